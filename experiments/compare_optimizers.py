"""AdamW vs Muon vs MuonClip on one config: loss against step and against training FLOPs.

    python experiments/compare_optimizers.py --config=configs/default.py [--config.train.steps=300] \
        [--optimizers=adamw,muon,muonclip] [--out=runs/compare_optimizers] [--report=experiments/results]

Trains the same config (same seed, data order and lr schedule) once per optimizer with
kimijax.train.loop.train, each in OUT/<optimizer> (metrics.jsonl; checkpoints are deleted after
each run unless --keep_checkpoints), then writes REPORT/compare_optimizers.png (train and eval
loss against step and against FLOPs) and REPORT/compare_optimizers.md (final train/eval loss,
tokens, time, max logit, clipped heads, update RMS per group). Workdirs default to runs/ (git-
ignored) so that no checkpoint lands in the tracked tree. An existing OUT/<optimizer> with a
finished run is reused (train() resumes and does nothing), so a report can be redrawn cheaply.

FLOPs per step = model FLOPs (6 N + 6 L_attn T d per token, as experiments/bench_train.py
counts them) x tokens + the optimizer's Newton-Schulz FLOPs (Muon: per matrix [A, B] with
m = min, n = max, ns_steps x (4 m^2 n + 2 m^3)); AdamW's elementwise work is not counted.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shutil
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

config_flags.DEFINE_config_file('config', str(ROOT / 'configs/default.py'), 'config file', lock_config=True)
flags.DEFINE_list('optimizers', ['adamw', 'muon', 'muonclip'], 'optimizer.name values to compare')
flags.DEFINE_string('out', str(ROOT / 'runs/compare_optimizers'), 'workdirs OUT/<optimizer>')
flags.DEFINE_string('report', str(ROOT / 'experiments/results'), 'where the .md and .png go')
flags.DEFINE_bool('keep_checkpoints', False, 'keep OUT/<optimizer>/checkpoints')
FLAGS = flags.FLAGS


def model_flops_per_token(config, n_params: int) -> float:
  m = config.model
  from kimijax.config import layer_kinds
  n_matmul = n_params if m.tie_embeddings else n_params - m.vocab_size * m.d_model
  return 6.0 * n_matmul + 6.0 * layer_kinds(m).count('A') * config.train.seq_len * m.d_model


def ns_flops_per_step(config, abstract_params) -> float:
  """Newton-Schulz FLOPs of one Muon step over all Muon matrices (0 for AdamW)."""
  import jax
  from kimijax.optim import factory
  routing = factory.routing(config)
  if routing is None:
    return 0.0
  total = 0.0
  for leaf, route in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(routing.routes(abstract_params))):
    if route.rule == 'muon':
      s, a, b = route.view.sizes(leaf.shape)
      m, n = min(a, b), max(a, b)
      total += s * config.optimizer.ns_steps * (4.0 * m * m * n + 2.0 * m ** 3)
  return total


def rms_over_lr(logged: list[dict], key: str) -> float:
  """Mean of update RMS / lr over logged steps with lr > 0 (NaN when the group is absent)."""
  values = [x[key] / x['lr'] for x in logged if key in x and x['lr'] > 0]
  return sum(values) / len(values) if values else float('nan')


def fmt(x: float) -> str:
  return '-' if x != x else f'{x:.3f}'


def run_one(config, name: str, workdir: pathlib.Path) -> dict:
  """Trains `config` with optimizer `name` in `workdir`, or reuses a finished run there (one
  whose summary.json matches the config), so that the report can be redrawn without training."""
  from kimijax.train.loop import train
  from kimijax.train.metrics import read_metrics
  c = config.copy_and_resolve_references()
  c.optimizer.name = name
  c.train.plot = False
  done = workdir / 'summary.json'
  if done.exists() and json.loads(done.read_text()).get('config') == json.loads(c.to_json()):
    summary = json.loads(done.read_text())
    print(f'{name}: reusing the finished run in {workdir}', flush=True)
  else:
    if workdir.exists():    # a partial or different run: start over (its checkpoints may be gone)
      shutil.rmtree(workdir)
    t0 = time.time()
    summary = train(c, workdir)
    summary.update(wall=time.time() - t0, config=json.loads(c.to_json()))
    done.write_text(json.dumps(summary, indent=1))
    print(f'{name}: done in {summary["wall"]:.0f} s', flush=True)
  if not FLAGS.keep_checkpoints:
    shutil.rmtree(workdir / 'checkpoints', ignore_errors=True)
  return {'summary': summary, 'records': read_metrics(workdir), 'config': c}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)   # orbax logs every checkpoint step at INFO
  import jax
  import jax.numpy as jnp
  import numpy as np
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from kimijax.model import Transformer

  config = FLAGS.config
  out, report = pathlib.Path(FLAGS.out), pathlib.Path(FLAGS.report)
  report.mkdir(parents=True, exist_ok=True)
  model = Transformer(config.model)
  abstract = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, config.train.seq_len), jnp.int32))['params'],
                            jax.random.key(0))
  import flax.linen as nn
  abstract = nn.unbox(abstract)
  n_params = sum(x.size for x in jax.tree.leaves(abstract))
  tokens_per_step = config.train.batch_size * config.train.seq_len
  model_flops_step = model_flops_per_token(config, n_params) * tokens_per_step

  runs = {}
  for name in FLAGS.optimizers:
    runs[name] = run_one(config, name, out / name)
    runs[name]['ns_flops_step'] = ns_flops_per_step(runs[name]['config'], abstract)
  wall = sum(r['summary']['wall'] for r in runs.values())

  fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
  rows = []
  for i, (name, r) in enumerate(runs.items()):
    flops_step = model_flops_step + r['ns_flops_step']
    train_pts = [(x['step'], x['loss']) for x in r['records'] if 'loss' in x]
    eval_pts = [(x['step'], x['eval_loss']) for x in r['records'] if 'eval_loss' in x]
    color = f'C{i}'
    style = ':' if name == 'muonclip' else '-'   # muonclip follows muon until the first clip
    for ax, scale in ((axes[0], 1.0), (axes[1], flops_step)):
      s, l = np.array(train_pts).T
      ax.plot(s * scale, l, style, color=color, alpha=0.6, lw=1.2, label=f'{name} train')
      if eval_pts:
        es, el = np.array(eval_pts).T
        ax.plot(es * scale, el, 'o' + style, color=color, ms=5, lw=2, label=f'{name} eval')
    logged = [x for x in r['records'] if 'loss' in x]
    if any('max_logit' in x for x in logged):
      axes[2].plot([x['step'] for x in logged], [x['max_logit'] for x in logged], style, color=color,
                   lw=1.5, label=name)
    last = logged[-1]
    rows.append({
        'optimizer': name,
        'final_train': np.mean([x['loss'] for x in logged[-5:]]),
        'final_eval': eval_pts[-1][1] if eval_pts else float('nan'),
        'best_eval': min(e for _, e in eval_pts) if eval_pts else float('nan'),
        'tokens': last['tokens'],
        'seconds': r['summary']['seconds'],
        'tok_s': np.median([x['tokens_per_sec'] for x in logged if x.get('tokens_per_sec')]),
        'flops': flops_step * last['step'],
        'ns_share': r['ns_flops_step'] / flops_step,
        'max_logit_final': last.get('max_logit', float('nan')),
        'max_logit_peak': max(x.get('max_logit', float('nan')) for x in logged),
        'clipped': sum(x.get('qk_clip_heads', 0) for x in logged),
        'rms_muon': rms_over_lr(logged, 'update_rms_muon'),
        'rms_adamw': rms_over_lr(logged, 'update_rms_adamw'),
    })
  for ax, xlabel in ((axes[0], 'step'), (axes[1], 'training FLOPs (model + Newton-Schulz)')):
    ax.set_xlabel(xlabel)
    ax.set_ylabel('loss (nats/byte)')
    ax.grid(alpha=0.3)
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
  axes[1].set_xscale('log')
  axes[0].legend(fontsize=8)
  if 'muonclip' in runs:
    axes[2].axhline(config.optimizer.qk_clip_tau, color='gray', ls='--', lw=1, label='tau (muonclip)')
  axes[2].set(xlabel='step', ylabel='max logit (all heads and layers)', yscale='log')
  axes[2].grid(alpha=0.3)
  axes[2].legend(fontsize=8)
  fig.suptitle(f'{pathlib.Path(sys.argv[0]).name}: {n_params / 1e6:.2f}M params, {config.train.steps} steps')
  png = report / 'compare_optimizers.png'
  fig.savefig(png, dpi=110, bbox_inches='tight')
  plt.close(fig)

  command = 'python ' + ' '.join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
  cpu = platform.processor() or platform.machine()
  lines = [
      '# AdamW vs Muon vs MuonClip',
      '',
      f'Date: {datetime.date.today().isoformat()}. Hardware: {os.cpu_count()}-core CPU ({cpu}), '
      f'{jax.device_count()} JAX device(s) ({jax.devices()[0].platform}), shared with other jobs; '
      f'jax {jax.__version__}. Wall time of the {len(runs)} runs: {wall:.0f} s.',
      '',
      'Command:',
      '',
      f'    {command}',
      '',
      f'Model: {n_params / 1e6:.2f}M parameters, d_model {config.model.d_model}, {config.model.num_layers} layers, '
      f'{config.model.num_heads} heads; {config.train.steps} steps of {tokens_per_step:,} tokens; '
      f'lr {config.optimizer.learning_rate} ({config.optimizer.schedule}, warmup {config.optimizer.warmup_steps}), '
      f'weight decay {config.optimizer.weight_decay}, grad clip {config.train.grad_clip}; muon: momentum '
      f'{config.optimizer.momentum}, NS {config.optimizer.ns_steps} steps in {config.optimizer.ns_dtype}, '
      f'rms_scale {config.optimizer.rms_scale}; muonclip tau {config.optimizer.qk_clip_tau}. '
      'Same seed, data order and schedule for every optimizer (same lr for all, as Moonlight\'s '
      'RMS matching intends).',
      '',
      '| optimizer | final train loss (mean of last 5 logs) | final eval loss | best eval loss | tokens | '
      'train time (s) | tokens/s | training FLOPs | NS share of FLOPs | max logit (final / peak) | '
      'heads clipped (sum over logged steps) | update RMS / lr: muon, adamw |',
      '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    lines.append(
        f"| {r['optimizer']} | {r['final_train']:.4f} | {r['final_eval']:.4f} | {r['best_eval']:.4f} | "
        f"{r['tokens']:,} | {r['seconds']:.0f} | {r['tok_s']:,.0f} | {r['flops']:.3g} | {100 * r['ns_share']:.1f}% | "
        f"{r['max_logit_final']:.2f} / {r['max_logit_peak']:.2f} | {r['clipped']} | "
        f"{fmt(r['rms_muon'])}, {fmt(r['rms_adamw'])} |")
  lines += [
      '',
      f'![loss vs step and FLOPs]({png.name})',
      '',
      'Update RMS / lr is the RMS of each group\'s parameter change divided by that step\'s lr, averaged '
      'over the logged steps with lr > 0 (for adamw every parameter is in the adamw group). '
      'Training FLOPs count 6 N + 6 L T d per token plus Muon\'s Newton-Schulz matmuls per step. '
      'Times include compilation of the first step and the eval passes; tokens/s is the median '
      'logged rate. The machine is shared, so times are indicative only.',
  ]
  md = report / 'compare_optimizers.md'
  md.write_text('\n'.join(lines) + '\n')
  (out / 'rows.json').write_text(json.dumps(rows, indent=1, default=float))
  print(md.read_text())
  print(f'wrote {md} and {png}')


if __name__ == '__main__':
  app.run(main)
