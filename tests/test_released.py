"""Released checkpoints (kimijax.hf, configs/released.py) against the released modeling code: small
random checkpoints of Kimi Linear, Moonlight and DeepSeek-V3 in the released layout, with the logits
and greedy continuations that transformers 5.17's modeling code computed for them
(tests/fixtures/released/make_fixtures.py), must come out of kimijax's model the same."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax import config as config_lib
from kimijax.hf.config import model_overrides, read_config
from kimijax.hf.safetensors import HfError, SafetensorsFolder
from kimijax.hf.weights import load_numpy
from kimijax.infer.generate import generate
from kimijax.model import Transformer, inference_variables

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'released'
FAMILIES = ('kimi_linear', 'moonlight', 'deepseek_v3')


def released_config(folder, **overrides):
  return config_lib.load(f'configs/released.py:{folder}', overrides=overrides)


def rel_rmse(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref**2)))


@pytest.fixture(scope='module', params=FAMILIES)
def released(request):
  folder = FIXTURES / request.param
  config = released_config(folder)
  params, moe_state = load_numpy(folder, config.model)
  model = Transformer(config.model)
  return request.param, config, model, inference_variables(params, moe_state), np.load(folder / 'reference.npz')


def test_logits_match_the_released_modeling_code(released):
  name, _, model, variables, ref = released
  logits, _ = model.apply(variables, jnp.asarray(ref['tokens']))
  err = rel_rmse(logits, ref['logits'])
  assert err < 1e-5, f'{name}: logits relative RMSE {err:.2e} against transformers'
  # the same choice of next token everywhere, not only close values
  np.testing.assert_array_equal(np.argmax(logits, -1), np.argmax(ref['logits'], -1))


def test_greedy_generation_matches_the_released_modeling_code(released):
  """Prefill, then the decode path with its caches (KDA state and conv state, MLA latents)."""
  name, _, model, variables, ref = released
  prompt, expected = ref['prompt'], ref['generated']
  tokens = generate(model, variables, prompt, max_new_tokens=expected.shape[1] - prompt.shape[1], temperature=0.0)
  np.testing.assert_array_equal(tokens, expected, err_msg=f'{name}: greedy tokens differ from transformers')


def test_decode_logits_match_the_released_modeling_code(released):
  """Each greedy step's logits from kimijax's decode path (prefill the prompt into the caches, then
  one token per step), against the logits transformers' cached generation chose each token from."""
  from kimijax.infer.cache import init_cache

  name, config, model, variables, ref = released
  prompt, generated, steps = ref['prompt'], ref['generated'], ref['logits_decode'].shape[1]
  b, p = prompt.shape
  positions = lambda start, n: jnp.broadcast_to(jnp.arange(start, start + n), (b, n))
  cache = init_cache(config.model, b, p + steps)
  logits, aux = model.apply(variables, jnp.asarray(prompt), positions(0, p), cache=cache)
  step_logits = [logits[:, -1]]
  for t in range(p, p + steps - 1):
    logits, aux = model.apply(variables, jnp.asarray(generated[:, t : t + 1]), positions(t, 1), cache=aux['cache'])
    step_logits.append(logits[:, -1])
  err = rel_rmse(jnp.stack(step_logits, 1), ref['logits_decode'])
  assert err < 1e-5, f'{name}: decode-step logits relative RMSE {err:.2e}'


def test_config_mapping_of_each_family():
  kimi = model_overrides(read_config(FIXTURES / 'kimi_linear'))
  assert kimi['model.layer_pattern'] == 'KKKA' and kimi['model.mla_rope'] is False
  assert kimi['model.moe.first_dense_layers'] == 1 and kimi['model.moe.n_group'] == 2
  moon = model_overrides(read_config(FIXTURES / 'moonlight'))
  assert moon['model.layer_pattern'] == 'AAA' and moon['model.mla_rope'] is True
  assert moon['model.mla_q_lora_rank'] == 0 and moon['model.moe.num_shared'] == 2
  deepseek = read_config(FIXTURES / 'deepseek_v3')
  assert model_overrides(deepseek)['model.mla_q_lora_rank'] == 24
  assert model_overrides(deepseek)['model.yarn.factor'] == 40.0 and 'model.yarn.factor' not in moon
  # Kimi K2's folders name DeepSeek-V3's layout 'kimi_k2'
  assert model_overrides({**deepseek, 'model_type': 'kimi_k2'}) == model_overrides(deepseek)


def test_bf16_tensors_are_read_exactly():
  """The reader's bf16 tensor is the file's bytes at the header's offsets, read independently here
  (8-byte little-endian header length, JSON header, data), as each value's top 16 float32 bits."""
  import struct

  path = next((FIXTURES / 'deepseek_v3').glob('*.safetensors'))
  data = path.read_bytes()
  (n,) = struct.unpack('<Q', data[:8])
  entry = json.loads(data[8 : 8 + n])['model.embed_tokens.weight']
  begin, end = (8 + n + offset for offset in entry['data_offsets'])
  bits = np.frombuffer(data[begin:end], '<u2').reshape(entry['shape'])
  w = SafetensorsFolder(FIXTURES / 'deepseek_v3').get('model.embed_tokens.weight')
  assert entry['dtype'] == 'BF16' and str(w.dtype) == 'bfloat16'
  np.testing.assert_array_equal(np.asarray(w, np.float32).view(np.uint32), bits.astype(np.uint32) << 16)


def copy_fixture(tmp_path, name):
  folder = tmp_path / name
  shutil.copytree(FIXTURES / name, folder)
  return folder


def test_a_missing_or_misshapen_tensor_is_one_error_naming_it(tmp_path):
  import struct

  folder = copy_fixture(tmp_path, 'moonlight')
  path = folder / 'model.safetensors'
  data = path.read_bytes()
  n = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8 : 8 + n])
  header['model.norm.weight_renamed'] = header.pop('model.norm.weight')
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack('<Q', len(text)) + text + data[8 + n :])
  config = released_config(folder)
  with pytest.raises(HfError, match=r"no tensor 'model.norm.weight'"):
    load_numpy(folder, config.model)

  config = released_config(FIXTURES / 'moonlight', **{'model.mlp_dim': 96})  # the checkpoint's dense layer is wider
  with pytest.raises(HfError, match=r'layer_0/mlp/wi_gate .*shape'):
    load_numpy(FIXTURES / 'moonlight', config.model)


def test_an_unsupported_config_value_is_one_error_naming_the_key(tmp_path):
  folder = copy_fixture(tmp_path, 'deepseek_v3')
  hf = json.loads((folder / 'config.json').read_text())
  hf['rope_scaling'] = {'type': 'linear', 'factor': 4.0}
  (folder / 'config.json').write_text(json.dumps(hf))
  with pytest.raises(config_lib.ConfigError, match='rope_scaling'):
    released_config(folder)
  with pytest.raises(config_lib.ConfigError, match='no such folder'):
    released_config(tmp_path / 'nowhere')
  (folder / 'config.json').write_text(json.dumps({**hf, 'rope_scaling': None, 'model_type': 'llama'}))
  with pytest.raises(config_lib.ConfigError, match="model_type 'llama'"):
    released_config(folder)


def test_a_model_key_that_disagrees_with_the_released_config_is_refused_before_reading(monkeypatch):
  """train.init_from: a key that changes the maths but no shape (RoPE's base) is one error naming
  it and both values, before any tensor is read; YaRN may be added (a context extension)."""
  from kimijax.train.checkpoint import check_init_from

  monkeypatch.setattr(SafetensorsFolder, 'get', lambda *a: pytest.fail('a tensor was read'))
  folder = FIXTURES / 'moonlight'
  with pytest.raises(HfError, match=r'model\.rope_theta: 50000\.0 -> 10000\.0'):
    check_init_from(released_config(folder, **{'model.rope_theta': 10000.0}))
  check_init_from(released_config(folder, **{'model.yarn.factor': 4.0}))


def test_a_run_starts_from_the_released_weights_with_a_fresh_optimizer(tmp_path):
  """train.init_from: the train state's parameters and MoE biases are the checkpoint's, the
  optimizer state is the optimizer's init, and the first step trains from there."""
  from kimijax.optim import make_optimizer
  from kimijax.parallel import mesh as mesh_lib
  from kimijax.train.step import build_training

  folder = FIXTURES / 'kimi_linear'
  config = released_config(folder, **{'train.seq_len': 16, 'train.batch_size': 2})
  run = build_training(config, mesh_lib.make_mesh(config.mesh), Transformer(config.model))
  state = run.init_state(config)
  files = SafetensorsFolder(folder)
  np.testing.assert_array_equal(state.params['embed'], files.get('model.embed_tokens.weight'))
  np.testing.assert_array_equal(
    state.moe_state['layer_1']['mlp']['bias'], files.get('model.layers.1.block_sparse_moe.gate.e_score_correction_bias')
  )
  fresh = make_optimizer(config).init(state.params)
  jax.tree.map(np.testing.assert_array_equal, state.opt_state, fresh)


def test_run_py_evaluates_fine_tunes_resumes_and_exports_a_released_folder(tmp_path):
  """run.py end to end on the Kimi Linear folder with the byte corpus: --mode=eval with --config
  reads the released weights (step 0) while DIR has no checkpoint; training starts from them, its
  first loss is theirs; after training, eval reads DIR's checkpoint instead; --mode=export writes
  that checkpoint as a released folder, whose validation loss is the checkpoint's."""
  import re
  import subprocess
  import sys

  from helpers import cpu_subprocess_env

  root = pathlib.Path(__file__).resolve().parents[1]
  workdir, exported = tmp_path / 'ft', tmp_path / 'hf'

  def flags(folder, workdir):
    return [
      f'--config=configs/released.py:{folder}',
      f'--workdir={workdir}',
      '--config.train.batch_size=4',
      '--config.train.seq_len=64',
      '--config.train.eval_batches=2',
      '--config.train.plot=False',
    ]

  def run(*argv):
    proc = subprocess.run(
      [sys.executable, 'run.py', *argv], cwd=root, env=cpu_subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout

  def eval_line(out):
    step, loss = re.search(r'step (\d+): eval loss ([\d.]+)', out).groups()
    return int(step), float(loss)

  run_flags = flags(FIXTURES / 'kimi_linear', workdir)
  step, released_loss = eval_line(run(*run_flags, '--mode=eval'))
  assert step == 0 and not (workdir / 'checkpoints').exists()
  # the released weights, not an initialisation: a fresh model's loss is near log(vocab)
  assert abs(released_loss - np.log(384)) > 0.5, released_loss
  run(*run_flags, '--config.train.steps=2', '--config.train.eval_every=2', '--config.train.checkpoint_every=2')
  first = json.loads((workdir / 'metrics.jsonl').read_text().splitlines()[0])
  # step 1 runs at learning rate 0 (warmup): the released weights' loss on a training batch
  assert abs(first['loss'] - released_loss) < 0.5 < abs(first['loss'] - np.log(384)), (first, released_loss)
  step, trained_loss = eval_line(run(*run_flags, '--mode=eval'))
  assert step == 2 and trained_loss != released_loss

  assert 'step 2: wrote' in run('--mode=export', f'--workdir={workdir}', f'--export_dir={exported}')
  step, exported_loss = eval_line(run(*flags(exported, tmp_path / 'eval_hf'), '--mode=eval'))
  assert (step, exported_loss) == (0, trained_loss)


def test_released_weights_too_big_for_a_device_stop_before_any_read(tmp_path, monkeypatch):
  """--mode=eval / generate hold the released parameters on each device: one error, naming the
  folder and the sizes, when they cannot fit, before any tensor is read or eval.jsonl written."""
  from kimijax.train import memory
  from kimijax.train.evaluate import evaluate_run

  folder = FIXTURES / 'moonlight'
  monkeypatch.setattr(memory, 'device_memory', lambda devices: (100_000, 'a 100 kB test limit'))
  monkeypatch.setattr(SafetensorsFolder, 'get', lambda *a: pytest.fail('a tensor was read'))
  config = released_config(folder, **{'train.batch_size': 2, 'train.seq_len': 16})
  with pytest.raises(memory.MemoryLimitError, match=r'parameters of .*moonlight take 0\.0 GiB .*a 100 kB test limit'):
    evaluate_run(tmp_path / 'w', 1, config)
  assert not (tmp_path / 'w' / 'eval.jsonl').exists()


def test_released_weights_held_in_bfloat16_take_half_the_memory(tmp_path, monkeypatch):
  """--param_dtype=bfloat16: the matrices are read straight into bf16, so a device that cannot
  hold the float32 parameters holds these; the memory check counts 2 bytes for them."""
  from kimijax.infer.generate import load_for_generation
  from kimijax.train import memory

  folder = FIXTURES / 'moonlight'
  config = released_config(folder, **{'train.batch_size': 2, 'train.seq_len': 16})
  float32_bytes = 4 * sum(x.size for x in jax.tree.leaves(load_numpy(folder, config.model)[0]))
  monkeypatch.setattr(memory, 'device_memory', lambda devices: (int(0.7 * float32_bytes), 'a test limit'))
  with pytest.raises(memory.MemoryLimitError, match='a test limit'):
    load_for_generation(tmp_path, config)
  _, _, variables = load_for_generation(tmp_path, config, 'bfloat16')
  params = variables['params']
  assert params['embed'].dtype == jnp.bfloat16 and params['final_norm']['scale'].dtype == jnp.float32
  np.testing.assert_array_equal(
    params['embed'], np.asarray(SafetensorsFolder(folder).get('model.embed_tokens.weight'), jnp.bfloat16)
  )


def test_released_weights_sharded_over_fsdp_evaluate_and_generate_as_replicated(tmp_path):
  """--config.mesh.fsdp shards the released parameters for eval and generate (a model larger than
  one device): the same validation loss and greedy tokens as with every device holding them all."""
  from kimijax.infer.generate import load_for_generation
  from kimijax.train.evaluate import evaluate_run

  n = jax.device_count()
  if n < 2:
    pytest.skip('needs several devices (tests/conftest.py makes 8 CPU devices)')
  folder, out = FIXTURES / 'kimi_linear', {}
  prompt = np.array([[5, 6, 7, 8]] * 2, np.int32)
  for name, mesh in (('replicated', {'mesh.data': n}), ('fsdp', {'mesh.data': 1, 'mesh.fsdp': n})):
    config = released_config(folder, **{'train.batch_size': n, 'train.seq_len': 32, **mesh})
    loss = evaluate_run(tmp_path / name, 2, config)['eval_loss']
    _, model, params = load_for_generation(tmp_path / name, config)
    if name == 'fsdp':  # the expert weights are split over the devices
      assert not params['params']['layer_1']['mlp']['wi_gate'].sharding.is_fully_replicated
    out[name] = loss, generate(model, params, prompt, max_new_tokens=5, temperature=0.0)
  np.testing.assert_allclose(out['fsdp'][0], out['replicated'][0], rtol=1e-5)
  np.testing.assert_array_equal(out['fsdp'][1], out['replicated'][1])
