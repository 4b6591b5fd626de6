"""kimijax.train.flops against counts done by hand for a tiny model (d=64, 2 layers, 2 heads,
SwiGLU 128, byte vocabulary 258, T=64, batch 4)."""

import pytest

from kimijax.config import base_config
from kimijax.train import flops

D, L, H, F, V, T, B = 64, 2, 2, 128, 258, 64, 4


def tiny(**model):
  c = base_config()
  c.model.update(dict(d_model=D, num_layers=L, num_heads=H, mlp_dim=F, **model))
  c.train.seq_len, c.train.batch_size = T, B
  return c


# embedding + final norm + per layer (q, k, v, o; two norm gains; SwiGLU gate, up, down)
N_TIED = V * D + D + L * (4 * D * D + 2 * D + 3 * D * F)


def test_parameter_count_and_model_flops_of_a_tied_attention_model():
  c = tiny()
  counted = flops.training_flops_per_step(c)
  assert counted['params'] == N_TIED
  # 6 N, then per attention layer causal QK^T and PV: 3 T H (Dh + Dh), Dh = 32
  per_token = 6 * N_TIED + L * 3 * T * H * (32 + 32)
  assert counted['model'] == pytest.approx(per_token * B * T, rel=1e-12)
  assert counted['optimizer'] == 0.0 and counted['total'] == counted['model']


def test_an_untied_head_adds_parameters_but_its_embedding_lookup_adds_no_flops():
  c = tiny(tie_embeddings=False)
  counted = flops.training_flops_per_step(c)
  assert counted['params'] == N_TIED + D * V
  assert counted['model'] == pytest.approx((6 * N_TIED + L * 3 * T * H * 64) * B * T, rel=1e-12)


def test_mla_head_dims_and_kda_state_products():
  mla = tiny(attention_kind='mla', mla_qk_nope_head_dim=16, mla_qk_rope_head_dim=8)
  assert flops.model_flops_per_token(mla, 0) == L * 3 * T * H * ((16 + 8) + 16)
  kda = tiny(layer_pattern='K')  # 2 heads of key = value dim 32: 18 H K V per layer
  assert flops.model_flops_per_token(kda, 0) == L * 18 * H * 32 * 32
  hybrid = tiny(layer_pattern='KA')
  assert flops.model_flops_per_token(hybrid, 0) == 18 * H * 32 * 32 + 3 * T * H * 64


def test_muon_newton_schulz_flops_per_step():
  c = tiny()
  c.optimizer.name = 'muon'
  ns = c.optimizer.ns_steps
  square = ns * (4 * D**3 + 2 * D**3)  # q, k, v, o as [64, 64] matrices
  wide = ns * (4 * D * D * F + 2 * D**3)  # gate, up [64, 128] and down [128, 64]
  counted = flops.training_flops_per_step(c)
  assert counted['optimizer'] == pytest.approx(L * (4 * square + 3 * wide), rel=1e-12)
  assert counted['total'] == pytest.approx(counted['model'] + counted['optimizer'], rel=1e-12)


def test_moe_flops_count_the_active_parameters():
  """4 layers of which the first is dense (SwiGLU 128); the others route each token to 2 of 8
  experts of hidden 32, plus one shared expert of 32 and a router [64, 8]. FLOPs count the router,
  the 2 chosen experts and the shared one; the parameter count keeps every expert; Muon's
  Newton-Schulz runs on all 8 experts' matrices."""
  c = tiny(mlp_kind='moe')
  c.model.num_layers = 4
  c.model.moe.update(num_experts=8, top_k=2, num_shared=1, expert_hidden=32, first_dense_layers=1)
  f = 32
  attention_layers = V * D + D + 4 * (4 * D * D + 2 * D)
  dense_mlp = 3 * D * F
  moe_total = 3 * (D * 8 + 8 * 3 * D * f + 3 * D * f)
  moe_active = 3 * (D * 8 + 2 * 3 * D * f + 3 * D * f)
  counted = flops.training_flops_per_step(c)
  assert counted['params'] == attention_layers + dense_mlp + moe_total
  assert counted['active_params'] == attention_layers + dense_mlp + moe_active
  per_token = 6 * (attention_layers + dense_mlp + moe_active) + 4 * 3 * T * H * (32 + 32)
  assert counted['model'] == pytest.approx(per_token * B * T, rel=1e-12)
  assert flops.training_flops_per_step(tiny())['active_params'] == N_TIED  # dense: active = total

  c.optimizer.name = 'muon'
  ns = c.optimizer.ns_steps
  expert = ns * (4 * f * f * D + 2 * f**3)  # each [64, 32] / [32, 64] expert matrix: m = 32, n = 64
  router = ns * (4 * 8 * 8 * D + 2 * 8**3)  # [64, 8]
  shared = ns * (4 * f * f * D + 2 * f**3)
  attention = 4 * ns * (4 * D**3 + 2 * D**3)
  dense = 3 * ns * (4 * D * D * F + 2 * D**3)
  want = 4 * attention + dense + 3 * (8 * 3 * expert + router + 3 * shared)
  assert flops.training_flops_per_step(c)['optimizer'] == pytest.approx(want, rel=1e-12)
