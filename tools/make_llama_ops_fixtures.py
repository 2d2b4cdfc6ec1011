"""Regenerate tests/data/llama_ops_<model>.npz: llama.cpp's own inputs and outputs of the
attention and element-wise ops, for tests/test_llama_ops.py to hold edge's kernels to them
bit for bit.

Needs llama-cpp-python built from source on an AVX-512 x86 machine (the build that made the
goldens) and the real model files; run it with that interpreter from the repository root:

    /path/to/llama-venv/bin/python tools/make_llama_ops_fixtures.py [--models-dir DIR]

Per model it evaluates a prompt of N tokens in one batch (prefill, T = N >= 2: tinyBLAS
kernels) and then one more token (decode, T = 1: ggml_vec_dot_f16), dumping layer 0 (and for
Gemma also global layer 5, whose RoPE base differs). Stored, for a few query rows (the ops work
row by row, so a subset of rows keeps the arithmetic; the KV cells are complete):

  {path}_rope_q_in/out   f32[R, H, hd]  RoPE input/output (NEOX), positions {path}_pos
  {path}_rope_k_in/out   f32[R, H_kv, hd]
  {path}_q               f32[R, H, hd]  the query as it enters kq (after Gemma's q scale)
  {path}_k_cache, _v_cache  f16[n, H_kv, hd]  the cells the rows can see (V un-transposed)
  {path}_kq, _probs      f32[R, H, n]   kq-L and kq_soft_max-L, visible cells only
  {path}_kqv             f32[R, H, hd_v]
  {path}_k_new, _v_new   f32[R, H_kv*hd]  the rows' K (after RoPE) and V, and the cache
  {path}_k_stored, ...   f16[R, H_kv*hd]  cells they were stored to
  {path}_gate/_up/_act   f32[R, 512]    ffn_gate, ffn_up and the SwiGLU/GeGLU output
for path in prefill, decode (and global_ for Gemma's layer 5 RoPE), plus the ops' parameters
(rope_base, global_rope_base, kq_scale: llama.cpp's values for these models) and
gelu_table_sha256 (of ggml_table_gelu_f16 as ggml_cpu_init builds it).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_dump import dump  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# name, file, prompt token ids (any ids; these are golden prompts' ids), decode token, rows kept
MODELS = {
    "gemma-3-270m": dict(
        prompt=[2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140, 12234, 13293, 506, 538,
                236772, 594, 123466, 1548, 29738, 107],
        decode=818, rows=[0, 1, 16, 18], layers=(0, 5), act="ffn_geglu",
        # local layers: RoPE base 10000; global: rope.freq_base; q pre-scaled, softmax scale 1
        params=dict(rope_base=10000.0, global_rope_base=1e6, kq_scale=1.0)),
    "qwen2.5-coder-0.5b-instruct": dict(
        prompt=[750, 75698, 1445, 982, 262, 4210, 5598, 279, 308, 7563, 79683, 1372, 14442,
                785, 6722, 315, 9625, 374, 750, 75698],
        decode=1445, rows=[0, 1, 16, 19], layers=(0,), act="ffn_swiglu",
        params=dict(rope_base=1e6, kq_scale=1.0 / 8.0)),  # 1.0f/sqrtf(64)
}
N_COLS = 512  # columns of the FFN activation kept (a multiple of 16: same SIMD blocks)


def gelu_table_sha256() -> str:
    """sha256 of ggml_table_gelu_f16 (uint16[65536]) as the CPU backend initializes it."""
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    table = np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(cpu, "ggml_table_gelu_f16"))
    return hashlib.sha256(table.astype("<u2").tobytes()).hexdigest()


def _query_name(order: list[str], layer: int) -> str:
    """The query tensor kq-L multiplies: the last permuted non-cache view computed before it."""
    before = order[: order.index(f"kq-{layer}")]
    return [n for n in before if n.endswith("(view) (permuted)") and not n.startswith("cache")][-1]


def _layer_names(order: list[str], layer: int, act: str) -> list[str]:
    sfx = f"-{layer}"
    names = [n for n in order if n.endswith(sfx) and n.split("-")[0] in
             ("Qcur", "Kcur", "Vcur", "Qcur_normed", "Kcur_normed", "kq", "kq_soft_max", "kqv",
              "ffn_gate", "ffn_up", act)]
    return names + [_query_name(order, layer), f"cache_k_l{layer} (view)", f"cache_v_l{layer} (view)"]


def _rope_pair(step: dict, which: str, layer: int):
    """(input, output) of the RoPE of Q or K: the output is the last ``Qcur-L`` tensor; the
    input is ``Qcur_normed-L`` (Gemma) or the ``Qcur-L`` before it (reshaped, after the bias)."""
    cur = step[f"{which}cur-{layer}"]
    normed = step.get(f"{which}cur_normed-{layer}")
    return (normed[-1] if normed else cur[-2]), cur[-1]


def _heads(x: np.ndarray, T: int, hd: int) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(T, -1, hd), dtype=np.float32)


def extract(step: dict, order: list[str], layer: int, n_past: int, T: int, rows, act: str, prefix: str) -> dict:
    out = {}
    kq = step[f"kq-{layer}"][0].reshape(-1, T, step[f"kq-{layer}"][0].shape[-1])  # [H, T, n_kv]
    H = kq.shape[0]
    q_in, q_out = _rope_pair(step, "Q", layer)
    hd = q_out.shape[-1]
    k_in, k_out = _rope_pair(step, "K", layer)
    r = np.asarray(rows)
    n = n_past + int(r.max()) + 1  # cells the kept rows see
    out[prefix + "pos"] = (n_past + r).astype(np.int32)
    out[prefix + "rope_q_in"] = _heads(q_in, T, hd)[r]
    out[prefix + "rope_q_out"] = _heads(q_out, T, hd)[r]
    out[prefix + "rope_k_in"] = _heads(k_in, T, hd)[r]
    out[prefix + "rope_k_out"] = _heads(k_out, T, hd)[r]
    out[prefix + "q"] = _heads(step[_query_name(order, layer)][0].reshape(H, T, hd).swapaxes(0, 1), T, hd)[r]
    k_cache = step[f"cache_k_l{layer} (view)"][-1]            # [n_kv, H_kv, hd] f16
    k_cache = k_cache.reshape(k_cache.shape[0], -1, hd)
    v_t = step[f"cache_v_l{layer} (view)"][-1]                # [hd_v, H_kv, n_kv] f16 (transposed)
    v_cache = np.transpose(v_t.reshape(v_t.shape[0], -1, v_t.shape[-1]), (2, 1, 0))
    out[prefix + "k_cache"] = np.ascontiguousarray(k_cache[:n])
    out[prefix + "v_cache"] = np.ascontiguousarray(v_cache[:n])
    out[prefix + "kq"] = np.ascontiguousarray(kq[:, r, :n].swapaxes(0, 1))
    sm = step[f"kq_soft_max-{layer}"][0].reshape(H, T, -1)
    out[prefix + "probs"] = np.ascontiguousarray(sm[:, r, :n].swapaxes(0, 1))
    assert not sm[:, r, n:].any(), "probability mass beyond the stored cells"
    kqv = step[f"kqv-{layer}"][0].reshape(H, T, -1)
    out[prefix + "kqv"] = np.ascontiguousarray(kqv[:, r].swapaxes(0, 1))
    v_new = step[f"Vcur-{layer}"][-1].reshape(T, -1)
    out[prefix + "k_new"] = np.ascontiguousarray(k_out.reshape(T, -1)[r], dtype=np.float32)
    out[prefix + "v_new"] = np.ascontiguousarray(v_new[r], dtype=np.float32)
    out[prefix + "k_stored"] = np.ascontiguousarray(k_cache[n_past + r].reshape(len(r), -1))
    out[prefix + "v_stored"] = np.ascontiguousarray(v_cache[n_past + r].reshape(len(r), -1))
    for name, key in (("ffn_gate", "gate"), ("ffn_up", "up"), (act, "act")):
        out[prefix + key] = np.ascontiguousarray(step[f"{name}-{layer}"][0].reshape(T, -1)[r, :N_COLS])
    return out


def make(model: str, path: Path, spec: dict) -> dict:
    seen: dict = {}
    dump(path, spec["prompt"], names=None, seen=seen)
    order = list(seen)
    names = [n for layer in spec["layers"] for n in _layer_names(order, layer, spec["act"])]
    steps, _ = dump(path, spec["prompt"], [spec["decode"]], names=names)
    T = len(spec["prompt"])
    out = {}
    for i, layer in enumerate(spec["layers"]):
        pre = "" if i == 0 else "global_"
        p = extract(steps[0], order, layer, 0, T, spec["rows"], spec["act"], pre + "prefill_")
        d = extract(steps[1], order, layer, T, 1, [0], spec["act"], pre + "decode_")
        if i == 0:
            out.update(p)
            out.update(d)
        else:  # only RoPE differs on the global layer
            out.update({k: v for k, v in {**p, **d}.items() if "rope" in k or k.endswith("pos")})
    out["model"] = np.array(model)
    out.update({k: np.float32(v) for k, v in spec["params"].items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-dir", default=os.path.expanduser("~/.cache/edge/models"))
    ap.add_argument("--out-dir", default=str(ROOT / "tests" / "data"))
    args = ap.parse_args()
    sha = gelu_table_sha256()
    for model, spec in MODELS.items():
        arrays = make(model, Path(args.models_dir) / f"{model}.gguf", spec)
        arrays["gelu_table_sha256"] = np.array(sha)
        dest = Path(args.out_dir) / f"llama_ops_{model}.npz"
        dest.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(dest, **arrays)
        print(f"{dest}: {len(arrays)} arrays, {dest.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
