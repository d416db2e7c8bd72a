"""Batched page-copy kernels (Triton) with a plain torch reference beside each one.

Kernels move bytes between pages of the pool; they know layouts, never metadata.
"""
