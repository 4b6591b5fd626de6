"""Default: a tiny byte-level attention LM on the Python stdlib sources, sized for a laptop CPU.

Run:      make run      (= python run.py --config=configs/default.py --workdir=runs/default)
Variants: :gqa   grouped-query attention, 2 KV heads
          :nope  no positional encoding
Expected: 3.48M parameters; eval loss about 1.49 nats/byte at step 600 (2.46M tokens), about 5.5 min
          on a 2-core CPU.
"""

from kimijax import configs_common
from kimijax.config import apply_variants, base_config


def get_config(variants: str | None = None):
  c = base_config()
  configs_common.cpu_run(c)
  return apply_variants(c, VARIANTS, variants)


VARIANTS = {
  'gqa': lambda c: c.model.update(attention_kind='gqa', num_kv_heads=2),
  'nope': lambda c: c.model.update(position='nope'),
}
