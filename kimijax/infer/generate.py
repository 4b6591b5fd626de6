"""Prefill + token-by-token decoding with per-layer caches, and batched sampling.

    tokens = generate(model, params, prompt_bt, max_new_tokens=64, temperature=0.8, top_p=0.95)

`params` is the model's params or, for a model with MoE layers, its variables with the balancing
biases, {'params': ..., 'moe_state': ...} (kimijax.model.inference_variables; load_for_generation
returns what the run's model needs). The MoE layers route each token as in training: prefill and
decode steps run them with no cache of their own.

The prompt runs once through the parallel path (the chunked KDA form, flash attention) and fills
every layer's cache; each new token then costs one decode step, which for KDA layers is O(1) in
the context length. Prompts in a batch share one length.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kimijax.infer.cache import init_cache
from kimijax.infer.sampling import sample
from kimijax.model import Transformer, as_variables, inference_variables
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.checkpoint import load_run_config, restore_latest_state


def _step_fns(model: nn.Module):
  """Jitted (prefill, decode_step) for `model`: each returns (last-position logits [B, V], cache).
  Both consume (donate) the cache they are given: use the returned one."""

  def run(params, tokens_bt, positions_bt, cache):
    logits, aux = model.apply(as_variables(params), tokens_bt, positions_bt, cache=cache)
    return logits[:, -1], aux['cache']

  @functools.partial(jax.jit, donate_argnames='cache')  # the cache is updated in place
  def prefill(params, tokens_bt, cache):
    return run(params, tokens_bt, jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape), cache)

  @functools.partial(jax.jit, donate_argnames='cache')
  def decode_step(params, token_b, position, cache):
    return run(params, token_b[:, None], jnp.full((token_b.shape[0], 1), position), cache)

  return prefill, decode_step


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
  """prompt [B, P] int -> [B, P + max_new_tokens] int32 (generation continues past stop_token
  for other rows; positions after a row's stop token are filled with it)."""
  prompt_bt = jnp.asarray(prompt_bt, jnp.int32)
  b, p = prompt_bt.shape
  if p == 0:
    raise ValueError('generate: the prompt must hold at least one token')
  prefill, decode_step = _step_fns(model)
  logits, cache = prefill(params, prompt_bt, init_cache(model.cfg, b, p + max_new_tokens))
  rng = jax.random.key(seed)
  out = [np.asarray(prompt_bt)]
  done = np.zeros(b, bool)
  for i in range(max_new_tokens):
    rng, key = jax.random.split(rng)
    token = sample(key, logits, temperature=temperature, top_k=top_k, top_p=top_p)
    token_np = np.asarray(token)
    if stop_token is not None:
      token_np = np.where(done, stop_token, token_np)
      done |= token_np == stop_token
    out.append(token_np[:, None])
    if i + 1 == max_new_tokens or (stop_token is not None and done.all()):
      break
    logits, cache = decode_step(params, jnp.asarray(token_np), p + i, cache)
  tokens = np.concatenate(out, axis=1).astype(np.int32)
  if tokens.shape[1] < p + max_new_tokens:  # every row stopped early
    tokens = np.pad(tokens, ((0, 0), (0, p + max_new_tokens - tokens.shape[1])), constant_values=stop_token)
  return tokens


def load_for_generation(workdir):
  """(config, model, params) from the latest checkpoint in workdir (its config.json), laid out
  data-parallel over this host's devices; params as generate takes them (with the MoE biases for
  a model with MoE layers). Off a GPU, GPU-only implementation choices of the run (attn_impl
  'cudnn' or 'tokamax', attnres_impl 'pallas', moe.impl 'tokamax', mla_decode_impl 'pallas') become
  'xla', so a GPU run generates on a CPU."""
  config = load_run_config(workdir)
  if jax.default_backend() != 'gpu':
    config.model.attn_impl = config.model.attnres_impl = config.model.moe.impl = 'xla'
    config.model.mla_decode_impl = 'xla'
  model = Transformer(config.model)
  state, _ = restore_latest_state(workdir, config, model, mesh_lib.make_mesh(config.mesh))
  return config, model, inference_variables(state.params, state.moe_state)
