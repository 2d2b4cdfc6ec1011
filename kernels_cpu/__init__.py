"""numba kernels only: dequantization, quantized matvec/matmul, norms, RoPE, attention."""
