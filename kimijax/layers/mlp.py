"""SwiGLU feed-forward block."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class SwiGLU(nn.Module):
  """y = W_out (silu(W_gate x) * (W_up x)); x [B, T, D] -> [B, T, D]."""
  hidden: int
  init_std: float
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_btd):
    d = x_btd.shape[-1]
    init = nn.initializers.normal(self.init_std)
    dense = lambda feats, names, name: nn.Dense(
        feats, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32, name=name,
        kernel_init=nn.with_logical_partitioning(init, names))
    gate = dense(self.hidden, ('embed', 'mlp'), 'wi_gate')(x_btd)
    up = dense(self.hidden, ('embed', 'mlp'), 'wi_up')(x_btd)
    h_btf = nn.with_logical_constraint(jax.nn.silu(gate) * up, ('act_batch', 'act_length', 'act_mlp'))
    return dense(d, ('mlp', 'embed'), 'wo')(h_btf)
