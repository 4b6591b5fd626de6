"""Muon as scaled by Moonlight (SPEC §2), as an optax GradientTransformation.

For each hidden weight matrix W (A x B, see kimijax.optim.routing for how a 3-D kernel becomes
one or several matrices) with gradient G:

    M_t = mu M_{t-1} + G_t                    (fp32, M_0 = 0, no bias correction)
    N_t = G_t + mu M_t                        (Nesterov; N_t = M_t without)
    O_t = NS5(N_t)                            (Newton-Schulz in ns_dtype, default bf16)
    W_t = W_{t-1} - lr_t (rms_scale sqrt(max(A, B)) O_t + wd W_{t-1})

Every other parameter (embeddings, head, norm gains, biases, 1-D) gets AdamW with (adam_b1,
adam_b2, adam_eps) and the same lr and wd, decayed as well (Moonlight decays norm gains too;
SPEC §2 says it matters for stability). Built from optax pieces: optax.partition splits the
parameters by `Routing.labels`; each side is chain(direction, add_decayed_weights(wd),
scale_by_learning_rate(lr)), so wd is decoupled and multiplied by the (scheduled) lr exactly as
in Moonlight's `p *= 1 - lr wd; p -= lr u`.

Where this differs from optax.contrib.muon (0.2.8), and why:
  - Momentum: optax keeps an EMA (1-mu) G + mu m with bias correction and mixes the Nesterov
    input from the bias-corrected terms; Moonlight uses M = mu M + G with no correction and
    N = G + mu M. NS normalises by ||N||_F, so only the relative weight of G and M matters, but
    that weight differs in the first steps; we follow Moonlight.
  - NS precision: optax runs NS in the input dtype (fp32 here) with eps 1e-8; Moonlight casts to
    bf16 and divides by ||N||_F + 1e-7. We take ns_dtype (bf16 by default; float32 in tests),
    computing the norm in fp32 before the cast. For float32 the matmuls use HIGHEST precision so
    that GPUs do not silently drop to TF32.
  - Scale: optax's default is sqrt(max(1, B/A)) (Keller Jordan's); we always apply Moonlight's
    rms_scale * sqrt(max(A, B)) (optax's consistent_rms), per matrix of a stack.
  - Routing: optax sends every 2-D parameter (embeddings and head included) to Muon, and gives
    its AdamW wd 0 and b2 0.999 by default; we route by name (kimijax.optim.routing) and give
    both groups the same lr and wd, with b2 = 0.95, as Moonlight does.
  - Matrix views: optax's MuonDimensionNumbers (reduction and output axes, the rest batched)
    are the same idea as our MatrixView; ours have defaults derived from parameter names.
  - States are always fp32 (momentum and Adam moments), whatever the parameter dtype.

Distributed: under jit with sharded parameters (fsdp/tensor), the reshapes and matmuls below
are whole-matrix operations on global arrays; XLA's SPMD partitioner inserts the collectives
(it shards the Gram matmuls and all-reduces their partial sums) so the result equals the
one-device update up to summation order, and the momentum is created from the boxed parameters
so it carries their logical axes and is sharded like them (tests/test_muon.py checks both). We
add no explicit resharding: gathering each matrix onto every device (Moonlight's Algorithm 1)
trades the per-iteration collectives for redundant NS compute; which is cheaper on GPUs is the
measurement left for issue 4's GPU session.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kimijax.optim.routing import ADAMW, MUON, MatrixView, Routing, path_names

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(x_sab: jax.Array, steps: int = 5, dtype=jnp.bfloat16) -> jax.Array:
  """Approximate orthogonalisation (U V^T of the SVD) of each matrix of x [S, A, B], fp32 out.

  X = x / (||x||_F + 1e-7) per matrix (norm in fp32), cast to `dtype`; transposed when A > B
  so the Gram matrix is the smaller one; `steps` iterations of X = a X + (b G + c G G) X with
  G = X X^T and (a, b, c) = NS_COEFFS.
  """
  a, b, c = NS_COEFFS
  x = x_sab.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True))
  x = (x / (norm + NS_EPS)).astype(dtype)
  tall = x.shape[1] > x.shape[2]
  if tall:
    x = jnp.swapaxes(x, 1, 2)
  precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
  mm = lambda p, q: jnp.matmul(p, q, precision=precision)
  for _ in range(steps):
    gram = mm(x, jnp.swapaxes(x, 1, 2))
    x = a * x + mm(b * gram + c * mm(gram, gram), x)
  if tall:
    x = jnp.swapaxes(x, 1, 2)
  return x.astype(jnp.float32)


def orthogonalise(n: jax.Array, view: MatrixView, *, steps: int, dtype, rms_scale: float) -> jax.Array:
  """rms_scale * sqrt(max(A, B)) * NS(N) for every matrix of the parameter-shaped `n`."""
  _, rows, cols = view.sizes(n.shape)
  o_sab = newton_schulz(view.to_matrices(n), steps, dtype)
  return view.from_matrices(o_sab, n.shape) * (rms_scale * math.sqrt(max(rows, cols)))


class ScaleByMuonState(NamedTuple):
  momentum: Any        # M_t, fp32, one per Muon parameter


def scale_by_muon(*, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, ns_dtype=jnp.bfloat16,
                  rms_scale: float = 0.2,
                  view_fn: Callable[[tuple[str, ...], tuple[int, ...]], MatrixView] | None = None
                  ) -> optax.GradientTransformation:
  """The Muon direction rms_scale sqrt(max(A, B)) NS5(N) (no lr, no wd, no sign flip).

  view_fn(path_names, shape) gives each parameter's MatrixView (default: Routing().view).
  Works on masked trees (optax.MaskedNode leaves have no state and are passed through).
  """
  view_fn = view_fn or Routing().view

  def init(params):
    return ScaleByMuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def update(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda g, m: momentum * m + g.astype(jnp.float32), updates, state.momentum)

    def direction(path, g, m):
      g = g.astype(jnp.float32)
      n = g + momentum * m if nesterov else m
      return orthogonalise(n, view_fn(path_names(path), g.shape), steps=ns_steps, dtype=ns_dtype,
                           rms_scale=rms_scale)

    out = jax.tree_util.tree_map_with_path(direction, updates, new_m)
    return out, ScaleByMuonState(new_m)

  return optax.GradientTransformation(init, update)


def adamw_direction(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  """Adam's bias-corrected m_hat / (sqrt(v_hat) + eps), moments in fp32."""
  return optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=jnp.float32)


def muon(learning_rate: optax.ScalarOrSchedule, *, momentum: float = 0.95, nesterov: bool = True,
         ns_steps: int = 5, ns_dtype=jnp.bfloat16, rms_scale: float = 0.2, weight_decay: float = 0.0,
         adam_b1: float = 0.9, adam_b2: float = 0.95, adam_eps: float = 1e-8, muon_mask=None,
         muon_views=None, per_head: bool = False) -> optax.GradientTransformationExtraArgs:
  """Moonlight's Muon for hidden matrices + AdamW for the rest (module docstring).

  Args:
    learning_rate: a float or a schedule (callable of the step count), shared by both groups.
    momentum, nesterov, ns_steps, ns_dtype, rms_scale: the Muon side (SPEC §2).
    weight_decay: decoupled, multiplied by the lr, on both groups.
    adam_b1, adam_b2, adam_eps: the AdamW side.
    muon_mask: pytree of bools (params' structure) or callable params -> such a pytree: True ->
      Muon, False -> AdamW. Default: kimijax.optim.routing.default_route.
    muon_views: pytree of MatrixView / None, or callable (path_names, shape) -> MatrixView | None,
      overriding the default matrix view of Muon parameters.
    per_head: default views of head-structured 3-D kernels are per-head stacks.
  """
  routing = Routing(per_head=per_head, muon_mask=muon_mask, muon_views=muon_views)
  tail = lambda: (optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
  return optax.partition({
      MUON: optax.chain(scale_by_muon(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      ns_dtype=ns_dtype, rms_scale=rms_scale, view_fn=routing.view),
                        *tail()),
      ADAMW: optax.chain(adamw_direction(adam_b1, adam_b2, adam_eps), *tail()),
  }, routing.labels)
