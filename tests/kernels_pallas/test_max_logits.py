"""The fused max-logit Pallas kernel, run in Pallas interpret mode on the CPU, against a float64
NumPy reference (on a GPU, tests/ops/test_attention.py's GPU test runs the compiled kernel)."""

import numpy as np
import pytest
from oracles import ref_max_logits_fast

from kernels_pallas.attention.max_logits import max_logits


@pytest.mark.parametrize(
  'b,t,s,h,hkv,d,causal',
  [
    (2, 100, 100, 4, 2, 32, True),  # T not a multiple of the blocks, GQA
    (1, 37, 80, 2, 1, 16, True),  # T < S (decoding offsets), MQA
    (2, 64, 64, 2, 2, 24, False),  # head dim padded to 32, no mask
    (1, 130, 130, 3, 3, 8, True),
  ],
)
def test_matches_float64_reference(b, t, s, h, hkv, d, causal):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(b, t, h, d)).astype(np.float32) - 1.0  # mostly negative logits too
  k = rng.normal(size=(b, s, hkv, d)).astype(np.float32)
  got = np.asarray(max_logits(q, k, causal=causal, block_q=32, block_k=16, interpret=True))
  np.testing.assert_allclose(got, ref_max_logits_fast(q, k, causal), rtol=1e-5, atol=1e-5)
