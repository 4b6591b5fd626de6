"""The cross-entropy computed chunk by chunk from the final hidden states (train.loss_chunk > 0), so that
the float32 logits [B, T, V] never exist at once: only one chunk's [chunk, V] does, in the forward
and again in the backward, which recomputes it (docs/training.md#chunked-loss)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.model import cotangent_in


def chunked_token_nll(x_btd, head_dv, targets_bt, chunk: int, *, accuracy: bool = False):
  """Per-token negative log-likelihood [B, T] float32 (and, with `accuracy`, the argmax hits [B, T]
  float32, 1 where the argmax logit is the target) of the logits x_btd @ head_dv, `chunk` tokens at
  a time.

  x_btd: the final normed hidden states in the compute dtype; head_dv [D, V] float32, cast to
  x_btd's dtype in each chunk. Each chunk's logits are computed as Transformer's head computes them
  (compute-dtype matmul, float32 result, compute-dtype cotangent: kimijax.model.cotangent_in), under
  jax.checkpoint inside a scan, so the backward recomputes them instead of keeping them; the
  head's gradient is summed over chunks in float32.

  The B * T tokens form n = ceil(B T / chunk) chunks of ceil(B T / n) <= chunk tokens each (fewer
  than n padding tokens in all, at the end of the token order), taken strided: chunk j holds tokens
  j, j + n, j + 2n, ..., so that a batch split over devices splits each chunk the same way. Padding
  tokens are computed and dropped."""
  b, t, d = x_btd.shape
  tokens = b * t
  n = -(-tokens // min(chunk, tokens))
  chunk = -(-tokens // n)
  pad = n * chunk - tokens
  dtype = x_btd.dtype
  x_nd = jnp.pad(x_btd.reshape(tokens, d), ((0, pad), (0, 0)))
  targets_n = jnp.pad(targets_bt.reshape(tokens), (0, pad))
  # [chunk, n] -> [n, chunk]: chunk j is column j, one token of every n
  x_kcd = x_nd.reshape(chunk, n, d).swapaxes(0, 1)
  targets_kc = targets_n.reshape(chunk, n).swapaxes(0, 1)

  @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan, CSE cannot undo the remat
  def one_chunk(head_dv, x_cd, targets_c):
    logits_cv = jnp.einsum('cd,dv->cv', x_cd, head_dv.astype(dtype), preferred_element_type=jnp.float32)
    logits_cv = cotangent_in(logits_cv, dtype)
    logits_cv = nn.with_logical_constraint(logits_cv, ('act_batch', 'act_vocab'))
    logp_cv = jax.nn.log_softmax(logits_cv, axis=-1)
    nll_c = -jnp.take_along_axis(logp_cv, targets_c[:, None], axis=-1)[:, 0]
    if not accuracy:
      return nll_c
    return nll_c, (jnp.argmax(logits_cv, axis=-1) == targets_c).astype(jnp.float32)

  _, out = jax.lax.scan(lambda carry, xs: (carry, one_chunk(head_dv, *xs)), None, (x_kcd, targets_kc))
  # [n, chunk] -> the tokens' order, padding dropped
  return jax.tree.map(lambda y_kc: y_kc.swapaxes(0, 1).reshape(n * chunk)[:tokens].reshape(b, t), out)
