"""The one timer of the benchmarks: wall time of device work, synchronised so that JAX's
asynchronous dispatch does not hide it.

`call_ms` times single calls (each one waited for): the median and minimum of `repeats` calls
after `warmup` untimed ones (the first call compiles). `queued_ms` times the same calls queued
back to back and waited for once, as a training step queues its layers: the device time per call
without the host's per-call dispatch and wait. `loop_ms` times a loop whose steps feed
each other (a train step's state, a decode step's cache): it waits only at the ends, so the host
queues step n + 1 while the device runs step n, as in training.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def _block(x):
  import jax

  return jax.block_until_ready(x)


def call_times_ms(
  fn: Callable[[], Any], *, repeats: int = 10, warmup: int = 2, sync: Callable[[Any], Any] = _block
) -> list[float]:
  """Milliseconds of each of `repeats` calls fn(), each followed by sync(result), after `warmup`
  untimed calls. `sync` defaults to jax.block_until_ready (pass e.g. a torch.cuda.synchronize
  wrapper for other frameworks)."""
  if repeats < 1:
    raise ValueError(f'repeats={repeats} must be >= 1')
  for _ in range(warmup):
    sync(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    sync(fn())
    times.append((time.perf_counter() - start) * 1e3)
  return times


def call_ms(
  fn: Callable[[], Any], *, repeats: int = 10, warmup: int = 2, sync: Callable[[Any], Any] = _block
) -> tuple[float, float]:
  """(median, min) milliseconds per call of fn(); see call_times_ms."""
  times = call_times_ms(fn, repeats=repeats, warmup=warmup, sync=sync)
  return statistics.median(times), min(times)


def queued_ms(
  fn: Callable[[], Any], *, repeats: int = 10, warmup: int = 2, sync: Callable[[Any], Any] = _block
) -> float:
  """Mean milliseconds per call of `repeats` independent calls fn() issued back to back, with
  sync only on the last result (the device runs them in order), after `warmup` waited calls."""
  if repeats < 1:
    raise ValueError(f'repeats={repeats} must be >= 1')
  for _ in range(warmup):
    sync(fn())
  start = time.perf_counter()
  for _ in range(repeats):
    out = fn()
  sync(out)
  return (time.perf_counter() - start) / repeats * 1e3


def loop_ms(step: Callable[[Any], Any], carry: Any, *, steps: int, warmup: int = 1) -> tuple[float, Any]:
  """Mean milliseconds per step of `carry = step(carry)` over `steps` steps, after `warmup`
  untimed steps; waits for the device only before and after the timed loop. Returns (ms, carry)."""
  if steps < 1:
    raise ValueError(f'steps={steps} must be >= 1')
  for _ in range(warmup):
    carry = step(carry)
  _block(carry)
  start = time.perf_counter()
  for _ in range(steps):
    carry = step(carry)
  _block(carry)
  return (time.perf_counter() - start) / steps * 1e3, carry


def copy_bytes_per_s(nbytes: int, steps: int = 10) -> float:
  """The device's copy bandwidth, bytes per second: a jitted x + 1 over a float32 buffer of about
  `nbytes`, donated (updated in place, as a decode step updates its cache), read and written once
  per call; the mean of `steps` chained calls (loop_ms)."""
  import jax
  import jax.numpy as jnp

  n = max(1, nbytes // 4)
  add_one = jax.jit(lambda x: x + 1, donate_argnums=0)
  ms, _ = loop_ms(add_one, jnp.zeros((n,), jnp.float32), steps=steps)
  return 2 * 4 * n / (ms / 1e3)
