"""One decoding token of a KDA layer's mixing (docs/kda.md) as one Pallas kernel: the short
convolutions and their activations, the decay gate and beta from their pre-activations, and the
state update (decay, delta write, read). A decode step's KDA layer then runs one kernel between
its projections and its output gate, where the composed form (KdaSettings.fused_decode=0) runs the
convolutions, activations and gates as XLA fusions before the step kernel (step.py).

One program = one (batch, head) and a block of value columns, the [K, BV] state slice in registers,
all arithmetic float32. With the convolutions (prefixes given), for each of q, k and v:

    z = sum_{j < W-1} w[j] prefix[j] + w[W-1] x,   new prefix = (prefix[1:], x)

then the layer's activations (kimijax.ops.kda.ACTIVATIONS, as the conv kernels evaluate them: SiLU,
and the L2 norm over K for q and k); without them the activations alone. Every program
of a (batch, head) computes q and k in full (K features) and writes the same new q and k prefixes;
v, its prefix and the state by its value columns."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kda.settings import checked
from kernels_pallas.kda.step import token_specs
from kernels_pallas.short_conv.conv import activate, sigmoid
from kimijax.ops.kda import ACTIVATIONS, gate_log_decay

F32 = jnp.float32


def _conv(x_ref, prefix_ref, w_ref, prefix_out_ref):
  """The conv of one token from its prefix [W-1, n] and taps [W, n] (float32), the new prefix
  written; x itself (float32) without a conv."""
  x = x_ref[...]
  if prefix_ref is None:
    return x.astype(F32)
  width = w_ref.shape[0]
  rows = [prefix_ref[j] for j in range(width - 1)]
  z = w_ref[width - 1] * x.astype(F32)
  for j in range(width - 1):
    z = z + w_ref[j] * rows[j].astype(F32)
  for j in range(width - 2):
    prefix_out_ref[j] = rows[j + 1]
  prefix_out_ref[width - 2] = x.astype(prefix_out_ref.dtype)
  return z


def _decode_kernel(*refs, scale, lower_bound, conv):
  inputs = 14 if conv else 8  # with the convs: the three prefixes and taps after the state
  q_ref, k_ref, v_ref, f_ref, b_ref, a_ref, dt_ref, s_ref = refs[:8]
  pq_ref, pk_ref, pv_ref, wq_ref, wk_ref, wv_ref = refs[8:inputs] or (None,) * 6
  o_ref, s_out_ref, *prefixes_out = refs[inputs:]
  pq_out, pk_out, pv_out = prefixes_out or (None,) * 3
  q = activate(_conv(q_ref, pq_ref, wq_ref, pq_out), ACTIVATIONS['q'])
  k = activate(_conv(k_ref, pk_ref, wk_ref, pk_out), ACTIVATIONS['k'])[:, None]  # [K, 1]
  v = activate(_conv(v_ref, pv_ref, wv_ref, pv_out), ACTIVATIONS['v'])
  g = gate_log_decay(f_ref[...].astype(F32) + dt_ref[...], jnp.exp(a_ref[...]), lower_bound)
  beta = sigmoid(b_ref[...].astype(F32))
  s = s_ref[...] * jnp.exp(g)[:, None]  # decay
  delta = beta * (v - jnp.sum(s * k, axis=0))
  s = s + k * delta[None, :]  # delta write
  o_ref[...] = jnp.sum(s * (scale * q)[:, None], axis=0).astype(o_ref.dtype)
  s_out_ref[...] = s


def kda_decode_pallas(
  q,
  k,
  v,
  f,
  b,
  state,
  a_log,
  dt_bias,
  *,
  prefixes=None,
  taps=None,
  scale,
  lower_bound=0.0,
  settings=None,
  interpret=False,
):
  """q, k, f [B, H, K] and v [B, H, V] (the projections, before the convs), b [B, H] (beta's
  pre-activation), state [B, H, K, V] float32, a_log [H], dt_bias [H, K]; with the convs,
  prefixes (q, k, v) [B, W-1, H, K or V] and taps (q, k, v) [W, H, K or V] float32.
  -> (o [B, H, V] in v's dtype, new state float32, new prefixes (in the prefixes' dtype) or None).
  K and V powers of two >= 16. settings: the KdaSettings whose warps_step, stages_step and
  value_block_step this kernel takes (None: the defaults)."""
  settings = checked(settings, 'kda_decode')
  conv = () if prefixes is None else (tuple(prefixes), tuple(taps))
  return _kda_decode_pallas(
    q,
    k,
    v,
    f,
    b,
    state,
    a_log,
    dt_bias,
    conv,
    scale=scale,
    lower_bound=float(lower_bound),
    settings=settings,
    interpret=interpret,
  )


@functools.partial(jax.jit, static_argnames=('scale', 'lower_bound', 'settings', 'interpret'))
def _kda_decode_pallas(q, k, v, f, b, state, a_log, dt_bias, conv, *, scale, lower_bound, settings, interpret):
  bsz, h, dk = q.shape
  dv = v.shape[-1]
  bv, vec, cols, state_spec = token_specs(dk, dv, settings)
  per_head = lambda *block: pl.BlockSpec((None,) + block, lambda bi, hi, j: (hi,) + (0,) * len(block))
  in_specs = [vec(dk), vec(dk), cols, vec(dk), vec(1), per_head(1), per_head(dk), state_spec]
  args = [q, k, v, f, b[..., None], a_log.astype(F32)[:, None], dt_bias.astype(F32), state.astype(F32)]
  out_specs = [cols, state_spec]
  out_shape = [jax.ShapeDtypeStruct((bsz, h, dv), v.dtype), jax.ShapeDtypeStruct(state.shape, F32)]
  if conv:
    prefixes, taps = conv
    width = taps[0].shape[0]
    prefix_spec = lambda d, j_block: pl.BlockSpec(
      (None, width - 1, None, d), lambda bi, hi, j: (bi, 0, hi, j if j_block else 0)
    )
    tap_spec = lambda d, j_block: pl.BlockSpec((width, None, d), lambda bi, hi, j: (0, hi, j if j_block else 0))
    in_specs += [prefix_spec(dk, False), prefix_spec(dk, False), prefix_spec(bv, True)]
    in_specs += [tap_spec(dk, False), tap_spec(dk, False), tap_spec(bv, True)]
    args += list(prefixes) + [w.astype(F32) for w in taps]
    out_specs += [prefix_spec(dk, False), prefix_spec(dk, False), prefix_spec(bv, True)]
    out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in prefixes]
  outs = pl.pallas_call(
    functools.partial(_decode_kernel, scale=scale, lower_bound=lower_bound, conv=bool(conv)),
    grid=(bsz, h, dv // bv),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    input_output_aliases={7: 1},
    compiler_params=settings.params('step', settings.stages_step),
    interpret=interpret,
    name='kda_decode',
  )(*args)
  return outs[0], outs[1], (tuple(outs[2:]) if conv else None)
