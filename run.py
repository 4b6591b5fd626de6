"""Train one config: python run.py --config=configs/default.py[:variant] --workdir=DIR [--config.a.b=v].

Re-running the same command resumes from DIR/checkpoints. For several processes (hosts), start
one copy per process with --coordinator_address=HOST:PORT --num_processes=N --process_id=I
(or none of them where jax.distributed detects the cluster itself, e.g. under SLURM).
"""

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file('config', None, 'ml_collections config file (path[:arg]).', lock_config=True)
flags.DEFINE_string('workdir', None, 'Output folder: metrics.jsonl, checkpoints/, tensorboard/, loss.png.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, for multi-process runs.')
flags.DEFINE_integer('num_processes', None, 'Number of processes in a multi-process run.')
flags.DEFINE_integer('process_id', None, 'This process index in a multi-process run.')
flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() with cluster auto-detection.')
flags.mark_flags_as_required(['config', 'workdir'])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)   # orbax logs every save step at INFO
  import jax
  if FLAGS.coordinator_address or FLAGS.distributed:
    if jax.default_backend() == 'cpu' or FLAGS.coordinator_address:
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)

  from kimijax.config import validate
  from kimijax.train.loop import train
  config = validate(FLAGS.config)
  summary = train(config, FLAGS.workdir)
  if jax.process_index() == 0:
    print('\n'.join([
        'done.',
        f'  parameters   {summary["params"] / 1e6:.2f}M',
        f'  tokens       {summary["tokens"]:,} in {summary["seconds"]:.0f} s',
        f'  final loss   train {summary["final_loss"]}, eval {summary["eval_loss"]}',
        f'  outputs      {summary["workdir"]}/ (metrics.jsonl, checkpoints/, tensorboard/, loss.png)',
    ]))


if __name__ == '__main__':
  app.run(main)
