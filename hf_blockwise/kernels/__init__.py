"""Kernels of hf_blockwise's own, compiled on the user's machine the first time they are needed.

`int8`: exact int8 matrix products on weights packed once for AVX-512 VNNI ([`hf_blockwise.kernels.int8`]).
"""
