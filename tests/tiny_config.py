"""A tiny configs/default.py for tests that train through the real loop (shared by test files)."""

from configs.default import get_config

TINY = {
  'model.d_model': 64,
  'model.num_layers': 2,
  'model.num_heads': 2,
  'model.mlp_dim': 128,
  'train.seq_len': 64,
  'train.batch_size': 4,
  'train.eval_batches': 1,
  'train.plot': False,
  'train.log_every': 1,
}


def make_config(overrides):
  """configs/default.py with {'group.key': value} overrides."""
  c = get_config()
  for key, value in overrides.items():
    group, name = key.split('.')
    c[group][name] = value
  return c
