"""Softmax attention with one dispatch point for its implementations.

`attention(q, k, v, impl=...)` runs one of IMPLS:

    'xla'      plain einsums; runs everywhere (the CPU default and the reference)
    'cudnn'    cuDNN's fused flash attention (NVIDIA GPU, bf16/fp16); one head dim, so a smaller
               value dim (MLA's 128 beside 192) is padded; max logits by a second fused kernel
               over q and k (max_logits_kernel)
    'tokamax'  tokamax's Mosaic GPU flash attention (NVIDIA GPU, bf16/fp16; forward and backward
               on Hopper), GQA and an unequal value dim natively; its forward keeps the per-row
               max of the scaled, masked logits, so the max logits cost nothing extra
               (experiments/results/bench_attention.md)
    'gpu'      per call, the faster of the two GPU implementations on an H200 (the GPU configs'
               choice): 'tokamax' when max logits are wanted or the value dim differs from the
               query/key dim, 'cudnn' otherwise (experiments/results/bench_attention.md)

With `return_max_logits=True` it also returns, per query head, the largest scaled and causally
masked logit over the batch and all positions (docs/optimizers.md#qk-clip, the S_max^h that QK-Clip needs). That
value is exact for every implementation and carries no gradient; `max_logits_blocked` is its
portable reference. Without it no max-logit work runs.

With `segment_ids` [B, T] (packed documents, kimijax/ops/segments.py) a query attends only to the
keys of its own segment, and the max logits are over those (same-segment, causal) pairs only:
'xla' masks the logits, 'tokamax' passes each query row's first key (its segment's start) to the
kernel, which skips key blocks wholly before it; 'cudnn' has no such mask through
jax.nn.dot_product_attention (a dense [B, 1, T, S] mask only, turned into a bias) and refuses
(`Implementation.segment_mask`), and 'gpu' then runs 'tokamax'. Decoding over a cache goes through
`decode_attention`. The GPU implementations raise a ValueError naming the fix on float32 inputs
or without a GPU (`unsupported`), before any compute.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kimijax.ops.per_shard import run_per_shard, spec_axes
from kimijax.ops.segments import segment_start_index

MASKED_LOGIT = -1e30  # finite: a fully masked row gives uniform weights instead of NaN


def _check_shapes(q, k, v):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
      f'attention expects q [B, T, H, D], k [B, S, Hkv, D] and v [B, S, Hkv, Dv]; '
      f'got q {q.shape}, k {k.shape}, v {v.shape}'
    )
  b, _, h, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
    raise ValueError(f'attention: k {k.shape} must be [B={b}, S, Hkv, D={d}] and v {v.shape} [B={b}, S, Hkv, Dv]')
  if h % k.shape[2]:
    raise ValueError(
      f'attention: key/value heads {k.shape[2]} must divide query heads {h}; got q {q.shape}, k {k.shape}'
    )


def _causal_mask(t: int, s: int) -> jax.Array:
  """[T, S] bool; query i sits at absolute position s - t + i (queries are the last T of S)."""
  return jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :]


def _grouped_logits(q, k, scale):
  """fp32 logits [B, Hkv, G, T, S] for q [B, T, Hkv*G, D], k [B, S, Hkv, D]."""
  b, t, h, d = q.shape
  hkv = k.shape[2]
  q_btkgd = q.reshape(b, t, hkv, h // hkv, d)
  return jnp.einsum('btkgd,bskd->bkgts', q_btkgd, k, preferred_element_type=jnp.float32) * scale


def _max_over_logits(logits_bkgts, mask_ts):
  masked = jnp.where(mask_ts, logits_bkgts, -jnp.inf) if mask_ts is not None else logits_bkgts
  m_kg = jnp.max(masked, axis=(0, 3, 4))
  return m_kg.reshape(-1)


def _xla_attention(q, k, v, causal, scale, return_max_logits, spec, segment_ids=None):
  del spec
  b, t, h, _ = q.shape
  s = k.shape[1]
  logits = _grouped_logits(q, k, scale)
  mask = _causal_mask(t, s) if causal else None
  if segment_ids is not None:  # [B, 1, 1, T, S]: the same segment
    same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    mask = same if mask is None else mask & same
  if mask is not None:
    logits = jnp.where(mask, logits, MASKED_LOGIT)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum('bkgts,bskd->btkgd', probs.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)
  out = out.reshape(b, t, h, v.shape[-1])
  if not return_max_logits:
    return out, None
  return out, jax.lax.stop_gradient(_max_over_logits(logits, mask))


def max_logits_blocked(q, k, *, causal=True, scale=None, block=512):
  """Exact per-head max logit [H] without materialising [T, S] for all queries at once.

  A portable reference for fused implementations that do not expose their logits (on GPU the
  fused Pallas kernel, max_logits_kernel, does the same without writing logits to memory).
  """
  b, t, h, d = q.shape
  s = k.shape[1]
  scale = d**-0.5 if scale is None else scale
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  block = min(block, t)
  n = -(-t // block)
  q_pad = jnp.pad(q, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
  q_nbthd = q_pad.reshape(b, n, block, h, d).transpose(1, 0, 2, 3, 4)
  rows = jnp.arange(n * block).reshape(n, block)

  def one_block(args):
    q_blk, row = args
    logits = _grouped_logits(q_blk, k, scale)
    valid = (row < t)[:, None]
    if causal:
      valid = valid & (row[:, None] + (s - t) >= jnp.arange(s)[None, :])
    return _max_over_logits(logits, valid)

  return jnp.max(jax.lax.map(one_block, (q_nbthd, rows)), axis=0)


def _kernel_layout(q, k, spec: P | None):
  """How a kernel that XLA cannot partition runs per shard under the current mesh, for q and k
  [B, T|S, H|Hkv, D] laid out as `spec`: (the spec of such arrays per shard: batch and head axes
  kept, a sharded length or feature axis gathered; the spec of a per-head result [H]; the pmax
  over the batch axes that makes per-shard maxima whole, or None). Heads (or a batch) that do not
  divide over their mesh axes stay whole per device."""
  batch, _, heads = (tuple(spec or ()) + (None,) * 3)[:3]
  mesh = jax.sharding.get_abstract_mesh()
  size = lambda entry: 1 if mesh.empty else math.prod(mesh.shape[a] for a in spec_axes(entry))
  if q.shape[2] % size(heads) or k.shape[2] % size(heads):
    heads = None
  if q.shape[0] % size(batch):
    batch = None
  max_over_batch = (lambda m: jax.lax.pmax(m, spec_axes(batch))) if spec_axes(batch) else None
  return P(batch, None, heads, None), P(heads), max_over_batch


def max_logits_kernel(q, k, *, causal=True, scale=None, spec: P | None = None):
  """Exact per-head max logit [H] by the fused Pallas kernel (kernels_pallas/attention/
  max_logits.py; interpreted off the GPU). Under a mesh of several devices made current by
  jax.set_mesh, with q and k [B, T|S, H|Hkv, D] laid out as `spec` (batch and head axes; a
  sharded length or feature axis is gathered), each device runs the kernel on its own batch
  rows and heads and the per-head maxima are reduced across the batch shards: q and k are never
  gathered."""
  from kernels_pallas.attention.max_logits import max_logits as kernel  # imports the Triton lowering
  from kernels_pallas.common import kernels_interpreted

  run = lambda q, k: kernel(q, k, causal=causal, scale=scale, interpret=kernels_interpreted())
  rows, per_head, max_over_batch = _kernel_layout(q, k, spec)
  return run_per_shard(run, (q, k), in_specs=(rows, rows), out_specs=per_head, across_shards=max_over_batch)


def unsupported(impl: str, dtype, platform: str | None = None) -> str | None:
  """Why attention `impl` cannot run on inputs of `dtype` on `platform` (default: JAX's default
  backend), or None when it can. The GPU implementations (gpu_only in IMPLS) need bf16 or fp16
  and an NVIDIA GPU."""
  if impl not in IMPLS or not IMPLS[impl].gpu_only:
    return None
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return (
      f'attention impl={impl!r} needs bfloat16 or float16 inputs, got {jnp.dtype(dtype)}; '
      "set model.compute_dtype='bfloat16' or use impl='xla'"
    )
  platform = platform or jax.default_backend()
  if platform != 'gpu':
    return (
      f'attention impl={impl!r} needs an NVIDIA GPU, but JAX runs on {platform!r} here; '
      "use impl='xla' (model.attn_impl='xla') off the GPU"
    )
  return None


def _check_supported(impl, q):
  problem = unsupported(impl, q.dtype)
  if problem:
    raise ValueError(problem)


def _cudnn_attention(q, k, v, causal, scale, return_max_logits, spec, segment_ids=None):
  if segment_ids is not None:
    raise ValueError(
      "attention impl='cudnn' has no document (segment) mask; use impl='tokamax' (or 'gpu', which "
      "then runs it) or impl='xla'"
    )
  _check_supported('cudnn', q)
  t, s = q.shape[1], k.shape[1]
  dv = v.shape[-1]
  if dv != q.shape[-1]:  # cuDNN wants one head dim: pad v (MLA's value dim may differ), slice after
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv))) if dv < q.shape[-1] else v
    if dv > q.shape[-1]:
      raise ValueError(
        f"attention impl='cudnn' needs the value head dim ({dv}) <= the query/key head "
        f"dim ({q.shape[-1]}); use impl='xla'"
      )
  if causal and t != s:
    # jax's is_causal aligns the mask top-left (query i sees keys <= i); here the queries are the
    # last T of S positions, so pass the bottom-right mask explicitly.
    out = jax.nn.dot_product_attention(
      q, k, v, mask=_causal_mask(t, s)[None, None], scale=scale, implementation='cudnn'
    )
  else:
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation='cudnn')
  out = out[..., :dv]
  if not return_max_logits:
    return out, None
  return out, max_logits_kernel(q, k, causal=causal, scale=scale, spec=spec)


def flash_attention_tokamax(
  q, k, v, *, causal=True, scale=None, return_max_logits=False, spec: P | None = None, op=None, segment_ids=None
):
  """(out [B, T, H, Dv], max_logits [H] fp32 or None) by tokamax's flash attention: the one place
  kimijax calls tokamax. q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (GQA: query head h
  reads key/value head h // (H / Hkv), as here); when T < S the queries are the last T positions.

  tokamax 0.0.17's public dot_product_attention does not return the softmax residuals, so this
  calls its op object, PallasMosaicGpuFlashAttention (tokamax._src, not public), with
  return_residuals=True. The residuals are (row max, row sum), each [B, H, T]. The kernel keeps its
  running row max in base-2 units, log2(e) * scale * q . k over the unmasked keys, and multiplies
  it by 1 / log2(e) before writing it, so the row max is max_j scale * q_i . k_j in natural units, the
  logits' own scale (masked keys excluded; with causal masking every row sees at least its own
  key). Hence max_logits[h] = max over b and i of row_max[b, h, i]: exact up to the two float32
  roundings of that scaling (~2e-7 relative). tests/ops/test_attention_tokamax.py pins each of
  these assumptions. Under a mesh the kernel (a Mosaic GPU custom call that XLA cannot partition)
  runs per shard, like max_logits_kernel. `op` substitutes another tokamax attention op with the
  same interface (the tests pass tokamax's XLA reference, which runs on a CPU).

  With segment_ids [B, T] (T = S) each query row also gets its first allowed key, the start of
  its segment (tokamax's Mask k_start, [B, 1, T]): the kernels mask keys before it and skip key
  blocks that lie wholly before it, and the row max covers the allowed keys only.

  The body runs under one jax.jit with the settings and the op as static arguments: a model's
  layers call it with the same shapes, so they share one trace and one lowering of the kernel
  (as kernels_pallas/__init__.py explains for the Pallas ops)."""
  from tokamax._src.ops.attention import pallas_mosaic_gpu

  op = pallas_mosaic_gpu.PallasMosaicGpuFlashAttention() if op is None else op
  q, k, v = (jnp.asarray(x) for x in (q, k, v))  # tokamax type-checks for jax arrays
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  kw = dict(causal=bool(causal), scale=float(scale), return_max_logits=bool(return_max_logits), spec=spec, op=op)
  if segment_ids is None:
    return _tokamax_flash(q, k, v, **kw)
  if q.shape[1] != k.shape[1]:
    raise ValueError(f'attention: segment_ids need as many queries as keys; got q {q.shape}, k {k.shape}')
  return _tokamax_flash(q, k, v, jnp.asarray(segment_ids), **kw)


@functools.partial(jax.jit, static_argnames=('causal', 'scale', 'return_max_logits', 'spec', 'op'))
def _tokamax_flash(q, k, v, segment_ids=None, *, causal, scale, return_max_logits, spec, op):
  """flash_attention_tokamax's body (see there)."""
  from tokamax._src.ops.attention import base

  # Key j is visible to query row i when j <= i + offset: offset S - T aligns the mask bottom-right
  # (offset 0 is tokamax's plain causal mask, computed in the kernel; otherwise a per-row key end).
  causal_mask = base.CausalMask(offset=k.shape[1] - q.shape[1]) if causal else None
  rows, per_head, max_over_batch = _kernel_layout(q, k, spec)
  args, in_specs = (q, k, v), (rows,) * 3
  if segment_ids is not None:  # each query row's first key: its segment's start, [B, 1, T]
    args += (segment_start_index(segment_ids)[:, None, :],)
    in_specs += (P(rows[0], None, None),)

  def run(q, k, v, k_start=None):
    mask = causal_mask if k_start is None else base.Mask(causal_mask=causal_mask, k_start=k_start)
    if not return_max_logits:
      return op(q, k, v, logits_scale=scale, mask=mask)
    out, (row_max_bht, _) = op(q, k, v, logits_scale=scale, mask=mask, return_residuals=True)
    return out, jax.lax.stop_gradient(jnp.max(row_max_bht, axis=(0, 2)))

  if not return_max_logits:
    return run_per_shard(run, args, in_specs=in_specs, out_specs=rows), None
  across = None if max_over_batch is None else (lambda outs: (outs[0], max_over_batch(outs[1])))
  return run_per_shard(run, args, in_specs=in_specs, out_specs=(rows, per_head), across_shards=across)


def _tokamax_attention(q, k, v, causal, scale, return_max_logits, spec, segment_ids=None):
  _check_supported('tokamax', q)
  return flash_attention_tokamax(
    q, k, v, causal=causal, scale=scale, return_max_logits=return_max_logits, spec=spec, segment_ids=segment_ids
  )


def gpu_choice(q, v, return_max_logits, segment_ids=None) -> str:
  """The GPU implementation impl='gpu' runs: the faster one for the call in bench_350m's step on
  an H200 (experiments/results/bench_attention.md, section 3). tokamax's max logits come free
  where cuDNN runs a second kernel, and it takes MLA's unequal value dim that cuDNN pads; without
  either, cuDNN's kernels are 2.3% faster. With segment ids, tokamax (cuDNN has no segment mask)."""
  if return_max_logits or v.shape[-1] != q.shape[-1] or segment_ids is not None:
    return 'tokamax'
  return 'cudnn'


def _gpu_attention(q, k, v, causal, scale, return_max_logits, spec, segment_ids=None):
  _check_supported('gpu', q)
  impl = IMPLS[gpu_choice(q, v, return_max_logits, segment_ids)]
  if segment_ids is None:
    return impl.attention(q, k, v, causal, scale, return_max_logits, spec)
  return impl.attention(q, k, v, causal, scale, return_max_logits, spec, segment_ids)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of attention. attention: (q, k, v, causal, scale, return_max_logits, spec[,
  segment_ids]) -> (out, max_logits or None). gpu_only: it needs an NVIDIA GPU and bf16 or fp16
  inputs (`unsupported` says why it cannot run elsewhere). segment_mask: it takes segment_ids
  (packed documents kept apart)."""

  attention: Callable
  gpu_only: bool = False
  segment_mask: bool = True


IMPLS = types.MappingProxyType(
  {
    'xla': Implementation(_xla_attention),
    'cudnn': Implementation(_cudnn_attention, gpu_only=True, segment_mask=False),
    'tokamax': Implementation(_tokamax_attention, gpu_only=True),
    'gpu': Implementation(_gpu_attention, gpu_only=True),
  }
)


def attention(
  q, k, v, *, causal=True, impl='xla', scale=None, return_max_logits=False, spec: P | None = None, segment_ids=None
):
  """Scaled dot-product attention with GQA.

  Args:
    q: [B, T, H, D] queries. k: [B, S, Hkv, D] keys, v: [B, S, Hkv, Dv] values, H % Hkv == 0.
      When T < S the queries are the last T positions (decoding with a cache).
    causal: mask keys after each query's position.
    impl: a key of IMPLS: 'xla', 'cudnn', 'tokamax' or 'gpu' (the faster of the two GPU ones for
      this call: gpu_choice).
    scale: softmax scale, default D ** -0.5.
    return_max_logits: also return max_logits [H] fp32 = max over batch, queries and unmasked keys
      of scale * q . k (docs/optimizers.md#qk-clip).
    spec: the PartitionSpec of q, k and v under a mesh (for implementations that run a kernel
      per shard; None: not sharded).
    segment_ids: None, or [B, T] int (T = S): packed documents, each a contiguous run of equal
      ids (kimijax/ops/segments.py); a query attends only to keys of its own segment, and
      max_logits is over those pairs. Implementations without `segment_mask` ('cudnn') refuse.

  Returns:
    out [B, T, H, Dv] in q's dtype, or (out, max_logits) when return_max_logits.
  """
  _check_shapes(q, k, v)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if impl not in IMPLS:
    raise ValueError(f'attention impl={impl!r} is unknown; allowed: {tuple(IMPLS)}')
  if segment_ids is None:
    out, m = IMPLS[impl].attention(q, k, v, causal, scale, return_max_logits, spec)
  else:
    if segment_ids.shape != (q.shape[0], q.shape[1]) or q.shape[1] != k.shape[1]:
      raise ValueError(
        f'attention: segment_ids must be [B, T] = {list(q.shape[:2])} with as many keys as queries; '
        f'got segment_ids {list(segment_ids.shape)}, k {list(k.shape)}'
      )
    out, m = IMPLS[impl].attention(q, k, v, causal, scale, return_max_logits, spec, segment_ids)
  return (out, m) if return_max_logits else out


def decode_attention(q, k_cache, v_cache, length, *, scale=None):
  """Attention of new queries over a preallocated cache, for decoding.

  q [B, T, H, D] are the queries at positions length-T .. length-1; k_cache [B, S, Hkv, D] and
  v_cache [B, S, Hkv, Dv] hold valid keys at positions < length (a traced scalar). Query i sees
  keys at positions <= length - T + i. Softmax in float32. Returns [B, T, H, Dv] in q's dtype.
  """
  b, t, h, d = q.shape
  s = k_cache.shape[1]
  scale = d**-0.5 if scale is None else scale
  logits = _grouped_logits(q, k_cache, scale)  # [B, Hkv, G, T, S]
  query_pos = length - t + jnp.arange(t)
  allowed = query_pos[:, None] >= jnp.arange(s)[None, :]
  probs = jax.nn.softmax(jnp.where(allowed, logits, MASKED_LOGIT), axis=-1)
  out = jnp.einsum('bkgts,bskd->btkgd', probs.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, v_cache.shape[-1]).astype(q.dtype)
