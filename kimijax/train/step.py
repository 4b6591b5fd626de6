"""The loss, one pure train step and one eval step, jitted once with explicit shardings."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from kimijax.parallel import mesh as mesh_lib
from kimijax.train.state import TrainState


def token_nll(logits_btv, targets_bt):
  """Per-token negative log-likelihood [B, T] in float32."""
  logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets_bt[..., None], axis=-1)[..., 0]


def make_loss_fn(model: nn.Module):
  def loss_fn(params, batch):
    logits_btv, aux = model.apply({'params': params}, batch['inputs'])
    mask = batch['mask']
    nll = token_nll(logits_btv, batch['targets'])
    loss = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    return loss, aux
  return loss_fn


def make_train_step(model, optimizer: optax.GradientTransformation, schedule: optax.Schedule):
  """(state, batch) -> (state, metrics). A step whose loss or gradients are not finite leaves the
  state unchanged and reports finite=False; the loop stops on it."""
  loss_fn = make_loss_fn(model)

  def train_step(state: TrainState, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                     opt_state=opt_state)
    new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
    metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': schedule(state.step),
               'max_logits': aux['max_logits'], 'finite': finite}
    return new, metrics

  return train_step


def make_eval_step(model):
  """(params, batch) -> (sum of token nll, number of tokens)."""
  def eval_step(params, batch):
    logits_btv, _ = model.apply({'params': params}, batch['inputs'])
    nll = token_nll(logits_btv, batch['targets'])
    return jnp.sum(nll * batch['mask']), jnp.sum(batch['mask'])
  return eval_step


def in_mesh(fn, mesh: Mesh, mesh_cfg: ml_collections.ConfigDict):
  """Runs fn with `mesh` and the logical axis rules active, so layers' sharding constraints apply."""
  rules = mesh_lib.rules(mesh_cfg)

  def wrapped(*args):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      return fn(*args)
  return wrapped


def jit_steps(model, optimizer, schedule, config, mesh, state_shardings):
  """The train and eval steps jitted with explicit in/out shardings; the train state is donated."""
  batch_sh = mesh_lib.batch_sharding(mesh, config.mesh)
  rep = mesh_lib.replicated(mesh)
  train = jax.jit(make_train_step(model, optimizer, schedule),
                  in_shardings=(state_shardings, batch_sh), out_shardings=(state_shardings, rep),
                  donate_argnums=0)
  evaluate = jax.jit(make_eval_step(model), in_shardings=(state_shardings.params, batch_sh),
                     out_shardings=rep)
  return in_mesh(train, mesh, config.mesh), in_mesh(evaluate, mesh, config.mesh)
