"""MoE load balancing (docs/moe.md#balancing): the bias update against a balance loss, both, and neither.

    python -m experiments.ablations.moe_balance --scale=cpu --workdir=runs/abl_moe_balance --seeds=2
    python -m experiments.ablations.moe_balance --scale=gpu --workdir=runs/abl_moe_balance_gpu --seeds=2 \\
        --publish=experiments/results/ablation_moe_balance_gpu

Arms on configs/moonlight_small.py, whose routed experts are the loss-free paper's layout (64
routed, top-6, 2 shared, sigmoid scores; Wang et al., arXiv 2408.15664, §4.1): 'bias', the bias
update alone (model.moe.bias_rate: 1e-3 at gpu scale, the paper's best rate and DeepSeek-V3's,
Moonlight's and kimijax's default; 1e-2 at cpu scale, below); 'aux_loss', the balance loss alone at
alpha = 1e-3 (model.moe.aux_loss_alpha; the paper's auxiliary-loss baseline), no bias update;
'none', neither; 'bias+aux', the bias with DeepSeek-V3's alpha = 1e-4 (arXiv 2412.19437 §2.1.2).
kimijax's balance loss is DeepSeek-V3's sequence-wise one (eq. 17-20: alpha sum_i f_i P_i per
sequence, the scores normalised to sum 1), the f_i P_i form of the paper's Eq. 2, so its alpha
carries over. The bias update is Moonlight's centred form (the base config's), which routes exactly
as the uncentred one: top-k sees only differences between the biases. Published (2408.15664 Table
2, 1B / 3B models): validation perplexity 9.50 / 7.92 with the bias against 9.56 / 7.97 with the
loss; MaxVio_global (the largest expert load over the mean, less 1, over the validation set) 0.04 /
0.04 against 0.72 / 0.52. Claims: every arm with balancing ends with a lower max / mean load than
'none'; the bias's below the loss's; the bias's eval loss below the loss's ('<', the paper's
ordering: "inside seed noise" there reads as no worse at this size, not as a reproduction). The
load metric, moe_load_max_mean_late, is metrics.jsonl's moe_load_max_mean (per training batch, in
the worst MoE layer: MaxVio_batch + 1) averaged over the logged steps of the run's last fifth; the
sweep's loss_curves.png plots it against step.
Scale cpu: the config's CPU model (7.3M parameters, 1.4M active; d 128, 1 dense + 3 MoE layers) at
batch 8 x 256, 250 steps. The initial routers' per-expert mean scores spread over 0.14-0.18 (max -
min, seeds 0 and 1), and a router trained by Muon spreads them further: at gamma = 1e-3 the biases'
range still grew by 2 gamma every step at step 250 (0.43, loads 3.1 x the mean), so the last fifth
would measure the approach, not the balance; at 1e-2 it levels off near 0.4 by step 100. The
paper's Figure 4 finds 1e-2 worse than 1e-3 late in a 100B-token run (the bias oscillates); 250
steps are all early.
Expected runtime: cpu, 4 arms x 2 seeds, 1.6-2.1 min a run (about 0.35 s a step), 15 min in all on
the 2-core CPU (measured 2026-12-04, other jobs on it part of the time; 0.6 s a step beside a
test run). gpu (an estimate, not yet run): 4 arms x 2 seeds of d 512, 8 layers (1 dense + 7 MoE
of 64 experts top-6 + 2 shared, expert hidden 352), 44M active of 263M parameters, 1500 steps of
16 x 1024 tokens, bf16, 'xla_blocked': ~5-8 min a run, ~40-60 min on one H200 (split it with
--arms).
"""

from experiments.ablations import common

# The bias step: 2408.15664's best rate and model.moe.bias_rate's default on the GPU; 1e-2 on the CPU,
# whose 250 steps at 1e-3 leave the bias still climbing at its full rate at the end (measured,
# docstring).
GAMMA = {'cpu': 1e-2, 'gpu': 1e-3}
ALPHA_LOSS = 1e-3  # the 2408.15664 auxiliary-loss baseline's weight
ALPHA_V3 = 1e-4  # DeepSeek-V3's sequence-wise loss beside the bias


def balance(bias_rate: float, alpha: float) -> dict:
  return {'model.moe.bias_rate': bias_rate, 'model.moe.aux_loss_alpha': alpha}


def arms(scale: str) -> list[common.Arm]:
  gamma = GAMMA[scale]
  return [
    common.Arm(
      'bias', balance(gamma, 0.0), '2408.15664 Table 2, 1B / 3B: val ppl 9.50 / 7.92, MaxVio_global 0.04 / 0.04'
    ),
    common.Arm('aux_loss', balance(0.0, ALPHA_LOSS), 'alpha 1e-3: 9.56 / 7.97, MaxVio_global 0.72 / 0.52'),
    common.Arm('none', balance(0.0, 0.0), '(no figure; 2408.15664 §2.2: unbalanced routing collapses)'),
    common.Arm(
      'bias+aux', balance(gamma, ALPHA_V3), "DeepSeek-V3's recipe (alpha 1e-4 beside the bias; no ablation figure)"
    ),
  ]


LOAD = 'moe_load_max_mean_late'
CLAIMS = [
  common.Claim('bias', '<', 'none', metric=LOAD, source='2408.15664 §3: the bias update balances the loads'),
  common.Claim('aux_loss', '<', 'none', metric=LOAD, source='2408.15664 §2.2: the auxiliary loss balances the loads'),
  common.Claim('bias+aux', '<', 'none', metric=LOAD, source='DeepSeek-V3 §2.1.2: bias and sequence-wise loss'),
  common.Claim('bias', '<', 'aux_loss', metric=LOAD, source='2408.15664 Table 2 (MaxVio_global 0.04 vs 0.72)'),
  common.Claim('bias', '<', 'aux_loss', source='2408.15664 Table 2 (val ppl 9.50 vs 9.56)'),
]


def moe_model(scale: str, *, cpu_steps: int):
  """configs/moonlight_small.py (64 routed experts top-6 + 2 shared, MLA, Muon) at the MoE
  ablations' sizes: on the CPU the config's own model at half its batch ('xla_blocked', expert
  hidden 88) for cpu_steps steps; on a GPU the docstring's d 512 model for 1500 steps."""
  from kimijax.config import load

  config = load('configs/moonlight_small.py')
  if scale == 'cpu':
    return common.sized(
      config,
      scale,
      d_model=128,
      num_layers=4,
      num_heads=2,
      seq_len=256,
      batch_size=8,
      steps=cpu_steps,
      model__mlp_dim=704,  # the dense first layer's width, 5.5 d as Moonlight's
    )
  return common.sized(
    config,
    scale,
    d_model=512,
    num_layers=8,
    num_heads=4,  # head dim 128, as the :gpu variant
    seq_len=1024,
    batch_size=16,
    steps=1500,
    model__mlp_dim=2816,  # 5.5 d
    model__mla_kv_lora_rank=256,
    model__mla_qk_rope_head_dim=64,
    model__moe__expert_hidden=352,  # 0.6875 d, as 1408 / 2048
    model__moe__impl='xla_blocked',  # 352 is not a multiple of 64, which 'mosaic' needs
    optimizer__learning_rate=2e-3,
  )


def base(scale: str):
  return moe_model(scale, cpu_steps=250)


if __name__ == '__main__':
  common.script(
    'MoE load balancing: bias update, balance loss, both, neither',
    base,
    arms,
    CLAIMS,
    __doc__,
    'runs/ablation_moe_balance',
  )
