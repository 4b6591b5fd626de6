"""One decoding token of KDA (docs/kda.md) as one Pallas kernel: the state is read once and written
once (in place when the caller donates it).

One program = one (batch, head) and a block of value columns, the [K, BV] state slice in
registers: decay, delta write, read, all float32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kda.settings import KdaSettings, checked

F32 = jnp.float32


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, scale):
  k = k_ref[...].astype(F32)[:, None]  # [K, 1]
  s = s_ref[...] * jnp.exp(g_ref[...].astype(F32))[:, None]  # decay
  delta = beta_ref[...].astype(F32) * (v_ref[...].astype(F32) - jnp.sum(s * k, axis=0))
  s = s + k * delta[None, :]  # delta write
  o_ref[...] = jnp.sum(s * (scale * q_ref[...].astype(F32))[:, None], axis=0).astype(o_ref.dtype)
  s_out_ref[...] = s


def kda_step_pallas(q, k, v, g, beta, state, *, scale, settings=None, interpret=False):
  """q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V] float32 -> (o [B, H, V] in v's
  dtype, new state float32). K and V powers of two >= 16. settings: the KdaSettings whose
  warps_step, stages_step and value_block_step this kernel takes (None: the defaults)."""
  settings = checked(settings, 'kda_step')
  return _kda_step_pallas(q, k, v, g, beta, state, scale=scale, settings=settings, interpret=interpret)


def token_specs(dk: int, dv: int, settings: KdaSettings):
  """The value block bv and the block specs of a decode kernel's grid (B, H, V / bv): vec(d), a
  [d] vector of the program's (batch, head); cols, its [bv] value columns; state, its [K, bv]
  state slice."""
  bv = min(dv, settings.value_block_step)
  vec = lambda d: pl.BlockSpec((None, None, d), lambda bi, hi, j: (bi, hi, 0))
  cols = pl.BlockSpec((None, None, bv), lambda bi, hi, j: (bi, hi, j))
  state = pl.BlockSpec((None, None, dk, bv), lambda bi, hi, j: (bi, hi, 0, j))
  return bv, vec, cols, state


@functools.partial(jax.jit, static_argnames=('scale', 'settings', 'interpret'))
def _kda_step_pallas(q, k, v, g, beta, state, *, scale, settings, interpret):
  b, h, dk = q.shape
  dv = v.shape[-1]
  bv, vec, cols, state_spec = token_specs(dk, dv, settings)
  return pl.pallas_call(
    functools.partial(_step_kernel, scale=scale),
    grid=(b, h, dv // bv),
    in_specs=[
      vec(dk),
      vec(dk),
      cols,
      vec(dk),
      pl.BlockSpec((None, None, 1), lambda bi, hi, j: (bi, hi, 0)),
      state_spec,
    ],
    out_specs=[cols, state_spec],
    out_shape=[jax.ShapeDtypeStruct((b, h, dv), v.dtype), jax.ShapeDtypeStruct(state.shape, F32)],
    input_output_aliases={5: 1},
    compiler_params=settings.params('step', settings.stages_step),
    interpret=interpret,
    name='kda_step',
  )(q, k, v, g, beta[..., None], state.astype(F32))
