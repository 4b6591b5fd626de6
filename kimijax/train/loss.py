"""The cross-entropy computed chunk by chunk from the final hidden states (train.loss_chunk > 0), so that
the float32 logits [B, T, V] never exist at once: only one chunk's [chunk, V] does, in the forward
and again in the backward, which recomputes it (docs/training.md#chunked-loss)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimijax.model import head_logits


def token_nll(logits_xv, targets_x):
  """Per-token negative log-likelihood [...] in float32 of logits [..., V] and int targets [...]."""
  logp = jax.nn.log_softmax(logits_xv.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets_x[..., None], axis=-1)[..., 0]


def nll_and_hits(logits_xv, targets_x, accuracy: bool):
  """token_nll, and with `accuracy` also the argmax hits [...] float32 (1 where the argmax logit is
  the target): (nll, hits)."""
  nll = token_nll(logits_xv, targets_x)
  if not accuracy:
    return nll
  return nll, (jnp.argmax(logits_xv, axis=-1) == targets_x).astype(jnp.float32)


def chunked_token_nll(x_btd, head_dv, targets_bt, chunk: int, *, accuracy: bool = False):
  """Per-token negative log-likelihood [B, T] float32 (and, with `accuracy`, the argmax hits [B, T]
  float32, 1 where the argmax logit is the target) of the logits x_btd @ head_dv, `chunk` tokens at
  a time.

  x_btd: the final normed hidden states in the compute dtype; head_dv [D, V] float32, cast to
  x_btd's dtype in each chunk. Each chunk's logits are computed as Transformer's head computes them
  (kimijax.model.head_logits: compute-dtype matmul, float32 result, compute-dtype cotangent), under
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
    return nll_and_hits(head_logits(x_cd, head_dv, dtype, ('act_batch', 'act_vocab')), targets_c, accuracy)

  _, out = jax.lax.scan(lambda carry, xs: (carry, one_chunk(head_dv, *xs)), None, (x_kcd, targets_kc))
  # [n, chunk] -> the tokens' order, padding dropped
  return jax.tree.map(lambda y_kc: y_kc.swapaxes(0, 1).reshape(n * chunk)[:tokens].reshape(b, t), out)
