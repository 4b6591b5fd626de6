"""Attention Residuals ablations (SPEC §4): standard, Full, Block with S = 2 / 4 / 8 / 16 sublayers.

    python -m experiments.ablations.attention_residuals --scale=cpu --workdir=runs/abl_attnres --seeds=2
    python -m experiments.ablations.attention_residuals --scale=gpu --workdir=runs/abl_attnres_gpu \\
        --seeds=2 --publish=experiments/results/ablation_attention_residuals

8 layers = 16 sublayers, so S = 2, 4, 8, 16 give 8, 4, 2, 1 blocks. The paper's 436M-model table
(val loss): baseline 1.766, Full 1.737, Block S=2 1.746, S=4 1.746, S=8 1.748, S=16 1.753, no key
RMSNorm 1.743, sigmoid instead of softmax 1.741. The last two arms are not runnable: kimijax has no
key-norm switch or sigmoid depth weighting (model.residual covers standard / attnres_full /
attnres_block only); they are listed so that the table says so.
Expected runtime (estimates, not measured): cpu, 6 arms x 2 seeds of a 0.4M model, 300 steps:
~20 min on the 2-core CPU. gpu: 6 arms x 2 seeds, ~25M parameters, 1500 steps of 16 x 1024
tokens, bf16, the Pallas AttnRes kernels (XLA for Full): ~2-3 min per run, ~30 min on one H200.
"""

from experiments.ablations import common


def block(s: int) -> dict:
  return {'model.residual': 'attnres_block', 'model.attnres_block_size': s}


ARMS = [
    common.Arm('standard', {}, 'val loss 1.766'),
    common.Arm('full', {'model.residual': 'attnres_full', 'model.attnres_impl': 'xla'}, '1.737'),
    common.Arm('block2', block(2), '1.746'),
    common.Arm('block4', block(4), '1.746'),
    common.Arm('block8', block(8), '1.748'),
    common.Arm('block16', block(16), '1.753'),
]
NOT_RUNNABLE = [common.Arm('no_key_norm', {}, '1.743', runnable=False),
                common.Arm('sigmoid', {}, '1.741', runnable=False)]
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
]


def base(scale: str):
  from configs.default import get_config
  if scale == 'cpu':
    return common.sized(get_config(), scale, d_model=64, num_layers=8, num_heads=4, seq_len=128,
                        batch_size=8, steps=300)
  return common.sized(get_config(), scale, d_model=512, num_layers=8, num_heads=8, seq_len=1024,
                      batch_size=16, steps=1500, model__attnres_impl='pallas', optimizer__learning_rate=2e-3)


if __name__ == '__main__':
  common.script('Attention Residuals ablations', base, ARMS + NOT_RUNNABLE, CLAIMS, __doc__, 'runs/ablation_attention_residuals')
