"""The generic matmul tile: LLVM vector IR for nr weight rows x nt activation rows of any weight type.

Each weight block is unpacked once into 32-lane int16 segments (kernels_cpu.matmul_decoders:
weights times their integer sub-block scale) and multiplied with the activation segments
pairwise into int32 lanes (x86 ``pmaddwd``). The integer vectors of the tile's (r, t) pairs are
then merged two by two, adding lanes that hold partial sums of the same output (the pack plan,
_pack_plan), down to the lanes of the path (8, 4 or 1 per output); this also packs several
outputs into one vector, and the float updates of the path run on those packed vectors.

A path is the float structure of one llama.cpp kernel (see kernels_cpu.matmul): integer sums
are exact in every kernel, so results depend only on which integer sums become floats, the
float scales they are multiplied by and the order of the float operations.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from llvmlite import ir

from kernels_cpu.matmul_decoders import V16I16, V32I8, V32I16, BlockFormat
from kernels_cpu.simd import F32, I32, I64, concat, fmuladd, load, madd_pairs, shuffle, tile_function, vec

T_ = GGMLQuantizationType
LANES = 16  # float32 / int32 lanes per accumulator (32 int16 products pairwise summed)
V16F32 = vec(F32, LANES)

VEC_DOT, TILED, GEMV, GEMM = 0, 1, 2, 3  # the paths: llama.cpp kernels whose float structure a tile reproduces
PATH_NAMES = ("vec_dot", "tiled", "gemv", "gemm")


def _groups(fmt: BlockFormat, path: int) -> int:
    """Float updates per block: GEMM takes one per 64 (Q4_K) or 128 (Q2_K) values."""
    if path != GEMM:
        return 1
    return 4 if fmt.ggml_type == T_.Q4_K else 2


class Packed:
    """Integer or float <16 x T> vectors holding partial sums of several tile inputs ((r, t) pairs).

    ``labels[k][l] = (input, part)``: lane l of vector k holds partial ``part`` of ``input`` (its
    other lanes may hold copies). Partial j of an input at merge level m is the sum of its pair
    sums j * 2**m .. (j + 1) * 2**m - 1 (pair sum p: values 2p, 2p + 1 of every 32-value segment).
    """

    def __init__(self, vecs: list, labels: list):
        self.vecs, self.labels = vecs, labels

    def owners(self, k: int) -> list:
        return [i for i, _ in self.labels[k]]


def _pair_masks(kind: str, arg: int = 0):
    """(lo, hi) shuffle masks of one merge step over two vectors (lanes >= 16: second vector):
    result lane l = src[lo[l]] + src[hi[l]].

    "lane": within each 128-bit lane k, [a0+a1, a2+a3, b0+b1, b2+b3] of that lane (x86 vshufps);
    "block": 128-bit lanes 2j, 2j+1 of a, then of b, added (vshufi32x4); "evenodd": even plus
    odd lanes of a then of b (vpermt2d); "fold": one vector, lane l plus lane l ^ arg.
    """
    if kind == "fold":
        return list(range(LANES)), [lane ^ arg for lane in range(LANES)]
    lo = []
    for lane in range(LANES):
        k, m = divmod(lane, 4)
        if kind == "lane":
            lo.append((LANES if m >= 2 else 0) + 4 * k + 2 * (m % 2))
        elif kind == "block":
            lo.append((LANES if k >= 2 else 0) + 8 * (k % 2) + m)
        else:
            lo.append((LANES if lane >= 8 else 0) + 2 * (lane % 8))
    step = 4 if kind == "block" else 1
    return lo, [v + step for v in lo]


def _merge_labels(kind, a, c, arg=0):
    """Labels after a merge step, or None if it would add lanes of different inputs or
    partials that are not 2j and 2j + 1."""
    src = a + c
    lo, hi = _pair_masks(kind, arg)
    out = []
    for x, y in zip(lo, hi):
        (i, p), (i2, p2) = src[x], src[y]
        if i != i2 or {p, p2} != {p & ~1, p | 1}:
            return None
        out.append((i, p >> 1))
    return out


def _pack_plan(n: int, w: int):
    """How _pack merges n per-input vectors of 16 pair sums down to ``w`` partials per input
    (8: lane j sums values 4j..4j+3 of every segment, as ggml's 8 lanes; 1: the total).

    Two vectors merge with the cheapest valid step ("lane", "block", "evenodd"); a lone vector
    folds in place. Returns (steps, labels of the resulting vectors)."""
    labels = [[(i, p) for p in range(LANES)] for i in range(n)]
    steps, parts = [], LANES
    while parts > w:
        if len(labels) > 1:
            pairs = [(k, min(k + 1, len(labels) - 1)) for k in range(0, len(labels), 2)]
            for kind in ("lane", "block", "evenodd"):
                merged = [_merge_labels(kind, labels[a], labels[c]) for a, c in pairs]
                if all(merged):
                    break
            steps.append((kind, pairs))
        else:
            for s in (1, 2, 4, 8):
                merged = [_merge_labels("fold", labels[0], [], s)]
                if merged[0]:
                    break
            steps.append(("fold", s))
        assert all(merged), "no valid merge"
        labels, parts = merged, parts // 2
    return steps, labels


def _pack(b, vecs: list, w: int) -> Packed:
    """Per-input <16 x i32> vectors of pair sums -> Packed with ``w`` partials per input."""
    steps, labels = _pack_plan(len(vecs), w)
    for kind, arg in steps:
        if kind == "fold":
            lo, hi = _pair_masks(kind, arg)
            vecs = [b.add(v, shuffle(b, v, hi)) for v in vecs]
        else:
            lo, hi = _pair_masks(kind)
            vecs = [b.add(shuffle(b, vecs[a], lo, vecs[c]), shuffle(b, vecs[a], hi, vecs[c])) for a, c in arg]
    return Packed(vecs, labels)


def _as_pairs(b, v):
    """<8 x i32> -> <16 x i32> [v0, 0, v1, 0, ...]: pair sums whose pairs add up to v's lanes,
    so sums over 32-value groups pack like segment products (lane j of v: values 32j..32j+31)."""
    return b.bitcast(b.zext(v, vec(I64, 8)), vec(I32, LANES))


def _direct_mins(b, headers: list, bsums: list, nt: int, owners: list, ks: range):
    """<16 x i32> with lane l = sum over k in ``ks`` (16-value groups, by pairs k, k + 1) of
    min16[k] * bsums[k] of input owners[l] = r * nt + t: the mins term of a few groups built
    straight in an accumulator's lane order (one pmaddwd per pair of groups, operands
    permuted from all rows' mins and all activation rows' bsums; nr and nt powers of two)."""
    all_mins = [h["mins"] for h in headers]
    while len(all_mins) > 1:  # concat: rows' 16 mins side by side
        all_mins = [concat(b, all_mins[k], all_mins[k + 1]) for k in range(0, len(all_mins), 2)]
    all_bs = list(bsums)
    while len(all_bs) > 1:
        all_bs = [concat(b, all_bs[k], all_bs[k + 1]) for k in range(0, len(all_bs), 2)]
    total = None
    for k in ks[::2]:
        lanes_m = [16 * (i // nt) + k + j for i in owners for j in (0, 1)]
        lanes_b = [16 * (i % nt) + k + j for i in owners for j in (0, 1)]
        term = madd_pairs(b, shuffle(b, all_mins[0], lanes_m), shuffle(b, all_bs[0], lanes_b))
        total = term if total is None else b.add(total, term)
    return total


def _lanes(b, per_input, p: Packed, k: int):
    """<16 x float> with lane l = per_input[input of lane l of p's vector k]."""
    return shuffle(b, per_input, p.owners(k))


def _by_input(b, values: list, index: list):
    """<16 x float> with lane i = values[index[i]] (values: scalars, index: one entry per input)."""
    small = ir.Constant(vec(F32, len(values)), ir.Undefined)
    for k, v in enumerate(values):
        small = b.insert_element(small, v, ir.Constant(I32, k))
    return shuffle(b, small, index + [0] * (LANES - len(index)))


def _to_float(b, v):
    return b.sitofp(v, V16F32)


def _accumulators(fmt: BlockFormat, path: int, n: int) -> dict:
    """Accumulator name -> (labels of its packed float vectors, partials per input)."""
    if path == VEC_DOT:
        out = {"lanes": (_pack_plan(n, 8)[1], 8)}
        if fmt.ggml_type in (T_.Q4_K, T_.Q5_K):
            w = 4 if fmt.ggml_type == T_.Q4_K else 1
            out["mins"] = (_pack_plan(n, w)[1], w)
        if fmt.act == T_.Q8_1:
            out["sum"] = ([[(i, 0) for i in range(n)] + [(n - 1, 0)] * (LANES - n)], 1)
        return out
    out = {"acc": (_pack_plan(n, 1)[1], 1)}
    if path != TILED and fmt.ggml_type in (T_.Q4_K, T_.Q2_K):  # GEMV / GEMM: the mins apart
        out["accm"] = out["acc"]
    return out


def _emit_block(b, fmt: BlockFormat, path: int, rows: dict, blk, accs: dict) -> dict:
    """IR for block ``blk`` of every (r, t) input of a tile (input i = r * nt + t): the integer
    sums, then the float updates of ``path``; returns the new accumulators (packed float
    vectors by name, laid out as _accumulators says)."""
    nr, nt = len(rows["w"]), len(rows["xq"])
    inputs = [(r, t) for r in range(nr) for t in range(nt)]
    r_of, t_of = [r for r, _ in inputs], [t for _, t in inputs]
    blocks = [b.gep(w_row, [b.mul(blk, ir.Constant(I64, fmt.block_bytes))]) for w_row in rows["w"]]
    headers = [fmt.header(b, p) for p in blocks]
    x_at = b.mul(blk, ir.Constant(I64, fmt.block_elems))
    dw = _by_input(b, [h["d"] for h in headers], r_of)
    dx = _by_input(b, [load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32) for xd in rows["xd"]], t_of)
    if fmt.act == T_.Q8_K:
        bsums = [load(b, xa, b.mul(blk, ir.Constant(I64, 32)), V16I16) for xa in rows["xa"]]
    if "mins" in headers[0]:  # as pair sums: min times the activation sum of values 32j..32j+31
        mins = [_as_pairs(b, madd_pairs(b, headers[r]["mins"], bsums[t])) for r, t in inputs]
        dmin = _by_input(b, [h["dmin"] for h in headers], r_of)
    layout = _accumulators(fmt, path, len(inputs))
    new = dict(accs)

    def update(name, p: Packed, scale):
        """acc = fma(float(int), scale, acc) over the packed vectors (scale: by input)."""
        assert p.labels == layout[name][0], f"{name}: layout differs from the accumulator's"
        new[name] = [fmuladd(b, _to_float(b, v), _lanes(b, scale, p, k), acc)
                     for k, (v, acc) in enumerate(zip(p.vecs, new[name]))]

    def group_done(g, sums):
        """Float updates once the integer sums of group g (all values for VEC_DOT / TILED) are complete."""
        if path == VEC_DOT:
            lanes = _pack(b, sums, 8)
            if fmt.ggml_type == T_.Q6_K:  # minus 32 * (scale * bsum) of values 32j..32j+31
                corr = _pack(b, [_as_pairs(b, madd_pairs(b, headers[r]["scales"], bsums[t])) for r, t in inputs], 8)
                five = ir.Constant(vec(I32, LANES), [5] * LANES)
                lanes.vecs = [b.sub(v, b.shl(c, five)) for v, c in zip(lanes.vecs, corr.vecs)]
            if "mins" in headers[0]:
                neg_dmin = b.fmul(b.fneg(dx), dmin)
                if fmt.ggml_type == T_.Q2_K:  # mins first, into the same 8 lanes
                    update("lanes", _pack(b, mins, 8), neg_dmin)
                else:  # Q4_K: 4 lanes (sub-block pairs); Q5_K: a scalar chain
                    update("mins", _pack(b, mins, layout["mins"][1]), neg_dmin)
            update("lanes", lanes, b.fmul(dx, dw))
            if fmt.act == T_.Q8_1:  # + m_w * s_x, a scalar fma chain per output
                m = _by_input(b, [h["m"] for h in headers], r_of)
                s = _by_input(b, [load(b, xa, b.mul(blk, ir.Constant(I64, 4)), F32) for xa in rows["xa"]], t_of)
                p = Packed(None, layout["sum"][0])
                new["sum"] = [fmuladd(b, _lanes(b, m, p, 0), _lanes(b, s, p, 0), new["sum"][0])]
        elif path == TILED:
            s1 = _pack(b, sums, 1)
            res = [b.fmul(_to_float(b, v), _lanes(b, dw, s1, k)) for k, v in enumerate(s1.vecs)]
            if "mins" in headers[0]:  # r = -(dmin * S2) + r, fused
                s2 = _pack(b, mins, 1)
                assert s2.labels == s1.labels
                res = [fmuladd(b, _lanes(b, b.fneg(dmin), s2, k), _to_float(b, v), r_)
                       for k, (v, r_) in enumerate(zip(s2.vecs, res))]
            new["acc"] = [fmuladd(b, r_, _lanes(b, dx, s1, k), acc) for k, (r_, acc) in enumerate(zip(res, new["acc"]))]
        else:  # GEMV / GEMM: acc += I * (d_w * d_x), accm += M * (dmin * d_x), per group of values
            acc = _pack(b, sums, 1)
            update("acc", acc, b.fmul(dw, dx))
            if "mins" in headers[0]:
                if n_groups == 1:
                    m = packed_mins
                else:  # one group of 16-value groups per pass
                    per = 16 // n_groups
                    m = Packed([_direct_mins(b, headers, bsums, nt, acc.owners(k), range(g * per, (g + 1) * per))
                                for k in range(len(acc.vecs))], acc.labels)
                update("accm", m, b.fmul(dmin, dx))

    n_groups = _groups(fmt, path)
    if path == GEMV and "mins" in headers[0]:
        packed_mins = _pack(b, mins, 1)
    group = fmt.block_elems // n_groups
    sums, g = [None] * len(inputs), 0
    unsigned = path == VEC_DOT  # Q6_K codes 0..63 with a bsums correction (ggml_vec_dot_q6_K_q8_K)
    for segs in zip(*(fmt.segments(b, p, h, unsigned) for p, h in zip(blocks, headers))):
        offset = segs[0][0]
        if offset // group != g:
            group_done(g, sums)
            sums, g = [None] * len(inputs), offset // group
        for t in range(nt):
            at = b.add(x_at, ir.Constant(I64, offset))
            if rows["x16"]:
                xv = load(b, rows["xq"][t], b.mul(at, ir.Constant(I64, 2)), V32I16)
            else:
                xv = b.sext(load(b, rows["xq"][t], at, V32I8), V32I16)
            for r in range(nr):
                prod = madd_pairs(b, segs[r][1], xv)
                i = r * nt + t
                sums[i] = prod if sums[i] is None else b.add(sums[i], prod)
    group_done(g, sums)
    return new


def _reduce(b, p: Packed, w: int) -> dict:
    """input -> float: the sum of its ``w`` partials in ggml's order (butterflies pairing partial
    j with j ^ 4, j ^ 2, j ^ 1: hsum_float_8 = ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)) for w = 8,
    (m0+m2)+(m1+m3) for w = 4)."""
    out = {}
    for v, labels in zip(p.vecs, p.labels):
        m = w // 2
        while m:
            i0 = labels[0][0]
            d = labels.index((i0, m)) ^ labels.index((i0, 0))
            assert all(labels[lane ^ d] == (i, part ^ m) for lane, (i, part) in enumerate(labels))
            v = b.fadd(v, shuffle(b, v, [lane ^ d for lane in range(LANES)]))
            labels = [(i, part & ~m) for i, part in labels]
            m //= 2
        for lane, (i, _) in enumerate(labels):
            if i not in out:
                out[i] = b.extract_element(v, ir.Constant(I32, lane))
    return out


def build_tile(module: ir.Module, fmt: BlockFormat, path: int, nr: int, nt: int, name: str,
               x16: bool = True) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)``.

    Pointers are i8* to the tile's first row (out: float*); strides in bytes (out: in floats);
    activation quants are int16 (``x16``) or int8. For r < nr, t < nt: out[t*out_stride + r*out_r_stride] =
    llama.cpp's ``path`` result for weight row r and activation row t over nb >= 1 blocks.
    """
    layout = _accumulators(fmt, path, nr * nt)
    zero = ir.Constant(V16F32, [0.0] * LANES)

    def body(b, rows, blk, accs):
        return _emit_block(b, fmt, path, dict(rows, x16=x16), blk, accs)

    def finish(b, new):
        res = {k: _reduce(b, Packed(new[k], labels), w) for k, (labels, w) in layout.items()}
        values = {}
        for i in range(nr * nt):
            if path in (GEMV, GEMM):
                value = b.fsub(res["acc"][i], res["accm"][i]) if "accm" in res else res["acc"][i]
            else:
                value = res["lanes" if path == VEC_DOT else "acc"][i]
                for extra in ("mins", "sum"):
                    if extra in res:
                        value = b.fadd(value, res[extra][i])
            values[divmod(i, nt)] = value
        return values

    return tile_function(module, name, nr, nt, {k: [zero] * len(labels) for k, (labels, _) in layout.items()},
                         body, finish, fmt.block_bytes)
