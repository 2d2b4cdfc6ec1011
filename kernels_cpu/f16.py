"""IEEE half-precision conversions for numba code.

numba has no float16 type on the CPU, so f16 data (KV cache, F16 weights, fp16 block scales)
travels as ``uint16`` and is converted with these intrinsics, which emit LLVM's ``fpext half``
and ``fptrunc ... to half`` (F16C ``vcvtph2ps``/``vcvtps2ph`` on x86, ``fcvt`` on arm64).
Both are exact IEEE conversions: ``f16_to_f32`` equals ``np.float16 -> np.float32`` and
``f32_to_f16`` rounds to nearest even like ``np.float32.astype(np.float16)``.

Without F16C (a generic x86-64 target) LLVM turns these conversions, scalar and vector, into
calls of the compiler runtime's ``__extendhfsf2`` / ``__truncsfhf2`` (``__gnu_h2f_ieee`` /
``__gnu_f2h_ieee`` before LLVM 15), which the JIT cannot find in the process: the kernels
called address 0 (a segfault at import, building ops.GELU_TABLE). :func:`install_half_libcalls`
(run when kernels_cpu is imported) defines them, in integer arithmetic with F16C's results
(NaNs made quiet, payloads kept), so the kernels run on any x86-64 and give the same bits.
"""
import llvmlite.binding as ll
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# half <-> float on integers; edge_d2h rounds to odd to float first (exact, then one rounding)
_HALF_IR = r"""
define internal float @edge_h2f(i16 %h16) {
  %h = zext i16 %h16 to i32
  %sign = and i32 %h, 32768
  %sign32 = shl i32 %sign, 16
  %e = lshr i32 %h, 10
  %exp = and i32 %e, 31
  %man = and i32 %h, 1023
  %e1 = add i32 %exp, 112
  %e2 = shl i32 %e1, 23
  %m13 = shl i32 %man, 13
  %norm = or i32 %e2, %m13
  %mnz = icmp ne i32 %man, 0
  %quiet = select i1 %mnz, i32 4194304, i32 0
  %in = or i32 %m13, 2139095040
  %infnan = or i32 %in, %quiet
  %mf = uitofp i32 %man to float
  %sf = fmul float %mf, 0x3E70000000000000
  %sub = bitcast float %sf to i32
  %isinf = icmp eq i32 %exp, 31
  %iszero = icmp eq i32 %exp, 0
  %r1 = select i1 %iszero, i32 %sub, i32 %norm
  %r2 = select i1 %isinf, i32 %infnan, i32 %r1
  %r = or i32 %r2, %sign32
  %f = bitcast i32 %r to float
  ret float %f
}

define internal i16 @edge_f2h(float %f) {
  %u = bitcast float %f to i32
  %sign = and i32 %u, 2147483648
  %a = xor i32 %u, %sign
  %big = icmp uge i32 %a, 1199570944
  %isnan = icmp ugt i32 %a, 2139095040
  %p = lshr i32 %a, 13
  %pay = and i32 %p, 1023
  %nanv = or i32 %pay, 32256
  %bigv = select i1 %isnan, i32 %nanv, i32 31744
  %small = icmp ult i32 %a, 947912704
  %af = bitcast i32 %a to float
  %s1 = fadd float %af, 0x3FE0000000000000
  %s2 = bitcast float %s1 to i32
  %smallv = sub i32 %s2, 1056964608
  %odd = and i32 %p, 1
  %n1 = add i32 %a, -939520001
  %n2 = add i32 %n1, %odd
  %normv = lshr i32 %n2, 13
  %v1 = select i1 %small, i32 %smallv, i32 %normv
  %v2 = select i1 %big, i32 %bigv, i32 %v1
  %sg = lshr i32 %sign, 16
  %v = or i32 %v2, %sg
  %r = trunc i32 %v to i16
  ret i16 %r
}

declare double @llvm.fabs.f64(double)

define internal i16 @edge_d2h(double %d) {
  %f = fptrunc double %d to float
  %fe = fpext float %f to double
  %fb = bitcast float %f to i32
  %ad = call double @llvm.fabs.f64(double %d)
  %afe = call double @llvm.fabs.f64(double %fe)
  %over = fcmp ogt double %afe, %ad
  %fb1 = sub i32 %fb, 1
  %t = select i1 %over, i32 %fb1, i32 %fb
  %tf = bitcast i32 %t to float
  %te = fpext float %tf to double
  %inexact = fcmp one double %te, %d
  %t1 = or i32 %t, 1
  %o = select i1 %inexact, i32 %t1, i32 %t
  %of = bitcast i32 %o to float
  %h = call i16 @edge_f2h(float %of)
  ret i16 %h
}
"""
# LLVM >= 15: half passed in an XMM register; before: as i16 under GCC's old names
_HALF_ABI_NEW = r"""
define float @__extendhfsf2(half %h) {
  %b = bitcast half %h to i16
  %r = call float @edge_h2f(i16 %b)
  ret float %r
}
define half @__truncsfhf2(float %f) {
  %b = call i16 @edge_f2h(float %f)
  %h = bitcast i16 %b to half
  ret half %h
}
define half @__truncdfhf2(double %d) {
  %b = call i16 @edge_d2h(double %d)
  %h = bitcast i16 %b to half
  ret half %h
}
"""
_HALF_ABI_OLD = r"""
define float @__gnu_h2f_ieee(i16 %b) {
  %r = call float @edge_h2f(i16 %b)
  ret float %r
}
define i16 @__gnu_f2h_ieee(float %f) {
  %b = call i16 @edge_f2h(float %f)
  ret i16 %b
}
define i16 @__truncdfhf2(double %d) {
  %b = call i16 @edge_d2h(double %d)
  ret i16 %b
}
"""
_half_engine = None  # the execution engine that holds the installed conversions (kept alive)


def install_half_libcalls() -> list[str]:
    """Define the compiler runtime's half-precision conversions (module docstring) in the
    process for numba's JIT, those it does not find already; returns the names defined.
    Idempotent. Only on x86-64 (other targets have their own conversion instructions)."""
    global _half_engine
    if _half_engine is not None or not ll.get_process_triple().startswith("x86_64"):
        return []
    ll.initialize_native_target()
    ll.initialize_native_asmprinter()
    abi = _HALF_ABI_NEW if ll.llvm_version_info[0] >= 15 else _HALF_ABI_OLD
    names = [line.split("@")[1].split("(")[0] for line in abi.splitlines() if line.startswith("define")]
    missing = [n for n in names if not ll.address_of_symbol(n)]
    if not missing:
        return []
    module = ll.parse_assembly(_HALF_IR + abi)
    module.triple = ll.get_process_triple()
    module.verify()
    tm = ll.Target.from_triple(module.triple).create_target_machine(cpu="x86-64", features="", opt=2)
    engine = ll.create_mcjit_compiler(module, tm)
    engine.finalize_object()
    for n in missing:
        ll.add_symbol(n, engine.get_function_address(n))
    _half_engine = engine
    return missing


@intrinsic
def f16_to_f32(typingctx, bits):
    """uint16 bit pattern of an IEEE half -> float32 (exact)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 16:
            v = builder.trunc(v, ir.IntType(16)) if v.type.width > 16 else builder.zext(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_f16(typingctx, value):
    """float32 (or float64) -> uint16 bit pattern of the nearest IEEE half (ties to even)."""
    if not isinstance(value, types.Float):
        return None
    sig = types.uint16(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen
