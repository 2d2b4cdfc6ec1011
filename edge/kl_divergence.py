"""KL divergence of a model from a base model's saved log-probs, as llama-perplexity
``--kl-divergence`` (llama.cpp tools/perplexity/perplexity.cpp: kl_divergence(),
log_softmax(n_vocab, logits, base_log_prob, tok, kld)).

The base run (``edge perplexity --kl-divergence-base FILE``, edge.perplexity) saves the text's
tokens and, per scored position, the base model's 16-bit log-probs (edge.logits_file). This run
evaluates the same chunks (BOS first, second half scored) with the model under test and compares
its distribution Q with the base's P at every scored position:
KLD = sum over tokens with log P > -16 of P * (log P - log Q); same top = both argmaxes equal;
dp = Q(next token) - P(next token). Per-position values are computed in float32 as llama.cpp does
(sums of vocabulary terms in double), the statistics in double.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from edge.logits_file import BaseLogits, LogitsFileError, dequantize_log_probs
from edge.perplexity import chunk_logits

_ROWS = 16   # positions compared at once: bounds the float temporaries (16 x n_vocab)
F32 = np.float32


def position_stats(logits: np.ndarray, records: np.ndarray, targets: np.ndarray):
    """Per-position comparison of logits f32[N, n_vocab] (model Q) with base records
    uint16[N, nv] (edge.logits_file) for next tokens int[N].

    Returns (nll f32[N], nll_base f32[N], kld f64[N], p_diff f32[N], same_top bool[N]):
    nll = max + lse - l[tok] and nll_base = -log P[tok] in nats; kld in nats; p_diff =
    exp(-nll) - exp(-nll_base); same_top = first argmax of the logits == first argmax of log P.
    """
    logits = np.asarray(logits, dtype=F32)
    n, n_vocab = logits.shape
    out = (np.empty(n, F32), np.empty(n, F32), np.empty(n, np.float64), np.empty(n, F32), np.empty(n, bool))
    for r in range(0, n, _ROWS):
        rows = slice(r, min(r + _ROWS, n))
        x = logits[rows]
        tok = np.asarray(targets[rows], dtype=np.int64)
        at = np.arange(len(tok))
        imax = x.argmax(axis=1)
        top = x[at, imax]
        lse = np.log(np.exp(x - top[:, None]).sum(axis=1, dtype=np.float64)).astype(F32)
        m = top + lse                                   # log of the softmax denominator
        nll = m - x[at, tok]
        logp = dequantize_log_probs(records[rows], n_vocab)
        nll_base = -logp[at, tok]
        terms = np.where(logp > F32(-16), np.exp(logp) * ((logp - x) + m[:, None]), F32(0))
        out[0][rows], out[1][rows] = nll, nll_base
        out[2][rows] = terms.sum(axis=1, dtype=np.float64)
        out[3][rows] = np.exp(-nll) - np.exp(-nll_base)
        out[4][rows] = imax == logp.argmax(axis=1)
    return out


def _mean_unc(total: float, total2: float, count: int) -> tuple[float, float]:
    """llama-perplexity's mean_and_uncertainty: mean and sqrt(var / (count - 1)) (0 if count <= 10)."""
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def _covariance(sa: float, sb: float, sab: float, count: int) -> float:
    """llama-perplexity's covariance of two means (0 if count < 10)."""
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


def _percentile(v: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile of sorted f32 values: linear between neighbours, in float32."""
    f = F32(fraction)
    p = F32(f * F32(len(v) - 1))
    ip = int(p)
    p = F32(p - F32(ip))
    return float(F32((F32(1) - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)]))


def _median(v: np.ndarray) -> float:
    n = len(v)
    return float(v[n // 2]) if n % 2 else float(F32(0.5) * (v[n // 2] + v[n // 2 - 1]))


class KLDivergenceResult:
    """Per-position values of a --kl-divergence run and llama-perplexity's statistics of them.

    Arrays (all positions so far): nll, nll_base, p_diff f32[N], kld f64[N], same_top bool[N].
    """

    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx
        self.n_chunks = 0
        self._parts: list[tuple] = []

    def add(self, stats: tuple) -> None:
        """Appends one chunk's :func:`position_stats`."""
        self._parts.append(stats)
        self.n_chunks += 1

    def _col(self, i: int) -> np.ndarray:
        return np.concatenate([p[i] for p in self._parts])

    nll = property(lambda self: self._col(0))
    nll_base = property(lambda self: self._col(1))
    kld = property(lambda self: self._col(2))
    p_diff = property(lambda self: self._col(3))
    same_top = property(lambda self: self._col(4))

    @property
    def count(self) -> int:
        return sum(len(p[0]) for p in self._parts)

    def summary(self) -> dict[str, tuple[float, float]]:
        """name -> (value, uncertainty) of llama-perplexity's means: ppl, ppl_base, ln_ppl_ratio,
        ppl_ratio, ppl_diff, cor (correlation of ln PPLs), kld, p_diff, p_diff_rms, same_top
        (fractions, not %)."""
        n = self.count
        nll, nll_b = self.nll.astype(np.float64), self.nll_base.astype(np.float64)
        nll32, nllb32 = self.nll, self.nll_base
        kld, pd = self.kld, self.p_diff
        pd2 = (pd * pd).astype(np.float64)
        lp = _mean_unc(nll.sum(), (nll32 * nll32).astype(np.float64).sum(), n)
        lb = _mean_unc(nll_b.sum(), (nllb32 * nllb32).astype(np.float64).sum(), n)
        cov = _covariance(nll.sum(), nll_b.sum(), (nll32 * nllb32).astype(np.float64).sum(), n)
        ratio_unc = math.sqrt(max(lp[1] ** 2 + lb[1] ** 2 - 2 * cov, 0.0))
        ppl, ppl_b = math.exp(lp[0]), math.exp(lb[0])
        mse = _mean_unc(pd2.sum(), (pd2 * pd2).sum(), n)
        rms = math.sqrt(mse[0])
        same = float(self.same_top.sum()) / n
        return {
            "ppl": (ppl, ppl * lp[1]),
            "ppl_base": (ppl_b, ppl_b * lb[1]),
            "cor": (cov / (lp[1] * lb[1]) if lp[1] * lb[1] > 0 else 0.0, 0.0),
            "ln_ppl_ratio": (lp[0] - lb[0], ratio_unc),
            "ppl_ratio": (math.exp(lp[0] - lb[0]), math.exp(lp[0] - lb[0]) * ratio_unc),
            "ppl_diff": (ppl - ppl_b, math.sqrt(max((ppl * lp[1]) ** 2 + (ppl_b * lb[1]) ** 2
                                                    - 2 * ppl * ppl_b * cov, 0.0))),
            "kld": _mean_unc(kld.sum(), (kld * kld).sum(), n),
            "p_diff": _mean_unc(pd.astype(np.float64).sum(), pd2.sum(), n),
            "p_diff_rms": (rms, 0.5 / rms * mse[1] if rms > 0 else 0.0),
            "same_top": (same, math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0),
        }

    def chunk_line(self) -> str:
        """The running line llama-perplexity prints after each chunk (chunk, PPL, ln ratio, KLD,
        dp RMS %, same top %)."""
        s = self.summary()
        return (f"{self.n_chunks:4d}    {s['ppl'][0]:9.4f} ± {s['ppl'][1]:9.4f}"
                f"    {s['ln_ppl_ratio'][0]:10.5f} ± {s['ln_ppl_ratio'][1]:10.5f}"
                f"    {s['kld'][0]:10.5f} ± {s['kld'][1]:10.5f}"
                f"    {100 * s['p_diff_rms'][0]:6.3f} ± {100 * s['p_diff_rms'][1]:6.3f} %"
                f"    {100 * s['same_top'][0]:6.3f} ± {100 * s['same_top'][1]:6.3f} %")

    def kld_percentiles(self) -> list[tuple[str, float]]:
        """(label, value) of Maximum, 99.9% .. 0.1%, Minimum of the per-position KLD (float32, as
        llama-perplexity's kld_values)."""
        return _percentile_rows(np.sort(self.kld.astype(F32)), (0.999, 0.99, 0.95, 0.90, None, 0.10, 0.05,
                                                                0.01, 0.001))

    def p_diff_percentiles(self) -> list[tuple[str, float]]:
        """(label, value) of Maximum, 99.9% .. 0.1%, Minimum of dp (fractions)."""
        return _percentile_rows(np.sort(self.p_diff), (0.999, 0.99, 0.95, 0.90, 0.75, None, 0.25, 0.10, 0.05,
                                                       0.01, 0.001))

    def report_lines(self) -> list[str]:
        """llama-perplexity's final statistics; empty below 100 positions, as llama-perplexity."""
        if self.count < 100:
            return []
        s = self.summary()
        lines = ["====== Perplexity statistics ======"]
        for label, key in (("Mean PPL(Q)                   ", "ppl"), ("Mean PPL(base)                ", "ppl_base")):
            lines.append(f"{label}: {s[key][0]:10.6f} ± {s[key][1]:10.6f}")
        lines.append(f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor'][0]:6.2f}%")
        for label, key in (("Mean ln(PPL(Q)/PPL(base))     ", "ln_ppl_ratio"),
                           ("Mean PPL(Q)/PPL(base)         ", "ppl_ratio"),
                           ("Mean PPL(Q)-PPL(base)         ", "ppl_diff")):
            lines.append(f"{label}: {s[key][0]:10.6f} ± {s[key][1]:10.6f}")
        lines += ["", "====== KL divergence statistics ======",
                  f"Mean    KLD: {s['kld'][0]:10.6f} ± {s['kld'][1]:10.6f}"]
        lines += [f"{label:<7} KLD: {v:10.6f}" for label, v in self.kld_percentiles()]
        lines += ["", "====== Token probability statistics ======",
                  f"Mean    Δp: {100 * s['p_diff'][0]:6.3f} ± {100 * s['p_diff'][1]:5.3f} %"]
        lines += [f"{label:<7} Δp: {100 * v:6.3f}%" for label, v in self.p_diff_percentiles()]
        lines += [f"RMS Δp    : {100 * s['p_diff_rms'][0]:6.3f} ± {100 * s['p_diff_rms'][1]:5.3f} %",
                  f"Same top p: {100 * s['same_top'][0]:6.3f} ± {100 * s['same_top'][1]:5.3f} %"]
        return lines


def _percentile_rows(v: np.ndarray, fractions) -> list[tuple[str, float]]:
    """Maximum, the given percentiles (None = the median), Minimum of sorted f32 values."""
    rows = [("Maximum", float(v[-1]))]
    for f in fractions:
        rows.append(("Median", _median(v)) if f is None else (f"{100 * f:4.1f}%", _percentile(v, f)))
    return rows + [("Minimum", float(v[0]))]


def kl_divergence(engine, base: BaseLogits, max_chunks: int = -1,
                  on_chunk: Callable[[KLDivergenceResult], None] | None = None) -> KLDivergenceResult:
    """Compares ``engine``'s model with the base log-probs of ``base`` on the file's own tokens.

    Chunks of base.n_ctx tokens are evaluated as in edge.perplexity.chunk_logits; each chunk's
    logits are compared with its records and dropped (memory: one chunk of logits).
    ``on_chunk(result)`` is called after each chunk. Raises LogitsFileError when the model's
    vocabulary size differs from the file's n_vocab or a record is damaged.
    """
    n_vocab = engine.model.args.n_vocab
    if base.n_vocab != n_vocab:
        raise LogitsFileError(f"{base.path} holds log-probs over {base.n_vocab} tokens but the model has a "
                              f"vocabulary of {n_vocab}: it was made with another model family")
    n_ctx, first = base.n_ctx, base.n_ctx // 2
    n_chunks = base.n_chunk if max_chunks <= 0 else min(base.n_chunk, max_chunks)
    result = KLDivergenceResult(n_ctx)
    for c in range(n_chunks):
        chunk = base.tokens[c * n_ctx : (c + 1) * n_ctx].tolist()
        records = base.records(c)
        logits = chunk_logits(engine, chunk)
        result.add(position_stats(logits, records, np.asarray(chunk[first + 1 :])))
        if on_chunk is not None:
            on_chunk(result)
    return result
