"""metrics.jsonl, TensorBoard events and the loss-curve PNG; only process 0 writes."""

from __future__ import annotations

import json
import os
import pathlib

import jax


class MetricsWriter:
  """Appends one JSON object per logged step to DIR/metrics.jsonl and mirrors scalars to
  TensorBoard (DIR/tensorboard)."""

  def __init__(self, workdir: str | pathlib.Path, *, resume_step: int | None = None):
    self.path = pathlib.Path(workdir) / 'metrics.jsonl'
    self.enabled = jax.process_index() == 0
    self._tb = None
    if not self.enabled:
      return
    if resume_step is not None:
      self._drop_after(resume_step)
    from tensorboardX import SummaryWriter

    # purge_step: TensorBoard drops the interrupted run's events after the restored step, as
    # _drop_after does for metrics.jsonl, so no step appears twice.
    self._tb = SummaryWriter(
      str(pathlib.Path(workdir) / 'tensorboard'), purge_step=resume_step + 1 if resume_step is not None else None
    )

  def _drop_after(self, step: int) -> None:
    """On resume, drop lines logged after the restored step by the interrupted run, so the
    file holds one continuous curve. Rewritten through a temporary file and a rename."""
    if not self.path.exists():
      return
    keep = [l for l in self.path.read_text().splitlines() if l.strip() and json.loads(l)['step'] <= step]
    tmp = self.path.with_suffix('.jsonl.tmp')
    tmp.write_text(''.join(l + '\n' for l in keep))
    os.replace(tmp, self.path)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    with self.path.open('a') as f:
      f.write(json.dumps(record) + '\n')
    for key, value in record.items():
      if key != 'step' and isinstance(value, (int, float)):
        self._tb.add_scalar(key, value, record['step'])
      elif key == 'eval_loss_by_position':  # one scalar per bucket, named by its positions
        for (first, last), loss in zip(record['eval_position_buckets'], value):
          if loss is not None:
            self._tb.add_scalar(f'eval_loss_by_position/{first:06d}-{last:06d}', loss, record['step'])

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


# metrics.jsonl keys of each MoE layer's statistics (the train step's metrics['moe'][layer]).
MOE_KEYS = {
  'load_max_over_mean': 'moe_load_max_mean',  # max / mean of the (token, k) rows per expert; 1 = balanced
  'load_cv': 'moe_load_cv',  # std / mean of the loads
  'router_entropy': 'moe_router_entropy',  # mean entropy (nats) of the normalised scores; log E = uniform
  'bias_range': 'moe_bias_range',  # max - min of the balancing bias after the step
  'aux_loss': 'moe_aux_loss',  # the layer's sequence-wise balance loss (model.moe.aux_loss_alpha > 0)
}


def moe_record(moe: dict, aux_loss) -> dict:
  """The metrics.jsonl entries of the MoE layers: per layer '<MOE_KEYS value>_<layer>' (e.g.
  moe_load_max_mean_layer_3), and over the layers moe_load_max_mean (the largest) and, when the
  balance loss is on, moe_aux_loss (the sum the loss adds). A balance loss that is off is 0.0
  and is not written."""
  on = float(aux_loss) != 0.0
  record = {'moe_aux_loss': float(aux_loss)} if on else {}
  worst = 0.0
  for layer, stats in moe.items():
    for name, key in MOE_KEYS.items():
      if name in stats and (name != 'aux_loss' or on):
        record[f'{key}_{layer}'] = float(stats[name])
    worst = max(worst, float(stats['load_max_over_mean']))
  record['moe_load_max_mean'] = worst
  return record


def read_metrics(workdir: str | pathlib.Path) -> list[dict]:
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def plot_loss_curve(workdir: str | pathlib.Path, title: str | None = None) -> pathlib.Path:
  """DIR/loss.png: train loss and eval loss against step, under `title`."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  records = read_metrics(workdir)
  train = [(r['step'], r['loss']) for r in records if 'loss' in r]
  evals = [(r['step'], r['eval_loss']) for r in records if 'eval_loss' in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  if train:
    ax.plot(*zip(*train), label='train loss')
  if evals:
    ax.plot(*zip(*evals), 'o-', label='eval loss')
  if title:
    ax.set_title(title, fontsize=10)
  ax.set_xlabel('step')
  ax.set_ylabel('nats per token')
  ax.grid(alpha=0.3)
  ax.legend()
  out = pathlib.Path(workdir) / 'loss.png'
  fig.savefig(out, dpi=110, bbox_inches='tight')
  plt.close(fig)
  return out


def plot_loss_by_position(workdir: str | pathlib.Path) -> pathlib.Path:
  """DIR/loss_by_position.png: eval loss against token position (log axis, one point per bucket
  at its last position), one line per eval step, later steps darker."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  evals = [r for r in read_metrics(workdir) if 'eval_loss_by_position' in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, r in enumerate(evals):
    points = [
      (last + 1, loss)
      for (_, last), loss in zip(r['eval_position_buckets'], r['eval_loss_by_position'])
      if loss is not None
    ]
    if points:
      shade = plt.cm.viridis(0.15 + 0.8 * i / max(len(evals) - 1, 1))
      ax.plot(*zip(*points), 'o-', ms=3, color=shade, label=f'step {r["step"]}')
  ax.set_xscale('log', base=2)
  ax.set_xlabel('token position (tokens of context seen, bucket end)')
  ax.set_ylabel('eval loss (nats per token)')
  ax.grid(alpha=0.3)
  if evals:
    ax.legend(fontsize=7, ncol=2)
  out = pathlib.Path(workdir) / 'loss_by_position.png'
  fig.savefig(out, dpi=110, bbox_inches='tight')
  plt.close(fig)
  return out
