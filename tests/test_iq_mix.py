"""llama-quantize's IQ, TQ, MXFP4 and Q2_K_S mixes in edge quantize (quant/mix.py), and whole
IQ4_NL / IQ4_XS files (quant/iq4_quants.py) against llama-quantize's, byte for byte.

(a) The plan (tensor order and types) equals llama-quantize --dry-run's for the 16 ftypes, with
    and without an imatrix, on gemma-3-270m (F16, rows of 640: the IQ4_XS -> IQ4_NL and other
    fallbacks, tied output) and qwen2.5-coder-0.5b (Q8_0 requantized, rows of 896, untied).
(b) A real run refuses, before writing anything, a mix that needs an imatrix it was not given
    (llama.cpp's tensor_requires_imatrix) and a mix that needs types edge cannot write yet;
    --dry-run still prints the plan.
(c) IQ4_NL and IQ4_XS files of a cut-down gemma (2 of its layers, 2048 token rows, block_count 8
    so that the first-eighth rules apply), with and without an imatrix, equal llama-quantize's.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from edge.cli import main
from edge.gguf_file import GGUFFile, format_type_counts, tensor_type_counts
from edge.imatrix import Imatrix, load_imatrix, write_imatrix
from quant.errors import QuantizeError
from quant.mix import (
    FILE_TYPES,
    ModelParams,
    QuantizeOptions,
    check_writable,
    choose_types,
)
from quant.pipeline import _DROPPED_KEYS, _writer_value
from quant.quantize import SUPPORTED_TYPES
from tests.conftest import real_model_path

IQ_MIXES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ1_S", "IQ1_M",
            "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4_MOE", "Q2_K_S")
_ROW = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), size =[^(\n]*(?:\((\S+)\))?")


def _synthetic_imatrix(src: Path, path: Path, seed: int = 3) -> Path:
    """An imatrix file (edge.imatrix.write_imatrix) with lognormal weights for every 2-D weight of ``src``."""
    rng = np.random.default_rng(seed)
    im = Imatrix(chunk_size=512, datasets=["synthetic.txt"])
    for t in GGUFFile(src).tensors.values():
        if len(t.shape) >= 2 and t.name.endswith("weight"):
            im.sums[t.name] = rng.lognormal(0.0, 1.5, t.shape[0]).astype(np.float32) * 512
            im.counts[t.name] = 512
    write_imatrix(path, im)
    return path


def _llama_quantize(tools: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LD_LIBRARY_PATH": str(tools)}
    return subprocess.run([str(tools / "llama-quantize"), *args], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


# ----------------------------------------------------------------------------- (a) the plans
@pytest.mark.slow
def test_iq_mixes_equal_llama_quantize_dry_run(gemma_f16_path, llama_cpp_tools, tmp_path):
    sources = {"gemma": Path(gemma_f16_path), "qwen05": real_model_path("qwen2.5-coder-0.5b")}
    n_cases = 0
    for label, src in sources.items():
        gf = GGUFFile(src)
        tensors, model = [(t.name, t.shape, t.ggml_type) for t in gf.tensors.values()], ModelParams.from_gguf(gf)
        imatrix = _synthetic_imatrix(src, tmp_path / f"{label}.imatrix.gguf")
        for ftype in IQ_MIXES:
            for with_imatrix in (False, True):
                extra = ["--imatrix", str(imatrix)] if with_imatrix else []
                proc = _llama_quantize(llama_cpp_tools, "--dry-run", "--allow-requantize", *extra, str(src), ftype)
                assert proc.returncode == 0, proc.stderr[-2000:]
                want = [(m[1], (m[3] or m[2]).upper()) for m in _ROW.finditer(proc.stdout + proc.stderr)]
                options = QuantizeOptions(allow_requantize=True, has_imatrix=with_imatrix)
                got = [(c.name, c.new_type.name) for c in choose_types(tensors, FILE_TYPES[ftype], options, model)]
                assert len(want) == len(gf.tensors) and got == want, (label, ftype, with_imatrix)
                n_cases += 1
    assert n_cases == 64


# --------------------------------------------------------------------------- (b) the refusals
def test_refusals_before_writing(gemma_f16_path, tmp_path, capsys):
    out = tmp_path / "never.gguf"
    imatrix = _synthetic_imatrix(Path(gemma_f16_path), tmp_path / "syn.imatrix.gguf")
    assert main(["quantize", str(gemma_f16_path), str(out), "IQ2_M"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "IQ2_M requires an importance matrix (--imatrix)" in err
    assert "Traceback" not in err and not out.exists()
    assert main(["quantize", str(gemma_f16_path), str(out), "IQ2_M", "--imatrix", str(imatrix)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the IQ2_M mix needs GGML types IQ2_S, IQ3_S, which edge cannot write yet" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["syn.imatrix.gguf"]
    assert main(["quantize", str(gemma_f16_path), str(out), "IQ2_M", "--dry-run"]) == 0
    captured = capsys.readouterr()
    plan = captured.out.splitlines()
    assert len(plan) == 237 and any("F16 -> IQ2_S" in line for line in plan) and not out.exists()
    # and says, in one line on stderr, that the real run would stop
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith("note: the real run would stop before writing: IQ2_M requires "
                                                   "an importance matrix (--imatrix): tensor blk.")
    # the per-type refusals of the planned mixes, without running the CLI
    gf = GGUFFile(gemma_f16_path)
    tensors, model = [(t.name, t.shape, t.ggml_type) for t in gf.tensors.values()], ModelParams.from_gguf(gf)
    names = load_imatrix(imatrix).weights

    def refusal(ftype: str, with_imatrix: bool) -> str:
        plan = choose_types(tensors, FILE_TYPES[ftype], QuantizeOptions(has_imatrix=with_imatrix), model)
        try:
            check_writable(plan, FILE_TYPES[ftype], names if with_imatrix else None, SUPPORTED_TYPES)
        except QuantizeError as e:
            return str(e)
        return ""

    for ftype in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K_S"):
        assert "requires an importance matrix" in refusal(ftype, False), ftype
    assert refusal("Q2_K_S", True) == "" and refusal("IQ4_XS", False) == "" and refusal("IQ4_NL", True) == ""
    assert "needs GGML type IQ3_S, which edge cannot write yet" in refusal("IQ3_XS", False)  # its IQ3_XXS: rows of 640
    assert "TQ1_0, which" in refusal("TQ1_0", False) and "MXFP4" not in refusal("MXFP4_MOE", False)  # no experts
    no_entry = {n: w for n, w in names.items() if n != "blk.3.ffn_down.weight"}
    plan = choose_types(tensors, FILE_TYPES["IQ2_XS"], QuantizeOptions(has_imatrix=True), model)
    with pytest.raises(QuantizeError, match="the imatrix has no entry for tensor blk.3.ffn_down.weight"):
        check_writable(plan, FILE_TYPES["IQ2_XS"], no_entry, SUPPORTED_TYPES)


# ------------------------------------------------------------------------------- (c) the files
@pytest.fixture(scope="module")
def small_gemma(gemma_f16_path, tmp_path_factory) -> Path:
    """gemma-3-270m F16 cut to blk.0 and blk.1 (block_count 8) and the first 2048 token rows."""
    src = GGUFFile(gemma_f16_path)
    path = tmp_path_factory.mktemp("iq4_files") / "gemma-small-f16.gguf"
    w = GGUFWriter(path, src.architecture)
    w.kv_data[0].clear()
    for key, field in src.fields.items():
        if key in _DROPPED_KEYS:
            continue
        value = 8 if key == f"{src.architecture}.block_count" else _writer_value(key, field)[0]
        w.add_key_value(key, value, field.value_type, sub_type=field.array_type)
    for t in src.tensors.values():
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) > 1:
            continue
        rows = src.tensor_rows(t.name)
        if t.name == "token_embd.weight":
            rows = rows[:2048]
        data = np.ascontiguousarray(rows).view(np.float16 if t.ggml_type.name == "F16" else np.float32)
        w.add_tensor(t.name, data if len(t.shape) > 1 else data.reshape(-1), raw_dtype=t.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
def test_whole_file_equals_llama_quantize(small_gemma, ftype, with_imatrix, llama_cpp_tools, tmp_path, capsys):
    extra = ["--imatrix", str(_synthetic_imatrix(small_gemma, tmp_path / "syn.imatrix.gguf"))] if with_imatrix else []
    ours, theirs = tmp_path / "edge.gguf", tmp_path / "llama.gguf"
    assert main(["quantize", str(small_gemma), str(ours), ftype, *extra]) == 0
    proc = _llama_quantize(llama_cpp_tools, *extra, str(small_gemma), str(theirs), ftype, "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = GGUFFile(ours)
    types = {t.name: t.ggml_type.name for t in out.tensors.values()}
    counts = tensor_type_counts(out)        # what edge list and edge bench print
    assert sum(counts.values()) == len(types) and counts[ftype] == sum(v == ftype for v in types.values())
    assert format_type_counts(counts).startswith(f"{next(iter(counts))}×{max(counts.values())}, ")
    assert types["blk.0.ffn_down.weight"] == (ftype if with_imatrix else "Q5_K")      # the first eighth, no imatrix
    assert types["blk.1.ffn_down.weight"] == ftype and types["blk.1.ffn_gate.weight"] == "IQ4_NL"  # rows of 640
    assert types["token_embd.weight"] == "Q8_0"     # IQ4_NL: Q6_K, which falls back to Q8_0 on rows of 640
    a, b = ours.read_bytes(), theirs.read_bytes()
    assert len(a) == len(b)
    assert a == b, f"first difference at byte {next(i for i in range(len(a)) if a[i] != b[i])}"
