"""SwiGLU feed-forward block."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.layers.params import project, weight


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
    gate_btf, up_btf = project(x_btd.astype(self.dtype), w_gate, w_up)
    h_btf = nn.with_logical_constraint(jax.nn.silu(gate_btf) * up_btf, ('act_batch', 'act_length', 'act_mlp'))
    return jnp.einsum('btf,fd->btd', h_btf, w_out)
