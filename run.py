"""Train one config, or generate text from a trained one.

    python run.py --config=configs/default.py[:variant] --workdir=DIR [--config.a.b=v]
    python run.py --mode=generate --workdir=DIR --prompt='def main(' [--max_new_tokens=200]

Re-running the same training command resumes from DIR/checkpoints. For several processes (hosts), start
one copy per process with --coordinator_address=HOST:PORT --num_processes=N --process_id=I
(or none of them where jax.distributed detects the cluster itself, e.g. under SLURM).
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file('config', None, 'ml_collections config file (path[:arg]).', lock_config=True)
flags.DEFINE_string('workdir', None, 'Output folder: metrics.jsonl, checkpoints/, tensorboard/, loss.png.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, for multi-process runs.')
flags.DEFINE_integer('num_processes', None, 'Number of processes in a multi-process run.')
flags.DEFINE_integer('process_id', None, 'This process index in a multi-process run.')
flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() with cluster auto-detection.')
flags.DEFINE_enum('mode', 'train', ['train', 'generate'], 'Train the config, or generate from DIR.')
flags.DEFINE_string('prompt', '', 'generate: the text to continue.')
flags.DEFINE_integer('max_new_tokens', 200, 'generate: tokens (bytes) to add.')
flags.DEFINE_float('temperature', 0.8, 'generate: sampling temperature; 0 is greedy.')
flags.DEFINE_integer('top_k', 0, 'generate: keep the k most likely tokens (0: all).')
flags.DEFINE_float('top_p', 0.95, 'generate: keep the smallest set of tokens with this probability.')
flags.DEFINE_integer('num_samples', 1, 'generate: continuations of the prompt, as one batch.')
flags.mark_flags_as_required(['workdir'])
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)   # orbax logs every save step at INFO
  import jax
  if FLAGS.coordinator_address or FLAGS.distributed:
    # Cross-process collectives of the CPU backend (harmless on GPU). Do not query the backend
    # here (jax.default_backend()): that initialises it, and initialize() must come first.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)

  from kimijax.config import ConfigError, validate
  from kimijax.data import DataError
  from kimijax.train.checkpoint import CheckpointError
  from kimijax.train.loop import train
  try:   # these errors carry one message naming the key or path; a traceback would bury it
    if FLAGS.mode == 'generate':
      return generate_text()
    if FLAGS.config is None:
      raise ConfigError('--config=FILE[:arg] is required to train')
    config = validate(FLAGS.config)
    summary = train(config, FLAGS.workdir)
  except (ConfigError, DataError, CheckpointError) as e:
    sys.exit(f'{type(e).__name__}: {e}')
  if jax.process_index() == 0:
    print('\n'.join([
        'done.',
        f'  parameters   {summary["params"] / 1e6:.2f}M',
        f'  tokens       {summary["tokens"]:,} in {summary["seconds"]:.0f} s',
        f'  final loss   train {_fmt(summary["final_loss"])}, eval {_fmt(summary["eval_loss"])} (nats/token)',
        f'  outputs      {summary["workdir"]}/ (metrics.jsonl, checkpoints/, tensorboard/, loss.png)',
    ]))


def generate_text():
  """Prints num_samples continuations of --prompt from the latest checkpoint in --workdir."""
  from kimijax.data import ByteTokenizer
  from kimijax.infer.generate import generate, load_for_generation
  config, model, params = load_for_generation(FLAGS.workdir)
  tokenizer = ByteTokenizer()
  prompt = tokenizer.encode(FLAGS.prompt or '\n')
  tokens = generate(model, params, [prompt] * FLAGS.num_samples, max_new_tokens=FLAGS.max_new_tokens,
                    temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                    seed=config.seed, stop_token=tokenizer.eos_id)
  for row in tokens:
    print(FLAGS.prompt + tokenizer.decode(row[len(prompt):]))
    print('-' * 40)


def _fmt(x) -> str:
  return 'n/a' if x is None else f'{x:.4f}'


if __name__ == '__main__':
  from kimijax.config import unknown_override
  if message := unknown_override(sys.argv):
    sys.exit(message)
  app.run(main)
