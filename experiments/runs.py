"""One training run of a workflow (sweep, ladder, ablation): train it in its own folder through
kimijax.train.loop.train (the run.py path), resume it when half finished, reuse it when finished,
and read back the figures a report needs. Nothing here deletes a run.

A run folder holds what train() writes (config.json, metrics.jsonl, checkpoints/, loss.png,
loss_by_position.png) and, once train() has returned, done.json (its summary and wall time).
A folder that holds a run of a different model or optimizer is an error naming the keys that
differ, never overwritten; any other change (a longer train.steps, say) continues or reuses the run
with a notice, by the rule run.py applies on resume (kimijax.train.checkpoint.resume_differences).

Also the provenance of what a workflow or benchmark prints: provenance() for a report's header,
bench_provenance() / print_header() for the header line every benchmark in experiments/bench/ prints.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time

import ml_collections


class WorkflowError(ValueError):
  """A workflow input that cannot be used (bad sweep key or value, a run folder holding another
  config, an unknown ladder or variant); the message names the key or path."""


def flatten(d: dict) -> dict:
  """{'a': {'b': 1}} -> {'a.b': 1}; tuples become lists, as in JSON (the checkpoint's own helper)."""
  from kimijax.train.checkpoint import _flatten

  return _flatten(d)


def config_json(config: ml_collections.ConfigDict) -> dict:
  return json.loads(config.to_json())


def set_key(config: ml_collections.ConfigDict, key: str, value) -> None:
  """config['a.b.c'] = value for a key that exists; WorkflowError naming the key otherwise."""
  *groups, name = key.split('.')
  node = config
  for g in groups:
    if g not in node or not isinstance(node[g], ml_collections.ConfigDict):
      raise WorkflowError(f'unknown config key {key!r}: no group {g!r}')
    node = node[g]
  if name not in node or isinstance(node[name], ml_collections.ConfigDict):
    raise WorkflowError(f'unknown config key {key!r}; keys here: {sorted(node.keys())}')
  node[name] = value


def with_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """A copy of config with {'group.key': value} applied (each key must exist)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    for key, value in overrides.items():
      set_key(c, key, value)
  return c


def check_folder(run_dir: pathlib.Path, config: ml_collections.ConfigDict) -> list[str]:
  """WorkflowError if run_dir already holds a run of another model or optimizer; else the notices
  of the keys that changed since it was saved (a longer train.steps continues the run). The rule
  is run.py's on resume: kimijax.train.checkpoint.resume_differences. A key the saved config lacks
  (added to the schema after the run) matches its default, as on checkpoint restore."""
  from kimijax.train.checkpoint import resume_differences

  saved = run_dir / 'config.json'
  if not saved.exists():
    return []
  errors, notices = resume_differences(json.loads(saved.read_text()), config, since='the run was saved')
  if errors:
    raise WorkflowError(
      f'{run_dir} holds a run of another config ({"; ".join(errors[:6])}'
      f'{"; ..." if len(errors) > 6 else ""}); use another --workdir, or move that run '
      'away yourself (nothing is deleted for you)'
    )
  return notices


def is_finished(run_dir: pathlib.Path) -> bool:
  return (run_dir / 'done.json').exists()


def finished_steps(run_dir: pathlib.Path) -> int | None:
  """The train.steps a finished run reached (its done.json), or None if it is not finished."""
  if not is_finished(run_dir):
    return None
  return json.loads((run_dir / 'done.json').read_text()).get('steps')


def train_run(
  config: ml_collections.ConfigDict,
  run_dir: str | pathlib.Path,
  *,
  devices=None,
  quiet: bool = False,
  drop_checkpoints: bool = False,
) -> dict:
  """Trains config in run_dir on `devices` (default all; resuming a half-finished run) unless it is
  finished; returns the run's figures (read_run). Raises WorkflowError before any compute if run_dir
  holds another model or optimizer (check_folder). A finished run is reused, or continued when
  train.steps is now larger (as run.py continues it); one that went past a smaller train.steps is
  reused as it is. drop_checkpoints=True (asked for on the command line, to carry a workdir between
  machines) removes the run's checkpoints once it is finished; its figures stay."""
  from kimijax.train.loop import train

  run_dir = pathlib.Path(run_dir)
  notices = check_folder(run_dir, config)
  done_steps = finished_steps(run_dir)
  if done_steps is not None and done_steps < config.train.steps:
    if not any((run_dir / 'checkpoints').glob('[0-9]*')):
      raise WorkflowError(
        f'{run_dir} finished at step {done_steps} and holds no checkpoint to continue it to train.steps='
        f'{config.train.steps} (removed by --drop_finished_checkpoints?); move that run away to train it again'
      )
    print(f'{run_dir}: finished at step {done_steps}; continuing it to train.steps={config.train.steps}', flush=True)
    (run_dir / 'done.json').unlink()
  if not is_finished(run_dir):
    stale = run_dir / 'metrics.jsonl'
    if stale.exists() and not any((run_dir / 'checkpoints').glob('[0-9]*')):
      # A run interrupted before its first checkpoint (or whose checkpoints were not carried
      # over) starts again from step 0: keep its lines aside so that the new curve is not appended.
      kept = stale.with_name(f'metrics.interrupted-{int(time.time())}.jsonl')
      os.replace(stale, kept)
      print(f'{run_dir}: no checkpoint to resume from; starting again (earlier lines kept in {kept.name})', flush=True)
    began = time.time()
    summary = train(config, run_dir, devices=devices)
    # Where and on what data it ran, so that a report written on another machine (a ladder brought
    # back from a GPU) states the run's hardware and epochs, not its own.
    summary.update(wall_seconds=time.time() - began, hardware=hardware(), train_split_tokens=train_split_tokens(config))
    tmp = run_dir / 'done.json.tmp'
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    os.replace(tmp, run_dir / 'done.json')
    if drop_checkpoints:
      import shutil

      shutil.rmtree(run_dir / 'checkpoints', ignore_errors=True)
  else:
    if not quiet:
      print(f'{run_dir}: finished earlier, reused', flush=True)
      for notice in notices:
        print(f'{run_dir}: notice: {notice}', flush=True)
    if done_steps is not None and done_steps != config.train.steps:  # went past a smaller train.steps
      config = with_overrides(config, {'train.steps': done_steps})
  return read_run(config, run_dir)


def train_split_tokens(config: ml_collections.ConfigDict) -> int | None:
  """Tokens in the training split of config's data, in its tokenizer's ids (None for the endless
  synthetic MQAR; shards: their manifest's count)."""
  from kimijax.data import pipeline

  return pipeline.split_num_tokens(config, 'train')


def read_run(config: ml_collections.ConfigDict, run_dir: str | pathlib.Path) -> dict:
  """The figures of a finished run from its metrics.jsonl: final train loss (the last logged step,
  not an average), final eval loss and accuracy (the eval at the last step; on MQAR the recall
  accuracy), tokens, training FLOPs (kimijax.train.flops), median logged tokens/s, max logit
  (final and peak), with MoE layers the last logged moe_load_max_mean (docs/moe.md#metrics), epochs
  of the training split seen, and the curves (the MoE loads' too: [] for a dense model)."""
  from kimijax.train import flops as flops_lib
  from kimijax.train.metrics import read_metrics

  run_dir = pathlib.Path(run_dir)
  records = read_metrics(run_dir)
  t = config.train
  logged = [r for r in records if 'loss' in r]
  evals = [r for r in records if 'eval_loss' in r]
  if not logged or not evals or evals[-1]['step'] != t.steps:
    raise WorkflowError(
      f'{run_dir}/metrics.jsonl does not reach step {t.steps} with an eval; '
      'the run is not finished (re-run the same command to resume it)'
    )
  step_flops = flops_lib.training_flops_per_step(config)
  tokens = t.steps * t.batch_size * t.seq_len
  rates = [r['tokens_per_sec'] for r in logged if r.get('tokens_per_sec')]
  max_logits = [r['max_logit'] for r in logged if 'max_logit' in r]
  loads = [(r['step'], r['moe_load_max_mean']) for r in logged if 'moe_load_max_mean' in r]
  done = json.loads((run_dir / 'done.json').read_text()) if is_finished(run_dir) else {}
  split = done['train_split_tokens'] if 'train_split_tokens' in done else train_split_tokens(config)
  last_eval = evals[-1]
  accuracy_key = 'eval_recall_accuracy' if 'eval_recall_accuracy' in last_eval else 'eval_accuracy'
  return {
    'run_dir': str(run_dir),
    'params': step_flops['params'],
    'active_params': step_flops['active_params'],
    'steps': t.steps,
    'tokens': tokens,
    'flops': step_flops['total'] * t.steps,
    'flops_per_step': step_flops,
    'final_train_loss': logged[-1]['loss'],
    'final_eval_loss': last_eval['eval_loss'],
    'accuracy_key': accuracy_key,
    'final_accuracy': last_eval.get(accuracy_key),
    'tokens_per_sec': statistics.median(rates) if rates else None,
    'max_logit_final': max_logits[-1] if max_logits else None,
    'max_logit_peak': max(max_logits) if max_logits else None,
    'moe_load_max_mean_final': loads[-1][1] if loads else None,
    'epochs': tokens / split if split else None,
    'wall_seconds': done.get('wall_seconds'),
    'hardware': done.get('hardware'),
    'loss_by_position': {
      'buckets': last_eval.get('eval_position_buckets'),
      'loss': last_eval.get('eval_loss_by_position'),
    },
    'curves': {
      'train': [(r['step'], r['loss']) for r in logged],
      'eval': [(r['step'], r['eval_loss']) for r in evals],
      'max_logit': [(r['step'], r['max_logit']) for r in logged if 'max_logit' in r],
      'moe_load_max_mean': loads,
    },
  }


def to_json(data) -> str:
  """JSON text with NaN and infinities (an interval from too few rungs, say) written as null, so that
  any JSON reader takes the file."""
  import math

  def clean(x):
    if type(x).__module__ == 'numpy' and hasattr(x, 'item'):  # numpy scalars and arrays
      x = x.item() if getattr(x, 'ndim', 0) == 0 else x.tolist()
    if isinstance(x, float):
      return x if math.isfinite(x) else None
    if isinstance(x, dict):
      return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    return x

  return json.dumps(clean(data), indent=1, default=str, allow_nan=False)


def _device_kind() -> str:
  import jax

  dev = jax.devices()[0]
  return dev.device_kind if dev.platform != 'cpu' else f'CPU ({platform.machine() or "unknown"})'


def devices_text() -> str:
  """'<device kind> x <count>' of this process's JAX devices."""
  import jax

  return f'{_device_kind()} x {jax.device_count()}'


def hardware() -> str:
  """'<device kind> x <count> JAX device(s), <n>-core host, jax <version>'."""
  import jax

  return f'{devices_text()} JAX device(s), {os.cpu_count()}-core host, jax {jax.__version__}'


def utc_now() -> str:
  return datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')


def command() -> str:
  """This process's command line as run, a script of this repository as its module
  ('python -m experiments.bench.bench_kda --batch=1'), each argument shell-quoted."""
  argv = [sys.argv[0]] + sys.argv[1:]
  if argv[0].endswith('.py'):
    module = pathlib.Path(argv[0]).resolve()
    root = pathlib.Path(__file__).resolve().parents[1]
    if module.is_relative_to(root):
      argv[0] = '-m ' + '.'.join(module.relative_to(root).with_suffix('').parts)
  return 'python ' + ' '.join([argv[0]] + [shlex.quote(a) for a in argv[1:]])


def provenance() -> dict:
  """Date, hardware and the command line of this process, for a report's header."""
  return {'date': utc_now(), 'hardware': hardware(), 'command': command()}


def package_version(name: str) -> str:
  """The installed version of a package, by its distribution name or its import name ('fla' for
  flash-linear-attention); 'not installed' if neither is installed. Imports nothing."""
  from importlib import metadata

  for dist in [name, *metadata.packages_distributions().get(name, [])]:
    try:
      return metadata.version(dist)
    except metadata.PackageNotFoundError:
      continue
  return 'not installed'


def bench_provenance(packages: tuple[str, ...] | list[str] = (), *, devices_from: dict | None = None) -> dict:
  """A benchmark's provenance, in its header's order: date (UTC), command (as run, normalised as in
  command()), jax's version, 'packages' {name: version or 'not installed'} of the optional packages
  the run uses, backend, device ('<kind> x <count>') and host name. devices_from: the provenance of
  the process that ran on the devices (a benchmark's subprocess), whose backend and device are
  taken ('unknown' where it lacks them) so that this process does not start JAX on them."""
  if devices_from is None:
    import jax

    backend, device = jax.default_backend(), devices_text()
  else:
    backend, device = devices_from.get('backend', 'unknown'), devices_from.get('device', 'unknown')
  return {
    'date': utc_now(),
    'command': command(),
    'jax': package_version('jax'),
    'packages': {name: package_version(name) for name in packages},
    'backend': backend,
    'device': device,
    'host': platform.node() or 'unknown',
  }


def header_line(prov: dict) -> str:
  """bench_provenance's fields on one line, in its order:
  'date 2026-12-01 14:03 UTC; command `python -m ...`; jax 0.11.2; tokamax 0.0.17; backend gpu;
  device NVIDIA H200 x 1; host NAME'."""
  fields = [f'date {prov["date"]}', f'command `{prov["command"]}`', f'jax {prov["jax"]}']
  fields += [f'{name} {version}' for name, version in prov['packages'].items()]
  fields += [f'backend {prov["backend"]}', f'device {prov["device"]}', f'host {prov["host"]}']
  return '; '.join(fields)


def print_header(packages: tuple[str, ...] | list[str] = (), *, devices_from: dict | None = None) -> dict:
  """Prints a benchmark's header line (header_line of bench_provenance) and returns the provenance,
  for its JSON. A benchmark prints its own settings on the next line."""
  prov = bench_provenance(packages, devices_from=devices_from)
  print(header_line(prov), flush=True)
  return prov


def mean_spread(values: list[float]) -> tuple[float, float | None]:
  """(mean, sample standard deviation; None for a single value)."""
  values = [v for v in values if v is not None]
  if not values:
    return float('nan'), None
  return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def fmt_mean(values: list[float], digits: int = 4) -> str:
  """'1.2345 ± 0.0123' over seeds, or '1.2345' for one."""
  mean, spread = mean_spread(values)
  if mean != mean:
    return '-'
  return f'{mean:.{digits}f}' + (f' ± {spread:.{digits}f}' if spread is not None else '')


def check_outputs(workdir: str | pathlib.Path, publish: str | None = None) -> None:
  """Before any training: WorkdirError if `workdir` cannot be a folder, WorkflowError if the
  --publish prefix's folder cannot (a file in the way)."""
  from kimijax.train.lock import check_workdir

  check_workdir(workdir)
  if publish:
    folder = pathlib.Path(publish).absolute().parent
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
      raise WorkflowError(f'--publish={publish}: {existing} is a file, not a folder')


def publish(files: dict[str, pathlib.Path], dest_prefix: str | pathlib.Path) -> list[pathlib.Path]:
  """Copies {suffix: file} to dest_prefix + suffix (e.g. experiments/results/NAME.md); the Markdown
  file's links to the others are rewritten to their new names."""
  dest_prefix = pathlib.Path(dest_prefix)
  dest_prefix.parent.mkdir(parents=True, exist_ok=True)
  renames = {src.name: dest_prefix.name + suffix for suffix, src in files.items()}
  out = []
  for suffix, src in files.items():
    dest = dest_prefix.parent / (dest_prefix.name + suffix)
    if suffix.endswith('.md'):
      text = src.read_text()
      for old, new in renames.items():
        text = text.replace(f']({old})', f']({new})')
      dest.write_text(text)
    else:
      dest.write_bytes(src.read_bytes())
    out.append(dest)
  return out
