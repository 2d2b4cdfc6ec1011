"""numba kernels only: dequantization, quantized matvec/matmul, norms, RoPE, attention."""
from kernels_cpu.f16 import install_half_libcalls

install_half_libcalls()   # f16 <-> f32 for CPUs without F16C (kernels_cpu.f16)
