"""kimijax.infer.generate's loop on the device against the loop on the host: the same tokens for the
same seed (greedy, sampled, a stop token that stops some rows, one that stops every row early), for a
hybrid KDA + MLA model and an all-attention one; one compilation per shapes and sampling arguments,
and no device-to-host transfer before the tokens."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_model_config

from kimijax.infer import generate as gen
from kimijax.infer.cache import init_cache
from kimijax.infer.sampling import sample
from kimijax.model import Transformer

B, PROMPT, NEW = 3, 5, 10
SAMPLED = dict(temperature=1.2, top_k=6, top_p=0.95)


def tiny(pattern, kind):
  return tiny_model_config(
    layer_pattern=pattern,
    attention_kind=kind,
    num_kv_heads=0,
    position='nope' if kind == 'mla' else 'rope',
    init_std=0.2,
    mla_kv_lora_rank=16,
    kda_impl='xla_recurrent',  # compiles fastest; decoding uses kda_step whatever the impl
    vocab_size=8,  # few tokens: sampled rows repeat them, so stop tokens can be found
  )


MODELS = {'KA hybrid, MLA': tiny('KA', 'mla'), 'all-attention, MHA': tiny('A', 'mha')}


@pytest.fixture(scope='module', params=list(MODELS), ids=list(MODELS))
def setup(request):
  cfg = MODELS[request.param]
  model = Transformer(cfg)
  prompt = jax.random.randint(jax.random.key(3), (B, PROMPT), 0, cfg.vocab_size)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), prompt)['params'])
  return model, params, np.asarray(prompt)


def host_loop(
  model, params, prompt_bt, *, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0, stop_token=None
):
  """The reference: prefill, then per token a split of the rng, a sample brought to the host, the
  stop-token bookkeeping in NumPy and one jitted decode step."""

  @jax.jit
  def run(tokens_bt, positions_bt, cache):
    logits, aux = model.apply({'params': params}, tokens_bt, positions_bt, cache=cache)
    return logits[:, -1], aux['cache']

  b, p = prompt_bt.shape
  logits, cache = run(prompt_bt, np.broadcast_to(np.arange(p), (b, p)), init_cache(model.cfg, b, p + max_new_tokens))
  rng = jax.random.key(seed)
  out, done = [prompt_bt], np.zeros(b, bool)
  for i in range(max_new_tokens):
    rng, key = jax.random.split(rng)
    token = np.asarray(sample(key, logits, temperature=temperature, top_k=top_k, top_p=top_p))
    if stop_token is not None:
      token = np.where(done, stop_token, token)
      done |= token == stop_token
    out.append(token[:, None])
    if i + 1 == max_new_tokens or done.all():
      break
    logits, cache = run(jnp.asarray(token[:, None]), np.full((b, 1), p + i), cache)
  tokens = np.concatenate(out, axis=1)
  return np.pad(tokens, ((0, 0), (0, p + max_new_tokens - tokens.shape[1])), constant_values=stop_token or 0)


def stop_tokens(tokens):
  """(a token that stops some rows but not all, one that every row emits ahead of its last new token),
  from a generation without a stop token: a row's tokens up to its first stop token do not change."""
  new = tokens[:, PROMPT:-1]
  in_rows = {t: [t in row for row in new] for t in np.unique(new).tolist()}
  some = next(t for t, rows in in_rows.items() if any(rows) and not all(rows))
  every = next(t for t, rows in in_rows.items() if all(rows))
  return some, every


def test_greedy_matches_the_host_loop(setup):
  model, params, prompt = setup
  want = host_loop(model, params, prompt, max_new_tokens=NEW, temperature=0.0)
  got = gen.generate(model, params, prompt, max_new_tokens=NEW, temperature=0.0)
  assert got.dtype == np.int32 and got.shape == (B, PROMPT + NEW)
  np.testing.assert_array_equal(got, want)


def test_sampled_with_stop_tokens_matches_the_host_loop(setup):
  model, params, prompt = setup
  free = host_loop(model, params, prompt, max_new_tokens=NEW, seed=4, **SAMPLED)
  np.testing.assert_array_equal(gen.generate(model, params, prompt, max_new_tokens=NEW, seed=4, **SAMPLED), free)
  some, every = stop_tokens(free)
  kwargs = dict(max_new_tokens=NEW, seed=4, **SAMPLED)
  want = host_loop(model, params, prompt, stop_token=some, **kwargs)
  np.testing.assert_array_equal(gen.generate(model, params, prompt, stop_token=some, **kwargs), want)
  assert (want[:, -1] == some).any() and not (want[:, -1] == some).all()
  # Every row stops: the loop ends early, after fewer decode steps than max_new_tokens - 1 (timed_generate:
  # the same loop, compiled as its own call after the prefill's).
  want = host_loop(model, params, prompt, stop_token=every, **kwargs)
  got, timing = gen.timed_generate(model, params, prompt, stop_token=every, **kwargs)
  np.testing.assert_array_equal(got, want)
  assert (want[:, -1] == every).all()
  first_stops = [list(row[PROMPT:]).index(every) for row in want]
  assert timing.decode_steps == max(first_stops) < NEW - 1
  assert timing.prefill_s > 0 and timing.decode_s > 0


def test_one_compilation_and_no_transfer_before_the_tokens(setup):
  model, params, prompt = setup
  with jax.transfer_guard_device_to_host('disallow'):  # a per-token host sync would raise here
    gen.generate(model, params, prompt, max_new_tokens=NEW, temperature=0.0, seed=1)  # compiled by the greedy test
    compiled = gen._generate_jit._cache_size()
    gen.generate(model, params, prompt + 1, max_new_tokens=NEW, temperature=0.0, seed=2)  # new seed and prompt
  assert gen._generate_jit._cache_size() == compiled


def test_bad_arguments():
  model = Transformer(MODELS['all-attention, MHA'])
  with pytest.raises(ValueError, match='max_new_tokens=0 must be positive'):
    gen.generate(model, {}, [[1, 2]], max_new_tokens=0)
  with pytest.raises(ValueError, match=r'at least one token, got \(2, 0\)'):
    gen.generate(model, {}, np.zeros((2, 0), np.int32), max_new_tokens=3)


def test_a_cache_past_the_devices_memory_is_named_before_compiling():
  """cache_too_large against the closed form of an MHA cache: K and V of [B, L, Hkv, Dh] per layer
  in the compute dtype (float32 here)."""
  from kimijax.config import num_kv_heads
  from kimijax.train.memory import GiB, device_memory

  m = MODELS['all-attention, MHA']
  per_token = m.num_layers * 2 * num_kv_heads(m) * (m.d_model // m.num_heads) * 4
  assert gen.cache_too_large(m, batch=2, length=64) is None
  devices = jax.local_devices()
  memory = device_memory(devices)
  if memory is None:
    pytest.skip("this host's memory cannot be told")
  length = 2 * memory[0] * len(devices) // (2 * per_token)  # twice the memory, for a batch of 2
  message = gen.cache_too_large(m, batch=2, length=length)
  assert message == (
    f'the decode cache of 2 x {length} tokens needs {2 * length * per_token / GiB:.1f} GiB, more than {memory[1]}'
  )
