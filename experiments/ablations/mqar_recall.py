"""MQAR recall of all-attention, 3:1 KDA:attention and all-KDA against sequence length and the
number of key-value pairs (the seeds' long-context axis; kimijax/data/mqar.py).

    python -m experiments.ablations.mqar_recall --scale=cpu --workdir=runs/abl_mqar --seeds=1
    python -m experiments.ablations.mqar_recall --scale=gpu --workdir=runs/abl_mqar_gpu --seeds=2 \\
        --publish=experiments/results/ablation_mqar_recall

Arms: pattern x (seq_len, pairs) over a small grid; the metric is the recall accuracy (exact
match of each queried value, logged as eval_recall_accuracy). Expected ordering (Zoology, Arora et
al. 2023, and the Kimi Linear report's synthetic tasks; not a table in SPEC): attention recalls
every pair at these sizes, a fixed-size recurrent state loses recall as pairs grow, and the hybrid's
attention layer restores it; so attention >= hybrid >= all-KDA, the gap growing with the pairs.
Expected runtime: cpu, 9 arms x 1 seed, 0.1M models, 300 steps at T <= 256: ~20 min on the 2-core
CPU (estimate). gpu: 9 arms x 2 seeds, ~6M models, 2000 steps at T up to 2048: ~30 min (estimate).
"""

from absl import app

from experiments.ablations import common
from experiments.runs import with_overrides

PATTERNS = {'attention': 'A', 'hybrid_3to1': '3:1', 'kda': 'K'}


def grid(scale: str):
  return ((128, 8), (256, 32), (256, 64)) if scale == 'cpu' else ((512, 32), (1024, 64), (2048, 128))


def arms(scale: str) -> list[common.Arm]:
  return [common.Arm(f'{name}_T{t}_P{p}', {'model.layer_pattern': pattern, 'train.seq_len': t,
                                             'data.mqar_num_pairs': p})
          for t, p in grid(scale) for name, pattern in PATTERNS.items()]


def claims(scale: str) -> list[common.Claim]:
  out = []
  for t, p in grid(scale):
    out += [common.Claim(f'attention_T{t}_P{p}', '>', f'hybrid_3to1_T{t}_P{p}', 'final_accuracy', 'Zoology'),
            common.Claim(f'hybrid_3to1_T{t}_P{p}', '>', f'kda_T{t}_P{p}', 'final_accuracy', 'Zoology')]
  return out


def base(scale: str):
  from configs.default import get_config
  c = get_config()
  if scale == 'cpu':
    return with_overrides(c, {'model.d_model': 64, 'model.num_layers': 4, 'model.num_heads': 2,
                              'model.mlp_dim': 128, 'train.batch_size': 16, 'train.steps': 300,
                              'train.eval_every': 100, 'train.checkpoint_every': 100, 'train.eval_batches': 4,
                              'optimizer.warmup_steps': 15, 'data.source': 'mqar'})
  return with_overrides(c, {
      'model.d_model': 256, 'model.num_layers': 4, 'model.num_heads': 4, 'model.mlp_dim': 768,
      'model.compute_dtype': 'bfloat16', 'model.attn_impl': 'cudnn', 'train.batch_size': 32,
      'train.steps': 2000, 'train.eval_every': 500, 'train.checkpoint_every': 500, 'train.eval_batches': 8,
      'optimizer.learning_rate': 1e-3, 'optimizer.warmup_steps': 100, 'data.source': 'mqar'})


def main(argv):
  del argv
  from absl import flags
  scale = flags.FLAGS.scale
  common.main('MQAR recall: attention, 3:1 hybrid, all KDA', base, arms(scale), claims(scale),
              __doc__.split('\n\n')[1])


if __name__ == '__main__':
  common.define_flags('runs/ablation_mqar_recall')
  app.run(main)
