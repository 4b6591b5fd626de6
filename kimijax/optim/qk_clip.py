"""QK-Clip (Kimi K2, docs/optimizers.md#qk-clip) as an optax transform (MuonClip, Muon then QK-Clip, is the chain
kimijax.optim.factory builds for optimizer.name='muonclip').

The forward pass reports S_max^h, the largest scaled logit of each query head over the batch
(model aux['max_logits'] = {'layer_<i>': [H] fp32}). After the optimizer step, every head with
S_max^h > tau has its query and key weights rescaled so that its logit would be tau:

    gamma_h = min(1, tau / S_max^h)
    MHA:  W_q^h *= sqrt(gamma_h),  W_k^h *= sqrt(gamma_h)
    GQA:  per KV group g, gamma_g = min over the group's query heads of gamma_h (the largest
          S_max); the key head g and all query heads of g get sqrt(gamma_g)

`qk_clip(tau).update(updates, state, params, max_logits=...)` rewrites `updates` so that
params + updates are the clipped new weights (W_t = W_{t-1} + u_t, then scaled). Heads not
rescaled keep their update bit for bit, and every other parameter is passed through untouched.
The clip does not change the current step's gradients; it is a weight rewrite after the step.

    MLA:  W_q^C (q_nope) and W_k^C (k_nope) per head *= sqrt(gamma_h); the rotary W_q^R (q_rope)
          per head *= gamma_h; the shared rotary W_k^R (k_rope) is untouched

The per-layer work is split into locating the attention module (the first of ATTENTION_MODULES
in `params[layer]`) and a clip rule from CLIP_RULES that maps the module's parameters and
gamma [H] to multiplicative factors {param name: array broadcastable to that parameter}; the
generic code applies factors != 1 to the new weights. A module no rule recognises stops with
NotImplementedError naming its parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kimijax.optim.boxes import accept_boxed

# (module params, gamma [H] fp32) -> {param name: factor} or None when the rule does not apply.
ClipRule = Callable[[Mapping[str, Any], jax.Array], 'dict[str, jax.Array] | None']


def mha_gqa_factors(module: Mapping[str, Any], gamma_h: jax.Array):
  """Factors for query [D, H, Dh] and key [D, Hkv, Dh] (MHA when Hkv == H). Query head h
  belongs to KV group h // (H // Hkv), as in kimijax.ops.attention."""
  if 'query' not in module or 'key' not in module:
    return None
  h, hkv = module['query'].shape[1], module['key'].shape[1]
  gamma_g = jnp.min(gamma_h.reshape(hkv, h // hkv), axis=1)
  root_g = jnp.sqrt(gamma_g)
  return {'query': jnp.repeat(root_g, h // hkv)[None, :, None], 'key': root_g[None, :, None]}


def mla_factors(module: Mapping[str, Any], gamma_h: jax.Array):
  """Factors for kimijax.layers.mla: q_nope [Dq, H, dn] and k_nope [r, H, dn] by sqrt(gamma),
  q_rope [Dq, H, dr] by gamma; the shared k_rope [D, dr] keeps its weights (docs/optimizers.md#qk-clip)."""
  if 'q_nope' not in module or 'k_nope' not in module:
    return None
  root_h = jnp.sqrt(gamma_h)[None, :, None]
  factors = {'q_nope': root_h, 'k_nope': root_h}
  if 'q_rope' in module:
    factors['q_rope'] = gamma_h[None, :, None]
  return factors


CLIP_RULES: tuple[ClipRule, ...] = (mha_gqa_factors, mla_factors)
# Names of attention submodules inside params['layer_<i>'] (kimijax/model.py make_mixer).
ATTENTION_MODULES = ('attention', 'mla')


class QKClipState(NamedTuple):
  heads_clipped: jax.Array  # int32 []: query heads with S_max > tau at the last update


def _replace(tree: Mapping, path: tuple[str, ...], value):
  """A copy of nested dict `tree` with tree[path[0]]...[path[-1]] = value."""
  head, *rest = path
  return {**tree, head: _replace(tree[head], tuple(rest), value) if rest else value}


def clip_factors(params, max_logits: Mapping[str, jax.Array], tau: float):
  """{(layer, module, param): factor} and the number of query heads with S_max > tau."""
  factors, clipped = {}, jnp.zeros((), jnp.int32)
  for layer, s_h in max_logits.items():
    names = [m for m in ATTENTION_MODULES if m in params.get(layer, {})]
    if not names:
      raise KeyError(
        f'qk_clip: max_logits has {layer!r} but params has no {layer}/one of '
        f'{ATTENTION_MODULES}; layers in params: {sorted(params)}'
      )
    attention_module = names[0]
    module = params[layer][attention_module]
    s_h = jnp.asarray(s_h, jnp.float32)
    over = s_h > tau
    gamma_h = jnp.where(over, tau / jnp.where(over, s_h, 1.0), 1.0)
    for rule in CLIP_RULES:
      found = rule(module, gamma_h)
      if found is not None:
        break
    else:
      raise NotImplementedError(
        f'qk_clip: no clip rule for {layer}/{attention_module} with parameters {sorted(module)}; '
        'kimijax.optim.qk_clip.CLIP_RULES knows MHA/GQA (query, key) and MLA (q_nope, k_nope, q_rope).'
      )
    for name, f in found.items():
      factors[(layer, attention_module, name)] = f
    clipped = clipped + jnp.sum(over, dtype=jnp.int32)
  return factors, clipped


def qk_clip(tau: float = 100.0) -> optax.GradientTransformationExtraArgs:
  """QK-Clip as a weight rewrite folded into the updates; needs params and max_logits=.
  tau: the logit cap (Kimi K2: 100)."""

  def init(params):
    del params
    return QKClipState(jnp.zeros((), jnp.int32))

  def update(updates, state, params=None, *, max_logits=None, **extra_args):
    del state, extra_args
    if params is None or max_logits is None:
      raise ValueError('qk_clip needs params and max_logits= (the model\'s aux["max_logits"]) in update')
    factors, clipped = clip_factors(params, max_logits, tau)
    for path, f in factors.items():
      p, u = _get(params, path), _get(updates, path)
      f = f.astype(jnp.float32)
      new_w = (p + u).astype(jnp.float32)
      rewritten = (new_w * f - p).astype(u.dtype)
      updates = _replace(updates, path, jnp.where(f != 1.0, rewritten, u))
    return updates, QKClipState(clipped)

  return accept_boxed(optax.GradientTransformationExtraArgs(init, update))  # model.init's params too


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def heads_clipped(opt_state) -> jax.Array | None:
  """The QKClipState.heads_clipped inside an optimizer state, or None when there is none."""
  found = [
    s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, QKClipState)) if isinstance(s, QKClipState)
  ]
  return found[0].heads_clipped if found else None
