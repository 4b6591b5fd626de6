"""A released checkpoint's config.json as kimijax model keys (docs/released.md).

    overrides = model_overrides(read_config('/data/Kimi-Linear-48B-A3B-Instruct'))
    # {'model.d_model': 2304, 'model.layer_pattern': 'KKKA...', 'model.moe.num_experts': 256, ...}

Two families, by config.json's model_type:
- 'kimi_linear' (Kimi Linear): KDA layers and NoPE MLA layers as `linear_attn_config` lists them
  (1-indexed kda_layers / full_attn_layers), sigmoid-routed MoE MLPs after the first dense layers;
- 'deepseek_v3' (DeepSeek-V3, Moonlight-16B-A3B, Kimi K2): MLA with RoPE on its decoupled dims
  (YaRN-extended as rope_scaling says), the same MoE with group-limited routing.

Every key that changes the maths is read; a value kimijax does not implement (RoPE scaling other
than YaRN, biases on the projections, an activation other than SiLU, ...) is one HfError naming the
key and value, before any weight is read. Keys that only concern serving (token ids, torch dtype)
are ignored.
"""

from __future__ import annotations

import json
import pathlib

from kimijax.hf.safetensors import HfError

# config.json's model_type -> the layout it is read in (Kimi K2's folders name DeepSeek-V3's layout 'kimi_k2')
FAMILIES = {'kimi_linear': 'kimi_linear', 'deepseek_v3': 'deepseek_v3', 'kimi_k2': 'deepseek_v3'}
CONV_WIDTH = 4  # kimijax.layers.kda.CONV_WIDTH, the released short conv's kernel size
# The latent RMSNorms of MLA (q_a_layernorm, kv_a_layernorm) are built without the config's eps
# in both families' modeling code, so they take the norm's default.
LATENT_NORM_EPS = 1e-6


def read_config(folder: str | pathlib.Path) -> dict:
  """config.json of a released checkpoint folder."""
  path = pathlib.Path(folder) / 'config.json'
  if not pathlib.Path(folder).is_dir():
    raise HfError(f'{folder}: no such folder (a released checkpoint: config.json and *.safetensors)')
  try:
    config = json.loads(path.read_text())
  except FileNotFoundError:
    raise HfError(f'{path}: missing (a released checkpoint folder holds config.json)') from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise HfError(f'{path}: not readable JSON ({e})') from None
  if config.get('model_type') not in FAMILIES:
    raise HfError(f'{path}: model_type {config.get("model_type")!r} is not one kimijax reads ({", ".join(FAMILIES)})')
  return config


def family(config: dict) -> str:
  """The layout of a config.json: 'kimi_linear' or 'deepseek_v3'."""
  return FAMILIES[config['model_type']]


def moe_names(layout: str) -> tuple[str, tuple[str, str, str]]:
  """(the MoE block's prefix in a layer, the expert's gate, up and down projection names) of a layout."""
  if layout == 'kimi_linear':
    return 'block_sparse_moe.', ('w1', 'w3', 'w2')
  return 'mlp.', ('gate_proj', 'up_proj', 'down_proj')


def rope_interleaved(config: dict) -> bool:
  """Whether the checkpoint lays each rotated pair of dims side by side (DeepSeek-V3's layout)."""
  return family(config) == 'deepseek_v3' and config.get('rope_interleave', True)


def _require(config: dict, key: str, allowed, default=None) -> None:
  value = config.get(key, default)
  if value not in allowed:
    raise HfError(f'config.json: {key}={value!r} is not supported by kimijax (supported: {allowed})')


def layer_letters(config: dict) -> str:
  """The mixer of each layer as kimijax's layer_pattern letters ('K' KDA, 'A' MLA)."""
  n = config['num_hidden_layers']
  if family(config) == 'deepseek_v3':
    return 'A' * n
  if config.get('layer_types'):
    kinds = {'linear_attention': 'K', 'full_attention': 'A'}
    if len(config['layer_types']) != n or any(t not in kinds for t in config['layer_types']):
      raise HfError(f'config.json: layer_types={config["layer_types"]} is not {n} of {sorted(kinds)}')
    return ''.join(kinds[t] for t in config['layer_types'])
  linear = config.get('linear_attn_config') or {}
  kda, full = linear.get('kda_layers'), linear.get('full_attn_layers')
  if kda is None or full is None:
    raise HfError('config.json: linear_attn_config needs kda_layers and full_attn_layers (1-indexed layer lists)')
  if sorted(kda + full) != list(range(1, n + 1)):
    raise HfError(
      f'config.json: linear_attn_config kda_layers={kda} and full_attn_layers={full} do not name layers '
      f'1..{n} once each'
    )
  return ''.join('K' if i + 1 in kda else 'A' for i in range(n))


def model_overrides(config: dict) -> dict:
  """{'model.KEY': value} that make kimijax's model the released one of `config` (config.json)."""
  try:
    return _overrides(config)
  except KeyError as e:
    raise HfError(f'config.json: the key {e} is missing (the {family(config)} layout needs it)') from None
  except (TypeError, ValueError) as e:
    raise HfError(f'config.json: a value does not have the expected type ({e})') from None


def _overrides(config: dict) -> dict:
  _require(config, 'hidden_act', ('silu',), 'silu')
  _require(config, 'attention_bias', (False,), False)
  heads = config['num_attention_heads']
  if config.get('num_key_value_heads', heads) != heads:
    raise HfError(f'config.json: num_key_value_heads={config["num_key_value_heads"]} must equal num_attention_heads')
  letters = layer_letters(config)
  out = {
    'model.vocab_size': config['vocab_size'],
    'model.d_model': config['hidden_size'],
    'model.num_layers': config['num_hidden_layers'],
    'model.layer_pattern': letters,
    'model.residual': 'standard',
    'model.norm_eps': float(config['rms_norm_eps']),
    'model.tie_embeddings': bool(config.get('tie_word_embeddings', False)),
    'model.mlp_dim': config['intermediate_size'],
    'model.num_heads': heads,
    'model.attention_kind': 'mla',
    'model.mla_kv_lora_rank': config['kv_lora_rank'],
    'model.mla_q_lora_rank': config.get('q_lora_rank') or 0,
    'model.mla_qk_nope_head_dim': config['qk_nope_head_dim'],
    'model.mla_qk_rope_head_dim': config['qk_rope_head_dim'],
    'model.mla_v_head_dim': config['v_head_dim'],
    'model.mla_latent_norm_eps': LATENT_NORM_EPS,
    'model.rope_theta': float(config.get('rope_theta') or (config.get('rope_parameters') or {}).get('rope_theta', 1e4)),
  }
  if family(config) == 'kimi_linear':
    _require(config, 'moe_router_activation_func', ('sigmoid',), 'sigmoid')
    out['model.mla_rope'] = False  # Kimi Linear's MLA is NoPE; its decoupled dims stay unrotated
    linear = config.get('linear_attn_config') or {}
    if 'K' in letters:
      width = linear.get('short_conv_kernel_size', config.get('linear_conv_kernel_dim', CONV_WIDTH))
      if width != CONV_WIDTH:
        raise HfError(f'config.json: short_conv_kernel_size={width}; kimijax short convs have {CONV_WIDTH} taps')
      out.update(
        {
          'model.kda_num_heads': linear.get('num_heads', config.get('linear_num_heads')),
          'model.kda_head_dim': linear.get('head_dim', config.get('linear_head_dim')),
          'model.kda_short_conv': True,
          'model.kda_output_gate': 'sigmoid',
          'model.kda_gate_lower_bound': 0.0,
          'model.kda_output_norm_eps': float(config['rms_norm_eps']),
        }
      )
  else:
    out['model.mla_rope'] = True
    _require(config, 'topk_method', ('noaux_tc',), 'noaux_tc')  # sigmoid scores, bias for choosing, top-2 group scores
  out.update(_moe_overrides(config))
  out.update(_yarn_overrides(config))
  return out


def _yarn_overrides(config: dict) -> dict:
  """model.yarn.* from rope_scaling (or transformers' rope_parameters) of type 'yarn'; {} for plain RoPE."""
  params = config.get('rope_scaling') or {}
  if not params and (config.get('rope_parameters') or {}).get('rope_type', 'default') != 'default':
    params = config['rope_parameters']
  if not params:
    return {}
  kind = params.get('rope_type', params.get('type'))
  if kind == 'default':
    return {}
  if kind != 'yarn':
    raise HfError(f"config.json: rope_scaling of type {kind!r} is not supported by kimijax (supported: 'yarn')")
  if params.get('attention_factor') is not None or params.get('truncate', True) is not True:
    raise HfError(f'config.json: rope_scaling={params} sets attention_factor or truncate, which kimijax does not read')
  # transformers takes the model's max_position_embeddings where the original context is not given
  original = int(params.get('original_max_position_embeddings') or config['max_position_embeddings'])
  return {
    'model.yarn.factor': float(params.get('factor') or config['max_position_embeddings'] / original),
    'model.yarn.original_context': original,
    'model.yarn.beta_fast': float(params.get('beta_fast') or 32.0),
    'model.yarn.beta_slow': float(params.get('beta_slow') or 1.0),
    'model.yarn.mscale': float(params.get('mscale') or 0.0),
    'model.yarn.mscale_all_dim': float(params.get('mscale_all_dim') or 0.0),
  }


def _moe_overrides(config: dict) -> dict:
  experts = config.get('n_routed_experts') or config.get('num_experts') or config.get('num_local_experts') or 0
  if not experts:
    return {'model.mlp_kind': 'dense'}
  _require(config, 'scoring_func', ('sigmoid',), 'sigmoid')  # noaux_tc routing, and Kimi's router, score by sigmoid
  _require(config, 'moe_layer_freq', (1,), 1)
  top_k = config.get('num_experts_per_tok') or config.get('num_experts_per_token')
  dense = config.get('first_k_dense_replace', 1)
  if 'mlp_layer_types' in config and config['mlp_layer_types']:
    types = config['mlp_layer_types']
    dense = sum(1 for t in types if t == 'dense')
    if types != ['dense'] * dense + ['sparse'] * (len(types) - dense):
      raise HfError(f'config.json: mlp_layer_types={types}; kimijax keeps dense layers first only')
  return {
    'model.mlp_kind': 'moe',
    'model.moe.num_experts': experts,
    'model.moe.top_k': top_k,
    'model.moe.num_shared': config.get('n_shared_experts') or config.get('num_shared_experts') or 0,
    'model.moe.expert_hidden': config['moe_intermediate_size'],
    'model.moe.score_func': 'sigmoid',
    'model.moe.renormalize': bool(config.get('norm_topk_prob', config.get('moe_renormalize', True))),
    'model.moe.scaling_factor': float(config.get('routed_scaling_factor', 1.0)),
    'model.moe.n_group': config.get('n_group') or config.get('num_expert_group') or 1,
    'model.moe.topk_group': config.get('topk_group') or 1,
    'model.moe.first_dense_layers': dense,
    'model.moe.dense_hidden': 0,
  }
