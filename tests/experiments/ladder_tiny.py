"""A ladder file of configs/ladder.py's form for tests/experiments/test_scaling_ladder.py (it is
read by kimijax.config.load_file, as configs/ladder.py is; not a test module).

  tiny       2 variants {rope, nope} x 2 rungs (d 8, 16) of one or two steps, variants that
             compile as fast as the baseline (the tests time compilation, not training)
  tiny_muon  tiny with nope trained by Muon, so that one variant has optimizer FLOPs
"""

from configs.ladder import get_config as ladder_config, rung
from kimijax.config import apply_variants


def _tiny(c):
  b = c.base
  b.train.seq_len, b.train.eval_batches, b.train.log_every, b.train.plot = 32, 1, 2, False
  c.tokens_per_param = 0.02
  c.rungs = [rung(d, head_dim=8, depth_per_width=8, batch_size=4) for d in (8, 16)]
  c.variants = {'rope': (), 'nope': (('model.position', 'nope'),)}
  c.baseline = 'rope'


def _tiny_muon(c):
  _tiny(c)
  c.variants['nope'] = (('model.position', 'nope'), ('optimizer.name', 'muon'))


VARIANTS = {'tiny': _tiny, 'tiny_muon': _tiny_muon}


def get_config(name: str | None = None):
  c = ladder_config('smoke')
  c.name = name or 'tiny'
  return apply_variants(c, VARIANTS, c.name)
