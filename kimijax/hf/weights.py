"""A released checkpoint's tensors as kimijax parameters (docs/released.md).

    params, moe_state = load_numpy(folder, config.model)        # float32 NumPy trees
    params, moe_state = load_sharded(folder, config.model, abstract_params, abstract_moe_state)

Each kimijax parameter is built from the released tensors it corresponds to: PyTorch's Linear
weights [out, in] become kimijax's [in, ...] kernels with the head axis split out; the per-expert
matrices are stacked [E, ...]; MLA's fused projections are split into their no-position and
decoupled parts (q_proj, kv_a_proj_with_mqa, kv_b_proj); KDA's depthwise conv weights [H K, 1, 4]
become taps [4, H, K]. DeepSeek-V3's checkpoints lay each rotated pair of dims side by side
(rope_interleave); kimijax rotates dim i with dim i + d/2, so the decoupled dims' output columns
are reordered (evens, then odds), which leaves every q . k unchanged. The routers' score
correction bias becomes the MoE layer's balancing bias ('moe_state').

Every parameter of the model must come from the checkpoint with its exact shape, and every tensor of
the checkpoint must be used (the multi-token-prediction layers past num_hidden_layers and RoPE's
cached frequencies excepted); otherwise one HfError names the tensor.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from flax import traverse_util

from kimijax import config as config_lib
from kimijax.hf.config import family, moe_names, read_config, rope_interleaved
from kimijax.hf.safetensors import HfError, SafetensorsFolder

Build = Callable[[], np.ndarray]
IGNORED = re.compile(r'.*rotary_emb\.inv_freq$')


@dataclasses.dataclass
class _Reader:
  files: SafetensorsFolder
  used: set = dataclasses.field(default_factory=set)

  def __call__(self, name: str) -> np.ndarray:
    self.used.add(name)
    return np.asarray(self.files.get(name), np.float32)

  def has(self, name: str) -> bool:
    return name in self.files


def _linear_heads(w_out_in: np.ndarray, heads: int) -> np.ndarray:
  """Linear [H * K, D] -> kernel [D, H, K]."""
  return w_out_in.reshape(heads, -1, w_out_in.shape[-1]).transpose(2, 0, 1)


def _interleaved_to_halves(d: int) -> np.ndarray:
  """Column order taking a rotary part laid out in adjacent pairs (x0, x1), (x2, x3), ... to
  kimijax's halves (dim i rotates with dim i + d/2): the even dims, then the odd ones."""
  return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def _mla(read: _Reader, prefix: str, m: ml_collections.ConfigDict, interleaved: bool) -> dict[tuple, Build]:
  h, r, (dn, dr, dv) = m.num_heads, m.mla_kv_lora_rank, config_lib.mla_dims(m)
  order = _interleaved_to_halves(dr) if interleaved else np.arange(dr)

  def q_parts(which):
    def build():
      if m.mla_q_lora_rank:
        w = read(prefix + 'q_b_proj.weight')
      else:
        w = read(prefix + 'q_proj.weight')
      w = _linear_heads(w, h)  # [in, H, dn + dr]
      return w[..., :dn] if which == 'nope' else w[..., dn:][..., order]

    return build

  def kv_a(which):
    def build():
      w = read(prefix + 'kv_a_proj_with_mqa.weight')  # [r + dr, D]
      return w[:r].T if which == 'latent' else w[r:][order].T

    return build

  def kv_b(which):
    def build():
      w = _linear_heads(read(prefix + 'kv_b_proj.weight'), h)  # [r, H, dn + dv]
      return w[..., :dn] if which == 'k' else w[..., dn:]

    return build

  out = {
    ('q_nope',): q_parts('nope'),
    ('kv_down',): kv_a('latent'),
    ('kv_norm', 'scale'): lambda: read(prefix + 'kv_a_layernorm.weight'),
    ('k_nope',): kv_b('k'),
    ('v',): kv_b('v'),
    ('out',): lambda: read(prefix + 'o_proj.weight').T.reshape(h, dv, -1),
  }
  if dr:
    out[('q_rope',)] = q_parts('rope')
    out[('k_rope',)] = kv_a('rope')
  if m.mla_q_lora_rank:
    out[('q_down',)] = lambda: read(prefix + 'q_a_proj.weight').T
    out[('q_norm', 'scale')] = lambda: read(prefix + 'q_a_layernorm.weight')
  return out


def _kda(read: _Reader, prefix: str, m: ml_collections.ConfigDict) -> dict[tuple, Build]:
  h, k = config_lib.kda_dims(m)
  low_rank_b = lambda name: lambda: read(prefix + name).reshape(h, k, -1).transpose(2, 0, 1)  # [rank, H, K]
  out = {
    ('b_proj',): lambda: read(prefix + 'b_proj.weight').T,
    ('A_log',): lambda: read(prefix + 'A_log').reshape(h),
    ('dt_bias',): lambda: read(prefix + 'dt_bias').reshape(h, k),
    ('f_a',): lambda: read(prefix + 'f_a_proj.weight').T,
    ('f_b',): low_rank_b('f_b_proj.weight'),
    ('g_a',): lambda: read(prefix + 'g_a_proj.weight').T,
    ('g_b',): low_rank_b('g_b_proj.weight'),
    ('o_norm',): lambda: read(prefix + 'o_norm.weight'),
    ('o_proj',): lambda: read(prefix + 'o_proj.weight').T.reshape(h, k, -1),
  }
  for n in 'qkv':
    out[(f'{n}_proj',)] = lambda n=n: _linear_heads(read(prefix + f'{n}_proj.weight'), h)
    out[(f'{n}_conv', 'kernel')] = lambda n=n: read(prefix + f'{n}_conv1d.weight')[:, 0, :].T.reshape(-1, h, k)
  return out


def _swiglu(read: _Reader, prefix: str, names=('gate_proj', 'up_proj', 'down_proj')) -> dict[tuple, Build]:
  gate, up, down = names
  return {
    ('wi_gate',): lambda: read(f'{prefix}{gate}.weight').T,
    ('wi_up',): lambda: read(f'{prefix}{up}.weight').T,
    ('wo',): lambda: read(f'{prefix}{down}.weight').T,
  }


def _moe(read: _Reader, prefix: str, m: ml_collections.ConfigDict, expert_names) -> dict[tuple, Build]:
  e = m.moe.num_experts

  def stacked(which):
    name = expert_names[('gate', 'up', 'down').index(which)]
    return lambda: np.stack([read(f'{prefix}experts.{i}.{name}.weight').T for i in range(e)])

  out = {
    ('router',): lambda: read(prefix + 'gate.weight').T,
    ('wi_gate',): stacked('gate'),
    ('wi_up',): stacked('up'),
    ('wo',): stacked('down'),
  }
  if m.moe.num_shared:
    out.update({('shared',) + key: build for key, build in _swiglu(read, prefix + 'shared_experts.').items()})
  return out


def sources(folder: str | pathlib.Path, model: ml_collections.ConfigDict) -> tuple[dict, dict, _Reader]:
  """({param path: build}, {moe_state path: build}, the reader that records which tensors were read)."""
  hf = read_config(folder)
  read = _Reader(SafetensorsFolder(folder))
  interleaved = rope_interleaved(hf)
  moe_prefix, expert_names = moe_names(family(hf))

  def embed():
    value = read('model.embed_tokens.weight')
    # a tied model's folder may still hold the head (transformers' Kimi Linear never ties): it must be the same
    if model.tie_embeddings and read.has('lm_head.weight') and not np.array_equal(read('lm_head.weight'), value):
      raise HfError(f'{folder}: tie_word_embeddings is true but lm_head.weight is not model.embed_tokens.weight')
    return value

  params: dict[tuple, Build] = {
    ('embed',): embed,
    ('final_norm', 'scale'): lambda: read('model.norm.weight'),
  }
  if not model.tie_embeddings:
    params[('head',)] = lambda: read('lm_head.weight').T
  moe_state: dict[tuple, Build] = {}
  kinds = config_lib.layer_kinds(model)
  for i in range(model.num_layers):
    layer, pre = f'layer_{i}', f'model.layers.{i}.'
    params[(layer, 'mixer_norm', 'scale')] = lambda pre=pre: read(pre + 'input_layernorm.weight')
    params[(layer, 'mlp_norm', 'scale')] = lambda pre=pre: read(pre + 'post_attention_layernorm.weight')
    if kinds[i] == 'K':
      mixer = {('kda',) + k: b for k, b in _kda(read, pre + 'self_attn.', model).items()}
    else:
      mixer = {('mla',) + k: b for k, b in _mla(read, pre + 'self_attn.', model, interleaved).items()}
    params.update({(layer,) + k: b for k, b in mixer.items()})
    if config_lib.moe_layer(model, i):
      mlp = _moe(read, pre + moe_prefix, model, expert_names)
      moe_state[(layer, 'mlp', 'bias')] = lambda pre=pre: read(pre + moe_prefix + 'gate.e_score_correction_bias')
    else:
      mlp = _swiglu(read, pre + 'mlp.')
    params.update({(layer, 'mlp') + k: b for k, b in mlp.items()})
  return params, moe_state, read


def _check_all_read(read: _Reader, num_layers: int) -> None:
  """HfError naming the tensors no parameter read; num_layers: the folder's own (config.json), the
  layers past it being multi-token prediction."""
  extra = re.compile(r'model\.layers\.(\d+)\.')
  unused = [
    n
    for n in read.files.names
    if n not in read.used
    and not IGNORED.match(n)
    and not ((m := extra.match(n)) and int(m.group(1)) >= num_layers)  # multi-token prediction layers
  ]
  if unused:
    shown = ', '.join(unused[:5]) + (f' and {len(unused) - 5} more' if len(unused) > 5 else '')
    raise HfError(f'{read.files.folder}: {len(unused)} tensors have no place in the model: {shown}')


def _built(path: tuple, build: Build, want: tuple, folder) -> np.ndarray:
  try:
    value = build()
  except HfError:  # a missing tensor, an unreadable dtype: their own message
    raise
  except (ValueError, IndexError) as e:  # a reshape or an index that does not fit: config and checkpoint disagree
    raise HfError(f'{folder}: the tensors of {"/".join(path)} do not fit its shape {want} ({e})') from None
  if tuple(value.shape) != tuple(want):
    raise HfError(f'{folder}: {"/".join(path)} from the checkpoint has shape {value.shape}, the model wants {want}')
  return np.ascontiguousarray(value, np.float32)


def load(folder, model: ml_collections.ConfigDict, abstract_params, abstract_moe_state, place) -> tuple[dict, dict]:
  """(params, moe_state) in the structure of the abstract trees (shapes from jax.eval_shape), each
  array made by place(path, array, abstract leaf)."""
  param_src, state_src, read = sources(folder, model)
  out = []
  for abstract, src in ((abstract_params, param_src), (abstract_moe_state, state_src)):
    want = traverse_util.flatten_dict(abstract)
    missing = sorted(set(want) - set(src))
    unknown = sorted(set(src) - set(want))
    if missing or unknown:
      raise HfError(
        f'{folder}: the model config and the checkpoint disagree: parameters without a tensor '
        f'{["/".join(p) for p in missing[:5]]}, tensors without a parameter {["/".join(p) for p in unknown[:5]]}'
      )
    flat = {path: place(path, _built(path, src[path], want[path].shape, folder), want[path]) for path in want}
    out.append(traverse_util.unflatten_dict(flat))
  _check_all_read(read, read_config(folder)['num_hidden_layers'])
  return out[0], out[1]


def abstract_variables(model: ml_collections.ConfigDict) -> tuple[dict, dict]:
  """(params, moe_state) of Transformer(model) as ShapeDtypeStructs, unboxed."""
  import flax.linen as nn
  import jax.numpy as jnp

  from kimijax.layers.moe import MOE_STATE
  from kimijax.model import Transformer

  shapes = jax.eval_shape(
    lambda: Transformer(config_lib.portable(model)).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  )
  return nn.unbox(shapes['params']), dict(shapes.get(MOE_STATE, {}))


def load_numpy(folder, model: ml_collections.ConfigDict) -> tuple[dict, dict]:
  """(params, moe_state) as float32 NumPy trees for Transformer(model)."""
  params, moe_state = abstract_variables(model)
  return load(folder, model, params, moe_state, lambda path, value, leaf: value)


def load_sharded(folder, model: ml_collections.ConfigDict, abstract_params, abstract_moe_state) -> tuple[dict, dict]:
  """(params, moe_state) as jax.Arrays laid out as the abstract leaves' .sharding say, one
  parameter in host memory at a time (each process builds it whole and keeps the slices its
  devices hold)."""

  def place(path, value, leaf):
    value = value.astype(leaf.dtype, copy=False)  # float32, or the dtype inference holds it in
    return jax.make_array_from_callback(value.shape, leaf.sharding, lambda index: value[index])

  return load(folder, model, abstract_params, abstract_moe_state, place)
