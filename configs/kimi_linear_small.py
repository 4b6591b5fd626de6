"""A small Kimi-Linear-shaped hybrid: 3 KDA : 1 MLA layers, NoPE, on the stdlib corpus (CPU-sized).

Run:      python run.py --config=configs/kimi_linear_small.py --workdir=runs/kimi_linear_small
Generate: python run.py --mode=generate --workdir=runs/kimi_linear_small --prompt='import '
Variants: :all_mla (0:1), :all_kda (1:0), :1to1, :7to1, :15to1 (the report's Table 1 ratios),
          :no_gate, :swish_gate, :no_conv (its KDA ablations), :rope (the decoupled dims rotated
          with RoPE), :nope0 (NoPE without decoupled dims and KDA output eps 1e-5: the form this
          config's earlier checkpoints were trained in, under which they resume)
Expected: 7.32M parameters (:nope0 7.24M); :nope0 reached eval loss 1.24 nats/byte at step 600
          (2.46M tokens) in about 26 min on a 2-core CPU.

MLA follows Kimi Linear's released convention: "NoPE" keeps decoupled dims (a per-head query part
and a key part shared by all heads; 64 beside 128 no-position dims in the release, 32 beside 64
here) and does not rotate them (model.mla_rope=False); the latent norms use eps 1e-6 and the KDA
output norm the model's norm eps.
"""

from kimijax import configs_common
from kimijax.config import apply_variants, base_config

RATIOS = {'all_mla': '0:1', 'all_kda': '1:0', '1to1': '1:1', '7to1': '7:1', '15to1': '15:1'}


def get_config(variants: str | None = None):
  c = base_config()
  configs_common.cpu_run(c)  # use bfloat16 (and kda_impl/attn_impl for the GPU) on a GPU
  m = c.model
  m.d_model = 256
  m.num_layers = 8
  m.num_heads = 4  # head dim 64 for KDA and MLA
  m.mlp_dim = 768
  m.layer_pattern = '3:1'  # KKKA KKKA
  m.attention_kind = 'mla'
  m.position = 'nope'
  m.mla_kv_lora_rank = 128
  m.mla_qk_rope_head_dim = 32  # decoupled dims, half the no-position head dim as in the release
  m.mla_rope = False  # ... and not rotated (Kimi Linear's NoPE)
  m.mla_latent_norm_eps = 1e-6
  m.kda_output_norm_eps = m.norm_eps
  m.kda_impl = 'xla'
  return apply_variants(c, VARIANTS, variants)


VARIANTS = {
  **{name: (lambda c, ratio=ratio: c.model.update(layer_pattern=ratio)) for name, ratio in RATIOS.items()},
  'no_gate': lambda c: c.model.update(kda_output_gate='none'),
  'swish_gate': lambda c: c.model.update(kda_output_gate='swish'),
  'no_conv': lambda c: c.model.update(kda_short_conv=False),
  'rope': lambda c: c.model.update(mla_rope=True),
  'nope0': lambda c: c.model.update(mla_qk_rope_head_dim=0, mla_rope=True, kda_output_norm_eps=1e-5),
}
