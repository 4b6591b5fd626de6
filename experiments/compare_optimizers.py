"""AdamW vs Muon vs MuonClip on one config: a sweep over optimizer.name (experiments/sweep.py).

    python -m experiments.compare_optimizers --config=configs/default.py --workdir=runs/compare_optimizers \\
        [--optimizers=adamw,muon,muonclip] [--seeds=1] [--config.train.steps=200] \\
        [--config.optimizer.qk_clip_tau=5] [--publish=experiments/results/compare_optimizers]

Same seed(s), data order and lr schedule for every optimizer (same lr for all, as Moonlight's
update-RMS matching intends). Writes the sweep's report into --workdir (sweep.md: final train and
eval loss, tokens, training FLOPs with Muon's Newton-Schulz, tokens/s, max logit final / peak;
loss_curves.png with the max-logit panel); nothing outside it unless --publish. Re-running resumes
or reuses the runs. Expected (2-core CPU, 200 steps, tau 5): Muon's eval loss below AdamW's and
MuonClip's max logit held at tau, about 10 min for the three runs; the figures:
experiments/results/compare_optimizers.md.
"""

from __future__ import annotations

from absl import app, flags


def define_flags():
  from kimijax.config import define_config_flag

  define_config_flag('config', None, 'config file, FILE[:VARIANT[,VARIANT]].')
  flags.DEFINE_list('optimizers', ['adamw', 'muon', 'muonclip'], 'optimizer.name values to compare')
  flags.DEFINE_integer('seeds', 1, 'runs per optimizer')
  flags.DEFINE_string('workdir', 'runs/compare_optimizers', 'output folder (runs/, sweep.md, ...)')
  flags.DEFINE_string('publish', None, 'also copy the report to PREFIX.md/.png/.json')
  flags.mark_flags_as_required(['config'])


def main(argv):
  del argv
  from experiments import sweep
  from experiments.cli import user_errors
  from experiments.runs import WorkflowError
  from kimijax.config import config_from_flags

  FLAGS = flags.FLAGS
  with user_errors():
    config = config_from_flags('config')
    names = FLAGS.optimizers
    if not names or len(set(names)) != len(names):
      raise WorkflowError(f'--optimizers={",".join(names)}: give one or more optimizer names, each once')
    axes = sweep.parse_axes([f'optimizer.name={",".join(names)}'], config)
    sweep.run_sweep(
      config, axes, seeds=FLAGS.seeds, workdir=FLAGS.workdir, publish=FLAGS.publish, title='AdamW vs Muon vs MuonClip'
    )


if __name__ == '__main__':
  define_flags()
  app.run(main)
