"""experiments/bench/timing.py's queued_ms: the calls are issued back to back and waited for once."""

import pytest

from experiments.bench import timing


def test_queued_ms_waits_once_for_the_last_of_the_queued_calls(monkeypatch):
  clock = iter([10.0, 10.6])  # perf_counter at the start and after the final wait
  monkeypatch.setattr(timing.time, 'perf_counter', lambda: next(clock))
  issued, waited = [], []

  def fn():
    issued.append(len(issued))
    return issued[-1]

  ms = timing.queued_ms(fn, repeats=3, warmup=2, sync=waited.append)
  assert issued == [0, 1, 2, 3, 4]
  assert waited == [0, 1, 4]  # each warm-up call, then only the last queued one
  assert ms == pytest.approx(600.0 / 3)


def test_queued_ms_rejects_no_repeats():
  with pytest.raises(ValueError, match='repeats=0'):
    timing.queued_ms(lambda: None, repeats=0)
