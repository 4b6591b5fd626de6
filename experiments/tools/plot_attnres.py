"""Attention Residuals analysis figures from trained runs (depth weights as in the AttnRes report's
Figure 8, and per-sublayer RMS for the PreNorm-dilution comparison).

    python -m experiments.tools.plot_attnres --workdir=runs/block [--workdir=runs/standard ...] \
        [--batches=4] [--out=DIR]

For each workdir: reads config.json and the latest checkpoint (restored onto one device), runs
--batches validation batches through Transformer(..., log_attnres=True) and averages the
statistics over them. Writes into --out (default: the first workdir):
  attnres_weights_<run>.png  heat-map of the mean depth-attention weight of each consumer (rows:
                             sublayers in order, then the final aggregator) on each source
                             (columns: embedding, then sublayer outputs or block sums); AttnRes
                             runs only. Blank cells: sources a consumer does not see.
  attnres_rms.png            RMS of each sublayer's output and of each consumer's input against
                             depth, one line per run (a standard run shows the growing hidden
                             state that AttnRes avoids).
  attnres_stats.json         the averaged numbers behind both figures.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
from absl import app, flags, logging

from experiments.cli import usage_error

flags.DEFINE_multi_string('workdir', None, 'run folder(s) with config.json and checkpoints/')
flags.DEFINE_integer('batches', 4, 'validation batches to average over')
flags.DEFINE_string('out', None, 'output folder (default: the first --workdir)')
FLAGS = flags.FLAGS


def collect_stats(workdir: str | pathlib.Path, batches: int = 4) -> dict:
  """{'residual', 'input_rms' [L+1], 'output_rms' [L], 'weights' [L+1, S] (AttnRes), 'step'} as
  NumPy float64, averaged over `batches` validation batches of the latest checkpoint."""
  import jax

  from kimijax.data import eval_batches
  from kimijax.model import Transformer, as_variables, inference_variables
  from kimijax.parallel import mesh as mesh_lib
  from kimijax.train.checkpoint import load_run_config, restore_latest_weights
  from kimijax.train.step import in_mesh

  workdir = pathlib.Path(workdir)
  config = load_run_config(workdir)
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  model = Transformer(config.model, log_attnres=True)
  params, moe_state, step = restore_latest_weights(workdir, config, model, mesh)
  params = inference_variables(params, moe_state)  # with the MoE biases, if any

  forward = jax.jit(
    lambda p, x: model.apply(as_variables(p), x)[1]['attnres'],
    in_shardings=(jax.tree.map(lambda x: x.sharding, params), mesh_lib.batch_sharding(mesh, config.mesh)),
  )
  forward = in_mesh(forward, mesh, config.mesh)
  runs = [
    jax.device_get(forward(params, b['inputs']))
    for b in eval_batches(config, batches, process_index=0, process_count=1)
  ]
  stats = {'residual': config.model.residual, 'step': int(step)}
  for key in ('input_rms', 'output_rms'):  # equal-sized batches: the RMS over all of them
    stats[key] = np.sqrt(np.mean([np.asarray(r[key], np.float64) ** 2 for r in runs], axis=0))
  if 'weights' in runs[0]:
    stats['weights'] = np.mean([np.asarray(r['weights'], np.float64) for r in runs], axis=0)
  return stats


def _sublayer_names(n: int) -> list[str]:
  return [f'{i // 2}.{"mix" if i % 2 == 0 else "mlp"}' for i in range(n)]


def _source_names(residual: str, width: int, num_sublayers: int) -> list[str]:
  if residual == 'attnres_full':
    return ['emb'] + _sublayer_names(num_sublayers)[: width - 1]
  return ['emb'] + [f'b{j}' for j in range(1, width)]


def plot(stats_by_run: dict[str, dict], out_dir: str | pathlib.Path) -> list[pathlib.Path]:
  """Writes the figures and attnres_stats.json into out_dir; returns their paths."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  for run, s in stats_by_run.items():
    if 'weights' not in s:
      continue
    w = s['weights']
    n_sub = len(s['output_rms'])
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 + 0.42 * w.shape[1]), 1.0 + 0.32 * w.shape[0]))
    image = ax.imshow(np.ma.masked_invalid(w), cmap='viridis', vmin=0.0, vmax=1.0, aspect='auto')
    ax.set_xticks(range(w.shape[1]), _source_names(s['residual'], w.shape[1], n_sub), rotation=90)
    ax.set_yticks(range(w.shape[0]), _sublayer_names(n_sub) + ['final'])
    if w.size <= 400:
      for (r, c), value in np.ndenumerate(w):
        if np.isfinite(value):
          ax.text(c, r, f'{value:.2f}', ha='center', va='center', fontsize=6, color='white' if value < 0.5 else 'black')
    ax.set_xlabel('source')
    ax.set_ylabel('consumer (layer.sublayer)')
    ax.set_title(f'{run}: mean depth-attention weights\n({s["residual"]}, step {s["step"]})', fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04)
    path = out_dir / f'attnres_weights_{run}.png'
    fig.savefig(path, dpi=120, bbox_inches='tight')
    plt.close(fig)
    paths.append(path)

  fig, (ax_out, ax_in) = plt.subplots(1, 2, figsize=(11, 4))
  for run, s in stats_by_run.items():
    label = f'{run} ({s["residual"]})'
    ax_out.plot(range(len(s['output_rms'])), s['output_rms'], 'o-', ms=3, label=label)
    ax_in.plot(range(len(s['input_rms'])), s['input_rms'], 'o-', ms=3, label=label)
  ax_out.set_title('output RMS of each sublayer')
  ax_out.set_xlabel('sublayer (mixer 2i, MLP 2i+1)')
  ax_in.set_title('input RMS of each consumer (before its pre-norm)')
  ax_in.set_xlabel('consumer (sublayers, then final)')
  for ax in (ax_out, ax_in):
    ax.set_yscale('log')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  path = out_dir / 'attnres_rms.png'
  fig.savefig(path, dpi=120, bbox_inches='tight')
  plt.close(fig)
  paths.append(path)

  path = out_dir / 'attnres_stats.json'
  as_json = {
    run: {k: (np.where(np.isnan(v), None, v).tolist() if isinstance(v, np.ndarray) else v) for k, v in s.items()}
    for run, s in stats_by_run.items()
  }
  path.write_text(json.dumps(as_json, indent=1))
  paths.append(path)
  return paths


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  if not FLAGS.workdir:
    usage_error('give at least one --workdir')
  from kimijax.config import ConfigError
  from kimijax.data import DataError
  from kimijax.train.checkpoint import CheckpointError

  stats = {}
  for workdir in FLAGS.workdir:
    name = pathlib.Path(workdir).resolve().name
    try:  # a folder that is not a run, or a run without a checkpoint: one message, no traceback
      stats[name if name not in stats else f'{name}_{len(stats)}'] = collect_stats(workdir, FLAGS.batches)
    except (CheckpointError, ConfigError, DataError) as e:
      sys.exit(f'{type(e).__name__}: --workdir={workdir}: {e}')
  for path in plot(stats, FLAGS.out or FLAGS.workdir[0]):
    print(path)


if __name__ == '__main__':
  app.run(main)
