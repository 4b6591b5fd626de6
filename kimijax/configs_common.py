"""Blocks that config files share (configs/*.py and the ablations' sizes in experiments/ablations/).

Each edits a config (or its model section) in place; a config file calls the ones it needs after
`kimijax.config.base_config()`. They live in the package, not in configs/, so that a config file
run by path from any working directory can import them.
"""

from __future__ import annotations

import ml_collections


def cpu_run(c: ml_collections.ConfigDict) -> None:
  """A 600-step byte-level run sized for a laptop CPU: float32 compute (XLA:CPU has no fast bf16
  matmul), batch 16 x 256 tokens, an eval every 100 steps, lr 3e-3 after 30 warmup steps."""
  c.model.compute_dtype = 'float32'
  c.train.steps = 600
  c.train.batch_size = 16
  c.train.seq_len = 256
  c.train.eval_every = 100
  c.train.checkpoint_every = 200
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 30


def gpu_kernels(m: ml_collections.ConfigDict, attn_impl: str = 'gpu') -> None:
  """bf16 compute and the GPU implementations: attention `attn_impl` ('gpu': per call the faster of
  cuDNN and tokamax), the fused Pallas KDA and short-convolution kernels and the MLA decode kernel
  (read only with MLA layers), and the Mosaic GPU grouped-matmul kernels for MoE layers (a Hopper GPU)."""
  m.compute_dtype = 'bfloat16'
  m.attn_impl = attn_impl
  m.kda_impl = 'pallas'
  m.short_conv_impl = 'pallas'
  m.mla_decode_impl = 'pallas'
  m.moe.impl = 'mosaic'


def gpu_data(c: ml_collections.ConfigDict) -> None:
  """The research runs' data on a GPU: the Python source of every installed package (deduplicated,
  kimijax/data/site_packages.py) and 16 eval batches."""
  c.data.source = 'site_packages'
  c.train.eval_batches = 16
