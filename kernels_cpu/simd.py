"""Low-level numba intrinsics: scalar bit casts and IEEE half-precision conversion.

Bit casts are numba ``@intrinsic`` functions that emit a single LLVM ``bitcast``; they let
kernels move between a float32 and its uint32 bit pattern without touching memory.

``f16_bits_to_f32`` converts an IEEE binary16 bit pattern to float32 exactly, using integer
operations only (no reliance on F16C or on the denormals-are-zero state of the FPU). It gives
the same bits as numpy's ``float16 -> float32`` cast (numpy ``npy_halfbits_to_floatbits``),
including the sign of zero and the payload of NaNs (a signalling NaN stays signalling).

The second half holds helpers that emit LLVM vector IR (used by matmul's generated kernels).
Note: numba's on-disk cache keys a kernel on its own source file only; after editing this
module, clear the cached kernels of the modules that use it (``__pycache__/*.nbi, *.nbc``).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from kernels_cpu import TargetError


def _check_feature_list() -> None:
    """Raise TargetError for a NUMBA_CPU_FEATURES that is not a list of ``+name`` / ``-name``
    (LLVM aborts the process on one, with an assertion, the first time it compiles; also on an
    item with a space, which LLVM takes as part of the name)."""
    from numba.core import config

    listed = config.CPU_FEATURES
    for item in (listed or "").split(","):
        name = item.strip()
        if name and name != item:
            raise TargetError(f"NUMBA_CPU_FEATURES={listed!r}: {item!r} has a space: give the list without spaces, "
                              f"e.g. +avx2,+fma,+f16c")
        if name and (name[0] not in "+-" or not name[1:] or not name[1:].replace("-", "").replace(".", "")
                     .replace("_", "").isalnum()):
            raise TargetError(f"NUMBA_CPU_FEATURES={listed!r}: {item!r} is not a feature: give a comma-separated "
                              f"list of +name / -name, e.g. +avx2,+fma,+f16c")


def _check_target() -> None:
    """Raise TargetError when LLVM does not know NUMBA_CPU_NAME or a feature of NUMBA_CPU_FEATURES
    for this machine's architecture: LLVM only warns (several times) and ignores it, so an arm64
    name or feature on x86 (or the reverse) gave a kernel path this machine cannot compile
    (an LLVM ERROR, or a segfault on arm64), and a misspelt name compiled generic code."""
    import os
    import tempfile

    from numba.core import config
    from llvmlite import binding

    if config.CPU_NAME is None and config.CPU_FEATURES is None:
        return
    binding.initialize_native_target()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as said:   # LLVM writes its warnings to the process's stderr
            os.dup2(said.fileno(), 2)
            try:
                binding.Target.from_default_triple().create_target_machine(
                    cpu=config.CPU_NAME or "", features=config.CPU_FEATURES or "")
            finally:
                os.dup2(saved, 2)
            said.seek(0)
            lines = said.read().decode(errors="replace").splitlines()
    finally:
        os.close(saved)
    machine = binding.get_process_triple().split("-")[0]
    if any("not a recognized processor" in line for line in lines):
        raise TargetError(f"NUMBA_CPU_NAME={config.CPU_NAME!r} is not a CPU LLVM knows for this machine ({machine}): "
                          f"numba compiles for the machine it runs on")
    unknown = [line.split("'")[1] for line in lines if "not a recognized feature" in line and line.count("'") >= 2]
    if unknown:
        raise TargetError(f"NUMBA_CPU_FEATURES={config.CPU_FEATURES!r}: {', '.join(dict.fromkeys(unknown))} "
                          f"{'is not a feature' if len(unknown) == 1 else 'are not features'} LLVM knows for this "
                          f"machine ({machine})")


_check_feature_list()
_check_target()

_F32_2_POW_M24 = np.float32(2.0**-24)


@intrinsic
def f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as float32 (LLVM ``trunc`` + ``bitcast``)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        value = args[0]
        if signature.args[0].bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif signature.args[0].bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return sig, codegen


@intrinsic
def bits_from_f32(typingctx, value):
    """Reinterpret a float32 as its uint32 bit pattern (LLVM ``bitcast``)."""
    if value != types.float32:
        return None
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(cache=True, inline="always")
def f16_bits_to_f32_bits(h):
    """binary16 bit pattern (any integer holding 16 bits) -> binary32 bit pattern (uint32).

    Normal numbers rebias the exponent (15 -> 127); subnormals are exact products
    m * 2**-24 (a normal float32); Inf/NaN keep sign and payload.
    """
    h = np.uint32(h) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == np.uint32(0x1F):
        return sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    if exp == np.uint32(0):
        if man == np.uint32(0):
            return sign
        return sign | bits_from_f32(np.float32(man) * _F32_2_POW_M24)
    return sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))


@njit(cache=True, inline="always")
def f16_bits_to_f32(h):
    """binary16 bit pattern -> float32 value (exact; see module docstring)."""
    return f32_from_bits(f16_bits_to_f32_bits(h))


@njit(cache=True, inline="always")
def load_f16(buf, i):
    """float32 value of the little-endian binary16 stored at ``buf[i:i+2]`` (uint8 array)."""
    return f16_bits_to_f32(np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << np.uint32(8)))


# ---------------------------------------------------------------------------------------------
# LLVM vector IR helpers (for code generated inside numba intrinsics).
#
# Kernels built from these use plain LLVM vector operations only (loads, shuffles, integer and
# float arithmetic, llvm.fma); LLVM selects the instructions for the host CPU (e.g.
# vpmaddwd / vcvtph2ps / vfmadd on x86-64 with AVX-512 or AVX2, sdot-free NEON code on arm64).

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
BYTE_PTR = I8.as_pointer()


def vec(element: ir.Type, n: int) -> ir.VectorType:
    """<n x element>."""
    return ir.VectorType(element, n)


def const_vec(element: ir.Type, values) -> ir.Constant:
    """A constant vector of ``element`` holding ``values``."""
    return ir.Constant(vec(element, len(values)), list(values))


def splat(b: ir.IRBuilder, value, n: int):
    """Broadcast scalar ``value`` to <n x type(value)>."""
    vt = vec(value.type, n)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), const_vec(I32, [0] * n))


def shuffle(b: ir.IRBuilder, v, lanes, other=None):
    """New vector of lanes ``lanes`` taken from ``v`` (indices >= len(v) pick from ``other``)."""
    return b.shuffle_vector(v, v if other is None else other, const_vec(I32, lanes))


def concat(b: ir.IRBuilder, lo, hi):
    """<n x T> lo, <n x T> hi -> <2n x T> (lo in lanes 0..n-1)."""
    n = lo.type.count
    return shuffle(b, lo, range(2 * n), hi)


def byte_at(b: ir.IRBuilder, base, offset):
    """i8* base + offset (``offset`` an i64 value or a Python int), in bytes."""
    if isinstance(offset, int):
        offset = ir.Constant(I64, offset)
    return b.gep(base, [offset])


def load(b: ir.IRBuilder, base, offset, ty: ir.Type):
    """Unaligned load of a ``ty`` at i8* base + offset bytes."""
    return b.load(b.bitcast(byte_at(b, base, offset), ty.as_pointer()), align=1)


def load_half(b: ir.IRBuilder, base, offset):
    """float32 value of the binary16 at i8* base + offset (LLVM fpext half -> float: exact)."""
    return b.fpext(load(b, base, offset, ir.HalfType()), F32)


def bit_lanes(b: ir.IRBuilder, word):
    """iN ``word`` -> <N x i1> with lane i = bit i of word (an LLVM bitcast; x86 kmov)."""
    return b.bitcast(word, vec(ir.IntType(1), word.type.width))


def lanes_i8(b: ir.IRBuilder, value: int, n: int):
    """Constant <n x i8> with every lane ``value``."""
    return const_vec(I8, [value] * n)


def madd_pairs(b: ir.IRBuilder, a, x):
    """<2n x i16> a, x -> <n x i32>: lane i = a[2i]*x[2i] + a[2i+1]*x[2i+1] (exact; x86 pmaddwd)."""
    n2 = a.type.count
    wide = vec(I32, n2)
    prod = b.mul(b.sext(a, wide), b.sext(x, wide))
    return b.add(shuffle(b, prod, range(0, n2, 2)), shuffle(b, prod, range(1, n2, 2)))


def hsum_f32(b: ir.IRBuilder, v):
    """Sum of the lanes of a float vector (pairwise tree: halves added lane by lane)."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.fadd(shuffle(b, v, range(n)), shuffle(b, v, range(n, 2 * n)))
    return b.extract_element(v, ir.Constant(I32, 0))


def fmuladd(b: ir.IRBuilder, x, y, acc):
    """x * y + acc on float vectors or scalars, rounded once (llvm.fma, as :func:`fma`). Was
    llvm.fmuladd, which LLVM fuses only where the target has FMA: a CPU without it (generic
    x86-64) got two roundings and other logits; llvm.fma is one definition on every CPU (the
    same vfmadd where FMA is, the C library's fmaf elsewhere)."""
    return fma(b, x, y, acc)


def fma(b: ir.IRBuilder, x, y, acc):
    """x * y + acc rounded once (llvm.fma: scalar or vector float32; vfmadd with FMA)."""
    name = f"llvm.fma.v{x.type.count}f32" if isinstance(x.type, ir.VectorType) else "llvm.fma.f32"
    return _x86_call(b, name, [x, y, acc])


def hsum_float_8(b: ir.IRBuilder, v):
    """ggml's hsum_float_8 of a <8 x float>: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))."""
    for step in (4, 2, 1):
        v = b.fadd(v, shuffle(b, v, [lane ^ step for lane in range(8)]))
    return b.extract_element(v, ir.Constant(I32, 0))


def target_features() -> frozenset:
    """Features (``"+avx512vnni"`` ...) of the CPU numba compiles for: NUMBA_CPU_FEATURES when set
    (without NUMBA_CPU_NAME: the host's with those added or removed), else the host's;
    plus what the CPU's name implies where LLVM's host query misses it (arm64 names, NEON on
    every arm64 CPU, x86-64-v3 / v4). They are part of the key of numba's on-disk cache entries (codegen
    ``magic_tuple``), so a kernel specialised on them is never served to another CPU."""
    from numba.core import config
    from llvmlite import binding

    host = binding.get_host_cpu_features().flatten().split(",")
    listed = config.CPU_FEATURES.split(",") if config.CPU_FEATURES is not None else host
    if config.CPU_FEATURES is not None and config.CPU_NAME is None:
        # numba names the host's CPU: LLVM starts from the features that name implies (the host's),
        # then adds and removes the listed ones
        listed = [f for f in host if f"-{f[1:]}" not in listed] + listed
    cpu = config.CPU_NAME or binding.get_host_cpu_name()
    if binding.get_process_triple().startswith(("aarch64", "arm64")):
        # NEON (Advanced SIMD) is part of every arm64 CPU (Armv8-A), listed or not
        implied = ("+neon", *_ARM64_IMPLIED.get(cpu, ()))
    else:
        implied = _X86_IMPLIED.get(cpu, ())
    on = {f[1:] for f in listed + [f for f in implied if f"-{f[1:]}" not in listed] if f.startswith("+")}
    off = {f[1:] for f in listed if f.startswith("-")}
    return frozenset(f"+{f}" for f in on if not _needs(f) & off)


def _needs(feature: str) -> set:
    """The features ``feature`` implies in LLVM, transitively (X86.td / AArch64Features.td, the ones
    edge's kernels choose by): turning one of them off turns ``feature`` off too (``-avx2`` on a
    CPU with AVX-512: no AVX-512 either)."""
    direct = _REQUIRES.get(feature, ("avx512f",) if feature.startswith("avx512") and feature != "avx512f" else ())
    out = set(direct)
    for f in direct:
        out |= _needs(f)
    return out


_REQUIRES = {"sse2": ("sse",), "sse3": ("sse2",), "ssse3": ("sse3",), "sse4.1": ("ssse3",), "sse4.2": ("sse4.1",),
             "avx": ("sse4.2",), "avx2": ("avx",), "fma": ("avx",), "f16c": ("avx",), "avx512f": ("avx2", "fma", "f16c"),
             "avxvnni": ("avx2",), "vaes": ("avx", "aes"), "vpclmulqdq": ("avx", "pclmul"), "aes": ("sse2",),
             "pclmul": ("sse2",), "gfni": ("sse2",), "dotprod": ("neon",), "i8mm": ("neon",)}


# x86-64 microarchitecture levels (psABI) by LLVM name: the features edge's kernels choose by that
# the name alone enables (x86-64-v3 with an empty NUMBA_CPU_FEATURES compiles AVX2 code)
_V3 = ("+avx", "+avx2", "+fma", "+f16c", "+bmi", "+bmi2")
_X86_IMPLIED = {"x86-64-v3": _V3, "x86-64-v4": (*_V3, "+avx512f", "+avx512bw", "+avx512cd", "+avx512dq", "+avx512vl")}


# arm64 CPUs by their LLVM name, and the features the name alone enables in LLVM that edge's
# kernels choose by. A host query may not list them: LLVM reads an arm64 host's features from
# /proc/cpuinfo on Linux only, and under qemu-user that file is the x86 host's (it answered
# "-aes,-rand,-sha2,-sve"); LLVM still compiles for everything the CPU name implies.
_DOT, _I8MM = ("+neon", "+dotprod"), ("+neon", "+dotprod", "+i8mm")
_ARM64_IMPLIED = {
    **dict.fromkeys(("apple-a13", "apple-a14", "apple-m1", "cortex-a76", "cortex-a77", "cortex-a78", "cortex-x1",
                     "neoverse-n1", "neoverse-e1"), _DOT),
    **dict.fromkeys(("apple-a15", "apple-a16", "apple-a17", "apple-m2", "apple-m3", "apple-m4", "cortex-a710",
                     "cortex-x2", "cortex-x3", "cortex-x4", "neoverse-n2", "neoverse-v1", "neoverse-v2"), _I8MM),
}


# AVX-512 VNNI on 256- and 512-bit vectors (EVEX vpdpbusd / vpdpwssd ymm need avx512vl too,
# vpmaddubsw zmm avx512bw)
HAS_VNNI = {"+avx512f", "+avx512vnni", "+avx512vl", "+avx512bw"} <= target_features()
# AVX-512 F: 512-bit float vectors (vscalefps for ggml_v_expf: kernels_cpu.attention_tiles)
HAS_AVX512 = "+avx512f" in target_features()
# AVX2 (also on AVX-512 CPUs): vpshufb / vpmaddubsw ymm tiles (kernels_cpu.iq4_avx2, iq23_avx2)
HAS_AVX2 = "+avx2" in target_features()
# AVX-VNNI without AVX-512 VNNI (Intel Alder Lake and later client CPUs, Sierra Forest; ggml's
# __AVXVNNI__): the VEX vpdpbusd / vpdpwssd ymm, which the AVX2 int8 tiles take for their u8 x s8
# 4-way step in place of vpmaddubsw + vpmaddwd (kernels_cpu.matmul_avx2, kquant_int8, iq4_avx2)
HAS_AVX_VNNI = HAS_AVX2 and "+avxvnni" in target_features() and not HAS_VNNI
# AVX2 without AVX-512 VNNI: the ymm int8 tiles (kernels_cpu.matmul_avx2, kquant_int8), 8-bit
# products through vpmaddubsw (vpdpbusd ymm with AVX-VNNI)
HAS_AVX2_INT8 = HAS_AVX2 and not HAS_VNNI
# arm64 NEON with the dot product extension (Armv8.2-A DotProd: Apple M1 and later, Cortex-A76 and
# later, Graviton 2+): sdot, four int8 products into each int32 lane (kernels_cpu.matmul_avx2's tiles)
HAS_DOTPROD = "+dotprod" in target_features()
# arm64 with DotProd and the int8 matrix multiply extension (Armv8.6-A I8MM: Apple M2 and later,
# Cortex-A710 / X2 and later, Neoverse V1 / N2, Graviton 3+): smmla, a 2 x 8 by 8 x 2 int8 product
# into 4 int32 lanes, in the tiles where two activation rows share the weights (kernels_cpu.kquant_int8's
# 8-row Q4_K tiles); the other tiles keep sdot
HAS_I8MM = HAS_DOTPROD and "+i8mm" in target_features()
# Q4_0 / Q5_0 / Q8_0 / Q4_1 / Q5_1 vec_dot tiles from kernels_cpu.matmul_avx2 (their int8 step:
# vpmaddubsw + vpmaddwd, vpdpbusd or sdot) and the Q2_K .. Q6_K tiles of kernels_cpu.kquant_int8
HAS_INT8_VEC_DOT = HAS_AVX2_INT8 or HAS_DOTPROD


def kernel_path(features: frozenset | None = None) -> str:
    """The kernel path edge takes for CPU ``features`` (default: target_features()):
    "avx512-vnni" (AVX-512 VNNI int8 tiles), "avx512" (AVX-512 F without VNNI: the AVX2 int8
    tiles, AVX-512's exp in attention), "avx-vnni" (the AVX2 int8 tiles with VEX vpdpbusd ymm
    for their 4-way u8 x s8 step: AVX-VNNI without AVX-512, HAS_AVX_VNNI), "avx2" (vpmaddubsw /
    vpshufb ymm tiles) or "generic" (plain LLVM vectors); on arm64 "neon-i8mm" (the sdot tiles,
    and smmla in the 8-row Q4_K tiles of two or more activation rows: DotProd and I8MM,
    HAS_I8MM), "neon-dotprod" (sdot in the Q4_0 / Q5_0 / Q8_0 / Q4_1 / Q5_1 and Q2_K .. Q6_K
    tiles) or "neon" (plain LLVM vectors, which LLVM turns into NEON code)."""
    f = target_features() if features is None else features
    if {"+dotprod", "+i8mm"} <= f:
        return "neon-i8mm"
    if "+dotprod" in f:
        return "neon-dotprod"
    if "+neon" in f:
        return "neon"
    if {"+avx512f", "+avx512vnni", "+avx512vl", "+avx512bw"} <= f:
        return "avx512-vnni"
    if "+avx512f" in f:
        return "avx512"
    if {"+avx2", "+avxvnni"} <= f:
        return "avx-vnni"
    return "avx2" if "+avx2" in f else "generic"


def host_lacks() -> list[str]:
    """Features numba's target has ("+name") that this x86 CPU says it lacks: kernels compiled for
    them stop with an illegal instruction here. Empty on arm64, whose host query lists too little
    to tell (LLVM reads nothing on macOS nor under qemu-user)."""
    from llvmlite import binding

    if not binding.get_process_triple().startswith(("x86_64", "i686", "i386")):
        return []
    host = set(binding.get_host_cpu_features().flatten().split(","))
    return sorted(f[1:] for f in target_features() if f"-{f[1:]}" in host)


def cpu_target() -> str:
    """The CPU numba compiles for: NUMBA_CPU_NAME when set, else the host's (LLVM's name)."""
    from numba.core import config
    from llvmlite import binding

    return config.CPU_NAME or binding.get_host_cpu_name()


def _x86_call(b: ir.IRBuilder, name: str, args, ret: ir.Type | None = None):
    fn = b.module.globals.get(name)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ret or args[0].type, [a.type for a in args]), name)
    return b.call(fn, args)


def scalef(b: ir.IRBuilder, x, n):
    """<16 x float> x * 2**floor(n) lane by lane, rounded once (x86 vscalefps, AVX-512 F only)."""
    return _x86_call(b, "llvm.x86.avx512.mask.scalef.ps.512", [x, n, x, ir.Constant(I16, -1), ir.Constant(I32, 4)])


def prefetch(b: ir.IRBuilder, ptr, offset: int):
    """Hint the CPU to fetch the cache line at byte ``offset`` of i8* ``ptr`` into L2
    (llvm.prefetch: read, locality 2, data; x86 prefetcht1). For tiles that compute long
    enough per block that the hardware prefetchers fall behind the stream of weight rows.
    Into L2, not L1: fetching the next tile into L1 (prefetcht0) evicted the current tile's
    lines; a Q8_0 8-row tile over the 145 MB output matrix took 54 ns per row with t0, 36 with
    t1 (34 with the matrix in L3)."""
    name = "llvm.prefetch.p0"
    fn = b.module.globals.get(name)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ir.VoidType(), [BYTE_PTR, I32, I32, I32]), name)
    b.call(fn, [b.gep(ptr, [ir.Constant(I64, offset)]), ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])


def _vnni_call(b: ir.IRBuilder, op: str, acc, u, v):
    n = acc.type.count  # 8 (ymm) or 16 (zmm) i32 lanes
    vi = vec(I32, n)
    return _x86_call(b, f"llvm.x86.avx512.{op}.{32 * n}", [acc, b.bitcast(u, vi), b.bitcast(v, vi)])


def dot_u8_s8(b: ir.IRBuilder, acc, u8, s8):
    """<n x i32> acc + (lane j: sum of u8[4j+k] * s8[4j+k], k < 4), u8 unsigned and s8 signed
    <4n x i8>, n = 8 or 16 (exact; x86 vpdpbusd, AVX-512 VNNI (+ VL for n = 8) only; for n = 8 also
    AVX-VNNI, where LLVM emits the same intrinsic as the VEX ``{vex} vpdpbusd ymm``: ggml's
    _mm256_dpbusd_avx_epi32)."""
    return _vnni_call(b, "vpdpbusd", acc, u8, s8)


def sdot(b: ir.IRBuilder, acc, a, c):
    """<4 x i32> acc + (lane j: sum of a[4j+k] * c[4j+k], k < 4) for signed <16 x i8> a, c
    (exact; arm64 sdot, DotProd only)."""
    return _x86_call(b, "llvm.aarch64.neon.sdot.v4i32.v16i8", [acc, a, c])


def smmla(b: ir.IRBuilder, acc, a, c):
    """<4 x i32> acc + the 2 x 2 int8 matrix product of signed <16 x i8> a (rows: bytes 0-7, 8-15)
    and c (columns: bytes 0-7, 8-15): lane 2i + j = acc[2i + j] + sum over k < 8 of a[8i + k] *
    c[8j + k] (exact; arm64 smmla, I8MM only)."""
    return _x86_call(b, "llvm.aarch64.neon.smmla.v4i32.v16i8", [acc, a, c])


def sdot_256(b: ir.IRBuilder, acc, a, c):
    """<8 x i32> acc (None: zeros) + (lane j: sum of a[4j+k] * c[4j+k], k < 4) for signed <32 x i8>
    a, c: two sdot, 16 bytes each (lanes 0-3, 4-7) (exact; arm64 DotProd only)."""
    zero = ir.Constant(vec(I32, 4), [0] * 4)
    return concat(b, *(sdot(b, zero if acc is None else shuffle(b, acc, range(4 * h, 4 * h + 4)),
                            shuffle(b, a, range(16 * h, 16 * h + 16)), shuffle(b, c, range(16 * h, 16 * h + 16)))
                       for h in range(2)))


def dot_i16(b: ir.IRBuilder, acc, a, x):
    """<n x i32> acc + (lane j: a[2j]*x[2j] + a[2j+1]*x[2j+1]) for <2n x i16> a, x, n = 8 or 16
    (exact; x86 vpdpwssd, AVX-512 VNNI (+ VL for n = 8) only; for n = 8 also AVX-VNNI: ``{vex} vpdpwssd ymm``)."""
    return _vnni_call(b, "vpdpwssd", acc, a, x)


def madd_u8_s8(b: ir.IRBuilder, u8, s8):
    """<64 x i8> u8 (unsigned), s8 (signed) -> <32 x i16>: lane i = u8[2i]*s8[2i] + u8[2i+1]*s8[2i+1]
    (x86 vpmaddubsw, AVX-512 BW). The sum saturates to int16: exact while |sum| <= 32767, e.g.
    u8 <= 127 or |s8| <= 127 with u8 <= 128 (2 * 127 * 128 = 32512)."""
    return _x86_call(b, "llvm.x86.avx512.pmaddubs.w.512", [u8, s8], vec(I16, 32))


def madd_u8_s8_256(b: ir.IRBuilder, u8, s8):
    """<32 x i8> u8 (unsigned), s8 (signed) -> <16 x i16>: lane i = u8[2i]*s8[2i] + u8[2i+1]*s8[2i+1]
    (x86 vpmaddubsw ymm, AVX2), saturated to int16 as madd_u8_s8."""
    return _x86_call(b, "llvm.x86.avx2.pmadd.ub.sw", [u8, s8], vec(I16, 16))


def sum_pairs_i16_256(b: ir.IRBuilder, v):
    """<16 x i16> -> <8 x i32>: lane j = v[2j] + v[2j+1] (exact; x86 vpmaddwd ymm with ones, AVX2)."""
    return _x86_call(b, "llvm.x86.avx2.pmadd.wd", [v, ir.Constant(vec(I16, 16), [1] * 16)], vec(I32, 8))


def sign_i8_256(b: ir.IRBuilder, x, s):
    """<32 x i8>: x[i] * sign(s[i]), 0 where s[i] == 0 (x86 vpsignb ymm, AVX2; -128 stays -128)."""
    return _x86_call(b, "llvm.x86.avx2.psign.b", [x, s])


def tile_function(module: ir.Module, name: str, nr: int, nt: int, accumulators: dict, body, finish,
                  block_bytes: int) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)``, the frame of a matmul tile of ``nr`` weight rows x ``nt`` activation rows.

    Pointers are i8* to the tile's first row (out: float*), strides in bytes (out: in floats);
    ``block_bytes``: bytes per weight block (for prefetching the next tile's rows when nt > 1).
    The function loops over blocks 0 <= blk < nb >= 1 with float-vector accumulators
    ``accumulators`` (name -> list of zero constants): ``body(b, rows, blk, accs)`` emits one
    block and returns the new accumulators (rows: "w", "xq", "xd", "xa" -> row pointers);
    ``finish(b, accs)`` returns {(r, t): float32 value}, stored at out[t*out_stride + r*out_r_stride].
    """
    args = [BYTE_PTR, I64] * 4 + [F32.as_pointer(), I64, I64, I64]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)
    fn.linkage = "internal"
    w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride, out_r_stride, nb = fn.args
    entry, loop, done = (fn.append_basic_block(n) for n in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    row = lambda base, stride, i: b.gep(base, [b.mul(ir.Constant(I64, i), stride)])  # noqa: E731
    rows = {"w": [row(w, w_stride, r) for r in range(nr)]}
    w_next = [row(w, w_stride, nr + r) for r in range(nr)]  # the next tile's rows: may lie past the matrix
    rows.update({k: [row(p, s, t) for t in range(nt)] for k, p, s in
                 (("xq", xq, xq_stride), ("xd", xd, xd_stride), ("xa", xa, xa_stride))})
    b.branch(loop)

    b.position_at_end(loop)
    blk = b.phi(I64)
    blk.add_incoming(ir.Constant(I64, 0), entry)
    accs = {k: [b.phi(z.type) for z in zeros] for k, zeros in accumulators.items()}
    if nt > 1:
        # A tile of several activation rows spends long on each block (compute-bound), and the
        # hardware prefetchers then fall behind its nr interleaved row streams: at a step of 8
        # decode rows the weights waited on DRAM for a third of the time. Fetch the same block
        # of the next tile's rows (the rows a thread takes next) now. Tiles of one activation
        # row (decode) stream at DRAM speed without it, and their next rows are far apart.
        at = b.mul(blk, ir.Constant(I64, block_bytes))
        for p in w_next:
            for line in range(0, block_bytes, 64):
                prefetch(b, b.gep(p, [at]), line)
    new = body(b, rows, blk, accs)
    for k, phis in accs.items():
        for phi, zero, v in zip(phis, accumulators[k], new[k]):
            phi.add_incoming(zero, entry)
            phi.add_incoming(v, b.block)
    blk_next = b.add(blk, ir.Constant(I64, 1))
    blk.add_incoming(blk_next, b.block)
    b.cbranch(b.icmp_signed("<", blk_next, nb), loop, done)

    b.position_at_end(done)
    for (r, t), value in finish(b, new).items():
        at = b.add(b.mul(ir.Constant(I64, t), out_stride), b.mul(ir.Constant(I64, r), out_r_stride))
        b.store(value, b.gep(out, [at]))
    b.ret_void()
    return fn
