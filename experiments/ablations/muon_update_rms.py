"""Moonlight's update-RMS sweep (docs/optimizers.md#muon): Muon with rms_scale 0.05 ... 0.8 against AdamW.

    python -m experiments.ablations.muon_update_rms --scale=cpu --workdir=runs/abl_muon_rms --seeds=2
    python -m experiments.ablations.muon_update_rms --scale=gpu --workdir=runs/abl_muon_rms_gpu \\
        --seeds=2 --publish=experiments/results/ablation_muon_update_rms_gpu

Same lr, weight decay and schedule for every arm (Moonlight keeps AdamW's and matches the update
RMS through rms_scale = 0.2 sqrt(max(A, B)) scaling). Published validation loss (~2B tokens): AdamW
3.679; 0.05 -> 3.503; 0.1 -> 3.374; 0.2 -> 3.325; 0.4 -> 3.314; 0.8 -> 3.543: every scale beats
AdamW, the optimum lies at 0.2-0.4, and both ends are worse.
Expected runtime: cpu, 6 arms x 2 seeds of configs/default.py shrunk to d=128, 2 layers, 200 steps:
about 18 min on the 2-core CPU (measured 2026-12-01). gpu: 6 arms x 2 seeds of a ~25M model,
1500 steps of 16 x 1024 tokens: ~1.5 min per run, ~20 min on one H200 (estimate).
"""

from experiments.ablations import common

SCALES = (0.05, 0.1, 0.2, 0.4, 0.8)
PUBLISHED = {0.05: '3.503', 0.1: '3.374', 0.2: '3.325', 0.4: '3.314', 0.8: '3.543'}
ARMS = [common.Arm('adamw', {'optimizer.name': 'adamw'}, 'val loss 3.679')] + [
  common.Arm(f'muon_rms{s:g}', {'optimizer.name': 'muon', 'optimizer.rms_scale': s}, PUBLISHED[s]) for s in SCALES
]
SOURCE = 'Moonlight update-RMS sweep (val loss)'
CLAIMS = [common.Claim(f'muon_rms{s:g}', '<', 'adamw', source=SOURCE) for s in SCALES] + [
  common.Claim('muon_rms0.2', '<', 'muon_rms0.05', source=SOURCE),
  common.Claim('muon_rms0.4', '<', 'muon_rms0.8', source=SOURCE),
]


def base(scale: str):
  from kimijax.config import load

  config = load('configs/default.py')
  if scale == 'cpu':
    return common.sized(config, scale, d_model=128, num_layers=2, num_heads=2, seq_len=128, batch_size=16, steps=200)
  return common.sized(
    config,
    scale,
    d_model=512,
    num_layers=8,
    num_heads=8,
    seq_len=1024,
    batch_size=16,
    steps=1500,
    optimizer__learning_rate=2e-3,
  )


if __name__ == '__main__':
  common.script('Muon update-RMS sweep against AdamW', base, ARMS, CLAIMS, __doc__, 'runs/ablation_muon_update_rms')
