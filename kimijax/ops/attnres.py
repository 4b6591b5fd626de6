"""Depth attention, the aggregation of Attention Residuals (SPEC §4).

A consumer (a sublayer, or the final aggregator) forms its input as a softmax-weighted mix of
earlier sources (the embedding and sublayer outputs, or block sums of them), per token:

    h = sum_i alpha_i v_i,   alpha = softmax_i( q . v_i / rms(v_i) ),   rms(v) = sqrt(mean_d v^2 + eps)

Keys are the RMS-normalised sources with no gain; values are the raw sources; there is no
1/sqrt(d). Logits, softmax and the weighted sum run in float32 whatever the sources' dtype.

Key-norm gain: SPEC §4 gives each consumer a learned gain g on the key RMSNorm. Since
q . (g * v / rms(v)) = (q * g) . (v / rms(v)), the model passes q = w * g here (w the
pseudo-query, g the gain, both its parameters) and this op stays gain-free.

Two forms with the same maths:
  depth_attention(sources [N, ..., D], query [D])        the stacked form (public contract)
  depth_attention_list([v_0, ..., v_{N-1}], query [D])    a Python sequence of [..., D] arrays,
      so that a model can mix completed block sums and a running partial sum without stacking
      (stacking would copy every source at every consumer).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def _logit(v, q_d, eps: float):
  """q . rms_normalise(v) over the last axis, float32: one pass over v for both reductions."""
  v = v.astype(jnp.float32)
  mean_sq = jnp.mean(v * v, axis=-1)
  # An elementwise product and a sum rather than a dot, so that no backend lowers it to a
  # reduced-precision (e.g. TF32) matmul.
  return jnp.sum(v * q_d, axis=-1) * jax.lax.rsqrt(mean_sq + eps)


def depth_attention_list(sources: Sequence[jax.Array], query, *, eps: float = 1e-6,
                         return_weights: bool = False, out_dtype=None):
  """Depth attention over a sequence of sources.

  sources: N >= 1 arrays of one shape [..., D] (e.g. [B, T, D]); query: [D].
  Returns h [..., D] in out_dtype (default: the sources' common dtype; computed in float32),
  and with return_weights=True also alpha [N, ...] float32 (sums to 1 over N).
  """
  sources = list(sources)
  if not sources:
    raise ValueError('depth_attention needs at least one source')
  shape = sources[0].shape
  if any(v.shape != shape for v in sources) or query.shape != shape[-1:]:
    raise ValueError(f'depth_attention: sources must share one shape [..., D] and query be [D]; got '
                     f'sources {[v.shape for v in sources]}, query {query.shape}')
  q_d = query.astype(jnp.float32)
  logits_n = jnp.stack([_logit(v, q_d, eps) for v in sources])
  alpha_n = jax.nn.softmax(logits_n, axis=0)
  h = alpha_n[0][..., None] * sources[0].astype(jnp.float32)
  for i in range(1, len(sources)):
    h = h + alpha_n[i][..., None] * sources[i].astype(jnp.float32)
  out_dtype = out_dtype or jnp.result_type(*sources)
  h = h.astype(out_dtype)
  return (h, alpha_n) if return_weights else h


def depth_attention(sources, query, *, eps: float = 1e-6):
  """sources [N, B, T, D] (any [N, ..., D]), query [D] -> h [B, T, D] in the sources' dtype.

  alpha_i = softmax over N of query . rms_normalise(sources[i]) (float32, keys without gain,
  no 1/sqrt(d)); h = sum_i alpha_i sources[i], summed in float32.
  """
  if sources.ndim < 2:
    raise ValueError(f'depth_attention expects sources [N, ..., D]; got shape {sources.shape}')
  return depth_attention_list([sources[i] for i in range(sources.shape[0])], query, eps=eps)
