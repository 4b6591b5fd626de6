"""Attention kernels: max_logits.py, the exact per-head max logit for QK-Clip. See README.md."""
