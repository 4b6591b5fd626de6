"""Moonlight's architecture scaled down: MLA attention and Mixture-of-Experts MLPs, a dense first
layer, trained with Muon (Moonlight-16B-A3B, arXiv 2502.16982; docs/moe.md).

Run:      python run.py --config=configs/moonlight_small.py --workdir=runs/moonlight_small
Variants: :gpu      one GPU: d 768, 12 layers, 64 routed experts top-6 + 2 shared of hidden 512
                    (Moonlight's 64 / 6 / 2; expert hidden 2/3 d against its 0.69 d, dense 5.5 d; 147M
                    active of 899M), bf16, tokamax attention, the 'mosaic' grouped matmul,
                    the site-packages corpus, 2000 steps of 16 x 2048 tokens
          :adamw    AdamW instead of Muon (Moonlight's comparison)
          :balance_loss  DeepSeek-V3's sequence-wise balance loss (alpha 1e-4) beside the bias
Expected: CPU (the default): 7.30M parameters, 1.42M active; eval loss 2.33 nats/byte at step
          100 and 1.88 at step 300 (1.23M tokens), about 1.4 s a step on a 2-core CPU
          (experiments/results/moe.md); :gpu on one H100: 899M parameters (147M active), about
          144k tokens/s on 'xla_blocked' (the variant now runs 'mosaic'), eval loss 0.80 / 0.64 / 0.57
          nats/byte at steps 500 / 1000 / 1500 (experiments/results/moe.md).

The routing is Moonlight's release (DeepSeek-V3's): sigmoid scores, the chosen experts' scores
renormalised and scaled by 2.446, the balancing bias for choosing only, moved after each step by
Moonlight's centred rule (model.moe.bias_centred), no balance loss; the shared experts are one
SwiGLU of width 2 x expert hidden. The CPU default keeps Moonlight's 64 / 6 / 2 experts at d 128:
with the 'xla_blocked' grouped matmul a CPU trains them about as fast as a dense MLP of the same
active width (experiments/results/moe.md). MLA as Moonlight's:
full-rank queries, RoPE on 64 decoupled dims beside 128 no-position dims per head (32 + 64 here).
"""

from kimijax import configs_common
from kimijax.config import apply_variants, base_config


def get_config(variants: str | None = None):
  c = base_config()
  configs_common.cpu_run(c)
  c.train.steps = 300
  m = c.model
  m.d_model = 128
  m.num_layers = 4
  m.num_heads = 2  # head dim 64
  m.attention_kind = 'mla'
  m.mla_kv_lora_rank = 64
  m.mla_qk_rope_head_dim = 32  # rotated (Moonlight uses RoPE), half the no-position dims
  m.mlp_dim = 704  # the dense first layer: 5.5 d, as 11264 / 2048
  m.mlp_kind = 'moe'
  m.moe.update(
    num_experts=64,
    top_k=6,
    num_shared=2,
    expert_hidden=88,  # 0.6875 d, as 1408 / 2048
    score_func='sigmoid',
    renormalize=True,
    scaling_factor=2.446,
    first_dense_layers=1,
    bias_rate=1e-3,
    bias_centred=True,
    impl='xla_blocked',  # lax.ragged_dot runs at a fraction of its FLOPs on XLA:CPU
  )
  c.optimizer.name = 'muon'
  return apply_variants(c, VARIANTS, variants)


def _gpu(c):
  m = c.model
  configs_common.gpu_kernels(m, attn_impl='tokamax')
  configs_common.gpu_data(c)
  m.update(
    d_model=768,
    num_layers=12,
    num_heads=6,  # head dim 128
    mla_kv_lora_rank=512,
    mla_qk_rope_head_dim=64,
    mlp_dim=4224,  # 5.5 d
  )
  m.moe.update(num_experts=64, top_k=6, num_shared=2, expert_hidden=512)
  c.train.update(steps=2000, batch_size=16, seq_len=2048, eval_every=500, checkpoint_every=500)
  c.optimizer.update(learning_rate=1e-3, warmup_steps=100)


VARIANTS = {
  'gpu': _gpu,
  'adamw': lambda c: c.optimizer.update(name='adamw'),
  'balance_loss': lambda c: c.model.moe.update(aux_loss_alpha=1e-4),
}
