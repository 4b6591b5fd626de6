"""Scaling ladders for experiments/scaling_ladder.py: model sizes tied by a stated rule, crossed with
variants.

    python -m experiments.scaling_ladder --config=configs/ladder.py:smoke --workdir=runs/ladder_smoke
    python -m experiments.scaling_ladder --config=configs/ladder.py:gpu --workdir=runs/ladder_gpu --variants=adamw

Ladders (the file's variants, one at a time, always named: --config=configs/ladder.py alone is an
error listing them; each with its expected result and its results file):
  smoke        3 rungs x {adamw, muon}, CPU, the byte-level stdlib corpus: 6 runs in 2.5 to 10 min
               on a 2-core CPU (the longer with other jobs beside them), muon below adamw at every
               rung (experiments/results/ladder_smoke.md)
  gpu          5 rungs x {adamw, muon} on one H200, bf16 + tokamax attention, the site-packages corpus:
               about 7 min of rung wall time per variant, muon about 2x adamw's compute efficiency
               at the top rung's loss (experiments/results/ladder_gpu.md)
  gpu_attnres  the gpu rungs x {standard, block AttnRes (one block per layer, the Pallas kernels)};
               standard = gpu's adamw rungs (copy runs/ladder_gpu/adamw to DIR/standard to reuse
               them); block's compute multiplier inside the noise (experiments/results/ladder_attnres.md)
  gpu_hybrid   the gpu rungs x {all attention, 3:1 KDA:attention}, KDA on the fused Pallas kernels;
               depth 4 * ceil(d / 256) so that every rung holds whole 'KKKA' groups; about 20 min
               on one H200 (experiments/results/ladder_hybrid.md)
  smoke_moe    the smoke rungs x {dense, moe}, both with Muon, the moe arm of gpu_moe (MOE_ARM) on the
               'xla_blocked' grouped matmul (XLA:CPU runs lax.ragged_dot many times slower): 6 runs
               in about 3.5 min on a 2-core CPU with other jobs beside them; moe's eval loss beside
               dense's at every rung (the same tokens and active parameters), its compute
               multiplier on model FLOPs (the verdict's) near 1 and on model + optimizer FLOPs
               below 1, Muon's Newton-Schulz on all 16 experts being a large share of that C at
               these widths (experiments/results/ladder_smoke_moe.md)
  gpu_moe      the gpu rungs x {dense, moe}, both with Muon: every MLP a Mixture-of-Experts of 16
               routed experts, top-2, + 1 shared, expert hidden d (so a token's 3 experts are as
               wide as the dense SwiGLU's 3 d), sigmoid routing renormalised and scaled by 2.446
               (the released factor), the bias update at its default 1e-3, no balance loss, the
               'mosaic' grouped matmul (ladder_moe.md's runs used 'xla_blocked': the same maths,
               slower). Run both arms in one workdir: the site-packages corpus
               is whatever the machine has installed, so rungs trained on another machine or day
               (runs/ladder_gpu/muon) need not have seen the same data. 5.4 min of rung wall time
               for dense and 8.8 min for moe on one H100, over calls of --time_budget_s=540 that
               resume; moe's eval loss below dense's at every rung, its compute multiplier 1.55x
               at the top rung's loss, inside the noise (experiments/results/ladder_moe.md)

Rule for every ladder: width d sets the rest. Depth = d / 64 layers (smoke: d / 16), heads = d / 64
(head dim 64; smoke: 16), SwiGLU width 3 d, byte vocabulary 258 (tied embeddings). Tokens per
rung = tokens_per_param x N, with N the baseline variant's active parameter count (its total
for a dense model), so every variant of a rung sees the same tokens; steps = ceil(tokens /
(batch x seq_len)). MoE (smoke_moe, gpu_moe): rungs are matched on active parameters (the two
arms of a rung differ only by the routers' 16 d per layer, about 1.2 / d of a layer's
parameters: 2-4% in smoke_moe, 0.3-1% in gpu_moe), tokens are per active parameter, and the
model's compute is counted on active parameters (kimijax/train/flops.py), so the arms of a rung
have nearly the same model FLOPs; Muon's Newton-Schulz runs on every expert, active or not: ~d^3
per expert matrix per step against the model's ~d^2 per token, the most where a step holds few
tokens (smoke_moe's 1-2k). The moe arm's MLPs hold 17 / 3 = 5.7x their active parameters. Learning
rate per rung: lr(d) = lr_256 * sqrt(256 / d) (lr_256 = 3e-3, the CPU default's tuned lr at
d = 256), warmup 5% of the steps, cosine to 10%. Muon uses the same lr (Moonlight's update-RMS
matching, docs/optimizers.md#muon). Batch per rung is in its entry. Nothing here is tuned per
variant.

Compute C (kimijax/train/flops.py, docs/scaling_ladders.md#compute) is counted two ways: model
FLOPs (6 N_active + attention + KDA state products per token, forward and backward) and model +
optimizer FLOPs (adding Muon's Newton-Schulz per step; AdamW adds none). The report fits both
and gives both multipliers; its verdict reads the one on model FLOPs, the count of the Moonlight,
Kimi Linear and Attention Residuals reports whose multipliers ours are set beside.
"""

import math

import ml_collections

from kimijax import configs_common
from kimijax.config import ConfigError, apply_variants, base_config

LR_256 = 3e-3
OPTIMIZERS = {'adamw': (('optimizer.name', 'adamw'),), 'muon': (('optimizer.name', 'muon'),)}


def rung(d: int, *, head_dim: int, depth_per_width: int, batch_size: int) -> dict:
  """One rung by the rule in the module docstring."""
  return {
    'name': f'd{d}',
    'd_model': d,
    'num_layers': d // depth_per_width,
    'num_heads': d // head_dim,
    'mlp_dim': 3 * d,
    'learning_rate': round(LR_256 * math.sqrt(256 / d), 6),
    'batch_size': batch_size,
  }


def _smoke(c: ml_collections.ConfigDict) -> None:
  b = c.base
  b.model.compute_dtype = 'float32'  # XLA:CPU has no fast bf16 matmul
  b.train.seq_len = 128
  b.train.eval_batches = 4
  c.tokens_per_param = 3.0
  c.rungs = [
    rung(32, head_dim=16, depth_per_width=16, batch_size=8),
    rung(48, head_dim=16, depth_per_width=16, batch_size=8),
    rung(64, head_dim=16, depth_per_width=16, batch_size=16),
  ]
  c.variants = OPTIMIZERS
  c.baseline = 'adamw'


def _gpu(c: ml_collections.ConfigDict) -> None:
  b = c.base
  configs_common.gpu_kernels(b.model, attn_impl='tokamax')  # as configs/bench_350m.py, tokamax attention
  b.model.residual_dtype = 'float32'  # small models: keep the residual stream exact
  b.train.seq_len = 1024
  configs_common.gpu_data(b)
  c.tokens_per_param = 20.0  # Chinchilla-like, close to Moonlight's ~22
  c.rungs = [
    rung(128, head_dim=64, depth_per_width=64, batch_size=16),
    rung(192, head_dim=64, depth_per_width=64, batch_size=32),
    rung(256, head_dim=64, depth_per_width=64, batch_size=64),
    rung(320, head_dim=64, depth_per_width=64, batch_size=64),
    rung(384, head_dim=64, depth_per_width=64, batch_size=128),
  ]
  c.variants = OPTIMIZERS
  c.baseline = 'adamw'


def _gpu_attnres(c: ml_collections.ConfigDict) -> None:
  _gpu(c)
  c.variants = {
    'standard': (('model.residual', 'standard'),),
    'block': (('model.residual', 'attnres_block'), ('model.attnres_block_size', 2), ('model.attnres_impl', 'pallas')),
  }
  c.baseline = 'standard'


def _gpu_hybrid(c: ml_collections.ConfigDict) -> None:
  _gpu(c)
  for r in c.rungs:  # the pattern tiles over the layers: 4 layers per 'KKKA', so depth 4 * ceil((d / 64) / 4)
    r['num_layers'] = 4 * math.ceil(r['num_layers'] / 4)
  c.variants = {'attention': (('model.layer_pattern', 'A'),), 'hybrid_3to1': (('model.layer_pattern', '3:1'),)}
  c.baseline = 'attention'


# The moe arm of gpu_moe and smoke_moe: every MLP (no dense first layer: the rungs have 2-6 layers,
# a dense first one would be a third to half of them) 16 routed experts top-2 + 1 shared of hidden
# mlp_dim // 3 = d, sigmoid routing renormalised and scaled by Moonlight's and Kimi Linear's 2.446,
# the bias update at its default rate, no balance loss. The grouped matmul is the ladder's base
# model.moe.impl.
MOE_ARM = (
  ('model.mlp_kind', 'moe'),
  ('model.moe.num_experts', 16),
  ('model.moe.top_k', 2),
  ('model.moe.num_shared', 1),
  ('model.moe.expert_hidden', 0),  # mlp_dim // (top_k + num_shared) = d
  ('model.moe.first_dense_layers', 0),
  ('model.moe.scaling_factor', 2.446),
)


def _dense_and_moe(c: ml_collections.ConfigDict) -> None:
  """{dense, moe}, both with Muon, on the ladder's rungs; baseline dense."""
  muon = OPTIMIZERS['muon']
  c.variants = {'dense': muon, 'moe': (*muon, *MOE_ARM)}
  c.baseline = 'dense'


def _smoke_moe(c: ml_collections.ConfigDict) -> None:
  _smoke(c)
  _dense_and_moe(c)


def _gpu_moe(c: ml_collections.ConfigDict) -> None:
  _gpu(c)
  _dense_and_moe(c)


VARIANTS = {
  'smoke': _smoke,
  'smoke_moe': _smoke_moe,
  'gpu': _gpu,
  'gpu_attnres': _gpu_attnres,
  'gpu_hybrid': _gpu_hybrid,
  'gpu_moe': _gpu_moe,
}


def get_config(name: str | None = None) -> ml_collections.ConfigDict:
  if not name:  # no default: the ladders differ in machine and hours (the docstring)
    raise ConfigError(f'give a ladder: --config=configs/ladder.py:NAME, NAME one of {", ".join(map(repr, VARIANTS))}')
  if ',' in name:
    raise ConfigError(f'{name!r}: give one ladder; allowed: {", ".join(map(repr, VARIANTS))}')
  c = ml_collections.ConfigDict()
  c.name = name
  c.base = base_config()
  c.base.train.log_every = 10
  c.base.train.plot = True
  c.rule = (
    'depth = d/64, heads = d/64 (smoke: d/16), SwiGLU 3d, byte vocab, tied; tokens = '
    'tokens_per_param x N(baseline, active); lr = 3e-3 sqrt(256/d), warmup 5%, cosine to 10%'
  )
  return apply_variants(c, VARIANTS, name)
