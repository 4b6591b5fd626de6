"""Muon against published conventions: Moonlight's bf16 Newton-Schulz (PyTorch arithmetic,
emulated in NumPy), float64 iterations, and the DeepSeek-V3 fused MLA matrices."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kimijax.optim.muon import NS_COEFFS, newton_schulz

BF16 = ml_dtypes.bfloat16


def _bf16(x):
  """Round to bfloat16 (nearest even), back to float32: what a PyTorch bf16 op stores."""
  return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def ns_float64(x, steps=5):
  """The Newton-Schulz iteration in float64 (the reference), on x / (||x||_F + 1e-7)."""
  a, b, c = NS_COEFFS
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + 1e-7)
  for _ in range(steps):
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x.T if tall else x


def ns_moonlight_bf16(x, steps=5):
  """Moonlight's bf16 iteration with PyTorch's arithmetic: every op's result is rounded to bf16,
  matmuls accumulate in float32, Python-float coefficients stay at full precision. Starts from
  the same rounded normalised input as kimijax (normalised in high precision)."""
  a, b, c = NS_COEFFS
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = _bf16(x / (np.linalg.norm(x) + 1e-7))
  for _ in range(steps):
    g = _bf16(x @ x.T)
    poly = _bf16(_bf16(b * g) + _bf16(c * _bf16(g @ g)))
    x = _bf16(_bf16(a * x) + _bf16(poly @ x))
  return x.T if tall else x


def _gradient_like(rng, shape):
  """A random matrix with a decaying spectrum, as gradients have."""
  a, b = shape
  u = rng.standard_normal((a, min(a, b)))
  v = rng.standard_normal((min(a, b), b))
  return (u * (1.0 / (1.0 + np.arange(min(a, b))))) @ v + 0.05 * rng.standard_normal(shape)


@pytest.mark.parametrize('shape', [(64, 192), (192, 64), (96, 96)])
def test_bf16_newton_schulz_is_at_least_as_accurate_as_moonlight(shape):
  """Against a float64 iteration, kimijax's bf16 Newton-Schulz errs no more than PyTorch's bf16
  iteration (Moonlight) does. With the coefficients rounded to bf16 (3.4375, -4.78125, 2.03125)
  and bf16 sums, the error was 1.3-2.5x Moonlight's."""
  rng = np.random.default_rng(0)
  ours, theirs = [], []
  for _ in range(4):
    x = _gradient_like(rng, shape)
    want = ns_float64(x)
    got = np.asarray(newton_schulz(jnp.asarray(x[None], jnp.float32), 5, jnp.bfloat16)[0], np.float64)
    ours.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    theirs.append(np.linalg.norm(ns_moonlight_bf16(x) - want) / np.linalg.norm(want))
  assert np.mean(ours) <= np.mean(theirs), (ours, theirs)


def test_bf16_newton_schulz_coefficients_are_not_rounded():
  """The jaxpr of the bf16 iteration holds the float32 coefficients, not bf16-rounded ones."""
  import jax

  jaxpr = str(jax.make_jaxpr(lambda x: newton_schulz(x, 1, jnp.bfloat16))(jnp.ones((1, 4, 8))))
  assert '3.4375' not in jaxpr and '4.78125' not in jaxpr


# ----------------------------------------------------------------------------- MLA matrices

H, DN, DR, DV, R, QIN, D = 4, 16, 8, 12, 24, 40, 48
MLA_SHAPES = {
  'q_nope': (QIN, H, DN),
  'q_rope': (QIN, H, DR),
  'kv_down': (D, R),
  'k_rope': (D, DR),
  'k_nope': (R, H, DN),
  'v': (R, H, DV),
  'out': (H, DV, D),
}


def to_deepseek(p):
  """kimijax's MLA parts -> DeepSeek-V3's Linear weights as [in, out] matrices, with DeepSeek's
  column order: per head [nope, rope] (q_b_proj) and [k_nope, v] (kv_b_proj); [latent, rope] for
  kv_a_proj_with_mqa."""
  return {
    'q_b_proj': np.concatenate([p['q_nope'], p['q_rope']], -1).reshape(QIN, -1),
    'kv_a_proj_with_mqa': np.concatenate([p['kv_down'], p['k_rope']], -1),
    'kv_b_proj': np.concatenate([p['k_nope'], p['v']], -1).reshape(R, -1),
    'o_proj': p['out'].reshape(H * DV, D),
  }


def np_muon_step(w, m, g, lr, *, mu=0.95, wd=0.1):
  """Moonlight's Muon on one matrix, float64: M = mu M + G, N = G + mu M, NS5, lr (0.2 sqrt(max) O + wd W)."""
  m = mu * m + g
  o = ns_float64(g + mu * m)
  return w - lr * (0.2 * np.sqrt(max(w.shape)) * o + wd * w), m


def _muon_run(params, grads_seq, lr, **kwargs):
  import jax

  from kimijax.optim import muon

  opt = muon(lr, weight_decay=0.1, ns_dtype=jnp.float32, **kwargs)
  p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  state = opt.init(p)
  for g in grads_seq:
    updates, state = jax.jit(opt.update)(jax.tree.map(jnp.asarray, g), state, p)
    p = jax.tree.map(lambda a, u: a + u, p, updates)
  return {k: np.asarray(v, np.float64) for k, v in p['mla'].items()}


def _random_mla(rng, scale=1.0):
  return {k: scale * rng.standard_normal(s).astype(np.float32) for k, s in MLA_SHAPES.items()}


def test_muon_on_mla_orthogonalises_deepseek_v3_fused_matrices():
  """Default: 6 Muon steps on MLA's parts equal float64 Moonlight Muon on the DeepSeek-V3 weights
  q_b_proj, kv_a_proj_with_mqa, kv_b_proj (one matrix each) and o_proj, mapped back."""
  rng = np.random.default_rng(3)
  steps, lr = 6, 0.02
  params = {'mla': _random_mla(rng, 0.1)}
  grads_seq = [{'mla': _random_mla(rng)} for _ in range(steps)]
  got = to_deepseek(_muon_run(params, grads_seq, lr))
  ref = {k: w.astype(np.float64) for k, w in to_deepseek(params['mla']).items()}
  mom = {k: np.zeros_like(w) for k, w in ref.items()}
  for g in grads_seq:
    for k, gk in to_deepseek({n: a.astype(np.float64) for n, a in g['mla'].items()}).items():
      ref[k], mom[k] = np_muon_step(ref[k], mom[k], gk, lr)
  w0 = to_deepseek({k: v.astype(np.float64) for k, v in params['mla'].items()})
  for k in ref:
    err = np.linalg.norm((got[k] - w0[k]) - (ref[k] - w0[k])) / np.linalg.norm(ref[k] - w0[k])
    assert err <= 1e-5, (k, err)


def test_muon_on_mla_per_part_option():
  """mla_views='per_part': each part is its own matrix (float64 Muon per part), which differs
  from the fused update."""
  rng = np.random.default_rng(4)
  steps, lr = 3, 0.02
  params = {'mla': _random_mla(rng, 0.1)}
  grads_seq = [{'mla': _random_mla(rng)} for _ in range(steps)]
  got = _muon_run(params, grads_seq, lr, mla_views='per_part')
  fused = _muon_run(params, grads_seq, lr)
  as_matrix = lambda k, a: a.reshape(a.shape[0] * a.shape[1], -1) if k == 'out' else a.reshape(a.shape[0], -1)
  for k, w0 in params['mla'].items():
    w, m = as_matrix(k, w0.astype(np.float64)), 0.0
    for g in grads_seq:
      w, m = np_muon_step(w, m, as_matrix(k, g['mla'][k].astype(np.float64)), lr)
    delta, want = as_matrix(k, got[k]) - as_matrix(k, w0), w - as_matrix(k, w0)
    assert np.linalg.norm(delta - want) / np.linalg.norm(want) <= 1e-5, k
  assert np.linalg.norm(fused['v'] - got['v']) > 1e-3 * np.linalg.norm(got['v'] - params['mla']['v'])


def test_routing_table_shows_fused_and_per_part_views():
  import jax

  from kimijax.optim.routing import Routing

  shapes = {'mla': {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in MLA_SHAPES.items()}}
  fused = Routing().table(shapes)
  assert f'[{R}, {H}*{DN}+{H}*{DV}]' in fused and 'kv_b_proj = k_nope + v' in fused
  assert f'[{D}, {DR}+{R}]' in fused and 'q_b_proj = q_nope + q_rope' in fused
  per_part = Routing(mla_views='per_part').table(shapes)
  assert 'kv_b_proj' not in per_part and f'[{R}, {H}*{DV}]' in per_part


def test_adamw_side_is_plain_adamw_with_nesterov_on():
  """With nesterov=True (Muon's default) the AdamW side stays AdamW (Moonlight), not NAdam as
  optax.adamw(nesterov=True) would make it: 4 steps against a float64 AdamW transcription."""
  import jax
  import optax

  from kimijax.optim import muon

  rng = np.random.default_rng(6)
  w0 = rng.standard_normal((7,)).astype(np.float32)
  grads = [rng.standard_normal((7,)).astype(np.float32) for _ in range(4)]
  lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.1

  def run(opt):
    p, state = {'gain': jnp.asarray(w0)}, None
    state = opt.init(p)
    for g in grads:
      u, state = opt.update({'gain': jnp.asarray(g)}, state, p)
      p = jax.tree.map(lambda a, b: a + b, p, u)
    return np.asarray(p['gain'], np.float64)

  w, m, v = w0.astype(np.float64), 0.0, 0.0
  for t, g in enumerate(grads, 1):
    g = g.astype(np.float64)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    w = w - lr * ((m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * w)
  ours = run(muon(lr, nesterov=True, weight_decay=wd, adam_b1=b1, adam_b2=b2, adam_eps=eps))
  nadam = run(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, nesterov=True))
  np.testing.assert_allclose(ours - w0, w - w0, rtol=1e-4, atol=1e-6)
  assert np.abs(nadam - w).max() > 1e-4  # optax's Nesterov AdamW is another optimizer


def test_config_key_muon_mla_views_is_validated_and_reaches_the_routing():
  from kimijax.config import ConfigError, base_config, validate
  from kimijax.optim.factory import routing

  c = base_config()
  c.optimizer.name = 'muon'
  assert routing(c).mla_views == 'fused'
  c.optimizer.muon_mla_views = 'per_part'
  assert routing(validate(c)).mla_views == 'per_part'
  c.optimizer.muon_mla_views = 'split'
  with pytest.raises(ConfigError, match=r"optimizer\.muon_mla_views='split' is not allowed"):
    validate(c)
