"""Phase 1 of Block Attention Residuals (docs/attention_residuals.md) as Pallas (Triton) kernels, forward and backward.

At the start of a block, the block's S consumers all attend over the same completed sources
v_1 .. v_n (the embedding and the block sums) with their own static queries q_j. Phase 1 does it
for all S at once, so each source is read a fixed number of times per block, not per consumer:

    s_ji = (q_j . v_i) * r_i,   r_i = rsqrt(mean_d v_i^2 + eps)      (per token, float32)
    lse_j = logsumexp_i s_ji,   o_j = sum_i exp(s_ji - lse_j) v_i

Each consumer later merges o_j with its block's partial sum (kimijax.ops.attnres.merge_norm;
with 'pallas' fused with its pre-norm in kernels_pallas/attnres/merge_norm.py).

This module holds the custom VJP that joins the kernels (M tokens, D features; the sources are
[M, D] in any float dtype): the logits and combine kernels forward (phase1_forward.py), the vdo
and grads kernels backward (phase1_backward.py). The softmax over n and the per-token backward
coefficients are [n, S, M] arrays, computed in XLA between the kernels. The backward maths
(dL/ds_ji = alpha_ji (g_ji - do_j . o_j + dlse_j), do_j . o_j = sum_i alpha_ji g_ji, g_ji = do_j . v_i):
    dv_i = sum_j alpha_ji do_j + r_i sum_j ds_ji q_j - (r_i^2 / D) (sum_j ds_ji s_ji) v_i
    dq_j = sum_tokens sum_i ds_ji r_i v_i
The two sums over features that are matrix products, q_j . v_i (over D) and dq_j (over tokens),
run on the tensor cores: bf16 operands, float32 accumulation, the float32 operand split into bf16
terms that sum to it exactly (bf16_split.py), so the products are those of float32. Everything
else is an elementwise multiply and sum in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels_pallas.attnres.bf16_split import source_parts, sum_terms, terms_side_by_side
from kernels_pallas.attnres.phase1_backward import grads_call, grads_kernel, vdo_call
from kernels_pallas.attnres.phase1_forward import combine_call, logits_call
from kernels_pallas.attnres.settings import Phase1Settings
from kernels_pallas.common import defvjp_with_symbolic_zeros, dense, is_zero, pad_rows, round_up

__all__ = ['MAX_QUERIES', 'Phase1Settings', 'phase1']

MAX_QUERIES = 16  # queries per kernel call; more run in groups


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _phase1(sources, queries, eps, settings, interpret):
  return _phase1_fwd(sources, queries, eps, settings, interpret)[0]


def _phase1_fwd(sources, queries, eps, settings, interpret):
  s = queries.shape[0]
  q_parts = terms_side_by_side(queries.T, axis=1)  # [D, N]
  terms, r = logits_call(sources, q_parts, eps, settings, interpret)
  logits = sum_terms(terms, s, axis=2).transpose(0, 2, 1)  # [n, S, M]
  lse = jax.nn.logsumexp(logits, axis=0)  # [S, M]
  alpha = jnp.exp(logits - lse)  # [n, S, M]
  outs = combine_call(sources, alpha, settings, interpret)
  return (tuple(outs), lse, sources), (sources, queries, logits, r, lse)


def _phase1_bwd(eps, settings, interpret, res, cotangents):
  del eps
  sources, queries, logits, r, lse = res
  d_outs, d_lse, d_sources_in = cotangents
  n, (m, d), s = len(sources), sources[0].shape, lse.shape[0]
  d_outs = [dense(x, (m, d), sources[0].dtype).astype(sources[0].dtype) for x in d_outs]
  d_lse = dense(d_lse, lse.shape, jnp.float32)
  # Sources whose pass-through is unused (the last block's) need no gradient added: a kernel
  # without those inputs, rather than reading n arrays of zeros.
  accumulate = not all(is_zero(x) for x in d_sources_in)
  d_sources_in = [dense(x, v.shape, v.dtype) for x, v in zip(d_sources_in, sources)] if accumulate else []
  vdo = vdo_call(d_outs, sources, settings, interpret)
  alpha = jnp.exp(logits - lse)  # [n, S, M]
  d_logits = alpha * (vdo - jnp.sum(alpha * vdo, axis=0) + d_lse)
  b = d_logits * r[:, None]
  c = -(r * r / d) * jnp.sum(d_logits * logits, axis=1)  # [n, M]
  b_parts = terms_side_by_side(b, axis=1)  # [n, N, M], for the dq dots
  kernel = functools.partial(
    grads_kernel, n=n, s=s, bt=settings.bt_grads, accumulate=accumulate, source_parts=source_parts(sources)
  )
  d_sources, dq_parts = grads_call(
    kernel, d_outs, sources, d_sources_in, (alpha, b, c, queries, b_parts), settings, interpret
  )
  return tuple(d_sources), sum_terms(jnp.sum(dq_parts, axis=0), s, axis=0)


defvjp_with_symbolic_zeros(_phase1, _phase1_fwd, _phase1_bwd, num_diff_args=2)


def phase1(sources, queries, *, eps: float = 1e-6, settings=None, interpret: bool = False):
  """sources: n >= 1 arrays [..., D] of one shape and dtype; queries [S, D]; settings: the kernels'
  Phase1Settings (None: the defaults).
  Returns (o: S arrays [..., D] in the sources' dtype, lse [S, ...] float32, the sources again).
  Take later uses of the sources from the third output: their gradient then reaches the
  backward `grads` kernel, which adds it to its own in the same pass (else XLA adds the two
  separately). Differentiable in sources and queries."""
  sources = tuple(sources)
  shape, s = sources[0].shape, queries.shape[0]
  if s < 1 or queries.shape[1:] != shape[-1:]:
    raise ValueError(f'attnres phase1: queries must be [S, {shape[-1]}]; got {queries.shape}')
  if s > MAX_QUERIES:
    outs, lses = (), []
    for k in range(0, s, MAX_QUERIES):
      o, lse, sources = phase1(sources, queries[k : k + MAX_QUERIES], eps=eps, settings=settings, interpret=interpret)
      outs, lses = outs + o, lses + [lse]
    return outs, jnp.concatenate(lses), sources
  settings = Phase1Settings() if settings is None else settings
  if not isinstance(settings, Phase1Settings):
    raise TypeError(
      f'attnres phase1: settings must be a Phase1Settings (kernels_pallas/attnres/settings.py) '
      f'or None, got {type(settings).__name__}'
    )
  return _phase1_flat(sources, queries, eps=float(eps), settings=settings, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=('eps', 'settings', 'interpret'))
def _phase1_flat(sources, queries, *, eps, settings, interpret):
  """phase1 after its checks, under one jax.jit shared by every call of the same shapes and
  settings (kernels_pallas/__init__.py)."""
  shape, s = sources[0].shape, queries.shape[0]
  d, m = shape[-1], math.prod(shape[:-1])
  m_pad = round_up(m, math.lcm(settings.bt, settings.rows_grads, settings.bt_vdo, settings.bt_logits))
  # Padded with ones: a zero row would give r = rsqrt(eps), infinite for eps = 0. The padded rows'
  # outputs are dropped, so their cotangents, and their share of every gradient, are zero.
  flat = tuple(pad_rows(v.reshape(m, d), m_pad, value=1) for v in sources)
  # float32 queries into the custom VJP: the cast's transpose gives dq the queries' own dtype.
  outs, lse, flat = _phase1(flat, queries.astype(jnp.float32), eps, settings, interpret)
  unflat = lambda x: x[:m].reshape(shape)
  return (tuple(map(unflat, outs)), lse[:, :m].reshape((s,) + shape[:-1]), tuple(map(unflat, flat)))
