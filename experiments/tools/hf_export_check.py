"""Models trained here, exported to the released Hugging Face layout (kimijax.hf.export), against
transformers' own modeling code: the same logits from the same folder.

    python -m experiments.tools.hf_export_check write DIR        # kimijax's environment
    PY -m pip install torch transformers==5.17.0 safetensors      # any other environment
    PY experiments/tools/hf_export_check.py compare DIR           # there: prints one row per model

`write` draws each model of CASES at random (MoE correction biases too, which initialise at zero),
exports it in float32 to DIR/NAME and saves kimijax's float32 logits for fixed random tokens in
DIR/NAME/kimijax.npz. `compare` loads each folder with transformers' AutoModelForCausalLM on the CPU
in float32 (no tensor may be missing, unexpected or mis-shaped) and prints the relative RMSE of its
logits against kimijax's and the share of positions where the two pick the same next token.
Results: experiments/results/hf_export.md.
"""

from __future__ import annotations

import pathlib
import sys

# name -> (config file, overrides): the released families' shapes as configured here
CASES = {
  'kimi_linear_moe': ('configs/kimi_linear_moe.py', {}),  # 3:1 KDA:MLA (NoPE), MoE, tied embeddings
  'moonlight_small': ('configs/moonlight_small.py', {}),  # MLA with RoPE, MoE, tied embeddings
  'mla_dense_qlora': (  # MLA with a query LoRA, dense MLPs, untied head
    'configs/moonlight_small.py',
    {'model.mlp_kind': 'dense', 'model.mla_q_lora_rank': 16, 'model.tie_embeddings': False},
  ),
  'moonlight_yarn': (  # YaRN as DeepSeek-V3 sets it, over a short original context so that it bites here
    'configs/moonlight_small.py',
    {
      'model.yarn.factor': 8.0,
      'model.yarn.original_context': 16,
      'model.yarn.mscale': 1.0,
      'model.yarn.mscale_all_dim': 1.0,
    },
  ),
}
TOKENS = (2, 24)


def write(folder: pathlib.Path) -> None:
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np

  from kimijax import config as config_lib
  from kimijax.hf.export import export_folder
  from kimijax.model import Transformer, as_variables, inference_variables

  rng = np.random.default_rng(0)
  for name, (file, overrides) in CASES.items():
    config = config_lib.load(file, overrides={'model.compute_dtype': 'float32', **overrides})
    model = Transformer(config_lib.portable(config.model))
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    params = nn.unbox(variables['params'])
    moe_state = jax.tree.map(
      lambda b: rng.normal(0, 0.1, b.shape).astype(np.float32), dict(variables.get('moe_state', {}))
    )
    out = export_folder(folder / name, config, params, moe_state, dtype='float32')
    tokens = rng.integers(0, config.model.vocab_size, TOKENS).astype(np.int32)
    logits, _ = model.apply(as_variables(inference_variables(params, moe_state)), jnp.asarray(tokens))
    np.savez(out / 'kimijax.npz', tokens=tokens, logits=np.asarray(logits, np.float32))
    print(f'wrote {out}')


def compare(folder: pathlib.Path) -> None:
  import numpy as np
  import torch
  import transformers

  print(f'transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32\n')
  print('| model | model_type | relative RMSE of the logits | same next token |')
  print('|---|---|---|---|')
  for name in CASES:
    path = folder / name
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
      sys.exit(f'{path}: transformers did not load every tensor as written: {problems}')
    ref = np.load(path / 'kimijax.npz')
    with torch.no_grad():
      logits = model.eval()(torch.tensor(ref['tokens'], dtype=torch.long)).logits.numpy().astype(np.float64)
    ours = ref['logits'].astype(np.float64)
    rmse = np.sqrt(np.mean((logits - ours) ** 2) / np.mean(ours**2))
    same = np.mean(logits.argmax(-1) == ours.argmax(-1))
    print(f'| {name} | {model.config.model_type} | {rmse:.1e} | {same:.0%} |')


if __name__ == '__main__':
  if len(sys.argv) != 3 or sys.argv[1] not in ('write', 'compare'):
    sys.exit(__doc__)
  {'write': write, 'compare': compare}[sys.argv[1]](pathlib.Path(sys.argv[2]))
