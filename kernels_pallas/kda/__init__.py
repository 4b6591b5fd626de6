"""Pallas (Triton backend) kernels of Kimi Delta Attention; see README.md in this folder."""

from kernels_pallas.kda.decode import kda_decode_pallas
from kernels_pallas.kda.op import kda_pallas
from kernels_pallas.kda.step import kda_step_pallas

__all__ = ['kda_decode_pallas', 'kda_pallas', 'kda_step_pallas']
