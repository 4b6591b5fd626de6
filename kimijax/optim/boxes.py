"""Optimizers that take flax's boxed parameters as they take plain ones.

`Transformer.init` returns its parameters in LogicallyPartitioned boxes (the logical axis names
that shard them). A pytree of boxes has different key paths (each leaf one `.value` deeper), which
Muon's routing reads to choose a parameter's rule and matrix view, and boxes have no arithmetic,
which QK-Clip's weight rewrite needs. `accept_boxed(tx)` runs tx's update on the unboxed trees and
boxes the new updates and state again like the incoming ones, so that `model.init`'s parameters
take exactly the step that `kimijax.init_params`' plain ones take. Its init keeps the boxes: the
train state is built from boxed parameters so that the optimizer state carries their logical axes
and is sharded like them (kimijax/train/state.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import optax


def is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _rebox(like, tree):
  """tree (unboxed) in the boxes of `like` where `like` has them."""
  if not any(is_box(x) for x in jax.tree.leaves(like, is_leaf=is_box)):
    return tree
  return jax.tree.map(lambda box, x: box.replace_boxed(x) if is_box(box) else x, like, tree, is_leaf=is_box)


def accept_boxed(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
  """tx whose update unboxes its inputs and boxes its results like them (init unchanged)."""

  def update(updates, state, params=None, **extra_args):
    new, new_state = tx.update(
      nn.unbox(updates), nn.unbox(state), None if params is None else nn.unbox(params), **extra_args
    )
    return _rebox(updates, new), _rebox(state, new_state)

  return optax.GradientTransformationExtraArgs(tx.init, update)
