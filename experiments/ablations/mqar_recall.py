"""MQAR recall of all-attention, 3:1 KDA:attention and all-KDA against sequence length and the
number of key-value pairs (the seeds' long-context axis; kimijax/data/mqar.py).

    python -m experiments.ablations.mqar_recall --scale=cpu --workdir=runs/abl_mqar --seeds=1
    python -m experiments.ablations.mqar_recall --scale=gpu --workdir=runs/abl_mqar_gpu --seeds=2 \\
        --publish=experiments/results/ablation_mqar_recall_gpu

Arms: pattern x (seq_len, pairs) over a small grid; the metric is the recall accuracy (exact
match of each queried value, logged as eval_recall_accuracy). Expected ordering (Zoology, Arora et
al. 2023, and the Kimi Linear report's synthetic tasks; not a published table): attention recalls
every pair at these sizes, a fixed-size recurrent state loses recall as pairs grow, and the hybrid's
attention layer restores it; so attention >= hybrid >= all-KDA, the gap growing with the pairs.
Expected runtime: cpu, 9 arms x 1 seed, 0.1M models, 300 steps at T <= 256: about 45 min on the
2-core CPU shared with a test run (measured 2026-12-01; no arm learned the task at this size:
experiments/results/ablation_mqar_recall.md). gpu: 9 arms x 2 seeds, ~6M models, 2000 steps at T
up to 2048: ~30 min (estimate).
"""

from experiments.ablations import common

PATTERNS = {'attention': 'A', 'hybrid_3to1': '3:1', 'kda': 'K'}


def grid(scale: str):
  return ((128, 8), (256, 32), (256, 64)) if scale == 'cpu' else ((512, 32), (1024, 64), (2048, 128))


def arms(scale: str) -> list[common.Arm]:
  return [
    common.Arm(f'{name}_T{t}_P{p}', {'model.layer_pattern': pattern, 'train.seq_len': t, 'data.mqar_num_pairs': p})
    for t, p in grid(scale)
    for name, pattern in PATTERNS.items()
  ]


def claims(scale: str) -> list[common.Claim]:
  out = []
  for t, p in grid(scale):
    out += [
      common.Claim(f'attention_T{t}_P{p}', '>', f'hybrid_3to1_T{t}_P{p}', 'final_accuracy', 'Zoology'),
      common.Claim(f'hybrid_3to1_T{t}_P{p}', '>', f'kda_T{t}_P{p}', 'final_accuracy', 'Zoology'),
    ]
  return out


def base(scale: str):
  from kimijax.config import load

  config = load('configs/default.py')
  if scale == 'cpu':  # seq_len is set per arm
    return common.sized(
      config,
      scale,
      d_model=64,
      num_layers=4,
      num_heads=2,
      seq_len=128,
      batch_size=16,
      steps=300,
      train__eval_batches=4,
      data__source='mqar',
    )
  return common.sized(
    config,
    scale,
    d_model=256,
    num_layers=4,
    num_heads=4,
    seq_len=512,
    batch_size=32,
    steps=2000,
    train__eval_batches=8,
    optimizer__learning_rate=1e-3,
    data__source='mqar',
  )


if __name__ == '__main__':
  common.script('MQAR recall: attention, 3:1 hybrid, all KDA', base, arms, claims, __doc__, 'runs/ablation_mqar_recall')
