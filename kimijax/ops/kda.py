"""Kimi Delta Attention (KDA) ops: the recurrence, its exact chunkwise form, a decode step (docs/kda.md).

Per batch row and head, with state S [K, V] in float32, one token t does (decay, delta write, read):

    S <- Diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)

`kda_recurrent` scans that over time (the reference); `kda_chunk` computes the same thing a chunk
of C tokens at a time with the WY/UT form of docs/kda.md (matmuls inside a chunk, a scan over chunks
for the state); `kda_step` is one token for decoding, `kda_decode` a KDA layer's decode token from
its projections (short convolutions, activations and gates, then the step); `kda`, `kda_step` and
`kda_decode` dispatch (`impl=...`) to one of IMPLS, the implementations by name: 'xla' (kda_chunk; the default),
'xla_recurrent' (kda_recurrent) and 'pallas' (the fused kernels of kernels_pallas/kda, interpreted
off the GPU, which take their Triton settings as `settings=`). Layout: q, k, g [B, T, H, K]; v
[B, T, H, V]; beta [B, T, H] (after the sigmoid); g is the per-channel log-decay (<= 0); q and k
arrive L2-normalised; states [B, H, K, V] float32. `kda(..., a_log=, dt_bias=)` takes the decay
gate's pre-activation in place of g and forms the log-decay itself (`kda_log_decay`; fused into
the kernels under 'pallas', which import the gate's maths from here).
`kda(..., segment_ids=)` keeps the packed documents of a row apart: the state restarts from zero
at each segment's first token (kimijax/ops/segments.py; the row's first segment continues from
the initial state). A restart is a decay of exactly zero, so every implementation takes it as the
log-decay RESET_LOG_DECAY at that token in place of g (`reset_log_decay`; under 'pallas' with the
gate fused, inside the cumulative-sum kernels), which no gradient flows through (docs/kda.md).
All arithmetic is float32 whatever the input dtype; outputs take v's dtype. fp32 matmuls follow
jax's default matmul precision (TF32 on NVIDIA GPUs unless `jax.default_matmul_precision('highest')`),
except the chunk form's small triangular inverse, always in full float32.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from kimijax.ops.segments import segment_starts

# checkpoint_name of the residuals worth keeping, in every implementation (the chunk form's
# per-chunk states; the fused kernels' aqk and T): a caller that rematerialises around the op with
# jax.checkpoint_policies.save_only_these_names(SAVED) keeps them and recomputes the rest.
SAVED = 'kda_saved'
_EXACT = lax.Precision.HIGHEST
_SUB = 16  # sub-chunk length inside a chunk (the anchoring unit of the chunk form)
# Chunks whose intra-chunk part is computed together are grouped so that its largest transient, the
# [group, B, H, C, 16, K] decay factors, holds about this many float32 (and the backward recomputes
# one group at a time). On CPU cache-sized groups measured fastest; accelerators want big batches.
_GROUP_ELEMENTS = {'cpu': 1 << 19}
_GROUP_ELEMENTS_DEFAULT = 1 << 24
# The log-decay of a document's first token under segment_ids: exp(-128) is 0 in float32 (below
# its smallest subnormal, e^-103.3), so the state that enters the token is dropped exactly, and
# every decay factor exp(G_r - G_i) across the token is 0 as well. As small a magnitude as that
# allows: the chunk forms subtract cumulative sums that include it, which costs them absolute
# precision in proportion (ulp(128) = 1.5e-5 in float32; docs/kda.md).
RESET_LOG_DECAY = -128.0
# A KDA layer's activations of q, k and v after their short convolutions (kimijax.ops.short_conv's
# names): SiLU, and the L2 norm over K that the recurrence's contract asks of q and k.
ACTIVATIONS = types.MappingProxyType({'q': 'silu_l2', 'k': 'silu_l2', 'v': 'silu'})


# ----------------------------------------------------------------------------- validation


def _fmt(shape) -> str:
  return '[' + ', '.join(str(int(d)) for d in shape) + ']'


def _check_float(fn, **arrays):
  for name, x in arrays.items():
    if x is not None and not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
      raise ValueError(f'{fn}: {name} must be a floating-point array, got dtype {jnp.asarray(x).dtype}')


def _check_sequence_inputs(fn, q, k, v, g, beta, initial_state):
  """Shape and dtype checks for the [B, T, H, *] entry points; returns (B, T, H, K, V)."""
  _check_float(fn, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
  if q.ndim != 4:
    raise ValueError(f'{fn}: q must be [B, T, H, K], got shape {_fmt(q.shape)}')
  b, t, h, dk = q.shape
  if k.shape != q.shape or g.shape != q.shape:
    raise ValueError(
      f'{fn}: q, k and g must have the same shape [B, T, H, K]; got q {_fmt(q.shape)}, '
      f'k {_fmt(k.shape)}, g {_fmt(g.shape)}'
    )
  if v.ndim != 4 or v.shape[:3] != (b, t, h):
    raise ValueError(
      f'{fn}: v must be [B, T, H, V] with B, T, H = {b}, {t}, {h} as in q {_fmt(q.shape)}; got v {_fmt(v.shape)}'
    )
  if beta.shape != (b, t, h):
    raise ValueError(
      f'{fn}: beta must be [B, T, H] = {_fmt((b, t, h))} (one scalar per token and '
      f'head, after the sigmoid); got beta {_fmt(beta.shape)}'
    )
  dv = v.shape[-1]
  if initial_state is not None and initial_state.shape != (b, h, dk, dv):
    raise ValueError(
      f'{fn}: initial_state must be [B, H, K, V] = {_fmt((b, h, dk, dv))} for q '
      f'{_fmt(q.shape)} and v {_fmt(v.shape)}; got {_fmt(initial_state.shape)}'
    )
  if t == 0:
    raise ValueError(f'{fn}: the sequence is empty (T = 0), q {_fmt(q.shape)}')
  return b, t, h, dk, dv


def _check_step_inputs(q, k, v, g, beta, state, fn='kda_step', g_name='g', beta_name='beta'):
  """g_name, beta_name: how the caller names its gate and beta arguments (kda_decode: f, beta_logit)."""
  _check_float(fn, **{'q': q, 'k': k, 'v': v, g_name: g, beta_name: beta, 'state': state})
  if q.ndim != 3:
    raise ValueError(f'{fn}: q must be [B, H, K] (one token), got shape {_fmt(q.shape)}')
  b, h, dk = q.shape
  if k.shape != q.shape or g.shape != q.shape:
    raise ValueError(
      f'{fn}: q, k and {g_name} must have the same shape [B, H, K]; got q {_fmt(q.shape)}, '
      f'k {_fmt(k.shape)}, {g_name} {_fmt(g.shape)}'
    )
  if v.ndim != 3 or v.shape[:2] != (b, h):
    raise ValueError(f'{fn}: v must be [B, H, V] with B, H = {b}, {h} as in q {_fmt(q.shape)}; got v {_fmt(v.shape)}')
  if beta.shape != (b, h):
    raise ValueError(f'{fn}: {beta_name} must be [B, H] = {_fmt((b, h))}; got {beta_name} {_fmt(beta.shape)}')
  if state.shape != (b, h, dk, v.shape[-1]):
    raise ValueError(f'{fn}: state must be [B, H, K, V] = {_fmt((b, h, dk, v.shape[-1]))}; got {_fmt(state.shape)}')


def _check_gate(a_log, dt_bias, lower_bound, h, dk):
  if (a_log is None) != (dt_bias is None):
    raise ValueError(
      'kda: a_log and dt_bias come together (the decay gate) or not at all; got '
      f'{"a_log" if dt_bias is None else "dt_bias"} alone'
    )
  if a_log is None:
    return
  _check_float('kda', a_log=a_log, dt_bias=dt_bias)
  if a_log.shape != (h,) or dt_bias.shape != (h, dk):
    raise ValueError(
      f'kda: the gate needs a_log [H] = {_fmt((h,))} and dt_bias [H, K] = {_fmt((h, dk))}; '
      f'got a_log {_fmt(a_log.shape)}, dt_bias {_fmt(dt_bias.shape)}'
    )
  if not (isinstance(lower_bound, numbers.Real) and lower_bound <= 0):
    raise ValueError(f'kda: gate_lower_bound must be a number <= 0 (0: the unbounded gate), got {lower_bound!r}')


def check_contract(q, k, g, beta, *, fn: str = 'kda') -> None:
  """The value contract of the sequence inputs, which the shapes do not tell (outside it the ops
  return NaN or Inf without an error): q, k, g and beta finite; each q[b, t, h] and k[b, t, h]
  L2-normalised (norm 1, within 1e-3, or 2e-2 in 16-bit dtypes; a zero vector passes); g <= 0 (a
  log-decay; None: not checked, as for a gate pre-activation); beta in [0, 1] (a sigmoid's
  output). Concrete arrays: ValueError naming the first violated condition and its extent.
  Inside jax.jit: jax.experimental.checkify checks, which the caller reports by wrapping the
  jitted function in checkify.checkify and calling .throw() on its error."""
  named = {'q': q, 'k': k, 'g': g, 'beta': beta}
  conditions = []  # (ok, message with {} for the extent, extent)
  for name, x in named.items():
    if x is not None:
      x = jnp.asarray(x)
      conditions.append(
        (jnp.all(jnp.isfinite(x)), f'{fn}: {name} has NaN or Inf entries ({{}} of them)', jnp.sum(~jnp.isfinite(x)))
      )
  for name in ('q', 'k'):
    x = jnp.asarray(named[name])
    tol = 2e-2 if jnp.dtype(x.dtype).itemsize <= 2 else 1e-3
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1))
    ok = jnp.all((jnp.abs(norm - 1.0) <= tol) | (norm <= tol))
    conditions.append(
      (
        ok,
        f'{fn}: {name} is not L2-normalised over its last axis (norms up to {{}} away from 1); the contract: '
        f'each {name}[b, t, h] of norm 1, e.g. {name} / ||{name}||',
        jnp.max(jnp.where(norm <= tol, 0.0, jnp.abs(norm - 1.0))),
      )
    )
  if g is not None:
    g = jnp.asarray(g)
    conditions.append(
      (
        jnp.all(g <= 0),
        f'{fn}: g has positive entries (max {{}}); g is the log-decay and must be <= 0',
        jnp.max(g).astype(jnp.float32),
      )
    )
  beta = jnp.asarray(beta)
  conditions.append(
    (
      jnp.all((beta >= 0) & (beta <= 1)),
      f"{fn}: beta lies outside [0, 1] (from {{}}); beta is the write strength, a sigmoid's output",
      jnp.stack([jnp.min(beta), jnp.max(beta)]).astype(jnp.float32),
    )
  )
  traced = any(isinstance(x, jax.core.Tracer) for x in (q, k, g, beta))
  for ok, message, extent in conditions:
    if traced:
      from jax.experimental import checkify

      checkify.check(ok, message, extent)
    elif not bool(ok):
      extent = jax.device_get(extent)
      shown = ' to '.join(f'{float(e):.4g}' for e in extent.reshape(-1)) if extent.ndim else f'{extent:.4g}'
      raise ValueError(message.format(shown))


# ----------------------------------------------------------------------------- the decay gate


def _sigmoid(z):
  return 1.0 / (1.0 + jnp.exp(-z))


def gate_log_decay(x, a, lower_bound: float):
  """docs/kda.md's log-decay g (float32) from x = f + dt_bias and a = exp(A_log): -a softplus(x), or
  with a lower bound lb < 0, lb sigmoid(a x). Written with exp and log1p only, so that the kernels
  (which import it) and XLA evaluate the same expression."""
  if lower_bound:
    return lower_bound * _sigmoid(a * x)
  return -a * (jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x))))


def log_decay_from_pre_activation(f, a_log, dt_bias, lower_bound: float):
  """gate_log_decay of f + dt_bias and exp(a_log) (f [..., H, K], a_log [H], dt_bias [H, K]),
  float32: the gate as XLA forms it outside the kernels. The bounded gate (lower_bound < 0) is
  differentiated by gate_derivatives, as the kernels do: autodiff of its 1 / (1 + exp(-a x)) would
  form inf / inf = NaN where a x is very negative."""
  f32 = jnp.float32
  f, a_log, dt_bias = f.astype(f32), a_log.astype(f32), dt_bias.astype(f32)
  if lower_bound:
    return _bounded_log_decay(f, a_log, dt_bias, lower_bound)
  return gate_log_decay(f + dt_bias, jnp.exp(a_log)[:, None], lower_bound)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _bounded_log_decay(f, a_log, dt_bias, lower_bound):
  return gate_log_decay(f + dt_bias, jnp.exp(a_log)[:, None], lower_bound)


@_bounded_log_decay.defjvp
def _bounded_log_decay_jvp(lower_bound, primals, tangents):
  f, a_log, dt_bias = primals
  df, da_log, ddt_bias = tangents
  x, a = f + dt_bias, jnp.exp(a_log)[:, None]
  dg_dx, dg_dalog = gate_derivatives(x, a, lower_bound)
  return gate_log_decay(x, a, lower_bound), dg_dx * (df + ddt_bias) + dg_dalog * da_log[:, None]


def gate_derivatives(x, a, lower_bound: float):
  """(dg/dx, dg/dA_log) of gate_log_decay at x, elementwise (a = exp(A_log))."""
  if lower_bound:
    s = _sigmoid(a * x)
    dg_dx = lower_bound * a * s * (1.0 - s)
    return dg_dx, dg_dx * x
  return -a * _sigmoid(x), gate_log_decay(x, a, 0.0)


def kda_log_decay(f, a_log, dt_bias, lower_bound=0.0):
  """docs/kda.md's decay gate: the log-decay g [B, T, H, K] (or [B, H, K]) float32 from its
  pre-activation f (the gate projection's output), a_log [H] and dt_bias [H, K]:
  g = -exp(a_log) softplus(f + dt_bias), or with lower_bound < 0, lower_bound sigmoid(exp(a_log)
  (f + dt_bias)). The same expression the Pallas kernels evaluate when the gate is fused."""
  return log_decay_from_pre_activation(f, a_log, dt_bias, float(lower_bound))


def reset_log_decay(g, resets):
  """g [B, T, H, K] with RESET_LOG_DECAY at the tokens where resets [B, T] (bool) is True: the
  state restarts from zero there. The forced entries pass no gradient to g."""
  return jnp.where(resets[:, :, None, None], jnp.asarray(RESET_LOG_DECAY, g.dtype), g)


def _default_scale(scale, dk):
  return dk**-0.5 if scale is None else scale


# ----------------------------------------------------------------------------- recurrence


def _token_update(s_bhkv, q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, scale):
  """One token of docs/kda.md in float32: decay, delta write, read. Returns (o [B, H, V], S')."""
  s_bhkv = s_bhkv * jnp.exp(g_bhk)[..., None]
  predicted_bhv = jnp.einsum('bhkv,bhk->bhv', s_bhkv, k_bhk)
  delta_bhv = beta_bh[..., None] * (v_bhv - predicted_bhv)
  s_bhkv = s_bhkv + k_bhk[..., :, None] * delta_bhv[..., None, :]
  o_bhv = jnp.einsum('bhkv,bhk->bhv', s_bhkv, scale * q_bhk)
  return o_bhv, s_bhkv


def kda_step(q, k, v, g, beta, state, *, scale=None, impl='xla', settings=None):
  """One decoding token: q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V].

  Returns (o [B, H, V] in v's dtype, new_state [B, H, K, V] float32). impl is the model's
  kda_impl (a key of IMPLS): 'pallas' runs one fused kernel (kernels_pallas/kda/step.py: the
  state read and written once; K and V powers of two) under `settings` (its KdaSettings; None:
  the defaults), the others this XLA form.
  """
  implementation = _implementation(impl, 'kda_step')
  q, k, v, g, beta, state = (jnp.asarray(x) for x in (q, k, v, g, beta, state))
  _check_step_inputs(q, k, v, g, beta, state)
  return implementation.step(q, k, v, g, beta, state, scale=_default_scale(scale, q.shape[-1]), settings=settings)


def _xla_step(q, k, v, g, beta, state, *, scale, settings):
  del settings  # no kernels
  f32 = lambda x: x.astype(jnp.float32)
  o, s = _token_update(f32(state), f32(q), f32(k), f32(v), f32(g), f32(beta), scale)
  return o.astype(v.dtype), s


def kda_decode(
  q,
  k,
  v,
  f,
  beta_logit,
  state,
  *,
  a_log,
  dt_bias,
  gate_lower_bound=0.0,
  prefixes=None,
  taps=None,
  scale=None,
  impl='xla',
  settings=None,
):
  """One decoding token of a KDA layer's mixing (docs/kda.md), from the projections on.

  q, k, f [B, H, K] and v [B, H, V]: the layer's q/k/v projections before their short
  convolutions and the decay gate's pre-activation; beta_logit [B, H] beta before its sigmoid;
  state [B, H, K, V]; a_log [H], dt_bias [H, K] and gate_lower_bound the gate (kda_log_decay).
  With the short convolutions, prefixes (q, k, v) [B, W-1, H, K or V] (the W-1 inputs before this
  token: the decode cache) and taps (q, k, v) [W, H, K or V]; without, both None. Then the
  activations ACTIVATIONS (kimijax.ops.short_conv's names), beta's sigmoid, the gate and kda_step.

  Returns (o [B, H, V] in v's dtype, new state float32, new prefixes or None). impl is the model's
  kda_impl: 'pallas' runs all of it as one kernel (kernels_pallas/kda/decode.py: K and V powers of
  two) under `settings` (a KdaSettings; None: the defaults; with fused_decode=0, the composed form
  with kda_step's kernel); the others compose short_conv, kda_log_decay and kda_step's XLA form.
  """
  implementation = _implementation(impl, 'kda_decode')
  q, k, v, f, beta_logit, state = (jnp.asarray(x) for x in (q, k, v, f, beta_logit, state))
  _check_step_inputs(q, k, v, f, beta_logit, state, fn='kda_decode', g_name='f', beta_name='beta_logit')
  a_log, dt_bias = jnp.asarray(a_log), jnp.asarray(dt_bias)
  _check_gate(a_log, dt_bias, gate_lower_bound, q.shape[1], q.shape[2])
  if (prefixes is None) != (taps is None):
    raise ValueError('kda_decode: prefixes and taps come together (the short convolutions) or not at all')
  if prefixes is not None:
    prefixes, taps = tuple(jnp.asarray(p) for p in prefixes), tuple(jnp.asarray(w) for w in taps)
    _check_conv_state(q, k, v, prefixes, taps)
  return implementation.decode(
    q,
    k,
    v,
    f,
    beta_logit,
    state,
    a_log,
    dt_bias,
    float(gate_lower_bound),
    prefixes,
    taps,
    scale=_default_scale(scale, q.shape[-1]),
    settings=settings,
  )


def _check_conv_state(q, k, v, prefixes, taps):
  if len(prefixes) != 3 or len(taps) != 3:
    raise ValueError(f'kda_decode: prefixes and taps are (q, k, v) triples; got {len(prefixes)} and {len(taps)}')
  width = taps[0].shape[0]
  for name, x, p, w in zip('qkv', (q, k, v), prefixes, taps):
    b, h, d = x.shape
    if w.shape != (width, h, d) or p.shape != (b, width - 1, h, d):
      raise ValueError(
        f'kda_decode: the {name} conv needs taps [W, H, D] = {_fmt((width, h, d))} and a prefix [B, W-1, H, D] = '
        f'{_fmt((b, width - 1, h, d))}; got taps {_fmt(w.shape)}, prefix {_fmt(p.shape)}'
      )


def _composed_decode(
  q, k, v, f, beta_logit, state, a_log, dt_bias, lower_bound, prefixes, taps, *, scale, settings, step=None
):
  """kda_decode as its parts: short_conv (XLA) and its activation, kda_log_decay, then `step` (kda_step's
  form; None: the XLA form)."""
  from kimijax.ops.short_conv import activate, short_conv

  xs, new_prefixes = [], []
  for i, (x, activation) in enumerate(zip((q, k, v), ACTIVATIONS.values())):
    if prefixes is None:
      y = activate(x, activation)
    else:
      y, prefix = short_conv(x[:, None], taps[i], activation, prefixes[i])
      y = y[:, 0]
      new_prefixes.append(prefix)
    xs.append(y.astype(x.dtype))
  g = kda_log_decay(f, a_log, dt_bias, lower_bound)
  beta = jax.nn.sigmoid(beta_logit.astype(jnp.float32))
  o, s = (step or _xla_step)(*xs, g, beta, state, scale=scale, settings=settings)
  return o, s, (None if prefixes is None else tuple(new_prefixes))


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False):
  """Reference KDA: a lax.scan over the T tokens (docs/kda.md, the order decay -> delta write -> read).

  Args:
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; g <= 0 (log-decay per channel).
    scale: query scale, default K ** -0.5.
    initial_state: optional [B, H, K, V] (zeros if None).
    output_final_state: also return the state after the last token.

  Returns:
    (o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32 or None).

  Its backward keeps the state of every token (O(T K V) memory): a reference, not for long sequences.
  """
  q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
  initial_state = None if initial_state is None else jnp.asarray(initial_state)
  b, _, h, dk, dv = _check_sequence_inputs('kda_recurrent', q, k, v, g, beta, initial_state)
  scale = _default_scale(scale, dk)
  time_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  xs = tuple(time_major(x) for x in (q, k, v, g, beta))
  s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

  def body(s, x):
    o, s = _token_update(s, *x, scale)
    return s, o

  s_final, o_tbhv = lax.scan(body, s0, xs)
  o = jnp.moveaxis(o_tbhv, 0, 1).astype(v.dtype)
  return o, (s_final if output_final_state else None)


# ----------------------------------------------------------------------------- chunkwise form


def _sub_chunk_len(c: int) -> int:
  """Largest divisor of the chunk length that is at most _SUB."""
  return max(d for d in range(1, min(c, _SUB) + 1) if c % d == 0)


def _suffix_sum_exclusive(x, axis):
  """sum_{j > i} x_j along axis, summed directly (no difference of two cumulative sums)."""
  inclusive = jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)
  shifted = lax.slice_in_dim(inclusive, 1, x.shape[axis], axis=axis)
  return jnp.concatenate([shifted, jnp.zeros_like(lax.slice_in_dim(x, 0, 1, axis=axis))], axis)


def _intra_chunk_scores(qs, k, g, sub):
  """Decay-weighted scores inside one chunk, never exponentiating a positive number.

  qs (scaled queries), k, g (per-token log-decay <= 0): [..., C, K] float32. With G the
  within-chunk cumulative sum of g, returns
    a_qk [..., C, C]: sum_d qs_rd k_id exp(G_rd - G_id) for i <= r, else 0
    a_kk [..., C, C]: sum_d k_rd  k_id exp(G_rd - G_id) for i <  r, else 0
  The chunk is cut into sub-chunks of `sub` rows. For a row r in sub-chunk a and a column i in an
  earlier sub-chunk, the exponent is split at the first row p of sub-chunk a,
  G_r - G_i = (G_r - G_p) + (G_p - G_i), both parts <= 0, so the pair block is one matmul of
  factors <= 1. Inside a sub-chunk no single split point works for every pair, so those
  `sub` x `sub` blocks are formed elementwise from exp(G_r - G_i) masked to i <= r.
  Accuracy: the split exponents are sums of g over the token range they cover, summed directly
  rather than as differences of chunk-wide cumulative sums (which lose absolute precision once a
  strong decay has made |G| large); only the within-sub-chunk differences subtract, and those
  cumulative sums span at most `sub` tokens.
  """
  *batch, c, dk = k.shape
  n = c // sub
  split = lambda x: x.reshape(*batch, n, sub, dk)
  q4, k4, g4 = split(qs), split(k), split(g)

  # diagonal blocks: e[a, s, s', d] = exp(G_{a,s,d} - G_{a,s',d}) for s' <= s, else 0
  local = jnp.cumsum(g4, axis=-2)  # cumulative within sub-chunk
  causal_incl = jnp.arange(sub)[:, None] >= jnp.arange(sub)[None, :]
  dg = local[..., :, :, None, :] - local[..., :, None, :, :]  # [..., n, S, S, K]
  e = jnp.exp(jnp.where(causal_incl[:, :, None], dg, -jnp.inf))
  ke = k4[..., :, None, :, :] * e  # k_{s'} exp(G_s - G_s')
  # broadcast-and-sum rather than einsum: tiny batched dot_generals are slow on CPU, this fuses
  qk_diag = jnp.sum(q4[..., :, :, None, :] * ke, axis=-1)  # [..., n, S, S]
  kk_diag = jnp.sum(k4[..., :, :, None, :] * ke, axis=-1) * jnp.tri(sub, k=-1, dtype=k.dtype)  # i < r
  eye_n = jnp.eye(n, dtype=k.dtype)
  place = lambda blocks: (blocks[..., :, :, None, :] * eye_n[:, None, :, None]).reshape(*batch, c, c)
  a_qk, a_kk = place(qk_diag), place(kk_diag)
  if n == 1:
    return a_qk, a_kk

  # blocks below the diagonal: split the exponent at p_a, the first row of sub-chunk a.
  # rows: G_r - G_{p_a} = sum of g over (p_a, r]
  row = jnp.exp(local - local[..., :, :1, :])  # [..., n, S, K], <= 1
  # columns i in sub-chunk b < a: G_{p_a} - G_i = (sum over (i, end of b]) + between[a, b], where
  # between[a, b] = (totals of the sub-chunks strictly between b and a) + g_{p_a}
  after_in_sub = _suffix_sum_exclusive(g4, axis=-2)  # [..., n, S, K]
  totals = local[..., :, -1, :]  # [..., n, K]
  strictly_between = (jnp.arange(n)[None, :, None] < jnp.arange(n)[None, None, :]) & (
    jnp.arange(n)[None, None, :] < jnp.arange(n)[:, None, None]
  )  # [a, b, c]
  between = (
    jnp.einsum('abc,...cd->...abd', strictly_between.astype(g.dtype), totals, precision=_EXACT) + g4[..., :, None, 0, :]
  )  # [..., n(a), n(b), K]
  col_exp = between[..., :, :, None, :] + after_in_sub[..., None, :, :, :]  # [..., a, b, S, K]
  earlier = jnp.arange(n)[:, None] > jnp.arange(n)[None, :]  # [a, b]: b < a
  col_exp = jnp.where(earlier[:, :, None, None], col_exp, -jnp.inf).reshape(*batch, n, c, dk)
  col = k[..., None, :, :] * jnp.exp(col_exp)  # [..., n, C, K], <= |k|
  a_qk = a_qk + jnp.einsum('...asd,...aid->...asi', q4 * row, col).reshape(*batch, c, c)
  a_kk = a_kk + jnp.einsum('...asd,...aid->...asi', k4 * row, col).reshape(*batch, c, c)
  return a_qk, a_kk


@jax.custom_jvp
def _unit_lower_inverse(a):
  """(I + a)^-1 for strictly lower-triangular a [..., C, C], exactly (C padded to a power of two).

  Block recursion from 1 x 1 blocks upward: the inverse of [[L1, 0], [A21, L2]] is
  [[T1, 0], [-T2 A21 T1, T2]], T1 and T2 the inverses of the diagonal blocks; log2 C levels of
  batched matmuls. (lax.linalg.triangular_solve was far slower on CPU, forward and backward.)
  The derivative is given directly, d(L^-1) = -L^-1 dL L^-1, two batched matmuls. These small
  matmuls always run in full float32 (no TF32), whatever the default matmul precision.
  """
  *batch, c0, _ = a.shape
  c = 1 << (c0 - 1).bit_length()
  if c != c0:  # [[I + a, 0], [0, I]] has the same leading block in its inverse
    a = jnp.pad(a, [(0, 0)] * len(batch) + [(0, c - c0), (0, c - c0)])
  t = jnp.ones((*batch, c, 1, 1), a.dtype)  # inverses of 1 x 1 blocks
  m = 1
  while m < c:
    nb = c // (2 * m)
    blocks = a.reshape(*batch, nb, 2 * m, nb, 2 * m)
    blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., nb, 2m, 2m]
    t1, t2 = t[..., 0::2, :, :], t[..., 1::2, :, :]
    t21 = -jnp.einsum('...ij,...jk,...kl->...il', t2, blocks[..., m:, :m], t1, precision=_EXACT)
    t = jnp.concatenate(
      [jnp.concatenate([t1, jnp.zeros_like(t1)], axis=-1), jnp.concatenate([t21, t2], axis=-1)], axis=-2
    )  # [..., nb, 2m, 2m]
    m *= 2
  return t[..., 0, :c0, :c0]


@_unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
  t = _unit_lower_inverse(primals[0])
  da = jnp.tril(tangents[0], -1)  # the function reads only the strictly lower triangle
  return t, -jnp.einsum('...ij,...jk,...kl->...il', t, da, t, precision=_EXACT)


def _chunk_intra(chunk, *, scale, sub):
  """Everything inside a chunk that does not need the incoming state (docs/kda.md, WY/UT form).

  chunk: q, k, g [..., C, K], v [..., C, V], beta [..., C] float32 (any leading dims). Returns
    qg = scale q exp(G)  [..., C, K]     reads the incoming state
    kg = k exp(G_C - G)  [..., C, K]     writes into the outgoing state
    w, u [..., C, K], [..., C, V]        (I + Diag(beta) A_kk) [w | u] = Diag(beta) [exp(G) k | v]
    a_qk [..., C, C]                     causal decay-weighted query-key scores
    decay [..., K] = exp(G_C)            the chunk's total decay
  with G the within-chunk cumulative sum of g. Every exp has a non-positive argument.
  """
  q, k, v, g, beta = chunk
  c, dk = k.shape[-2:]
  gcum = jnp.cumsum(g, axis=-2)  # G, non-increasing
  a_qk, a_kk = _intra_chunk_scores(scale * q, k, g, sub)
  t_inv = _unit_lower_inverse(beta[..., :, None] * a_kk)  # (I + Diag(beta) A_kk)^-1
  w = jnp.einsum('...ri,...id->...rd', t_inv, (beta[..., None] * jnp.exp(gcum)) * k)
  u = jnp.einsum('...ri,...iv->...rv', t_inv, beta[..., None] * v)
  to_end = _suffix_sum_exclusive(g, axis=-2)  # G_C - G, summed directly
  return dict(
    qg=scale * q * jnp.exp(gcum), kg=k * jnp.exp(to_end), w=w, u=u, a_qk=a_qk, decay=jnp.exp(gcum[..., -1, :])
  )


def _chunk_state_step(s, x):
  """Carry the state [..., K, V] across one chunk and read the chunk's outputs [..., C, V]. The
  state entering the chunk is the residual worth keeping (SAVED): the rest is cheap to recompute."""
  s = checkpoint_name(s, SAVED)
  v_new = x['u'] - jnp.einsum('...ck,...kv->...cv', x['w'], s)  # U - W S
  o = jnp.einsum('...ck,...kv->...cv', x['qg'], s) + jnp.einsum('...ci,...iv->...cv', x['a_qk'], v_new)
  s = x['decay'][..., :, None] * s + jnp.einsum('...ck,...cv->...kv', x['kg'], v_new)
  return s, o


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
  """KDA in the exact chunkwise WY/UT form (docs/kda.md); same arguments and results as kda_recurrent.

  T is padded to a multiple of the chunk length with k = v = q = 0, g = 0, beta = 0 (tokens that
  neither decay nor write) and the output sliced back; sequences shorter than chunk_size use one
  chunk of T rounded up to a multiple of 16. The intra-chunk part (decay-weighted scores, the UT
  inverse, W and U) runs batched over groups of chunks; a lax.scan over chunks then carries the state.

  Memory: the intra-chunk part is rematerialised in the backward pass (jax.checkpoint), in groups
  of chunks sized so its largest transient ([.., C, 16, K] decay factors) stays near
  _GROUP_ELEMENTS; the backward keeps O(T (K + V + C)) activations plus one [B, H, K, V] state per
  chunk, (T / C) K V, never a state per token. No exp of a positive number is formed (see
  _intra_chunk_scores), so any decay g <= 0, however strong, is safe.
  """
  q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
  initial_state = None if initial_state is None else jnp.asarray(initial_state)
  b, t, h, dk, dv = _check_sequence_inputs('kda_chunk', q, k, v, g, beta, initial_state)
  if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f'kda_chunk: chunk_size must be a positive int, got {chunk_size!r}')
  scale = _default_scale(scale, dk)
  c = min(int(chunk_size), -(-t // _SUB) * _SUB)
  n = -(-t // c)
  pad = n * c - t
  sub = _sub_chunk_len(c)

  def chunks(x):  # [B, T, H, *] -> [N, B, H, C, *] float32, zero-padded in time
    x = x.astype(jnp.float32)
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n, c, h, *x.shape[3:])
    return jnp.moveaxis(x, (1, 3), (0, 2))

  xs = tuple(chunks(x) for x in (q, k, v, g, beta))
  intra = jax.checkpoint(lambda x: _chunk_intra(x, scale=scale, sub=sub))
  budget = _GROUP_ELEMENTS.get(jax.default_backend(), _GROUP_ELEMENTS_DEFAULT)
  group = max(1, budget // (b * h * c * sub * max(dk, dv)))
  if group >= n:
    per_chunk = intra(xs)
  else:
    per_chunk = lax.map(intra, xs, batch_size=group)
  s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
  s_final, o_nbhcv = lax.scan(_chunk_state_step, s0, per_chunk)
  o = jnp.moveaxis(o_nbhcv, (0, 2), (1, 3)).reshape(b, n * c, h, dv)[:, :t]
  return o.astype(v.dtype), (s_final if output_final_state else None)


# ----------------------------------------------------------------------------- dispatch


def _gated(fn):
  """An implementation of g that takes the gate and the document resets too, forming the
  log-decay in XLA first."""

  def impl(q, k, v, g, beta, *, gate, resets=None, **kw):
    g = g if gate is None else kda_log_decay(g, *gate)
    return fn(q, k, v, g if resets is None else reset_log_decay(g, resets), beta, **kw)

  return impl


def _recurrent_impl(q, k, v, g, beta, *, scale, initial_state, output_final_state, chunk_size, settings):
  del chunk_size, settings  # the recurrence has no chunks and no kernels
  return kda_recurrent(
    q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state
  )


def _chunk_impl(q, k, v, g, beta, *, settings, **kw):
  del settings  # no kernels
  return kda_chunk(q, k, v, g, beta, **kw)


def _fused_impl(q, k, v, g, beta, *, gate, scale, initial_state, output_final_state, chunk_size, settings, resets=None):
  """The fused Pallas kernels of kernels_pallas/kda (interpreted off the GPU), the gate (and the
  document resets with it) fused in, under `settings` (a KdaSettings; None: the defaults); their
  chunk length is fixed (64), so chunk_size is not used."""
  del chunk_size
  from kernels_pallas.common import kernels_interpreted
  from kernels_pallas.kda import kda_pallas

  _, _, _, dk, _ = _check_sequence_inputs("kda impl='pallas'", q, k, v, g, beta, initial_state)
  a_log, dt_bias, lower_bound = gate or (None, None, 0.0)
  o, s_final = kda_pallas(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    scale=_default_scale(scale, dk),
    a_log=a_log,
    dt_bias=dt_bias,
    gate_lower_bound=lower_bound,
    settings=settings,
    interpret=kernels_interpreted(),
    resets=resets,
  )
  return o, (s_final if output_final_state else None)


def _fused_step(q, k, v, g, beta, state, *, scale, settings):
  from kernels_pallas.common import kernels_interpreted
  from kernels_pallas.kda import kda_step_pallas

  return kda_step_pallas(
    q, k, v, g, beta, state, scale=float(scale), settings=settings, interpret=kernels_interpreted()
  )


def _fused_decode(q, k, v, f, beta_logit, state, a_log, dt_bias, lower_bound, prefixes, taps, *, scale, settings):
  from kernels_pallas.common import kernels_interpreted
  from kernels_pallas.kda import kda_decode_pallas
  from kernels_pallas.kda.settings import KdaSettings

  if isinstance(settings, KdaSettings) and not settings.fused_decode:
    return _composed_decode(
      q,
      k,
      v,
      f,
      beta_logit,
      state,
      a_log,
      dt_bias,
      lower_bound,
      prefixes,
      taps,
      scale=scale,
      settings=settings,
      step=_fused_step,
    )

  return kda_decode_pallas(
    q,
    k,
    v,
    f,
    beta_logit,
    state,
    a_log,
    dt_bias,
    prefixes=prefixes,
    taps=taps,
    scale=float(scale),
    lower_bound=lower_bound,
    settings=settings,
    interpret=kernels_interpreted(),
  )


def _pallas_settings(text: str):
  from kernels_pallas.kda.settings import KdaSettings

  return KdaSettings.from_string(text)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of KDA. kda: kda's arguments (keywords after beta; gate = (a_log, dt_bias,
  lower_bound) or None; settings; resets [B, T] bool, given only under segment_ids) -> (o, state
  or None). step: kda_step's (keywords scale, settings) -> (o, state). decode: kda_decode's (q, k,
  v, f, beta_logit, state, a_log, dt_bias, lower_bound, prefixes, taps; keywords scale, settings)
  -> (o, state, prefixes). parse_settings: 'key=int/key=int' -> the settings its kernels take
  (the `settings` argument; None: it has no kernels and ignores that argument)."""

  kda: Callable
  step: Callable
  decode: Callable
  parse_settings: Callable[[str], object] | None = None


IMPLS = types.MappingProxyType(
  {
    'xla': Implementation(_gated(_chunk_impl), _xla_step, _composed_decode),
    'xla_recurrent': Implementation(_gated(_recurrent_impl), _xla_step, _composed_decode),
    'pallas': Implementation(_fused_impl, _fused_step, _fused_decode, parse_settings=_pallas_settings),
  }
)


def _implementation(impl: str, fn: str) -> Implementation:
  if impl not in IMPLS:
    raise ValueError(f'{fn} impl={impl!r} is unknown; allowed: {tuple(IMPLS)}')
  return IMPLS[impl]


def kda(
  q,
  k,
  v,
  g,
  beta,
  *,
  impl='xla',
  scale=None,
  initial_state=None,
  output_final_state=False,
  chunk_size=64,
  a_log=None,
  dt_bias=None,
  gate_lower_bound=0.0,
  settings=None,
  check_inputs=False,
  segment_ids=None,
):
  """KDA through one dispatch point: impl, a key of IMPLS ('xla' | 'xla_recurrent' | 'pallas').

  Same arguments and results as kda_chunk (chunk_size is used by 'xla' alone). With a_log [H]
  and dt_bias [H, K], g is the decay gate's pre-activation f [B, T, H, K] (any float dtype) and
  the log-decay is kda_log_decay(f, a_log, dt_bias, gate_lower_bound): in XLA before the op, or
  inside 'pallas''s cumulative-sum kernels, which then never write a float32 g. Gradients reach
  a_log and dt_bias either way. settings: the kernels' settings of an implementation that has
  them ('pallas': a kernels_pallas.kda.settings.KdaSettings, or IMPLS['pallas'].parse_settings of
  'key=int/key=int'); None: their defaults; the XLA forms ignore it. check_inputs=True checks the
  values against the contract first (check_contract: q and k L2-normalised, g <= 0, beta in
  [0, 1], all finite), a ValueError naming the violated condition instead of a NaN output.
  segment_ids: None, or [B, T] int, packed documents as contiguous runs of equal ids
  (kimijax/ops/segments.py): the state restarts from zero at the first token of every segment but
  the row's first (RESET_LOG_DECAY).
  """
  implementation = _implementation(impl, 'kda')
  q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
  initial_state = None if initial_state is None else jnp.asarray(initial_state)
  if check_inputs:
    _check_sequence_inputs(f'kda impl={impl!r}', q, k, v, g, beta, initial_state)
    check_contract(q, k, None if a_log is not None else g, beta)
  gate = None
  if a_log is not None or dt_bias is not None:  # checked before XLA forms g from them
    _, _, h, dk, _ = _check_sequence_inputs(f'kda impl={impl!r}', q, k, v, g, beta, initial_state)
    a_log, dt_bias = (None if x is None else jnp.asarray(x) for x in (a_log, dt_bias))
    _check_gate(a_log, dt_bias, gate_lower_bound, h, dk)
    gate = (a_log, dt_bias, float(gate_lower_bound))
  resets = {}
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != q.shape[:2]:
      raise ValueError(f'kda: segment_ids must be [B, T] = {_fmt(q.shape[:2])}; got {_fmt(segment_ids.shape)}')
    resets = dict(resets=segment_starts(segment_ids))
  return implementation.kda(
    q,
    k,
    v,
    g,
    beta,
    gate=gate,
    scale=scale,
    initial_state=initial_state,
    output_final_state=output_final_state,
    chunk_size=chunk_size,
    settings=settings,
    **resets,
  )
