"""Optimizers as optax GradientTransformations, picked by config.optimizer.name."""

from kimijax.optim.factory import make_optimizer, make_schedule

__all__ = ['make_optimizer', 'make_schedule']
