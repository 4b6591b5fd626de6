"""Export to the released Hugging Face layout (kimijax.hf.export) against the released folders: a run
started from a released folder is written back to the same tensors, byte for byte, and a model
trained here is written as a folder that the reader (itself checked against transformers in
tests/test_released.py) gives back as the same parameters and the same logits."""

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from experiments.tools.hf_export_check import CASES
from kimijax import config as config_lib
from kimijax.hf.export import export_folder
from kimijax.hf.safetensors import HfError, SafetensorsFolder
from kimijax.hf.weights import load_numpy
from kimijax.model import Transformer, as_variables, inference_variables

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'released'


@pytest.mark.parametrize('name', ['kimi_linear', 'moonlight', 'deepseek_v3'])
def test_a_released_run_exports_to_its_own_tensors(tmp_path, name):
  """Read, then written in the source's layout and dtypes (bf16 with a float32 bias for
  deepseek_v3): every tensor has the source's name, dtype, shape and bytes; config.json is copied."""
  folder = FIXTURES / name
  config = config_lib.load(f'configs/released.py:{folder}')
  params, moe_state = load_numpy(folder, config.model)
  out = export_folder(tmp_path / 'out', config, params, moe_state)
  source, written = SafetensorsFolder(folder), SafetensorsFolder(out)
  assert written.names == source.names
  for n in source.names:
    a, b = source.get(n), written.get(n)
    assert a.dtype == b.dtype and a.shape == b.shape, n
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=n)
  assert (out / 'config.json').read_bytes() == (folder / 'config.json').read_bytes()
  index = json.loads((out / 'model.safetensors.index.json').read_text())
  assert sorted(index['weight_map']) == source.names
  assert not (tmp_path / 'out.partial').exists()


def _random_variables(model_cfg, seed=0):
  """Parameters as initialised, MoE biases drawn nonzero (an initialised bias is 0)."""
  model = Transformer(config_lib.portable(model_cfg))
  variables = model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
  rng = np.random.default_rng(seed)
  draw = lambda b: rng.normal(0, 0.1, b.shape).astype(np.float32)
  return model, nn.unbox(variables['params']), jax.tree.map(draw, dict(variables.get('moe_state', {})))


# the models experiments/tools/hf_export_check.py also gives to transformers, and the family each becomes
FAMILY = {'kimi_linear_moe': 'kimi_linear', 'mla_dense_qlora': 'deepseek_v3'}
FAMILY.update(moonlight_small='deepseek_v3', moonlight_yarn='deepseek_v3')


@pytest.mark.parametrize('name', sorted(CASES))
def test_a_model_trained_here_exports_and_reads_back_the_same(tmp_path, name):
  """float32 export, then configs/released.py on the written folder: the same parameters exactly,
  the same MoE biases, and the same logits from the model its config.json describes."""
  (file, overrides), family = CASES[name], FAMILY[name]
  config = config_lib.load(file, overrides={'model.compute_dtype': 'float32', **overrides})
  model, params, moe_state = _random_variables(config.model)
  out = export_folder(tmp_path / 'out', config, params, moe_state, dtype='float32')
  assert json.loads((out / 'config.json').read_text())['model_type'] == family
  back = config_lib.load(f'configs/released.py:{out}')
  params_back, moe_back = load_numpy(out, back.model)
  jax.tree.map(np.testing.assert_array_equal, params_back, jax.tree.map(np.asarray, params))
  jax.tree.map(np.testing.assert_array_equal, moe_back, moe_state)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 16)), jnp.int32)
  logits, _ = model.apply(as_variables(inference_variables(params, moe_state)), tokens)
  logits_back, _ = Transformer(back.model).apply(as_variables(inference_variables(params_back, moe_back)), tokens)
  np.testing.assert_allclose(logits_back, logits, rtol=1e-5, atol=1e-5)


def test_the_default_dtype_is_bfloat16_with_a_float32_router_bias(tmp_path):
  config = config_lib.load('configs/moonlight_small.py', overrides={'model.compute_dtype': 'float32'})
  _, params, moe_state = _random_variables(config.model)
  files = SafetensorsFolder(export_folder(tmp_path / 'out', config, params, moe_state))
  bias = 'model.layers.1.mlp.gate.e_score_correction_bias'
  assert files.get(bias).dtype == np.float32
  assert {str(files.get(n).dtype) for n in files.names if n != bias and 'bias' not in n} == {'bfloat16'}
  np.testing.assert_array_equal(
    files.get('model.embed_tokens.weight'), np.asarray(params['embed']).astype(ml_dtypes.bfloat16)
  )


@pytest.mark.parametrize(
  'file, overrides, key',
  [
    ('configs/default.py', {}, 'model.attention_kind'),  # standard attention: neither family has it
    ('configs/kimi_linear_moe.py', {'model.mla_rope': True}, 'model.mla_rope'),  # Kimi Linear's MLA is NoPE
    ('configs/kimi_linear_moe.py', {'model.residual': 'attnres_block'}, 'model.residual'),
    ('configs/moonlight_small.py', {'model.moe.score_func': 'softmax'}, 'model.moe.score_func'),
  ],
)
def test_a_model_the_family_cannot_express_is_one_error_naming_the_key(tmp_path, file, overrides, key):
  config = config_lib.load(file, overrides=overrides)
  _, params, moe_state = _random_variables(config.model)
  with pytest.raises(HfError, match=key.replace('.', r'\.')):
    export_folder(tmp_path / 'out', config, params, moe_state)
  assert not list(tmp_path.iterdir())  # nothing written


def test_an_existing_folder_is_refused_and_left_alone(tmp_path):
  config = config_lib.load(f'configs/released.py:{FIXTURES / "moonlight"}')
  params, moe_state = load_numpy(FIXTURES / 'moonlight', config.model)
  (tmp_path / 'out').mkdir()
  (tmp_path / 'out' / 'keep.txt').write_text('mine')
  with pytest.raises(HfError, match='exists'):
    export_folder(tmp_path / 'out', config, params, moe_state)
  assert [p.name for p in (tmp_path / 'out').iterdir()] == ['keep.txt']
  (tmp_path / 'new.partial').mkdir()  # an export that did not finish, or someone's folder
  with pytest.raises(HfError, match='new.partial exists'):
    export_folder(tmp_path / 'new', config, params, moe_state)
  assert not (tmp_path / 'new').exists() and not list((tmp_path / 'new.partial').iterdir())
