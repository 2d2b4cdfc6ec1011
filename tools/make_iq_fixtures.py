"""Regenerate the I-quant / ternary / MXFP4 tiny models and llama.cpp's logits on them
(tests/iq_cases.py, held to by tests/test_iq_models.py).

    /work/main/.venv/bin/python tools/make_iq_fixtures.py [--check] [CASE ...]   (default: every case)

Run from the repository root with edge's interpreter; llama.cpp's tools run from the oracle's bin
folder (tools/build_oracle.sh; EDGE_ORACLE_PYTHON names another). Steps, in a temporary folder
with relative file names (llama.cpp writes the names into the files' metadata):
1. f16.gguf = tests.tiny_models.write_tiny_model(**iq_cases.BASE) (seeded, the same bytes each time);
2. imatrix.gguf = llama-imatrix -m f16.gguf -f imatrix.txt -c 64 --process-output --no-ppl -t 2
   over iq_cases.imatrix_text() (kept as tests/data/arch/iq/imatrix.gguf);
3. per case, llama-quantize as tests/iq_cases.py's docstring says, kept as
   tests/data/arch/iq/<case>.gguf;
4. llama.cpp's logits and greedy tokens on it, recorded as tools/make_arch_fixtures.py records
   them (same prompts, N_GREEDY, N_CTX and oracle script), into tests/data/arch/<case>.npz.
With --check nothing is written: every step is redone and compared with the committed files
(the imatrix, each GGUF's bytes and llama.cpp's logits), which shows the fixtures reproduce.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.conftest import ORACLE_PYTHON as ORACLE
from tests.iq_cases import BASE, IQ_CASES, QUANT_ROLES, imatrix_text
from tests.tiny_models import write_tiny_model
from tools.make_arch_fixtures import OUT_DIR, checked_cases, run_oracle

IQ_DIR = OUT_DIR / "iq"
BIN = ORACLE.parent


def _run(args: list[str], cwd: Path) -> None:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")


def make_imatrix(tmp: Path) -> Path:
    """Steps 1-2: f16.gguf and imatrix.gguf in tmp; returns the imatrix's path."""
    write_tiny_model(tmp / "f16.gguf", **BASE)
    (tmp / "imatrix.txt").write_text(imatrix_text())
    _run([str(BIN / "llama-imatrix"), "-m", "f16.gguf", "-f", "imatrix.txt", "-c", "64", "--process-output",
          "--no-ppl", "-t", "2", "-o", "imatrix.gguf"], tmp)
    return tmp / "imatrix.gguf"


def quantize(case: str, tmp: Path) -> Path:
    """Step 3: llama-quantize f16.gguf (with imatrix.gguf) into tmp/<case>.gguf."""
    t = IQ_CASES[case].lower()
    args = [str(BIN / "llama-quantize"), "--imatrix", "imatrix.gguf", "--token-embedding-type", "q8_0",
            "--output-tensor-type", t]
    for role in QUANT_ROLES:
        args += ["--tensor-type", f"{role}={t}"]
    # the file type in the header: llama-quantize has no plain MXFP4 ftype, MXFP4_MOE is its name
    ftype = "MXFP4_MOE" if t == "mxfp4" else t.upper()
    _run([*args, "f16.gguf", f"{case}.gguf", ftype, "2"], tmp)
    return tmp / f"{case}.gguf"


def main(argv: list[str]) -> None:
    check = "--check" in argv
    cases = checked_cases([a for a in argv if a != "--check"], list(IQ_CASES))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        imat = make_imatrix(tmp)
        if check:
            same = imat.read_bytes() == (IQ_DIR / "imatrix.gguf").read_bytes()
            print(f"imatrix.gguf: {'same bytes' if same else 'DIFFERS'}")
        else:
            IQ_DIR.mkdir(parents=True, exist_ok=True)
            (IQ_DIR / "imatrix.gguf").write_bytes(imat.read_bytes())
        for case in cases:
            model = quantize(case, tmp)
            got = run_oracle(case, model, tmp, len(BASE["tokens"]))   # step 4
            if check:
                z = np.load(OUT_DIR / f"{case}.npz")
                same_file = model.read_bytes() == (IQ_DIR / f"{case}.gguf").read_bytes()
                same = all(np.array_equal(got[k], z[k]) for k in got if k != "system_info")
                print(f"{case}: gguf {'same bytes' if same_file else 'DIFFERS'}, llama.cpp's logits and greedy "
                      f"{'reproduced' if same else 'DIFFER'}")
                continue
            (IQ_DIR / f"{case}.gguf").write_bytes(model.read_bytes())
            out = OUT_DIR / f"{case}.npz"
            np.savez_compressed(out, **got)
            gaps = [np.sort(got[f"p{k}_greedy_logits"], axis=1)[:, -2:] for k in range(3)]
            min_gap = min(float((g[:, 1] - g[:, 0]).min()) for g in gaps)
            print(f"{case}: {model.stat().st_size} byte GGUF, {out.relative_to(ROOT)} ({out.stat().st_size} bytes), "
                  f"smallest greedy top-2 gap {min_gap:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
