"""llama.cpp's side of ``edge bench --vs-llama-cpp``: a child process driven over stdin/stdout.

Runs under any interpreter that has llama-cpp-python (``--llama-python``); it imports only the
standard library, numpy and llama_cpp, never edge. Started as

    PYTHON bench_llama_cpp.py '{"model": PATH, "n_ctx": 4096, "threads": 2, "n_batch": 512,
                                "type_k": "f16", "type_v": "f16", "first_ids": [...]}'

it loads the model through llama.cpp's C API (llama_model_load_from_file, llama_init_from_model
with flash attention off, as the goldens were made), decodes ``first_ids`` and takes the greedy
token, then writes one JSON line: {"load_to_first_token_s": s, "version": llama_cpp.__version__}
(or {"error": msg}, also when llama_cpp cannot be imported, and exits 1).
After that it answers one JSON request per stdin line with one JSON line on stdout; each
request mirrors a method of edge.bench.EdgeRunner (same arguments, same results):

    {"op": "pp", "ids": [...]}               -> {"s": seconds, "n_tokens": positions filled}
    {"op": "tg", "ids": [...], "n": N}       -> {"s": seconds, "tokens": [N greedy ids]}
    {"op": "batched", "prompts": [[...]...], "n": N, "n_ctx_seq": C}
                                             -> {"s": seconds, "tokens": [[N ids] per sequence]}
    {"op": "rss"}                            -> {"peak_rss_mb": MB}
    {"op": "quit"}

Times are time.perf_counter seconds of the llama_decode calls and the greedy picks only.
"""
from __future__ import annotations

import ctypes
import json
import resource
import sys
import time

try:
    import numpy as np
    import llama_cpp as ll
except ImportError as e:  # reported to the parent as the first line
    ll, IMPORT_ERROR = None, f"{type(e).__name__}: {e}"


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (ru_maxrss: kB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss * 1024 / 1e6


GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type ids of the KV cache types


class LlamaBench:
    """One model with a single-sequence context (n_ctx) and, on demand, a B-sequence one;
    KV cache types type_k/type_v ("f16", "f32", "q8_0")."""

    def __init__(self, model: str, n_ctx: int, threads: int, n_batch: int, type_k: str, type_v: str):
        self._quiet = ll.llama_log_callback(lambda level, text, user_data: None)  # stdout is the protocol
        ll.llama_log_set(self._quiet, ctypes.c_void_p(0))
        ll.llama_backend_init()
        self.threads, self.n_batch = threads, n_batch
        self.type_k, self.type_v = GGML_TYPES[type_k], GGML_TYPES[type_v]
        self.model = ll.llama_model_load_from_file(model.encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.ctx = self._context(n_ctx, 1)
        self.multi = None  # (n_seq, n_ctx_seq, ctx) of the last batched request
        self.batch, self.batch_rows = None, 0

    def _context(self, n_ctx: int, n_seq: int):
        p = ll.llama_context_default_params()
        rows = max(self.n_batch, n_seq)
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, rows, rows, n_seq
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k, p.type_v = self.type_k, self.type_v
        p.kv_unified = False
        p.no_perf = True
        ctx = ll.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx {n_ctx}, n_seq_max {n_seq}; "
                               "a quantized V cache needs flash attention, which this benchmark keeps off)")
        return ctx

    def _decode(self, ctx, tokens, positions, seqs, want_logits) -> None:
        """One llama_decode of len(tokens) rows; logits for the rows where want_logits."""
        if len(tokens) > self.batch_rows:
            if self.batch is not None:
                ll.llama_batch_free(self.batch)
            self.batch_rows = max(len(tokens), self.n_batch)
            self.batch = ll.llama_batch_init(self.batch_rows, 0, 1)
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s, w) in enumerate(zip(tokens, positions, seqs, want_logits)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = t, p, 1, s, w
        rc = ll.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, ctx, rows: int) -> np.ndarray:
        """f32[rows, n_vocab]: the logits of the rows that asked for them, in batch order."""
        return np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(rows, self.n_vocab))

    def _prefill(self, ctx, ids, seq: int = 0) -> int:
        """Decode ``ids`` in chunks of n_batch into the empty sequence ``seq``; returns the greedy token."""
        for i in range(0, len(ids), self.n_batch):
            chunk = ids[i : i + self.n_batch]
            last = i + len(chunk) == len(ids)
            self._decode(ctx, chunk, range(i, i + len(chunk)), [seq] * len(chunk),
                         [last and j == len(chunk) - 1 for j in range(len(chunk))])
        return int(np.argmax(self._logits(ctx, 1)[0]))

    def _clear(self, ctx) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)

    def first_token(self, ids) -> int:
        return self._prefill(self.ctx, ids)

    def pp(self, ids) -> dict:
        self._clear(self.ctx)
        t0 = time.perf_counter()
        self._prefill(self.ctx, ids)
        s = time.perf_counter() - t0
        n = ll.llama_memory_seq_pos_max(ll.llama_get_memory(self.ctx), 0) + 1
        return {"s": s, "n_tokens": int(n)}

    def tg(self, ids, n: int) -> dict:
        self._clear(self.ctx)
        tok = self._prefill(self.ctx, ids)
        out = []
        t0 = time.perf_counter()
        for k in range(n):
            self._decode(self.ctx, [tok], [len(ids) + k], [0], [True])
            tok = int(np.argmax(self._logits(self.ctx, 1)[0]))
            out.append(tok)
        return {"s": time.perf_counter() - t0, "tokens": out}

    def rss(self) -> dict:
        return {"peak_rss_mb": peak_rss_mb()}

    def batched(self, prompts, n: int, n_ctx_seq: int) -> dict:
        B = len(prompts)
        if self.multi is None or self.multi[:2] != (B, n_ctx_seq):
            if self.multi is not None:
                ll.llama_free(self.multi[2])
            self.multi = (B, n_ctx_seq, self._context(B * n_ctx_seq, B))
        ctx = self.multi[2]
        self._clear(ctx)
        toks = [self._prefill(ctx, p, s) for s, p in enumerate(prompts)]
        pos = [len(p) for p in prompts]
        out = [[] for _ in range(B)]
        t0 = time.perf_counter()
        for k in range(n):
            self._decode(ctx, toks, [q + k for q in pos], range(B), [True] * B)
            toks = [int(t) for t in np.argmax(self._logits(ctx, B), axis=1)]
            for s in range(B):
                out[s].append(toks[s])
        return {"s": time.perf_counter() - t0, "tokens": out}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = sys.stdout
    if ll is None:
        print(json.dumps({"error": f"cannot import llama_cpp ({IMPORT_ERROR}); install llama-cpp-python "
                                    "(pip install -e '.[bench]' in edge's checkout) or pass --llama-python PYTHON"}),
              file=out, flush=True)
        return 1
    try:
        t0 = time.perf_counter()
        bench = LlamaBench(cfg["model"], cfg["n_ctx"], cfg["threads"], cfg["n_batch"], cfg["type_k"], cfg["type_v"])
        bench.first_token(cfg["first_ids"])
        hello = {"load_to_first_token_s": time.perf_counter() - t0, "version": ll.__version__}
    except (RuntimeError, OSError, ValueError) as e:
        print(json.dumps({"error": str(e)}), file=out, flush=True)
        return 1
    print(json.dumps(hello), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        if op == "quit":
            break
        try:
            res = getattr(bench, op)(**req)
        except RuntimeError as e:
            res = {"error": str(e)}
        print(json.dumps(res), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
