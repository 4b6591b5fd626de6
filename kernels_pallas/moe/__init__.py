"""Pallas (Triton backend) grouped-matmul kernels of the MoE routed experts; see README.md in this folder."""

from kernels_pallas.moe.grouped import expert_weight_grad, gate_up_swiglu, tile_matmul

__all__ = ['expert_weight_grad', 'gate_up_swiglu', 'tile_matmul']
