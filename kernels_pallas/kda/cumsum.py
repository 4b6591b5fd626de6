"""Within-chunk cumulative sums of [B, T, H, K] tensors (docs/kda.md: G = cumsum of g per chunk), with
the KDA gate optionally fused in.

One program per (batch, head, chunk) and slice of features holds its [C, K'] block. The inclusive
sum (G from g, forward) is a scan down the block's rows. The reverse inclusive sum (dg from dG,
backward; the Triton backend has no reverse scan) is the column total minus the same forward scan
plus the row, in float32 (its rounding is a few ulp of the column's partial sums), and adds a
per-chunk row (the gradient of the chunk's total decay, which every g of the chunk receives).
Either way one read and one write of the tensor. Forms measured before on an H200
(experiments/results/bench_kda.md): XLA's cumulative sum over the chunk axis (about 2x the
forward's time), the triangle of ones as a float32 dot (5x) and as three bf16 dots on the tensor
cores (0.50 ms against the scan's 0.33 at the hybrid step's shape, with the gate).

With the gate fused (docs/kda.md's decay gate, kimijax.ops.kda.gate_log_decay), the forward reads the gate's
pre-activation f in its own dtype (bf16 in a bf16 model) instead of a float32 g that XLA wrote,
and the reverse sum goes on through the gate's derivative: it writes df in f's dtype and, per
chunk, the row sums that become the gradients of dt_bias and A_log. Rows at or past `t_valid`
(the op's padding of T) get g = 0 and no gradient. With a reset input (document masking: int32
[B, T], nonzero at each document's first token but the row's first) the rows it marks get g =
RESET_LOG_DECAY, a decay of exactly zero, in place of the gate's, and no gradient into f, dt_bias or
A_log; without it the kernels are the unmasked programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kda.blocks import F32
from kimijax.ops.kda import RESET_LOG_DECAY, gate_derivatives, gate_log_decay


def _valid_rows(c, t_valid):
  """[C, 1] bool: the rows of this program's chunk (grid axis 2) before t_valid."""
  row = pl.program_id(2) * c + jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
  return row < t_valid


def _reverse_sum(x):
  """Per column, the sum from each row to the last of x [C, K] float32: the column total minus
  the inclusive sum above, plus the row (see the module docstring)."""
  return jnp.sum(x, axis=0, keepdims=True) - jnp.cumsum(x, axis=0) + x


def chunk_cumsum_kernel(x_ref, *refs, reverse):
  """refs: (o_ref,), or with reverse (add_ref, o_ref): add [K] added to every row of the result."""
  *add_ref, o_ref = refs
  x = x_ref[...].astype(F32)
  if not reverse:
    o_ref[...] = jnp.cumsum(x, axis=0)
    return
  total = _reverse_sum(x)
  o_ref[...] = total + add_ref[0][...][None, :] if add_ref else total


def _reset_rows(reset_ref):
  """[C, 1] bool: the rows of this program's chunk that start a document (the reset input)."""
  return (reset_ref[...] != 0)[:, None]


def gated_cumsum_kernel(f_ref, a_ref, bias_ref, *refs, lower_bound, t_valid):
  """G = cumsum of g = gate_log_decay(f + dt_bias) down the chunk; a_ref, bias_ref: [K] rows of
  exp(A_log) and dt_bias for this head. t_valid None: every row is valid. refs: (o_ref,), or
  (reset_ref, o_ref) with document resets ([C] int32 rows: g = RESET_LOG_DECAY where nonzero)."""
  *reset_ref, o_ref = refs
  x = f_ref[...].astype(F32) + bias_ref[...][None, :]
  g = gate_log_decay(x, a_ref[...][None, :], lower_bound)
  if reset_ref:
    g = jnp.where(_reset_rows(reset_ref[0]), RESET_LOG_DECAY, g)
  if t_valid is not None:
    g = jnp.where(_valid_rows(g.shape[0], t_valid), g, 0.0)
  o_ref[...] = jnp.cumsum(g, axis=0)


def gated_reverse_cumsum_kernel(x_ref, add_ref, f_ref, a_ref, bias_ref, *refs, lower_bound, t_valid):
  """dg = reverse sum of dG plus the chunk-end row, then through the gate: df = dg dg/dx (f's
  dtype) and this chunk's column sums of df (dt_bias's gradient) and of dg dg/dA_log (A_log's,
  before the sum over features). refs: (df_ref, dbias_ref, dalog_ref), after reset_ref with
  document resets (whose rows' g was forced: no gradient reaches the gate from them)."""
  *reset_ref, df_ref, dbias_ref, dalog_ref = refs
  dg = _reverse_sum(x_ref[...].astype(F32)) + add_ref[...][None, :]
  x = f_ref[...].astype(F32) + bias_ref[...][None, :]
  dg_dx, dg_dalog = gate_derivatives(x, a_ref[...][None, :], lower_bound)
  if t_valid is not None:
    dg = jnp.where(_valid_rows(dg.shape[0], t_valid), dg, 0.0)
  if reset_ref:
    dg = jnp.where(_reset_rows(reset_ref[0]), 0.0, dg)
  dx = dg * dg_dx
  df_ref[...] = dx.astype(df_ref.dtype)
  dbias_ref[...] = jnp.sum(dx, axis=0)
  dalog_ref[...] = jnp.sum(dg * dg_dalog, axis=0)
