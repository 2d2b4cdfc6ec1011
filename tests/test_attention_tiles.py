"""paged_attention's tiled path for f16 pools (kernels_cpu.attention_tiles: many query rows at
once) against the walk of one (row, head) pair at a time (kernels_cpu.attention._attention_rows,
which decode and the f32 / q8_0 pools take): bit for bit equal, in both lane orders (the batch's
tinyBLAS, and ggml_vec_dot_f16 for batch-invariant mode), over GQA shapes, head sizes, sliding
windows, soft-capping, several sequences in one batch and shuffled block tables."""
import numpy as np
import pytest
from numba import njit, types
from numba.extending import intrinsic

from kernels_cpu import attention
from kernels_cpu.attention import paged_attention, store_kv
from kernels_cpu.attention_tiles import V16, _v_expf
from kernels_cpu.fmath import v_expf

ROW = {"f16": lambda hd: hd, "f32": lambda hd: hd, "q8_0": lambda hd: hd // 32 * 34}
DTYPE = {"f16": np.uint16, "f32": np.float32, "q8_0": np.uint8}
NAN_F16 = 0x7E00


def _case(rng, kind, T, H, H_kv, hd, hd_v, context, n_seq=1, interleave=False, bs=16, window=0, spread=1.0,
          zeros=False):
    """(q, k_pool, v_pool, tables, seq_ids, positions): n_seq sequences of ``context`` cells each
    in one pool of shuffled blocks (unused slots NaN for f16), the batch being the last T
    positions of each sequence, sequence by sequence or (``interleave``) in runs of 1-5 rows
    taken from the sequences in turn. ``zeros``: a third of q, K and V exactly +-0."""
    per = -(-context // bs)
    n_blocks = n_seq * per + 3
    pools = []
    for n in (hd, hd_v):
        shape = (n_blocks, bs, H_kv, ROW[kind](n))
        pools.append(np.full(shape, NAN_F16, np.uint16) if kind == "f16" else np.zeros(shape, DTYPE[kind]))
    tables = rng.permutation(n_blocks).astype(np.int32)[: n_seq * per].reshape(n_seq, per)
    if window:                  # blocks wholly out of every row's window: holes, as the cache leaves them
        first_seen = max(0, context - T - window + 1)
        tables[:, : first_seen // bs] = -1
    for s in range(n_seq):
        pos = np.arange(context, dtype=np.int32)
        keep = pos >= (first_seen // bs) * bs if window else pos >= 0
        for pool, n in zip(pools, (hd, hd_v)):
            x = (rng.standard_normal((context, H_kv * n)) * spread).astype(np.float32)
            if zeros:
                x[rng.random(x.shape) < 0.33] = 0.0
                x = np.where(rng.random(x.shape) < 0.5, -x, x)
            store_kv(x[keep], pool, tables, np.full(keep.sum(), s, np.int32), pos[keep])
    rows = [(s, p) for s in range(n_seq) for p in range(context - T, context)]
    if interleave:
        queues = [[r for r in rows if r[0] == s] for s in range(n_seq)]
        rows, s = [], 0
        while any(queues):
            if queues[s]:
                take = int(rng.integers(1, 6))
                rows += queues[s][:take]
                queues[s] = queues[s][take:]
            s = (s + 1) % n_seq
    seq_ids = np.array([r[0] for r in rows], np.int32)
    positions = np.array([r[1] for r in rows], np.int32)
    q = (rng.standard_normal((len(rows), H, hd)) * spread).astype(np.float32)
    if zeros:
        q[rng.random(q.shape) < 0.33] = 0.0
        q = np.where(rng.random(q.shape) < 0.5, -q, q)
    return q, pools[0], pools[1], tables, seq_ids, positions


def _compare(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, softcap, batch_invariant, hd_v,
             finite=True):
    T, H, hd = q.shape
    out = np.full((T, H, hd_v), np.nan, np.float32)
    paged_attention(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, batch_invariant, softcap)
    ref = np.full_like(out, np.nan)
    tiny_kq, tiny_kqv = attention._paths(T, hd, hd_v, batch_invariant)
    attention._attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, np.float32(softcap), ref,
                              0, 1, tiny_kq, tiny_kqv)
    assert np.isfinite(ref).all() == finite
    bad = np.argwhere(out.view(np.uint32) != ref.view(np.uint32))
    assert bad.size == 0, f"{len(bad)} outputs differ, first at (row, head, d) {tuple(bad[0])}: " \
                          f"{out[tuple(bad[0])]!r} != {ref[tuple(bad[0])]!r}"


# (T, H, H_kv, hd, hd_v, context, window, softcap, n_seq, interleave, bs)
CASES = [
    (512, 14, 2, 64, 64, 512, 0, 0.0, 1, False, 16),       # qwen2.5-0.5b prefill
    (37, 14, 2, 64, 64, 100, 0, 0.0, 1, False, 16),
    (600, 2, 1, 64, 64, 600, 0, 0.0, 1, False, 16),
    (2, 8, 2, 128, 128, 40, 0, 0.0, 1, False, 16),
    (70, 8, 2, 128, 128, 300, 0, 0.0, 2, True, 16),        # two sequences, runs of rows in turn
    (33, 4, 4, 256, 256, 90, 0, 0.0, 1, False, 1),
    (45, 4, 1, 256, 256, 120, 17, 0.0, 1, False, 16),      # gemma3-like, sliding window
    (40, 2, 1, 192, 128, 77, 0, 0.0, 1, False, 7),         # hd_v != hd, odd block size
    (29, 8, 2, 64, 64, 200, 0, 30.0, 2, False, 64),        # soft-capping, sequence by sequence
    (100, 1, 1, 64, 64, 130, 50, 0.0, 1, False, 16),
    (1, 14, 2, 64, 64, 300, 0, 0.0, 1, False, 16),         # decode
    (4, 14, 2, 64, 64, 300, 0, 0.0, 4, True, 16),          # batched decode: 4 sequences
]


@pytest.fixture
def tiles_used(monkeypatch):
    """A list that gets an entry each time paged_attention takes the tiled path."""
    used = []
    kernel = attention._tiled_kernel
    monkeypatch.setattr(attention, "_tiled_kernel", lambda *args: used.append(args) or kernel(*args))
    return used


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-H{}-{}-hd{}-{}-c{}-w{}-cap{}-s{}{}-bs{}".format(
    *c[:9], "i" if c[9] else "", c[10]))
def test_tiled_equals_pairs(case, batch_invariant, tiles_used):
    T, H, H_kv, hd, hd_v, context, window, softcap, n_seq, interleave, bs = case
    rng = np.random.default_rng(sum(case[:6]))
    data = _case(rng, "f16", T, H, H_kv, hd, hd_v, context, n_seq, interleave, bs, window)
    _compare(*data, window, np.float32(1 / np.sqrt(hd)), softcap, batch_invariant, hd_v)
    assert tiles_used


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_zeros_and_large_scores(batch_invariant, tiles_used):
    """Scores of +-0 (every product of a dot product +-0: the tiled KQ may give -0 where the
    walk gives +0, which the softmax cannot tell apart) and scores far apart (probabilities
    that underflow to 0, f16 subnormal probabilities)."""
    rng = np.random.default_rng(3)
    for zeros, spread in ((True, 1.0), (False, 6.0), (True, 8.0)):
        data = _case(rng, "f16", 64, 8, 2, 64, 64, 150, 1, False, 16, 0, spread, zeros)
        _compare(*data, 0, np.float32(0.125), 0.0, batch_invariant, 64)
    assert len(tiles_used) == 3


def test_few_queries_take_the_walk(tiles_used):
    """A decode step of a model with 4 query heads per KV head: the walk (TILE_MIN_QUERIES)."""
    rng = np.random.default_rng(4)
    data = _case(rng, "f16", 1, 4, 1, 256, 256, 300, 3, True)
    _compare(*data, 0, np.float32(0.0625), 0.0, True, 256)
    assert not tiles_used


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_other_pools_take_the_walk(kind, batch_invariant):
    """f32 and q8_0 pools keep the per-pair walk: paged_attention equals it for them too."""
    rng = np.random.default_rng(5)
    data = _case(rng, kind, 50, 8, 2, 64, 64, 120, 2, True, 16, 33)
    _compare(*data, 33, np.float32(0.125), 0.0, batch_invariant, 64)


def test_inf_in_a_later_rows_v(tiles_used):
    """A V row of inf (an f16 overflow) seen only by later rows of a tile: the earlier rows stay
    finite, as in the walk (each row adds only the cells it sees)."""
    rng = np.random.default_rng(9)
    q, k_pool, v_pool, tables, seq_ids, positions = _case(rng, "f16", 40, 4, 2, 64, 64, 60)
    p = 45                                      # a position in the batch (rows at 20..59)
    v_pool[tables[0, p // 16], p % 16] = 0x7C00  # +inf
    _compare(q, k_pool, v_pool, tables, seq_ids, positions, 0, np.float32(0.125), 0.0, False, 64, finite=False)
    assert tiles_used


@intrinsic
def _v_expf_16(typingctx, x, i, use_scalef):
    """x[i:i + 16] = _v_expf(x[i:i + 16]) (float32 1-D C; use_scalef a literal bool)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.bitcast(builder.gep(data, [args[1]]), V16.as_pointer())
        builder.store(_v_expf(builder, builder.load(at, align=4), signature.args[2].literal_value), at, align=4)
        return context.get_dummy_value()
    if not isinstance(use_scalef, types.BooleanLiteral):
        return None
    return types.void(x, types.intp, use_scalef), codegen


@njit
def _expf_both(x, vector, scalar):
    for i in range(0, x.shape[0], 16):
        _v_expf_16(vector, i, True)
    for i in range(x.shape[0]):
        scalar[i] = v_expf(x[i])


@njit
def _expf_float64_scaling(x):
    for i in range(0, x.shape[0], 16):
        _v_expf_16(x, i, False)


def test_vector_expf_is_ggml_v_expf():
    """The softmax's 16-lane ggml_v_expf (vscalefps, and the float64 scaling for CPUs without
    AVX-512) against kernels_cpu.fmath.v_expf: subnormal results, underflow, overflow."""
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.uniform(-200, 100, 40000), rng.uniform(-110, -80, 8000),
                        [0.0, -0.0, 88.7, 89.0, -87.3, -103.9, -149.0, -150.0, -192.0, 192.0, -1e30, 1e30,
                         np.nextafter(np.float32(0), 1), 1e-30, 7.0, -7.0]]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-len(x) % 16, np.float32)])
    vector, scalar = x.copy(), np.empty_like(x)
    _expf_both(x, vector, scalar)
    float64_scaling = x.copy()
    _expf_float64_scaling(float64_scaling)
    assert np.array_equal(vector.view(np.uint32), scalar.view(np.uint32))
    assert np.array_equal(float64_scaling.view(np.uint32), scalar.view(np.uint32))
