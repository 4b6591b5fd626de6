"""Pallas (Triton backend) kernels of Kimi Delta Attention; see README.md in this folder."""

from kernels_pallas.kda.op import kda_pallas

__all__ = ['kda_pallas']
