"""Pallas (Triton backend) kernels of KDA's short convolution and its activation; see conv.py."""

from kernels_pallas.short_conv.conv import short_conv_pallas

__all__ = ['short_conv_pallas']
