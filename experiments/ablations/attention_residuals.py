"""Attention Residuals ablations (docs/attention_residuals.md): standard, Full, Block with S = 2 / 4 / 8 / 16 sublayers,
and Full without the key RMSNorm and with sigmoid instead of softmax over depth.

    python -m experiments.ablations.attention_residuals --scale=cpu --workdir=runs/abl_attnres --seeds=2
    python -m experiments.ablations.attention_residuals --scale=gpu --workdir=runs/abl_attnres_gpu \\
        --seeds=2 --publish=experiments/results/ablation_attention_residuals_gpu
    python -m experiments.ablations.attention_residuals --scale=gpu --workdir=runs/abl_attnres_gpu \\
        --seeds=2 --arms=full,no_key_norm,sigmoid      # a subset per call; runs resume and are reused

8 layers = 16 sublayers, so S = 2, 4, 8, 16 give 8, 4, 2, 1 blocks. The paper's 436M-model table
(val loss): baseline 1.766, Full 1.737, Block S=2 1.746, S=4 1.746, S=8 1.748, S=16 1.753; on Full,
no key RMSNorm 1.743 (model.attnres_key_norm=False: logits w . v_i on the raw sources, no norm and no
gain) and sigmoid instead of softmax 1.741 (model.attnres_depth_weights='sigmoid': each source
weighed by sigmoid(w . RMSNorm(v_i)), no normalisation over depth); kimijax/ops/attnres.py has the
maths. The Full arms (full, no_key_norm, sigmoid) run on the XLA path: the fused Pallas kernels
implement docs/attention_residuals.md's softmax over RMS-normalised keys only, and
compile a kernel set per source count.
Expected runtime: cpu, 8 arms x 2 seeds of a 0.4M model, 300 steps. With --seeds=1 the 8 runs
took 40 min on the shared 2-core CPU (2026-12-01): 2-4 min for standard and each Block arm, 4-6 min
for no_key_norm and sigmoid, 15 min for Full (the CPU busy with tests meanwhile); so about 1.3 h
for both seeds (--arms splits it). gpu (estimates, not measured): 8 arms x 2 seeds,
~25M parameters, 1500 steps of 16 x 1024 tokens, bf16, the Pallas AttnRes kernels for the Block arms
(XLA for the Full arms): ~2-3 min per run, ~40-50 min on one H200, i.e. several --arms calls.
"""

from experiments.ablations import common


def block(s: int) -> dict:
  return {'model.residual': 'attnres_block', 'model.attnres_block_size': s}


# Full AttnRes on the XLA path (the gpu base selects the Pallas kernels, which the ablated
# variants do not have); the paper ablates both switches on Full.
FULL = {'model.residual': 'attnres_full', 'model.attnres_impl': 'xla'}

ARMS = [
  common.Arm('standard', {}, 'val loss 1.766'),
  common.Arm('full', FULL, '1.737'),
  common.Arm('block2', block(2), '1.746'),
  common.Arm('block4', block(4), '1.746'),
  common.Arm('block8', block(8), '1.748'),
  common.Arm('block16', block(16), '1.753'),
  common.Arm('no_key_norm', {**FULL, 'model.attnres_key_norm': False}, '1.743'),
  common.Arm('sigmoid', {**FULL, 'model.attnres_depth_weights': 'sigmoid'}, '1.741'),
]
SOURCE = 'AttnRes 436M ablation (val loss)'
CLAIMS = [
  common.Claim('full', '<', 'standard', source=SOURCE),
  common.Claim('block4', '<', 'standard', source=SOURCE),
  common.Claim('block8', '<', 'standard', source=SOURCE),
  common.Claim('full', '<', 'block8', source=SOURCE),
  common.Claim('block2', '<', 'block16', source=SOURCE),
  common.Claim('block4', '=', 'block2', source='AttnRes (1.746 = 1.746)'),
  common.Claim('full', '<', 'no_key_norm', source=SOURCE),
  common.Claim('full', '<', 'sigmoid', source=SOURCE),
  common.Claim('no_key_norm', '<', 'standard', source=SOURCE),
  common.Claim('sigmoid', '<', 'standard', source=SOURCE),
]


def base(scale: str):
  from kimijax.config import load

  config = load('configs/default.py')
  if scale == 'cpu':
    return common.sized(config, scale, d_model=64, num_layers=8, num_heads=4, seq_len=128, batch_size=8, steps=300)
  return common.sized(
    config,
    scale,
    d_model=512,
    num_layers=8,
    num_heads=8,
    seq_len=1024,
    batch_size=16,
    steps=1500,
    model__attnres_impl='pallas',
    optimizer__learning_rate=2e-3,
  )


if __name__ == '__main__':
  common.script('Attention Residuals ablations', base, ARMS, CLAIMS, __doc__, 'runs/ablation_attention_residuals')
