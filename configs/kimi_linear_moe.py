"""Kimi Linear's architecture scaled down: 3 KDA : 1 MLA layers (NoPE, as released) with
Mixture-of-Experts MLPs and a dense first layer (Kimi Linear 48B-A3B, arXiv 2510.26692;
docs/kda.md, docs/moe.md).

Run:      python run.py --config=configs/kimi_linear_moe.py --workdir=runs/kimi_linear_moe
Generate: python run.py --mode=generate --workdir=runs/kimi_linear_moe --prompt='import '
Variants: :gpu     one H200: d 768, 12 layers, 64 routed experts top-8 + 1 shared of hidden 384
                   (the release's 8 active + 1 shared; expert hidden 0.44 d there, 0.5 d here;
                   128M active of 673M), bf16, the fused Pallas KDA kernels, tokamax attention,
                   the 'mosaic' grouped matmul, the site-packages corpus, 2000 steps of
                   16 x 2048 tokens
          :muon    Muon instead of AdamW
Expected: CPU (the default): 2.74M parameters, 1.19M active; eval loss 2.31 nats/byte at step
          100 (410k tokens), about 3.7 s a step on a 2-core CPU (experiments/results/moe.md);
          :gpu on one H100: 673M parameters (128M active), about 221k tokens/s, eval loss
          0.83 / 0.69 / 0.61 nats/byte at steps 500 / 1000 / 1500 (experiments/results/moe.md).

The routing is the release's: sigmoid scores, renormalised and scaled by 2.446, the balancing
bias for choosing only (DeepSeek-V3's update, rate 1e-3), no balance loss, one shared expert. MLA
is Kimi Linear's NoPE form: decoupled dims beside the no-position dims, not rotated. The CPU
default has 32 routed experts top-8 + 1 shared, on the 'xla_blocked' grouped matmul.
"""

from kimijax import configs_common
from kimijax.config import apply_variants, base_config


def get_config(variants: str | None = None):
  c = base_config()
  configs_common.cpu_run(c)
  c.train.steps = 300
  m = c.model
  m.d_model = 128
  m.num_layers = 4  # KKKA
  m.num_heads = 2  # head dim 64 for KDA and MLA
  m.layer_pattern = '3:1'
  m.attention_kind = 'mla'
  m.position = 'nope'
  m.mla_kv_lora_rank = 64
  m.mla_qk_rope_head_dim = 32  # decoupled dims, half the no-position head dim as in the release ...
  m.mla_rope = False  # ... and not rotated (Kimi Linear's NoPE)
  m.kda_output_norm_eps = m.norm_eps
  m.mlp_dim = 512  # the dense first layer: 4 d, as 9216 / 2304
  m.mlp_kind = 'moe'
  m.moe.update(
    num_experts=32,
    top_k=8,
    num_shared=1,
    expert_hidden=56,  # 0.44 d, as 1024 / 2304
    score_func='sigmoid',
    renormalize=True,
    scaling_factor=2.446,
    first_dense_layers=1,
    bias_rate=1e-3,
    impl='xla_blocked',  # lax.ragged_dot runs at a fraction of its FLOPs on XLA:CPU
  )
  return apply_variants(c, VARIANTS, variants)


def _gpu(c):
  m = c.model
  configs_common.gpu_kernels(m, attn_impl='tokamax')
  configs_common.gpu_data(c)
  m.update(d_model=768, num_layers=12, num_heads=6, mla_kv_lora_rank=512, mla_qk_rope_head_dim=64, mlp_dim=3072)
  m.moe.update(num_experts=64, top_k=8, num_shared=1, expert_hidden=384)
  c.train.update(steps=2000, batch_size=16, seq_len=2048, eval_every=500, checkpoint_every=500)
  c.optimizer.update(learning_rate=1e-3, warmup_steps=100)


VARIANTS = {
  'gpu': _gpu,
  'muon': lambda c: c.optimizer.update(name='muon'),
}
