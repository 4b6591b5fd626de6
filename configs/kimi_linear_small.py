"""A small Kimi-Linear-shaped hybrid: 3 KDA : 1 MLA layers, NoPE, on the stdlib corpus (CPU-sized).

Run:      python run.py --config=configs/kimi_linear_small.py --workdir=runs/kimi_linear_small
Generate: python run.py --mode=generate --workdir=runs/kimi_linear_small --prompt='import '
Variants: :all_mla (0:1), :all_kda (1:0), :1to1, :7to1, :15to1 (the report's Table 1 ratios),
          :no_gate, :swish_gate, :no_conv (its KDA ablations), :rope (the decoupled dims rotated
          with RoPE), :nope0 (NoPE without decoupled dims and KDA output eps 1e-5: this config's
          form until 2026-12-01, under which its earlier checkpoints resume)

MLA follows Kimi Linear's released convention: "NoPE" keeps decoupled dims (a per-head query part
and a key part shared by all heads; 64 beside 128 no-position dims in the release, 32 beside 64
here) and does not rotate them (model.mla_rope=False); the latent norms use eps 1e-6 and the KDA
output norm the model's norm eps.
Expected (:nope0, 7.24M parameters; the default has 7.32M): eval loss 2.155 / 1.726 / 1.469 /
          1.349 / 1.258 / 1.239 nats/byte at steps 100..600 (2.46M tokens), 1576 s on the shared
          2-core CPU (~1.9 s/step alone), 2026-11-30.
"""

from kimijax.config import base_config

RATIOS = {'all_mla': '0:1', 'all_kda': '1:0', '1to1': '1:1', '7to1': '7:1', '15to1': '15:1'}
VARIANTS = sorted(RATIOS) + ['no_gate', 'swish_gate', 'no_conv', 'rope', 'nope0']


def get_config(arg: str | None = None):
  c = base_config()
  m = c.model
  m.d_model = 256
  m.num_layers = 8
  m.num_heads = 4                   # head dim 64 for KDA and MLA
  m.mlp_dim = 768
  m.layer_pattern = '3:1'           # KKKA KKKA
  m.attention_kind = 'mla'
  m.position = 'nope'
  m.mla_kv_lora_rank = 128
  m.mla_qk_rope_head_dim = 32       # decoupled dims, half the no-position head dim as in the release
  m.mla_rope = False                # ... and not rotated (Kimi Linear's NoPE)
  m.mla_latent_norm_eps = 1e-6
  m.kda_output_norm_eps = m.norm_eps
  m.kda_impl = 'xla'
  m.compute_dtype = 'float32'       # CPU; use bfloat16 (and kda_impl/attn_impl for the GPU) on a GPU
  c.train.steps = 600
  c.train.batch_size = 16
  c.train.seq_len = 256
  c.train.eval_every = 100
  c.train.checkpoint_every = 200
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 30
  for variant in filter(None, (arg or '').split(',')):
    if variant in RATIOS:
      m.layer_pattern = RATIOS[variant]
    elif variant == 'no_gate':
      m.kda_output_gate = 'none'
    elif variant == 'swish_gate':
      m.kda_output_gate = 'swish'
    elif variant == 'no_conv':
      m.kda_short_conv = False
    elif variant == 'rope':
      m.mla_rope = True
    elif variant == 'nope0':
      m.mla_qk_rope_head_dim, m.mla_rope, m.kda_output_norm_eps = 0, True, 1e-5
    else:
      raise ValueError(f'configs/kimi_linear_small.py: unknown variant {variant!r}; allowed: {VARIANTS}')
  return c
