"""Muon as scaled by Moonlight (docs/optimizers.md#muon), as an optax GradientTransformation.

For each hidden weight matrix W (A x B, see kimijax.optim.routing for how a 3-D kernel becomes
one or several matrices) with gradient G:

    M_t = mu M_{t-1} + G_t                    (fp32, M_0 = 0, no bias correction)
    N_t = G_t + mu M_t                        (Nesterov; N_t = M_t without)
    O_t = NS5(N_t)                            (Newton-Schulz in ns_dtype, default bf16)
    W_t = W_{t-1} - lr_t (rms_scale sqrt(max(A, B)) O_t + wd W_{t-1})

Every other parameter (embeddings, head, norm gains, biases, 1-D) gets AdamW with (adam_b1,
adam_b2, adam_eps) and the same lr and wd, decayed as well (Moonlight decays norm gains too;
docs/optimizers.md#muon says it matters for stability). Built from optax pieces: optax.partition splits the
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
  - Nesterov and the AdamW side: `nesterov` applies to the Muon side only. optax.adamw's own
    `nesterov=True` turns it into NAdam (the bias-corrected b1 m + (1 - b1) g in the numerator),
    which Moonlight's AdamW side is not; ours is plain AdamW (optax.scale_by_adam) whatever
    `nesterov` says. (optax.contrib.muon passes its own `nesterov` to the Muon side only, too.)
  - bf16 Newton-Schulz: JAX would round Python-float coefficients to the array's dtype
    (3.4445 -> 3.4375 in bf16) where PyTorch keeps them at full precision; _iterate keeps the
    coefficients, the products' accumulation and both combinations in fp32.
  - MLA: the parts of each DeepSeek-V3 Linear weight are orthogonalised as one matrix by default
    (mla_views; kimijax.optim.routing), as Moonlight's Muon sees them.

Distributed (docs/optimizers.md#muon): under jit with sharded parameters (fsdp/tensor) the momentum is created
from the boxed parameters, so it carries their logical axes and is sharded like them. Newton-
Schulz always sees whole matrices: orthogonalise_all stacks same-shaped matrices and splits the
stack over the devices, so each device orthogonalises its share of whole matrices, instead of
every rank repeating all of them as in Moonlight's Algorithm 1 (optimizer.muon_split_matrices;
False orthogonalises each parameter in its own layout and leaves the sharding to XLA).
tests/optim/test_muon.py checks that the sharded update equals the one-device update;
experiments/results/muon_distributed.md has the 2-GPU cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kimijax.optim.boxes import accept_boxed
from kimijax.optim.routing import ADAMW, MUON, MatrixView, Routing, path_names

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def _normalise(x_sab: jax.Array, dtype) -> jax.Array:
  """x / (||x||_F + 1e-7) per matrix, the norm in fp32, cast to the Newton-Schulz dtype."""
  x = x_sab.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True))
  return (x / (norm + NS_EPS)).astype(dtype)


def _iterate(x_sab: jax.Array, steps: int) -> jax.Array:
  """`steps` iterations of X = a X + (b G + c G G) X, G = X X^T, on wide matrices (A <= B).

  The matmul operands are in x's dtype (the Newton-Schulz dtype), their products accumulate and
  come out in float32, and the coefficients and both linear combinations are float32; only the
  operands of the next matmul are rounded to the low dtype. Multiplying a bf16 array by a Python
  float would instead round the coefficients to bf16 (3.4445 -> 3.4375) and every sum to bf16:
  PyTorch (Moonlight) keeps such scalars at full precision, and this is at least as accurate.
  """
  a, b, c = (jnp.float32(v) for v in NS_COEFFS)
  dtype = x_sab.dtype
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  mm = lambda p, q: jnp.matmul(p, q, precision=precision, preferred_element_type=jnp.float32)
  x = x_sab
  for _ in range(steps):
    gram = mm(x, jnp.swapaxes(x, 1, 2))  # fp32
    poly = b * gram + c * mm(gram.astype(dtype), gram.astype(dtype))  # fp32
    x = (a * x.astype(jnp.float32) + mm(poly.astype(dtype), x)).astype(dtype)
  return x


def _tall(x_sab: jax.Array) -> bool:
  return x_sab.shape[1] > x_sab.shape[2]


def _transpose_if(x_sab: jax.Array, tall: bool) -> jax.Array:
  """Tall matrices are iterated transposed, so that the Gram matrix X X^T is the smaller one."""
  return jnp.swapaxes(x_sab, 1, 2) if tall else x_sab


def _orthogonalise_normalised(x_sab: jax.Array, steps: int) -> jax.Array:
  tall = _tall(x_sab)
  return _transpose_if(_iterate(_transpose_if(x_sab, tall), steps), tall)


def newton_schulz(x_sab: jax.Array, steps: int = 5, dtype=jnp.bfloat16) -> jax.Array:
  """Approximate orthogonalisation (U V^T of the SVD) of each matrix of x [S, A, B], fp32 out.

  X = x / (||x||_F + 1e-7) per matrix (norm in fp32), cast to `dtype`; transposed when A > B
  so the Gram matrix is the smaller one; `steps` iterations of X = a X + (b G + c G G) X with
  G = X X^T and (a, b, c) = NS_COEFFS. float32 matmuls use HIGHEST precision (no TF32).
  """
  return _orthogonalise_normalised(_normalise(x_sab, dtype), steps).astype(jnp.float32)


def _split_over_devices(mats: list[jax.Array], steps: int, mesh) -> list[jax.Array]:
  """Newton-Schulz of normalised [S, A, B] stacks, same-shaped matrices stacked and the stacks
  sharded over every axis of `mesh` (see orthogonalise_all)."""
  groups: dict[tuple[int, int], list[int]] = {}
  for i, x in enumerate(mats):
    groups.setdefault(tuple(sorted(x.shape[1:])), []).append(i)
  out: list[jax.Array] = [None] * len(mats)  # type: ignore[list-item]
  for indices in groups.values():
    stack = jnp.concatenate([_transpose_if(mats[i], _tall(mats[i])) for i in indices], axis=0)
    total = stack.shape[0]
    stack = jnp.pad(stack, ((0, -total % mesh.size), (0, 0), (0, 0)))
    stack = jax.lax.with_sharding_constraint(stack, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    result = _iterate(stack, steps)[:total]
    offset = 0
    for i in indices:
      count = mats[i].shape[0]
      out[i] = _transpose_if(result[offset : offset + count], _tall(mats[i]))
      offset += count
  return out


def _fuse(parts: list[jax.Array], names: list[str]) -> jax.Array:
  """[S, A, B_i] column blocks of one matrix -> [S, A, sum B_i]."""
  if len({p.shape[:2] for p in parts}) > 1:
    raise ValueError(
      'parameters fused into one Muon matrix must have the same stack and row sizes; got '
      + ', '.join(f'{n}: {p.shape[0]} x [{p.shape[1]}, {p.shape[2]}]' for n, p in zip(names, parts))
    )
  return jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]


def orthogonalise_all(
  ns: list[jax.Array],
  views: list[MatrixView],
  *,
  steps: int,
  dtype,
  rms_scale: float,
  split_matrices: bool = True,
  groups: list | None = None,
) -> list[jax.Array]:
  """rms_scale * sqrt(max(A, B)) * NS(N) for every matrix of every parameter-shaped N in `ns`.

  groups: one key per entry (None: a matrix of its own). Entries with the same key are column
  blocks of one matrix (MLA's parts of one DeepSeek-V3 Linear weight, kimijax.optim.routing):
  their [S, A, B_i] matrices are concatenated along the columns, orthogonalised and scaled as one
  [S, A, sum B_i] matrix, and split back.

  Distributed Muon (docs/optimizers.md#muon) runs Newton-Schulz on whole matrices. With split_matrices and a mesh
  of several devices (jax.set_mesh with Auto axes, as the train step runs), the matrices of all
  parameters are grouped by shape (tall ones transposed), each group is stacked, padded with zero
  matrices to a multiple of the device count and sharded over every mesh axis along the stack:
  each device orthogonalises whole matrices, its 1/n share of them, with no collective inside the
  iteration, and XLA moves the matrices there and back. With parameters sharded over fsdp alone
  that is one all-to-all each way; with tensor sharding too, XLA adds all-gathers; with
  replicated parameters (data parallel only) it trades repeated Newton-Schulz work for the
  collectives. Moonlight's Algorithm 1 instead gathers every matrix onto every data-parallel rank
  and repeats the work there. Without split_matrices (or without a mesh) each parameter is
  orthogonalised on its own in its own layout, and XLA's partitioner decides how to shard the
  Gram matmuls. The arithmetic per matrix is the same either way, so the update equals the
  one-device update.
  """
  members: dict[Any, list[int]] = {}
  for i, key in enumerate(groups or [None] * len(ns)):
    members.setdefault(('own', i) if key is None else ('group', key), []).append(i)
  parts = [view.to_matrices(n) for n, view in zip(ns, views)]
  fused = [
    _fuse([parts[i] for i in idx], [str(groups[i]) if groups else str(i) for i in idx]) for idx in members.values()
  ]
  mats = [_normalise(x, dtype) for x in fused]
  mesh = jax.sharding.get_abstract_mesh()  # the one jax.set_mesh made current, if any
  if split_matrices and not mesh.empty and mesh.size > 1:
    out = _split_over_devices(mats, steps, mesh)
  else:
    out = [_orthogonalise_normalised(x, steps) for x in mats]
  directions: list[jax.Array] = [None] * len(ns)  # type: ignore[list-item]
  for o_sab, idx in zip(out, members.values()):
    o_sab = o_sab.astype(jnp.float32) * (rms_scale * math.sqrt(max(o_sab.shape[1:])))
    offset = 0
    for i in idx:
      width = parts[i].shape[2]
      directions[i] = views[i].from_matrices(o_sab[:, :, offset : offset + width], ns[i].shape)
      offset += width
  return directions


class ScaleByMuonState(NamedTuple):
  momentum: Any  # M_t, fp32, one per Muon parameter


def scale_by_muon(
  *,
  momentum: float = 0.95,
  nesterov: bool = True,
  ns_steps: int = 5,
  ns_dtype=jnp.bfloat16,
  rms_scale: float = 0.2,
  view_fn: Callable[[tuple[str, ...], tuple[int, ...]], MatrixView] | None = None,
  group_fn: Callable[[tuple[str, ...]], Any] | None = None,
  split_matrices: bool = True,
) -> optax.GradientTransformation:
  """The Muon direction rms_scale sqrt(max(A, B)) NS5(N) (no lr, no wd, no sign flip).

  view_fn(path_names, shape) gives each parameter's MatrixView (default: Routing().view);
  group_fn(path_names) the fused matrix it is a column block of, or None (default:
  Routing().group, MLA fused as in DeepSeek-V3); split_matrices: see orthogonalise_all. Works on
  masked trees (optax.MaskedNode leaves have no state and are passed through).
  """
  view_fn = view_fn or Routing().view
  group_fn = group_fn or Routing().group

  def init(params):
    return ScaleByMuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def update(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda g, m: momentum * m + g.astype(jnp.float32), updates, state.momentum)
    nesterov_input = lambda g, m: g.astype(jnp.float32) + momentum * m if nesterov else m
    n_tree = jax.tree.map(nesterov_input, updates, new_m)
    paths_ns, treedef = jax.tree_util.tree_flatten_with_path(n_tree)
    views = [view_fn(path_names(path), n.shape) for path, n in paths_ns]
    groups = [group_fn(path_names(path)) for path, _ in paths_ns]
    out = orthogonalise_all(
      [n for _, n in paths_ns],
      views,
      steps=ns_steps,
      dtype=ns_dtype,
      rms_scale=rms_scale,
      split_matrices=split_matrices,
      groups=groups,
    )
    return jax.tree.unflatten(treedef, out), ScaleByMuonState(new_m)

  return optax.GradientTransformation(init, update)


def adamw_direction(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  """Adam's bias-corrected m_hat / (sqrt(v_hat) + eps), moments in fp32."""
  return optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=jnp.float32)


def muon(
  learning_rate: optax.ScalarOrSchedule,
  *,
  momentum: float = 0.95,
  nesterov: bool = True,
  ns_steps: int = 5,
  ns_dtype=jnp.bfloat16,
  rms_scale: float = 0.2,
  weight_decay: float = 0.0,
  adam_b1: float = 0.9,
  adam_b2: float = 0.95,
  adam_eps: float = 1e-8,
  muon_mask=None,
  muon_views=None,
  per_head: bool = False,
  mla_views: str = 'fused',
  split_matrices: bool = True,
  moe_router: str = 'muon',
) -> optax.GradientTransformationExtraArgs:
  """Moonlight's Muon for hidden matrices + AdamW for the rest (module docstring).

  Args:
    learning_rate: a float or a schedule (callable of the step count), shared by both groups.
    momentum, nesterov, ns_steps, ns_dtype, rms_scale: the Muon side (docs/optimizers.md#muon).
    weight_decay: decoupled, multiplied by the lr, on both groups.
    adam_b1, adam_b2, adam_eps: the AdamW side.
    muon_mask: pytree of bools (params' structure) or callable params -> such a pytree: True ->
      Muon, False -> AdamW. Default: kimijax.optim.routing.default_route.
    muon_views: pytree of MatrixView / None, or callable (path_names, shape) -> MatrixView | None,
      overriding the default matrix view of Muon parameters.
    per_head: default views of head-structured 3-D kernels are per-head stacks.
    mla_views: 'fused' (default): MLA's parts of one DeepSeek-V3 Linear weight (q_nope + q_rope,
      kv_down + k_rope, k_nope + v) are orthogonalised as one matrix, as Moonlight does;
      'per_part': each on its own (kimijax.optim.routing).
    split_matrices: under a mesh of several devices, each device runs Newton-Schulz on a share
      of the whole matrices (orthogonalise_all); False leaves the layout to XLA.
    moe_router: the MoE routers' rule, 'muon' (Moonlight) or 'adamw'.
  """
  routing = Routing(
    per_head=per_head, muon_mask=muon_mask, muon_views=muon_views, mla_views=mla_views, router=moe_router
  )
  tail = lambda: (optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate))
  partition = optax.partition(
    {
      MUON: optax.chain(
        scale_by_muon(
          momentum=momentum,
          nesterov=nesterov,
          ns_steps=ns_steps,
          ns_dtype=ns_dtype,
          rms_scale=rms_scale,
          view_fn=routing.view,
          group_fn=routing.group,
          split_matrices=split_matrices,
        ),
        *tail(),
      ),
      ADAMW: optax.chain(adamw_direction(adam_b1, adam_b2, adam_eps), *tail()),
    },
    routing.labels,
  )
  return accept_boxed(partition)  # model.init's boxed parameters route as the plain ones do
