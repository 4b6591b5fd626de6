"""Train one config, evaluate or generate from a trained run, or show a config without training.

    python run.py --config=configs/default.py[:variant] --workdir=DIR [--config.a.b=v]
    python run.py --mode=eval --workdir=DIR            # latest checkpoint on the validation split
    python run.py --mode=generate --workdir=DIR --prompt='def main(' [--max_new_tokens=200]
    python run.py --mode=eval|generate --config=configs/released.py:FOLDER --workdir=DIR
                                                       # a released checkpoint (docs/released.md)
    python run.py --mode=eval --config=configs/trained.py:DIR --workdir=DIR --config.train.seq_len=8192
                                                       # DIR's checkpoint with keys changed
    python run.py --mode=export --workdir=DIR --export_dir=OUT
                                                       # the latest checkpoint as a Hugging Face folder
    python run.py --mode=config --config=configs/default.py[:variant] [--config.a.b=v]
                                                       # resolved config + parameter counts, no training

Config files and their variants (--config=FILE:VARIANT, several as FILE:a,b; each file's VARIANTS;
--config.a.b=v overrides any key, e.g. --config.train.steps=1e3):
    configs/default.py            gqa (grouped-query attention, 2 KV heads), nope (no positions)
    configs/kimi_linear_small.py  all_mla, all_kda, 1to1, 7to1, 15to1 (KDA:MLA ratios), no_gate,
                                  swish_gate, no_conv (KDA ablations), rope (rotate MLA's decoupled
                                  dims), nope0 (MLA without decoupled dims, the config's former form)
    configs/bench_350m.py         hybrid (3 KDA : 1 attention), kda_keep, remat, xla, cudnn, tokamax (attn_impl),
                                  mla (Kimi Linear's MLA dims), attnres_full, attnres_block, attnres_xla,
                                  moe (Mixture-of-Experts MLPs of the same active width), long (batch 1,
                                  remat and the chunked loss, for the longest trainable sequence)
    configs/moonlight_small.py    MLA + MoE as Moonlight: gpu (one H200), adamw, balance_loss
    configs/kimi_linear_moe.py    3:1 KDA:MLA + MoE as Kimi Linear: gpu (one H200), muon
    configs/bpe_shards.py         3:1 KDA:attention on prepared BPE shards, documents kept apart:
                                  no_mask (packed across documents), gpu (one H200)
    configs/ladder.py             smoke, smoke_moe, gpu, gpu_attnres, gpu_hybrid, gpu_moe (ladders,
                                  for experiments/scaling_ladder.py)
    configs/released.py:FOLDER    a released checkpoint folder (docs/released.md): gpu, adamw
    configs/trained.py:DIR        a trained run's own config, to evaluate or generate from it with keys
                                  changed (a longer context, YaRN: docs/attention.md#yarn)

Re-running the same training command resumes from DIR/checkpoints (and does nothing once the run
has reached train.steps). Ctrl-C, SIGTERM (a scheduler's preemption) or SIGUSR1 stops after the
current step, saves a checkpoint of it (within train.preemption_grace_s seconds), releases the
workdir and exits with status 128 + the signal (130 for Ctrl-C, 143 for SIGTERM). A train or eval
step that would not fit the device's memory stops before compiling, naming its estimate. For several processes
(hosts), start one copy per process with --coordinator_address=HOST:PORT --num_processes=N
--process_id=I (or none of them where jax.distributed detects the cluster itself, e.g. under SLURM).
"""

import os
import pathlib
import sys
import threading

from absl import app, flags, logging

from kimijax.config import define_config_flag

define_config_flag(
  'config', None, 'config file, FILE[:VARIANT[,VARIANT]]; the files and their variants are listed above.'
)
flags.DEFINE_string('workdir', None, 'Output folder: metrics.jsonl, checkpoints/, tensorboard/, loss.png.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, for multi-process runs.')
flags.DEFINE_integer('num_processes', None, 'Number of processes in a multi-process run.')
flags.DEFINE_integer('process_id', None, 'This process index in a multi-process run.')
flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() with cluster auto-detection.')
flags.DEFINE_integer(
  'peer_timeout_s', 300, 'Multi-process: seconds to wait for every process to join before stopping with an error.'
)
flags.DEFINE_enum(
  'mode',
  'train',
  ['train', 'eval', 'generate', 'config', 'export'],
  'train the config; eval or generate from the latest checkpoint in --workdir; config: '
  'print the resolved config and parameter counts without training; export: write the latest '
  'checkpoint as a Hugging Face folder (--export_dir).',
)
flags.DEFINE_string('prompt', '', 'generate: the text to continue (empty: a newline).')
flags.DEFINE_integer('max_new_tokens', 200, "generate: tokens to add (> 0), in the run's tokenizer.")
flags.DEFINE_float('temperature', 0.8, 'generate: sampling temperature (>= 0); 0 is greedy.')
flags.DEFINE_integer('top_k', 0, 'generate: keep the k most likely tokens (0: all).')
flags.DEFINE_float('top_p', 0.95, 'generate: keep the smallest set of tokens with this probability, in (0, 1].')
flags.DEFINE_integer('num_samples', 1, 'generate: continuations of the prompt, as one batch (> 0).')
flags.DEFINE_integer('eval_batches', 0, "eval: validation batches (0: the run's train.eval_batches).")
flags.DEFINE_enum(
  'param_dtype',
  'float32',
  ['float32', 'bfloat16'],
  'eval, generate: the dtype the weight matrices are held in (bfloat16 halves their memory; '
  'with bf16 compute the result is that of the float32 weights rounded to bf16).',
)
flags.DEFINE_string(
  'compile_cache',
  '~/.cache/kimijax/xla',
  "XLA's persistent compilation cache: a step, eval or decode program compiled once is loaded from here "
  "by later runs of the same shapes and settings (a resume, an eval; '' for none; JAX_COMPILATION_CACHE_DIR, "
  'where set, takes its place).',
)
flags.DEFINE_string('export_dir', '', 'export: the new folder to write (config.json, *.safetensors, tokenizer).')
flags.DEFINE_enum(
  'export_dtype',
  'auto',
  ['auto', 'bfloat16', 'float32'],
  "export: the tensors' dtype (auto: a released source's, else bfloat16).",
)
FLAGS = flags.FLAGS


class UsageError(ValueError):
  """A command-line flag that cannot be used; the message names it."""


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
  import jax

  from kimijax.config import ConfigError, config_from_flags, overrides_from_flags

  try:  # a mistake in the command stops here, before any process waits for the others or computes
    if FLAGS.mode != 'config' and not FLAGS.workdir:
      raise UsageError(f'--workdir=DIR is required for --mode={FLAGS.mode}')
    if FLAGS.mode == 'export' and FLAGS.config is not None:
      raise UsageError("--mode=export writes DIR's checkpoint under DIR's own config.json; drop --config")
    if FLAGS.mode in ('train', 'config') and FLAGS.config is None:
      raise ConfigError(f'--config=FILE[:variant] is required for --mode={FLAGS.mode}')
    if FLAGS.config is None and (overrides := overrides_from_flags('config')):
      key = next(iter(overrides))  # it would be ignored: without --config, DIR/config.json is used as it is
      raise UsageError(
        f'--config.{key} needs --config: --mode={FLAGS.mode} without it takes DIR/config.json as it is; '
        f'give --config=configs/trained.py:{FLAGS.workdir} to change its keys'
        if FLAGS.mode != 'export'
        else f"--config.{key}: --mode=export writes DIR's checkpoint under DIR's own config.json; drop it"
      )
    # eval and generate take the run's config.json unless --config is given (then
    # train.init_from, a released checkpoint, stands in while DIR has no checkpoint)
    config = config_from_flags('config') if FLAGS.mode in ('train', 'config') or FLAGS.config else None
  except (ConfigError, UsageError) as e:
    sys.exit(f'{type(e).__name__}: {e}')
  use_compile_cache(jax, FLAGS.compile_cache)
  if FLAGS.coordinator_address or FLAGS.distributed:
    if FLAGS.peer_timeout_s <= 0:
      sys.exit(f'UsageError: --peer_timeout_s={FLAGS.peer_timeout_s} must be positive')
    join_processes(jax)

  from kimijax.train.loop import train
  from kimijax.train.user_errors import one_line_errors

  with one_line_errors(UsageError):  # errors that name the key or path; a traceback would bury them
    if FLAGS.mode == 'generate':
      return generate_text(config)
    if FLAGS.mode == 'eval':
      return evaluate_run(config)
    if FLAGS.mode == 'config':
      return print_config(config)
    if FLAGS.mode == 'export':
      return export_run()
    summary = train(config, FLAGS.workdir)
  if jax.process_index() == 0:
    print_summary(summary)


def use_compile_cache(jax, directory: str) -> None:
  """Point XLA's persistent compilation cache at `directory` (created; '~' expanded), unless it is ''
  or JAX_COMPILATION_CACHE_DIR already names one. A cache that cannot be created is left off with
  a warning: it saves compile time, the run does not need it."""
  if not directory or os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    return
  path = os.path.expanduser(directory)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    print(
      f'kimijax: no compilation cache at --compile_cache={directory} ({e.strerror}); compiling afresh', file=sys.stderr
    )
    return
  jax.config.update('jax_compilation_cache_dir', path)


def join_processes(jax) -> None:
  """jax.distributed.initialize, saying what it waits for and stopping after --peer_timeout_s."""
  # Cross-process collectives of the CPU backend (harmless on GPU). Do not query the backend
  # here (jax.default_backend()): that initialises it, and initialize() must come first.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  who = f'process {FLAGS.process_id} of {FLAGS.num_processes}' if FLAGS.num_processes else 'this process'
  where = FLAGS.coordinator_address or 'the coordinator the cluster names'
  print(
    f'kimijax: {who} waiting up to {FLAGS.peer_timeout_s} s for every process to join at {where} (--peer_timeout_s)',
    flush=True,
  )
  message = (
    f'DistributedError: {who} could not join the others at {where} within --peer_timeout_s='
    f'{FLAGS.peer_timeout_s} s: are all {FLAGS.num_processes or ""} processes started, with the same '
    '--coordinator_address and --num_processes?'
  )
  # On its own deadline the runtime aborts the process from C++ (a core dump, no Python
  # exception), so a watchdog stops first, with the message; the runtime's deadline is later.
  watchdog = threading.Timer(FLAGS.peer_timeout_s, lambda: (print(message, file=sys.stderr, flush=True), os._exit(1)))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
      FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, initialization_timeout=FLAGS.peer_timeout_s + 60
    )
  except Exception as e:  # the runtime raises several types (XlaRuntimeError, RuntimeError, ...)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    sys.exit(f'{message} ({first})')
  finally:
    watchdog.cancel()


def print_summary(summary: dict) -> None:
  if summary.get('already_finished'):
    print(
      '\n'.join(
        [
          f'already finished at step {summary["steps"]}; nothing was trained or written.',
          f'  final loss   train {_fmt(summary["final_loss"])}, eval {_fmt(summary["eval_loss"])} (nats/token, '
          'from metrics.jsonl)',
          f'  outputs      {summary["workdir"]}/   (raise --config.train.steps to continue; rm -r it to start over)',
        ]
      )
    )
    return
  from kimijax.train.loop import summary_text

  print(summary_text(summary))


def print_config(config) -> None:
  """--mode=config: the resolved config (the mesh rules as a table) and the model's parameter
  counts (shapes only)."""
  import yaml

  from kimijax.model import parameter_counts

  def plain(x):  # tuples as lists: YAML without !!python/tuple tags
    if isinstance(x, dict):
      return {k: plain(v) for k, v in x.items()}
    return [plain(v) for v in x] if isinstance(x, (tuple, list)) else x

  tree = plain(config.to_dict())
  rules = tree['mesh'].pop('rules')
  tree['mesh']['rules'] = '(the table below)'
  print(yaml.safe_dump(tree, sort_keys=True, default_flow_style=False).rstrip())
  print('mesh.rules (logical axis -> mesh axes):')
  width = max(len(name) for name, _ in rules)
  for name, axes in rules:
    shown = 'replicated' if axes is None else ', '.join(axes) if isinstance(axes, list) else axes
    print(f'  {name.ljust(width)}  {shown}')
  counts = parameter_counts(config.model)
  width = max(len(k) for k in counts)
  print('parameters:')
  for key, n in counts.items():
    print(f'  {key.ljust(width)}  {n:>12,}  ({n / 1e6:.2f}M)')


def generate_flag_errors(prompt: str) -> str | None:
  """The message for a bad --mode=generate flag, else None."""
  if FLAGS.max_new_tokens <= 0:
    return f'--max_new_tokens={FLAGS.max_new_tokens} must be positive'
  if FLAGS.num_samples <= 0:
    return f'--num_samples={FLAGS.num_samples} must be positive'
  if FLAGS.top_k < 0:
    return f'--top_k={FLAGS.top_k} must be >= 0 (0: all tokens)'
  if FLAGS.temperature < 0:
    return f'--temperature={FLAGS.temperature} must be >= 0 (0: greedy)'
  if not 0.0 < FLAGS.top_p <= 1.0:
    return f'--top_p={FLAGS.top_p} must lie in (0, 1]'
  try:
    prompt.encode('utf-8')
  except UnicodeEncodeError as e:
    bad = prompt[e.start : e.end].encode('utf-8', 'surrogateescape')
    return f'--prompt is not valid UTF-8 text (byte {e.start}: {bad!r})'
  return None


def generate_text(config=None):
  """Prints num_samples continuations of --prompt from the latest checkpoint in --workdir (or, with
  --config, the released checkpoint its train.init_from names while --workdir has none)."""
  if message := generate_flag_errors(FLAGS.prompt):
    raise UsageError(message)
  from kimijax.data import load_tokenizer
  from kimijax.data.pipeline import tokenizer_spec
  from kimijax.infer.generate import cache_too_large, load_for_generation, timed_generate

  config, model, params = load_for_generation(FLAGS.workdir, config, FLAGS.param_dtype)
  tokenizer = load_tokenizer(tokenizer_spec(config))  # the run's (data.tokenizer)
  prompt = tokenizer.encode(FLAGS.prompt or '\n')
  if message := cache_too_large(config.model, FLAGS.num_samples, len(prompt) + FLAGS.max_new_tokens):
    raise UsageError(f'--max_new_tokens={FLAGS.max_new_tokens} x --num_samples={FLAGS.num_samples}: {message}')
  tokens, timing = timed_generate(
    model,
    params,
    [prompt] * FLAGS.num_samples,
    max_new_tokens=FLAGS.max_new_tokens,
    temperature=FLAGS.temperature,
    top_k=FLAGS.top_k,
    top_p=FLAGS.top_p,
    seed=config.seed,
    stop_token=tokenizer.eos_id,
  )
  for row in tokens:
    print(FLAGS.prompt + tokenizer.decode(row[len(prompt) :]))
    print('-' * 40)
  print(timing_line(timing, FLAGS.num_samples, len(prompt)))


def timing_line(timing, batch: int, prompt_len: int) -> str:
  """Prefill time and the decode loop's tokens/s (batch x decode steps / its seconds), both after compilation."""
  steps = timing.decode_steps
  speed = f'{batch * steps / timing.decode_s:,.1f} tokens/s' if steps else 'no decode step (one new token)'
  return (
    f'prefill {timing.prefill_s * 1e3:.1f} ms ({batch} x {prompt_len} tokens); decode {speed} '
    f'({batch} x {steps} steps in {timing.decode_s * 1e3:.1f} ms, sampling included; compilation excluded)'
  )


def export_run():
  """--mode=export: writes the latest checkpoint in --workdir to --export_dir (kimijax.hf.export)."""
  if not FLAGS.export_dir:
    raise UsageError('--export_dir=OUT is required for --mode=export')
  from kimijax.hf.export import export_run as run_export

  dtype = None if FLAGS.export_dtype == 'auto' else FLAGS.export_dtype
  out, step = run_export(FLAGS.workdir, FLAGS.export_dir, dtype)
  print(f'step {step}: wrote {out} (config.json, {len(list(out.glob("*.safetensors")))} safetensors files)')


def evaluate_run(config=None):
  """--mode=eval: prints (and appends to DIR/eval.jsonl) the latest checkpoint's validation loss
  (with --config, the released weights of its train.init_from while DIR has no checkpoint)."""
  if FLAGS.eval_batches < 0:
    raise UsageError(f'--eval_batches={FLAGS.eval_batches} must be >= 0')
  from kimijax.train.evaluate import evaluate_run as run_eval

  r = run_eval(FLAGS.workdir, FLAGS.eval_batches or None, config, FLAGS.param_dtype)
  print(
    f'step {r["step"]}: eval loss {r["eval_loss"]:.4f} nats/token over {r["eval_batches"]} validation '
    f'batches ({r["tokens"]:,} tokens); appended to {pathlib.Path(FLAGS.workdir) / "eval.jsonl"}'
  )
  buckets = zip(r['position_buckets'], r['loss_by_position'])
  print('by context length (tokens): ' + ', '.join(f'{a + 1}-{b + 1} {_fmt(loss)}' for (a, b), loss in buckets))


def _fmt(x) -> str:
  return 'n/a' if x is None else f'{x:.4f}'


if __name__ == '__main__':
  app.run(main)
