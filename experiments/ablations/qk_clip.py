"""QK-Clip (Kimi K2, docs/optimizers.md#qk-clip): max-logit trajectories and loss curves of Muon with and without the
clip, at a tau that binds at this size.

    python -m experiments.ablations.qk_clip --scale=cpu --workdir=runs/abl_qk_clip --seeds=2
    python -m experiments.ablations.qk_clip --scale=gpu --workdir=runs/abl_qk_clip_gpu --seeds=2 \\
        --publish=experiments/results/ablation_qk_clip_gpu

K2's tau = 100 never binds in small models (Muon's max logit stays near 10 on configs/default.py,
experiments/results/compare_optimizers.md), so tau here is 5 (cpu) / 10 (gpu), below the unclipped
run's peak, and the lr is high enough for logits to grow. The report's claims: with the clip the
max logit is capped at tau, and the loss curves with and without it coincide. The sweep's
loss_curves.png holds both trajectories (max-logit panel) and the loss curves.
Expected runtime: cpu, 2 arms x 2 seeds of configs/default.py (3.5M, 300 steps): about 10 min per
run, 40 min in all, on the 2-core CPU (measured 2026-12-01: 1.8-2.0 s per step, the machine
idle). gpu: 2 arms x 2 seeds of a 27M model, 1500 steps: 4.5 min on one H200 (measured 2026-12-02,
experiments/results/ablation_qk_clip_gpu.md).
"""

from experiments.ablations import common

ARMS = [
  common.Arm('muon', {'optimizer.name': 'muon'}, 'max logit > 1000 at 9B active (diverged)'),
  common.Arm('muonclip', {'optimizer.name': 'muonclip'}, 'capped at tau; same loss curve'),
]
CLAIMS = [
  common.Claim('muonclip', '<', 'muon', metric='max_logit_peak', source='K2: the clip caps the max logit'),
  common.Claim('muonclip', '=', 'muon', source='K2: loss curves with and without the clip coincide'),
]


def base(scale: str):
  from kimijax.config import load

  config = load('configs/default.py')
  if scale == 'cpu':  # configs/default.py as it is (3.5M parameters), 300 steps
    return common.sized(
      config,
      scale,
      d_model=256,
      num_layers=4,
      num_heads=4,
      seq_len=256,
      batch_size=16,
      steps=300,
      optimizer__qk_clip_tau=5.0,
    )
  return common.sized(
    config,
    scale,
    d_model=512,
    num_layers=8,
    num_heads=8,
    seq_len=1024,
    batch_size=16,
    steps=1500,
    optimizer__learning_rate=3e-3,
    optimizer__qk_clip_tau=10.0,
  )


if __name__ == '__main__':
  common.script('QK-Clip: Muon with and without the clip', base, ARMS, CLAIMS, __doc__, 'runs/ablation_qk_clip')
