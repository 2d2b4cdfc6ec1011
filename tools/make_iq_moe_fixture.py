"""Make the tiny MoE I-quant case qwen3moe-iq4_xs: tests/data/arch/iq/qwen3moe-iq4_xs.gguf and
llama.cpp 0.3.36's logits and greedy tokens on it, tests/data/arch/qwen3moe-iq4_xs.npz.

The F16 model is tests/arch_cases.py's qwen3moe with one layer and 4 experts of 256 (2 used;
n_embd 256), seed 5 (its greedy runs have a near-tie, top-2 gap < 0.05, in one prompt only),
written by tests.tiny_models.write_tiny_model in F16; llama-quantize turns it into IQ4_XS:

    llama-quantize --pure --token-embedding-type q8_0 f16.gguf qwen3moe-iq4_xs.gguf IQ4_XS 1

so every attention, expert (ffn_{gate,up,down}_exps) and output matrix is IQ4_XS (IQ4_XS needs no
importance matrix); the router ffn_gate_inp stays F32. The quantized file is committed (rebuilding
it needs llama-quantize); the fixture records its sha256. Run with any interpreter that has gguf
(the oracle's is found as in tools/make_arch_fixtures.py):

    python tools/make_iq_moe_fixture.py            # writes both files, prints sizes
    python tools/make_iq_moe_fixture.py --check    # reruns llama-quantize and llama.cpp in a
                                                   # temporary folder: same bytes, same logits
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.arch_cases import ARCHS
from tests.conftest import ORACLE_PYTHON as ORACLE
from tests.tiny_models import write_tiny_model
from tools.make_arch_fixtures import run_oracle, sha256

CASE = "qwen3moe-iq4_xs"
ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
         "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
F16_ARGS = dict(ARCHS["qwen3moe"], n_layer=1, n_expert=4, seed=5, types={r: Q.F16 for r in ROLES})
QUANTIZE_ARGS = ["--pure", "--token-embedding-type", "q8_0"]
GGUF_OUT = ROOT / "tests" / "data" / "arch" / "iq" / f"{CASE}.gguf"
NPZ_OUT = ROOT / "tests" / "data" / "arch" / f"{CASE}.npz"


def quantize(folder: Path) -> Path:
    """llama-quantize's IQ4_XS of the F16 tiny model, written into folder; returns its path."""
    f16 = write_tiny_model(folder / "f16.gguf", **F16_ARGS)
    out = folder / f"{CASE}.gguf"
    cmd = [str(ORACLE.parent / "llama-quantize"), *QUANTIZE_ARGS, str(f16), str(out), "IQ4_XS", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"llama-quantize failed:\n{proc.stderr[-3000:]}")
    return out


def main(argv: list[str]) -> None:
    if not ORACLE.is_file():
        raise SystemExit(f"no oracle interpreter at {ORACLE}: build it with tools/build_oracle.sh")
    with tempfile.TemporaryDirectory() as tmp:
        model = quantize(Path(tmp))
        got = run_oracle(CASE, model, Path(tmp), 96)
        if argv == ["--check"]:
            ref = dict(np.load(NPZ_OUT))
            assert sha256(model) == str(ref["gguf_sha256"]) == sha256(GGUF_OUT), "llama-quantize gave other bytes"
            for k, v in ref.items():
                assert np.array_equal(v, got[k]), f"{k}: llama.cpp's rerun differs"
            print(f"{CASE}: same GGUF bytes, llama.cpp's logits and greedy tokens reproduced")
            return
        GGUF_OUT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model, GGUF_OUT)
        np.savez_compressed(NPZ_OUT, **got)
    for p in (GGUF_OUT, NPZ_OUT):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
