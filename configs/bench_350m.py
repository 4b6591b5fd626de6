"""~350M-parameter full-attention LM at sequence length 4096, for GPU throughput benchmarks.

Run:      python -m experiments.bench.bench_train --config=configs/bench_350m.py
Expected: one H200, 2026-12-01, tokamax attention: 390.6 ms/step against 400.0 with :cudnn (one
          run each, bench_compare.py; experiments/results/bench_attention.md), 73.5 GiB peak;
          2026-12-02: 395.4 ms, 44.5% MFU. With --config.train.log_max_logits=False the default
          runs cuDNN: 387.1 ms against :tokamax's 395.9.
          2026-11-30 with cuDNN: 392 ms/step (other runs that day up to 411 ms), 167k tokens/s,
          44.9% MFU, 73.5 GiB peak
          (table and breakdown in experiments/results/bench_train.md); :attnres_block 420.1 ms
          against 400.0 standard on one GPU (+5.0%; +4.8% on another machine;
          experiments/bench/bench_compare.py; 79.2 GiB),
          :attnres_full 1053 ms
          (bench_attnres.md); Muon on 2 GPUs (fsdp=2, batch 32) +1.3% over AdamW
          (muon_distributed.md).
          :hybrid 482.7 ms/step, 71.6 GiB against all-attention's 388.3 ms and 73.55 GiB in the
          same call (2026-12-02: 0.804x its tokens/s; 0.804x-0.805x in earlier calls; from a cold
          cache the runs took about 115 s and 50 s in all); :hybrid,mla 517.7 ms (545.3 with
          :cudnn's padded values; both before the last kernel changes); :hybrid,kda_keep
          526.5 ms, 76.1 GiB (2026-12-01, before them too). At batch 2 x 32768
          (--config.train.seq_len=32768 --config.train.batch_size=2): :hybrid 667.9 ms against
          all-attention's 1038 (1.55x its tokens/s, 2026-12-02; experiments/results/bench_kda.md).
Variants: :hybrid (3 KDA : 1 attention, 18 + 6 layers, the fused Pallas KDA kernels; the KDA
          layers recompute their q and k projections in the backward and keep v's, so that the
          step fits in attention's memory and an H800's 80 GB),
          :kda_keep (with :hybrid: the KDA layers keep all three projections for the backward
          instead: 76.1 GiB),
          :remat (rematerialise each layer), :xla (attn_impl='xla'),
          :cudnn (cuDNN attention, and the fused max-logit kernel when max logits are on),
          :tokamax (tokamax's Mosaic GPU flash attention, whose residuals give the max logits;
          SPEC §5; by default attn_impl='gpu' picks tokamax with max logits or MLA, else cuDNN), :mla (the attention layers as Kimi Linear's MLA: kv rank 512, 128
          no-position + 64 unrotated decoupled q/k dims, 128 value dims), :attnres_full,
          :attnres_block (8 blocks of 6 of the 48 sublayers, with the Pallas kernels),
          :attnres_xla (AttnRes in plain XLA); combine with commas (:hybrid,mla,cudnn).
          tokamax against cuDNN, side by side: experiments/results/bench_attention.md.
"""

from kimijax.config import base_config


def get_config(arg: str | None = None):
  c = base_config()
  m = c.model
  m.vocab_size = 32768
  m.d_model = 1024
  m.num_layers = 24
  m.num_heads = 8                     # head_dim 128
  m.mlp_dim = 2816
  m.attn_impl = 'gpu'                 # tokamax when max logits are logged or clipped (free from its
                                      # residuals) or for MLA, else cuDNN; :tokamax, :cudnn force one
  m.kda_impl = 'pallas'               # used by the KDA layers of :hybrid
  m.short_conv_impl = 'pallas'        # their short convs: the fused conv + activation kernels
  m.kda_recompute_projections = 'qk'  # their q and k projections recomputed in the backward, v's kept
                                      # (4.5 GiB less than keeping all three)
  m.compute_dtype = 'bfloat16'
  m.tie_embeddings = True
  m.residual_dtype = 'bfloat16'      # 2.6% faster than float32 here (see results)
  c.train.batch_size = 16
  c.train.seq_len = 4096
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 100
  variants = [v for v in (arg or '').split(',') if v]
  for variant in variants:
    if variant == 'remat':
      m.remat = True
    elif variant == 'hybrid':
      m.layer_pattern = 'KKKA'
    elif variant == 'kda_keep':           # KDA layers keep their q/k/v projections for the backward
      m.kda_recompute_projections = ''
    elif variant == 'xla':
      m.attn_impl = 'xla'
    elif variant in ('cudnn', 'tokamax'):
      m.attn_impl = variant
    elif variant == 'mla':              # q/k 192 and v 128 dims per head: cuDNN pads v, tokamax does not
      m.attention_kind = 'mla'
      m.mla_kv_lora_rank, m.mla_qk_rope_head_dim, m.mla_v_head_dim, m.mla_rope = 512, 64, 128, False
    elif variant == 'attnres_full':     # XLA: Pallas compiles a kernel set per source count (2..49)
      m.residual = 'attnres_full'
    elif variant == 'attnres_block':      # 2 * 24 sublayers / 6 = 8 blocks
      m.residual, m.attnres_block_size, m.attnres_impl = 'attnres_block', 6, 'pallas'
    elif variant == 'attnres_xla':        # AttnRes phase 1 in plain XLA instead of the Pallas kernels
      pass                                # applied after the loop, so that order does not matter
    else:
      raise ValueError(f"configs/bench_350m.py: unknown variant {variant!r}; allowed: 'hybrid', 'kda_keep', 'remat', 'xla', "
                       "'cudnn', 'tokamax', 'mla', 'attnres_full', 'attnres_block', 'attnres_xla'")
  if 'attnres_xla' in variants:
    m.attnres_impl = 'xla'
  return c
