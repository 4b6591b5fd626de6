"""README.md's library example runs as written (it is read from README.md here, so the two cannot
drift), and the parameters it uses behave as the parameters of model.init do: kimijax.init_params
gives model.init's values without the logical-axis boxes, and model.init's boxed parameters go
through Muon and QK-Clip to the same step."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kimijax
import kimijax.config
from kimijax.model import Transformer
from kimijax.optim import muon, qk_clip

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_example() -> str:
  blocks = re.findall(r'^```python\n(.*?)^```$', (ROOT / 'README.md').read_text(), flags=re.S | re.M)
  assert len(blocks) == 1, 'README.md should hold one python block: the library example'
  return blocks[0]


def test_readme_library_example_runs_as_written():
  namespace = {}
  exec(compile(readme_example(), 'README.md', 'exec'), namespace)
  params, o, state = namespace['params'], namespace['o'], namespace['final_state']
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))  # no boxes left
  assert bool(jnp.isfinite(namespace['loss']))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
  assert o.shape == (1, 64, 2, 32) and state.shape == (1, 2, 32, 32) and state.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(o)))


def _tiny():
  return kimijax.config.load(
    'configs/kimi_linear_small.py:all_mla',
    {'model.num_layers': 1, 'model.d_model': 64, 'model.num_heads': 2, 'model.mlp_dim': 96},
  )


def test_init_params_are_model_init_values_without_boxes():
  config = _tiny()
  tokens = jnp.zeros((1, 8), jnp.int32)
  boxed = Transformer(config.model).init(jax.random.key(3), tokens)['params']
  plain = kimijax.init_params(config, jax.random.key(3))
  assert jax.tree.structure(plain) == jax.tree.structure(nn.unbox(boxed))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(nn.unbox(boxed))):  # jitted: last-bit rounding
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


@pytest.mark.long  # ~40 s; the README example's MuonClip step runs by default
def test_boxed_params_from_model_init_take_the_same_muonclip_step():
  """The parameters model.init returns (in LogicallyPartitioned boxes) used to stop QK-Clip with
  "unsupported operand type(s) for +: 'LogicallyPartitioned'"; they now take the step the plain ones
  take. tau is low enough that the clip rewrites weights."""
  config = _tiny()
  model = Transformer(config.model)
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)
  boxed = model.init(jax.random.key(0), tokens[:, :-1])['params']

  def loss_fn(params):
    logits, aux = model.apply({'params': params}, tokens[:, :-1])
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean(), aux

  def one_step(params, tau=1e-3):
    tx = optax.chain(muon(3e-3, weight_decay=0.1), qk_clip(tau=tau))
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, _ = tx.update(grads, tx.init(params), params, max_logits=aux['max_logits'])
    return optax.apply_updates(params, updates)

  from_boxed, from_plain = nn.unbox(one_step(boxed)), one_step(nn.unbox(boxed))
  for a, b in zip(jax.tree.leaves(from_boxed), jax.tree.leaves(from_plain)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  unclipped = one_step(nn.unbox(boxed), tau=1e9)
  q_nope = lambda p: np.asarray(p['layer_0']['mla']['q_nope'])
  assert not np.allclose(q_nope(from_plain), q_nope(unclipped))  # the clip did rewrite the weights
