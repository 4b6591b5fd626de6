"""The loss, one pure train step and one eval step, jitted once with explicit shardings."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding

from kimijax import optim
from kimijax.layers.moe import MOE_STATS, moe_aux_loss, moe_metrics, update_moe_state
from kimijax.model import Transformer, as_variables, document_inputs, inference_variables, variables
from kimijax.optim import make_optimizer, make_schedule
from kimijax.optim.qk_clip import heads_clipped
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.loss import chunked_token_nll, nll_and_hits
from kimijax.train.state import TrainState, init_state, state_shardings


def _outputs_to_nll(model: nn.Module, loss_chunk: int, accuracy: bool = False):
  """(outputs of model.apply, targets [B, T]) -> per-token nll [B, T] float32 (and, with `accuracy`,
  the argmax hits [B, T] float32), and the model whose apply gives those outputs: the logits with
  loss_chunk 0, else (with Transformer(..., return_hidden=True)) the hidden states and the head, the
  nll then taken loss_chunk tokens at a time (kimijax/train/loss.py)."""
  if loss_chunk:

    def chunked(outputs, targets_bt):
      x_btd, head_dv = outputs
      return chunked_token_nll(x_btd, head_dv, targets_bt, loss_chunk, accuracy=accuracy)

    return model.clone(return_hidden=True), chunked

  return model, lambda logits_btv, targets_bt: nll_and_hits(logits_btv, targets_bt, accuracy)


def make_loss_fn(model: nn.Module, loss_chunk: int = 0):
  """(params, batch, moe_state=None) -> (loss, aux): the mean token nll over the masked tokens.
  With MoE layers (a non-empty moe_state, the model's balancing biases) the apply collects their
  router statistics as aux['moe_stats'], the loss adds their balance losses (0 when
  model.moe.aux_loss_alpha is 0) and aux['nll'] keeps the nll alone. loss_chunk (train.loss_chunk,
  a Transformer's): 0 takes the nll of the logits [B, T, V]; > 0 that many tokens' logits at a time,
  never all of them (kimijax/train/loss.py), the same loss."""
  model, nll_of = _outputs_to_nll(model, loss_chunk)

  def loss_fn(params, batch, moe_state=None):
    if moe_state:
      (outputs, aux), mutated = model.apply(
        variables(params, moe_state), batch['inputs'], mutable=[MOE_STATS], **document_inputs(batch)
      )
      aux = {**aux, 'moe_stats': mutated[MOE_STATS]}
    else:
      outputs, aux = model.apply({'params': params}, batch['inputs'], **document_inputs(batch))
    mask = batch['mask']
    nll = nll_of(outputs, batch['targets'])
    loss = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    if moe_state:
      aux['nll'] = loss
      loss = loss + moe_aux_loss(aux['moe_stats'])
    return loss, aux

  return loss_fn


def update_rms(updates, labels) -> dict:
  """{'update_rms_<group>': RMS over the group's elements of the parameter change} (lr, weight
  decay and QK-Clip included), fp32; `labels` is a pytree of group names like `updates`."""
  sums, counts = {}, {}
  for u, group in zip(jax.tree.leaves(updates), jax.tree.leaves(labels)):
    sums[group] = sums.get(group, 0.0) + jnp.sum(jnp.square(u.astype(jnp.float32)))
    counts[group] = counts.get(group, 0) + u.size
  return {f'update_rms_{g}': jnp.sqrt(sums[g] / counts[g]) for g in sorted(sums)}


def computes_max_logits(config: ml_collections.ConfigDict) -> bool:
  """Whether the forward pass computes the attention layers' max logits: for the log
  (train.log_max_logits) or for QK-Clip (optimizer.name='muonclip'), which needs them."""
  return bool(config.train.log_max_logits) or config.optimizer.name == 'muonclip'


def make_train_step(
  model,
  optimizer: optax.GradientTransformation,
  schedule: optax.Schedule,
  param_groups=None,
  *,
  bias_rate: float | None = None,
  bias_centred: bool | None = None,
  loss_chunk: int = 0,
):
  """(state, batch) -> (state, metrics). A step whose loss or gradients are not finite leaves the
  state unchanged and reports finite=False; the loop stops on it.

  With MoE layers (state.moe_state non-empty) the loss adds their balance losses and, after the
  update, each layer's balancing bias moves by kimijax.layers.moe.update_moe_state with that
  layer's loads over the global batch (`bias_rate`, `bias_centred`; None: the model config's
  model.moe.bias_rate and bias_centred), inside the same finite guard as the params.
  metrics['moe'] = {'layer_<i>': {load_max_over_mean, load_cv, router_entropy, bias_min,
  bias_max, bias_range, aux_loss}} (the bias after the step), metrics['moe_aux_loss'] the total
  balance loss, and metrics['loss'] the nll alone.

  The optimizer gets the forward pass's per-head max logits as `max_logits=` (QK-Clip uses them;
  other transforms ignore them); metrics['max_logits'] holds them when the model computes them
  (aux['max_logits']), and is absent otherwise. `param_groups` (params -> pytree of group names, e.g.
  kimijax.optim.param_groups(config)) adds update_rms_<group> to the metrics; with QK-Clip in the
  optimizer, `qk_clip_heads` is the number of query heads clipped this step. `loss_chunk`:
  train.loss_chunk (make_loss_fn)."""
  loss_fn = make_loss_fn(model, loss_chunk)
  optimizer = optax.with_extra_args_support(optimizer)
  moe_cfg = getattr(getattr(model, 'cfg', None), 'moe', None)
  if bias_rate is None:
    bias_rate = moe_cfg.bias_rate if moe_cfg is not None else 1e-3
  if bias_centred is None:
    bias_centred = bool(moe_cfg.bias_centred) if moe_cfg is not None else False

  def train_step(state: TrainState, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, state.moe_state)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params, max_logits=aux.get('max_logits'))
    moe_state = state.moe_state
    if moe_state:
      moe_state = update_moe_state(moe_state, aux['moe_stats'], rate=bias_rate, centred=bias_centred)
    new = TrainState(
      step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state, moe_state=moe_state
    )
    new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
    metrics = {'loss': aux.get('nll', loss), 'grad_norm': grad_norm, 'lr': schedule(state.step), 'finite': finite}
    if moe_state:
      metrics['moe_aux_loss'] = moe_aux_loss(aux['moe_stats'])
      layers = moe_metrics(new.moe_state, aux['moe_stats'])  # {'layer_<i>/mlp': {...}}
      metrics['moe'] = {path.split('/')[0]: stats for path, stats in layers.items()}
    if 'max_logits' in aux:
      metrics['max_logits'] = aux['max_logits']
    if param_groups is not None:
      metrics.update(update_rms(updates, param_groups(state.params)))
    clipped = heads_clipped(opt_state)
    if clipped is not None:
      metrics['qk_clip_heads'] = clipped
    if 'attnres' in aux:  # Transformer(..., log_attnres=True): per-sublayer depth statistics
      metrics['attnres'] = aux['attnres']
    return new, metrics

  return train_step


def make_eval_step(model, loss_chunk: int = 0):
  """(params, batch) -> sums over the batch's masked tokens, float32: 'nll' (token nll), 'tokens',
  'correct' (argmax prediction == target; on MQAR the exact recall of a queried value), and
  'nll_by_position' / 'tokens_by_position' [T] (the same sums per position in the sequence).
  `params`: the params, or for a model with MoE layers the variables with its biases
  (kimijax.model.inference_variables). Nothing here reads max logits, so a Transformer evaluates
  without computing them. `loss_chunk`: train.loss_chunk (make_loss_fn)."""
  if isinstance(model, Transformer):
    model = model.clone(max_logits=False)
  model, nll_of = _outputs_to_nll(model, loss_chunk, accuracy=True)

  def eval_step(params, batch):
    outputs, _ = model.apply(as_variables(params), batch['inputs'], **document_inputs(batch))
    mask = batch['mask'].astype(jnp.float32)
    nll, hit = nll_of(outputs, batch['targets'])
    nll, hit = nll * mask, hit * mask
    return {
      'nll': jnp.sum(nll),
      'tokens': jnp.sum(mask),
      'correct': jnp.sum(hit),
      'nll_by_position': jnp.sum(nll, axis=0),
      'tokens_by_position': jnp.sum(mask, axis=0),
    }

  return eval_step


def in_mesh(fn, mesh: Mesh, mesh_cfg: ml_collections.ConfigDict):
  """Runs fn (jitted) with `mesh` and the logical axis rules active, so layers' sharding constraints
  apply; the result's .lower(*args) lowers fn the same way (ahead-of-time compilation)."""
  rules = mesh_lib.rules(mesh_cfg)

  def wrapped(*args):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return fn(*args)

  def lower(*args):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return fn.lower(*args)

  wrapped.lower = lower
  return wrapped


def jit_steps(model, optimizer, schedule, config, mesh, state_shardings):
  """The train and eval steps jitted with explicit in/out shardings; the train state is donated."""
  batch_sh = mesh_lib.batch_sharding(mesh, config.mesh)
  rep = mesh_lib.replicated(mesh)
  train = jax.jit(
    make_train_step(
      model,
      optimizer,
      schedule,
      optim.param_groups(config),
      bias_rate=config.model.moe.bias_rate,
      bias_centred=config.model.moe.bias_centred,
      loss_chunk=config.train.loss_chunk,
    ),
    in_shardings=(state_shardings, batch_sh),
    out_shardings=(state_shardings, rep),
    donate_argnums=0,
  )
  weights_sh = inference_variables(state_shardings.params, state_shardings.moe_state)
  evaluate = jax.jit(
    make_eval_step(model, config.train.loss_chunk), in_shardings=(weights_sh, batch_sh), out_shardings=rep
  )
  return in_mesh(train, mesh, config.mesh), in_mesh(evaluate, mesh, config.mesh)


class Training(NamedTuple):
  """Everything a run needs besides data: built once from the config and the mesh."""

  model: nn.Module
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: TrainState  # shapes, dtypes and shardings, for restoring checkpoints
  shardings: TrainState  # NamedSharding per leaf
  train_step: Callable  # (state, batch) -> (state, metrics), jitted, state donated
  eval_step: Callable  # (inference_variables(params, moe_state), batch) -> {'nll', 'tokens', ...} sums, jitted
  batch_sharding: NamedSharding

  def init_state(self, config: ml_collections.ConfigDict) -> TrainState:
    return init_state(self.model, self.optimizer, config, self.abstract_state)


def build_training(config: ml_collections.ConfigDict, mesh: Mesh, model: nn.Module | None = None) -> Training:
  """Model (default Transformer(config.model), with max logits as computes_max_logits(config)
  says), optimizer, schedule, state layout and jitted steps."""
  if model is None:
    model = Transformer(config.model, max_logits=computes_max_logits(config))
  if config.optimizer.name == 'muonclip' and not getattr(model, 'max_logits', True):
    raise ValueError(
      "optimizer.name='muonclip' needs the model's max logits (QK-Clip); build it with "
      'Transformer(..., max_logits=True)'
    )
  schedule = make_schedule(config)
  optimizer = make_optimizer(config, schedule)
  abstract_state, shardings = state_shardings(model, optimizer, config, mesh)
  train_step, eval_step = jit_steps(model, optimizer, schedule, config, mesh, shardings)
  return Training(
    model,
    optimizer,
    schedule,
    abstract_state,
    shardings,
    train_step,
    eval_step,
    mesh_lib.batch_sharding(mesh, config.mesh),
  )
