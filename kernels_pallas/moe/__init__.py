"""Grouped-matmul kernels of the MoE routed experts: Pallas Triton (grouped.py) and Mosaic GPU
(grouped_mosaic.py), the same functions over the same padded layout; see README.md in this folder."""
