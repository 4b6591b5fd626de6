"""Learning-rate schedules and the optimizer named by config.optimizer."""

from __future__ import annotations

import jax
import ml_collections
import optax


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup, then 'cosine' decay, 'wsd' (stable, then linear decay over the last
  decay_fraction of the steps) or 'constant'; all end at min_lr_ratio * learning_rate."""
  o, steps = config.optimizer, config.train.steps
  peak, floor = o.learning_rate, o.learning_rate * o.min_lr_ratio
  warmup = min(o.warmup_steps, steps)
  warm = optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
  rest = max(steps - warmup, 1)
  if o.schedule == 'cosine':
    after = optax.cosine_decay_schedule(peak, rest, alpha=o.min_lr_ratio)
  elif o.schedule == 'wsd':
    decay = max(int(round(o.decay_fraction * steps)), 1)
    after = optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
        [max(rest - decay, 0)])
  elif o.schedule == 'constant':
    after = optax.constant_schedule(peak)
  else:
    raise ValueError(f'optimizer.schedule={o.schedule!r} is unknown')
  return optax.join_schedules([warm, after], [warmup])


def decay_mask(params):
  """Weight decay on matrices only (ndim >= 2); norm gains and vectors are not decayed."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  o = config.optimizer
  schedule = make_schedule(config)
  clip = [optax.clip_by_global_norm(config.train.grad_clip)] if config.train.grad_clip > 0 else []
  if o.name == 'adamw':
    opt = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
  else:
    raise ValueError(f'optimizer.name={o.name!r} is unknown')
  return optax.chain(*clip, opt)
