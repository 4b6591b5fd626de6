"""Scaling ladders for experiments/scaling_ladder.py: model sizes tied by a stated rule, crossed with
variants.

    python -m experiments.scaling_ladder --config=configs/ladder.py:smoke --workdir=runs/ladder_smoke
    python -m experiments.scaling_ladder --config=configs/ladder.py:gpu --workdir=runs/ladder_gpu --variants=adamw
    python -m experiments.scaling_ladder --config=configs/ladder.py:gpu_attnres --workdir=runs/ladder_attnres

Ladders (NAME):
  smoke        3 rungs x {adamw, muon}, CPU; 10 min on the shared 2-core CPU (byte-level stdlib corpus)
  gpu          5 rungs x {adamw, muon} on one H200, bf16 + tokamax attention, the site-packages corpus
  gpu_attnres  the gpu rungs x {standard, block AttnRes (one block per layer, the Pallas kernels)};
               standard = gpu's adamw rungs (copy runs/ladder_gpu/adamw to DIR/standard to reuse them)
  gpu_hybrid   the gpu rungs x {all attention, 3:1 KDA:attention}; KDA runs the fused Pallas kernels
               (0.71x fla's forward+backward time on the H200 at (8, 4096, 16, 128)); the 10 rungs
               took 18.7 min of wall time on one H200, the hybrid 1.63x [0.90, 3.29] attention's
               compute at the largest rungs' loss (experiments/results/ladder_hybrid.md);
               depth 4 * ceil(d / 256) so that every rung holds whole 'KKKA' groups

Rule for every ladder: width d sets the rest. Depth = d / 64 layers (smoke: d / 16), heads = d / 64
(head dim 64; smoke: 16), SwiGLU width 3 d, byte vocabulary 258 (tied embeddings). Tokens per
rung = tokens_per_param x N, with N the baseline variant's total parameter count, so every variant
of a rung sees the same tokens; steps = ceil(tokens / (batch x seq_len)). Learning rate per rung:
lr(d) = lr_256 * sqrt(256 / d) (lr_256 = 3e-3, the CPU default's tuned lr at d = 256), warmup 5%
of the steps, cosine to 10%. Muon uses the same lr (Moonlight's update-RMS matching, SPEC §2).
Batch per rung is in its entry. Nothing here is tuned per variant.
"""

import math

import ml_collections

from kimijax.config import base_config

LR_256 = 3e-3


def rung(d: int, *, head_dim: int, depth_per_width: int, batch_size: int) -> dict:
  """One rung by the rule in the module docstring."""
  return {'name': f'd{d}', 'd_model': d, 'num_layers': d // depth_per_width, 'num_heads': d // head_dim,
          'mlp_dim': 3 * d, 'learning_rate': round(LR_256 * math.sqrt(256 / d), 6), 'batch_size': batch_size}


def _smoke(c: ml_collections.ConfigDict) -> None:
  b = c.base
  b.model.compute_dtype = 'float32'     # XLA:CPU has no fast bf16 matmul
  b.train.seq_len = 128
  b.train.eval_batches = 4
  c.tokens_per_param = 3.0
  c.rungs = [rung(32, head_dim=16, depth_per_width=16, batch_size=8),
             rung(48, head_dim=16, depth_per_width=16, batch_size=8),
             rung(64, head_dim=16, depth_per_width=16, batch_size=16)]
  c.variants = {'adamw': (('optimizer.name', 'adamw'),), 'muon': (('optimizer.name', 'muon'),)}
  c.baseline = 'adamw'
  c.expected = ('6 runs, 10 min on the shared 2-core CPU (2026-12-01; most of it the d64 rungs); '
                'muon below adamw at every rung (experiments/results/ladder_smoke.md)')


def _gpu(c: ml_collections.ConfigDict) -> None:
  b = c.base
  b.model.compute_dtype = 'bfloat16'    # as configs/bench_350m.py: bf16 matmuls, tokamax attention
  b.model.attn_impl = 'tokamax'
  b.model.kda_impl = 'pallas'           # the fused KDA kernels (kernels_pallas/kda)
  b.model.short_conv_impl = 'pallas'    # and the fused short convs (kernels_pallas/short_conv)
  b.model.residual_dtype = 'float32'    # small models: keep the residual stream exact
  b.train.seq_len = 1024
  b.train.eval_batches = 16
  b.data.source = 'site_packages'       # the Python source of every installed package, deduplicated
  c.tokens_per_param = 20.0             # Chinchilla-like, close to Moonlight's ~22
  c.rungs = [rung(128, head_dim=64, depth_per_width=64, batch_size=16),
             rung(192, head_dim=64, depth_per_width=64, batch_size=32),
             rung(256, head_dim=64, depth_per_width=64, batch_size=64),
             rung(320, head_dim=64, depth_per_width=64, batch_size=64),
             rung(384, head_dim=64, depth_per_width=64, batch_size=128)]
  c.expected = ('per variant ~475M tokens over 0.46M-11.6M parameters; adamw 6.7 and muon 7.0 min of '
                'rung wall time on one H200 (39-155 s per rung, compilation included; 2026-12-02), i.e. '
                'one or two 10-minute calls each; muon 2.19x adamw\'s compute efficiency at the top '
                'rung\'s loss (experiments/results/ladder_gpu.md)')


def get_config(name: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = name or 'smoke'
  c.base = base_config()
  c.base.train.log_every = 10
  c.base.train.plot = True
  c.rule = ('depth = d/64, heads = d/64 (smoke: d/16), SwiGLU 3d, byte vocab, tied; tokens = '
            'tokens_per_param x N(baseline); lr = 3e-3 sqrt(256/d), warmup 5%, cosine to 10%')
  if c.name == 'smoke':
    _smoke(c)
  elif c.name in ('gpu', 'gpu_attnres', 'gpu_hybrid'):
    _gpu(c)
    if c.name == 'gpu':
      c.variants = {'adamw': (('optimizer.name', 'adamw'),), 'muon': (('optimizer.name', 'muon'),)}
      c.baseline = 'adamw'
    elif c.name == 'gpu_attnres':
      c.variants = {'standard': (('model.residual', 'standard'),),
                    'block': (('model.residual', 'attnres_block'), ('model.attnres_block_size', 2),
                              ('model.attnres_impl', 'pallas'))}
      c.baseline = 'standard'
      c.expected = ("block 6.2 min of rung wall time on one H200 (34-160 s per rung, 2026-12-02); standard's "
                    "rungs are the gpu ladder's adamw rungs (the same configs); block's compute multiplier "
                    '0.54x-1.38x across the rungs, inside the noise (experiments/results/ladder_attnres.md)')
    else:   # the pattern tiles over the layers: 4 layers per 'KKKA', so depth 4 * ceil((d / 64) / 4)
      for r in c.rungs:
        r['num_layers'] = 4 * math.ceil(r['num_layers'] / 4)
      c.variants = {'attention': (('model.layer_pattern', 'A'),),
                    'hybrid_3to1': (('model.layer_pattern', '3:1'),)}
      c.baseline = 'attention'
  else:
    raise ValueError(f"configs/ladder.py: unknown ladder {name!r}; allowed: 'smoke', 'gpu', "
                     "'gpu_attnres', 'gpu_hybrid'")
  return c
