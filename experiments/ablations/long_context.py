"""Loss by token position at a long sequence: all attention, 3:1 KDA:attention, all KDA (the seeds'
second scaling axis: does a model keep improving with context, as in the Kimi talk's Transformer
against LSTM figure).

    python -m experiments.ablations.long_context --scale=cpu --workdir=runs/abl_long_context --seeds=1
    python -m experiments.ablations.long_context --scale=gpu --workdir=runs/abl_long_context_gpu --seeds=1 \\
        --publish=experiments/results/ablation_long_context_gpu

Each run's eval loss is logged per power-of-two position bucket (eval_loss_by_position); the
sweep's loss_curves.png plots the final one against position for the three patterns, and the
verdict compares the loss of the last bucket (the longest contexts). The published ordering is the
Kimi Linear report's long-context average (Table 5: Kimi Linear 54.5 against MLA 52.2), so the
hybrid's long-context loss should be the lower. MLA with NoPE as in the report.
Expected runtime: cpu, 3 runs of a 0.2M model at T = 1024, 150 steps: about 17 min on the 2-core
CPU (measured 2026-12-01 while a test run shared it). gpu: 3 runs of a ~25M model at T = 8192,
batch 4, 1000 steps with the fused Pallas KDA kernels: ~25 min on one H200 (an estimate made for
the XLA chunk form, so an upper bound).
"""

from experiments.ablations import common

ARMS = [
  common.Arm('attention', {'model.layer_pattern': '0:1'}, 'MLA: long-context avg 52.2'),
  common.Arm('hybrid_3to1', {'model.layer_pattern': '3:1'}, 'Kimi Linear: 54.5'),
  common.Arm('kda', {'model.layer_pattern': '1:0'}, '(not reported)'),
]
CLAIMS = [
  common.Claim(
    'hybrid_3to1',
    '<',
    'attention',
    metric='long_context_loss',
    source='Kimi Linear Table 5 (long-context average, higher is better)',
  )
]


def base(scale: str):
  from kimijax.config import load

  config = load('configs/kimi_linear_small.py')
  if scale == 'cpu':
    return common.sized(
      config,
      scale,
      d_model=64,
      num_layers=4,
      num_heads=2,
      seq_len=1024,
      batch_size=4,
      steps=150,
      model__mla_kv_lora_rank=32,
    )
  return common.sized(
    config,
    scale,
    d_model=512,
    num_layers=8,
    num_heads=8,
    seq_len=8192,
    batch_size=4,
    steps=1000,
    model__mla_kv_lora_rank=256,
    optimizer__learning_rate=2e-3,
  )


if __name__ == '__main__':
  common.script('Loss by position at a long context', base, ARMS, CLAIMS, __doc__, 'runs/ablation_long_context')
