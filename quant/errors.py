"""The error of quant/ (numba-free, so that the CLI can name quantization types without loading the kernels)."""
from __future__ import annotations


class QuantizeError(ValueError):
    """Input that cannot be quantized: unsupported type, wrong dtype/shape, partial blocks."""
