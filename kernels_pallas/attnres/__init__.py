"""Block Attention Residuals kernels: phase 1 (phase1.py: depth attention of a block's S consumers
over its fixed sources, forward and backward) and phase 2 fused with the consumer's pre-norm
(merge_norm.py). See README.md."""
