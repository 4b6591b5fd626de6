"""kimijax/train/memory.py: the step's memory estimate against XLA's own memory analysis of the
compiled step (an independent account of the same step), and what a run does with it: a step that
cannot fit stops before anything compiles with one line naming the batch, the sequence length and
the estimate, and leaves no workdir behind; an out-of-memory error of XLA's in the first step is one
such line too, and the run removes what it created."""

import jax
import pytest
from tiny_config import TINY

from kimijax import config as config_lib
from kimijax.parallel import mesh as mesh_lib
from kimijax.train import flops as flops_lib, loop as loop_lib, memory as memory_lib
from kimijax.train.step import build_training

ONE = jax.devices()[:1]
SMALL = {'model.d_model': 128, 'model.num_layers': 2, 'model.num_heads': 2, 'model.mlp_dim': 384}


def _config(overrides):
  return config_lib.load('configs/default.py', {**SMALL, 'train.batch_size': 4, **overrides})


def _compiled_bytes(config) -> int:
  """Peak bytes of the compiled train step by XLA's buffer assignment (memory.compiled_peak_bytes):
  arguments, outputs and temporaries, less what the donated state lets XLA reuse."""
  return memory_lib.compiled_peak_bytes(build_training(config, mesh_lib.make_mesh(config.mesh, ONE)), config)


@pytest.mark.parametrize(
  'overrides',
  [
    {'train.seq_len': 256},
    {'train.seq_len': 512, 'model.remat': True},
    {'train.seq_len': 256, 'optimizer.name': 'muon'},
    {'train.seq_len': 512, 'model.remat': True, 'train.loss_chunk': 256, 'model.vocab_size': 4096},
  ],
  ids=['attention', 'remat', 'muon', 'loss_chunk'],
)
def test_estimate_is_below_but_near_xla_memory_analysis(overrides):
  """The estimate errs low (it must never refuse a step that runs) and within 2.5x of XLA's peak."""
  config = _config(overrides)
  estimate = memory_lib.estimate(config, flops_lib.count(flops_lib.abstract_params(config))).total
  xla = _compiled_bytes(config)
  assert 0.4 * xla <= estimate <= xla, (estimate, xla)


def test_remat_and_longer_sequences_move_the_estimate_as_their_arrays_do():
  """Closed forms of the activations term: attention 'xla' grows with T^2 (the probabilities), remat
  keeps one layer's activations besides each layer's input."""
  n = 10**6
  base = _config({'train.seq_len': 256})
  long = _config({'train.seq_len': 512})
  remat = _config({'train.seq_len': 256, 'model.remat': True})
  per_layer = memory_lib.layer_activation_bytes(base.model, 'A', 256)
  d, f, h = 128, 384, 2
  assert per_layer == 2 * 8 * d + 3 * 4 * f + 4 * 4 * d + 8 * h * 256  # float32 compute and residual
  tokens = 4 * 256
  assert memory_lib.estimate(base, n).activations == 2 * per_layer * tokens
  assert memory_lib.estimate(remat, n).activations == tokens * (2 * 4 * d + per_layer)
  long_layer = memory_lib.layer_activation_bytes(long.model, 'A', 512)
  assert long_layer - per_layer == 8 * h * 256  # the probabilities' row doubles
  assert memory_lib.estimate(base, n).state == 3 * 4 * n  # parameters and AdamW's two moments


def test_with_a_loss_chunk_the_logits_term_is_one_chunks():
  """float32 logits [B * T, V] without chunks; one chunk's [chunk, V] with them, at most all the
  tokens'."""
  n, v, tokens = 10**6, 4096, 4 * 256
  estimate = lambda chunk: memory_lib.estimate(
    _config({'train.seq_len': 256, 'model.vocab_size': v, 'train.loss_chunk': chunk}), n
  )
  assert estimate(0).logits == 4 * tokens * v
  assert estimate(128).logits == 4 * 128 * v
  assert estimate(10**6).logits == 4 * tokens * v
  assert estimate(128).activations == estimate(0).activations


def test_the_check_suggests_a_loss_chunk_where_the_logits_are_what_does_not_fit(monkeypatch):
  """Remat first, then train.loss_chunk, then both: the first that fits."""
  config = _config({'train.seq_len': 4096, 'model.vocab_size': 65536, 'model.remat': True})
  n = flops_lib.count(flops_lib.abstract_params(config))
  need = memory_lib.estimate(config, n).total
  chunked = config.copy_and_resolve_references()
  chunked.train.loss_chunk = memory_lib.SUGGESTED_LOSS_CHUNK
  with_chunk = memory_lib.estimate(chunked, n).total
  assert with_chunk < need
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: (need + with_chunk) // 2)
  with pytest.raises(memory_lib.MemoryLimitError, match=r'set train\.loss_chunk=4096 \(about'):
    loop_lib.check_memory(config, ONE)


def test_a_gpu_sized_step_on_this_host_stops_with_one_line(monkeypatch):
  config = config_lib.load('configs/bench_350m.py:xla')
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: 16 * 2**30)
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    loop_lib.check_memory(config, ONE)
  message = str(info.value)
  assert '\n' not in message
  assert message.startswith('the train step at train.batch_size=16 x train.seq_len=4096 needs about ')
  assert "more than this host's 16.0 GiB of available memory" in message
  assert 'use a config sized for a CPU, such as configs/default.py' in message
  config = config_lib.load('configs/bench_350m.py:xla', {'train.check_memory': False})
  loop_lib.check_memory(config, ONE)  # skipped on request


def test_remat_is_suggested_only_where_it_fits(monkeypatch):
  config = _config({'train.seq_len': 256})
  n = flops_lib.count(flops_lib.abstract_params(config))
  need = memory_lib.estimate(config, n).total
  with_remat = memory_lib.estimate(_config({'train.seq_len': 256, 'model.remat': True}), n).total
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: (need + with_remat) // 2)
  with pytest.raises(memory_lib.MemoryLimitError, match=r'set model\.remat=True \(about'):
    loop_lib.check_memory(config, ONE)
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: with_remat // 2)
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    loop_lib.check_memory(config, ONE)
  assert 'remat' not in str(info.value)


def test_the_gpu_attention_message_suggests_xla_only_where_it_fits(monkeypatch):
  """configs/bench_350m.py names a GPU attention; off the GPU the message used to suggest
  model.attn_impl='xla', which for this config cannot fit a CPU host."""
  config = config_lib.load('configs/bench_350m.py')
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: 64 * 2**30)
  with pytest.raises(config_lib.ConfigError) as info:
    loop_lib.check_attention_impl(config, ONE)
  message = str(info.value)
  assert message.startswith("attention impl='gpu' needs an NVIDIA GPU, but JAX runs on 'cpu' here")
  assert "with model.attn_impl='xla' the train step at train.batch_size=16 x train.seq_len=4096" in message
  assert 'configs/default.py' in message
  small = config_lib.load(
    'configs/default.py', {**TINY, 'model.attn_impl': 'tokamax', 'model.compute_dtype': 'bfloat16'}
  )
  with pytest.raises(config_lib.ConfigError, match="use model.attn_impl='xla' off the GPU"):
    loop_lib.check_attention_impl(small, ONE)


def test_out_of_memory_in_the_first_step_is_one_line_and_leaves_no_workdir(tmp_path, monkeypatch):
  """XLA's out-of-memory error (an estimate can err low) in the first step: one MemoryLimitError
  naming the batch and sequence length, and the run's new workdir is removed, so that a re-run
  with a smaller batch does not find a config.json of this one."""
  real = loop_lib.build_training

  def failing(*args, **kwargs):
    def oom(state, batch):
      raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 750063923716 bytes.')

    return real(*args, **kwargs)._replace(train_step=oom)

  monkeypatch.setattr(loop_lib, 'build_training', failing)
  workdir = tmp_path / 'run'
  config = config_lib.load(
    'configs/default.py', {**TINY, 'train.steps': 3, 'data.source': 'mqar', 'data.mqar_num_pairs': 4}
  )
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    loop_lib.train(config, workdir, devices=ONE)
  assert 'out of memory in the first train step; the train step at train.batch_size=4 x train.seq_len=64' in str(
    info.value
  )
  assert 'Out of memory allocating 750063923716 bytes' in str(info.value)
  assert 'set model.remat=True, or set train.loss_chunk=4096' in str(info.value)  # what the config has not tried
  assert not workdir.exists()
  existing = tmp_path / 'existing'  # a folder of the user's: only what the run added goes
  existing.mkdir()
  (existing / 'notes.txt').write_text('mine')
  with pytest.raises(memory_lib.MemoryLimitError):
    loop_lib.train(config, existing, devices=ONE)
  assert sorted(p.name for p in existing.iterdir()) == ['notes.txt']


def test_out_of_memory_surfacing_when_the_first_step_is_waited_for_is_one_error():
  """On a GPU the step's allocation can fail after the asynchronous call has returned, when its
  result is waited for: first_step waits, so that error too is one MemoryLimitError."""
  config = config_lib.load('configs/default.py', {**TINY, 'train.steps': 3})

  class Pending:
    def block_until_ready(self):
      raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 55.59GiB')

  mesh = mesh_lib.make_mesh(config.mesh, ONE)
  with pytest.raises(memory_lib.MemoryLimitError, match='out of memory in the first train step.*55.59GiB'):
    loop_lib.first_step(lambda state, batch: (state, Pending()), {}, {}, config, mesh)


class _FakeGpu:
  """A GPU as memory.check sees one: its platform, kind, process and allocator limit."""

  platform, device_kind, process_index = 'gpu', 'NVIDIA H800', 0

  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    return {'bytes_limit': self.limit}


ONE_WAY = {'data': 1, 'fsdp': 1, 'tensor': 1}


def test_a_step_that_fits_more_of_the_gpu_is_told_the_allocator_share(monkeypatch):
  """Under JAX's default share (0.75 of the card) a step that fits 0.95 of it is told
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, with that share's bytes; one that does not fit it, or a
  run that already set the variable, is not."""
  config = _config({'train.seq_len': 256, 'model.remat': True, 'train.loss_chunk': 256})
  n = flops_lib.count(flops_lib.abstract_params(config))
  need = memory_lib.estimate(config, n).per_device(ONE_WAY)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION', raising=False)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_ALLOCATOR', raising=False)
  limit = int(need * 0.9)  # the card: limit / 0.75; 0.95 of it is 1.14 need
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    memory_lib.check(config, [_FakeGpu(limit)], n, ONE_WAY)
  raised_gib = limit / 0.75 * 0.95 / 2**30
  share = '(JAX gives XLA 0.75 of each GPU by default; about %.1f GiB then)' % raised_gib
  assert f'start with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 {share}' in str(info.value)
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    memory_lib.check(config, [_FakeGpu(int(need * 0.7))], n, ONE_WAY)  # 0.95 of the card: 0.89 need
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in str(info.value)
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.8')
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    memory_lib.check(config, [_FakeGpu(limit)], n, ONE_WAY)
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in str(info.value)


def test_an_moe_step_is_told_its_expert_remat_first(monkeypatch):
  """model.moe.remat (the routed experts recomputed) comes before model.remat where it fits."""
  moe = {'model.mlp_kind': 'moe', 'model.moe.num_experts': 8, 'model.moe.top_k': 4, 'model.moe.expert_hidden': 256}
  config = _config({'train.seq_len': 512, **moe})
  n = flops_lib.count(flops_lib.abstract_params(config))
  need = memory_lib.estimate(config, n).total
  with_moe_remat = memory_lib.estimate(_config({'train.seq_len': 512, **moe, 'model.moe.remat': True}), n).total
  assert with_moe_remat < need
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: (need + with_moe_remat) // 2)
  with pytest.raises(memory_lib.MemoryLimitError, match=r'set model\.moe\.remat=True \(about'):
    loop_lib.check_memory(config, ONE)


def test_on_a_gpu_xlas_plan_decides_an_estimate_over_the_limit(monkeypatch):
  """XLA's GPU compiler fits a step to its memory limit, so an estimate over the limit is checked
  against the compiled plan: a plan within the limit runs (with a line saying so), one over it is
  refused with its figure. Off the GPU the plan is not consulted."""
  config = _config({'train.seq_len': 256, 'model.remat': True, 'train.loss_chunk': 256})
  n = flops_lib.count(flops_lib.abstract_params(config))
  need = memory_lib.estimate(config, n).per_device(ONE_WAY)
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.9')  # no allocator advice here
  gpu = [_FakeGpu(int(need * 0.8))]
  note = memory_lib.check(config, gpu, n, ONE_WAY, plan=lambda: int(need * 0.7))
  assert note.startswith(f'memory: estimated {need / 2**30:.1f} GiB per device, over the ')
  assert note.endswith(f"XLA's plan of the step, {int(need * 0.7) / 2**30:.1f} GiB, fits")
  with pytest.raises(memory_lib.MemoryLimitError, match=r"\(XLA's plan of the step: [0-9.]+ GiB\), more than"):
    memory_lib.check(config, gpu, n, ONE_WAY, plan=lambda: int(need * 0.9))
  assert memory_lib.check(config, [_FakeGpu(need * 2)], n, ONE_WAY, plan=lambda: 1 / 0) is None  # fits: no compile

  def never():
    raise AssertionError('the plan is compiled only on a GPU')

  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: int(need * 0.8))
  with pytest.raises(memory_lib.MemoryLimitError):
    memory_lib.check(config, ONE, n, ONE_WAY, plan=never)


def test_the_allocator_advice_follows_xlas_plan_where_there_is_one(monkeypatch):
  config = _config({'train.seq_len': 256, 'model.remat': True, 'train.loss_chunk': 256})
  n = flops_lib.count(flops_lib.abstract_params(config))
  need = memory_lib.estimate(config, n).per_device(ONE_WAY)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION', raising=False)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_ALLOCATOR', raising=False)
  gpu = [_FakeGpu(int(need * 0.8))]  # at 0.95 of the card: 1.01 need
  for planned, advised in ((0.9, True), (1.1, False)):
    with pytest.raises(memory_lib.MemoryLimitError) as info:
      memory_lib.check(config, gpu, n, ONE_WAY, plan=lambda p=planned: int(need * p))
    assert ('XLA_PYTHON_CLIENT_MEM_FRACTION=0.95' in str(info.value)) == advised, planned


# ------------------------------------------------------------------- the eval step (--mode=eval)


def _eval_plan(config):
  """XLA's memory analysis of the compiled eval step on one CPU device (compiled_eval_peak_bytes):
  an account of the step independent of the estimate's closed form."""
  from kimijax.model import Transformer
  from kimijax.train.step import in_mesh, make_eval_step

  mesh = mesh_lib.make_mesh(config.mesh, ONE)
  step = in_mesh(jax.jit(make_eval_step(Transformer(config.model), config.train.loss_chunk)), mesh, config.mesh)
  params = flops_lib.abstract_params(config)
  return memory_lib.compiled_eval_peak_bytes(step, params, config, mesh_lib.batch_sharding(mesh, config.mesh))


@pytest.mark.parametrize(
  'overrides',
  [
    {'train.seq_len': 256},
    {'train.seq_len': 1024},
    {'train.seq_len': 512, 'train.loss_chunk': 256, 'model.vocab_size': 4096},
    {'train.seq_len': 256, 'model.vocab_size': 8192},
    {'train.seq_len': 512, 'model.layer_pattern': 'KA'},
  ],
  ids=['attention', 'long', 'loss_chunk', 'logits', 'kda'],
)
def test_eval_estimate_is_below_but_near_xla_memory_analysis(overrides):
  """The eval estimate errs low (it must never refuse an eval that runs) and within 2.5x of XLA's
  plan of the compiled eval step, float32 parameters."""
  config = _config(overrides)
  n = flops_lib.count(flops_lib.abstract_params(config))
  estimate = memory_lib.eval_estimate(config, 4 * n).total
  xla = _eval_plan(config)
  assert 0.4 * xla <= estimate <= xla, (estimate, xla)


def test_an_eval_that_cannot_fit_is_one_line_naming_its_batch_and_length(monkeypatch):
  """A host of less memory than the eval step's estimate: one MemoryLimitError naming
  train.batch_size x train.seq_len; train.loss_chunk suggested where the logits are what does not
  fit and a chunk would; train.check_memory=False skips the check."""
  config = _config({'train.seq_len': 2048, 'model.vocab_size': 65536})
  n = flops_lib.count(flops_lib.abstract_params(config))
  need = memory_lib.eval_estimate(config, 4 * n).total
  tokens = 4 * 2048
  assert need == 4 * n + tokens * 4 * 128 + 4 * tokens * 65536  # parameters, residual, float32 logits
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: need - 1)
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    memory_lib.check_eval(config, ONE, 4 * n, ONE_WAY)
  message = str(info.value)
  assert '\n' not in message
  assert message.startswith(
    f'the eval step at train.batch_size=4 x train.seq_len=2048 needs about {need / 2**30:.1f} GiB'
  )
  assert 'set train.loss_chunk=4096 (about' in message and message.endswith(
    '(train.check_memory=False skips this check)'
  )
  assert 'lower train.seq_len or train.batch_size' in message
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: need)
  assert memory_lib.check_eval(config, ONE, 4 * n, ONE_WAY) is None
  monkeypatch.setattr(memory_lib, '_host_available_bytes', lambda: 4 * n)
  with pytest.raises(memory_lib.MemoryLimitError) as info:
    memory_lib.check_eval(config, ONE, 4 * n, ONE_WAY)
  assert 'loss_chunk' not in str(info.value)  # the chunked step does not fit either
  skipped = _config({'train.seq_len': 2048, 'model.vocab_size': 65536, 'train.check_memory': False})
  assert memory_lib.check_eval(skipped, ONE, 4 * n, ONE_WAY) is None


def test_an_eval_over_the_estimate_on_a_gpu_is_settled_by_xlas_plan(monkeypatch):
  config = _config({'train.seq_len': 256})
  need = memory_lib.eval_estimate(config, 10**6).per_device(ONE_WAY)
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.9')
  gpu = [_FakeGpu(int(need * 0.8))]
  note = memory_lib.check_eval(config, gpu, 10**6, ONE_WAY, plan=lambda: int(need * 0.7))
  assert note.startswith('memory: eval step estimated at') and note.endswith('fits')
  with pytest.raises(memory_lib.MemoryLimitError, match=r"\(XLA's plan of the step: [0-9.]+ GiB\), more than"):
    memory_lib.check_eval(config, gpu, 10**6, ONE_WAY, plan=lambda: int(need * 0.9))
