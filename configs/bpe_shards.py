"""A hybrid LM (3 KDA : 1 attention) on prepared token shards with a byte-level BPE, documents kept apart.

Prepare: python -m kimijax.data.prepare --train_tokenizer=8192 --output=runs/data/stdlib_bpe8k \
             --input="$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/**/*.py"
         (every .py file of the Python standard library here, 36 MB; a BPE of 8,192 ids trained on
         them, then 10.6M training tokens in shards; 1.5 min on a 2-core CPU)
Run:     python run.py --config=configs/bpe_shards.py --workdir=runs/bpe_shards
         (shards elsewhere: --config.data.path=DIR --config.data.tokenizer=hf:DIR/tokenizer.json)
Variants: :no_mask  documents not kept apart (data.document_mask=False), for the A/B
          :gpu      167M parameters at 2,048 tokens per sequence in bf16 with the GPU kernels
Expected: 5.72M parameters (2.10M of them the tied 8,192 x 256 embedding). :gpu is not measured.

model.vocab_size = 0 takes the tokenizer's vocabulary, padded to a multiple of 128 (docs/data.md).
With data.document_mask each batch carries segment ids and positions: attention stays inside a
document, KDA's state and its short convolutions restart at each document's first token, RoPE counts
from it (docs/data.md#document-masking).
"""

from kimijax import configs_common
from kimijax.config import apply_variants, base_config

SHARDS = 'runs/data/stdlib_bpe8k'


def get_config(variants: str | None = None):
  c = base_config()
  configs_common.cpu_run(c)
  c.train.steps = 300
  c.data.source = 'shards'
  c.data.path = SHARDS
  c.data.tokenizer = f'hf:{SHARDS}/tokenizer.json'
  c.data.document_mask = True
  m = c.model
  m.vocab_size = 0  # the tokenizer's (8,192)
  m.d_model = 256
  m.num_layers = 4
  m.num_heads = 4  # head dim 64 for KDA and attention
  m.mlp_dim = 768
  m.layer_pattern = '3:1'  # KKKA
  return apply_variants(c, VARIANTS, variants)


def _gpu(c):
  """One GPU: bf16 and the GPU implementations (attention 'gpu' runs tokamax under document
  masking), 12 layers of width 1024, batch 32 x 2048."""
  configs_common.gpu_kernels(c.model)
  c.model.update(d_model=1024, num_layers=12, num_heads=8, mlp_dim=2816)
  c.train.update(steps=5000, batch_size=32, seq_len=2048, eval_every=500, checkpoint_every=500, eval_batches=16)
  c.optimizer.update(learning_rate=1e-3, warmup_steps=200)


VARIANTS = {
  'no_mask': lambda c: c.data.update(document_mask=False),
  'gpu': _gpu,
}
