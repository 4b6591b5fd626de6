"""attn_impl='tokamax': what kimijax assumes of tokamax 0.0.17, the wrapper's plumbing, and (on a GPU)
the Mosaic GPU kernel against the 'xla' implementation.

kimijax.ops.attention.flash_attention_tokamax reaches into tokamax's non-public op object for the
softmax residuals. The CPU tests pin each assumption it rests on, so that a tokamax upgrade that
changes one fails here by name: the op's entry point and keywords, the causal-offset convention
(bottom-right for T < S), the residuals' layout and units (through tokamax's XLA reference op,
which shares the residual type and runs on a CPU), and that the Hopper kernel writes its row max
back in natural units. The same wrapper then runs with that reference op substituted, against
the float64 oracle, alone and per shard on 8 fake devices. The GPU tests (marked gpu; run with
JAX_PLATFORMS=cuda) compare the real kernel with 'xla' at small and benchmark shapes.
"""

import inspect
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_rmse
from jax.sharding import NamedSharding, PartitionSpec as P
from oracles import ref_attention, ref_attention_grads, ref_max_logits_fast

from kimijax import config as config_lib
from kimijax.ops import attention as attention_lib


def tokamax_modules():
  from tokamax._src.ops.attention import base, pallas_mosaic_gpu

  return base, pallas_mosaic_gpu


def rand(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


def make_qkv(seed, b, t, s, h, hkv, d, dv):
  rng = np.random.default_rng(seed)
  return rand(rng, b, t, h, d), rand(rng, b, s, hkv, d), rand(rng, b, s, hkv, dv)


@pytest.fixture
def highest_precision():
  with jax.default_matmul_precision('highest'):
    yield


# ----------------------------------------------------------------------------- pinned tokamax behaviour


def test_tokamax_entry_point_takes_the_keywords_the_wrapper_passes():
  """The op class, its base (whose residual type it declares) and the keywords of its call."""
  base, mgpu = tokamax_modules()
  op_cls = mgpu.PallasMosaicGpuFlashAttention
  assert issubclass(op_cls, base.DotProductAttention)
  params = inspect.signature(op_cls.__call__).parameters
  for name in ('q', 'k', 'v', 'logits_scale', 'mask', 'return_residuals'):
    assert name in params, f'tokamax attention op lost the {name!r} argument'
  for name in ('logits_scale', 'mask', 'return_residuals'):
    assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
  assert [f.name for f in base.CausalMask.__dataclass_fields__.values()][:1] == ['offset']
  # The kernel tracks the row max only with the stable softmax, which is its default here.
  assert op_cls().use_stable_softmax is base.AUTO
  assert base.needs_stable_softmax(jnp.float32, None) is True


@pytest.mark.parametrize('t,s', [(6, 6), (3, 8), (1, 5)])
def test_causal_offset_s_minus_t_is_the_bottom_right_mask(t, s):
  """CausalMask(offset=S - T) keeps key j for query row i when j <= i + S - T, kimijax's mask
  (queries are the last T of S positions); the Mosaic kernels get offset 0 as their in-kernel
  causal mask and any other offset as a per-row key end i + offset + 1."""
  from tokamax._src.ops.attention import pallas_mosaic_gpu_common as common

  base, _ = tokamax_modules()
  mask = base.Mask(causal_mask=base.CausalMask(offset=s - t))
  np.testing.assert_array_equal(np.asarray(mask.as_array(t, s))[0], np.asarray(attention_lib._causal_mask(t, s)))
  q, k = jnp.zeros((1, t, 2, 8)), jnp.zeros((1, s, 2, 8))
  dense, is_causal, k_start, k_end = common.decompose_mask(mask, q, k, None, None)
  assert dense is None and k_start is None
  if t == s:
    assert is_causal and k_end is None
  else:
    assert not is_causal
    np.testing.assert_array_equal(np.asarray(k_end).reshape(-1), np.arange(t) + s - t + 1)


def test_residuals_are_the_row_max_and_row_sum_in_natural_units(highest_precision):
  """tokamax's reference op: residuals (m, l), each [B, H, T]; m = max over unmasked keys of
  scale * q . k (no log2 e factor, the scale applied), l = sum of exp(logit - m)."""
  base, _ = tokamax_modules()
  b, t, s, h, hkv, d, scale = 2, 5, 9, 4, 2, 8, 0.3
  q, k, v = (jnp.asarray(x) for x in make_qkv(1, b, t, s, h, hkv, d, d))
  _, (m, l) = base.DotProductAttention()(
    q, k, v, logits_scale=scale, mask=base.CausalMask(offset=s - t), return_residuals=True
  )
  assert m.shape == l.shape == (b, h, t) and m.dtype == jnp.float32
  kh = np.repeat(np.asarray(k, np.float64), h // hkv, axis=2)
  logits = scale * np.einsum('bthd,bshd->bhts', np.asarray(q, np.float64), kh)
  logits = np.where(np.asarray(attention_lib._causal_mask(t, s)), logits, -np.inf)
  np.testing.assert_allclose(m, logits.max(-1), rtol=1e-6)
  np.testing.assert_allclose(l, np.exp(logits - logits.max(-1, keepdims=True)).sum(-1), rtol=1e-5)


def test_the_hopper_kernel_writes_its_row_max_in_natural_units():
  """The SM90 (H100/H200) forward keeps its running max as log2(e) * scale * q . k (base-2
  softmax) and multiplies it by 1 / log2(e) when it writes the residual, so the residual is in the
  logits' own units, as the reference's. Source inspection is all a CPU can do; the GPU tests
  below check the numbers. If this fails after an upgrade, re-derive the transform in
  flash_attention_tokamax and run the gpu tests."""
  from tokamax._src.ops.attention import pallas_mosaic_gpu_kernel_sm90 as sm90

  source = inspect.getsource(sm90.flash_attention_kernel)
  assert re.search(r'scale \*= math\.log2\(math\.e\)', source)
  assert re.search(r'm_i = jnp\.maximum\(m_i, s\.max\(axis=1\) \* scale\)', source)
  assert re.search(r'm_smem\[wg\] = m_i \* \(1 / math\.log2\(math\.e\)\)', source)


# ----------------------------------------------------------------------------- the wrapper, with tokamax's reference op


CASES = [  # (B, T, S, H, Hkv, D, Dv, causal)
  (2, 7, 7, 4, 4, 8, 8, True),  # MHA, causal
  (2, 9, 9, 6, 2, 8, 8, True),  # GQA, causal
  (2, 5, 11, 4, 2, 8, 8, True),  # GQA, T < S: the last 5 of 11 positions
  (2, 6, 6, 4, 4, 12, 8, True),  # MLA-like: value dim below the query/key dim
  (1, 3, 10, 4, 1, 6, 6, False),  # MQA, not causal, T < S
]
IDS = [f'B{c[0]}T{c[1]}S{c[2]}H{c[3]}kv{c[4]}D{c[5]}v{c[6]}{"causal" if c[7] else "full"}' for c in CASES]


def reference_wrapper(**kw):
  base, _ = tokamax_modules()
  return jax.jit(lambda q, k, v: attention_lib.flash_attention_tokamax(q, k, v, op=base.DotProductAttention(), **kw))


@pytest.mark.parametrize('b,t,s,h,hkv,d,dv,causal', CASES, ids=IDS)
def test_wrapper_with_the_reference_op_matches_float64(b, t, s, h, hkv, d, dv, causal, highest_precision):
  q, k, v = make_qkv(2, b, t, s, h, hkv, d, dv)
  out, max_logits = reference_wrapper(causal=causal, return_max_logits=True)(q, k, v)
  ref_out, _ = ref_attention(q, k, v, causal)
  assert out.shape == (b, t, h, dv) and max_logits.shape == (h,) and max_logits.dtype == jnp.float32
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(max_logits, ref_max_logits_fast(q, k, causal), rtol=1e-5, atol=1e-6)
  plain, none = reference_wrapper(causal=causal)(q, k, v)
  assert none is None
  np.testing.assert_allclose(plain, out, rtol=1e-6, atol=1e-6)


def test_wrapper_gradients_flow_and_max_logits_carry_none(highest_precision):
  b, t, s, h, hkv, d, dv = 2, 5, 11, 4, 2, 8, 6
  q, k, v = make_qkv(3, b, t, s, h, hkv, d, dv)
  d_out = rand(np.random.default_rng(4), b, t, h, dv)
  run = reference_wrapper(causal=True, return_max_logits=True)
  grads = jax.grad(lambda q, k, v: jnp.sum(run(q, k, v)[0] * d_out), argnums=(0, 1, 2))(q, k, v)
  for name, g, r in zip('qkv', grads, ref_attention_grads(q, k, v, d_out, True)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5, err_msg=f'd/d{name}')
  for g in jax.grad(lambda q, k: jnp.sum(run(q, k, v)[1]), argnums=(0, 1))(q, k):
    np.testing.assert_array_equal(g, 0.0)


def test_wrapper_runs_per_shard_under_a_mesh(highest_precision):
  """Batch over data x fsdp, heads over tensor, as the attention layers lay q, k, v out: each
  device attends over its own rows and heads, the max logits are reduced across the batch shards,
  and nothing is gathered."""
  b, t, h, hkv, d, dv = 8, 16, 4, 2, 8, 6
  q, k, v = make_qkv(5, b, t, t, h, hkv, d, dv)
  spec = P(('data', 'fsdp'), None, 'tensor', None)
  mesh = jax.make_mesh((2, 2, 2), ('data', 'fsdp', 'tensor'), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  run = reference_wrapper(causal=True, return_max_logits=True, spec=spec)
  with jax.set_mesh(mesh):
    out, max_logits = run(*args)
    compiled = run.lower(*args).compile().as_text()
  np.testing.assert_allclose(out, ref_attention(q, k, v, True)[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(max_logits, ref_max_logits_fast(q, k, True), rtol=1e-5, atol=1e-6)
  assert 'all-gather' not in compiled and 'all-to-all' not in compiled
  assert 'all-reduce' in compiled  # the max across the batch shards


def test_wrapper_is_traced_and_lowered_once_for_layers_of_one_shape():
  """Three layers' calls with the same shapes: the forward module holds the wrapper's body once,
  called three times; the gradient's holds at most three bodies (forwards whose residuals differ
  by their use, one backward called by every layer), not a copy of the kernel per layer."""
  base, _ = tokamax_modules()
  q, k, v = make_qkv(6, 2, 8, 8, 4, 2, 8, 8)

  def three_layers(q, k, v):
    for _ in range(3):
      q = attention_lib.flash_attention_tokamax(q, k, v, op=base.DotProductAttention(), return_max_logits=True)[0]
    return jnp.sum(q)

  def calls(fn):
    text = jax.jit(fn).lower(q, k, v).as_text()
    bodies = re.findall(r'func\.func private @(_tokamax_flash[\w.]*)', text)
    return {name: len(re.findall(rf'call @{re.escape(name)}\(', text)) for name in bodies}

  assert calls(three_layers) == {'_tokamax_flash': 3}
  backward = calls(jax.grad(three_layers))
  assert len(backward) <= 3 and sum(backward.values()) == 6 and 3 in backward.values(), backward


# ----------------------------------------------------------------------------- selection and errors


def test_the_cpu_default_stays_xla_which_runs_anywhere():
  assert config_lib.base_config().model.attn_impl == 'xla'
  assert attention_lib.unsupported('xla', jnp.float32) is None


@pytest.mark.parametrize(
  'dtype,says', [(jnp.float32, 'needs bfloat16 or float16'), (jnp.bfloat16, 'needs an NVIDIA GPU')]
)
def test_tokamax_on_this_cpu_is_one_clear_error_before_compute(dtype, says):
  """Raised while tracing (eval_shape compiles and runs nothing), naming the key and the fix."""
  q = jax.ShapeDtypeStruct((1, 8, 2, 16), dtype)
  with pytest.raises(ValueError, match=says) as err:
    jax.eval_shape(lambda q: attention_lib.attention(q, q, q, impl='tokamax', return_max_logits=True), q)
  assert "impl='tokamax'" in str(err.value) and "'xla'" in str(err.value)
  assert attention_lib.unsupported('tokamax', jnp.bfloat16, 'gpu') is None


def test_training_with_tokamax_off_the_gpu_stops_before_compute():
  from kimijax.train.loop import check_attention_impl

  config = config_lib.base_config()
  config.model.attn_impl = 'tokamax'
  with pytest.raises(config_lib.ConfigError, match="impl='tokamax' needs an NVIDIA GPU"):
    check_attention_impl(config, jax.devices('cpu'))
  config.model.layer_pattern = 'K'  # no attention layer: the key is unused
  check_attention_impl(config, jax.devices('cpu'))


@pytest.mark.parametrize('max_logits,dv,chosen', [(True, 16, 'tokamax'), (False, 8, 'tokamax'), (False, 16, 'cudnn')])
def test_impl_gpu_runs_tokamax_for_max_logits_or_unequal_value_dim_else_cudnn(monkeypatch, max_logits, dv, chosen):
  """impl='gpu' hands the call, arguments unchanged, to the implementation gpu_choice names (the
  two GPU ones are replaced by recorders here: this CPU runs neither)."""
  calls = []

  def recorder(name):
    def run(q, k, v, causal, scale, return_max_logits, spec):
      calls.append((name, q.shape, v.shape, causal, scale, return_max_logits))
      return jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype), jnp.zeros(q.shape[2]) if return_max_logits else None

    return run

  implementations = {
    **attention_lib.IMPLS,
    'tokamax': attention_lib.Implementation(recorder('tokamax'), gpu_only=True),
    'cudnn': attention_lib.Implementation(recorder('cudnn'), gpu_only=True),
  }
  monkeypatch.setattr(attention_lib, 'IMPLS', types.MappingProxyType(implementations))
  monkeypatch.setattr(attention_lib, 'unsupported', lambda impl, dtype, platform=None: None)
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  v = jnp.zeros((1, 8, 2, dv), jnp.bfloat16)
  attention_lib.attention(q, q, v, impl='gpu', scale=0.5, return_max_logits=max_logits)
  assert calls == [(chosen, q.shape, v.shape, True, 0.5, max_logits)]


def test_impl_gpu_off_the_gpu_is_one_clear_error_naming_it():
  q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="impl='gpu' needs an NVIDIA GPU"):
    jax.eval_shape(lambda q: attention_lib.attention(q, q, q, impl='gpu'), q)


# ----------------------------------------------------------------------------- GPU: the kernel against 'xla'


def bf16_qkv(seed, b, t, s, h, hkv, d, dv, negative=False):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.float32)
  k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32)
  if negative:  # every logit < 0: a max clamped at 0 (or at a fill value) would show
    q, k = jnp.abs(q) + 0.1, -jnp.abs(k) - 0.1
  v = jax.random.normal(keys[2], (b, s, hkv, dv), jnp.float32)
  d_out = jax.random.normal(keys[3], (b, t, h, dv), jnp.float32)
  return tuple(x.astype(jnp.bfloat16) for x in (q, k, v, d_out))


def compare_with_xla(shape, causal=True, negative=False, grads=True):
  """Relative RMSE of tokamax against 'xla' on the same bf16 inputs (outputs, then the gradients
  of sum(out * d_out)), and tokamax's max logits against 'xla''s (float32 logits of the same bf16
  q and k)."""
  q, k, v, d_out = bf16_qkv(0, *shape, negative=negative)
  results = {}
  for impl in ('xla', 'tokamax'):
    fwd = jax.jit(
      lambda q, k, v, impl=impl: attention_lib.attention(q, k, v, causal=causal, impl=impl, return_max_logits=True)
    )
    out, max_logits = fwd(q, k, v)
    loss = lambda q, k, v, impl=impl: jnp.sum(
      attention_lib.attention(q, k, v, causal=causal, impl=impl).astype(jnp.float32) * d_out.astype(jnp.float32)
    )
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v) if grads else ()
    results[impl] = (
      np.asarray(out.astype(jnp.float32)),
      np.asarray(max_logits),
      [np.asarray(x.astype(jnp.float32)) for x in g],
    )
  (out_x, m_x, g_x), (out_t, m_t, g_t) = results['xla'], results['tokamax']
  b, t, _, h, _, _, dv = shape
  assert out_t.shape == out_x.shape == (b, t, h, dv)
  assert rel_rmse(out_t, out_x) <= 5e-3, rel_rmse(out_t, out_x)
  np.testing.assert_allclose(m_t, m_x, rtol=1e-5)
  for name, a, b in zip('qkv', g_t, g_x):
    assert rel_rmse(a, b) <= 1e-2, (name, rel_rmse(a, b))
  return q, k, m_t


SMALL = [  # (B, T, S, H, Hkv, D, Dv), causal unless noted
  (2, 256, 256, 8, 8, 64, 64),  # MHA
  (2, 256, 256, 16, 4, 128, 128),  # GQA 16 / 4
  (2, 256, 256, 8, 8, 192, 128),  # MLA dims: q/k 192, v 128, unpadded
  (2, 128, 384, 8, 2, 64, 64),  # T < S: the last 128 of 384 positions
  (2, 77, 256, 8, 2, 64, 64),  # T < S, T not a multiple of a block
  (2, 255, 255, 8, 2, 128, 128),  # odd length
]


@pytest.mark.gpu
@pytest.mark.parametrize('shape', SMALL, ids=[f'B{b}T{t}S{s}H{h}kv{hkv}D{d}v{dv}' for b, t, s, h, hkv, d, dv in SMALL])
def test_gpu_tokamax_matches_xla_at_small_shapes(shape):
  q, k, m = compare_with_xla(shape)
  q64, k64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k))
  np.testing.assert_allclose(m, ref_max_logits_fast(q64, k64, True), rtol=1e-5)


@pytest.mark.gpu
def test_gpu_tokamax_max_logits_are_signed_and_unmasked_only():
  compare_with_xla((2, 128, 256, 8, 2, 64, 64), negative=True)
  compare_with_xla((2, 77, 256, 8, 2, 64, 64), causal=False, grads=False)


BENCH = [(8, 4096, 4096, 16, 16, 128, 128), (8, 4096, 4096, 16, 4, 128, 128), (8, 4096, 4096, 16, 16, 192, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize('shape', BENCH, ids=['mha', 'gqa16_4', 'mla192_128'])
def test_gpu_tokamax_matches_xla_at_benchmark_shapes(shape):
  compare_with_xla(shape)


@pytest.mark.gpu
def test_gpu_model_trains_the_same_with_tokamax():
  """A small MLA + GQA model's loss, gradients and per-layer max logits, 'tokamax' against 'xla'."""
  from kimijax.model import Transformer
  from kimijax.train.step import make_loss_fn

  losses, grads, logits = {}, {}, {}
  for impl in ('xla', 'tokamax'):
    cfg = config_lib.base_config().model
    cfg.update(
      d_model=512,
      num_heads=4,
      num_kv_heads=2,
      attention_kind='gqa',
      num_layers=2,
      layer_pattern='A',
      attn_impl=impl,
      compute_dtype='bfloat16',
    )
    mla = cfg.copy_and_resolve_references()
    mla.update(attention_kind='mla', num_kv_heads=0, mla_qk_rope_head_dim=64, mla_kv_lora_rank=128)
    for name, c in (('gqa', cfg), ('mla', mla)):
      model = Transformer(c)
      tokens = jax.random.randint(jax.random.key(1), (2, 513), 0, c.vocab_size)
      batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'mask': jnp.ones((2, 512))}
      params = model.init(jax.random.key(0), batch['inputs'])['params']
      (loss, aux), g = jax.jit(jax.value_and_grad(make_loss_fn(model), has_aux=True))(params, batch)
      losses[name, impl], grads[name, impl], logits[name, impl] = float(loss), g, aux['max_logits']
  for name in ('gqa', 'mla'):
    assert abs(losses[name, 'tokamax'] - losses[name, 'xla']) < 1e-3 * abs(losses[name, 'xla'])
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    assert rel_rmse(flat(grads[name, 'tokamax']), flat(grads[name, 'xla'])) <= 1e-2
    # Layer 0 sees the same inputs in both programs, so its max logits are exact; deeper layers see
    # inputs that differ by the two implementations' bf16 roundings (a few 1e-3 relative).
    for layer, m in logits[name, 'xla'].items():
      np.testing.assert_allclose(
        logits[name, 'tokamax'][layer], m, rtol=1e-5 if layer == 'layer_0' else 1e-2, err_msg=f'{name} {layer}'
      )
