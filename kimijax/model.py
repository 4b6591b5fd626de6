"""Decoder-only language model: embed -> layers by model.layer_pattern -> final norm -> head.

Each layer is two pre-norm sublayers, a sequence mixer (the pattern letter: 'A' attention) and
an MLP, a SwiGLU or, with model.mlp_kind='moe' past model.moe.first_dense_layers, a
Mixture-of-Experts (kimijax/layers/moe.py, docs/moe.md); sublayer l computes y_l =
F_l(Norm_l(h_l)). How h_l is formed from the embedding and the earlier outputs is the residual
strategy `model.residual` (kimijax/layers/residual.py):
'standard' (h_{l+1} = h_l + y_l), 'attnres_full' or 'attnres_block' (Attention Residuals,
docs/attention_residuals.md; then a final depth-attention aggregator feeds the final norm).

    model = Transformer(config.model)
    params = kimijax.init_params(config, rng)  # plain arrays (model.init's are in logical-axis boxes)
    logits_btv, aux = model.apply({'params': params}, tokens_bt)
    # packed documents kept apart (data.document_mask): the batch's positions and segment ids
    logits_btv, aux = model.apply({'params': params}, tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt)

A model with MoE layers also has the variable collection 'moe_state' (the balancing biases, kept
beside the params by the train state) and every apply passes it:
`model.apply({'params': params, 'moe_state': moe_state}, tokens_bt)` (`variables(params,
moe_state)` builds that dict; a dense model has no 'moe_state'). The train step makes 'moe_stats'
mutable to collect each MoE layer's router statistics (kimijax/layers/moe.py).

`aux['max_logits']` is {'layer_<i>': [H] fp32} for each attention layer: its per-head max
scaled logit over the batch (docs/optimizers.md#qk-clip), for logging and QK-Clip. With
`Transformer(cfg, max_logits=False)` nothing computes them and aux has no 'max_logits'
(kimijax.train.step.computes_max_logits decides it from the config).

With `Transformer(cfg, log_attnres=True)`, `aux['attnres']` also holds, averaged over batch and
tokens (consumers: sublayers 0 .. L-1 in order, then the final aggregator):
  'input_rms'  [L + 1]  RMS of each consumer's input h_l (before its pre-norm)
  'output_rms' [L]      RMS of each sublayer's output y_l
  'weights'    [L + 1, S] (AttnRes only) depth-attention weights; column j is source j (the
               embedding, then sublayer outputs or block sums in order; a block's running partial
               sum takes its block's column), NaN where consumer l has no source j.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from kimijax import config as config_lib
from kimijax.layers import residual as residual_lib
from kimijax.layers.attention import SelfAttention
from kimijax.layers.kda import KimiDeltaAttention
from kimijax.layers.mla import MultiHeadLatentAttention
from kimijax.layers.mlp import SwiGLU
from kimijax.layers.moe import MOE_STATE, MoE
from kimijax.layers.norms import RMSNorm
from kimijax.ops.segments import tokens_since_start


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cotangent_in(x, dtype):
  """Identity whose cotangent is cast to `dtype`: the float32 logits' gradient then flows back
  through the head matmul in the compute dtype (bf16 GEMMs) instead of float32 GEMMs."""
  return x


def _cotangent_in_fwd(x, dtype):
  return x, None


def _cotangent_in_bwd(dtype, _, g):
  return (g.astype(dtype),)


cotangent_in.defvjp(_cotangent_in_fwd, _cotangent_in_bwd)


def head_logits(x_xd, head_dv, dtype, axes):
  """Logits [..., V] float32 of final hidden states x [..., D] and the head [D, V]: the matmul in
  `dtype` (the compute dtype) with a float32 result, its cotangent cast back to `dtype`
  (cotangent_in), constrained to the logical axes `axes`. The model's head and the chunked loss
  (kimijax/train/loss.py) both compute their logits here."""
  logits = jnp.einsum('...d,dv->...v', x_xd, head_dv.astype(dtype), preferred_element_type=jnp.float32)
  return nn.with_logical_constraint(cotangent_in(logits, dtype), axes)


def make_mixer(
  cfg: ml_collections.ConfigDict, kind: str, dtype, max_logits: bool = True, kernels: dict | None = None
) -> nn.Module:
  """The sequence mixer of a model.layer_pattern letter. Called as mixer(x_btd, positions_bt, cache,
  segment_ids_bt) it returns (y_btd, max_logits [H] fp32 or None, new cache or None). max_logits is
  None for mixers without softmax logits (KDA), when decoding and when `max_logits` is False; the
  cache (kimijax/infer/cache.py) is None in training; segment_ids_bt [B, T] (packed documents kept
  apart) or None. kernels: model.kernels parsed (config_lib.kernel_settings; None: parsed here)."""
  if kind == 'K':
    kernels = config_lib.kernel_settings(cfg) if kernels is None else kernels
    heads, head_dim = config_lib.kda_dims(cfg)
    return KimiDeltaAttention(
      num_heads=heads,
      head_dim=head_dim,
      impl=cfg.kda_impl,
      short_conv=cfg.kda_short_conv,
      output_gate=cfg.kda_output_gate,
      gate_lower_bound=cfg.kda_gate_lower_bound,
      init_std=cfg.init_std,
      dtype=dtype,
      output_norm_eps=cfg.kda_output_norm_eps,
      short_conv_impl=cfg.short_conv_impl,
      recompute_projections=cfg.kda_recompute_projections,
      settings=kernels['kda'],
      short_conv_settings=kernels['short_conv'],
      name='kda',
    )
  if kind == 'A' and cfg.attention_kind == 'mla':
    kernels = config_lib.kernel_settings(cfg) if kernels is None else kernels
    return MultiHeadLatentAttention(
      num_heads=cfg.num_heads,
      kv_lora_rank=cfg.mla_kv_lora_rank,
      qk_nope_head_dim=config_lib.mla_dims(cfg)[0],
      qk_rope_head_dim=cfg.mla_qk_rope_head_dim,
      v_head_dim=cfg.mla_v_head_dim,
      q_lora_rank=cfg.mla_q_lora_rank,
      rope_theta=cfg.rope_theta,
      impl=cfg.attn_impl,
      norm_eps=cfg.mla_latent_norm_eps,
      init_std=cfg.init_std,
      dtype=dtype,
      rope=cfg.mla_rope,
      max_logits=max_logits,
      decode_impl=cfg.mla_decode_impl,
      decode_settings=kernels['mla_decode'],
      yarn=config_lib.yarn(cfg),
      name='mla',
    )
  if kind == 'A':
    return SelfAttention(
      num_heads=cfg.num_heads,
      num_kv_heads=config_lib.num_kv_heads(cfg),
      rope=cfg.position == 'rope',
      rope_theta=cfg.rope_theta,
      impl=cfg.attn_impl,
      init_std=cfg.init_std,
      dtype=dtype,
      max_logits=max_logits,
      yarn=config_lib.yarn(cfg),
      name='attention',
    )
  raise ValueError(f'unknown layer kind {kind!r}')


def make_mlp(cfg: ml_collections.ConfigDict, index: int, dtype, kernels: dict | None = None) -> nn.Module:
  """The MLP of layer `index`: the MoE layer where config_lib.moe_layer says so, else the dense
  SwiGLU (of width model.moe.dense_hidden in an MoE model, model.mlp_dim otherwise). kernels:
  model.kernels parsed (config_lib.kernel_settings; None: parsed here)."""
  if not config_lib.moe_layer(cfg, index):
    hidden = config_lib.moe_hidden(cfg)[1] if cfg.mlp_kind == 'moe' else cfg.mlp_dim
    return SwiGLU(hidden=hidden, init_std=cfg.init_std, dtype=dtype, name='mlp')
  kernels = config_lib.kernel_settings(cfg) if kernels is None else kernels
  moe = cfg.moe
  return MoE(
    num_experts=moe.num_experts,
    top_k=moe.top_k,
    expert_hidden=config_lib.moe_hidden(cfg)[0],
    num_shared=moe.num_shared,
    score_func=moe.score_func,
    renormalize=moe.renormalize,
    scaling_factor=moe.scaling_factor,
    n_group=moe.n_group,
    topk_group=moe.topk_group,
    aux_loss_alpha=moe.aux_loss_alpha,
    init_std=cfg.init_std,
    dtype=dtype,
    impl=moe.impl,
    settings=kernels['moe'],
    remat=moe.remat,
    name='mlp',
  )


class Layer(nn.Module):
  """Layer `index`: sublayers 2*index (mixer) and 2*index + 1 (MLP: SwiGLU or MoE, make_mlp). Each reads its input
  h from the residual state, applies F(Norm(h)) and writes its output back; the strategy
  (model.residual) is all in `residual_lib`, so mixers never see it.

  (state, positions [B, T], cache, segment ids [B, T] or None) -> (state, max logits [H] of an
  attention mixer or None, per-sublayer statistics when `log` else None, the mixer's new cache or
  None). kernels: the Pallas kernels' settings, model.kernels parsed (config_lib.kernel_settings)."""

  cfg: ml_collections.ConfigDict
  kind: str
  index: int
  log: bool = False
  max_logits: bool = True
  kernels: dict | None = None

  @nn.compact
  def __call__(self, state, positions_bt, cache=None, segment_ids_bt=None):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.compute_dtype)
    res = residual_lib.make_residual(cfg, log=self.log, kernels=self.kernels)
    stats = {'weights': [], 'input_rms': [], 'output_rms': []}

    def sublayer(state, offset: int, name: str, fn):
      norm = RMSNorm(eps=cfg.norm_eps, dtype=dtype, name=f'{name}_norm')
      x_btd, h_btd, w_n, state = res.read(state, 2 * self.index + offset, norm)
      y_btd, extra = fn(x_btd)
      if self.log:
        stats['weights'].append(w_n)
        stats['input_rms'].append(residual_lib.rms(h_btd))
        stats['output_rms'].append(residual_lib.rms(y_btd))
      return res.write(state, y_btd, 2 * self.index + offset), extra

    mixer = make_mixer(cfg, self.kind, dtype, self.max_logits, self.kernels)

    def run_mixer(x_btd):
      y_btd, max_logits_h, new_cache = mixer(x_btd, positions_bt, cache, segment_ids_bt)
      return y_btd, (max_logits_h, new_cache)

    state, (max_logits_h, new_cache) = sublayer(state, 0, 'mixer', run_mixer)
    mlp = make_mlp(cfg, self.index, dtype, self.kernels)
    state, _ = sublayer(state, 1, 'mlp', lambda x: (mlp(x), None))
    return state, max_logits_h, (stats if self.log else None), new_cache


class Transformer(nn.Module):
  """tokens [B, T] int32 -> (logits [B, T, V] fp32, aux).

  With `cache` (kimijax.infer.cache.init_cache) the call is a prefill (T tokens from position 0)
  or a decode step (T = 1 at positions_bt), and aux['cache'] holds the updated caches. With
  `segment_ids_bt` [B, T] (training on packed documents, data.document_mask, positions_bt then
  restarting at each document: kimijax/data/documents.py) no token sees another document:
  attention is masked, KDA's state and the short convolutions restart (kimijax/ops/segments.py).
  Without (None, the default) the model is the unmasked one, unchanged.

  With `return_hidden=True` the head is not applied: the call returns ((the final normed hidden
  states x [B, T, D] in model.compute_dtype, the head matrix [D, V] float32: the embedding's
  transpose when model.tie_embeddings), aux), logits = x @ head as this model computes them; the
  chunked loss (kimijax/train/loss.py) takes them. Parameters and aux are the same."""

  cfg: ml_collections.ConfigDict
  log_attnres: bool = False  # add aux['attnres'] (per-sublayer depth weights and RMS)
  max_logits: bool = True  # compute aux['max_logits'] (False: no max-logit work at all)
  return_hidden: bool = False  # return (hidden states, head matrix) instead of the logits

  @nn.compact
  def __call__(self, tokens_bt, positions_bt=None, cache=None, segment_ids_bt=None):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.compute_dtype)
    if positions_bt is None and segment_ids_bt is not None:  # each document's from its first token
      positions_bt = tokens_since_start(segment_ids_bt)
    elif positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    embed = self.param(
      'embed',
      nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ('vocab', 'embed')),
      (cfg.vocab_size, cfg.d_model),
      jnp.float32,
    )
    # The Pallas kernels' settings (model.kernels), parsed once and handed to the layers as values.
    kernels = config_lib.kernel_settings(cfg)
    # The residual stream is kept in residual_dtype (default float32); sublayers compute in `dtype`.
    res = residual_lib.make_residual(cfg, log=self.log_attnres, kernels=kernels)
    state = res.start(jnp.take(embed, tokens_bt, axis=0).astype(cfg.residual_dtype))

    # Remat per layer: the residual state (h, or the AttnRes sources) is the saved carry.
    layer_cls = nn.remat(Layer, prevent_cse=True) if cfg.remat else Layer
    max_logits, stats, new_cache = {}, [], {}
    for i, kind in enumerate(config_lib.layer_kinds(cfg)):
      name = f'layer_{i}'
      layer = layer_cls(
        cfg=cfg, kind=kind, index=i, log=self.log_attnres, max_logits=self.max_logits, kernels=kernels, name=name
      )
      state, m, s, new_cache[name] = layer(state, positions_bt, None if cache is None else cache[name], segment_ids_bt)
      stats.append(s)
      if m is not None:
        max_logits[f'layer_{i}'] = m
    # The final norm's input (AttnRes: the final aggregator's).
    x_btd, h_btd, w_n, _ = res.read(
      state, residual_lib.num_sublayers(cfg), RMSNorm(eps=cfg.norm_eps, dtype=dtype, name='final_norm')
    )
    if cfg.tie_embeddings:
      head_dv = embed.T
    else:
      head_dv = self.param(
        'head',
        nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), ('embed', 'vocab')),
        (cfg.d_model, cfg.vocab_size),
        jnp.float32,
      )
    aux = {'max_logits': max_logits} if self.max_logits else {}
    if cache is not None:
      aux['cache'] = new_cache
    if self.log_attnres:
      aux['attnres'] = _collect_stats(cfg, stats, w_n, residual_lib.rms(h_btd))
    if self.return_hidden:
      return (x_btd, head_dv), aux
    return head_logits(x_btd, head_dv, dtype, ('act_batch', 'act_length', 'act_vocab')), aux


def _collect_stats(cfg, layer_stats, final_w_n, final_rms):
  """Per-layer statistics -> aux['attnres'] (see the module docstring): weight rows padded
  with NaN to the most sources any consumer sees."""
  out = {
    'input_rms': jnp.stack([r for s in layer_stats for r in s['input_rms']] + [final_rms]),
    'output_rms': jnp.stack([r for s in layer_stats for r in s['output_rms']]),
  }
  if cfg.residual != 'standard':
    width = residual_lib.num_sources(cfg)
    rows = [w for s in layer_stats for w in s['weights']] + [final_w_n]
    out['weights'] = jnp.stack([jnp.pad(w, (0, width - w.shape[0]), constant_values=jnp.nan) for w in rows])
  return out


def document_inputs(batch) -> dict:
  """The model's keyword inputs from a batch that carries packed documents' segment_ids and
  positions (data.document_mask: kimijax/data/pipeline.py), else {}: model.apply(variables,
  batch['inputs'], **document_inputs(batch))."""
  if 'segment_ids' not in batch:
    return {}
  return {'positions_bt': batch['positions'], 'segment_ids_bt': batch['segment_ids']}


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def variables(params, moe_state=None) -> dict:
  """The variables of Transformer.apply: {'params': params}, with {'moe_state': moe_state} when the
  model has MoE layers (moe_state non-empty)."""
  return {'params': params, MOE_STATE: moe_state} if moe_state else {'params': params}


def as_variables(params_or_variables) -> dict:
  """What evaluation and generation take for a model's weights, as the variables of apply: the
  params tree alone (a dense model), or a variables dict {'params': ..., 'moe_state': ...} (a
  model with MoE layers, whose balancing biases choose the experts), returned as it is."""
  tree = params_or_variables
  return tree if isinstance(tree, dict) and 'params' in tree else {'params': tree}


def inference_variables(params, moe_state=None):
  """The weights evaluation and generation take (as_variables reads them back): the params tree
  alone for a dense model, as before, or the variables dict with the MoE biases."""
  return variables(params, moe_state) if moe_state else params


def inference_params(tree, dtype: str):
  """Parameters (arrays, or ShapeDtypeStructs with their shardings) as evaluation and generation
  may hold them: every array of ndim >= 2 in `dtype` (the weight matrices, and arrays such as
  dt_bias [H, K] and the conv taps), the vectors (norm gains, A_log) kept float32. 'bfloat16'
  halves their memory; each such array is cast to the compute dtype where it is used, or promoted
  back to float32 exactly, so with model.compute_dtype='bfloat16' the logits are bitwise those of
  the float32 parameters rounded to bfloat16 (tests/test_model.py)."""
  dtype = jnp.dtype(dtype)

  def low(x):
    if x.ndim < 2 or x.dtype == dtype:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)

  return jax.tree.map(low, tree)


def parameter_counts(cfg: ml_collections.ConfigDict) -> dict[str, int]:
  """{part: parameters} of Transformer(cfg) from shapes alone (nothing is allocated): the
  embedding, the head, each mixer kind, the MLPs, the norm gains, AttnRes, and 'total'. With MoE
  layers the MLPs split into the dense layers' 'mlp', 'moe router', 'moe routed experts' and
  'moe shared experts', and 'active' follows 'total': the parameters one token uses (top_k of the
  routed experts; config_lib.moe_inactive_params). Traced with the portable implementations (same
  parameters), so a GPU config counts on any machine."""
  cfg = config_lib.portable(cfg)
  shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  counts: dict[str, int] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(nn.unbox(shapes['params']))[0]:
    names = [str(getattr(k, 'key', k)) for k in path]
    if names[0] in ('embed', 'head', 'attnres'):
      part = {'embed': 'embedding', 'head': 'head', 'attnres': 'attnres'}[names[0]]
    elif names[0] == 'final_norm' or (len(names) > 1 and names[1].endswith('_norm')):
      part = 'norms'  # the sublayers' pre-norms and the final norm
    elif len(names) > 1 and names[1] in ('attention', 'mla', 'kda'):
      part = {'attention': 'attention layers', 'mla': 'mla layers', 'kda': 'kda layers'}[names[1]]
    elif len(names) > 2 and names[1] == 'mlp' and config_lib.moe_layer(cfg, int(names[0].removeprefix('layer_'))):
      part = {'router': 'moe router', 'shared': 'moe shared experts'}.get(names[2], 'moe routed experts')
    elif len(names) > 1 and names[1] == 'mlp':
      part = 'mlp'
    else:
      part = 'other'
    counts[part] = counts.get(part, 0) + leaf.size
  counts['total'] = sum(counts.values())
  if cfg.mlp_kind == 'moe':
    counts['active'] = counts['total'] - config_lib.moe_inactive_params(cfg)
  return counts
