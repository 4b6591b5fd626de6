"""Learning-rate schedules and the optimizer named by config.optimizer.

    'adamw'     optax.adamw; weight decay on matrices only (decay_mask)
    'muon'      kimijax.optim.muon.muon: Moonlight's Muon on hidden matrices, AdamW on the rest
    'muonclip'  muon, then kimijax.optim.qk_clip.qk_clip(optimizer.qk_clip_tau)

Global-norm gradient clipping (train.grad_clip) comes first in every chain. The returned
transform takes the forward pass's max logits as `update(..., max_logits=...)` (ignored by
all but QK-Clip).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from kimijax.optim.muon import muon
from kimijax.optim.qk_clip import qk_clip
from kimijax.optim.routing import ADAMW, Routing


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup, then 'cosine' decay, 'wsd' (stable, then linear decay over the last
  decay_fraction of the steps), both ending at min_lr_ratio * learning_rate, or 'constant' (the peak
  to the end)."""
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
      [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)], [max(rest - decay, 0)]
    )
  elif o.schedule == 'constant':
    after = optax.constant_schedule(peak)
  else:
    raise ValueError(f'optimizer.schedule={o.schedule!r} is unknown')
  return optax.join_schedules([warm, after], [warmup])


def decay_mask(params):
  """Weight decay on matrices only (ndim >= 2); norm gains and vectors are not decayed."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def routing(config: ml_collections.ConfigDict) -> Routing | None:
  """The Muon/AdamW routing of config's optimizer (None for plain 'adamw')."""
  if config.optimizer.name in ('muon', 'muonclip'):
    o = config.optimizer
    return Routing(per_head=o.muon_per_head, mla_views=o.muon_mla_views, router=o.moe_router)
  return None


def make_optimizer(
  config: ml_collections.ConfigDict, schedule: optax.Schedule | None = None
) -> optax.GradientTransformationExtraArgs:
  """The chain named by config.optimizer.name, stepping with `schedule` (default
  make_schedule(config); the train step passes the one it also logs)."""
  o = config.optimizer
  schedule = make_schedule(config) if schedule is None else schedule
  clip = [optax.clip_by_global_norm(config.train.grad_clip)] if config.train.grad_clip > 0 else []
  if o.name == 'adamw':
    opts = [optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)]
  elif o.name in ('muon', 'muonclip'):
    opts = [
      muon(
        schedule,
        momentum=o.momentum,
        nesterov=o.nesterov,
        ns_steps=o.ns_steps,
        ns_dtype=jnp.dtype(o.ns_dtype),
        rms_scale=o.rms_scale,
        weight_decay=o.weight_decay,
        adam_b1=o.b1,
        adam_b2=o.b2,
        adam_eps=o.eps,
        per_head=o.muon_per_head,
        mla_views=o.muon_mla_views,
        split_matrices=o.muon_split_matrices,
        moe_router=o.moe_router,
      )
    ]
    if o.name == 'muonclip':
      opts.append(qk_clip(o.qk_clip_tau))
  else:
    raise ValueError(f'optimizer.name={o.name!r} is unknown')
  return optax.chain(*clip, *opts)


def param_groups(config: ml_collections.ConfigDict) -> Callable[[Any], Any]:
  """params -> pytree of group labels ('muon' / 'adamw'), for per-group update metrics."""
  r = routing(config)
  return r.labels if r is not None else (lambda params: jax.tree.map(lambda _: ADAMW, params))


def describe(config: ml_collections.ConfigDict, params) -> str | None:
  """The start-up table of which parameter uses which rule (None for plain 'adamw')."""
  r = routing(config)
  return r.table(params) if r is not None else None


def routing_summary(config: ml_collections.ConfigDict, params) -> str | None:
  """describe() in one line: parameters and arrays per rule (None for plain 'adamw')."""
  r = routing(config)
  if r is None:
    return None
  counts: dict[str, list[int]] = {}
  for leaf, route in zip(jax.tree.leaves(params), jax.tree.leaves(r.routes(params))):
    n = counts.setdefault(route.rule, [0, 0])
    n[0] += int(leaf.size)
    n[1] += 1
  return ', '.join(f'{rule} on {n:,} parameters ({arrays} arrays)' for rule, (n, arrays) in sorted(counts.items()))
