"""Optimizers as optax GradientTransformations, picked by config.optimizer.name."""

from kimijax.optim.factory import describe, make_optimizer, make_schedule, param_groups, routing_summary
from kimijax.optim.muon import muon, scale_by_muon
from kimijax.optim.qk_clip import qk_clip
from kimijax.optim.routing import MatrixView, Routing

__all__ = [
  'MatrixView',
  'Routing',
  'describe',
  'make_optimizer',
  'make_schedule',
  'muon',
  'param_groups',
  'qk_clip',
  'routing_summary',
  'scale_by_muon',
]
