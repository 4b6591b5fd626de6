"""A released checkpoint (Kimi Linear, DeepSeek-V3 / Moonlight, in the Hugging Face layout) as a
kimijax run: the model from its config.json, the weights from its *.safetensors, the tokenizer from
its tiktoken.model or tokenizer.json (docs/released.md).

Run:      python run.py --mode=config --config=configs/released.py:FOLDER           # the model, its counts
          python run.py --mode=eval --config=configs/released.py:FOLDER,gpu --workdir=DIR \
              --config.data.source=text --config.data.path=CORPUS                  # the released weights' loss
          python run.py --mode=generate --config=configs/released.py:FOLDER,gpu --workdir=DIR --prompt='...'
          python run.py --config=configs/released.py:FOLDER,gpu --workdir=DIR ...   # fine-tune from them
Variants: FOLDER first, then: gpu (bf16 compute and the GPU kernels), adamw (AdamW instead of Muon)
Expected: the released model's own outputs: tests/test_released.py checks logits and greedy
          generation against transformers' modeling code on small checkpoints of both families
          (tests/fixtures/released/). A fine-tune starts from the released weights with a fresh
          optimizer state: Muon at lr 2e-5 (the released models were trained with Muon), cosine
          decay after 10 warmup steps, 100 steps of 8 x 2048 tokens.
"""

import os

from kimijax import configs_common
from kimijax.config import ConfigError, apply_variants, base_config


def get_config(arg: str | None = None):
  folder, _, variants = (arg or '').partition(',')
  if not folder:
    raise ConfigError('give the released checkpoint folder: --config=configs/released.py:FOLDER[,variant]')
  from kimijax.hf.config import model_overrides, read_config
  from kimijax.hf.safetensors import HfError

  try:
    overrides = model_overrides(read_config(folder))
  except HfError as e:
    raise ConfigError(str(e)) from None
  c = base_config()
  c.update_from_flattened_dict(overrides)
  c.model.compute_dtype = 'float32'
  c.train.update(init_from=os.path.abspath(folder), steps=100, batch_size=8, seq_len=2048, eval_every=50)
  c.train.update(checkpoint_every=50, eval_batches=8)
  c.optimizer.update(name='muon', learning_rate=2e-5, warmup_steps=10, weight_decay=0.1)
  c.data.tokenizer = _tokenizer(folder)
  return apply_variants(c, VARIANTS, variants)


def _tokenizer(folder: str) -> str:
  """The folder's tokenizer as data.tokenizer: tiktoken.model (Kimi's) or tokenizer.json; else the
  byte tokenizer (the model's vocabulary must then hold 256 bytes and the specials)."""
  if os.path.exists(os.path.join(folder, 'tiktoken.model')):
    return 'tiktoken:' + os.path.abspath(os.path.join(folder, 'tiktoken.model'))
  if os.path.exists(os.path.join(folder, 'tokenizer.json')):
    return 'hf:' + os.path.abspath(os.path.join(folder, 'tokenizer.json'))
  return 'byte'


VARIANTS = {
  'gpu': lambda c: configs_common.gpu_kernels(c.model, attn_impl='tokamax'),
  'adamw': lambda c: c.optimizer.update(name='adamw'),
}
