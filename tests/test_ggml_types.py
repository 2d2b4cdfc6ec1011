"""The GGML type table (kernels_cpu.ggml_types): its rows agree with gguf-py and ggml-common.h,
and every reader of types (kernels, quantizers, KV cache, CLI) follows it."""
from __future__ import annotations

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from kernels_cpu.ggml_types import QK_K, TYPES, GGMLType, kernels, sizes


def test_rows_match_gguf_sizes_and_ggml_layouts():
    assert [t.name for t in TYPES] == ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                       "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
                                       "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0",
                                       "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
    for t, row in TYPES.items():
        assert (row.block_size, row.type_size) == GGML_QUANT_SIZES[t], t.name
    q4_k = TYPES[T.Q4_K]
    assert q4_k.type_size == 2 + 2 + 12 + QK_K // 2 == 144
    assert [q4_k.offset(f) for f in ("d", "dmin", "scales", "qs")] == [0, 2, 4, 16]
    assert {t.name: row.f16_scales for t, row in TYPES.items() if row.quantized} == {
        "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
        "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
        "MXFP4": (), "IQ1_S": (0,), "IQ1_M": (), "TQ1_0": (52,), "TQ2_0": (64,),
        "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,)}  # IQ1_M: f16 d in the scales' top nibbles
    assert {t.name: row.vec_dot_type.name for t, row in TYPES.items()} == {
        "F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q8_0", "Q4_1": "Q8_1", "Q5_0": "Q8_0",
        "Q5_1": "Q8_1", "Q8_0": "Q8_0", "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K",
        "Q6_K": "Q8_K", "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_K", "MXFP4": "Q8_0", "IQ1_S": "Q8_K", "IQ1_M": "Q8_K",
        "TQ1_0": "Q8_K", "TQ2_0": "Q8_K",
        "IQ2_XXS": "Q8_K", "IQ2_XS": "Q8_K", "IQ2_S": "Q8_K", "IQ3_XXS": "Q8_K", "IQ3_S": "Q8_K"}
    assert [t.name for t, row in TYPES.items() if row.repacked] == ["Q4_0", "Q2_K", "Q4_K", "IQ4_NL", "MXFP4"]
    assert TYPES[T.Q6_K].row_bytes(512) == 420
    assert sizes(T.Q8_K) == GGML_QUANT_SIZES[T.Q8_K]  # a type outside the table: gguf's sizes


def test_errors_name_the_field_and_the_kernel():
    with pytest.raises(KeyError, match="Q8_0 blocks have no field 'dmin' \\(fields: d, qs\\)"):
        TYPES[T.Q8_0].offset("dmin")
    with pytest.raises(LookupError, match="GGML type Q4_K has no kernel dequant_q4_k"):
        kernels({}, "dequant", types=[T.Q4_K])
    assert kernels({}, "matmul", "_bi", types=[T.Q4_0], optional=True) == {}
    with pytest.raises(ValueError, match="unknown kernel kind 'quantize'"):
        TYPES[T.Q4_0].kernel_name("quantize")


def test_readers_follow_the_table():
    from edge.cli import QUANTIZE_TYPES
    from edge.kv.cache import kv_row
    from kernels_cpu import dequant, matmul_kernels
    from quant.mix import FILE_TYPES, parse_tensor_type
    from quant.quantize import SUPPORTED_TYPES
    from quant.errors import QuantizeError

    assert list(dequant.KERNELS) == list(TYPES)
    assert dequant.KERNELS[T.Q6_K] is dequant.dequant_q6_k
    assert set(matmul_kernels.QUANT_KERNELS) == {t for t, row in TYPES.items() if row.quantized}
    assert matmul_kernels.QUANT_KERNELS[T.Q4_K] is matmul_kernels.matmul_q4_k_q8_k
    assert set(matmul_kernels.REPACKED_KERNELS) == {T.Q4_0, T.Q2_K, T.Q4_K, T.IQ4_NL, T.MXFP4}
    # types edge computes with but does not write (no quantizer yet)
    assert set(SUPPORTED_TYPES) <= set(TYPES)
    assert set(TYPES) - set(SUPPORTED_TYPES) == {T.MXFP4, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0,
                                                T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S}
    assert kv_row("q8_0", 64) == 2 * 34 and kv_row("f16", 64) == 64
    assert QUANTIZE_TYPES == ", ".join(FILE_TYPES)
    with pytest.raises(QuantizeError, match="choose one of: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K"):
        parse_tensor_type("IQ2_XXS", "--output-tensor-type")


def test_a_row_is_its_fields():
    row = GGMLType(T.Q8_0, 32, T.Q8_0, (("d", 2), ("qs", 32)))
    assert row.type_size == 34 and row.name == "Q8_0" and row.kernel_name("matmul") == "matmul_q8_0_q8_0"
