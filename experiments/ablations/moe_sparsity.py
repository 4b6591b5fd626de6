"""MoE sparsity (docs/moe.md): at fixed activated experts and expert width, more routed experts.

    python -m experiments.ablations.moe_sparsity --scale=cpu --workdir=runs/abl_moe_sparsity --seeds=2
    python -m experiments.ablations.moe_sparsity --scale=gpu --workdir=runs/abl_moe_sparsity_gpu --seeds=2 \\
        --publish=experiments/results/ablation_moe_sparsity_gpu

Kimi K2's sparsity scaling law (arXiv 2507.20534, §2.3): with sparsity the total routed experts
over the activated ones, small controlled MoE runs trained with Muon at a fixed number of activated
parameters (so at fixed FLOPs per token) reach a lower training and validation loss the more
experts they have, consistently over the sparsities tried, so that a sparser model reaches a given
validation loss with fewer FLOPs; K2 itself takes sparsity 48 (384 routed experts, 8 per token,
beside 1 shared), trading the gain of going sparser against the cost of serving more experts.
Arms on configs/moonlight_small.py (64 routed experts top-6 + 2 shared, expert hidden F, sigmoid
scores, centred bias update at the config's rate 1e-3, 'xla_blocked'), its num_experts alone set
to 12, 24, 48 and 96: sparsity 2, 4, 8 and 16. A token's experts, the shared experts, attention and
the dense first layer are the same in every arm; only the router [D, E] grows with E, D (E - 12)
more parameters per MoE layer than e12's (e96's active parameters are 2.3% above e12's at cpu
scale, 0.7% at gpu scale; the router's FLOPs grow alike), so the active parameters are equal but
for it (tests/experiments/test_ablations.py). Claims: each sparser arm's eval loss below the next
denser one's, and the sparsest's below the densest's ('<'). At cpu scale each expert of e96 sees
1/16 of the tokens (about 38k token rows per layer over the run) and the arms train for the same
300 steps, far short of the budgets K2's law is drawn at: more experts may not pay there, and the
verdict says what it says. The bias rate is the config's 1e-3, which at this size and length
leaves the loads unbalanced (experiments/results/ablation_moe_balance.md); the sweep's
loss_curves.png plots every arm's max / mean load beside its loss.
Scale cpu: moe_balance's CPU model (d 128, 1 dense + 3 MoE layers of expert hidden 88, MLA) at
batch 8 x 256, 300 steps (0.61M tokens): 1.40M (e12) to 1.43M (e96) active parameters, 2.0M to
10.6M in all.
Expected runtime: cpu, 4 arms x 2 seeds: 0.2 s a step for e12, 0.46 s for e96 (Muon
orthogonalises every expert's matrices), 1.3-2.8 min a run, 14.8 min in all (measured
2026-12-04, the 2-core CPU otherwise idle; experiments/results/ablation_moe_sparsity.md). gpu (an
estimate, not yet run): moe_balance's gpu model (d 512, 8 layers: 1 dense + 7 MoE, expert hidden
352), 1500 steps of 16 x 1024 tokens, bf16, 'xla_blocked': 43.4M (e12) to 43.7M (e96) active
parameters, 66M to 384M in all; 5-9 min a run (Muon's Newton-Schulz on every expert grows with
E), 50-70 min for 8 runs on one H200 (split it with --arms).
"""

from experiments.ablations import common, moe_balance

EXPERTS = (12, 24, 48, 96)  # at top-6: sparsity 2, 4, 8, 16


def arms(scale: str) -> list[common.Arm]:
  del scale  # the same arms at both scales
  published = {
    12: 'sparsity 2',
    24: 'sparsity 4',
    48: 'sparsity 8',
    96: 'sparsity 16 (K2 §2.3: lower loss the sparser at fixed active parameters; K2 runs 48)',
  }
  return [common.Arm(f'e{e}', {'model.moe.num_experts': e}, published[e]) for e in EXPERTS]


SOURCE = 'K2 §2.3 (arXiv 2507.20534): sparser is lower at fixed activated parameters'
PAIRS = list(zip(EXPERTS[1:], EXPERTS)) + [(EXPERTS[-1], EXPERTS[0])]  # (sparser, denser)
CLAIMS = [common.Claim(f'e{sparse}', '<', f'e{dense}', source=SOURCE) for sparse, dense in PAIRS]


def base(scale: str):
  return moe_balance.moe_model(scale, cpu_steps=300)  # moe_balance's model, with bias rate 1e-3


if __name__ == '__main__':
  common.script(
    'MoE sparsity: 12, 24, 48, 96 routed experts at top-6',
    base,
    arms,
    CLAIMS,
    __doc__,
    'runs/ablation_moe_sparsity',
  )
