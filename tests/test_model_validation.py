"""Model files whose hyperparameters a kernel would trust: refused at load with one GGUFError
naming the key, its value and what it must agree with (edge.models.hparams), never a memory
corruption, a crash, a hang or a traceback.

Cases that used to crash the process run through ``edge run`` in a worker process
(tests/fuzz_worker.py), so a signal, a hang or a memory blow-up is a failed test, not a dead
test run; the rest load the model in-process.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from edge.gguf_file import GGUFError, GGUFFile
from edge.models import load_model
from kernels_cpu import ops
from kernels_cpu.attention import paged_attention
from kernels_cpu.quantize_act import quantize_q8_k
from tests.fuzz_worker import MEMORY_BUDGET, Worker
from tests.gguf_mutate import Header, mutate
from tests.tiny_models import write_tiny_model

U32 = VT.UINT32


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _tiny(tmp_path, changes=None, name="m.gguf", **kw) -> str:
    """A tiny model (tests/tiny_models.py, ``kw``) with metadata ``changes`` (tests/gguf_mutate.py)."""
    base = write_tiny_model(tmp_path / f"base-{name}", **kw)
    return mutate(base, tmp_path / name, changes or {})


def _load(path):
    return load_model(GGUFFile(path))


def _edge_run(worker: Worker, path):
    res = worker.run(["run", "-m", str(path), "-n", "2", "-c", "64", "-t", "1", "<t1><t2>"])
    assert res.problem() is None, res.problem()
    return res


# ---- finding 1: rope.dimension_count drove an out-of-bounds write in the RoPE kernel ----------

@pytest.mark.parametrize("n_rot", [258, 512, 10**6])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_rope_dimension_count_above_head_size(tmp_path, worker, arch, n_rot):
    """head size 256: rope.dimension_count 258 exited 0 after writing past the q/k rows, 512 and
    10^6 died of malloc aborts or SIGSEGV. llama.cpp refuses n_rot != head size for llama, and
    its RoPE asserts n_rot <= head size for the others; so does edge, at load."""
    path = _tiny(tmp_path, {f"{arch}.rope.dimension_count": (U32, None, n_rot)}, arch=arch, n_embd=64,
                 n_head=2, n_head_kv=1, head_dim=256)
    res = _edge_run(worker, path)
    rule = ("must be even and at most the head size gemma3.attention.key_length = 256" if arch == "gemma3"
            else "must equal the head size llama.attention.key_length = 256 for llama")
    assert res.rc == 1 and res.error_types[0] == "GGUFError"
    assert res.error_lines == [f"edge run: error: {path}: {arch}.rope.dimension_count = {n_rot} {rule}"]


@pytest.mark.parametrize("n_rot", [0, 1, 30])
def test_rope_dimension_count_zero_odd(tmp_path, n_rot):
    """rope.dimension_count 0 and 1 ended in a ZeroDivisionError traceback at the first token;
    an odd count is refused as llama.cpp's RoPE refuses it."""
    path = _tiny(tmp_path, {"gemma3.rope.dimension_count": (U32, None, n_rot)}, arch="gemma3", head_dim=32)
    if n_rot == 30:
        assert _load(path).args.n_rot == 30   # partial RoPE: the first 30 of 32 dimensions turn
        return
    with pytest.raises(GGUFError, match=rf"gemma3.rope.dimension_count = {n_rot} must be even and at most "
                                        r"the head size gemma3.attention.key_length = 32$"):
        _load(path)


# ---- finding 6: block_count sized per-layer structures before any tensor was checked ----------

@pytest.mark.parametrize("n", [2**40, 10**9])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_huge_block_count_refused_at_once(tmp_path, worker, arch, n):
    """block_count 2^40 hung growing to 2.9 GB, 10^9 passed 4 GB: now refused before anything is
    built from it (llama.cpp's limit is 512 layers), within the worker's budgets."""
    path = _tiny(tmp_path, {f"{arch}.block_count": (VT.UINT64, None, n)}, arch=arch)
    res = _edge_run(worker, path)
    assert res.error_lines == [f"edge run: error: {path}: {arch}.block_count = {n} is out of range: "
                               "it must be in 1..512"]   # llama.cpp's LLAMA_MAX_LAYERS
    assert res.cpu < 1.0 and res.peak_rss < MEMORY_BUDGET


def test_block_count_against_blocks_present(tmp_path):
    """block_count must name exactly the blk.N tensors the file has, checked before any layer
    is built; a missing block in the middle is named."""
    path = _tiny(tmp_path, {"llama.block_count": (U32, None, 3)}, arch="llama")
    with pytest.raises(GGUFError, match=r"llama.block_count = 3, but the file has tensors of blocks "
                                        r"blk.0 .. blk.1 \(2 blocks\)$"):
        _load(path)
    h = Header(write_tiny_model(tmp_path / "three.gguf", arch="llama", n_layer=3))
    h.tensors = [t for t in h.tensors if not t[0].startswith("blk.1.")]
    with pytest.raises(GGUFError, match=r"llama.block_count = 3, but the file has tensors of blocks "
                                        r"blk.0 .. blk.2 without blk.1$"):
        _load(h.write(tmp_path / "hole.gguf"))


# ---- finding 7: zero counts ended in ZeroDivisionError tracebacks -----------------------------

@pytest.mark.parametrize("key", ["attention.head_count", "attention.head_count_kv", "context_length",
                                 "embedding_length", "feed_forward_length", "attention.key_length"])
def test_zero_counts(tmp_path, key):
    path = _tiny(tmp_path, {f"gemma3.{key}": (U32, None, 0)}, arch="gemma3", head_dim=32)
    with pytest.raises(GGUFError, match=rf"gemma3.{key} = 0 is out of range: it must be in 1..4294967295$"):
        _load(path)


def test_sliding_window_pattern_zero_and_arrays(tmp_path):
    """sliding_window_pattern 0 divided by zero; llama.cpp reads it as "every layer uses the
    window", and so does edge. A per-layer array is taken as llama.cpp takes it; one of
    another length than block_count is refused."""
    kw = dict(arch="gemma3", head_dim=32, n_layer=3, sliding_window=4)
    key = "gemma3.attention.sliding_window_pattern"
    model = _load(_tiny(tmp_path, {key: (U32, None, 0)}, "p0.gguf", **kw))
    assert model.args.swa_layers == (True, True, True) and [b.window for b in model.blocks] == [4, 4, 4]
    assert model.forward([1, 2, 3], model.new_cache(8)).shape == (1, 96)
    assert _load(_tiny(tmp_path, {key: (U32, None, 2)}, "p2.gguf", **kw)).args.swa_layers == (True, False, True)
    arr = (VT.ARRAY, VT.BOOL, np.array([False, True, True]))
    assert _load(_tiny(tmp_path, {key: arr}, "pa.gguf", **kw)).args.swa_layers == (False, True, True)
    short = (VT.ARRAY, VT.INT32, np.array([1, 0], np.int32))
    with pytest.raises(GGUFError, match=rf"{key} has 2 entries, but gemma3.block_count = 3$"):
        _load(_tiny(tmp_path, {key: short}, "ps.gguf", **kw))


# ---- every size against the tensors -----------------------------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("attention.key_length", 8, r"tensor 'blk.0.attn_q.weight' has shape \[64, 128\], but the metadata gives "
     r"\[gemma3.embedding_length = 64, gemma3.attention.head_count \* gemma3.attention.key_length = "
     r"4 \* 8 = 32\]"),
    ("attention.value_length", 16, r"'blk.0.attn_v.weight' has shape \[64, 64\], but the metadata gives "
     r"\[gemma3.embedding_length = 64, gemma3.attention.head_count_kv \* gemma3.attention.value_length = "
     r"2 \* 16 = 32\]"),
    ("attention.head_count", 8, r"'blk.0.attn_q.weight' has shape \[64, 128\], .* 8 \* 32 = 256\]"),
    ("attention.head_count_kv", 4, r"'blk.0.attn_k.weight' has shape \[64, 64\], .* 4 \* 32 = 128\]"),
    ("attention.head_count_kv", 3,
     r"gemma3.attention.head_count_kv = 3 does not divide gemma3.attention.head_count = 4$"),
    ("embedding_length", 32, r"'token_embd.weight' has shape \[64, 96\], but the metadata gives "
     r"\[gemma3.embedding_length = 32, the 96 tokens of tokenizer.ggml.tokens\]"),
    ("feed_forward_length", 64, r"'blk.0.ffn_gate.weight' has shape \[64, 128\], but the metadata gives "
     r"\[gemma3.embedding_length = 64, gemma3.feed_forward_length = 64\]"),
    ("rope.dimension_count", 16, r"'rope_freqs.weight' has shape \[16\], but the metadata gives "
     r"\[gemma3.rope.dimension_count / 2 = 8\]"),
])
def test_sizes_agree_with_tensors(tmp_path, key, value, message):
    path = _tiny(tmp_path, {f"gemma3.{key}": (U32, None, value)}, arch="gemma3", head_dim=32, rope_freqs=True)
    with pytest.raises(GGUFError, match=message):
        _load(path)


@pytest.mark.parametrize("key, value, rule", [
    ("attention.layer_norm_rms_epsilon", -1e-6, ">= 0"),
    ("attention.layer_norm_rms_epsilon", float("nan"), ">= 0"),
    ("rope.freq_base", 0.0, "> 0"), ("rope.freq_base", float("inf"), "> 0"), ("rope.freq_base_swa", -1.0, "> 0"),
    ("rope.scaling.factor", -2.0, ">= 0"), ("final_logit_softcapping", float("inf"), ""),
])
def test_floats_finite_and_in_range(tmp_path, key, value, rule):
    path = _tiny(tmp_path, {f"gemma3.{key}": (VT.FLOAT32, None, value)}, arch="gemma3", head_dim=32)
    bound = f" {rule}" if rule else ""
    with pytest.raises(GGUFError, match=rf"gemma3.{key} = .* is out of range: it must be a finite number{bound}$"):
        _load(path)


def test_sliding_window_range_and_types(tmp_path):
    path = _tiny(tmp_path, {"gemma3.attention.sliding_window": (VT.INT32, None, -1)}, arch="gemma3", head_dim=32)
    with pytest.raises(GGUFError, match=r"gemma3.attention.sliding_window = -1 is out of range: "
                                        r"it must be in 0..4294967295$"):
        _load(path)
    path = _tiny(tmp_path, {"gemma3.attention.head_count": (VT.FLOAT32, None, 4.0)}, "f.gguf", arch="gemma3")
    with pytest.raises(GGUFError, match=r"'gemma3.attention.head_count' at offset \d+ has type FLOAT32, "
                                        r"expected an integer"):
        _load(path)


def test_rope_scaling_as_llama_cpp(tmp_path):
    """Absent rope.scaling.type means linear (llama.cpp's default), so a factor alone scales;
    "none" ignores the factor; rope.freq_base_swa sets Gemma 3's local RoPE base."""
    f = (VT.FLOAT32, None, 4.0)
    factor_only = _tiny(tmp_path, {"llama.rope.scaling.factor": f}, "a.gguf", arch="llama")
    assert _load(factor_only).args.rope_freq_scale == 0.25
    none = {"llama.rope.scaling.factor": f, "llama.rope.scaling.type": (VT.STRING, None, "none")}
    assert _load(_tiny(tmp_path, none, "n.gguf", arch="llama")).args.rope_freq_scale == 1.0
    swa = {"gemma3.rope.freq_base_swa": (VT.FLOAT32, None, 20000.0)}
    assert _load(_tiny(tmp_path, swa, "s.gguf", arch="gemma3", head_dim=32)).args.rope_freq_base_swa == 20000.0


# ---- defence in depth: kernel entry points refuse shapes that would index out of bounds -------

def test_kernels_refuse_shapes_that_do_not_fit():
    x = np.zeros((2, 4, 8), np.float32)
    cos, sin = ops.rope_cos_sin(np.arange(2), 10, 10000.0)   # 5 pairs: 10 dimensions of a head of 8
    with pytest.raises(ValueError, match=r"rope: cos/sin \(2, 5\) do not fit x \(2, 4, 8\)"):
        ops.rope(x, cos, sin, True)
    for n_rot in (0, 1):
        with pytest.raises(ValueError, match=f"n_rot must be even and at least 2, got {n_rot}"):
            ops.rope_cos_sin(np.arange(2), n_rot, 10000.0)
    with pytest.raises(ValueError, match=r"freq_factors has shape \(3,\), expected \(4,\)"):
        ops.rope_cos_sin(np.arange(2), 8, 10000.0, freq_factors=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="rms_norm"):
        ops.rms_norm(np.zeros((2, 8), np.float32), np.ones(4, np.float32), 1e-6, np.zeros((2, 8), np.float32))
    q, out = np.zeros((1, 3, 8), np.float32), np.zeros((1, 3, 8), np.float32)
    pool = np.zeros((1, 16, 2, 8), np.uint16)   # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(q, pool, pool, np.zeros((1, 1), np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
                      0, np.float32(1), out)


def test_kernels_divide_as_ieee():
    """Values a file can hold (eps 0 over a zero row, a 0 in rope_freqs, an infinite activation)
    give ggml's IEEE results, not a ZeroDivisionError from numba."""
    x = np.zeros((1, 8), np.float32)
    ops.rms_norm(x, np.ones(8, np.float32), 0.0, x)
    assert np.isnan(x).all()                        # 0 * (1 / sqrt(0)) as ggml
    cos, _ = ops.rope_cos_sin(np.array([1]), 4, 10000.0, freq_factors=np.array([0, 1], np.float32))
    assert np.isnan(cos[0, 0]) and np.isfinite(cos[0, 1])
    big = np.zeros((1, 256), np.float32)
    big[0, 0] = np.inf
    _, d, _ = quantize_q8_k(big)
    assert d[0, 0] == -np.inf                       # 1 / (-127 / inf)
