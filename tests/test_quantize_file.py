"""`edge quantize` (quant/mix.py, quant/pipeline.py, edge/cli/quantize.py) against llama-quantize.

(a) Type choice: the five golden mixes of gemma-3-270m (quantize.json) and the tables of the
    design note for the other eleven ftypes, by tensor name; the options on gemma and on
    synthetic tensor lists; and, when llama-cpp-python is there, llama.cpp's own choice
    (llama_model_quantize dry run) for all 16 ftypes x options on gemma and both Qwen models.
(b) Files: for the five golden mixes, the output of the F16 source has quantize.json's file size,
    and every tensor its golden type and sha256; with llama-cpp-python, whole files (an option
    mix, a requantization) equal llama.cpp's byte for byte.
(c) edge loads the quantized files and their perplexity is within 0.5% of llama.cpp's.
(d) llama-cpp-python loads and runs edge's output.
(e) Atomic output (Ctrl+C, errors), bad inputs and BUGS.md Q1 (NaN, overflow) through the CLI.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter

from edge.cli import QUANTIZE_TYPES, main
from edge.gguf_file import GGUFFile
from edge.store import resolve_model
from quant.errors import QuantizeError
from quant.mix import (FILE_TYPES, ModelParams, QuantizeOptions, choose_types, layer_index, llama_order,
                       parse_file_type, parse_tensor_type)
from quant.pipeline import plan_quantize, quantize_file
from tests.conftest import GOLDEN, golden, real_model_path

GOLD = golden("gemma3-270m", "quantize.json")
GOLDEN_MIXES = list(GOLD["quantized"])                    # Q8_0, Q4_0, Q4_K_M, Q6_K, Q5_K_M


# ------------------------------------------------------------------------------------- helpers
def _tensor_list(gf: GGUFFile) -> list[tuple[str, tuple[int, ...], T]]:
    return [(t.name, t.shape, t.ggml_type) for t in gf.tensors.values()]


def _types(ftype: str, gf: GGUFFile, **options) -> dict[str, str]:
    choice = choose_types(_tensor_list(gf), FILE_TYPES[ftype], QuantizeOptions(**options), ModelParams.from_gguf(gf))
    return {c.name: c.new_type.name for c in choice}


def _kind_layer(name: str) -> tuple[str, int]:
    """('attn_v', 3) for blk.3.attn_v.weight; ('token_embd', -1) for token_embd.weight."""
    parts = name.split(".")
    return (parts[2], int(parts[1])) if name.startswith("blk.") else (parts[0], -1)


@pytest.fixture(scope="module")
def gemma_src(gemma_f16_path) -> GGUFFile:
    return GGUFFile(gemma_f16_path)


@pytest.fixture(scope="module")
def quantized(gemma_quant_lab):
    """ftype -> path of edge's quantization of the F16 source (made once per session)."""
    return gemma_quant_lab.quantized


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], n_layer: int = 2, alignment: int | None = None) -> Path:
    """A small llama-architecture GGUF with the given float tensors (numpy order, F32/F16)."""
    w = GGUFWriter(path, "llama")
    w.add_block_count(n_layer)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_string("general.name", "tiny")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for name, x in tensors.items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_model(rng, **overrides) -> dict[str, np.ndarray]:
    """F32 tensors of a 2-layer model with 256-value rows (every K-quant fits)."""
    t = {"token_embd.weight": rng.standard_normal((64, 256)), "output_norm.weight": np.ones(256),
         "output.weight": rng.standard_normal((64, 256))}
    for i in range(2):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            t[f"blk.{i}.{kind}.weight"] = rng.standard_normal((32, 256)) * 0.05
        t[f"blk.{i}.attn_norm.weight"] = np.ones(256)
    t.update(overrides)
    return {k: np.asarray(v, dtype=np.float32) for k, v in t.items()}


# ---------------------------------------------------------------------------- (a) type choice
@pytest.mark.slow
@pytest.mark.parametrize("ftype", GOLDEN_MIXES)
def test_types_and_order_equal_golden(gemma_src, ftype):
    """Every tensor of llama-quantize's file, in its order, with its type."""
    want = [(t["name"], t["type"]) for t in GOLD["quantized"][ftype]["tensors"]]
    assert list(_types(ftype, gemma_src).items()) == want


UBM = {0, 1, 4, 7, 10, 13, 15, 16, 17}      # use_more_bits(i, 18)
# note 2.6, gemma3 (18 layers, n_gqa 4, rows of 640 except attn_output 1024 and ffn_down 2048):
# kind -> type, or (layers, type in those layers, type in the others); "qkgu" = attn_q/k, ffn_gate/up
NOTE_TABLES = {
    "Q8_0": {"qkgu": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_down": "Q8_0"},
    "Q4_0": {"qkgu": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_0", "ffn_down": "Q4_0"},
    "Q4_1": {"qkgu": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_1", "ffn_down": "Q4_1"},
    "Q5_0": {"qkgu": "Q5_0", "attn_v": "Q5_0", "attn_output": "Q5_0", "ffn_down": "Q5_0"},
    "Q5_1": {"qkgu": "Q5_1", "attn_v": "Q5_1", "attn_output": "Q5_1", "ffn_down": "Q5_1"},
    "Q2_K": {"qkgu": "Q4_0", "attn_v": "Q5_0", "attn_output": "Q3_K", "ffn_down": "Q3_K"},
    "Q3_K_S": {"qkgu": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q3_K", "ffn_down": "Q3_K"},
    "Q3_K_M": {"qkgu": "Q4_0", "attn_v": ({0, 1}, "Q5_1", "Q5_0"), "attn_output": "Q4_K",
               "ffn_down": ({0}, "Q5_K", "Q4_K")},
    "Q3_K_L": {"qkgu": "Q4_0", "attn_v": "Q5_1", "attn_output": "Q5_K", "ffn_down": "Q5_K"},
    "Q4_K_S": {"qkgu": "Q5_0", "attn_v": ({0, 1, 2, 3}, "Q5_1", "Q5_0"), "attn_output": "Q4_K",
               "ffn_down": ({0, 1}, "Q5_K", "Q4_K")},
    "Q4_K_M": {"qkgu": "Q5_0", "attn_v": (UBM, "Q8_0", "Q5_0"), "attn_output": "Q4_K",
               "ffn_down": (UBM, "Q6_K", "Q4_K")},
    "Q5_K_S": {"qkgu": "Q5_1", "attn_v": "Q5_1", "attn_output": "Q5_K", "ffn_down": "Q5_K"},
    "Q5_K_M": {"qkgu": "Q5_1", "attn_v": (UBM, "Q8_0", "Q5_1"), "attn_output": "Q5_K",
               "ffn_down": (UBM, "Q6_K", "Q5_K")},
    "Q6_K": {"qkgu": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q6_K", "ffn_down": "Q6_K"},
    "F16": {"qkgu": "F16", "attn_v": "F16", "attn_output": "F16", "ffn_down": "F16"},
    "BF16": {"qkgu": "BF16", "attn_v": "BF16", "attn_output": "BF16", "ffn_down": "BF16"},
}


def _note_type(ftype: str, name: str, shape: tuple[int, ...]) -> str:
    if len(shape) == 1:
        return "F32"                                           # norms: copied
    kind, layer = _kind_layer(name)
    if kind == "token_embd":
        return ftype if ftype in ("F16", "BF16") else "Q8_0"   # tied: the output rule
    rule = NOTE_TABLES[ftype]["qkgu" if kind in ("attn_q", "attn_k", "ffn_gate", "ffn_up") else kind]
    return rule if isinstance(rule, str) else rule[1] if layer in rule[0] else rule[2]


@pytest.mark.slow
@pytest.mark.parametrize("ftype", NOTE_TABLES)
def test_types_equal_note_tables(gemma_src, ftype):
    """The K-quant and legacy mixes (the IQ / TQ / MXFP4 ones: tests/test_iq_mix.py)."""
    assert set(NOTE_TABLES) <= set(FILE_TYPES) and set(FILE_TYPES) == set(QUANTIZE_TYPES.split(", "))
    got = _types(ftype, gemma_src)
    want = {t.name: _note_type(ftype, t.name, t.shape) for t in gemma_src.tensors.values()}
    assert got == want


@pytest.mark.slow
def test_options_on_gemma(gemma_src):
    """Note 2.5, each checked against llama.cpp there: gemma has no output.weight (tied)."""
    base = _types("Q4_K_M", gemma_src)
    pure = _types("Q4_K_M", gemma_src, pure=True)
    for name, t in pure.items():
        kind, _ = _kind_layer(name)
        if "norm" not in kind:
            assert t == ("Q4_K" if kind in ("attn_output", "ffn_down") else "Q5_0"), name
    out_q4 = _types("Q4_K_M", gemma_src, output_tensor_type=T.Q4_0)
    assert out_q4 == {**base, "token_embd.weight": "Q4_0"}            # tied token_embd follows it
    out_k = _types("Q4_K_M", gemma_src, output_tensor_type=T.Q4_K)
    assert out_k["token_embd.weight"] == "Q5_0"                        # ... through the fallback
    assert _types("Q4_K_M", gemma_src, output_tensor_type=T.Q4_0, pure=True)["token_embd.weight"] == "Q5_0"
    tok = _types("Q4_K_M", gemma_src, token_embedding_type=T.Q4_1)
    assert tok == {**base, "token_embd.weight": "Q4_1"}
    assert _types("Q4_0", gemma_src, leave_output_tensor=True)["token_embd.weight"] == "Q8_0"
    with pytest.raises(QuantizeError, match=r"--token-embedding-type Q6_K: token_embd.weight has rows of 640"):
        _types("Q4_K_M", gemma_src, token_embedding_type=T.Q6_K)


def _synthetic(ftype: str, tensors, model=ModelParams("llama", n_layer=2, n_head=8, n_head_kv=8), **options):
    choice = choose_types(tensors, FILE_TYPES[ftype], QuantizeOptions(**options), model)
    return {c.name: c.new_type.name for c in choice}


UNTIED = [("token_embd.weight", (256, 1000), T.F16), ("output.weight", (256, 1000), T.F16),
          ("output_norm.weight", (256,), T.F32), ("blk.1.attn_v.weight", (256, 256), T.F16),
          ("blk.0.attn_v.weight", (256, 256), T.F16), ("blk.0.ffn_down.weight", (512, 256), T.F16),
          ("blk.1.ffn_down.weight", (512, 256), T.F16), ("blk.0.attn_v.bias", (256,), T.F32),
          ("blk.0.ffn_gate_inp.weight", (256, 8), T.F32), ("blk.0.attn_k.weight", (256, 256, 1), T.F16)]


def test_untied_output_rules():
    """With output.weight: it takes Q6_K (Q8_0 stays Q8_0), token_embd keeps the base type;
    --output-tensor-type and --token-embedding-type apply to their own tensor only;
    --leave-output-tensor copies output.weight; kept tensors keep their type."""
    q4km = _synthetic("Q4_K_M", UNTIED)      # use_more_bits(i, 2) is true for i = 1 only
    assert q4km == {"token_embd.weight": "Q4_K", "output.weight": "Q6_K", "output_norm.weight": "F32",
                    "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.bias": "F32", "blk.0.attn_v.weight": "Q4_K",
                    "blk.0.ffn_down.weight": "Q4_K", "blk.0.ffn_gate_inp.weight": "F32",
                    "blk.1.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"}
    assert list(q4km)[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]   # llama order
    assert _synthetic("Q8_0", UNTIED)["output.weight"] == "Q8_0"
    opt = _synthetic("Q4_K_M", UNTIED, output_tensor_type=T.Q5_K, token_embedding_type=T.Q2_K)
    assert (opt["output.weight"], opt["token_embd.weight"]) == ("Q5_K", "Q2_K")
    assert _synthetic("Q4_K_M", UNTIED, leave_output_tensor=True)["output.weight"] == "F16"
    # a tensor of shape [256, 256, 1] is 2-D for ggml (ggml_n_dims), so it is quantized
    assert _synthetic("Q4_0", UNTIED, pure=True)["blk.0.attn_k.weight"] == "Q4_0"


def test_fallback_and_requantize_rules():
    """BUGS.md G3: rows of 896 (Qwen2.5-0.5B) take the fallback of each K-quant; a quantized
    source tensor is refused unless allowed, but copied when its type does not change."""
    rows896 = [("blk.0.attn_q.weight", (896, 896), T.F16), ("blk.0.ffn_down.weight", (4864, 896), T.F16),
               ("blk.1.ffn_down.weight", (4864, 896), T.F16), ("blk.0.attn_v.weight", (896, 128), T.F16)]
    model = ModelParams("qwen2", n_layer=2, n_head=14, n_head_kv=2)
    # attn_q Q4_K -> Q5_0, attn_v Q6_K -> Q8_0; ffn_down's rows of 4864 fit Q4_K / Q6_K
    assert _synthetic("Q4_K_M", rows896, model) == {"blk.0.attn_q.weight": "Q5_0", "blk.0.attn_v.weight": "Q8_0",
                                                   "blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K"}
    assert _synthetic("Q2_K", rows896, model)["blk.0.attn_q.weight"] == "Q4_0"
    assert _synthetic("Q5_K_S", rows896, model)["blk.0.attn_q.weight"] == "Q5_1"
    odd = [("blk.0.attn_q.weight", (100, 64), T.F32)]                 # 100 values: no block fits
    assert _synthetic("Q4_K_M", odd) == {"blk.0.attn_q.weight": "F16"}
    quantized = [("blk.0.attn_q.weight", (256, 64), T.Q8_0), ("blk.0.attn_k.weight", (256, 64), T.Q4_K)]
    with pytest.raises(QuantizeError, match=r"tensor blk.0.attn_k.weight is already quantized \(Q4_K\).*"
                                            r"--allow-requantize"):
        _synthetic("Q8_0", quantized)
    assert _synthetic("Q8_0", quantized[:1]) == {"blk.0.attn_q.weight": "Q8_0"}          # same type: copied
    assert _synthetic("Q8_0", quantized, allow_requantize=True)["blk.0.attn_k.weight"] == "Q8_0"


def test_moe_and_70b_rules():
    """8 experts: attn_v and attn_k Q8_0, attn_output Q5_K, ffn_down's layer from its name (10:
    Q4_K; the running count, 0, would give Q6_K); LLaMA-70B (80 layers, GQA): attn_v Q5_K."""
    moe = ModelParams("llama", n_layer=32, n_head=32, n_head_kv=8, n_expert=8)
    t = [("blk.10.attn_v.weight", (4096, 1024), T.F16), ("blk.10.attn_k.weight", (4096, 1024), T.F16),
         ("blk.10.attn_output.weight", (4096, 4096), T.F16),
         ("blk.10.ffn_down_exps.weight", (14336, 4096, 8), T.F16)]
    assert _synthetic("Q4_K_M", t, moe) == {"blk.10.attn_v.weight": "Q8_0", "blk.10.attn_k.weight": "Q8_0",
                                            "blk.10.attn_output.weight": "Q5_K",
                                            "blk.10.ffn_down_exps.weight": "Q4_K"}
    with pytest.raises(QuantizeError, match="cannot determine its layer"):
        _synthetic("Q4_K_M", [("ffn_down.weight", (256, 256), T.F16)], moe)
    big = ModelParams("llama", n_layer=80, n_head=64, n_head_kv=8)
    assert big.is_70b and not ModelParams("llama", n_layer=80, n_head=64, n_head_kv=64).is_70b
    v = [(f"blk.{i}.attn_v.weight", (8192, 1024), T.F16) for i in range(80)]
    assert set(_synthetic("Q3_K_M", v, big).values()) == {"Q5_K"}


def test_model_params_from_gguf(tmp_path):
    """Per-layer head counts (arrays) count by layer 0, as llama_hparams::n_gqa(0)."""
    w = GGUFWriter(tmp_path / "m.gguf", "llama")
    w.add_block_count(2)
    w.add_head_count(8)
    w.add_key_value("llama.attention.head_count_kv", [2, 4], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    w.add_uint32("llama.expert_count", 8)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = ModelParams.from_gguf(GGUFFile(tmp_path / "m.gguf"))
    assert (p.arch, p.n_layer, p.n_head, p.n_head_kv, p.n_gqa, p.n_expert) == ("llama", 2, 8, 2, 4, 8)


def test_parse_types_and_order():
    assert parse_file_type("q4_k_m") is FILE_TYPES["Q4_K_M"] and parse_file_type("15") is FILE_TYPES["Q4_K_M"]
    assert FILE_TYPES["BF16"].file_type == 32 and FILE_TYPES["Q8_0"].file_type == 7
    with pytest.raises(QuantizeError, match="unknown quantization type 'Q4_K_X'; choose one of: F16, BF16"):
        parse_file_type("Q4_K_X")
    # llama-quantize's aliases, and its types edge does not write named as such
    assert [parse_file_type(a).name for a in ("Q3_K", "q4_k", "Q5_K")] == ["Q3_K_M", "Q4_K_M", "Q5_K_M"]
    with pytest.raises(QuantizeError, match="Q1_0 is a llama-quantize type that edge does not write; choose one of"):
        parse_file_type("q1_0")
    assert parse_file_type("iq4_xs") is FILE_TYPES["IQ4_XS"] and FILE_TYPES["IQ4_XS"].file_type == 30
    assert parse_tensor_type("q6_k", "--output-tensor-type") is T.Q6_K
    with pytest.raises(QuantizeError, match="--output-tensor-type: unknown or unsupported GGML type 'IQ2_XXS'"):
        parse_tensor_type("IQ2_XXS", "--output-tensor-type")
    assert parse_tensor_type("iq4_nl", "--output-tensor-type") is T.IQ4_NL
    assert layer_index("blk.12.attn_q.weight") == 12 and layer_index("output.weight") == -1
    assert llama_order(["blk.10.a", "blk.2.b", "token_embd.weight", "blk.2.a", "output.weight"]) == \
        ["output.weight", "token_embd.weight", "blk.2.a", "blk.2.b", "blk.10.a"]


_ORACLE_TYPES = r"""
import ctypes, json, re, sys
import llama_cpp
lines = []
@llama_cpp.llama_log_callback
def _log(level, text, user_data):
    lines.append(text.decode("utf-8", "replace"))
llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
row = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), size =[^(\n]*(?:\((\S+)\))?")
out = {}
for case in json.loads(sys.stdin.read()):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + case["ftype"])
    p.dry_run = True
    for k, v in case["params"].items():
        setattr(p, k, getattr(llama_cpp, "GGML_TYPE_" + v) if k.endswith("_type") else v)
    lines.clear()
    rc = llama_cpp.llama_model_quantize(case["src"].encode(), b"/dev/null", p)
    out[case["id"]] = {"rc": rc, "types": [[m[1], (m[3] or m[2]).upper()] for m in row.finditer("".join(lines))]}
print(json.dumps(out))
"""
ORACLE_OPTIONS = [{}, {"pure": True}, {"output_tensor_type": "Q4_0"}, {"output_tensor_type": "Q5_K"},
                  {"output_tensor_type": "Q4_0", "pure": True}, {"token_embedding_type": "Q4_1"},
                  {"quantize_output_tensor": False}]


@pytest.mark.slow
def test_types_equal_llama_cpp_dry_run(gemma_f16_path, oracle_python):
    """llama_model_quantize (dry run) on gemma (F16, tied), Qwen2.5-0.5B (rows of 896, untied)
    and Qwen2.5-1.5B (rows of 1536, all K-quants fit): every ftype x option set gives the same
    tensors, order and types; where llama.cpp would write a row its block does not divide
    (--output-tensor-type Q5_K on rows of 896, an abort in a real run) edge refuses up front."""
    sources = {"gemma": Path(gemma_f16_path), "qwen05": real_model_path("qwen2.5-coder-0.5b"),
               "qwen15": resolve_model("qwen2.5-coder-1.5b-instruct")}
    cases = [{"id": f"{s}|{ft}|{i}", "src": str(p), "ftype": ft, "params": {**o, "allow_requantize": True}}
             for s, p in sources.items() for ft in NOTE_TABLES for i, o in enumerate(ORACLE_OPTIONS)
             if s != "qwen15" or i < 2]           # 1.5B: the mixture rules without fallback, plain and pure
    proc = subprocess.run([str(oracle_python), "-c", _ORACLE_TYPES], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref = json.loads(proc.stdout)
    files = {s: GGUFFile(p) for s, p in sources.items()}
    n_refused = 0
    for case in cases:
        s, ft, i = case["id"].split("|")
        o = ORACLE_OPTIONS[int(i)]
        options = dict(allow_requantize=True, pure=o.get("pure", False),
                       leave_output_tensor=not o.get("quantize_output_tensor", True),
                       output_tensor_type=T[o["output_tensor_type"]] if "output_tensor_type" in o else None,
                       token_embedding_type=T[o["token_embedding_type"]] if "token_embedding_type" in o else None)
        want = ref[case["id"]]
        assert want["rc"] == 0 and len(want["types"]) == len(files[s].tensors), case["id"]
        try:
            got = list(_types(ft, files[s], **options).items())
        except QuantizeError as e:
            n_refused += 1
            bad = [t for n, t in want["types"] if n == "output.weight"]
            assert o.get("output_tensor_type") == "Q5_K" and s == "qwen05" and bad == ["Q5_K"], (case["id"], e)
            continue
        assert got == [tuple(x) for x in want["types"]], case["id"]
    assert n_refused == len(NOTE_TABLES)    # the IQ / TQ / MXFP4 mixes: tests/test_iq_mix.py


# ------------------------------------------------------------------------------- (b) the files
@pytest.mark.slow
@pytest.mark.parametrize("ftype", GOLDEN_MIXES)
def test_file_equals_golden(quantized, gemma_src, ftype):
    """Size of llama-quantize's file; every tensor's type and sha256; the KV pairs of the source
    with general.file_type and general.quantization_version moved to the end."""
    gold = GOLD["quantized"][ftype]
    t0 = time.perf_counter()
    out = GGUFFile(quantized(ftype))
    print(f"{ftype}: {time.perf_counter() - t0:.1f} s")
    assert out.file_size == int(gold["file_size"])
    assert list(out.tensors) == [t["name"] for t in gold["tensors"]]
    for t in gold["tensors"]:
        assert out.tensors[t["name"]].ggml_type.name == t["type"], t["name"]
        assert hashlib.sha256(out.tensor_bytes(t["name"])).hexdigest() == t["sha256"], t["name"]
    moved = ["general.quantization_version", "general.file_type"]
    assert list(out.fields) == [k for k in gemma_src.fields if k not in moved] + moved
    assert out.get("general.file_type") == FILE_TYPES[ftype].file_type and out.get("general.quantization_version") == 2
    assert out.alignment == 32 and out.data_offset == 6_525_120


@pytest.mark.slow
def test_dry_run_plan(gemma_f16_path, tmp_path, capsys):
    """--dry-run prints every tensor and the exact output size, and writes nothing."""
    out = tmp_path / "never.gguf"
    assert main(["quantize", str(gemma_f16_path), str(out), "Q4_K_M", "--dry-run"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert len(text) == 237 and not out.exists() and list(tmp_path.iterdir()) == []
    assert "token_embd.weight" in text[1] and "F16 -> Q8_0" in text[1] and "178,257,920 bytes" in text[1]
    assert "(Q4_K does not fit rows of 640)" in text[2]                           # blk.0.attn_k.weight -> Q5_0
    size = int(GOLD["quantized"]["Q4_K_M"]["file_size"])
    assert text[-1].startswith(f"Q4_K_M: 236 tensors, 127 converted; output {size:,} bytes")
    for ftype in GOLDEN_MIXES:
        assert plan_quantize(gemma_f16_path, FILE_TYPES[ftype], QuantizeOptions()).output_size == \
            int(GOLD["quantized"][ftype]["file_size"])
    # the output paths the real run refuses, the dry run refuses too
    for bad, message in ((tmp_path / "none" / "x.gguf", "does not exist"), (gemma_f16_path, "is the input file")):
        assert main(["quantize", str(gemma_f16_path), str(bad), "Q4_K_M", "--dry-run"]) == 1
        assert message in capsys.readouterr().err


_ORACLE_QUANTIZE = r"""
import sys, llama_cpp
src, dst, ftype = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.nthread = 2
for kv in sys.argv[4:]:
    k, v = kv.split("=")
    setattr(p, k, getattr(llama_cpp, "GGML_TYPE_" + v) if k.endswith("_type") else v == "1")
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p))
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["Q3_K_M --output-tensor-type Q4_1", "Q8_0 -> Q4_0 --allow-requantize",
                                  "Q4_K_M -> Q6_K --allow-requantize"])
def test_whole_file_equals_llama_cpp(case, quantized, gemma_f16_path, tmp_path, oracle_python):
    """The whole output file equals llama.cpp's, for a mix with an option and for
    requantization (kernels_cpu.dequant of Q8_0, Q5_0, Q4_K, Q6_K sources, then quantized)."""
    words = case.split()
    if words[1] == "->":
        src, ftype, args, params = quantized(words[0]), words[2], ["--allow-requantize"], ["allow_requantize=1"]
    else:
        src, ftype, args, params = gemma_f16_path, words[0], words[1:], ["output_tensor_type=Q4_1"]
    ours, theirs = tmp_path / "edge.gguf", tmp_path / "llama.gguf"
    assert main(["quantize", str(src), str(ours), ftype, *args]) == 0
    proc = subprocess.run([str(oracle_python), "-c", _ORACLE_QUANTIZE, str(src), str(theirs), ftype, *params],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ours.stat().st_size == theirs.stat().st_size
    assert ours.read_bytes() == theirs.read_bytes()


# -------------------------------------------------------------------- (c) edge runs the output
PPL_MIXES = GOLDEN_MIXES


@pytest.mark.slow
@pytest.mark.parametrize("ftype", PPL_MIXES)
def test_perplexity_within_half_percent(gemma_quant_lab, ftype):
    """quantize.json's ppl_method: n_ctx 256, BOS first, second half of each chunk scored. The
    perplexity is the one the KL-divergence run against the F16 source computes on the same
    tokens (edge.perplexity.chunk_logits; tests/test_kl_divergence.py checks it against plain
    edge.perplexity)."""
    ref = golden("gemma3-270m", "perplexity.json")
    res = gemma_quant_lab.kld(ftype)
    ppl = res.summary()["ppl"][0]
    print(f"{ftype}: ppl {ppl:.4f} (llama.cpp {float(GOLD['quantized'][ftype]['ppl']):.4f})")
    assert res.count == int(ref["n_scored"])
    assert abs(ppl / float(GOLD["quantized"][ftype]["ppl"]) - 1) <= 0.005


# ------------------------------------------------------------------ (d) llama.cpp runs the output
_ORACLE_RUN = r"""
import json, math, sys
import numpy as np
from llama_cpp import Llama
text = open(sys.argv[1], encoding="utf-8").read()
res = {}
for path in sys.argv[2:]:
    llm = Llama(model_path=path, n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    toks = [llm.token_bos()] + llm.tokenize(text.encode(), add_bos=False)[1:256]
    llm.eval(toks)
    logits = np.asarray(llm.scores[128 : len(toks) - 1], dtype=np.float64)     # second half, as perplexity
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    nll = lse - logits[np.arange(len(logits)), toks[129:]]
    llm.reset()
    gen = llm("The capital of France is", max_tokens=8, temperature=0.0)
    res[path] = {"ppl": math.exp(nll.mean()), "text": gen["choices"][0]["text"],
                 "n_tokens": gen["usage"]["completion_tokens"]}
print(json.dumps(res))
"""


@pytest.mark.slow
def test_llama_cpp_loads_and_generates(quantized, gemma_f16_path, oracle_python):
    """llama-cpp-python loads edge's Q4_K_M and Q8_0 files, generates, and scores the perplexity
    text's first chunk within 3% (Q8_0) / 10% (Q4_K_M) of the F16 source (a broken file is far off)."""
    paths = [str(gemma_f16_path), str(quantized("Q8_0")), str(quantized("Q4_K_M"))]
    ref = golden("gemma3-270m", "perplexity.json")
    proc = subprocess.run([str(oracle_python), "-c", _ORACLE_RUN, str(GOLDEN / ref["text_file"]), *paths],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    base = res[paths[0]]["ppl"]
    for path, bound in ((paths[1], 0.03), (paths[2], 0.10)):
        assert res[path]["n_tokens"] == 8 and res[path]["text"].strip(), res[path]
        assert abs(res[path]["ppl"] / base - 1) <= bound, (path, res[path]["ppl"], base)


# -------------------------------------------------------------- (e) atomic output, bad inputs
def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_interrupt_leaves_no_file(tmp_path):
    """KeyboardInterrupt in the middle of the data: no temporary file, the old OUT unchanged."""
    src = _write_gguf(tmp_path / "src.gguf", _tiny_model(np.random.default_rng(1)))
    out = tmp_path / "out.gguf"
    out.write_bytes(b"GGUF an older file")
    calls = []

    def interrupt(done, total, tensor):
        calls.append(tensor.name)
        if len(calls) == 12:
            assert len(_files(tmp_path)) == 3                      # src, out and the temporary file
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_file(src, out, FILE_TYPES["Q4_K_M"], progress=interrupt)
    assert _files(tmp_path) == ["out.gguf", "src.gguf"] and out.read_bytes() == b"GGUF an older file"
    plan = quantize_file(src, out, FILE_TYPES["Q4_K_M"])                 # and then it works
    assert out.stat().st_size == plan.output_size and _files(tmp_path) == ["out.gguf", "src.gguf"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o644)


def test_partial_file_of_a_killed_run_is_removed(tmp_path):
    """A run killed with SIGKILL leaves its temporary file; the next run writing the same OUT
    removes it, but not the file of a run still going (pid 1 here: always alive)."""
    src = _write_gguf(tmp_path / "src.gguf", _tiny_model(np.random.default_rng(1)))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f".out.gguf.pid{dead}.abc123.partial").write_bytes(b"x" * 100)
    (tmp_path / ".out.gguf.pid1.def456.partial").write_bytes(b"y")
    quantize_file(src, tmp_path / "out.gguf", FILE_TYPES["Q8_0"])
    assert _files(tmp_path) == [".out.gguf.pid1.def456.partial", "out.gguf", "src.gguf"]


@pytest.mark.slow
def test_sigint_to_the_command(gemma_f16_path, tmp_path):
    """Ctrl+C (SIGINT) to a running `edge quantize`: exit 130, no temporary file, OUT untouched."""
    out = tmp_path / "out.gguf"
    out.write_bytes(b"GGUF keep me")
    proc = subprocess.Popen([sys.executable, "-m", "edge.cli", "quantize", str(gemma_f16_path), str(out), "Q6_K"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:                # wait for the data to start flowing
        partial = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
        if partial and partial[0].stat().st_size > 20_000_000:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the temporary file never grew")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert _files(tmp_path) == ["out.gguf"] and out.read_bytes() == b"GGUF keep me"


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    src = _write_gguf(tmp_path / "src.gguf", _tiny_model(np.random.default_rng(2)))
    (tmp_path / "notes.txt").write_text("hello")
    os.mkfifo(tmp_path / "fifo")
    out = tmp_path / "out.gguf"
    cases = [
        ([str(tmp_path / "missing.gguf"), str(out), "Q8_0"], f"file not found: {tmp_path / 'missing.gguf'}"),
        ([str(tmp_path / "notes.txt"), str(out), "Q8_0"], "not a GGUF file"),
        ([str(src), str(out), "Q4_K_X"], "unknown quantization type 'Q4_K_X'; choose one of"),
        ([str(src), str(src), "Q8_0"], "is the input file"),
        ([str(src), f"{tmp_path}/./src.gguf", "Q8_0"], "is the input file"),
        ([str(src), str(tmp_path), "Q8_0"], "is a directory"),
        ([str(src), str(tmp_path / "no" / "out.gguf"), "Q8_0"], "does not exist"),
        ([str(src), str(tmp_path / "notes.txt"), "Q8_0"], "notes.txt exists and is not a GGUF file"),
        ([str(src), str(tmp_path / "fifo"), "Q8_0"], "fifo exists and is not a regular file"),
        ([str(src), str(tmp_path / "newdir") + "/", "Q8_0"], "newdir/' is not the path of a file"),
        ([str(src), "", "Q8_0"], "'' is not the path of a file"),
        ([str(src), str(out), "Q8_0", "--token-embedding-type", "Q9_9"], "--token-embedding-type: unknown"),
        ([str(src), str(out), "Q8_0", "--output-tensor-type", "iq2_xxs"], "--output-tensor-type: unknown"),
        ([str(src), str(out), "Q8_0", "-t", "0"], "-t/--threads must be at least 1"),
    ]
    for argv, message in cases:
        assert main(["quantize", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("edge quantize: error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert _files(tmp_path) == ["fifo", "notes.txt", "src.gguf"] and (tmp_path / "notes.txt").read_text() == "hello"


def test_token_embedding_type_that_does_not_fit(tmp_path, capsys):
    """llama.cpp writes half a file and aborts; edge refuses before writing."""
    tensors = _tiny_model(np.random.default_rng(3), **{"token_embd.weight": np.ones((64, 640))})
    src = _write_gguf(tmp_path / "src.gguf", tensors)
    assert main(["quantize", str(src), str(tmp_path / "out.gguf"), "Q4_K_M", "--token-embedding-type", "q6_k"]) == 1
    assert "--token-embedding-type Q6_K: token_embd.weight has rows of 640 values" in capsys.readouterr().err
    assert _files(tmp_path) == ["src.gguf"]


def test_requantize_needs_the_flag(tmp_path, capsys):
    src = _write_gguf(tmp_path / "src.gguf", _tiny_model(np.random.default_rng(4)))
    q8 = tmp_path / "q8.gguf"
    assert main(["quantize", str(src), str(q8), "Q8_0"]) == 0
    capsys.readouterr()
    assert main(["quantize", str(q8), str(tmp_path / "q4.gguf"), "Q4_0"]) == 1
    err = capsys.readouterr().err
    assert "is already quantized (Q8_0)" in err and "--allow-requantize" in err
    assert main(["quantize", str(q8), str(tmp_path / "q4.gguf"), "Q4_0", "--allow-requantize"]) == 0
    out = GGUFFile(tmp_path / "q4.gguf")
    assert out.tensors["blk.0.attn_q.weight"].ggml_type == T.Q4_0 and out.get("general.file_type") == 2


@pytest.mark.parametrize("value, ftype, message", [
    (np.nan, "Q4_K_M", "tensor blk.1.ffn_down.weight holds NaN or Inf \\(row 5\\); cannot convert it to Q6_K"),
    (-np.inf, "F16", "tensor blk.1.ffn_down.weight holds NaN or Inf \\(row 5\\); cannot convert it to F16"),
    (1e6, "F16", "tensor blk.1.ffn_down.weight: row 5 does not fit F16"),
    (1e7, "Q8_0", "tensor blk.1.ffn_down.weight: row 5 does not fit Q8_0"),
    (1e9, "Q4_K_M", "tensor blk.1.ffn_down.weight: row 5 does not fit Q6_K"),
])
def test_non_finite_and_overflow_are_errors(tmp_path, capsys, value, ftype, message):
    """BUGS.md Q1: NaN/Inf in the source, or values whose fp16 scales overflow (llama.cpp's
    ggml_validate_row_data), is an error naming the tensor, and no file is left."""
    bad = np.random.default_rng(5).standard_normal((32, 256)).astype(np.float32)
    bad[5, 100] = value
    src = _write_gguf(tmp_path / "src.gguf", _tiny_model(np.random.default_rng(5), **{"blk.1.ffn_down.weight": bad}))
    with pytest.raises(QuantizeError, match=message):
        quantize_file(src, tmp_path / "out.gguf", FILE_TYPES[ftype])
    assert _files(tmp_path) == ["src.gguf"]


def test_zero_tensor_and_alignment(tmp_path):
    """An all-zero matrix quantizes to zero scales and dequantizes to exact zeros; a source
    with general.alignment 64 gives an output aligned to 32 without that key (llama-quant's 32)."""
    from kernels_cpu.dequant import dequantize

    tensors = _tiny_model(np.random.default_rng(6), **{"blk.0.ffn_up.weight": np.zeros((32, 256))})
    src = _write_gguf(tmp_path / "src.gguf", tensors, alignment=64)
    assert GGUFFile(src).alignment == 64
    quantize_file(src, tmp_path / "out.gguf", FILE_TYPES["Q4_K_M"])
    out = GGUFFile(tmp_path / "out.gguf")
    assert out.alignment == 32 and "general.alignment" not in out.fields
    assert all(t.offset % 32 == 0 for t in out.tensors.values())
    assert out.tensors["blk.0.ffn_up.weight"].ggml_type == T.Q4_K
    assert not dequantize(np.ascontiguousarray(out.tensor_rows("blk.0.ffn_up.weight")), T.Q4_K).any()
    w = dequantize(np.ascontiguousarray(out.tensor_rows("blk.0.attn_q.weight")), T.Q4_K)
    assert np.abs(w - tensors["blk.0.attn_q.weight"]).max() < 0.05 * math.sqrt(2)
    assert [k for k in out.fields][-2:] == ["general.quantization_version", "general.file_type"]


def test_cli_prints_sizes_and_time(tmp_path, capsys):
    src = _write_gguf(tmp_path / "src.gguf", _tiny_model(np.random.default_rng(7)))
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(src), str(out), "q8_0", "-t", "1"]) == 0
    line = capsys.readouterr().out
    src_mib, out_mib = os.path.getsize(src) / 2**20, os.path.getsize(out) / 2**20
    assert line.startswith(f"{src}: {src_mib:.2f} MiB -> {out}: {out_mib:.2f} MiB (Q8_0, "
                           f"{out_mib / src_mib:.1%} of the source) in ")
    assert line.rstrip().endswith(" s")
