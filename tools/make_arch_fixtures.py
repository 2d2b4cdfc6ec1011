"""Regenerate tests/data/arch/<case>.npz: llama.cpp's logits and greedy tokens on the tiny
random-weight models of tests/arch_cases.py, for tests/test_arch_llama_cpp.py to hold edge to.

    /work/main/.venv/bin/python tools/make_arch_fixtures.py [CASE ...]     (default: every case)

Run from the repository root with edge's interpreter; llama.cpp runs in the oracle interpreter
(llama-cpp-python 0.3.36 built from source, tools/build_oracle.sh; EDGE_ORACLE_PYTHON names
another). Per case it writes the GGUF with tests.tiny_models.write_tiny_model (seeded: the same
bytes every time), has llama.cpp evaluate each prompt of PROMPT_LENGTHS in one batch (the
logits of every position) and then decode N_GREEDY greedy tokens one at a time, and stores:

  p{k}_ids            int32[n]           the prompt (token ids drawn with a fixed seed)
  p{k}_logits         f32[n, n_vocab]    llama.cpp's logits of every prompt position
  p{k}_greedy         int32[N_GREEDY]    greedy tokens (first argmax of llama.cpp's logits)
  p{k}_greedy_logits  f32[N_GREEDY, n_vocab]  the logits each greedy token was chosen from
                                         (row 0: the prompt's last; row i: the decode step of
                                         greedy token i - 1)
  gguf_sha256, case, system_info         the model file the fixture was made from, the case,
                                         llama.cpp's llama_print_system_info() (its CPU build)

The GGUFs (megabytes) are not committed: the test rebuilds each with the same function and
checks its sha256 against gguf_sha256.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.arch_cases import ARCH_CASES
from tests.conftest import (
    ORACLE_PYTHON as ORACLE,  # EDGE_ORACLE_PYTHON, else tools/build_oracle.sh's place
)
from tests.tiny_models import write_tiny_model

OUT_DIR = ROOT / "tests" / "data" / "arch"
PROMPT_LENGTHS = (5, 11, 17)   # below and above 8 rows: llama.cpp's K-quant kernels switch at 8
N_GREEDY = 32
N_CTX = 64
PROMPT_SEED = 1234

# runs in the oracle interpreter: argv = model, request.json, out.npz
_ORACLE_SCRIPT = r"""
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, req, out = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
llm = Llama(model_path=path, n_ctx=req["n_ctx"], n_batch=req["n_ctx"], n_ubatch=req["n_ctx"], logits_all=True,
            verbose=False, n_threads=2, flash_attn=False)
res = {"system_info": np.array(llama_cpp.llama_print_system_info().decode())}
for k, ids in enumerate(req["prompts"]):
    llm.reset()
    llm.eval(ids)
    res[f"p{k}_logits"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
    rows, toks = [res[f"p{k}_logits"][-1]], []
    for i in range(req["n_greedy"]):
        toks.append(int(np.argmax(rows[-1])))
        if i + 1 < req["n_greedy"]:
            llm.eval([toks[-1]])
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    res[f"p{k}_greedy"] = np.array(toks, np.int32)
    res[f"p{k}_greedy_logits"] = np.stack(rows)
np.savez(out, **res)
"""


def prompts(n_vocab: int) -> list[list[int]]:
    """The prompts of every case: PROMPT_LENGTHS token ids drawn with PROMPT_SEED."""
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(0, n_vocab, n).tolist() for n in PROMPT_LENGTHS]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build(case: str, folder: Path) -> Path:
    """The case's GGUF file, written into folder. Raises KeyError for an unknown case."""
    return write_tiny_model(Path(folder) / f"{case}.gguf", **ARCH_CASES[case])


def run_oracle(case: str, model: Path, folder: Path, n_vocab: int) -> dict:
    """llama.cpp's arrays of a fixture for the GGUF model (prompts(n_vocab): p<k>_ids, p<k>_logits
    f32[n, n_vocab], p<k>_greedy i32[N_GREEDY], p<k>_greedy_logits; gguf_sha256, case,
    system_info). Scratch files go to folder; raises SystemExit if llama.cpp fails."""
    req = folder / f"{case}.json"
    ids = prompts(n_vocab)
    req.write_text(json.dumps({"prompts": ids, "n_greedy": N_GREEDY, "n_ctx": N_CTX}))
    raw = folder / f"{case}.raw.npz"
    proc = subprocess.run([str(ORACLE), "-c", _ORACLE_SCRIPT, str(model), str(req), str(raw)],
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{case}: llama.cpp failed:\n{proc.stderr[-3000:]}")
    got = dict(np.load(raw))
    for k, p in enumerate(ids):
        got[f"p{k}_ids"] = np.array(p, np.int32)
    got.update(gguf_sha256=np.array(sha256(model)), case=np.array(case))
    return got


def make(case: str, folder: Path) -> Path:
    """Run llama.cpp on one case and write its fixture; returns the fixture's path."""
    model = build(case, folder)
    got = run_oracle(case, model, folder, ARCH_CASES[case].get("n_vocab", 96))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"{case}.npz"
    np.savez_compressed(out, **got)
    return out


def main(argv: list[str]) -> None:
    cases = argv or sorted(ARCH_CASES)
    unknown = [c for c in cases if c not in ARCH_CASES]
    if unknown:
        raise SystemExit(f"unknown case {', '.join(unknown)} (known: {', '.join(sorted(ARCH_CASES))})")
    if not ORACLE.is_file():
        raise SystemExit(f"no oracle interpreter at {ORACLE}: build it with tools/build_oracle.sh")
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            out = make(case, Path(tmp))
            z = np.load(out)
            gaps = [np.sort(z[f"p{k}_greedy_logits"], axis=1)[:, -2:] for k in range(len(PROMPT_LENGTHS))]
            min_gap = min(float((g[:, 1] - g[:, 0]).min()) for g in gaps)
            print(f"{case}: {out.relative_to(ROOT)} ({out.stat().st_size} bytes), smallest greedy top-2 gap "
                  f"{min_gap:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
