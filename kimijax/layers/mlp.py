"""SwiGLU feed-forward block."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.layers.params import weight


class SwiGLU(nn.Module):
  """y = W_out (silu(W_gate x) * (W_up x)); x [B, T, D] -> [B, T, D]."""

  hidden: int
  init_std: float
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_btd):
    d = x_btd.shape[-1]
    w_gate = weight(self, 'wi_gate', (d, self.hidden), ('embed', 'mlp'))
    w_up = weight(self, 'wi_up', (d, self.hidden), ('embed', 'mlp'))
    w_out = weight(self, 'wo', (self.hidden, d), ('mlp', 'embed'))
    # gate and up in one GEMM of twice the output width
    gate_up = jnp.einsum('btd,dsf->btsf', x_btd.astype(self.dtype), jnp.stack([w_gate, w_up], axis=1))
    h_btf = nn.with_logical_constraint(
      jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], ('act_batch', 'act_length', 'act_mlp')
    )
    return jnp.einsum('btf,fd->btd', h_btf, w_out)
