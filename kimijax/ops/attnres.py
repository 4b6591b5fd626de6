"""Depth attention, the aggregation of Attention Residuals (docs/attention_residuals.md).

A consumer (a sublayer, or the final aggregator) forms its input as a softmax-weighted mix of
earlier sources (the embedding and sublayer outputs, or block sums of them), per token:

    h = sum_i alpha_i v_i,   alpha = softmax_i( q . v_i / rms(v_i) ),   rms(v) = sqrt(mean_d v^2 + eps)

Keys are the RMS-normalised sources with no gain; values are the raw sources; there is no
1/sqrt(d). Logits, softmax and the weighted sum run in float32 whatever the sources' dtype.

Key-norm gain: docs/attention_residuals.md gives each consumer a learned gain g on the key RMSNorm. Since
q . (g * v / rms(v)) = (q * g) . (v / rms(v)), the model passes q = w * g here (w the
pseudo-query, g the gain, both its parameters) and this op stays gain-free.

Two forms with the same maths:
  depth_attention(sources [N, ..., D], query [D])        the stacked form (public contract)
  depth_attention_list([v_0, ..., v_{N-1}], query [D])    a Python sequence of [..., D] arrays,
      so that a model can mix completed block sums and a running partial sum without stacking
      (stacking would copy every source at every consumer).

Block AttnRes in two phases (what the model runs; docs/attention_residuals.md's block sources). Within a block the
completed sources (embedding and block sums) are fixed and every consumer's query is a static
parameter, so softmax over [b_0 .. b_{n-1}, p] splits exactly into
  phase1(block_sums, queries [S, D])  -> o_j = softmax-weighted sum of the block sums for each of
                                         the block's S consumers, and lse_j, their logsumexp;
  merge_partial(o_j, lse_j, p, q_j)   -> h = sigma o_j + (1 - sigma) p,
                                         sigma = sigmoid(lse_j - q_j . p / rms(p)),
since exp(lse_j) / (exp(lse_j) + exp(s_p)) is the total weight the full softmax gives the block
sums. Phase 1 reads each block sum once per block instead of once per consumer. The model runs
phase 2 through merge_norm, merged with the consumer's pre-norm in one call. IMPLS holds the two
phases' implementations: 'xla', and 'pallas', fused GPU kernels (kernels_pallas/attnres/) whose
merge_norm never writes h, their Triton settings passed as `settings=` (None: the defaults). o_j
is stored in the sources' dtype.

Variants: the two switches of docs/attention_residuals.md's ablations (the paper's 436M model, on Full AttnRes: "no key
RMSNorm" 1.743 and "sigmoid" 1.741 against Full's 1.737; config keys model.attnres_key_norm and
model.attnres_depth_weights). Every public function here takes them as `key_norm` (default True)
and `depth_weights` (default 'softmax'), so that the model passes them through and never branches
on them. Query q (q = w * g with the key norm, q = w without it), sources v_0 .. v_{N-1}, values
always the raw sources, everything in float32:

  logits   key_norm=True  (docs/attention_residuals.md):  s_i = q . v_i / rms(v_i),   rms(v) = sqrt(mean_d v^2 + eps)
           key_norm=False:            s_i = q . v_i                (no norm, no gain, no eps)
  weights  'softmax' (docs/attention_residuals.md):       alpha_i = exp(s_i) / sum_k exp(s_k)
           'sigmoid':                 alpha_i = sigmoid(s_i) = 1 / (1 + exp(-s_i)), each source on
                                      its own (no competition; the weights need not sum to 1)
  output                              h = sum_i alpha_i v_i

The switches combine freely, and the two-phase split holds for each: with softmax (either key) the
merge is sigma o_j + (1 - sigma) p as above, from the chosen logits; with sigmoid the weights are
independent, so phase 1 gives o_j = sum_i sigmoid(s_ji) b_i and phase 2 is h = o_j + sigmoid(s_p) p
(phase 1's lse, still logsumexp_i s_ji, goes unused). At q = 0 softmax gives the mean of the sources
and sigmoid half their sum; every consumer RMS-normalises its input, so each variant starts as the
standard pre-norm model, up to eps. Only 'xla' implements the variants: 'pallas' (its kernels'
maths) is docs/attention_residuals.md's default alone and the dispatchers raise ValueError for any other.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kimijax.ops.norms import rms_normalise
from kimijax.ops.per_shard import lead_spec, run_per_shard

DEPTH_WEIGHTS = ('softmax', 'sigmoid')  # how the logits over the sources become weights


def _check_variant(key_norm, depth_weights, fn: str) -> None:
  if not isinstance(key_norm, bool):
    raise ValueError(f'{fn}: key_norm must be True or False; got {key_norm!r}')
  if depth_weights not in DEPTH_WEIGHTS:
    raise ValueError(f'{fn}: depth_weights must be one of {DEPTH_WEIGHTS}; got {depth_weights!r}')


def _logits(v, q_sd, eps: float, key_norm: bool = True):
  """Queries q_sd [S, D] against one source v [..., D]: [S, ...] float32 logits
  q_j . rms_normalise(v) (key_norm) or q_j . v, one pass over v for every reduction."""
  v = v.astype(jnp.float32)
  # Elementwise products and sums rather than a dot, so that no backend lowers them to a
  # reduced-precision (e.g. TF32) matmul.
  dots = jnp.stack([jnp.sum(v * q_d, axis=-1) for q_d in q_sd])
  if not key_norm:
    return dots
  return dots * jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)


def _logit(v, q_d, eps: float, key_norm: bool = True):
  """One query q_d [D]: [...] float32 logits."""
  return _logits(v, q_d[None], eps, key_norm)[0]


def _weights(logits_n, depth_weights: str):
  """[N, ...] logits -> [N, ...] weights: softmax over N, or sigmoid of each."""
  if depth_weights == 'sigmoid':
    return jax.nn.sigmoid(logits_n)
  return jax.nn.softmax(logits_n, axis=0)


def depth_attention_list(
  sources: Sequence[jax.Array],
  query,
  *,
  eps: float = 1e-6,
  key_norm: bool = True,
  depth_weights: str = 'softmax',
  return_weights: bool = False,
  out_dtype=None,
):
  """Depth attention over a sequence of sources.

  sources: N >= 1 arrays of one shape [..., D] (e.g. [B, T, D]); query: [D]; key_norm and
  depth_weights: the variant (module docstring). Returns h [..., D] in out_dtype (default: the
  sources' common dtype; computed in float32), and with return_weights=True also alpha [N, ...]
  float32 (sums to 1 over N with softmax; each in (0, 1) with sigmoid).
  """
  _check_variant(key_norm, depth_weights, 'depth_attention')
  sources = list(sources)
  if not sources:
    raise ValueError('depth_attention needs at least one source')
  shape = sources[0].shape
  if any(v.shape != shape for v in sources) or query.shape != shape[-1:]:
    raise ValueError(
      f'depth_attention: sources must share one shape [..., D] and query be [D]; got '
      f'sources {[v.shape for v in sources]}, query {query.shape}'
    )
  q_d = query.astype(jnp.float32)
  logits_n = jnp.stack([_logit(v, q_d, eps, key_norm) for v in sources])
  alpha_n = _weights(logits_n, depth_weights)
  h = alpha_n[0][..., None] * sources[0].astype(jnp.float32)
  for i in range(1, len(sources)):
    h = h + alpha_n[i][..., None] * sources[i].astype(jnp.float32)
  out_dtype = out_dtype or jnp.result_type(*sources)
  h = h.astype(out_dtype)
  return (h, alpha_n) if return_weights else h


def depth_attention(sources, query, *, eps: float = 1e-6, key_norm: bool = True, depth_weights: str = 'softmax'):
  """sources [N, B, T, D] (any [N, ..., D]), query [D] -> h [B, T, D] in the sources' dtype.

  Defaults (docs/attention_residuals.md): alpha_i = softmax over N of query . rms_normalise(sources[i]) (float32,
  keys without gain, no 1/sqrt(d)); h = sum_i alpha_i sources[i], summed in float32.
  key_norm=False: the logits are query . sources[i]; depth_weights='sigmoid': alpha_i is the
  sigmoid of each logit (module docstring).
  """
  if sources.ndim < 2:
    raise ValueError(f'depth_attention expects sources [N, ..., D]; got shape {sources.shape}')
  return depth_attention_list(
    [sources[i] for i in range(sources.shape[0])], query, eps=eps, key_norm=key_norm, depth_weights=depth_weights
  )


def _phase1_xla(sources, queries, eps, spec, key_norm, depth_weights, settings):
  del spec, settings
  q_sd = queries.astype(jnp.float32)
  logits = jnp.stack([_logits(v, q_sd, eps, key_norm) for v in sources])  # [n, S, ...]
  lse = jax.nn.logsumexp(logits, axis=0)
  alpha = jax.nn.sigmoid(logits) if depth_weights == 'sigmoid' else jnp.exp(logits - lse)
  # All S outputs as one [..., S, D] array: one fusion reads each source once for all of them.
  o_all = sum(
    jnp.moveaxis(alpha[i], 0, -1)[..., None] * v.astype(jnp.float32)[..., None, :] for i, v in enumerate(sources)
  ).astype(sources[0].dtype)
  return tuple(o_all[..., j, :] for j in range(q_sd.shape[0])), lse, sources


def _phase1_pallas(sources, queries, eps, spec, key_norm, depth_weights, settings):
  del key_norm, depth_weights  # the default only (phase1 checks): the kernels' maths
  from kernels_pallas.attnres.phase1 import phase1 as kernel  # imports the Triton lowering
  from kernels_pallas.common import kernels_interpreted

  run = lambda vs, q: kernel(vs, q, eps=eps, settings=settings, interpret=kernels_interpreted())
  lead = lead_spec(spec, sources[0].ndim)
  return run_per_shard(
    run,
    (sources, queries),
    in_specs=((P(*lead, None),) * len(sources), P()),
    out_specs=((P(*lead, None),) * queries.shape[0], P(None, *lead), (P(*lead, None),) * len(sources)),
  )


def _merge_norm_xla(
  o, lse, partial, query, scale, eps, norm_eps, dtype, addend, spec, key_norm, depth_weights, settings
):
  del spec, settings
  partial = partial if addend is None else partial + addend
  h = merge_partial(o, lse, partial, query, eps=eps, key_norm=key_norm, depth_weights=depth_weights)
  return (rms_normalise(h, norm_eps) * scale).astype(dtype), partial


def _merge_norm_pallas(
  o, lse, partial, query, scale, eps, norm_eps, dtype, addend, spec, key_norm, depth_weights, settings
):
  del key_norm, depth_weights  # the default only (merge_norm checks): the kernels' maths
  from kernels_pallas.attnres.merge_norm import merge_norm as kernel
  from kernels_pallas.common import kernels_interpreted

  run = lambda o, lse, p, y, q, g: kernel(
    o,
    lse,
    p,
    q,
    g,
    eps=eps,
    norm_eps=norm_eps,
    dtype=dtype,
    addend=y,
    settings=settings,
    interpret=kernels_interpreted(),
  )
  lead = lead_spec(spec, partial.ndim)
  rows = P(*lead, None)
  return run_per_shard(
    run,
    (o, lse, partial, addend, query, scale),
    in_specs=(rows, P(*lead), rows, None if addend is None else rows, P(), P()),
    out_specs=(rows, rows),
  )


def _phase1_settings(text: str):
  from kernels_pallas.attnres.settings import Phase1Settings

  return Phase1Settings.from_string(text)


def _merge_norm_settings(text: str):
  from kernels_pallas.attnres.settings import MergeNormSettings

  return MergeNormSettings.from_string(text)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of Block AttnRes's two phases (the signatures of phase1 and merge_norm
  below, arguments in order, eps, spec, key_norm, depth_weights and settings included).
  adds_in_merge: its merge_norm forms partial + addend in the same pass as the merge, one pass
  fewer than a separate add, so that a caller gains by handing it the addend rather than adding
  first. all_variants: it implements every (key_norm, depth_weights) of the module docstring;
  else only docs/attention_residuals.md's softmax over RMS-normalised keys (the dispatchers raise for the others).
  parse_phase1_settings, parse_merge_norm_settings: 'key=int/key=int' -> the settings its kernels
  take (None: it has no kernels and ignores the settings argument)."""

  phase1: Callable
  merge_norm: Callable
  adds_in_merge: bool
  all_variants: bool
  parse_phase1_settings: Callable[[str], object] | None = None
  parse_merge_norm_settings: Callable[[str], object] | None = None


IMPLS = types.MappingProxyType(
  {
    'xla': Implementation(_phase1_xla, _merge_norm_xla, adds_in_merge=False, all_variants=True),
    # Fused GPU kernels (kernels_pallas/attnres/), interpreted off the GPU; per shard under a mesh.
    'pallas': Implementation(
      _phase1_pallas,
      _merge_norm_pallas,
      adds_in_merge=True,
      all_variants=False,
      parse_phase1_settings=_phase1_settings,
      parse_merge_norm_settings=_merge_norm_settings,
    ),
  }
)


def is_default_variant(key_norm: bool, depth_weights: str) -> bool:
  """docs/attention_residuals.md's AttnRes: softmax over RMS-normalised keys (what every implementation runs)."""
  return key_norm is True and depth_weights == 'softmax'


def _implementation(impl: str, fn: str, key_norm: bool = True, depth_weights: str = 'softmax') -> Implementation:
  if impl not in IMPLS:
    raise ValueError(f'attnres {fn}: impl must be one of {tuple(IMPLS)}; got {impl!r}')
  _check_variant(key_norm, depth_weights, f'attnres {fn}')
  if not IMPLS[impl].all_variants and not is_default_variant(key_norm, depth_weights):
    raise ValueError(
      f"attnres {fn}: impl={impl!r} implements only key_norm=True, depth_weights='softmax' "
      f"(docs/attention_residuals.md); got key_norm={key_norm!r}, depth_weights={depth_weights!r}: use impl='xla'"
    )
  return IMPLS[impl]


def phase1(
  sources: Sequence[jax.Array],
  queries,
  *,
  eps: float = 1e-6,
  impl: str = 'xla',
  spec: P | None = None,
  key_norm: bool = True,
  depth_weights: str = 'softmax',
  settings=None,
):
  """Depth attention of S queries over the same n sources, for a block's S consumers at once.

  sources: n >= 1 arrays [..., D] of one shape and dtype; queries: [S, D] (effective queries,
  gains folded in). Returns (o, lse, sources): o a tuple of S arrays [..., D] in the sources'
  dtype (o_j = sum_i softmax_i(s_ji) v_i; with depth_weights='sigmoid' sum_i sigmoid(s_ji) v_i),
  lse [S, ...] float32 (logsumexp_i s_ji), s_ji = q_j . rms_normalise(v_i) (key_norm=False:
  q_j . v_i), and the sources unchanged: take their later uses from here, so that with
  'pallas' their gradient is added inside the backward kernel rather than in separate XLA adds.
  impl: a key of IMPLS ('pallas' only for the default variant). Under a mesh of several devices
  made current by jax.set_mesh (as the train step does) 'pallas' runs per shard (shard_map) with
  the sources laid out as `spec` (their feature axis unsharded). One source (block 0) under
  softmax needs no implementation: o_j is that source and lse_j its logit. settings: the kernels'
  settings of an implementation that has them ('pallas': a Phase1Settings of
  kernels_pallas/attnres/settings.py); None: their defaults.
  """
  sources = tuple(sources)
  shape = sources[0].shape if sources else None
  if (
    not sources
    or any(v.shape != shape or v.dtype != sources[0].dtype for v in sources)
    or queries.ndim != 2
    or queries.shape[1:] != shape[-1:]
  ):
    raise ValueError(
      f'attnres phase1: sources must share one shape [..., D] and dtype, queries be '
      f'[S, D]; got sources {[(v.shape, str(v.dtype)) for v in sources]}, queries '
      f'{queries.shape}'
    )
  implementation = _implementation(impl, 'phase1', key_norm, depth_weights)
  if len(sources) == 1 and depth_weights == 'softmax':
    return ((sources[0],) * queries.shape[0], _logits(sources[0], queries.astype(jnp.float32), eps, key_norm), sources)
  return implementation.phase1(sources, queries, eps, spec, key_norm, depth_weights, settings)


def merge_partial(o, lse, partial, query, *, eps: float = 1e-6, key_norm: bool = True, depth_weights: str = 'softmax'):
  """Phase 2: one consumer's input from its phase-1 output o [..., D] and lse [...] and its
  block's partial sum p [..., D] with query [D], in p's dtype, computed in float32:
  softmax: sigma o + (1 - sigma) p, sigma = sigmoid(lse - s_p); sigmoid: o + sigmoid(s_p) p
  (lse unused); s_p = q . rms_normalise(p), or q . p with key_norm=False."""
  _check_variant(key_norm, depth_weights, 'attnres merge_partial')
  s_p = _logit(partial, query.astype(jnp.float32), eps, key_norm)
  if depth_weights == 'sigmoid':
    h = o.astype(jnp.float32) + jax.nn.sigmoid(s_p)[..., None] * partial.astype(jnp.float32)
  else:
    sigma = jax.nn.sigmoid(lse - s_p)[..., None]
    h = sigma * o.astype(jnp.float32) + (1 - sigma) * partial.astype(jnp.float32)
  return h.astype(partial.dtype)


def merge_norm(
  o,
  lse,
  partial,
  query,
  scale,
  *,
  eps: float = 1e-6,
  norm_eps: float = 1e-6,
  dtype=jnp.float32,
  addend=None,
  impl: str = 'xla',
  spec: P | None = None,
  key_norm: bool = True,
  depth_weights: str = 'softmax',
  settings=None,
):
  """Phase 2 and the consumer's pre-norm in one call. o, partial [..., D]; lse [...]; query,
  scale [D] (the pre-norm's gain); addend: None, or a sublayer output [..., D] not yet added to
  the partial sum. Returns (x, p): x = scale * rms_normalise(merge_partial(o, lse, p, query),
  norm_eps) in `dtype` with p = partial (+ addend), and p, for the caller's later uses of it.
  'xla': merge_partial (any variant), then the RMSNorm formula; 'pallas' (the default variant
  only): fused kernels that never write the merged input, add the addend in the same pass, and
  add the gradient of p's later uses inside the backward kernel; under a mesh they run per
  shard, as phase1 does (the gradients of query and scale summed over shards). settings: as
  phase1's ('pallas': a MergeNormSettings)."""
  return _implementation(impl, 'merge_norm', key_norm, depth_weights).merge_norm(
    o, lse, partial, query, scale, eps, norm_eps, dtype, addend, spec, key_norm, depth_weights, settings
  )
