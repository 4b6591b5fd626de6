"""~350M-parameter full-attention LM at sequence length 4096, for GPU throughput benchmarks.

Run:      python -m experiments.bench.bench_train --config=configs/bench_350m.py[:variant,...]
Expected: about 390 ms/step and 45% MFU on one H200 (all attention; :hybrid and the others beside
          it: experiments/results/bench_train.md; KDA's kernels: bench_kda.md; tokamax against
          cuDNN: bench_attention.md; AttnRes: bench_attnres.md).
Variants (combine with commas, e.g. :hybrid,mla,cudnn):
          :hybrid (3 KDA : 1 attention, 18 + 6 layers, the fused Pallas KDA kernels; the KDA layers
          recompute their q and k projections in the backward and keep v's, so that the step fits
          in attention's memory and an H800's 80 GB),
          :kda_keep (with :hybrid: the KDA layers keep all three projections for the backward),
          :remat (rematerialise each layer), :xla (attn_impl='xla'),
          :long (batch 1, each layer rematerialised and the loss taken 4096 tokens at a time,
          train.loss_chunk: for the longest sequence one GPU trains, set with
          --config.train.seq_len=N; with :hybrid against all attention),
          :cudnn (cuDNN attention, and the fused max-logit kernel when max logits are on),
          :tokamax (tokamax's Mosaic GPU flash attention, whose residuals give the max logits; by
          default attn_impl='gpu' picks tokamax with max logits or MLA, else cuDNN),
          :mla (the attention layers as Kimi Linear's MLA: kv rank 512, 128 no-position + 64
          unrotated decoupled q/k dims, 128 value dims), :attnres_full,
          :attnres_block (8 blocks of 6 of the 48 sublayers, with the Pallas kernels),
          :attnres_xla (AttnRes in plain XLA, whatever the other variants say),
          :moe (Mixture-of-Experts MLPs after a dense first layer: 64 routed experts of hidden
          256, top-8, + 3 shared, so that a token's 11 experts are the dense SwiGLU's 2816 wide:
          343M active parameters with the routers against the dense 342M, of 1.36B in all;
          the 'mosaic' grouped matmul (Mosaic GPU kernels); MFU on active FLOPs; about 0.76x
          the dense model's tokens/s; fits one H200 as it is, not an 80 GB card (H800, H100) at
          16 x 4096, where batch 8 fits; experiments/results/moe.md).
"""

from kimijax import configs_common
from kimijax.config import apply_variants, base_config


def get_config(variants: str | None = None):
  c = base_config()
  m = c.model
  m.vocab_size = 32768
  m.d_model = 1024
  m.num_layers = 24
  m.num_heads = 8  # head_dim 128
  m.mlp_dim = 2816
  configs_common.gpu_kernels(m)  # attention 'gpu': tokamax when max logits are logged or clipped
  # (free from its residuals) or for MLA, else cuDNN; the KDA layers
  # of :hybrid and their short convs: the fused Pallas kernels
  m.kda_recompute_projections = 'qk'  # their q and k projections recomputed in the backward, v's kept
  # (4.5 GiB less than keeping all three)
  m.tie_embeddings = True
  m.residual_dtype = 'bfloat16'  # faster than float32 here (experiments/results/bench_train.md)
  c.train.batch_size = 16
  c.train.seq_len = 4096
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 100
  return apply_variants(c, VARIANTS, variants)


# Applied in this order, whatever the order on the command line.
VARIANTS = {
  'remat': lambda c: c.model.update(remat=True),
  'long': lambda c: _long(c),
  'hybrid': lambda c: c.model.update(layer_pattern='KKKA'),
  'kda_keep': lambda c: c.model.update(kda_recompute_projections=''),
  'xla': lambda c: c.model.update(attn_impl='xla'),
  'cudnn': lambda c: c.model.update(attn_impl='cudnn'),
  'tokamax': lambda c: c.model.update(attn_impl='tokamax'),
  # q/k 192 and v 128 dims per head: cuDNN pads v, tokamax does not
  'mla': lambda c: c.model.update(
    attention_kind='mla', mla_kv_lora_rank=512, mla_qk_rope_head_dim=64, mla_v_head_dim=128, mla_rope=False
  ),
  # XLA: Pallas would compile a kernel set per source count (2..49)
  'attnres_full': lambda c: c.model.update(residual='attnres_full'),
  # 2 * 24 sublayers / 6 = 8 blocks
  'attnres_block': lambda c: c.model.update(residual='attnres_block', attnres_block_size=6, attnres_impl='pallas'),
  'attnres_xla': lambda c: c.model.update(attnres_impl='xla'),
  'moe': lambda c: _moe(c.model),
}


def _moe(m):
  m.mlp_kind = 'moe'
  m.moe.update(num_experts=64, top_k=8, num_shared=3, expert_hidden=256, first_dense_layers=1)


def _long(c):
  c.model.remat = True
  c.train.update(batch_size=1, loss_chunk=4096)
