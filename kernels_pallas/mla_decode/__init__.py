"""Pallas (Triton backend) kernel of MLA decoding over the compressed latents; see README.md in this folder."""

from kernels_pallas.mla_decode.decode import mla_decode_pallas

__all__ = ['mla_decode_pallas']
