"""experiments/bench/bench_decode.py on the CPU: the bytes of a step's memory roofline against a count
from the shapes, the Markdown table of a tiny hybrid at one context, and the flags' errors."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import bench_decode
from kimijax import config as config_lib
from kimijax.infer.cache import init_cache
from kimijax.model import Transformer

TINY = {
  'model.d_model': 32,
  'model.num_layers': 2,
  'model.num_heads': 2,
  'model.mlp_dim': 64,
  'model.layer_pattern': 'KA',
  'model.compute_dtype': 'bfloat16',
}


def test_step_bytes_count_parameters_attention_cache_once_and_kda_state_twice():
  config = config_lib.load_file(
    'configs/default.py',
    {**TINY, 'model.attention_kind': 'mla', 'model.position': 'nope', 'model.tie_embeddings': False},
  )
  m = config_lib.validate(config).model
  batch, context = 3, 40
  params = jax.eval_shape(lambda: nn.unbox(Transformer(m).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, m.compute_dtype if x.ndim > 1 else x.dtype), params)
  params = params['params']  # shapes only: the count needs no values
  cache = jax.eval_shape(lambda: init_cache(m, batch, context))
  weights = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
  vocab, d, heads, head_dim = m.vocab_size, m.d_model, m.num_heads, m.d_model // m.num_heads
  embed_unread = (vocab - batch) * d * 2  # bf16 rows of the untied input embedding the batch does not look up
  latents = batch * context * m.mla_kv_lora_rank * 2  # layer 1 (MLA, NoPE): the bf16 latents of every position
  state = batch * heads * head_dim * head_dim * 4  # layer 0 (KDA): float32 state, read and written
  convs = 3 * batch * 3 * heads * head_dim * 2  # q, k, v conv states of the last 3 inputs, bf16, read and written
  want = weights - embed_unread + latents + 2 * (state + convs)
  assert bench_decode.step_bytes(m, params, cache, batch) == want


def test_tiny_hybrid_prints_a_markdown_table_and_traces_each_pattern(tmp_path):
  config = config_lib.load_file('configs/default.py', {**TINY, 'model.compute_dtype': 'float32'})
  lines = list(
    bench_decode.table(
      config, [8], batch=2, steps=2, hybrid='KA', baseline='A', copy_gib=0.001, profile_dir=str(tmp_path)
    )
  )
  for role in ('hybrid', 'baseline'):  # the trace profile_summary reads
    assert list((tmp_path / f'{role}_8').glob('**/perfetto_trace.json.gz')), role
  setup, blank, header, rule, baseline, hybrid = lines  # each row as measured, the baseline first
  bandwidth = re.search(r'copy bandwidth ([\d,.]+) GB/s', setup)
  assert bandwidth and float(bandwidth[1].replace(',', '')) > 0
  assert blank == '' and header == bench_decode.HEADER
  columns = header.count(' | ') + 1
  assert rule == '|' + '---|' * columns
  number = r'[\d,]+\.\d+'
  for line, pattern in ((hybrid, 'KA'), (baseline, 'A')):
    cells = [c.strip() for c in line.split('|')[1:-1]]
    assert len(cells) == columns and cells[:2] == ['8', pattern], line
    assert all(re.fullmatch(number, c) for c in cells[2:11]), line
    speedup = cells[-1]
  assert re.fullmatch(rf'{number}x \({number}x\)', hybrid.split('|')[-2].strip()), hybrid
  assert speedup == ''  # the baseline's row: the speed-up is in the hybrid's


def test_kda_tiles_time_the_hybrid_once_per_entry_with_the_same_parameters():
  """A row per --kda_tiles entry (the decode kernel and its composed A/B under kda_impl='pallas',
  interpreted here), labelled with the entry, each with its speed-up over the one baseline row; the
  bytes read are the same (the same parameters and cache)."""
  config = config_lib.load_file(
    'configs/default.py', {**TINY, 'model.compute_dtype': 'float32', 'model.kda_impl': 'pallas'}
  )
  lines = list(
    bench_decode.table(
      config, [8], batch=2, steps=2, hybrid='KA', baseline='A', copy_gib=0.001, kda_tiles=('', 'fused_decode=0')
    )
  )
  rows = [[c.strip() for c in line.split('|')[1:-1]] for line in lines[4:]]
  assert [r[1] for r in rows] == ['A', 'KA', 'KA (kda fused_decode=0)']
  assert rows[1][7] == rows[2][7]  # read MiB
  assert rows[0][-1] == '' and rows[1][-1].endswith('x)') and rows[2][-1].endswith('x)')


def test_no_baseline_times_the_hybrid_alone():
  config = config_lib.load_file('configs/default.py', {**TINY, 'model.compute_dtype': 'float32'})
  lines = list(bench_decode.table(config, [8], batch=2, steps=2, hybrid='KA', baseline='', copy_gib=0.001))
  (row,) = lines[4:]
  cells = [c.strip() for c in row.split('|')[1:-1]]
  assert cells[:2] == ['8', 'KA'] and cells[-1] == ''


def test_flag_errors():
  assert bench_decode.flag_error(['64'], 2, 1.0) is None
  assert bench_decode.flag_error(['64'], 2, 1.0, ('', 'fused_decode=0')) is None
  assert bench_decode.flag_error(['64'], 2, 1.0, ('fused_decode=2',)).startswith("--kda_tiles='fused_decode=2': ")
  assert bench_decode.flag_error(['64'], 2, 1.0, ('warps_nope=4',)).startswith("--kda_tiles='warps_nope=4': ")
  assert bench_decode.flag_error(['64'], 0, 1.0) == '--steps=0 must be >= 1'
  assert bench_decode.flag_error(['64'], 2, 0.0) == '--copy_gib=0.0 must be positive'
  assert bench_decode.flag_error(['4k'], 2, 1.0) == "--contexts: ['4k'] are not whole numbers"
  message = "--contexts: ['3'] leave no prompt for the loop: each must be at least --steps + 2 = 4"
  assert bench_decode.flag_error(['64', '3'], 2, 1.0) == message


def test_build_draws_parameters_of_the_models_shapes_for_the_configs_kda_implementation():
  """build returns a model of the config's kda_impl (kda_decode dispatches on it: 'pallas' is the
  decode kernel of a GPU config) and random parameters of exactly the shapes init makes, matrices
  in the compute dtype, the rest float32, N(0, 0.02)."""
  config = config_lib.load_file('configs/default.py', {**TINY, 'model.kda_impl': 'xla'})
  model, params, m = bench_decode.build(config, 'KA')
  assert model.cfg.kda_impl == m.kda_impl == 'xla'
  init = nn.unbox(Transformer(m).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))['params']
  assert jax.tree.structure(params) == jax.tree.structure(init)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(init)):
    assert got.shape == want.shape
    assert got.dtype == (jnp.bfloat16 if want.ndim > 1 else jnp.float32)
  values = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(params)])
  assert abs(values.std() - 0.02) < 1e-3 and abs(values.mean()) < 1e-3
