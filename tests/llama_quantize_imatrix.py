"""llama.cpp's llama_model_quantize with an importance matrix, as llama-quantize --imatrix calls
it: the oracle of tests/test_imatrix.py. Run by the llama-cpp-python interpreter:

    python llama_quantize_imatrix.py SRC.gguf DST.gguf FTYPE_NAME WEIGHTS.npz

WEIGHTS.npz: one float32 array per tensor name (the weights in_sum2 / counts, as
tools/quantize/quantize.cpp load_imatrix makes them), plus "__file__" (the imatrix path as
given), "__dataset__" (first dataset, may be empty) and "__chunks__" (int): the KV overrides
llama-quantize adds (quantize.imatrix.file, .dataset, .entries_count, .chunks_count).
"""
import ctypes
import sys

import llama_cpp
import numpy as np


def main(src: str, dst: str, ftype: str, weights_npz: str) -> None:
    data = np.load(weights_npz)
    names = [k for k in data.files if not k.startswith("__")]
    arrays = [np.ascontiguousarray(data[k], dtype=np.float32) for k in names]
    entries = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
    keep = [n.encode() for n in names]
    for e, name, a in zip(entries, keep, arrays):
        e.name = name
        e.data = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        e.size = a.size
    overrides = []
    path, dataset, chunks = str(data["__file__"]), str(data["__dataset__"]), int(data["__chunks__"])
    overrides.append(("quantize.imatrix.file", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, path))
    if dataset:
        overrides.append(("quantize.imatrix.dataset", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, dataset))
    overrides.append(("quantize.imatrix.entries_count", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, len(names)))
    if chunks > 0:
        overrides.append(("quantize.imatrix.chunks_count", llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, chunks))
    kvo = (llama_cpp.llama_model_kv_override * (len(overrides) + 1))()
    for o, (key, tag, value) in zip(kvo, overrides):
        o.key = key.encode()
        o.tag = tag
        if tag == llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR:
            o.value.val_str = value.encode()[:127]
        else:
            o.value.val_i64 = value
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
    p.nthread = 2
    p.imatrix = entries
    p.kv_overrides = kvo
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
