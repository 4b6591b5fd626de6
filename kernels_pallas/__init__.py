"""Pallas GPU kernels, one folder per op (attnres/, attention/), each with a README (backend,
tiles, precision, what is recomputed), and common.py, the helpers they share. kimijax.ops
dispatches to them; nothing else in kimijax imports them."""
