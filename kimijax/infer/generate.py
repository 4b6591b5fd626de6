"""Prefill + decoding on the device with per-layer caches, and batched sampling.

    tokens = generate(model, params, prompt_bt, max_new_tokens=64, temperature=0.8, top_p=0.95)

`params` is the model's params or, for a model with MoE layers, its variables with the balancing
biases, {'params': ..., 'moe_state': ...} (kimijax.model.inference_variables; load_for_generation
returns what the run's model needs). The MoE layers route each token as in training: prefill and
decode steps run them with no cache of their own.

The prompt runs once through the parallel path (the chunked KDA form, flash attention) and fills
every layer's cache; each new token then costs one decode step, which for KDA layers is O(1) in
the context length. Prompts in a batch share one length.

`generate` is one jitted call: the prefill, then a `lax.while_loop` whose carry holds the cache,
the rng, the last sampled tokens, the [B, P + max_new_tokens] int32 output buffer, the per-row
done mask and the step index. Sampling (kimijax.infer.sampling) and the stop token are handled in
the loop, which ends when every row has emitted the stop token, so the host waits once, for the
tokens. The rng is split once per new token, `rng, key = jax.random.split(rng)`, and `key`
samples that token. It compiles once per model, shapes and sampling arguments; the seed is traced.

`timed_generate` gives the same tokens from the two halves, prefill and the loop, each compiled
ahead of time and timed on its own (run.py --mode=generate prints the times). `decode`, the loop
alone from given last logits and a cache (donated), serves benchmarks that fill the cache
themselves (experiments/bench/bench_decode.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kimijax import config as config_lib
from kimijax.data.tokenizer import config_vocab_size
from kimijax.infer.cache import cache_bytes, init_cache
from kimijax.infer.sampling import sample
from kimijax.model import Transformer, as_variables, inference_variables
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.checkpoint import latest_weights, load_run_config


@dataclasses.dataclass(frozen=True)
class Sampling:
  """The sampling arguments, static under jit: `sample` branches on temperature == 0, top_k sets
  the shape of its top-k and top_p < 1 adds a sort; stop_token None drops the stop test from the
  loop. A run's stop token (its tokenizer's EOS) does not change between calls, so a traced one
  would save no compilation."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_token: int | None = None


class _Static:
  """A model as a static jit argument, equal only to itself: a Module holding a ConfigDict has no
  hash. jit's cache keeps it alive, so its id is not reused while the compiled function lives."""

  def __init__(self, model: nn.Module):
    self.model = model

  def __hash__(self):
    return id(self.model)

  def __eq__(self, other):
    return isinstance(other, _Static) and other.model is self.model


def _apply(model, params, tokens_bt, positions_bt, cache):
  """(last-position logits [B, V], updated cache)."""
  logits, aux = model.apply(as_variables(params), tokens_bt, positions_bt, cache=cache)
  return logits[:, -1], aux['cache']


def _prefill(static, params, prompt_bt, max_new_tokens):
  b, p = prompt_bt.shape
  cache = init_cache(static.model.cfg, b, p + max_new_tokens)
  return _apply(static.model, params, prompt_bt, jnp.broadcast_to(jnp.arange(p), (b, p)), cache)


def _pick(rng, logits_bv, done_b, sampling: Sampling):
  """(rng, tokens [B], done [B]): one split of rng, then the sample; rows already done emit the stop token."""
  rng, key = jax.random.split(rng)
  token = sample(key, logits_bv, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
  if sampling.stop_token is not None:
    token = jnp.where(done_b, sampling.stop_token, token)
    done_b = done_b | (token == sampling.stop_token)
  return rng, token, done_b


def _decode(static, params, prompt_bt, logits_bv, cache, rng, max_new_tokens, sampling: Sampling):
  """(tokens [B, P + N] int32, cache, decode steps run): N = max_new_tokens tokens, the first
  sampled from `logits_bv`, each later one after a decode step of the one before it."""
  b, p = prompt_bt.shape
  fill = 0 if sampling.stop_token is None else sampling.stop_token
  out = jnp.full((b, p + max_new_tokens), fill, jnp.int32).at[:, :p].set(prompt_bt)
  rng, token, done = _pick(rng, logits_bv, jnp.zeros((b,), bool), sampling)
  out = out.at[:, p].set(token)

  def running(carry):
    i, done = carry[0], carry[3]
    return (i < max_new_tokens) & ~jnp.all(done)

  def step(carry):  # token i from a decode step of token i - 1 at position p + i - 1
    i, rng, token, done, out, cache = carry
    logits, cache = _apply(static.model, params, token[:, None], jnp.full((b, 1), p + i - 1), cache)
    rng, token, done = _pick(rng, logits, done, sampling)
    return i + 1, rng, token, done, jax.lax.dynamic_update_slice(out, token[:, None], (0, p + i)), cache

  i, _, _, _, out, cache = jax.lax.while_loop(running, step, (jnp.int32(1), rng, token, done, out, cache))
  return out, cache, i - 1


_STATIC = ('static', 'max_new_tokens', 'sampling')
_prefill_jit = jax.jit(_prefill, static_argnames=('static', 'max_new_tokens'))
_decode_jit = jax.jit(_decode, static_argnames=_STATIC, donate_argnames='cache')  # the cache updated in place


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_jit(static, params, prompt_bt, rng, max_new_tokens, sampling):
  logits, cache = _prefill(static, params, prompt_bt, max_new_tokens)
  return _decode(static, params, prompt_bt, logits, cache, rng, max_new_tokens, sampling)[0]


def _checked_prompt(prompt_bt, max_new_tokens: int):
  prompt_bt = jnp.asarray(prompt_bt, jnp.int32)
  if prompt_bt.ndim != 2 or prompt_bt.shape[1] == 0:
    raise ValueError(f'generate: the prompt must be [batch, length] with at least one token, got {prompt_bt.shape}')
  if max_new_tokens < 1:
    raise ValueError(f'generate: max_new_tokens={max_new_tokens} must be positive')
  return prompt_bt


def cache_too_large(m, batch: int, length: int, devices=None) -> str | None:
  """What generate's cache of batch x length tokens (model config m) needs, where that is more
  than the devices' memory together (kimijax.train.memory.device_memory); None where it fits or
  the memory cannot be told. Checked before anything compiles: an out-of-memory error of XLA's
  would come only after the prefill's compilation."""
  from kimijax.train.memory import GiB, device_memory

  devices = list(devices or jax.local_devices())
  memory = device_memory(devices)
  need = cache_bytes(jax.eval_shape(lambda: init_cache(m, batch, length)))
  if memory is None or need <= memory[0] * len(devices):
    return None
  return f'the decode cache of {batch} x {length} tokens needs {need / GiB:.1f} GiB, more than {memory[1]}'


def decode(model: nn.Module, params, prompt_bt, logits_bv, cache, rng, *, max_new_tokens: int, **sampling):
  """(tokens [B, P + max_new_tokens] int32, cache, decode steps run) on the device from prefill's
  logits and cache (donated: use the returned one); `sampling` is Sampling's fields."""
  prompt_bt = _checked_prompt(prompt_bt, max_new_tokens)
  return _decode_jit(_Static(model), params, prompt_bt, logits_bv, cache, rng, max_new_tokens, Sampling(**sampling))


def generate(
  model: nn.Module,
  params,
  prompt_bt,
  *,
  max_new_tokens: int,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  stop_token: int | None = None,
):
  """prompt [B, P] int -> [B, P + max_new_tokens] np.int32 (generation continues past stop_token
  for other rows; positions after a row's stop token are filled with it)."""
  prompt_bt = _checked_prompt(prompt_bt, max_new_tokens)
  sampling = Sampling(temperature, top_k, top_p, stop_token)
  tokens = _generate_jit(_Static(model), params, prompt_bt, jax.random.key(seed), max_new_tokens, sampling)
  return np.asarray(jax.device_get(tokens), np.int32)


@dataclasses.dataclass(frozen=True)
class Timing:
  prefill_s: float  # the prompt's forward pass and the cache it fills
  decode_s: float  # the loop: every new token's sample and decode step
  decode_steps: int  # decode steps the loop ran (max_new_tokens - 1 unless every row stopped early)


def timed_generate(model: nn.Module, params, prompt_bt, *, max_new_tokens: int, seed: int = 0, **sampling):
  """(generate's tokens, Timing): prefill and the decode loop compiled ahead of time, then each run
  once and waited for, so that the times hold no compilation. The tokens per second of the loop,
  batch x decode_steps / decode_s, compare with one decode step's (experiments/bench/bench_decode.py)."""
  prompt_bt = _checked_prompt(prompt_bt, max_new_tokens)
  static, rng, sampling = _Static(model), jax.random.key(seed), Sampling(**sampling)
  prefill_compiled = _prefill_jit.lower(static, params, prompt_bt, max_new_tokens).compile()
  start = time.perf_counter()
  logits, cache = jax.block_until_ready(prefill_compiled(params, prompt_bt))
  prefill_s = time.perf_counter() - start
  decode_compiled = _decode_jit.lower(static, params, prompt_bt, logits, cache, rng, max_new_tokens, sampling).compile()
  start = time.perf_counter()
  tokens, _, steps = jax.block_until_ready(decode_compiled(params, prompt_bt, logits, cache, rng))
  decode_s = time.perf_counter() - start
  return np.asarray(jax.device_get(tokens), np.int32), Timing(prefill_s, decode_s, int(steps))


def load_for_generation(workdir, config=None, param_dtype: str = 'float32'):
  """(config, model, params) from the latest checkpoint in workdir (its config.json, or `config`
  where given: then a released checkpoint named by config.train.init_from stands in while workdir
  has no checkpoint), laid out data-parallel over this host's devices; params as generate takes
  them (with the MoE biases for a model with MoE layers), the matrices in param_dtype
  (kimijax.model.inference_params). Off a GPU, the run's implementations become XLA ones
  (kimijax.config.portable: the same parameters), so a GPU run generates on a CPU."""
  config = load_run_config(workdir) if config is None else config.copy_and_resolve_references()
  if jax.default_backend() != 'gpu':
    config.model = config_lib.portable(config.model)
  config_vocab_size(config)  # a tokenizer with ids past the model's vocabulary is a DataError naming both
  model = Transformer(config.model)
  params, moe_state, _ = latest_weights(workdir, config, model, mesh_lib.make_mesh(config.mesh), param_dtype)
  return config, model, inference_variables(params, moe_state)
