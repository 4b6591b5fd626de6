"""Which optimizer rule each parameter gets, and how Muon sees it as a matrix.

Muon orthogonalises matrices; our kernels are 2-D or 3-D, and Flax keeps the head axes apart
([D, H, Dh]) so that QK-Clip can index heads. A `MatrixView` says which axes of a parameter are
a stack (each slice is its own matrix), which are folded into the matrix rows (A) and which into
the columns (B). A parameter of shape [*stack, *rows, *cols] (after a transpose) becomes
prod(stack) matrices of shape [prod(rows), prod(cols)], each orthogonalised on its own and
scaled by rms_scale * sqrt(max(A, B)) of that matrix (docs/optimizers.md#muon).

Default routing (`default_route`), decided from the parameter's path names and shape only, so it
gives the same answer for boxed (nn.Partitioned) parameters at init and plain arrays in update:

    AdamW:  any parameter with < 2 axes (norm gains, biases, Attention Residuals pseudo-queries);
            'embed' and 'head' (embeddings and the output head, Moonlight's exclusions);
            KDA's 'A_log' and 'dt_bias' (per-head decay parameters, not feature maps);
            anything named '*bias', anything under a module whose name contains 'norm';
            short-conv kernels (a path name containing 'conv'): depthwise taps [width, H, Dh]
            are per-channel filters, not a linear map between feature spaces.
    MoE:    the router [D, E] goes to Muon (as Moonlight trains it; Routing(router='adamw') sends
            it to AdamW instead); the stacked experts [E, D, F] / [E, F, D] to Muon as E
            matrices, each orthogonalised and scaled by sqrt(max(D, F)) on its own.
    Muon:   every other parameter with >= 2 axes, with the matrix view
            2-D [in, out]                                 -> one [in, out] matrix
            'query' 'key' 'value' (attention), 'q_proj' 'k_proj' 'v_proj' 'f_b' 'g_b' (KDA),
            'q_nope' 'q_rope' 'k_nope' 'v' (MLA)   [in, H, Dh]
                                                          -> one [in, H*Dh] matrix
            'out' 'o_proj'  [H, Dh, out]                  -> one [H*Dh, out] matrix
            other >= 3-D                                  -> leading axes are a stack (scanned
                                                             layers, experts), last two the matrix
With per_head=True the head-structured kernels become stacks of per-head matrices instead:
[in, H, Dh] -> H matrices [in, Dh], [H, Dh, out] -> H matrices [Dh, out].

The fused view is the default because it is what Moonlight (and Kimi's released code) do: q/k/v/o
are single nn.Linear weights there, orthogonalised whole. Moonlight's per-matrix rule for stacks applies to
weights that are genuinely separate matrices (experts, scanned layers); per_head=True is there to
ablate it.

MLA (mla_views): kimijax keeps MLA's no-position and rotary parts as separate parameters (QK-Clip
scales them differently), but Moonlight's models (the DeepSeek-V3 layout) hold them as one Linear
weight each, and Muon orthogonalises each whole matrix. With mla_views='fused' (the default) the
parts of one such weight are orthogonalised as one matrix, side by side along the columns (they
share the rows, the input), and scaled by sqrt(max(A, B)) of the fused matrix:

    parts (kimijax)          fused matrix (DeepSeek-V3 name)   shape
    q_nope + q_rope          q_b_proj (q_proj without q lora)  [q_in, H*d_nope + H*d_rope]
    kv_down + k_rope         kv_a_proj_with_mqa                [D, r + d_rope]
    k_nope + v               kv_b_proj                         [r, H*d_nope + H*d_v]

(Newton-Schulz commutes with a permutation of the columns, so DeepSeek's per-head interleaving of
the columns gives the same update.) With per_head=True the fused matrices are per head too:
[q_in, d_nope + d_rope] and [r, d_nope + d_v] for each head. mla_views='per_part' orthogonalises
each part on its own (the views of the table above, one per parameter). Parts are grouped by
name within one module, so a module with only some of the parts (NoPE without rotary dims has no
q_rope or k_rope) fuses what it has.

Overrides: `muon_mask` (True -> Muon, False -> AdamW) replaces the rule choice; `muon_views`
replaces the matrix view of Muon parameters.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import flax.core.meta
import jax

MUON, ADAMW = 'muon', 'adamw'

ADAMW_BY_NAME = {
  'embed': 'embedding',
  'head': 'output head',
  'A_log': 'KDA decay rate',
  'dt_bias': 'KDA gate bias',
}
_INTO_HEADS = re.compile(r'^(query|key|value|[qkv]_proj|[fg]_b|q_nope|q_rope|k_nope|v)$')  # [in, H, Dh]
_OUT_OF_HEADS = re.compile(r'^(out|o_proj)$')  # [H, Dh, out]
# MLA parameters that are column blocks of one Linear weight in the DeepSeek-V3 layout.
MLA_FUSED = {
  'q_nope': 'q_b_proj',
  'q_rope': 'q_b_proj',
  'kv_down': 'kv_a_proj_with_mqa',
  'k_rope': 'kv_a_proj_with_mqa',
  'k_nope': 'kv_b_proj',
  'v': 'kv_b_proj',
}
MLA_VIEWS = ('fused', 'per_part')
ROUTER_RULES = (MUON, ADAMW)  # where the MoE routers go (Routing(router=...), optimizer.moe_router)
_EXPERT_STACKS = ('wi_gate', 'wi_up', 'wo')  # the MoE layer's stacked experts, under its 'mlp'


@dataclasses.dataclass(frozen=True)
class MatrixView:
  """Axes of a parameter that form the stack, the matrix rows (A) and the columns (B).

  Together they must list every axis once. Frozen and not a pytree node, so a tree of views is
  a tree of leaves.
  """

  stack: tuple[int, ...]
  rows: tuple[int, ...]
  cols: tuple[int, ...]

  def check(self, shape, where: str = '') -> None:
    axes = self.stack + self.rows + self.cols
    if sorted(axes) != list(range(len(shape))) or not self.rows or not self.cols:
      raise ValueError(
        f'MatrixView {self} does not split the {len(shape)} axes of shape {tuple(shape)} '
        f'into stack, rows and cols (each axis once, rows and cols non-empty){where}'
      )

  def sizes(self, shape) -> tuple[int, int, int]:
    """(number of matrices, rows A, cols B)."""
    size = lambda axes: math.prod(shape[a] for a in axes)
    return size(self.stack), size(self.rows), size(self.cols)

  def to_matrices(self, x):
    """x [...] -> [S, A, B]."""
    s, a, b = self.sizes(x.shape)
    return x.transpose(self.stack + self.rows + self.cols).reshape(s, a, b)

  def from_matrices(self, x_sab, shape):
    """[S, A, B] -> the parameter's shape (inverse of to_matrices)."""
    perm = self.stack + self.rows + self.cols
    x = x_sab.reshape(tuple(shape[a] for a in perm))
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return x.transpose(inverse)

  def describe(self, shape) -> str:
    """e.g. '[256, 4*64]' or '4 x [256, 64]'."""
    side = lambda axes: '*'.join(str(shape[a]) for a in axes)
    out = f'[{side(self.rows)}, {side(self.cols)}]'
    return f'{side(self.stack)} x {out}' if self.stack else out


def fused_description(parts: list[tuple[MatrixView, tuple[int, ...]]]) -> str:
  """The matrix of column blocks side by side, e.g. '[32, 4*16+4*16]' or '4 x [32, 16+16]'."""
  side = lambda shape, axes: '*'.join(str(shape[a]) for a in axes)
  view, shape = parts[0]
  out = f'[{side(shape, view.rows)}, {"+".join(side(s, v.cols) for v, s in parts)}]'
  return f'{side(shape, view.stack)} x {out}' if view.stack else out


def path_names(path) -> tuple[str, ...]:
  """A jax key path as plain strings: (('layer_0'), ('attention'), ('query'))."""
  names = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
    else:
      names.append(str(k))
  return tuple(names)


def default_view(names: tuple[str, ...], shape, per_head: bool = False) -> MatrixView:
  """The matrix view of a Muon parameter from its name and shape (see the module docstring)."""
  ndim, leaf = len(shape), names[-1] if names else ''
  if ndim == 2:
    return MatrixView((), (0,), (1,))
  if ndim == 3 and _INTO_HEADS.match(leaf):
    return MatrixView((1,), (0,), (2,)) if per_head else MatrixView((), (0,), (1, 2))
  if ndim == 3 and _OUT_OF_HEADS.match(leaf):
    return MatrixView((0,), (1,), (2,)) if per_head else MatrixView((), (0, 1), (2,))
  return MatrixView(tuple(range(ndim - 2)), (ndim - 2,), (ndim - 1,))


def default_route(names: tuple[str, ...], shape, router: str = MUON) -> tuple[str, str]:
  """(rule, reason) for a parameter by the default routing (`router`: the MoE routers' rule)."""
  leaf = names[-1] if names else ''
  if len(shape) < 2:
    return ADAMW, f'{len(shape)}-D'
  if leaf == 'router' and len(shape) == 2:
    return router, 'MoE router'
  if leaf in _EXPERT_STACKS and len(shape) == 3 and 'mlp' in names:
    return MUON, f'MoE experts, {shape[0]} matrices'
  if leaf in ADAMW_BY_NAME:
    return ADAMW, ADAMW_BY_NAME[leaf]
  if leaf == 'bias' or leaf.endswith('_bias'):
    return ADAMW, 'bias'
  if any('norm' in n.lower() for n in names):
    return ADAMW, 'norm gain'
  if any('conv' in n.lower() for n in names):
    return ADAMW, 'short-conv taps'
  return MUON, 'hidden matrix'


def _is_box(x) -> bool:
  return isinstance(x, flax.core.meta.AxisMetadata)


def _unbox(x):
  return x.unbox() if _is_box(x) else x


@dataclasses.dataclass(frozen=True)
class Route:
  rule: str  # 'muon' or 'adamw'
  reason: str
  view: MatrixView | None  # for 'muon' only


class Routing:
  """Routes parameters to Muon or AdamW and gives Muon parameters their matrix view.

  Args:
    per_head: head-structured 3-D kernels as stacks of per-head matrices (default: one matrix).
    mla_views: 'fused' (Moonlight's DeepSeek-V3 matrices, the default) or 'per_part' (each MLA
      parameter its own matrix); see the module docstring.
    muon_mask: pytree of bools with the parameters' structure, or a callable params -> such a
      pytree; True sends a parameter to Muon, False to AdamW, replacing the default rule.
    muon_views: pytree of MatrixView (or None for the default) with the parameters' structure,
      or a callable (path_names, shape) -> MatrixView | None.
    router: the rule of the MoE routers, 'muon' (Moonlight, the default) or 'adamw'.
  """

  def __init__(
    self, *, per_head: bool = False, muon_mask=None, muon_views=None, mla_views: str = 'fused', router: str = MUON
  ):
    if mla_views not in MLA_VIEWS:
      raise ValueError(f'mla_views={mla_views!r} is not one of {MLA_VIEWS}')
    if router not in ROUTER_RULES:
      raise ValueError(f'router={router!r} is not one of {ROUTER_RULES}')
    self.router = router
    self.per_head = per_head
    self.mla_views = mla_views
    self.muon_mask = muon_mask
    if muon_views is None or callable(muon_views):
      self._view_override = muon_views
    else:
      flat = jax.tree_util.tree_flatten_with_path(muon_views, is_leaf=lambda x: x is None or isinstance(x, MatrixView))[
        0
      ]
      table = {path_names(p): v for p, v in flat}
      self._view_override = lambda names, shape: table.get(names)

  def view(self, names: tuple[str, ...], shape) -> MatrixView:
    view = self._view_override(names, shape) if self._view_override else None
    view = view or default_view(names, shape, self.per_head)
    view.check(shape, f' (parameter {"/".join(names)})')
    return view

  def group(self, names: tuple[str, ...]) -> tuple[str, ...] | None:
    """The fused matrix a Muon parameter is a column block of (its module's path + the
    DeepSeek-V3 name), or None for a matrix of its own."""
    fused = MLA_FUSED.get(names[-1]) if names and self.mla_views == 'fused' else None
    return None if fused is None else names[:-1] + (fused,)

  def routes(self, params) -> Any:
    """Pytree of Route, with the unboxed structure of `params` (boxed or plain arrays, or
    ShapeDtypeStructs)."""
    mask = self.muon_mask(params) if callable(self.muon_mask) else self.muon_mask

    def one(path, leaf, m=None):
      names, shape = path_names(path), _unbox(leaf).shape
      rule, reason = default_route(names, shape, self.router)
      m = _unbox(m)
      if m is not None:
        if bool(m) != (rule == MUON):
          rule, reason = (MUON if m else ADAMW), 'muon_mask'
        if rule == MUON and len(shape) < 2:
          raise ValueError(
            f'muon_mask sends {"/".join(names)} of shape {tuple(shape)} to Muon, which needs a parameter with >= 2 axes'
          )
      return Route(rule, reason, self.view(names, shape) if rule == MUON else None)

    if mask is None:
      return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_box)
    return jax.tree_util.tree_map_with_path(one, params, mask, is_leaf=_is_box)

  def labels(self, params) -> Any:
    """Pytree of 'muon' / 'adamw' strings (the labels of optax.partition)."""
    return jax.tree.map(lambda r: r.rule, self.routes(params))

  def table(self, params) -> str:
    """A text table: path, shape, rule, matrix view, reason; one row per parameter."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
    routes = jax.tree.leaves(self.routes(params))
    rows = [('parameter', 'shape', 'rule', 'matrix view', 'why')]
    counts = {MUON: 0, ADAMW: 0}
    members: dict[tuple[str, ...], list[tuple[str, MatrixView, tuple[int, ...]]]] = {}
    for (path, leaf), route in zip(flat, routes):
      key = self.group(path_names(path)) if route.rule == MUON else None
      if key is not None:
        members.setdefault(key, []).append((path_names(path)[-1], route.view, tuple(_unbox(leaf).shape)))
    for (path, leaf), route in zip(flat, routes):
      shape = tuple(_unbox(leaf).shape)
      counts[route.rule] += math.prod(shape)
      view, reason = route.view.describe(shape) if route.view else '-', route.reason
      key = self.group(path_names(path)) if route.rule == MUON else None
      if key is not None and len(members[key]) > 1:
        view = fused_description([(v, s) for _, v, s in members[key]])
        reason += f', fused: {key[-1]} = {" + ".join(n for n, _, _ in members[key])}'
      rows.append(('/'.join(path_names(path)), str(list(shape)), route.rule, view, reason))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, '  '.join('-' * w for w in widths))
    lines.append(f'muon: {counts[MUON]:,} parameters, adamw: {counts[ADAMW]:,} parameters')
    return '\n'.join(lines)
