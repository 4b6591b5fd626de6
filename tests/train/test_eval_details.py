"""The eval step's accuracy and loss-by-position sums against a float64 NumPy transcription of the
same logits, and the loop's power-of-two position buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.model import Transformer
from kimijax.train.loop import evaluate_details, position_buckets
from kimijax.train.step import make_eval_step
from tiny_config import TINY, make_config


def test_position_buckets_double_and_cover_every_position_once():
  assert position_buckets(16) == [(0, 0), (1, 2), (3, 6), (7, 15)]   # 1, 2-3, 4-7, 8-16 tokens seen
  for t in (1, 5, 64, 100, 4096):
    buckets = position_buckets(t)
    assert buckets[0][0] == 0 and buckets[-1][1] == t - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(buckets, buckets[1:]))


def test_eval_sums_match_numpy_per_position_and_accuracy():
  config = make_config({**TINY, 'train.seq_len': 16})
  model = Transformer(config.model)
  rng = np.random.default_rng(0)
  batches = [{'inputs': rng.integers(0, 256, (3, 16)).astype(np.int32),
              'targets': rng.integers(0, 256, (3, 16)).astype(np.int32),
              'mask': (rng.random((3, 16)) < 0.7).astype(np.float32)} for _ in range(2)]
  params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))['params']
  details = evaluate_details(jax.jit(make_eval_step(model)), params, batches)

  nll = np.zeros(16)
  count = np.zeros(16)
  hits = 0.0
  for b in batches:
    logits = np.asarray(model.apply({'params': params}, b['inputs'])[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    tok = -np.take_along_axis(logp, b['targets'][..., None], -1)[..., 0]
    nll += (tok * b['mask']).sum(0)
    count += b['mask'].sum(0)
    hits += ((logits.argmax(-1) == b['targets']) * b['mask']).sum()
  assert details['eval_loss'] == pytest.approx(nll.sum() / count.sum(), rel=1e-5)
  assert details['accuracy'] == pytest.approx(hits / count.sum(), abs=1e-7)
  assert details['position_buckets'] == [[0, 0], [1, 2], [3, 6], [7, 15]]
  for (first, last), loss in zip(details['position_buckets'], details['loss_by_position']):
    sl = slice(first, last + 1)
    if count[sl].sum():
      assert loss == pytest.approx(nll[sl].sum() / count[sl].sum(), rel=1e-5)
    else:
      assert loss is None
