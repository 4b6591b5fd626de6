"""What several Pallas kernels share: row padding, the custom-VJP helpers for symbolic-zero
cotangents, Triton compiler parameters and when to interpret. The base of their settings and its
parsing: kernels_pallas/settings.py.
"""

from __future__ import annotations

import jax

# Imported for its side effect only: it registers a config option that is part of jit's trace
# context. Pallas's CPU interpreter imports it during a first trace, after jit has keyed that
# call, so every jitted function holding an interpreted kernel would trace and compile again on
# its second call.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values


def power_of_two_divisor(n: int, at_most: int) -> int:
  """The largest power of two that divides n and is <= at_most (Triton block shapes are powers
  of two); 1 when only 1 does."""
  p = 1 << (max(at_most, 1).bit_length() - 1)
  while n % p:
    p //= 2
  return p


def feature_chunk(d: int, target: int = 64) -> int:
  """The largest power of two <= target dividing d (at least 16): the feature tile of kernels
  that walk a row of d features in chunks (Triton block shapes are powers of two)."""
  c = power_of_two_divisor(d, target)
  if c < 16:
    raise ValueError(f'the Pallas kernels need the feature dim (d_model) divisible by 16; got {d}')
  return c


def round_up(m: int, quantum: int) -> int:
  """The least multiple of quantum >= m (rows padded to a whole number of tiles)."""
  return -(-m // quantum) * quantum


def pad_rows(x, m_pad: int, value=0):
  """x [M, ...] padded with `value` to m_pad rows (x itself when it already has them)."""
  pad = ((0, m_pad - x.shape[0]),) + ((0, 0),) * (x.ndim - 1)
  return x if x.shape[0] == m_pad else jnp.pad(x, pad, constant_values=value)


# ----------------------------------------------------------------------------- backend


def triton_params(num_warps: int, num_stages: int):
  """Triton's compiler parameters of one kernel."""
  from jax.experimental.pallas import triton as plgpu

  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def compiler_params(settings, kernel: str = ''):
  """Triton parameters of one kernel from its family's settings: fields warps{kernel} and stages{kernel}."""
  return triton_params(getattr(settings, 'warps' + kernel), getattr(settings, 'stages' + kernel))


def kernels_interpreted() -> bool:
  """Whether Pallas kernels run in interpret mode: off the GPU (slow: for tests on the CPU)."""
  return jax.default_backend() != 'gpu'


# ----------------------------------------------------------------------------- custom VJP


def defvjp_with_symbolic_zeros(fn, fwd, bwd, num_diff_args: int):
  """fn.defvjp(fwd, bwd) where bwd sees a SymbolicZero for each output that nothing uses (to
  skip work on it; `dense` makes one an array) and fwd gets plain values, not the wrapped
  primals, for fn's first num_diff_args arguments (the differentiable ones)."""
  fn.defvjp(
    lambda *args: fwd(*custom_vjp_primal_tree_values(args[:num_diff_args]), *args[num_diff_args:]),
    bwd,
    symbolic_zeros=True,
  )


def dense(cotangent, shape, dtype):
  """A custom VJP's cotangent (symbolic zeros passed) as an array: zeros if symbolic."""
  return jnp.zeros(shape, dtype) if isinstance(cotangent, SymbolicZero) else cotangent


def is_zero(cotangent) -> bool:
  """Whether a custom VJP's cotangent is a symbolic zero (its output unused)."""
  return isinstance(cotangent, SymbolicZero)
