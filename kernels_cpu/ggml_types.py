"""The GGML tensor types edge computes with: one row per type, the table everything else reads.

A row holds what ggml spreads over ggml-common.h (the ``block_*`` structs), ggml.c
``type_traits`` (block size, type size) and ggml-cpu.c ``type_traits_cpu`` (``vec_dot_type``):

* ``block_size``: values per block (1 for the float types).
* ``fields``: the block's fields in memory order with their sizes in bytes, as the struct
  declares them; ``type_size`` (bytes per block) is their sum and ``offset(name)`` the byte
  offset of one. The f16 scales of a block are its fields named ``d``, ``m`` and ``dmin``
  (``ggml_half`` in every block struct).
* ``vec_dot_type``: the type a matmul converts the activations to before the dot products
  (Q8_0, Q8_1, Q8_K; F32, F16, BF16 for the float weights).
* ``repacked``: llama.cpp's x86 CPU backend repacks such weights when the row count is a
  multiple of 8 (ggml_repack_get_optimal_repack_type), which changes the kernel it runs.

Kernels are found by name from the row (:func:`kernels`): ``dequant_<type>`` in
kernels_cpu.dequant, ``matmul_<type>_<vec_dot_type>`` (plus ``_repacked`` where ``repacked``) in
kernels_cpu.matmul_kernels, e.g. ``dequant_q4_k`` and ``matmul_q4_k_q8_k``. Adding a type is
one row here plus those kernels (and a quantizer in quant.quantize when edge writes it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32  # values per block of the 32-value types
QK_K = 256  # values per K-quant super-block
K_SCALE_SIZE = 12  # packed 6-bit scales and mins of Q4_K / Q5_K
HALF = 2  # bytes of a ggml_half (f16) field
F16_SCALE_FIELDS = ("d", "m", "dmin")


@dataclass(frozen=True)
class GGMLType:
    """One GGML tensor type: block layout, activation type and kernel names (see the module docstring)."""

    ggml_type: GGMLQuantizationType
    block_size: int
    vec_dot_type: GGMLQuantizationType
    fields: tuple[tuple[str, int], ...]
    repacked: bool = False
    type_size: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "type_size", sum(size for _, size in self.fields))

    @property
    def name(self) -> str:
        """The GGML name, e.g. ``Q4_K``."""
        return self.ggml_type.name

    @property
    def quantized(self) -> bool:
        """A block format (ggml_is_quantized): more than one value per block."""
        return self.block_size > 1

    def offset(self, name: str) -> int:
        """Byte offset of field ``name`` in a block. Raises KeyError for a field the block lacks."""
        at = 0
        for f, size in self.fields:
            if f == name:
                return at
            at += size
        raise KeyError(f"{self.name} blocks have no field {name!r} (fields: {', '.join(f for f, _ in self.fields)})")

    @property
    def f16_scales(self) -> tuple[int, ...]:
        """Byte offsets of the block's f16 scales (d, then m or dmin where present), in memory order."""
        return tuple(self.offset(f) for f, _ in self.fields if f in F16_SCALE_FIELDS)

    def row_bytes(self, n_values: int) -> int:
        """Bytes of ``n_values`` values (ggml_row_size); n_values a multiple of block_size."""
        return n_values // self.block_size * self.type_size

    def kernel_name(self, kind: str) -> str:
        """``dequant_q4_k`` (kind "dequant") or ``matmul_q4_k_q8_k`` (kind "matmul")."""
        if kind == "dequant":
            return f"dequant_{self.name.lower()}"
        if kind == "matmul":
            return f"matmul_{self.name.lower()}_{self.vec_dot_type.name.lower()}"
        raise ValueError(f"unknown kernel kind {kind!r} (dequant, matmul)")


def _row(t: GGMLQuantizationType, block_size: int, vec_dot_type: GGMLQuantizationType, repacked: bool = False,
         **fields: int) -> GGMLType:
    return GGMLType(t, block_size, vec_dot_type, tuple(fields.items()), repacked)


# fields as in ggml-common.h, in memory order: name=bytes
TYPES: dict[GGMLQuantizationType, GGMLType] = {row.ggml_type: row for row in (
    _row(T.F32, 1, T.F32, value=4),
    _row(T.F16, 1, T.F16, value=HALF),
    _row(T.BF16, 1, T.BF16, value=2),
    _row(T.Q4_0, QK4_0, T.Q8_0, repacked=True, d=HALF, qs=QK4_0 // 2),
    _row(T.Q4_1, QK4_1, T.Q8_1, d=HALF, m=HALF, qs=QK4_1 // 2),
    _row(T.Q5_0, QK5_0, T.Q8_0, d=HALF, qh=4, qs=QK5_0 // 2),
    _row(T.Q5_1, QK5_1, T.Q8_1, d=HALF, m=HALF, qh=4, qs=QK5_1 // 2),
    _row(T.Q8_0, QK8_0, T.Q8_0, d=HALF, qs=QK8_0),
    _row(T.Q2_K, QK_K, T.Q8_K, repacked=True, scales=QK_K // 16, qs=QK_K // 4, d=HALF, dmin=HALF),
    _row(T.Q3_K, QK_K, T.Q8_K, hmask=QK_K // 8, qs=QK_K // 4, scales=12, d=HALF),
    _row(T.Q4_K, QK_K, T.Q8_K, repacked=True, d=HALF, dmin=HALF, scales=K_SCALE_SIZE, qs=QK_K // 2),
    _row(T.Q5_K, QK_K, T.Q8_K, d=HALF, dmin=HALF, scales=K_SCALE_SIZE, qh=QK_K // 8, qs=QK_K // 2),
    _row(T.Q6_K, QK_K, T.Q8_K, ql=QK_K // 2, qh=QK_K // 4, scales=QK_K // 16, d=HALF),
    _row(T.IQ4_NL, 32, T.Q8_0, repacked=True, d=HALF, qs=16),
    _row(T.IQ4_XS, QK_K, T.Q8_K, d=HALF, scales_h=2, scales_l=QK_K // 64, qs=QK_K // 2),
    _row(T.MXFP4, 32, T.Q8_0, repacked=True, e=1, qs=16),
    _row(T.IQ1_S, QK_K, T.Q8_K, d=HALF, qs=QK_K // 8, qh=QK_K // 32 * 2),  # qh: uint16[8]
    _row(T.IQ1_M, QK_K, T.Q8_K, qs=QK_K // 8, qh=QK_K // 16, scales=QK_K // 32),  # f16 d in the scales' top nibbles
    _row(T.TQ1_0, QK_K, T.Q8_K, qs=(QK_K - 4 * QK_K // 64) // 5, qh=QK_K // 64, d=HALF),
    _row(T.TQ2_0, QK_K, T.Q8_K, qs=QK_K // 4, d=HALF),
    _row(T.IQ2_XXS, QK_K, T.Q8_K, d=HALF, qs=QK_K // 4),
    _row(T.IQ2_XS, QK_K, T.Q8_K, d=HALF, qs=QK_K // 4, scales=QK_K // 32),
    _row(T.IQ2_S, QK_K, T.Q8_K, d=HALF, qs=QK_K // 4, qh=QK_K // 32, scales=QK_K // 32),
    _row(T.IQ3_XXS, QK_K, T.Q8_K, d=HALF, qs=3 * QK_K // 8),
    _row(T.IQ3_S, QK_K, T.Q8_K, d=HALF, qs=QK_K // 4, qh=QK_K // 32, signs=QK_K // 8, scales=QK_K // 64),
)}
QUANTIZED_TYPES = tuple(t for t, row in TYPES.items() if row.quantized)


def sizes(t: GGMLQuantizationType) -> tuple[int, int]:
    """(values, bytes) per block of any GGML type: the table's row, else gguf's GGML_QUANT_SIZES
    (types a GGUF file may hold that edge only copies). Raises KeyError for an unknown type."""
    row = TYPES.get(t)
    return (row.block_size, row.type_size) if row is not None else GGML_QUANT_SIZES[t]


def kernels(namespace, kind: str, suffix: str = "", types=None, optional: bool = False) -> dict:
    """{type: kernel} for each row of ``types`` (default: every row), the kernel being the
    attribute of ``namespace`` (a module or a dict of globals) named ``row.kernel_name(kind) +
    suffix``. ``optional``: rows without such a kernel are left out; otherwise a missing kernel
    raises LookupError naming it."""
    get = namespace.get if isinstance(namespace, dict) else lambda n, d=None: getattr(namespace, n, d)
    out = {}
    for t in TYPES if types is None else types:
        name = TYPES[t].kernel_name(kind) + suffix
        kernel = get(name, None)
        if kernel is None and not optional:
            raise LookupError(f"GGML type {t.name} has no kernel {name}")
        if kernel is not None:
            out[t] = kernel
    return out
