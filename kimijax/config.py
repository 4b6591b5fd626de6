"""The one configuration schema: every key a config may set, its default, and its validation.

Config files in configs/ start from `base_config()` and override values; `validate(config)`
runs before any compute and stops with one message naming the offending key and the allowed
values. A key that is not in `base_config()` is an error, so typos never pass silently.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from kimijax.data.pipeline import SOURCES as DATA_SOURCES, default_data_config
from kimijax.ops import attention as attention_ops, attnres as attnres_ops, kda as kda_ops, short_conv as short_conv_ops

# Letters accepted in model.layer_pattern: one letter per mixer sublayer kind.
LAYER_KINDS = {'A': 'full attention (model.attention_kind)', 'K': 'Kimi Delta Attention'}
RESIDUALS = ('standard', 'attnres_full', 'attnres_block')   # SPEC §4; kimijax/layers/residual.py
OPTIMIZERS = ('adamw', 'muon', 'muonclip')   # kimijax/optim/factory.py
SCHEDULES = ('cosine', 'wsd', 'constant')
MLA_VIEWS = ('fused', 'per_part')   # muon's MLA matrices; kimijax/optim/routing.py
# model.kda_recompute_projections: the KDA projections recomputed in the backward, in q, k, v order
RECOMPUTABLE_PROJECTIONS = ('', 'q', 'k', 'v', 'qk', 'qv', 'kv', 'qkv')
# Each op module holds a mapping of the implementations it dispatches to; only built ones are listed.
ATTN_IMPLS = attention_ops.IMPLS
KDA_IMPLS = kda_ops.IMPLS
SHORT_CONV_IMPLS = short_conv_ops.IMPLS
ATTNRES_IMPLS = attnres_ops.IMPLS
ATTNRES_DEPTH_WEIGHTS = attnres_ops.DEPTH_WEIGHTS   # SPEC §4 and its sigmoid ablation
# model.kernels key -> the parser of the settings of the Pallas kernels it overrides ('key=int/key=int'
# -> a frozen dataclass of kernels_pallas/<op>/settings.py), from the ops' 'pallas' implementations
KERNEL_SETTINGS = {
    'kda': KDA_IMPLS['pallas'].parse_settings,
    'short_conv': SHORT_CONV_IMPLS['pallas'].parse_settings,
    'attnres_phase1': ATTNRES_IMPLS['pallas'].parse_phase1_settings,
    'attnres_merge_norm': ATTNRES_IMPLS['pallas'].parse_merge_norm_settings,
}
ATTENTION_KINDS = ('mha', 'gqa', 'mla')
KDA_OUTPUT_GATES = ('sigmoid', 'swish', 'none')
POSITIONS = ('rope', 'nope')
DTYPES = ('float32', 'bfloat16')
MESH_AXES = ('data', 'fsdp', 'tensor')

# Logical axis name -> mesh axes. Parameters use 'embed', 'heads', 'kv_heads', 'mlp', 'vocab';
# activations use the 'act_*' names so that e.g. the parameter embedding dim can be fsdp-sharded
# while the activation's embedding dim is replicated.
DEFAULT_RULES = (
    ('act_batch', ('data', 'fsdp')),
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
)


def base_config() -> ml_collections.ConfigDict:
  """All keys with their defaults: a tiny attention LM on the stdlib corpus, CPU-sized."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 258            # >= the tokenizer's vocabulary (bytes + EOS + PAD)
  m.d_model = 256
  m.num_layers = 4
  m.num_heads = 4               # head_dim = d_model // num_heads
  m.num_kv_heads = 0            # 0: same as num_heads; < num_heads with attention_kind='gqa'
  m.attention_kind = 'mha'
  m.mlp_dim = 768               # SwiGLU hidden width
  m.layer_pattern = 'A'         # letters tiled to num_layers ('KKKA'), or a ratio 'K:A' ('3:1' = 'KKKA')
  m.residual = 'standard'       # 'standard' (h + f(h)) | 'attnres_full' | 'attnres_block' (SPEC §4)
  m.attnres_block_size = 4      # attnres_block: sublayers per block (attention and MLP count one each);
                                # the last block takes the rest when it does not divide 2 * num_layers
  m.attnres_impl = 'xla'        # AttnRes: 'xla' | 'pallas' (GPU kernels in kernels_pallas/attnres/: phase 1,
                                # and phase 2 fused with the pre-norm; the default variant below only)
  m.attnres_key_norm = True     # AttnRes depth keys: True: RMSNorm(v_i) with a learned gain (SPEC §4);
                                # False: the raw sources v_i, no gain (the paper's "no key RMSNorm" ablation)
  m.attnres_depth_weights = 'softmax'  # AttnRes weights over sources: 'softmax' over depth (SPEC §4) |
                                # 'sigmoid': sigmoid(logit) per source, not normalised (the paper's ablation).
                                # Maths of both switches: kimijax/ops/attnres.py; a non-default one needs 'xla'
  m.position = 'rope'
  m.rope_theta = 10000.0
  m.tie_embeddings = True
  m.attn_impl = 'xla'           # kimijax.ops.attention.IMPLS: 'xla' (runs everywhere) | 'cudnn' (cuDNN flash
                                # attention + a max-logit kernel) | 'tokamax' (tokamax's Mosaic GPU flash
                                # attention, max logits from its residuals, MLA's value dim unpadded;
                                # SPEC §5) | 'gpu' (per call the faster of the two: tokamax with max
                                # logits or MLA's value dim, else cuDNN); the GPU ones need an NVIDIA
                                # GPU and compute_dtype='bfloat16'
  m.kda_impl = 'xla'            # kimijax.ops.kda.IMPLS: 'xla' (the chunkwise form) | 'xla_recurrent' (the
                                # token-by-token scan, the reference) | 'pallas' (the fused kernels)
  m.norm_eps = 1e-6
  m.init_std = 0.02
  m.compute_dtype = 'bfloat16'  # params stay float32; norms, softmax and the loss run in float32
  m.residual_dtype = 'float32'  # dtype of the residual stream between sublayers
  m.remat = False               # rematerialise each layer in the backward pass
  # Kimi Delta Attention layers ('K'; SPEC §1)
  m.kda_num_heads = 0           # 0: num_heads
  m.kda_head_dim = 0            # 0: d_model // num_heads (key and value head dim)
  m.kda_short_conv = True       # depthwise causal conv (kernel 4) + SiLU on q, k, v
  m.short_conv_impl = 'xla'     # KDA's short convs, kimijax.ops.short_conv.IMPLS: 'xla' | 'pallas' (the fused
                                # conv kernels)
  m.kda_recompute_projections = ''  # which of KDA's q/k/v projections its backward recomputes instead
                                # of keeping: '' none, 'qkv' all; each one recomputed is 2 bytes per
                                # token and channel less in bf16 and one [D, H*K] matmul more
  m.kda_output_gate = 'sigmoid' # 'sigmoid' | 'swish' | 'none' (report Table 1)
  m.kda_gate_lower_bound = 0.0  # 0: -exp(A_log) softplus gate; in [-5, 0): bounded sigmoid gate
  m.kda_output_norm_eps = 1e-5  # eps of KDA's per-head output RMSNorm (Kimi Linear: its rms_norm_eps)
  # Multi-head Latent Attention (attention_kind='mla')
  m.mla_kv_lora_rank = 64
  m.mla_q_lora_rank = 0         # 0: full-rank queries
  m.mla_qk_nope_head_dim = 0    # 0: d_model // num_heads
  m.mla_qk_rope_head_dim = 0    # decoupled dims: a per-head query part and a key part shared by all heads;
                                # 0: none (NoPE without decoupled dims)
  m.mla_rope = True             # rotate the decoupled dims with RoPE; False: keep them unrotated, as Kimi
                                # Linear's released MLA ("NoPE", 64 decoupled dims) does
  m.mla_latent_norm_eps = 1e-6  # eps of the q and kv latent RMSNorms (1e-6 in Kimi Linear and DeepSeek-V3)
  m.mla_v_head_dim = 0          # 0: the nope head dim
  # Settings of the Pallas kernels over their measured defaults, 'key=int/key=int' ('' = the defaults;
  # the keys are the fields of kernels_pallas/<op>/settings.py): used where the impl is 'pallas'
  m.kernels = k = ml_collections.ConfigDict()
  k.kda = ''                    # KdaSettings (kernels_pallas/kda/settings.py), e.g. 'flat_branch=0'
  k.short_conv = ''             # ShortConvSettings (kernels_pallas/short_conv/settings.py)
  k.attnres_phase1 = ''         # Phase1Settings (kernels_pallas/attnres/settings.py)
  k.attnres_merge_norm = ''     # MergeNormSettings (kernels_pallas/attnres/settings.py)

  c.train = t = ml_collections.ConfigDict()
  t.steps = 1000
  t.batch_size = 16             # global, in sequences
  t.seq_len = 256
  t.log_every = 10
  t.eval_every = 200
  t.eval_batches = 8
  t.checkpoint_every = 200
  t.keep_checkpoints = 3
  t.grad_clip = 1.0             # global-norm clip; 0 disables
  t.plot = True                 # loss-curve PNG in the workdir at the end
  t.log_attnres = False         # log per-sublayer depth-attention weights (AttnRes) and input/output RMS
  t.log_max_logits = True       # compute and log each attention layer's per-head max logit (SPEC §3);
                                # False: no max-logit work runs, unless QK-Clip (optimizer.name='muonclip')
                                # needs them, and then they are still logged (already computed, a few floats)

  c.optimizer = o = ml_collections.ConfigDict()
  o.name = 'adamw'              # 'adamw' | 'muon' (Moonlight, SPEC §2) | 'muonclip' (muon + QK-Clip, SPEC §3)
  o.learning_rate = 3e-3        # shared by AdamW and both sides of muon
  o.weight_decay = 0.1          # decoupled (x lr); muon decays every parameter, adamw only matrices
  o.qk_clip_tau = 100.0         # muonclip: logit cap tau
  o.schedule = 'cosine'
  o.warmup_steps = 50
  o.decay_fraction = 0.2        # wsd: fraction of steps spent decaying at the end
  o.min_lr_ratio = 0.1          # final lr = min_lr_ratio * learning_rate
  o.b1 = 0.9                    # AdamW betas and eps (also muon's AdamW side)
  o.b2 = 0.95
  o.eps = 1e-8
  o.momentum = 0.95             # muon: M = momentum * M + G (Moonlight, no bias correction)
  o.nesterov = True             # muon: orthogonalise G + momentum * M instead of M
  o.ns_steps = 5                # muon: Newton-Schulz iterations
  o.ns_dtype = 'bfloat16'       # muon: dtype of the Newton-Schulz matmuls ('float32' for exactness)
  o.rms_scale = 0.2             # muon: update = rms_scale * sqrt(max(A, B)) * NS(N), AdamW-like RMS
  o.muon_per_head = False       # muon: attention kernels as per-head matrices, not one [D, H*Dh]
  o.muon_split_matrices = True  # muon: each device runs Newton-Schulz on its share of whole matrices
  o.muon_mla_views = 'fused'    # muon: 'fused' MLA parts as DeepSeek-V3's q_b_proj, kv_a_proj_with_mqa,
                                # kv_b_proj (Moonlight) | 'per_part' (each parameter its own matrix)

  c.data = default_data_config()   # source, path, val_fraction, mqar_num_pairs

  c.mesh = ms = ml_collections.ConfigDict()
  ms.data = -1                  # -1: all devices not used by the other axes
  ms.fsdp = 1
  ms.tensor = 1
  ms.rules = DEFAULT_RULES
  return c


class ConfigError(ValueError):
  """A config value or key that cannot be used; the message names the key."""


def _check_keys(config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict, prefix: str):
  for key in config.keys():
    path = f'{prefix}{key}'
    if key not in schema:
      raise ConfigError(f'unknown config key {path!r}; known keys here: {sorted(schema.keys())}')
    if isinstance(schema[key], ml_collections.ConfigDict):
      if not isinstance(config[key], ml_collections.ConfigDict):
        raise ConfigError(f'config key {path!r} must be a group with keys {sorted(schema[key].keys())}')
      _check_keys(config[key], schema[key], path + '.')
  for key in schema.keys():
    if key not in config:
      raise ConfigError(f'config key {prefix}{key!r} is missing; start configs from kimijax.config.base_config()')


def _one_of(path: str, value: Any, allowed) -> None:
  if value not in allowed:
    raise ConfigError(f'{path}={value!r} is not allowed; allowed values: {list(allowed)}')


def _positive(path: str, value, *, zero_ok: bool = False) -> None:
  if value < 0 or (value == 0 and not zero_ok):
    raise ConfigError(f'{path}={value!r} must be {"non-negative" if zero_ok else "positive"}')


def expand_pattern(pattern: str) -> str:
  """'KKKA' stays; a ratio '3:1' becomes 'KKKA' (KDA layers, then attention layers)."""
  if ':' not in pattern:
    return pattern
  parts = pattern.split(':')
  if len(parts) != 2 or not all(p.isdigit() for p in parts) or not int(parts[0]) + int(parts[1]):
    raise ConfigError(f"model.layer_pattern={pattern!r}: a ratio must be 'K:A' with non-negative "
                      "integers, e.g. '3:1'")
  return 'K' * int(parts[0]) + 'A' * int(parts[1])


def layer_kinds(model: ml_collections.ConfigDict) -> str:
  """The per-layer mixer letters: layer_pattern tiled to num_layers ('A' x 4 -> 'AAAA')."""
  pattern = expand_pattern(model.layer_pattern)
  reps = -(-model.num_layers // len(pattern))
  return (pattern * reps)[: model.num_layers]


def kda_dims(model: ml_collections.ConfigDict) -> tuple[int, int]:
  """(heads, head dim) of the KDA layers; the head dim serves keys and values."""
  return model.kda_num_heads or model.num_heads, model.kda_head_dim or model.d_model // model.num_heads


def portable(model: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of the model config with the implementations that run on any machine ('xla' attention
  and AttnRes, 'xla' KDA unless 'xla_recurrent', 'xla' short convs): same parameters, so shapes and
  counts of a GPU config can be traced on a CPU."""
  model = model.copy_and_resolve_references()
  model.attn_impl, model.attnres_impl = 'xla', 'xla'
  if model.kda_impl not in ('xla', 'xla_recurrent'):
    model.kda_impl = 'xla'
  model.short_conv_impl = 'xla'
  return model


def kernel_settings(model: ml_collections.ConfigDict) -> dict:
  """model.kernels parsed: {key: the settings of its Pallas kernels} (KERNEL_SETTINGS; '' gives the
  defaults), the values a model hands to its layers."""
  return {key: parse(model.kernels[key]) for key, parse in KERNEL_SETTINGS.items()}


def num_kv_heads(model: ml_collections.ConfigDict) -> int:
  return model.num_kv_heads or model.num_heads


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every key and value; raises ConfigError naming the first bad one. Returns config."""
  _check_keys(config, base_config(), '')
  m, t, o, d, ms = config.model, config.train, config.optimizer, config.data, config.mesh

  for key in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'mlp_dim'):
    _positive(f'model.{key}', m[key])
  _positive('model.num_kv_heads', m.num_kv_heads, zero_ok=True)
  if m.d_model % m.num_heads:
    raise ConfigError(f'model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}')
  if (m.d_model // m.num_heads) % 2 and m.position == 'rope':
    raise ConfigError(f'head_dim = model.d_model // model.num_heads = {m.d_model // m.num_heads} '
                      'must be even for model.position=\'rope\'')
  _one_of('model.attention_kind', m.attention_kind, ATTENTION_KINDS)
  kv = num_kv_heads(m)
  if m.attention_kind == 'mha' and kv != m.num_heads:
    raise ConfigError(f'model.num_kv_heads={m.num_kv_heads} differs from model.num_heads={m.num_heads}; '
                      "set model.attention_kind='gqa' for grouped-query attention")
  if m.num_heads % kv:
    raise ConfigError(f'model.num_kv_heads={kv} does not divide model.num_heads={m.num_heads}')
  if not m.layer_pattern:
    raise ConfigError(f'model.layer_pattern is empty; use letters from {LAYER_KINDS}')
  for letter in expand_pattern(m.layer_pattern):
    if letter not in LAYER_KINDS:
      raise ConfigError(f'model.layer_pattern={m.layer_pattern!r} has unknown letter {letter!r}; '
                        f'allowed letters: {LAYER_KINDS}')
  _one_of('model.residual', m.residual, RESIDUALS)
  _one_of('model.kda_output_gate', m.kda_output_gate, KDA_OUTPUT_GATES)
  if not -5.0 <= m.kda_gate_lower_bound <= 0.0:
    raise ConfigError(f'model.kda_gate_lower_bound={m.kda_gate_lower_bound!r} must lie in [-5, 0] (0: unbounded gate)')
  for key in ('kda_num_heads', 'kda_head_dim', 'mla_q_lora_rank', 'mla_qk_nope_head_dim',
              'mla_qk_rope_head_dim', 'mla_v_head_dim'):
    _positive(f'model.{key}', m[key], zero_ok=True)
  _positive('model.mla_kv_lora_rank', m.mla_kv_lora_rank)
  if m.mla_qk_rope_head_dim % 2 and m.mla_rope:
    raise ConfigError(f'model.mla_qk_rope_head_dim={m.mla_qk_rope_head_dim} must be even (rotary pairs) '
                      'with model.mla_rope=True')
  if not isinstance(m.attnres_block_size, int) or m.attnres_block_size < 1:
    raise ConfigError(f'model.attnres_block_size={m.attnres_block_size!r} must be a positive integer '
                      '(sublayers per block; 1 is Full AttnRes)')
  _one_of('model.attnres_impl', m.attnres_impl, ATTNRES_IMPLS)
  if not isinstance(m.attnres_key_norm, bool):
    raise ConfigError(f'model.attnres_key_norm={m.attnres_key_norm!r} is not allowed; allowed values: '
                      '[True, False]')
  _one_of('model.attnres_depth_weights', m.attnres_depth_weights, ATTNRES_DEPTH_WEIGHTS)
  if (m.residual != 'standard' and not ATTNRES_IMPLS[m.attnres_impl].all_variants
      and not attnres_ops.is_default_variant(m.attnres_key_norm, m.attnres_depth_weights)):
    changed = [f'model.{k}={m[k]!r}' for k, default in (('attnres_key_norm', True),
                                                         ('attnres_depth_weights', 'softmax'))
               if m[k] != default]
    raise ConfigError(f"{' and '.join(changed)} need{'s' * (len(changed) == 1)} model.attnres_impl='xla': "
                      f"model.attnres_impl={m.attnres_impl!r} implements only SPEC §4's softmax over "
                      "RMS-normalised keys (model.attnres_key_norm=True, model.attnres_depth_weights='softmax')")
  if m.residual != 'standard' and m.attnres_impl == 'pallas' and m.d_model % 16:
    raise ConfigError(f"model.attnres_impl='pallas' needs model.d_model divisible by 16; got {m.d_model}")
  _one_of('model.position', m.position, POSITIONS)
  _one_of('model.attn_impl', m.attn_impl, ATTN_IMPLS)
  _one_of('model.kda_impl', m.kda_impl, KDA_IMPLS)
  _one_of('model.short_conv_impl', m.short_conv_impl, SHORT_CONV_IMPLS)
  for key, parse in KERNEL_SETTINGS.items():
    text = m.kernels[key]
    if not isinstance(text, str):
      raise ConfigError(f"model.kernels.{key}={text!r} must be a string 'key=int/key=int' ('' for the defaults)")
    try:
      parse(text)
    except ValueError as e:
      raise ConfigError(f'model.kernels.{key}={text!r}: {e}') from None
  head_dim = kda_dims(m)[1]
  for key in ('kda_impl', 'short_conv_impl'):
    if m[key] == 'pallas' and 'K' in layer_kinds(m) and (head_dim < 16 or head_dim & (head_dim - 1)):
      raise ConfigError(f"model.{key}='pallas' needs the KDA head dim (model.kda_head_dim, or d_model // "
                        f"num_heads) a power of two >= 16; got {head_dim}")
  _one_of('model.compute_dtype', m.compute_dtype, DTYPES)
  _one_of('model.residual_dtype', m.residual_dtype, DTYPES)
  _positive('model.norm_eps', m.norm_eps)
  _positive('model.mla_latent_norm_eps', m.mla_latent_norm_eps)
  _positive('model.kda_output_norm_eps', m.kda_output_norm_eps)
  _one_of('model.mla_rope', m.mla_rope, (True, False))
  _one_of('model.kda_recompute_projections', m.kda_recompute_projections, RECOMPUTABLE_PROJECTIONS)
  _positive('model.init_std', m.init_std)
  _positive('model.rope_theta', m.rope_theta)

  for key in ('steps', 'batch_size', 'seq_len', 'log_every', 'eval_every', 'eval_batches',
              'checkpoint_every', 'keep_checkpoints'):
    _positive(f'train.{key}', t[key])
  _positive('train.grad_clip', t.grad_clip, zero_ok=True)
  for key in ('log_attnres', 'log_max_logits'):
    _one_of(f'train.{key}', t[key], (True, False))

  _one_of('optimizer.name', o.name, OPTIMIZERS)
  _one_of('optimizer.schedule', o.schedule, SCHEDULES)
  _positive('optimizer.learning_rate', o.learning_rate)
  _positive('optimizer.weight_decay', o.weight_decay, zero_ok=True)
  _positive('optimizer.qk_clip_tau', o.qk_clip_tau)
  _positive('optimizer.warmup_steps', o.warmup_steps, zero_ok=True)
  _positive('optimizer.eps', o.eps)
  if not 0.0 <= o.momentum < 1.0:
    raise ConfigError(f'optimizer.momentum={o.momentum!r} must lie in [0, 1)')
  _positive('optimizer.ns_steps', o.ns_steps)
  _one_of('optimizer.ns_dtype', o.ns_dtype, DTYPES)
  _one_of('optimizer.muon_mla_views', o.muon_mla_views, MLA_VIEWS)
  _positive('optimizer.rms_scale', o.rms_scale)
  for key in ('nesterov', 'muon_per_head', 'muon_split_matrices'):
    _one_of(f'optimizer.{key}', o[key], (True, False))
  for key in ('b1', 'b2', 'decay_fraction', 'min_lr_ratio'):
    if not 0.0 <= o[key] <= 1.0:
      raise ConfigError(f'optimizer.{key}={o[key]!r} must lie in [0, 1]')

  _one_of('data.source', d.source, DATA_SOURCES)
  if d.source == 'text' and not d.path:
    raise ConfigError("data.path must name a text file or folder when data.source='text'")
  if not 0.0 < d.val_fraction < 1.0:
    raise ConfigError(f'data.val_fraction={d.val_fraction!r} must lie in (0, 1)')
  _positive('data.mqar_num_pairs', d.mqar_num_pairs)

  for axis in MESH_AXES:
    if ms[axis] == 0 or ms[axis] < -1:
      raise ConfigError(f'mesh.{axis}={ms[axis]} must be a positive size or -1 (all remaining devices)')
  if sum(ms[a] == -1 for a in MESH_AXES) > 1:
    raise ConfigError('at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1')
  for rule in ms.rules:
    if len(rule) != 2:
      raise ConfigError(f'mesh.rules entry {rule!r} must be (logical_name, mesh_axes)')
    axes = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
    for axis in axes:
      if axis is not None and axis not in MESH_AXES:
        raise ConfigError(f'mesh.rules entry {rule!r} names mesh axis {axis!r}; allowed: {MESH_AXES}')
  return config


def unknown_override(argv: list[str]) -> str | None:
  """The message for a --config.a.b=v whose key is not in the schema, else None. ml_collections
  would fail inside flag parsing with a bare AttributeError naming neither the key nor the
  allowed ones."""
  for arg in argv[1:]:
    if arg == '--':
      break
    if not arg.startswith('--config.'):
      continue
    path = arg[len('--config.'):].split('=', 1)[0]
    node, parent = base_config(), 'config'
    for part in path.split('.'):
      if not isinstance(node, ml_collections.ConfigDict):
        return f'ConfigError: unknown config key {path!r} (from {arg}): {parent!r} is a value, not a group'
      if part not in node:
        return (f'ConfigError: unknown config key {path!r} (from {arg}); '
                f'allowed keys in {parent!r}: {sorted(node.keys())}')
      node, parent = node[part], part if parent == 'config' else f'{parent}.{part}'
  return None
