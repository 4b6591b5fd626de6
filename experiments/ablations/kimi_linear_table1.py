"""Kimi Linear report, Table 1 (docs/kda.md): KDA:MLA ratio, output gate, short convolution, NoPE vs RoPE.

    python -m experiments.ablations.kimi_linear_table1 --scale=cpu --workdir=runs/abl_kimi_linear --seeds=1
    python -m experiments.ablations.kimi_linear_table1 --scale=gpu --workdir=runs/abl_kimi_linear_gpu \\
        --seeds=2 --publish=experiments/results/ablation_kimi_linear_table1_gpu

Arms (16 layers as in the report, so that 15:1 still holds one MLA layer): 3:1 (the reference),
0:1 (all MLA), 1:1, 7:1, 15:1, 1:0 (all KDA), no output gate, swish gate, no short conv, and RoPE on
the MLA layers. Verdicts on final eval loss (the report's validation perplexity) and, for NoPE vs
RoPE, on the eval loss of the longest-context position bucket (the report's claim is on long-context
benchmarks, Table 5: NoPE 54.5 vs RoPE 51.8).
Expected runtime: cpu, 10 arms x 1 seed of a 0.27M-parameter model, 100 steps: about 40 min on
the shared 2-core CPU (2026-12-01, 3-4 min a run; KDA's chunk form dominates). gpu (estimates): 10 arms x 2 seeds, ~28M
parameters, 1000 steps of 16 x 2048 tokens (33M tokens), estimated at ~5 min per run for the XLA
KDA chunk form (the fused Pallas kernels, the GPU default, are ~5x faster per KDA op): up to ~100
min on one H200, i.e. split it with --arms over several calls (runs resume and are reused).
"""

from experiments.ablations import common

ARMS = [
  common.Arm('3:1', {}, 'train ppl 9.23, val 5.65'),
  common.Arm('0:1', {'model.layer_pattern': '0:1'}, '9.45 / 5.77'),
  common.Arm('1:1', {'model.layer_pattern': '1:1'}, '9.29 / 5.66'),
  common.Arm('7:1', {'model.layer_pattern': '7:1'}, '9.23 / 5.70'),
  common.Arm('15:1', {'model.layer_pattern': '15:1'}, '9.34 / 5.82'),
  common.Arm('1:0', {'model.layer_pattern': '1:0'}, '(not in Table 1)'),
  common.Arm('no_gate', {'model.kda_output_gate': 'none'}, '9.25 / 5.67'),
  common.Arm('swish_gate', {'model.kda_output_gate': 'swish'}, '9.43 / 5.81'),
  common.Arm('no_conv', {'model.kda_short_conv': False}, '9.29 / 5.70'),
  common.Arm(
    'rope', {'model.mla_rope': True, 'model.attn_impl': 'xla'}, 'long-context avg 51.8 vs NoPE 54.5 (Table 5)'
  ),
]
SOURCE = 'Kimi Linear Table 1 (val ppl)'
CLAIMS = [
  common.Claim('3:1', '<', '0:1', source=SOURCE),
  common.Claim('3:1', '<', '1:1', source=SOURCE),
  common.Claim('3:1', '<', '7:1', source=SOURCE),
  common.Claim('3:1', '<', '15:1', source=SOURCE),
  common.Claim('3:1', '<', 'no_gate', source=SOURCE),
  common.Claim('3:1', '<', 'swish_gate', source=SOURCE),
  common.Claim('no_gate', '<', 'swish_gate', source=SOURCE),
  common.Claim('3:1', '<', 'no_conv', source=SOURCE),
  common.Claim('3:1', '<', 'rope', metric='long_context_loss', source='Kimi Linear Table 5 (long context)'),
]


def base(scale: str):
  from kimijax.config import load

  config = load('configs/kimi_linear_small.py')
  if scale == 'cpu':
    return common.sized(
      config,
      scale,
      d_model=32,
      num_layers=16,
      num_heads=2,
      seq_len=128,
      batch_size=8,
      steps=100,
      model__mla_kv_lora_rank=32,
    )
  return common.sized(
    config,
    scale,
    d_model=512,
    num_layers=16,
    num_heads=8,
    seq_len=2048,
    batch_size=16,
    steps=1000,
    model__mla_kv_lora_rank=256,
    optimizer__learning_rate=2e-3,
  )


if __name__ == '__main__':
  common.script('Kimi Linear Table 1 ablations', base, ARMS, CLAIMS, __doc__, 'runs/ablation_kimi_linear_table1')
