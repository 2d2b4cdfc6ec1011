"""Regenerate tests/data/llama_matmul.npz: llama.cpp's own quantized matmul results, for
tests/test_matmul.py to hold edge's kernels (and tests/matmul_reference.py) to them bit for bit.

Two sources, both from the libraries of a llama-cpp-python built from source on an AVX-512
VNNI x86 machine (the build that made the goldens); run with that interpreter from the
repository root:

    /path/to/llama-venv/bin/python tools/make_matmul_fixtures.py [--models-dir DIR]

* synthetic: every quantized type edge supports, random weights with realistic f16 scales,
  R = 6 rows (plain CPU buffer) and, for the types llama.cpp repacks on x86 (Q4_0, Q4_K,
  Q2_K), R = 8 rows in the CPU_REPACK buffer; activations x float32[T, K] for T in
  SYNTH_T (decode, tinyBLAS / vec_dot, repacked gemm + gemv, tiled), all T sharing the rows of
  one x (with +max/-max ties in 256-value blocks, where the repacked gemm's quantize_mat_q8_K
  and quantize_row_q8_K pick opposite signs, and an all-zero block). Computed
  with ggml_mul_mat through ggml_graph_compute_with_ctx (2 threads), the weights in the buffer
  type the model loader would pick.
* real: the MUL_MAT ops of layer 0 of gemma-3-270m over a 9-token prompt and one decode step
  (Q5_0 attn_q, Q8_0 attn_v, Q4_K attn_output, Q6_K ffn_down: tinyBLAS / vec_dot, repacked
  gemm + gemv, tiled / vec_dot), captured with llama.cpp's eval callback; the first REAL_ROWS
  weight rows and their outputs are kept.

Stored (see Fixtures): weights "w/ID" uint8[R, row_bytes] and activations "x/ID" float32[n, K]
shared by content; per case NAME (listed in ``cases``): NAME_w, NAME_x (IDs), NAME_T (the case
uses the first T rows of x), NAME_type (GGML type id), NAME_out float32[T, R].
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_dump import _read, _Tensor  # noqa: E402
from make_ggml_op_fixtures import Ggml, _InitParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# name -> (ggml type id, values per block, bytes per block, byte offsets of f16 fields)
TYPES = {"Q4_0": (2, 32, 18, (0,)), "Q4_1": (3, 32, 20, (0, 2)), "Q5_0": (6, 32, 22, (0,)),
         "Q5_1": (7, 32, 24, (0, 2)), "Q8_0": (8, 32, 34, (0,)), "Q2_K": (10, 256, 84, (80, 82)),
         "Q3_K": (11, 256, 110, (108,)), "Q4_K": (12, 256, 144, (0, 2)), "Q5_K": (13, 256, 176, (0, 2)),
         "Q6_K": (14, 256, 210, (208,))}
REPACKED = ("Q4_0", "Q4_K", "Q2_K")  # x86 AVX2/AVX-512: ggml_repack_get_optimal_repack_type
SYNTH_K = 512
SYNTH_T = (1, 2, 5, 8, 11)
REAL_MODEL = "gemma-3-270m"
REAL_PROMPT = [2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140]
REAL_DECODE = 12234
REAL_WEIGHTS = ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight")
REAL_ROWS = 16


class GgmlMatmul(Ggml):
    """ggml_mul_mat on weights in the plain CPU buffer or the CPU_REPACK buffer."""

    def __init__(self):
        super().__init__(mem_mb=64)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.cpu.ggml_cpu_init()
        for name, res, args in (("ggml_mul_mat", vp, [vp, vp, vp]),
                                ("ggml_backend_alloc_ctx_tensors_from_buft", vp, [vp, vp])):
            fn = getattr(self.base, name)
            fn.restype, fn.argtypes = res, args
        self.base.ggml_backend_tensor_set.argtypes = [vp, vp, sz, sz]
        self.base.ggml_backend_buffer_free.argtypes = [vp]
        self.base.ggml_free.argtypes = [vp]
        self.repack_buft = self.cpu._Z35ggml_backend_cpu_repack_buffer_typev
        self.repack_buft.restype = vp

    def matmul(self, w: np.ndarray, type_id: int, k: int, x: np.ndarray, repack: bool) -> np.ndarray:
        """x float32[T, K] times weight rows w uint8[R, row_bytes] -> float32[T, R], as ggml computes it."""
        self.base.ggml_free(self.ctx)
        self.ctx = self.base.ggml_init(_InitParams(64 << 20, None, False))
        buf, wctx = None, None
        if repack:
            wctx = self.base.ggml_init(_InitParams(1 << 20, None, True))
            tw = self.base.ggml_new_tensor_2d(wctx, type_id, k, w.shape[0])
            buf = self.base.ggml_backend_alloc_ctx_tensors_from_buft(wctx, self.repack_buft())
            self.base.ggml_backend_tensor_set(tw, w.ctypes.data, 0, w.nbytes)
        else:
            tw = self.base.ggml_new_tensor_2d(self.ctx, type_id, k, w.shape[0])
            ctypes.memmove(_Tensor.from_address(tw).data, w.ctypes.data, w.nbytes)
        out = self.compute(self.base.ggml_mul_mat(self.ctx, tw, self.tensor(x)), (x.shape[0], w.shape[0]))
        if buf:
            self.base.ggml_backend_buffer_free(buf)
            self.base.ggml_free(wctx)
        return out


def random_rows(name: str, R: int, K: int, rng) -> np.ndarray:
    """uint8[R, row_bytes]: random quants, f16 scales ~ N(0, 0.02) (finite, realistic)."""
    _, block, size, f16 = TYPES[name]
    raw = rng.integers(0, 256, (R, K // block, size), dtype=np.uint8)
    for off in f16:
        scale = rng.normal(0, 0.02, raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(R, -1)


def synthetic_x(rng) -> np.ndarray:
    x = rng.normal(0, 1, (max(SYNTH_T), SYNTH_K)).astype(np.float32)
    x[:, ::61] *= 30  # outliers: block scales differ
    x[1, 256:288] = 0  # an all-zero 32-value block
    x[0, 5], x[0, 100] = -200.0, 200.0  # +-max tie, -max first: quantize_row_q8_K and _mat_q8_K differ in sign
    x[3, 300], x[3, 301] = 150.0, -150.0
    return x


class Fixtures:
    """Cases sharing their weights and activations by content: arrays "w/ID" and "x/ID"; per
    case NAME: NAME_w and NAME_x (IDs), NAME_T (the first T rows of x), NAME_type, NAME_out."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self._ids: dict[tuple, str] = {}

    def _store(self, kind: str, a: np.ndarray) -> str:
        key = (kind, a.shape, a.tobytes())
        if key not in self._ids:
            self._ids[key] = f"{kind}/{len(self._ids)}"
            self.arrays[self._ids[key]] = a
        return self._ids[key]

    def add(self, name: str, w: np.ndarray, type_id: int, x: np.ndarray, T: int, out: np.ndarray) -> None:
        self.arrays.update({f"{name}_w": np.array(self._store("w", np.ascontiguousarray(w))),
                            f"{name}_x": np.array(self._store("x", np.ascontiguousarray(x, np.float32))),
                            f"{name}_T": np.int32(T), f"{name}_type": np.int32(type_id),
                            f"{name}_out": np.ascontiguousarray(out, np.float32)})


def synthetic(g: GgmlMatmul, fx: Fixtures, rng) -> None:
    x_all = synthetic_x(rng)
    for name, (type_id, _, _, _) in TYPES.items():
        for R, repack in ((6, False),) + (((8, True),) if name in REPACKED else ()):
            w = random_rows(name, R, SYNTH_K, rng)
            for T in SYNTH_T:
                out = g.matmul(w, type_id, SYNTH_K, np.ascontiguousarray(x_all[:T]), repack)
                fx.add(f"synth_{name}_R{R}_T{T}", w, type_id, x_all, T, out)


def capture_matmuls(model_path: Path, prompt: list, decode: int, weights: tuple) -> list:
    """[{weight name: (x float32[T, K], out float32[T, R])}] per llama_decode call (prompt, then
    the decode token), from llama.cpp's eval callback on MUL_MAT ops."""
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaBatch, LlamaContext

    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    base.ggml_op_name.restype, base.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    steps: list[dict] = []

    @llama_cpp.ggml_backend_sched_eval_callback
    def callback(tp, ask, user):
        t = _Tensor.from_address(tp)
        if base.ggml_op_name(t.op) != b"MUL_MAT":
            return not ask
        name = _Tensor.from_address(t.src[0]).name.decode()
        if ask:
            return name in weights
        x = _Tensor.from_address(t.src[1])
        steps[-1][name] = (_read(x).reshape(-1, x.ne[0]), _read(t).reshape(-1, t.ne[0]))
        return True

    llm = Llama(str(model_path), n_ctx=512, n_threads=2, n_batch=512, n_ubatch=512, verbose=False, flash_attn=False)
    llm.context_params.cb_eval = callback
    llm._ctx = LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    llm._batch = LlamaBatch(n_tokens=llm.n_batch, embd=0, n_seq_max=llm.context_params.n_ctx, verbose=False)
    llm.reset()
    for chunk in (prompt, [decode]):
        steps.append({})
        llm.eval(chunk)
    return steps


class _GgufParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def gguf_rows(path: Path, name: str, n_rows: int) -> tuple[np.ndarray, int]:
    """(uint8[n_rows, row_bytes] view of tensor ``name``'s rows in the file, GGML type id),
    located with ggml's own GGUF reader (gguf_init_from_file, no data loaded)."""
    import llama_cpp

    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    vp, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    for fn, res, args in (("gguf_init_from_file", vp, [ctypes.c_char_p, _GgufParams]),
                          ("gguf_find_tensor", i64, [vp, ctypes.c_char_p]), ("gguf_get_data_offset", sz, [vp]),
                          ("gguf_get_tensor_offset", sz, [vp, i64]), ("gguf_get_tensor_size", sz, [vp, i64]),
                          ("gguf_get_tensor_type", ctypes.c_int, [vp, i64])):
        getattr(base, fn).restype, getattr(base, fn).argtypes = res, args
    base.gguf_free.argtypes = [vp]
    ctx = base.gguf_init_from_file(str(path).encode(), _GgufParams(True, None))
    tid = base.gguf_find_tensor(ctx, name.encode())
    at = base.gguf_get_data_offset(ctx) + base.gguf_get_tensor_offset(ctx, tid)
    size, type_id = base.gguf_get_tensor_size(ctx, tid), base.gguf_get_tensor_type(ctx, tid)
    base.gguf_free(ctx)
    rows = np.memmap(path, np.uint8, "r", offset=at, shape=(size,)).reshape(n_rows, size // n_rows)
    return rows, type_id


def real(models_dir: Path, fx: Fixtures) -> None:
    path = models_dir / f"{REAL_MODEL}.gguf"
    for step, label in zip(capture_matmuls(path, REAL_PROMPT, REAL_DECODE, REAL_WEIGHTS), ("prefill", "decode")):
        for name in REAL_WEIGHTS:
            x, y = step[name]
            rows, type_id = gguf_rows(path, name, y.shape[1])
            fx.add(f"real_{name.replace('.', '_')}_{label}", rows[:REAL_ROWS], type_id, x, x.shape[0], y[:, :REAL_ROWS])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-dir", default=os.path.expanduser("~/.cache/edge/models"))
    args = ap.parse_args()
    fx = Fixtures()
    synthetic(GgmlMatmul(), fx, np.random.default_rng(2026))
    real(Path(args.models_dir), fx)
    arrays = fx.arrays
    arrays["cases"] = np.array(sorted(k[:-4] for k in arrays if k.endswith("_out")))
    dest = ROOT / "tests" / "data" / "llama_matmul.npz"
    np.savez_compressed(dest, **arrays)
    print(f"{dest}: {len(arrays['cases'])} cases, {dest.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
