"""Quantize float32 rows with ggml's own ggml_quantize_chunk: the oracle of
tests/test_quant_blocks.py (no imatrix) and tests/test_quant_imatrix.py (with one). Run by the
interpreter of a llama-cpp-python install, whose llama_cpp/lib/libggml-base.so it loads through ctypes (llama_cpp itself is not imported):

    python ggml_oracle_quantize.py IN.npz OUT.npz

IN.npz: x float32[R, K], types int64[n] (GGML type ids), row_bytes int64[n], and optionally
qw float32[K] (the imatrix argument: one weight per column).
OUT.npz: for each type id t, an array str(t) of uint8[R, row_bytes].
"""
import ctypes
import importlib.util
import os
import sys

import numpy as np


def load_ggml_base() -> ctypes.CDLL:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llama_cpp is not installed in this interpreter")
    lib = ctypes.CDLL(os.path.join(spec.submodule_search_locations[0], "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def main(src: str, dst: str) -> None:
    lib = load_ggml_base()
    data = np.load(src)
    x = np.ascontiguousarray(data["x"], dtype=np.float32)
    n_rows, n_per_row = x.shape
    qw = np.ascontiguousarray(data["qw"], dtype=np.float32) if "qw" in data else None
    results = {}
    for t, row_bytes in zip(data["types"].tolist(), data["row_bytes"].tolist()):
        out = np.zeros((n_rows, row_bytes), np.uint8)
        written = lib.ggml_quantize_chunk(t, x.ctypes.data, out.ctypes.data, 0, n_rows, n_per_row,
                                          None if qw is None else qw.ctypes.data)
        if written != out.size:
            sys.exit(f"ggml_quantize_chunk(type {t}) wrote {written} bytes, expected {out.size}")
        results[str(t)] = out
    np.savez(dst, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
