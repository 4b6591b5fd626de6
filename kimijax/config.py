"""The one configuration schema: every key a config may set, its default, its doc and its checks.

Each key is declared once in SCHEMA (kimijax.schema.Key: default, one line of doc, allowed values
or bounds); `base_config()` is the declared defaults, the config files in configs/ start from it,
and `load('configs/default.py:gqa', overrides)` runs one of them and validates it. `validate(config)`
checks every key against its declaration (unknown keys, types, allowed values, bounds), then the
rules between keys, section by section, and stops with one message naming the offending key.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from kimijax import schema
from kimijax.data.pipeline import DATA_KEYS
from kimijax.ops import (
  attention as attention_ops,
  attnres as attnres_ops,
  kda as kda_ops,
  mla_decode as mla_decode_ops,
  moe as moe_ops,
  short_conv as short_conv_ops,
)
from kimijax.schema import NON_NEGATIVE, POSITIVE, ConfigError, Key

# Letters accepted in model.layer_pattern: one letter per mixer sublayer kind.
LAYER_KINDS = {'A': 'full attention (model.attention_kind)', 'K': 'Kimi Delta Attention'}
# Each op module holds a mapping of the implementations it dispatches to; only built ones are listed.
ATTN_IMPLS = attention_ops.IMPLS
KDA_IMPLS = kda_ops.IMPLS
SHORT_CONV_IMPLS = short_conv_ops.IMPLS
ATTNRES_IMPLS = attnres_ops.IMPLS
MOE_IMPLS = moe_ops.IMPLS
MLA_DECODE_IMPLS = mla_decode_ops.IMPLS
# model.kernels key -> the parser of the settings of the Pallas kernels it overrides ('key=int/key=int'
# -> a frozen dataclass of kernels_pallas/<op>/settings.py), from the ops' 'pallas' implementations;
# model.kernels.moe is parsed by model.moe.impl's own parser instead (moe_settings)
KERNEL_SETTINGS = {
  'kda': KDA_IMPLS['pallas'].parse_settings,
  'short_conv': SHORT_CONV_IMPLS['pallas'].parse_settings,
  'attnres_phase1': ATTNRES_IMPLS['pallas'].parse_phase1_settings,
  'attnres_merge_norm': ATTNRES_IMPLS['pallas'].parse_merge_norm_settings,
  'mla_decode': MLA_DECODE_IMPLS['pallas'].parse_settings,
}
DTYPES = ('float32', 'bfloat16')
MLP_KINDS = ('dense', 'moe')
# The mesh axes, in the device order of the mesh; 'expert' is in the mesh only when mesh.expert > 1.
MESH_AXES = ('data', 'fsdp', 'tensor', 'expert')
# model.kda_recompute_projections: the KDA projections recomputed in the backward, in q, k, v order
RECOMPUTABLE_PROJECTIONS = ('', 'q', 'k', 'v', 'qk', 'qv', 'kv', 'qkv')

# Logical axis name -> mesh axes. Parameters use 'embed', 'heads', 'kv_heads', 'mlp', 'vocab';
# activations use the 'act_*' names so that e.g. the parameter embedding dim can be fsdp-sharded
# while the activation's embedding dim is replicated. The batch is split over 'expert' too, so that
# the devices of an expert group also carry tokens (docs/moe.md#expert-parallelism); rules naming
# an axis the mesh lacks (mesh.expert = 1) drop it (kimijax/parallel/mesh.py).
DEFAULT_RULES = (
  ('act_batch', ('data', 'fsdp', 'expert')),
  ('act_length', None),
  ('act_embed', None),
  ('act_heads', 'tensor'),
  ('act_mlp', 'tensor'),
  ('act_vocab', 'tensor'),
  ('embed', 'fsdp'),
  ('vocab', 'tensor'),
  ('heads', 'tensor'),
  ('kv_heads', 'tensor'),
  ('head_dim', None),
  ('mlp', 'tensor'),
  ('norm', None),
  ('conv_width', None),
  ('latent', None),
  ('expert', 'expert'),
)


def _layer_pattern(path: str, pattern: str) -> None:
  if not pattern:
    raise ConfigError(f'{path} is empty; use letters from {LAYER_KINDS}')
  for letter in expand_pattern(pattern):
    if letter not in LAYER_KINDS:
      raise ConfigError(f'{path}={pattern!r} has unknown letter {letter!r}; allowed letters: {LAYER_KINDS}')


def _kernel_settings(key: str) -> Callable[[str, str], None]:
  """The check of model.kernels.<key>: its 'key=int/key=int' text parses as that kernel family's settings."""

  def check(path: str, text: str) -> None:
    try:
      KERNEL_SETTINGS[key](text)
    except ValueError as e:
      raise ConfigError(f'{path}={text!r}: {e}') from None

  return check


def _mesh_size(path: str, size: int) -> None:
  if size == 0 or size < -1:
    raise ConfigError(f'{path}={size} must be a positive size or -1 (all remaining devices)')


def _mesh_rules(path: str, rules) -> None:
  for rule in rules:
    if len(rule) != 2:
      raise ConfigError(f'{path} entry {rule!r} must be (logical_name, mesh_axes)')
    axes = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
    for axis in axes:
      if axis is not None and axis not in MESH_AXES:
        raise ConfigError(f'{path} entry {rule!r} names mesh axis {axis!r}; allowed: {MESH_AXES}')


# Every key, declared once: Key(default, one line of doc, allowed= or bounds=). The defaults are a
# tiny attention LM on the stdlib corpus, CPU-sized.
SCHEMA = {
  'seed': Key(0, 'seeds the parameters and the data order'),
  'model': {
    'vocab_size': Key(
      258,
      "0: the tokenizer's vocabulary (data.tokenizer) padded to a multiple of 128, set by validation; "
      "else at least the tokenizer's",
      bounds=NON_NEGATIVE,
    ),
    'd_model': Key(256, 'width of the residual stream', bounds=POSITIVE),
    'num_layers': Key(4, 'mixer layers (each with its MLP)', bounds=POSITIVE),
    'num_heads': Key(4, 'attention heads; head_dim = d_model // num_heads', bounds=POSITIVE),
    'num_kv_heads': Key(0, "0: same as num_heads; < num_heads with attention_kind='gqa'", bounds=NON_NEGATIVE),
    'attention_kind': Key(
      'mha', 'the attention layers (A): multi-head, grouped-query or MLA', allowed=('mha', 'gqa', 'mla')
    ),
    'mlp_dim': Key(768, 'SwiGLU hidden width', bounds=POSITIVE),
    'mlp_kind': Key(
      'dense', "each layer's MLP: 'dense' SwiGLU or 'moe' (Mixture-of-Experts, model.moe.*)", allowed=MLP_KINDS
    ),
    'layer_pattern': Key(
      'A', "letters tiled to num_layers ('KKKA'), or a ratio 'K:A' ('3:1' = 'KKKA')", check=_layer_pattern
    ),
    'residual': Key(
      'standard',
      "'standard' (h + f(h)) or Attention Residuals (docs/attention_residuals.md)",
      allowed=('standard', 'attnres_full', 'attnres_block'),
    ),
    'attnres_block_size': Key(
      4,
      'attnres_block: sublayers per block (attention and MLP count one each; the last '
      'block takes the rest; 1 is Full AttnRes)',
      bounds=POSITIVE,
    ),
    'attnres_impl': Key(
      'xla',
      "AttnRes: 'pallas' runs the GPU kernels of kernels_pallas/attnres/ (phase 1, and "
      'phase 2 fused with the pre-norm; the default variant below only)',
      allowed=ATTNRES_IMPLS,
    ),
    'attnres_key_norm': Key(
      True,
      'AttnRes depth keys: RMSNorm(v_i) with a learned gain; False: the raw '
      'sources, no gain (the paper\'s "no key RMSNorm" ablation)',
    ),
    'attnres_depth_weights': Key(
      'softmax',
      'AttnRes weights over the sources: softmax over depth or '
      "'sigmoid' per source, not normalised (the paper's ablation)",
      allowed=attnres_ops.DEPTH_WEIGHTS,
    ),
    'position': Key('rope', 'positions of the attention layers: rotary or none', allowed=('rope', 'nope')),
    'rope_theta': Key(10000.0, 'RoPE base frequency', bounds=POSITIVE),
    'tie_embeddings': Key(True, 'the output head reuses the embedding matrix'),
    'attn_impl': Key(
      'xla',
      "'xla' runs everywhere; 'cudnn', 'tokamax' and 'gpu' (per call the faster of the two) "
      "need an NVIDIA GPU and compute_dtype='bfloat16' (kimijax/ops/attention.py)",
      allowed=ATTN_IMPLS,
    ),
    'kda_impl': Key(
      'xla',
      "KDA (kimijax/ops/kda.py): 'xla' the chunkwise form, 'xla_recurrent' the "
      "token scan (the reference), 'pallas' the fused kernels",
      allowed=KDA_IMPLS,
    ),
    'norm_eps': Key(1e-6, 'eps of the RMSNorms', bounds=POSITIVE),
    'init_std': Key(0.02, 'std of the normal initialisation of the matrices', bounds=POSITIVE),
    'compute_dtype': Key('bfloat16', 'params stay float32; norms, softmax and the loss run in float32', allowed=DTYPES),
    'residual_dtype': Key('float32', 'dtype of the residual stream between sublayers', allowed=DTYPES),
    'remat': Key(False, 'rematerialise each layer in the backward pass'),
    # Kimi Delta Attention layers ('K'; docs/kda.md)
    'kda_num_heads': Key(0, '0: num_heads', bounds=NON_NEGATIVE),
    'kda_head_dim': Key(0, '0: d_model // num_heads (key and value head dim)', bounds=NON_NEGATIVE),
    'kda_short_conv': Key(True, 'depthwise causal conv (kernel 4) + SiLU on q, k, v'),
    'short_conv_impl': Key(
      'xla',
      "the short conv: 'pallas' runs the fused conv kernels (kimijax/ops/short_conv.py)",
      allowed=SHORT_CONV_IMPLS,
    ),
    'kda_recompute_projections': Key(
      '',
      "KDA projections its backward recomputes instead of keeping ('qkv': all);"
      ' each saves 2 bytes per token and channel in bf16 for one more matmul',
      allowed=RECOMPUTABLE_PROJECTIONS,
    ),
    'kda_output_gate': Key('sigmoid', 'the KDA output gate (report Table 1)', allowed=('sigmoid', 'swish', 'none')),
    'kda_gate_lower_bound': Key(
      0.0, '0: -exp(A_log) softplus gate; in [-5, 0): bounded sigmoid gate', bounds='[-5, 0]'
    ),
    'kda_output_norm_eps': Key(
      1e-5, "eps of KDA's per-head output RMSNorm (Kimi Linear: its rms_norm_eps)", bounds=POSITIVE
    ),
    # Multi-head Latent Attention (attention_kind='mla')
    'mla_kv_lora_rank': Key(64, 'rank of the shared key-value latent', bounds=POSITIVE),
    'mla_q_lora_rank': Key(0, '0: full-rank queries', bounds=NON_NEGATIVE),
    'mla_qk_nope_head_dim': Key(0, '0: d_model // num_heads', bounds=NON_NEGATIVE),
    'mla_qk_rope_head_dim': Key(
      0, 'decoupled dims, a per-head query part and a key part shared by all heads; 0: none', bounds=NON_NEGATIVE
    ),
    'mla_rope': Key(True, 'rotate the decoupled dims with RoPE; False: unrotated, as Kimi Linear\'s MLA ("NoPE")'),
    'mla_latent_norm_eps': Key(
      1e-6, 'eps of the q and kv latent RMSNorms (1e-6 in Kimi Linear and DeepSeek-V3)', bounds=POSITIVE
    ),
    'mla_v_head_dim': Key(0, '0: the nope head dim', bounds=NON_NEGATIVE),
    'mla_decode_impl': Key(
      'xla',
      "MLA decoding over the cached latents (kimijax/ops/mla_decode.py): 'pallas' the split-context "
      'kernel (kernels_pallas/mla_decode/; an NVIDIA GPU, interpreted elsewhere)',
      allowed=MLA_DECODE_IMPLS,
    ),
    # YaRN's context extension of RoPE (docs/attention.md#yarn; DeepSeek-V3: 40, 4096, mscales 1)
    'yarn': {
      'factor': Key(0.0, 'context extension factor; 0: plain RoPE', bounds=NON_NEGATIVE),
      'original_context': Key(4096, 'the context the model was trained at before the extension', bounds=POSITIVE),
      'beta_fast': Key(
        32.0, 'frequencies turning more than this often in the original context are kept', bounds=POSITIVE
      ),
      'beta_slow': Key(1.0, 'frequencies turning less than this often are divided by factor', bounds=POSITIVE),
      'mscale': Key(
        0.0,
        'rotated dims x m(factor, mscale) / m(factor, mscale_all_dim) with both set, else x m(factor, 1); 0: unset',
        bounds=NON_NEGATIVE,
      ),
      'mscale_all_dim': Key(0.0, 'the softmax scale times m(factor, mscale_all_dim)^2; 0: unset', bounds=NON_NEGATIVE),
    },
    # Mixture-of-Experts MLPs (mlp_kind='moe'; docs/moe.md)
    'moe': {
      'num_experts': Key(8, 'routed experts per MoE layer', bounds=POSITIVE),
      'top_k': Key(2, 'routed experts per token', bounds=POSITIVE),
      'expert_hidden': Key(
        0, "each expert's SwiGLU width; 0: mlp_dim // (top_k + num_shared), the dense MLP's width", bounds=NON_NEGATIVE
      ),
      'num_shared': Key(1, 'shared experts: one SwiGLU of width expert_hidden * num_shared', bounds=NON_NEGATIVE),
      'score_func': Key('sigmoid', "router scores: 'sigmoid' as released, or 'softmax'", allowed=moe_ops.SCORE_FUNCS),
      'renormalize': Key(True, "divide the chosen experts' scores by their sum (as released)"),
      'scaling_factor': Key(1.0, 'routed scaling factor (2.446 Moonlight, Kimi Linear; 2.827 K2)', bounds=POSITIVE),
      'n_group': Key(1, 'expert groups for group-limited routing (1: off; DeepSeek-V3: 8)', bounds=POSITIVE),
      'topk_group': Key(1, 'groups a token may choose from (DeepSeek-V3: 4)', bounds=POSITIVE),
      'aux_loss_alpha': Key(0.0, 'sequence-wise balance loss weight (0: off; DeepSeek-V3: 1e-4)', bounds=NON_NEGATIVE),
      'bias_rate': Key(1e-3, 'balancing bias step: b += rate * sign(mean load - load) per step', bounds=NON_NEGATIVE),
      'bias_centred': Key(False, "Moonlight's centred bias update (keeps the mean bias at 0)"),
      'impl': Key(
        'xla_blocked',
        "the grouped matmul: 'xla_blocked' (padded blocks; the fastest on the CPU), 'xla' "
        '(lax.ragged_dot: the reference; on a GPU this XLA lowers it as a dense matmul over all experts), '
        "'tokamax' (Mosaic GPU; D and expert hidden multiples of 64), 'pallas' (padded tiles, "
        'Triton kernels of kernels_pallas/moe/, interpreted off the GPU; D and expert hidden multiples of 16) '
        "or 'mosaic' (the same tiles, Mosaic GPU kernels of kernels_pallas/moe/; the fastest on Hopper GPUs "
        "and the GPU configs' choice; bf16 or f16; D and expert hidden multiples of 64)",
        allowed=MOE_IMPLS,
      ),
      'remat': Key(
        False,
        'recompute the routed experts in the backward from their inputs instead of keeping their top_k rows '
        'per token (less memory for one more expert forward; model.remat recomputes whole layers)',
      ),
      'first_dense_layers': Key(1, 'first layers kept dense (as released; DeepSeek-V3: 3)', bounds=NON_NEGATIVE),
      'dense_hidden': Key(0, 'SwiGLU width of those dense layers; 0: model.mlp_dim', bounds=NON_NEGATIVE),
    },
    # Settings of the Pallas kernels, 'key=int/key=int' over their defaults ('': the defaults)
    'kernels': {
      'kda': Key('', 'KdaSettings (kernels_pallas/kda/settings.py)', check=_kernel_settings('kda')),
      'short_conv': Key(
        '', 'ShortConvSettings (kernels_pallas/short_conv/settings.py)', check=_kernel_settings('short_conv')
      ),
      'attnres_phase1': Key(
        '', 'Phase1Settings (kernels_pallas/attnres/settings.py)', check=_kernel_settings('attnres_phase1')
      ),
      'attnres_merge_norm': Key(
        '',
        'MergeNormSettings, AttnRes phase 2 fused with the pre-norm (kernels_pallas/attnres/settings.py)',
        check=_kernel_settings('attnres_merge_norm'),
      ),
      'mla_decode': Key(
        '', 'MlaDecodeSettings (kernels_pallas/mla_decode/settings.py)', check=_kernel_settings('mla_decode')
      ),
      'moe': Key(
        '',
        "the settings of model.moe.impl: MoeSettings for 'pallas', MosaicMoeSettings for 'mosaic' "
        '(kernels_pallas/moe/settings.py), '
        "BlockedSettings for 'xla_blocked' (kimijax/ops/moe.py); '' for an impl that takes none",
      ),
    },
  },
  'train': {
    'steps': Key(1000, 'optimizer steps', bounds=POSITIVE),
    'batch_size': Key(16, 'global, in sequences', bounds=POSITIVE),
    'seq_len': Key(256, 'tokens per sequence', bounds=POSITIVE),
    'log_every': Key(10, 'steps between metrics.jsonl lines', bounds=POSITIVE),
    'eval_every': Key(200, 'steps between evals', bounds=POSITIVE),
    'eval_batches': Key(8, 'validation batches per eval', bounds=POSITIVE),
    'checkpoint_every': Key(200, 'steps between checkpoints', bounds=POSITIVE),
    'keep_checkpoints': Key(3, 'checkpoints kept on disk', bounds=POSITIVE),
    'grad_clip': Key(1.0, 'global-norm clip; 0 disables', bounds=NON_NEGATIVE),
    'loss_chunk': Key(
      0,
      'tokens per chunk of the cross-entropy, logits recomputed in the backward; 0: all [B, T, V] at once',
      bounds=NON_NEGATIVE,
    ),
    'plot': Key(True, 'loss-curve PNG in the workdir at the end'),
    'log_attnres': Key(False, 'log per-sublayer depth-attention weights (AttnRes) and input/output RMS'),
    'log_max_logits': Key(
      True,
      "log each attention layer's per-head max logit (docs/attention.md); False: "
      "no max-logit work runs, unless QK-Clip (optimizer.name='muonclip') needs them",
    ),
    'preemption_grace_s': Key(
      25.0,
      'seconds from a stop signal (SIGTERM, SIGUSR1, Ctrl-C) to exit, for the step in progress and its '
      "checkpoint; under a scheduler's wait before SIGKILL (0: no limit)",
      bounds=NON_NEGATIVE,
    ),
    'check_memory': Key(True, "stop before compiling when the step's estimated memory exceeds the device's"),
    'print_routing': Key(False, "print Muon's routing table at start-up (always in DIR/optimizer_routing.txt)"),
    'init_from': Key(
      '',
      'a run folder (its latest checkpoint; the optimizer may differ) or a released checkpoint folder '
      '(docs/released.md) whose weights start a fresh run, and stand in for a checkpoint in '
      "--mode=eval / generate; '': random initialisation",
    ),
  },
  'optimizer': {
    'name': Key(
      'adamw',
      "'muon' (Moonlight) or 'muonclip' (muon + QK-Clip); docs/optimizers.md",
      allowed=('adamw', 'muon', 'muonclip'),
    ),
    'learning_rate': Key(3e-3, 'shared by AdamW and both sides of muon', bounds=POSITIVE),
    'weight_decay': Key(0.1, 'decoupled (x lr); muon decays every parameter, adamw only matrices', bounds=NON_NEGATIVE),
    'qk_clip_tau': Key(100.0, 'muonclip: logit cap tau', bounds=POSITIVE),
    'schedule': Key('cosine', 'after the warmup', allowed=('cosine', 'wsd', 'constant')),
    'warmup_steps': Key(50, 'linear warmup from 0', bounds=NON_NEGATIVE),
    'decay_fraction': Key(0.2, 'wsd: fraction of steps spent decaying at the end', bounds='[0, 1]'),
    'min_lr_ratio': Key(0.1, 'final lr = min_lr_ratio * learning_rate', bounds='[0, 1]'),
    'b1': Key(0.9, "AdamW beta1 (also muon's AdamW side)", bounds='[0, 1]'),
    'b2': Key(0.95, 'AdamW beta2', bounds='[0, 1]'),
    'eps': Key(1e-8, 'AdamW eps', bounds=POSITIVE),
    'momentum': Key(0.95, 'muon: M = momentum * M + G (Moonlight, no bias correction)', bounds='[0, 1)'),
    'nesterov': Key(True, 'muon: orthogonalise G + momentum * M instead of M'),
    'ns_steps': Key(5, 'muon: Newton-Schulz iterations', bounds=POSITIVE),
    'ns_dtype': Key('bfloat16', "muon: dtype of the Newton-Schulz matmuls ('float32' for exactness)", allowed=DTYPES),
    'rms_scale': Key(0.2, 'muon: update = rms_scale * sqrt(max(A, B)) * NS(N), AdamW-like RMS', bounds=POSITIVE),
    'muon_per_head': Key(False, 'muon: attention kernels as per-head matrices, not one [D, H*Dh]'),
    'muon_split_matrices': Key(True, 'muon: each device runs Newton-Schulz on its share of whole matrices'),
    'muon_mla_views': Key(
      'fused',
      "muon: MLA parts fused as DeepSeek-V3's q_b_proj, kv_a_proj_with_mqa, kv_b_proj "
      "(Moonlight) or 'per_part' (kimijax/optim/routing.py)",
      allowed=('fused', 'per_part'),
    ),
    'moe_router': Key('muon', "muon: MoE routers [D, E] on 'muon' (Moonlight) or 'adamw'", allowed=('muon', 'adamw')),
  },
  'data': DATA_KEYS,
  'mesh': {
    'data': Key(-1, 'data-parallel size; -1: all devices not used by the other axes', check=_mesh_size),
    'fsdp': Key(1, 'parameter-sharding size (-1: the remaining devices)', check=_mesh_size),
    'tensor': Key(1, 'tensor-parallel size (-1: the remaining devices)', check=_mesh_size),
    'expert': Key(1, 'expert-parallel size: MoE experts and the batch split over it (docs/moe.md)', bounds=POSITIVE),
    'rules': Key(DEFAULT_RULES, 'logical axis name -> mesh axes (DEFAULT_RULES)', check=_mesh_rules),
  },
}


def base_config() -> ml_collections.ConfigDict:
  """All keys with their declared defaults: a tiny attention LM on the stdlib corpus, CPU-sized."""
  return schema.defaults(SCHEMA)


def expand_pattern(pattern: str) -> str:
  """'KKKA' stays; a ratio '3:1' becomes 'KKKA' (KDA layers, then attention layers)."""
  if ':' not in pattern:
    return pattern
  parts = pattern.split(':')
  if len(parts) != 2 or not all(p.isdigit() for p in parts) or not int(parts[0]) + int(parts[1]):
    raise ConfigError(f"model.layer_pattern={pattern!r}: a ratio must be 'K:A' with non-negative integers, e.g. '3:1'")
  return 'K' * int(parts[0]) + 'A' * int(parts[1])


def layer_kinds(model: ml_collections.ConfigDict) -> str:
  """The per-layer mixer letters: layer_pattern tiled to num_layers ('A' x 4 -> 'AAAA')."""
  pattern = expand_pattern(model.layer_pattern)
  reps = -(-model.num_layers // len(pattern))
  return (pattern * reps)[: model.num_layers]


def kda_dims(model: ml_collections.ConfigDict) -> tuple[int, int]:
  """(heads, head dim) of the KDA layers; the head dim serves keys and values."""
  return model.kda_num_heads or model.num_heads, model.kda_head_dim or model.d_model // model.num_heads


def yarn(model: ml_collections.ConfigDict):
  """model.yarn as kimijax.layers.rope.Yarn, or None when its factor is 0 (plain RoPE)."""
  from kimijax.layers.rope import Yarn

  y = model.yarn
  if not y.factor:
    return None
  return Yarn(
    float(y.factor),
    int(y.original_context),
    float(y.beta_fast),
    float(y.beta_slow),
    float(y.mscale),
    float(y.mscale_all_dim),
  )


def mla_dims(model: ml_collections.ConfigDict) -> tuple[int, int, int]:
  """(no-position, decoupled, value) head dims of the MLA layers, their 0 defaults resolved."""
  nope = model.mla_qk_nope_head_dim or model.d_model // model.num_heads
  return nope, model.mla_qk_rope_head_dim, model.mla_v_head_dim or nope


def portable(model: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of the model config with XLA implementations of the same maths, which run at speed on
  any machine ('xla' attention, AttnRes, short convs and MLA decoding; 'xla' KDA unless
  'xla_recurrent'; 'xla_blocked' grouped matmuls unless 'xla'): the same parameters, so a GPU
  config's shapes and counts are traced, and a GPU run evaluates and generates, on a CPU."""
  model = model.copy_and_resolve_references()
  model.attn_impl, model.attnres_impl = 'xla', 'xla'
  if model.kda_impl not in ('xla', 'xla_recurrent'):
    model.kda_impl = 'xla'
  model.short_conv_impl = model.mla_decode_impl = 'xla'
  if model.moe.impl not in ('xla', 'xla_blocked'):
    model.moe.impl = 'xla_blocked'
  return model


def moe_layer(model: ml_collections.ConfigDict, index: int) -> bool:
  """Whether layer `index` has the MoE MLP (model.mlp_kind='moe', past model.moe.first_dense_layers)."""
  return model.mlp_kind == 'moe' and index >= model.moe.first_dense_layers


def moe_hidden(model: ml_collections.ConfigDict) -> tuple[int, int]:
  """(expert hidden F, SwiGLU width of the dense layers) with their 0 defaults resolved: F =
  mlp_dim // (top_k + num_shared), so that a token's routed + shared experts are as wide as the
  dense MLP, and the dense layers' width mlp_dim."""
  moe = model.moe
  return moe.expert_hidden or model.mlp_dim // (moe.top_k + moe.num_shared), moe.dense_hidden or model.mlp_dim


def moe_inactive_params(model: ml_collections.ConfigDict) -> int:
  """Parameters a token does not use: in each MoE layer the num_experts - top_k routed experts it
  is not sent to, 3 D F each (gate, up, down). 0 for a dense model. Active = total - this."""
  layers = sum(moe_layer(model, i) for i in range(model.num_layers))
  return layers * (model.moe.num_experts - model.moe.top_k) * 3 * model.d_model * moe_hidden(model)[0]


def kernel_settings(model: ml_collections.ConfigDict) -> dict:
  """model.kernels parsed: {key: the settings of its Pallas kernels} (KERNEL_SETTINGS; '' gives the
  defaults) and 'moe': model.moe.impl's settings (moe_settings), the values a model hands to its layers."""
  return {**{key: parse(model.kernels[key]) for key, parse in KERNEL_SETTINGS.items()}, 'moe': moe_settings(model)}


def moe_settings(model: ml_collections.ConfigDict):
  """model.kernels.moe parsed by model.moe.impl's parser (its settings, '' the defaults), or None for
  an impl that takes none; text the impl cannot take is a ConfigError naming both keys."""
  impl, text = model.moe.impl, model.kernels.moe
  parse = MOE_IMPLS[impl].parse_settings
  if parse is None:
    if text:
      raise ConfigError(f'model.kernels.moe={text!r}: model.moe.impl={impl!r} takes no settings; set it to ""')
    return None
  try:
    return parse(text)
  except ValueError as e:
    raise ConfigError(f'model.kernels.moe={text!r} (model.moe.impl={impl!r}): {e}') from None


def num_kv_heads(model: ml_collections.ConfigDict) -> int:
  return model.num_kv_heads or model.num_heads


def _model_rules(m: ml_collections.ConfigDict) -> None:
  if m.d_model % m.num_heads:
    raise ConfigError(f'model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}')
  if 0 < m.yarn.factor < 1:
    raise ConfigError(f'model.yarn.factor={m.yarn.factor} must be 0 (plain RoPE) or at least 1 (an extension)')
  rotates = m.mla_rope and m.mla_qk_rope_head_dim if m.attention_kind == 'mla' else m.position == 'rope'
  if m.yarn.factor and not ('A' in layer_kinds(m) and rotates):
    raise ConfigError(
      f'model.yarn.factor={m.yarn.factor} extends RoPE, but no layer of this model rotates its queries and keys '
      "(model.position='nope', or MLA with mla_rope=False or no decoupled dims, or no attention layer)"
    )
  if (m.d_model // m.num_heads) % 2 and m.position == 'rope':
    raise ConfigError(
      f"head_dim = model.d_model // model.num_heads = {m.d_model // m.num_heads} must be even for model.position='rope'"
    )
  kv = num_kv_heads(m)
  if m.attention_kind == 'mha' and kv != m.num_heads:
    raise ConfigError(
      f'model.num_kv_heads={m.num_kv_heads} differs from model.num_heads={m.num_heads}; '
      "set model.attention_kind='gqa' for grouped-query attention"
    )
  if m.num_heads % kv:
    raise ConfigError(f'model.num_kv_heads={kv} does not divide model.num_heads={m.num_heads}')
  if m.mla_qk_rope_head_dim % 2 and m.mla_rope:
    raise ConfigError(
      f'model.mla_qk_rope_head_dim={m.mla_qk_rope_head_dim} must be even (rotary pairs) with model.mla_rope=True'
    )
  if (
    m.residual != 'standard'
    and not ATTNRES_IMPLS[m.attnres_impl].all_variants
    and not attnres_ops.is_default_variant(m.attnres_key_norm, m.attnres_depth_weights)
  ):
    changed = [
      f'model.{k}={m[k]!r}'
      for k, default in (('attnres_key_norm', True), ('attnres_depth_weights', 'softmax'))
      if m[k] != default
    ]
    raise ConfigError(
      f"{' and '.join(changed)} need{'s' * (len(changed) == 1)} model.attnres_impl='xla': "
      f'model.attnres_impl={m.attnres_impl!r} implements only the softmax over '
      "RMS-normalised keys (model.attnres_key_norm=True, model.attnres_depth_weights='softmax')"
    )
  if m.residual != 'standard' and m.attnres_impl == 'pallas' and m.d_model % 16:
    raise ConfigError(f"model.attnres_impl='pallas' needs model.d_model divisible by 16; got {m.d_model}")
  head_dim = kda_dims(m)[1]
  for key in ('kda_impl', 'short_conv_impl'):
    if m[key] == 'pallas' and 'K' in layer_kinds(m) and (head_dim < 16 or head_dim & (head_dim - 1)):
      raise ConfigError(
        f"model.{key}='pallas' needs the KDA head dim (model.kda_head_dim, or d_model // "
        f'num_heads) a power of two >= 16; got {head_dim}'
      )
  if m.attention_kind == 'mla' and 'A' in layer_kinds(m):
    problem = MLA_DECODE_IMPLS[m.mla_decode_impl].dims_problem(m.mla_kv_lora_rank, m.mla_qk_rope_head_dim)
    if problem:
      raise ConfigError(
        f'model.mla_decode_impl={m.mla_decode_impl!r} {problem} (model.mla_kv_lora_rank, model.mla_qk_rope_head_dim)'
      )
  moe_settings(m)  # model.kernels.moe fits model.moe.impl, MoE layers or not
  _moe_rules(m)


def _moe_rules(m: ml_collections.ConfigDict) -> None:
  """The rules of model.moe, with model.mlp_kind='moe' only (a dense model ignores the group)."""
  if m.mlp_kind != 'moe':
    return
  moe = m.moe
  try:
    moe_ops.check_routing(
      num_experts=moe.num_experts,
      top_k=moe.top_k,
      n_group=moe.n_group,
      topk_group=moe.topk_group,
      score_func=moe.score_func,
      prefix='model.moe.',
    )
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if not moe.expert_hidden and m.mlp_dim % (moe.top_k + moe.num_shared):
    raise ConfigError(
      f'model.moe.expert_hidden=0 takes model.mlp_dim={m.mlp_dim} // (model.moe.top_k={moe.top_k} + '
      f'model.moe.num_shared={moe.num_shared}), which does not divide; set model.moe.expert_hidden'
    )
  if moe.first_dense_layers >= m.num_layers:
    raise ConfigError(
      f'model.moe.first_dense_layers={moe.first_dense_layers} leaves no MoE layer of '
      f"model.num_layers={m.num_layers}; lower it or set model.mlp_kind='dense'"
    )
  # The shape limits of the implementation (its platform is checked when training starts).
  problem = moe_ops.unsupported(moe.impl, m.compute_dtype, m.d_model, moe_hidden(m)[0], platform='gpu')
  if problem:
    raise ConfigError(problem.replace(f'moe impl={moe.impl!r}', f'model.moe.impl={moe.impl!r}'))


def _data_rules(d: ml_collections.ConfigDict) -> None:
  if d.source == 'text' and not d.path:
    raise ConfigError("data.path must name a text file or folder when data.source='text'")
  if d.source == 'shards' and not d.path:
    raise ConfigError("data.path must name the folder `python -m kimijax.data.prepare` wrote when data.source='shards'")


def _mesh_rules_between_axes(ms: ml_collections.ConfigDict) -> None:
  if sum(ms[a] == -1 for a in MESH_AXES) > 1:
    raise ConfigError('at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1')


def _document_mask_rules(config: ml_collections.ConfigDict) -> None:
  """data.document_mask needs an attention implementation that keeps packed documents apart."""
  m = config.model
  if config.data.document_mask and 'A' in layer_kinds(m) and not ATTN_IMPLS[m.attn_impl].segment_mask:
    raise ConfigError(
      f'model.attn_impl={m.attn_impl!r} has no document mask, which data.document_mask=True needs; '
      "use model.attn_impl='tokamax' or 'gpu' (which then runs tokamax) on a GPU, or 'xla'"
    )


def _resolve_vocab_size(config: ml_collections.ConfigDict) -> None:
  """model.vocab_size = 0 becomes the tokenizer's vocabulary padded to a multiple of 128; a size
  below a BPE tokenizer's is an error naming both (kimijax.data.tokenizer.config_vocab_size). The
  byte tokenizer's 258 is checked when training starts instead, so that model-only configs of a
  smaller vocabulary (the tests' tiny models) validate."""
  from kimijax.data.pipeline import tokenizer_spec
  from kimijax.data.sources import DataError
  from kimijax.data.tokenizer import config_vocab_size

  if config.model.vocab_size and tokenizer_spec(config) == 'byte':
    return
  try:
    vocab_size = config_vocab_size(config)
  except DataError as e:  # a tokenizer file that is missing or does not parse, or a vocab too small
    raise ConfigError(str(e)) from None
  if vocab_size != config.model.vocab_size:
    config.model.vocab_size = vocab_size


# The rules between keys, by section (train and optimizer have none: each of their keys stands alone).
RULES = {'model': _model_rules, 'data': _data_rules, 'mesh': _mesh_rules_between_axes}
# The rules across sections, after those.
CROSS_RULES = (_document_mask_rules, _resolve_vocab_size)


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every key against SCHEMA, then the rules between keys; raises ConfigError naming the
  first bad key. Resolves model.vocab_size = 0 to the tokenizer's (padded). Returns config."""
  schema.check(config, SCHEMA)
  for section, rules in RULES.items():
    rules(config[section])
  for rule in CROSS_RULES:
    rule(config)
  return config


# ----------------------------------------------------------------------------- config files


def apply_variants(
  config: ml_collections.ConfigDict, variants: Mapping[str, Callable[[Any], Any]], names: str | None
) -> ml_collections.ConfigDict:
  """config with the comma-separated variant `names` applied, in the order `variants` lists them
  (so that ':a,b' and ':b,a' are one config). A config file declares its variants as
  VARIANTS = {name: function that edits the config} and ends get_config with this call."""
  chosen = [n for n in (names or '').split(',') if n]
  for name in chosen:
    if name not in variants:
      raise ConfigError(f'unknown variant {name!r}; allowed: {", ".join(map(repr, variants))}')
  if len(set(chosen)) != len(chosen):
    raise ConfigError(f'variants {names!r} name one twice; give each once')
  for name, edit in variants.items():
    if name in chosen:
      edit(config)
  return config


def _find_file(path: str) -> pathlib.Path:
  """A config file by path: as given (absolute, or from the working directory), else from the
  repository root, so that 'configs/default.py' loads from any working directory."""
  candidates = [pathlib.Path(path)]
  if not candidates[0].is_absolute():
    candidates.append(pathlib.Path(__file__).resolve().parents[1] / path)
  for candidate in candidates:
    if candidate.is_file():
      return candidate
  raise ConfigError(f'config file {path!r} not found')


def _get_config(path: str, variants: str):
  """Runs the config file at path and returns its get_config(variants); any error of the file's
  own is one ConfigError naming the file."""
  file = _find_file(path)
  spec = importlib.util.spec_from_file_location(f'_kimijax_config_{file.stem}', file)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    if not hasattr(module, 'get_config'):
      raise ConfigError('defines no get_config()')
    return module.get_config(variants) if variants else module.get_config()
  except ConfigError as e:
    raise ConfigError(f'{path}: {e}') from None
  except Exception as e:  # a config file's own error: its message is what the user needs
    raise ConfigError(f'{path}: {type(e).__name__}: {e}') from e


def override(config: ml_collections.ConfigDict, path: str, value) -> None:
  """config['a.b.c'] = value for a key that exists; a string is parsed as the key's type (an int
  key takes '1e3'), an integral float becomes an int for an int key."""
  parts = path.split('.')
  node = config
  for i, part in enumerate(parts):
    where = repr('.'.join(parts[:i])) if i else 'the config'
    if not isinstance(node, ml_collections.ConfigDict):
      raise ConfigError(f'unknown config key {path!r}: {where} is a value, not a group')
    if part not in node:
      raise ConfigError(f'unknown config key {path!r}; known keys in {where}: {sorted(node.keys())}')
    parent, node = node, node[part]
  if isinstance(node, ml_collections.ConfigDict):
    raise ConfigError(f'config key {path!r} is a group; override its keys ({path}.KEY=VALUE)')
  if isinstance(value, str) and not isinstance(node, str):
    value = schema.parse_value(path, value, node)
  elif type(node) is int and isinstance(value, float) and value.is_integer():
    value = int(value)
  try:
    parent[parts[-1]] = value
  except TypeError:
    raise ConfigError(f'{path}={value!r} is not of the type of {path} ({type(node).__name__})') from None


def load_file(spec: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """load() without the validation, for config files of another kind (configs/ladder.py)."""
  path, _, variants = spec.partition(':')
  config = _get_config(path, variants)
  for key, value in (overrides or {}).items():
    override(config, key, value)
  return config


def load(spec: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """The validated config of a config file. spec: 'FILE[:VARIANT[,VARIANT...]]' (the variants the
  file's VARIANTS name), FILE found from the working directory or else the repository root;
  overrides: {'a.b': value}, a string parsed as the key's type as on the command line
  ({'train.steps': '1e3'}). Any mistake is one ConfigError naming the file, variant or key. The
  config comes locked: assigning a key that does not exist is an error."""
  return validate(load_file(spec, overrides)).lock()


def define_config_flag(
  name: str = 'config',
  default: str | None = None,
  help_string: str = 'config file, FILE[:VARIANT[,VARIANT]] (the variants: its VARIANTS).',
  flag_values=None,
) -> None:
  """Defines the absl flag --NAME=FILE[:VARIANT,...] and its --NAME.a.b=VALUE overrides, as run.py
  has them; `config_from_flags(NAME)` loads the config once the flags are parsed. The flag is
  listed by the program's --help (not only --helpfull)."""
  from absl import flags

  flag_values = flags.FLAGS if flag_values is None else flag_values
  flags.DEFINE_string(
    name, default, f'{help_string} Override any key with --{name}.KEY=VALUE.', flag_values=flag_values
  )
  flag_values.register_key_flag_for_module(sys.argv[0], flag_values[name])
  define_override_flags(name, flag_values)


def define_override_flags(name: str = 'config', flag_values=None) -> None:
  """Defines a string flag for each --NAME.a.b=VALUE on this command line (absl knows no flag
  patterns), for a program whose config comes from elsewhere (an ablation's own base config);
  `overrides_from_flags(NAME)` reads them back."""
  from absl import flags

  flag_values = flags.FLAGS if flag_values is None else flag_values
  for arg in sys.argv[1:]:
    if arg == '--':
      break
    match = re.match(rf'--{re.escape(name)}\.([\w.]+)(=|$)', arg)
    if match and f'{name}.{match.group(1)}' not in flag_values:
      flags.DEFINE_string(
        f'{name}.{match.group(1)}', None, f'override of config key {match.group(1)}', flag_values=flag_values
      )


def overrides_from_flags(name: str = 'config', flag_values=None) -> dict[str, str]:
  """{'a.b': 'VALUE'} of the parsed --NAME.a.b=VALUE flags (strings, parsed by `override`)."""
  from absl import flags

  flag_values = flags.FLAGS if flag_values is None else flag_values
  prefix = f'{name}.'
  return {
    flag[len(prefix) :]: flag_values[flag].value
    for flag in flag_values
    if flag.startswith(prefix) and flag_values[flag].present
  }


def config_from_flags(name: str = 'config', *, validate: bool = True, flag_values=None) -> ml_collections.ConfigDict:
  """The config of the parsed --NAME flag with its --NAME.a.b overrides: load(), or load_file()
  with validate=False. Call it inside the script's error handling: mistakes are ConfigErrors."""
  from absl import flags

  flag_values = flags.FLAGS if flag_values is None else flag_values
  spec = flag_values[name].value
  if not spec:
    raise ConfigError(f'--{name}=FILE[:VARIANT] is required')
  return (load if validate else load_file)(spec, overrides_from_flags(name, flag_values))
