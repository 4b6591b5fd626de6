"""kimijax/train/loss.py and train.loss_chunk: the chunked cross-entropy against a float64 NumPy
log-softmax, and the train and eval steps' loss, gradients and sums with chunks against those of
the whole logits (tied and untied head, masked tokens, chunks that divide the tokens and one that
does not, MoE with its balance loss, the KDA hybrid); the compiled step's memory without the
logits [B, T, V]."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax import config as config_lib
from kimijax.layers.moe import MOE_STATE
from kimijax.model import Transformer
from kimijax.train.loss import chunked_token_nll
from kimijax.train.step import make_eval_step, make_loss_fn

B, T, V = 2, 12, 40


def model_config(**model):
  c = config_lib.base_config()
  c.model.update(d_model=32, num_layers=2, num_heads=2, mlp_dim=64, vocab_size=V, compute_dtype='float32')
  c.model.moe.update(model.pop('moe', {}))
  c.model.update(model)
  return config_lib.validate(c).model


def random_batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T + 1))
  mask = (rng.random((B, T)) > 0.3).astype(np.float32)
  mask[0, :3] = 0.0
  return {'inputs': jnp.asarray(tokens[:, :-1]), 'targets': jnp.asarray(tokens[:, 1:]), 'mask': jnp.asarray(mask)}


def rel_err(got, want) -> float:
  """The largest relative error over the leaves, in the norm of each."""
  errs = jax.tree.map(
    lambda g, w: float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30)),
    got,
    want,
  )
  return max(jax.tree.leaves(errs))


@pytest.mark.parametrize('chunk', [4, 5, 7, 100], ids=['divides', 'pads', 'evens_out', 'larger_than_tokens'])
def test_chunked_nll_and_hits_match_a_float64_log_softmax(chunk):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((B, T, 16)).astype(np.float32)
  head = rng.standard_normal((16, V)).astype(np.float32)
  targets = rng.integers(0, V, (B, T))
  nll, hit = jax.jit(lambda *a: chunked_token_nll(*a, chunk, accuracy=True))(x, head, targets)
  logits = x.astype(np.float64) @ head.astype(np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  np.testing.assert_allclose(nll, -np.take_along_axis(logp, targets[..., None], -1)[..., 0], rtol=1e-5)
  np.testing.assert_array_equal(hit, (logits.argmax(-1) == targets).astype(np.float32))


# name: (model keys, model.moe keys, train.loss_chunk) for B * T = 24 tokens
MOE = {'expert_hidden': 16, 'num_experts': 4, 'aux_loss_alpha': 0.1, 'first_dense_layers': 0}
CASES = {
  'untied_divides': ({'tie_embeddings': False, 'num_layers': 1}, {}, 8),
  'tied_pads': ({'tie_embeddings': True, 'num_layers': 1}, {}, 5),
  'moe_aux_loss': ({'mlp_kind': 'moe', 'num_layers': 1}, MOE, 6),
  'hybrid_kda': ({'layer_pattern': 'KA', 'kda_impl': 'xla', 'tie_embeddings': False}, {}, 8),
}


# The loss sees only the final hidden states: the mixer does not matter, so the KDA case runs under make test-all.
@pytest.mark.parametrize('case', [pytest.param(c, marks=pytest.mark.long) if c == 'hybrid_kda' else c for c in CASES])
def test_chunked_loss_gradients_and_eval_equal_the_whole_logits(case):
  model_keys, moe_keys, chunk = CASES[case]
  cfg = model_config(**model_keys, moe=moe_keys)
  model = Transformer(cfg)
  batch = random_batch()
  variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), batch['inputs']))
  params, moe_state = variables['params'], variables.get(MOE_STATE)
  results = {}
  for c in (0, chunk):
    grad = jax.jit(jax.value_and_grad(make_loss_fn(model, c), has_aux=True))
    results[c] = grad(params, batch, moe_state)
  ((loss, aux), grads), ((want_loss, want_aux), want_grads) = results[chunk], results[0]
  assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
  assert rel_err(grads, want_grads) <= 1e-5
  assert ('head' in params) == (not cfg.tie_embeddings)
  assert jax.tree.structure(aux) == jax.tree.structure(want_aux)
  if moe_state:
    assert float(loss - aux['nll']) > 0  # the balance loss is in
    assert abs(float(aux['nll']) - float(want_aux['nll'])) <= 1e-5 * float(want_aux['nll'])


@pytest.mark.parametrize('chunk', [pytest.param(8, marks=pytest.mark.long), 5], ids=['divides', 'pads'])
def test_chunked_eval_sums_equal_the_whole_logits(chunk):
  """nll, argmax hits and their per-position sums; the MoE biases ride in the variables."""
  model = Transformer(model_config(mlp_kind='moe', num_layers=1, moe=MOE))
  batch = random_batch(seed=2)
  variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), batch['inputs']))
  sums, want = (jax.jit(make_eval_step(model, c))(variables, batch) for c in (chunk, 0))
  assert rel_err(sums, want) <= 1e-5
  assert float(sums['tokens']) == float(batch['mask'].sum())
  assert float(sums['correct']) == float(want['correct'])


def test_the_compiled_chunked_step_does_not_hold_the_logits():
  """XLA's temporaries of the loss and gradient, V 4096 x T 2048: the whole logits (32 MiB float32)
  and their gradient are held without chunks, one chunk's (4 MiB) with chunks of 256."""
  cfg = model_config(vocab_size=4096, num_layers=1, d_model=64, mlp_dim=128, tie_embeddings=False)
  model = Transformer(cfg, max_logits=False)
  shape = (1, 2048)
  batch = {
    'inputs': jax.ShapeDtypeStruct(shape, jnp.int32),
    'targets': jax.ShapeDtypeStruct(shape, jnp.int32),
    'mask': jax.ShapeDtypeStruct(shape, jnp.float32),
  }
  params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(shape, jnp.int32)))['params']
  temp = {
    c: jax.jit(jax.grad(lambda p, b: make_loss_fn(model, c)(p, b)[0])).lower(params, batch).compile() for c in (0, 256)
  }
  temp = {c: compiled.memory_analysis().temp_size_in_bytes for c, compiled in temp.items()}
  logits_bytes = 4 * shape[1] * cfg.vocab_size
  assert temp[0] - temp[256] >= logits_bytes, temp
