"""A kimijax model's parameters as a checkpoint folder in the released Hugging Face layout: the
inverse of kimijax.hf.weights, so that transformers (or any tool that reads the released models)
loads a model trained or fine-tuned here (docs/released.md).

    export_folder(out, config, params, moe_state)            # config: the run's whole config

The layout:
- a run started from a released folder (train.init_from names one) is written as that folder: its
  config.json, tokenizer and other files are copied, and each tensor keeps its name and dtype;
- any other run becomes a 'kimi_linear' folder when it has KDA layers or NoPE MLA, else a
  'deepseek_v3' one (MLA with RoPE on its decoupled dims), with a config.json written from the
  model keys and the tensors in bfloat16 (the routers' correction bias in float32), or `dtype`.
Either way the written config.json is read back through kimijax.hf.config and must give the run's
model in every key that changes the maths; a model the family cannot express (standard attention,
Attention Residuals, a KDA without its short convs, ...) is one HfError naming the key, before
anything is written.

The tensors go one layer per file (model-00001-of-0000N.safetensors, the embeddings, final norm
and head last) with model.safetensors.index.json, so one layer is in host memory at a time. The
folder is written under OUT.partial, renamed to OUT when complete and removed on failure; an
existing OUT or OUT.partial is refused.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable

import jax
import ml_collections
import ml_dtypes
import numpy as np
from flax import traverse_util

from kimijax import config as config_lib
from kimijax.hf.config import CONV_WIDTH, family, model_overrides, moe_names, read_config, rope_interleaved
from kimijax.hf.safetensors import HfError, SafetensorsFolder, write_file

Get = Callable[[tuple], np.ndarray]  # a parameter path -> its float32 value
EXPORT_DTYPES = {'bfloat16': ml_dtypes.bfloat16, 'float32': np.float32}
BIAS = 'e_score_correction_bias'


def _heads_to_linear(kernel: np.ndarray) -> np.ndarray:
  """Kernel [D, H, K] -> Linear weight [H * K, D] (kimijax.hf.weights reads the other way)."""
  return kernel.transpose(1, 2, 0).reshape(-1, kernel.shape[0])


def _halves_to_interleaved(d: int) -> np.ndarray:
  """Column order taking kimijax's rotary halves back to adjacent pairs (the inverse of the
  reader's evens-then-odds order)."""
  return np.argsort(np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)]))


def _mla(get: Get, prefix: str, m: ml_collections.ConfigDict, interleaved: bool) -> dict[str, Callable]:
  dr = m.mla_qk_rope_head_dim
  order = _halves_to_interleaved(dr) if interleaved else np.arange(dr)

  def q():
    nope = get(('q_nope',))
    rope = get(('q_rope',))[..., order] if dr else nope[..., :0]
    return _heads_to_linear(np.concatenate([nope, rope], -1))

  def kv_a():
    rope = get(('k_rope',))[:, order].T if dr else np.zeros((0, m.d_model), np.float32)
    return np.concatenate([get(('kv_down',)).T, rope], 0)

  out = {
    'kv_a_proj_with_mqa.weight': kv_a,
    'kv_a_layernorm.weight': lambda: get(('kv_norm', 'scale')),
    'kv_b_proj.weight': lambda: _heads_to_linear(np.concatenate([get(('k_nope',)), get(('v',))], -1)),
    'o_proj.weight': lambda: get(('out',)).reshape(-1, m.d_model).T,
  }
  if m.mla_q_lora_rank:
    out['q_a_proj.weight'] = lambda: get(('q_down',)).T
    out['q_a_layernorm.weight'] = lambda: get(('q_norm', 'scale'))
    out['q_b_proj.weight'] = q
  else:
    out['q_proj.weight'] = q
  return {prefix + name: build for name, build in out.items()}


def _kda(get: Get, prefix: str, m: ml_collections.ConfigDict) -> dict[str, Callable]:
  h, k = config_lib.kda_dims(m)
  low_rank_b = lambda path: lambda: get(path).transpose(1, 2, 0).reshape(h * k, -1)  # [rank, H, K] -> [H K, rank]
  out = {
    'b_proj.weight': lambda: get(('b_proj',)).T,
    'A_log': lambda: get(('A_log',)).reshape(1, 1, h, 1),
    'dt_bias': lambda: get(('dt_bias',)).reshape(h * k),
    'f_a_proj.weight': lambda: get(('f_a',)).T,
    'f_b_proj.weight': low_rank_b(('f_b',)),
    'g_a_proj.weight': lambda: get(('g_a',)).T,
    'g_b_proj.weight': low_rank_b(('g_b',)),
    'o_norm.weight': lambda: get(('o_norm',)),
    'o_proj.weight': lambda: get(('o_proj',)).reshape(h * k, -1).T,
  }
  for n in 'qkv':
    out[f'{n}_proj.weight'] = lambda n=n: _heads_to_linear(get((f'{n}_proj',)))
    out[f'{n}_conv1d.weight'] = lambda n=n: get((f'{n}_conv', 'kernel')).reshape(CONV_WIDTH, h * k).T[:, None, :]
  return {prefix + name: build for name, build in out.items()}


def _swiglu(get: Get, prefix: str, names=('gate_proj', 'up_proj', 'down_proj')) -> dict[str, Callable]:
  return {f'{prefix}{name}.weight': (lambda p=p: get((p,)).T) for name, p in zip(names, ('wi_gate', 'wi_up', 'wo'))}


def _moe(get: Get, prefix: str, m: ml_collections.ConfigDict, expert_names) -> dict[str, Callable]:
  out = {prefix + 'gate.weight': lambda: get(('router',)).T}
  for i in range(m.moe.num_experts):
    for name, p in zip(expert_names, ('wi_gate', 'wi_up', 'wo')):
      out[f'{prefix}experts.{i}.{name}.weight'] = lambda i=i, p=p: get((p,))[i].T
  if m.moe.num_shared:
    out.update(_swiglu(lambda path: get(('shared',) + path), prefix + 'shared_experts.'))
  return out


def tensors(model: ml_collections.ConfigDict, layout: str, interleaved: bool, get: Get, get_state: Get):
  """[(file group, {tensor name: build})]: each layer's tensors, then the embeddings, final norm
  and head; get / get_state read a parameter / moe_state path as float32."""
  moe_prefix, expert_names = moe_names(layout)
  kinds = config_lib.layer_kinds(model)
  groups = []
  for i in range(model.num_layers):
    layer, pre = f'layer_{i}', f'model.layers.{i}.'
    at = lambda *path, layer=layer: get((layer, *path))
    out = {
      pre + 'input_layernorm.weight': lambda at=at: at('mixer_norm', 'scale'),
      pre + 'post_attention_layernorm.weight': lambda at=at: at('mlp_norm', 'scale'),
    }
    if kinds[i] == 'K':
      out.update(_kda(lambda path, at=at: at('kda', *path), pre + 'self_attn.', model))
    else:
      out.update(_mla(lambda path, at=at: at('mla', *path), pre + 'self_attn.', model, interleaved))
    mlp = lambda path, at=at: at('mlp', *path)
    if config_lib.moe_layer(model, i):
      out.update(_moe(mlp, pre + moe_prefix, model, expert_names))
      out[pre + moe_prefix + 'gate.' + BIAS] = lambda layer=layer: get_state((layer, 'mlp', 'bias'))
    else:
      out.update(_swiglu(mlp, pre + 'mlp.'))
    groups.append(out)
  last = {
    'model.embed_tokens.weight': lambda: get(('embed',)),
    'model.norm.weight': lambda: get(('final_norm', 'scale')),
  }
  if not model.tie_embeddings:
    last['lm_head.weight'] = lambda: get(('head',)).T
  elif layout == 'kimi_linear':  # transformers' Kimi Linear never ties: the head is written out
    last['lm_head.weight'] = lambda: get(('embed',))
  groups.append(last)
  return groups


# ----------------------------------------------------------------------------- config.json


def family_of(model: ml_collections.ConfigDict) -> str:
  """The released family that writes this model: Kimi Linear's for KDA layers or NoPE MLA, else DeepSeek-V3's."""
  return 'kimi_linear' if 'K' in config_lib.layer_kinds(model) or not model.mla_rope else 'deepseek_v3'


def hf_config(model: ml_collections.ConfigDict, tokenizer=None, dtype: str = 'bfloat16') -> dict:
  """config.json for a model with no released folder behind it, in family_of(model)'s keys."""
  m, layout = model, family_of(model)
  kinds = config_lib.layer_kinds(m)
  expert_hidden, dense_hidden = config_lib.moe_hidden(m) if m.mlp_kind == 'moe' else (0, m.mlp_dim)
  moe = m.mlp_kind == 'moe'
  dense_layers = m.moe.first_dense_layers if moe else m.num_layers
  out = {
    'vocab_size': m.vocab_size,
    'hidden_size': m.d_model,
    'intermediate_size': dense_hidden,
    'moe_intermediate_size': expert_hidden,
    'num_hidden_layers': m.num_layers,
    'num_attention_heads': m.num_heads,
    'num_key_value_heads': m.num_heads,
    'hidden_act': 'silu',
    'rms_norm_eps': m.norm_eps,
    'tie_word_embeddings': m.tie_embeddings,
    'attention_bias': False,
    'rope_theta': m.rope_theta,
    'rope_scaling': _rope_scaling(config_lib.yarn(m), m.mla_qk_rope_head_dim),
    **_max_positions(config_lib.yarn(m)),
    'q_lora_rank': m.mla_q_lora_rank or None,
    'kv_lora_rank': m.mla_kv_lora_rank,
    'qk_nope_head_dim': config_lib.mla_dims(m)[0],
    'qk_rope_head_dim': config_lib.mla_dims(m)[1],
    'v_head_dim': config_lib.mla_dims(m)[2],
    'routed_scaling_factor': m.moe.scaling_factor,
    'first_k_dense_replace': min(dense_layers, m.num_layers),
    'moe_layer_freq': 1,
    'topk_group': m.moe.topk_group,
    'torch_dtype': dtype,
    'bos_token_id': getattr(tokenizer, 'bos_id', None),
    'eos_token_id': getattr(tokenizer, 'eos_id', None),
    'pad_token_id': getattr(tokenizer, 'pad_id', None),
  }
  if layout == 'kimi_linear':
    heads, head_dim = config_lib.kda_dims(m)
    out.update(
      {
        'architectures': ['KimiLinearForCausalLM'],
        'model_type': 'kimi_linear',
        'num_experts': m.moe.num_experts if moe else 0,
        'num_experts_per_token': m.moe.top_k,
        'num_shared_experts': m.moe.num_shared,
        'moe_renormalize': m.moe.renormalize,
        'moe_router_activation_func': 'sigmoid',  # the only router either family has
        'use_grouped_topk': True,
        'num_expert_group': m.moe.n_group,
        'mla_use_nope': True,
        'linear_attn_config': {
          'kda_layers': [i + 1 for i, k in enumerate(kinds) if k == 'K'],
          'full_attn_layers': [i + 1 for i, k in enumerate(kinds) if k != 'K'],
          'num_heads': heads,
          'head_dim': head_dim,
          'short_conv_kernel_size': CONV_WIDTH,
        },
      }
    )
  else:
    out.update(
      {
        'architectures': ['DeepseekV3ForCausalLM'],
        'model_type': 'deepseek_v3',
        'n_routed_experts': m.moe.num_experts if moe else 0,
        'num_experts_per_tok': m.moe.top_k,
        'n_shared_experts': m.moe.num_shared,
        'norm_topk_prob': m.moe.renormalize,
        'scoring_func': 'sigmoid',
        'topk_method': 'noaux_tc',
        'n_group': m.moe.n_group,
        'rope_interleave': True,
      }
    )
  return out


def _max_positions(yarn) -> dict:
  """max_position_embeddings for a YaRN model (the extended context: readers that derive the factor
  from it and the original context agree with `factor`); {} otherwise, the model having no limit."""
  return {'max_position_embeddings': int(yarn.factor * yarn.original_context)} if yarn else {}


def _rope_scaling(yarn, rope_dims: int) -> dict | None:
  """config.json's rope_scaling for model.yarn (None for plain RoPE)."""
  if yarn is None or not rope_dims:
    return None
  out = {'type': 'yarn', 'factor': yarn.factor, 'original_max_position_embeddings': yarn.original_context}
  out.update(beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)
  out.update({k: getattr(yarn, k) for k in ('mscale', 'mscale_all_dim') if getattr(yarn, k)})
  return out


def _maths(m: ml_collections.ConfigDict) -> dict:
  """The model keys that decide its function, with their 0 defaults resolved; implementation
  keys (impls, kernels, compute dtype, remat), initialisation and training-only MoE keys are left out."""
  kinds = config_lib.layer_kinds(m)
  out = {
    'model.vocab_size': m.vocab_size,
    'model.d_model': m.d_model,
    'model.layer_pattern': kinds,
    'model.residual': m.residual,
    'model.norm_eps': m.norm_eps,
    'model.tie_embeddings': m.tie_embeddings,
    'model.mlp_kind': m.mlp_kind,
  }
  if 'A' in kinds:
    out.update(
      {
        'model.num_heads': m.num_heads,
        'model.attention_kind': m.attention_kind,
        'model.mla_kv_lora_rank': m.mla_kv_lora_rank,
        'model.mla_q_lora_rank': m.mla_q_lora_rank,
        'model.mla_qk_nope_head_dim, mla_qk_rope_head_dim, mla_v_head_dim': config_lib.mla_dims(m),
        'model.mla_latent_norm_eps': m.mla_latent_norm_eps,
        'model.mla_rope': m.mla_rope,
      }
    )
    if m.mla_rope and m.mla_qk_rope_head_dim:
      out['model.rope_theta'] = m.rope_theta
      out['model.yarn'] = config_lib.yarn(m)
  if 'K' in kinds:
    out.update(
      {
        'model.kda_num_heads, model.kda_head_dim': config_lib.kda_dims(m),
        'model.kda_short_conv': m.kda_short_conv,
        'model.kda_output_gate': m.kda_output_gate,
        'model.kda_gate_lower_bound': m.kda_gate_lower_bound,
        'model.kda_output_norm_eps': m.kda_output_norm_eps,
      }
    )
  if m.mlp_kind == 'moe':
    expert_hidden, dense_hidden = config_lib.moe_hidden(m)
    out.update({f'model.moe.{k}': m.moe[k] for k in MOE_MATHS})
    out.update({'model.moe.expert_hidden': expert_hidden, 'model.moe.dense_hidden': dense_hidden})
  else:
    out['model.mlp_dim'] = m.mlp_dim
  return out


MOE_MATHS = ('num_experts', 'top_k', 'num_shared', 'score_func', 'renormalize', 'scaling_factor', 'n_group')
MOE_MATHS += ('topk_group', 'first_dense_layers')


def model_differences(hf: dict, model: ml_collections.ConfigDict, ignore=()) -> list[tuple[str, object, object]]:
  """(key, the model's value, the value config.json `hf` gives) for each key of _maths that differs,
  less the keys starting with one of `ignore`."""
  back = config_lib.base_config()
  back.update_from_flattened_dict(model_overrides(hf))
  want, got = _maths(model), _maths(back.model)
  return [(k, want[k], got.get(k)) for k in want if want[k] != got.get(k) and not k.startswith(tuple(ignore))]


def check_expresses(hf: dict, model: ml_collections.ConfigDict) -> None:
  """HfError naming the first model key whose value `hf` (a config.json) does not give back."""
  try:
    differences = model_differences(hf, model)
  except HfError as e:
    raise HfError(f'the model cannot be written as a {hf["model_type"]} checkpoint: {e}') from None
  for key, want, got in differences[:1]:
    raise HfError(
      f'{key}={want!r} cannot be written as a {hf["model_type"]} checkpoint (its config.json gives '
      f'{got!r}); docs/released.md lists what the released families express'
    )


# ----------------------------------------------------------------------------- the folder


def _host_tree(tree) -> dict[tuple, object]:
  """{path: leaf} of a parameter tree, every leaf readable by this process."""
  flat = traverse_util.flatten_dict(tree)
  if any(isinstance(leaf, jax.Array) and not leaf.is_fully_addressable for leaf in flat.values()):
    raise HfError('export reads every parameter in one process; run it on one host (--mode=export)')
  return flat


def _getter(flat: dict) -> Get:
  def get(path):
    if path not in flat:
      raise HfError(f'the model has no parameter {"/".join(path)} for the released layout')
    return np.asarray(jax.device_get(flat[path]), np.float32)

  return get


def released_source(config: ml_collections.ConfigDict) -> str:
  """config.train.init_from when it names a released folder ('' for none, or for a run folder)."""
  from kimijax.train.checkpoint import is_run_folder

  folder = config.train.init_from
  return folder if folder and not is_run_folder(folder) else ''


def checked_config(out, config: ml_collections.ConfigDict, dtype: str | None, tokenizer=None) -> dict:
  """The config.json the export of `config`'s model writes, after every check that needs no
  parameter: OUT is new, the dtype is known, the family expresses the model (HfError otherwise)."""
  if pathlib.Path(out).exists():
    raise HfError(f'{out} exists; export writes a new folder (give another path, or remove it)')
  if dtype is not None and dtype not in EXPORT_DTYPES:
    raise HfError(f'export dtype {dtype!r} is not one of {sorted(EXPORT_DTYPES)}')
  source = released_source(config)
  hf = read_config(source) if source else hf_config(config.model, tokenizer, dtype or 'bfloat16')
  check_expresses(hf, config.model)
  return hf


def export_run(workdir, out, dtype: str | None = None) -> tuple[pathlib.Path, int]:
  """(the folder, the step): the latest checkpoint of the run in `workdir` exported to `out`."""
  from kimijax.data import load_tokenizer
  from kimijax.data.pipeline import tokenizer_spec
  from kimijax.model import Transformer
  from kimijax.parallel import mesh as mesh_lib
  from kimijax.train.checkpoint import latest_weights, load_run_config

  config = load_run_config(workdir)
  config.model = config_lib.portable(config.model)  # the same parameters; no kernel is needed to read them
  tokenizer = load_tokenizer(tokenizer_spec(config))
  checked_config(out, config, dtype, tokenizer)  # before the restore
  model = Transformer(config.model)
  params, moe_state, step = latest_weights(workdir, config, model, mesh_lib.make_mesh(config.mesh))
  return export_folder(out, config, params, moe_state, dtype=dtype, tokenizer=tokenizer), step


def export_folder(
  out: str | pathlib.Path,
  config: ml_collections.ConfigDict,
  params,
  moe_state,
  *,
  dtype: str | None = None,
  tokenizer=None,
) -> pathlib.Path:
  """Writes the folder (module docstring) and returns its path. dtype: 'bfloat16' or 'float32' for
  every tensor but the routers' correction bias (float32); None keeps a released source's dtypes,
  else bfloat16. tokenizer: the run's (its special ids go into a written config.json)."""
  out, hf = pathlib.Path(out), checked_config(out, config, dtype, tokenizer)
  model, source = config.model, released_source(config)
  source_files = SafetensorsFolder(source) if source else None
  groups = tensors(model, family(hf), rope_interleaved(hf), _getter(_host_tree(params)), _getter(_host_tree(moe_state)))

  def stored(name: str, value: np.ndarray) -> np.ndarray:
    if name.endswith(BIAS):
      return value.astype(np.float32)
    if dtype is None and source_files is not None and name in source_files:
      return value.astype(source_files.get(name).dtype)
    return value.astype(EXPORT_DTYPES[dtype or 'bfloat16'])

  partial = out.with_name(out.name + '.partial')
  if partial.exists():
    raise HfError(f'{partial} exists (an export that did not finish?); remove it, then export again')
  partial.mkdir(parents=True)
  try:
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
      file = f'model-{i + 1:05d}-of-{len(groups):05d}.safetensors'
      total += write_file(partial / file, {name: stored(name, build()) for name, build in group.items()})
      weight_map.update(dict.fromkeys(group, file))
    index = {'metadata': {'total_size': total}, 'weight_map': dict(sorted(weight_map.items()))}
    (partial / 'model.safetensors.index.json').write_text(json.dumps(index, indent=2) + '\n')
    if source:
      skip = {'model.safetensors.index.json'} | ({'config.json'} if dtype else set())
      for path in sorted(pathlib.Path(source).iterdir()):
        if path.is_file() and path.suffix != '.safetensors' and path.name not in skip:
          shutil.copy2(path, partial / path.name)
    if not source or dtype:  # a forced dtype is the folder's torch_dtype
      (partial / 'config.json').write_text(
        json.dumps({**hf, 'torch_dtype': dtype or hf['torch_dtype']}, indent=2) + '\n'
      )
    if not source:
      _copy_tokenizer(config, partial)
    partial.rename(out)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  return out


def _copy_tokenizer(config: ml_collections.ConfigDict, folder: pathlib.Path) -> None:
  """The run's tokenizer file beside the weights: tokenizer.json for 'hf:PATH', tiktoken.model for
  'tiktoken:PATH'; the byte tokenizer has no file (ids 0-255 are the bytes)."""
  spec = str(config.data.get('tokenizer', 'byte'))
  kind, _, path = spec.partition(':')
  path = path.split('#', 1)[0]
  if kind == 'hf':
    shutil.copy2(path, folder / 'tokenizer.json')
  elif kind == 'tiktoken':
    shutil.copy2(path, folder / 'tiktoken.model')
