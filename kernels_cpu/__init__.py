"""numba kernels only: dequantization, quantized matvec/matmul, norms, RoPE, attention."""


class TargetError(RuntimeError):
    """numba's target CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES) is one edge cannot compile for."""


from kernels_cpu.f16 import install_half_libcalls  # noqa: E402

install_half_libcalls()   # f16 <-> f32 for CPUs without F16C (kernels_cpu.f16)
