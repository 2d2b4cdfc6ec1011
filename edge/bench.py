"""``edge bench``: throughput in the manner of llama-bench, optionally beside llama.cpp.

Tests (each the median of ``reps`` timed repetitions after one short untimed warm-up):

- ``ppN``: prefill of N random token ids (fixed seed; the first is BOS when the model adds
  BOS, as llama-bench does) in chunks of n_batch into an empty paged KV cache of n_ctx tokens
  (edge's own, as ``edge run`` uses; KV types -ctk/-ctv, f16 by default);
  tokens/s = N / seconds. pp and tg run with llama.cpp's choice of kernel per batch size, or
  with ``batch_invariant`` (--batch-invariant) in the mode ``edge serve`` computes in.
- ``tgN``: N greedy tokens decoded one forward pass at a time after the short prompt
  FIRST_PROMPT, through the generation loop (edge.generate, end-of-generation tokens decoded
  on as llama-bench does); tokens/s = N / seconds of those N steps (the prompt and its first
  token are not timed).
- ``tgN copy`` and ``tgN copy ngram`` (``spec``, edge only): N greedy tokens after a prompt
  that asks for text the prompt already holds (the source of one of edge's own modules, then
  its first third again: the model goes on copying), plain and with speculative decoding by
  prompt lookup, both batch-invariant (the tokens are checked equal); tokens/s = N / seconds
  after the first token; the ngram row's RESULT has ``vs_plain`` and ``drafted`` / ``accepted``.
- ``tgN json`` and ``tgN json schema`` (``grammar``, edge only): N greedy tokens after a chat
  prompt asking for a long JSON array (JSON_PROMPT), plain and with the JSON schema
  JSON_SCHEMA enforced by edge.grammar.GrammarMask in the mask stage; tokens/s = N / seconds
  after the first token. The schema row's RESULT has ``vs_plain``, ``mask_ms_per_token`` (the
  mask stage's time per sampled token), ``compile_ms`` (the schema's compile time),
  ``ll_tokenizer_s`` (the vocabulary's llguidance tokenizer, built once per tokenizer) and
  ``eog_only_steps`` (steps after the grammar completed: only end-of-generation tokens allowed).
- ``tgN xB``: B sequences (distinct random prompts of BATCH_PROMPT_LEN ids) decoding together,
  each step one forward pass of B rows (one token per sequence), in batch-invariant mode as
  ``edge serve`` runs its batches (Transformer.set_batch_invariant); tokens/s = B * N / seconds;
  ``vs_1_seq`` divides it by the B = 1 result (by tgN when 1 is not among the B values).
  Each sequence has a KV cache of n_ctx_seq = BATCH_PROMPT_LEN + N rounded up to 256 rows.

Also: peak RSS (getrusage ru_maxrss, mmapped weight pages included) after the pp and tg tests
(KV cache of n_ctx), load-to-first-token (Engine construction, or llama.cpp's model load and
context creation, to the first greedy token of FIRST_PROMPT; the first thing each process does
after its imports), and the wall time of a fresh ``edge run -n 1`` process (interpreter start
to exit), for llama.cpp the child process's start to its first token.

With a llama.cpp interpreter (``--vs-llama-cpp``), edge.bench_llama_cpp runs the same tests
with the same token ids, threads (n_threads and n_threads_batch), n_batch (= n_ubatch) and
n_ctx and KV cache types in a child process; flash attention is off (edge computes attention as llama.cpp does
without it).

JSON (``edge bench --json``), one object:
    model, model_path, model_bytes, threads, n_ctx, n_batch, reps, cache_type_k, cache_type_v, seed
    tensor_types: {GGML type name: tensor count} of the model file, most common first
    tests: list of {test, kind ("pp" | "tg" | "batched" | "spec" | "grammar"), n_seq, n_tokens_asked,
                    edge: RESULT, llama_cpp: RESULT | null, edge_over_llama_cpp: float | null,
                    tokens_equal: whether both engines generated the same greedy tokens (tg and
                    batched, last rep; null for pp and without llama.cpp)}
        RESULT = {tps (median tokens/s), tps_min, tps_max, samples (tokens/s per rep),
                  n_tokens (tokens the engine processed or generated in one rep),
                  vs_1_seq (batched rows only)}
    peak_rss_mb, load_to_first_token_s, process_first_token_wall_s: {edge, llama_cpp}
    kernels: {path (kernels_cpu.simd.kernel_path: "avx512-vnni", "avx2", ...), cpu (numba's target CPU)}
    ceilings: this machine's, measured after the tests (kernels_cpu.ceilings) with the same threads:
        {kernel_path ("avx512-vnni" | "avx512" | "avx-vnni" | "avx2" | "generic" | "neon-i8mm" | "neon-dotprod" | "neon"), features, read_gb_s (memory read
        bandwidth), int8_gmacs (int8 multiply-adds per second, in G), weight_bytes_per_token
        (bytes of weight matrices one token reads: all but token_embd unless it is the output;
        experts counted as n_expert_used / n_expert of theirs), macs_per_token (their
        multiply-adds), macs_per_prompt_token (without the output matrix: prefill computes the
        logits of its last row only)}; each RESULT then has ``ceiling_fraction``, the share of the
        roofline reached: ppN tokens/s x macs_per_prompt_token / int8 throughput; tgN and tgN xB the larger of
        steps/s x weight_bytes_per_token / read bandwidth (a step of B rows reads the weights
        once) and tokens/s x macs_per_token / int8 throughput (attention not counted).
    llama_cpp: null when not asked, else {python, version, error}; error (str | null) says why
        llama.cpp's numbers are missing (not importable, failed test: that test's RESULT is null).
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.gguf_file import GGUFFile, tensor_type_counts

FIRST_PROMPT = "The capital of France is"
BATCH_PROMPT_LEN = 8
SEED = 1234
_LLAMA_CHILD = Path(__file__).with_name("bench_llama_cpp.py")
JSON_PROMPT = "Write a JSON array of 500 made-up people, each with an id, a name, an age and an email."
JSON_SCHEMA = {"type": "array", "minItems": 3, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "age", "email"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": {"type": "string"}}}}


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (ru_maxrss: kB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss * 1024 / 1e6


@dataclass
class BenchConfig:
    """What to measure. Sizes in tokens; batch_sizes are the B values of the batched test."""

    model: Path
    n_prompt: int = 512
    n_gen: int = 128
    n_batch: int = 512
    n_ctx: int = 4096
    batch_sizes: tuple[int, ...] = (1, 4, 8)
    reps: int = 3
    threads: int = 1
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    llama_python: str | None = None   # interpreter with llama-cpp-python; None = edge only
    batch_invariant: bool = False     # Engine.batch_invariant of pp and tg (tgN xB: always on)
    spec: bool = False                # add the tgN copy tests (speculative decoding)
    grammar: bool = False             # add the tgN json tests (constrained decoding)

    def check(self) -> None:
        """Raise ValueError for sizes that cannot be run."""
        for name, v in (("n_batch", self.n_batch), ("n_ctx", self.n_ctx), ("reps", self.reps)):
            if v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        for name, v in (("n_prompt", self.n_prompt), ("n_gen", self.n_gen)):
            if v < 0:
                raise ValueError(f"{name} must be at least 0 (0 skips its test), got {v}")
        if self.n_prompt == 0 and self.n_gen == 0:
            raise ValueError("-p 0 and -n 0 leave no test to run")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be at least 1, got {list(self.batch_sizes)}")
        if self.n_gen and max(self.batch_sizes) > self.n_batch:
            raise ValueError(f"-B {max(self.batch_sizes)} exceeds -b/--batch-size {self.n_batch}: a step of B "
                             "sequences is one batch of B rows (raise -b or lower -B)")
        if self.n_prompt > self.n_ctx:
            raise ValueError(f"-p {self.n_prompt} does not fit the context size -c {self.n_ctx}")
        if 32 + self.n_gen > self.n_ctx:
            raise ValueError(f"-n {self.n_gen} plus a short prompt does not fit the context size -c {self.n_ctx}")


class EdgeRunner:
    """edge's side of the benchmark. Constructing it loads the model and times load-to-first-token.

    Every call works in a fresh paged KV cache (edge.kv.cache.PagedKVCache, the engine's own
    block size, KV types and storage; fresh, so no prefix is ever reused), as ``edge run``
    generates. Methods return plain dicts, as the llama.cpp child (edge.bench_llama_cpp) does:
    pp -> {s, n_tokens}; tg -> {s, tokens}; batched -> {s, tokens per sequence}; rss -> {peak_rss_mb}.
    """

    def __init__(self, cfg: BenchConfig):
        from edge.engine import Engine

        t0 = time.perf_counter()
        self.engine = Engine(cfg.model, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch,
                             cache_type_k=cfg.cache_type_k, cache_type_v=cfg.cache_type_v,
                             batch_invariant=cfg.batch_invariant)
        self.batch_invariant = cfg.batch_invariant
        self.model = self.engine.model
        self.first_ids = self.engine.raw_prompt(FIRST_PROMPT)
        self.first_token(self.first_ids)
        self.load_to_first_token_s = time.perf_counter() - t0

    def _kv(self, n_ctx: int, n_seq: int = 1):
        from edge.kv.cache import PagedKVCache

        e = self.engine
        return PagedKVCache(self.model.args, n_ctx, n_seq, e.block_size, e.cache_type_k, e.cache_type_v,
                            storage=e.kv_storage)

    def first_token(self, ids) -> int:
        kv = self._kv(self.engine.n_ctx)
        try:
            slot, _ = kv.new_sequence(ids)
            return int(np.argmax(self.engine.prefill(ids, kv, seq=slot)))
        finally:
            kv.close()

    def pp(self, ids) -> dict:
        kv = self._kv(self.engine.n_ctx)
        try:
            t0 = time.perf_counter()
            slot, _ = kv.new_sequence(ids)
            self.engine.prefill(ids, kv, seq=slot)
            return {"s": time.perf_counter() - t0, "n_tokens": int(kv.pos[slot])}
        finally:
            kv.close()

    def tg(self, ids, n: int) -> dict:
        return self._decode([ids], n, self.engine.n_ctx, single=True)

    def batched(self, prompts, n: int, n_ctx_seq: int) -> dict:
        """B sequences decoding together, as ``edge serve`` runs them: in batch-invariant mode
        (Transformer.set_batch_invariant; a sequence's tokens do not depend on its neighbours)."""
        self.model.set_batch_invariant(True)
        try:
            return self._decode(prompts, n, n_ctx_seq, single=False)
        finally:
            self.model.set_batch_invariant(self.batch_invariant)

    def _decode(self, prompts, n: int, n_ctx: int, single: bool) -> dict:
        """Prefill each prompt into its own slot and sample its first token (untimed), then n
        timed steps of the generation loop, each one forward pass of one token per sequence,
        greedy. ``single``: one sequence, tokens as a flat list."""
        from edge.generate import Limits
        from edge.sampling import SamplingParams

        kv = self._kv(n_ctx, len(prompts))
        try:
            loop = self.engine.loop(kv)
            seqs = [loop.new(p, SamplingParams(temperature=0.0), Limits(n + 1, eog=False)) for p in prompts]
            for seq in seqs:
                loop.admit(seq)
                loop.sample(seq, loop.compute(seq))
            out = np.empty((n, len(seqs)), dtype=np.int64)
            t0 = time.perf_counter()
            for k in range(n):
                out[k] = [sampled.token for sampled in loop.advance(seqs)]
            s = time.perf_counter() - t0
        finally:
            kv.close()
        return {"s": s, "tokens": out[:, 0].tolist() if single else out.T.tolist()}

    def copy(self, ids, n: int, spec: bool) -> dict:
        """N greedy tokens after ``ids`` (the first untimed), batch-invariant, with prompt
        lookup when ``spec``: {s, tokens, drafted, accepted}."""
        from edge.generate import GenerationLoop, Limits
        from edge.sampling import SamplingParams
        from edge.speculative import SpecParams, make_speculator

        e = self.engine
        kv = self._kv(e.n_ctx)
        self.model.set_batch_invariant(True)
        try:
            spec_ = make_speculator(SpecParams("ngram"), e) if spec else None
            loop = GenerationLoop(self.model, kv, e.tokenizer, e.n_batch, e.threads, spec_)
            seq = loop.new(ids, SamplingParams(temperature=0.0), Limits(n + 1, eog=False))
            loop.admit(seq)
            run = loop.run(seq)
            first = next(run)
            t0 = time.perf_counter()
            tokens = [first.token] + [o.token for o in run if o.generated]
            s = time.perf_counter() - t0
            loop.free(seq)
        finally:
            kv.close()
            self.model.set_batch_invariant(self.batch_invariant)
        st = seq.spec
        return {"s": s, "tokens": tokens[1:], "drafted": st.drafted if st else 0, "accepted": st.accepted if st else 0}

    def constrained(self, ids, n: int, schema: bool) -> dict:
        """N greedy tokens after ``ids`` (the first untimed), with JSON_SCHEMA in the mask stage
        when ``schema``: {s, tokens, first (the untimed token)}, and with the schema mask_s (its time over the N timed
        tokens), compile_s, eog_only_steps."""
        from edge.generate import Limits
        from edge.grammar import GrammarMask, json_schema
        from edge.sampling import SamplingParams

        e = self.engine
        kv = self._kv(e.n_ctx)
        try:
            mask = GrammarMask(json_schema(JSON_SCHEMA), e.tokenizer, len(ids)) if schema else None
            loop = e.loop(kv)
            seq = loop.new(ids, SamplingParams(temperature=0.0), Limits(n + 1, eog=False), [mask] if mask else ())
            loop.admit(seq)
            first = loop.sample(seq, loop.compute(seq)).token
            mask_s0 = mask.mask_seconds if mask else 0.0
            eog0 = mask.eog_only_calls if mask else 0
            t0 = time.perf_counter()
            tokens = [loop.advance([seq])[0].token for _ in range(n)]
            s = time.perf_counter() - t0
        finally:
            kv.close()
        out = {"s": s, "tokens": tokens, "first": first}
        if mask is not None:
            out.update(mask_s=mask.mask_seconds - mask_s0, compile_s=mask.compile_seconds,
                       eog_only_steps=mask.eog_only_calls - eog0)
        return out

    def rss(self) -> dict:
        return {"peak_rss_mb": peak_rss_mb()}


def json_prompt(engine) -> list[int]:
    """The tgN json prompt: JSON_PROMPT through the chat template (as is without one)."""
    if engine.template is None:
        return engine.raw_prompt(JSON_PROMPT)
    return engine.chat_prompt([{"role": "user", "content": JSON_PROMPT}])


def copy_prompt(engine, n_gen: int) -> list[int]:
    """The tgN copy prompt: edge.textstream's source, then its first third again (raw, so any
    model continues it), cut to leave n_gen + 16 positions of the context."""
    from edge import textstream

    text = Path(textstream.__file__).read_text(encoding="utf-8")
    ids = engine.raw_prompt(text + "\n\n" + text[: len(text) // 3])
    return ids[-max(16, engine.n_ctx - n_gen - 16):]


class LlamaUnavailable(RuntimeError):
    """llama.cpp's side cannot run (interpreter missing, llama_cpp not importable, load failed)."""


class LlamaRunner:
    """The llama.cpp child process (edge.bench_llama_cpp) behind EdgeRunner's methods.

    Raises LlamaUnavailable from the constructor, RuntimeError from a failed request.
    """

    def __init__(self, python: str, cfg: BenchConfig, first_ids: list[int]):
        import tempfile

        args = {"model": str(cfg.model), "n_ctx": cfg.n_ctx, "threads": cfg.threads,
                "n_batch": cfg.n_batch, "type_k": cfg.cache_type_k, "type_v": cfg.cache_type_v,
                "first_ids": [int(t) for t in first_ids]}
        self._stderr = tempfile.TemporaryFile(mode="w+")
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen([python, str(_LLAMA_CHILD), json.dumps(args)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        except OSError as e:
            raise LlamaUnavailable(f"cannot start {python}: {e}") from None
        try:
            hello = self._read()
        except RuntimeError as e:
            self.close()
            raise LlamaUnavailable(str(e)) from None
        self.process_first_token_wall_s = time.perf_counter() - t0
        self.load_to_first_token_s = hello["load_to_first_token_s"]
        self.version = hello["version"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._stderr.seek(0)
            tail = self._stderr.read().strip().splitlines()[-3:]
            raise RuntimeError(f"the llama.cpp process ended (status {self.proc.returncode}): {' | '.join(tail)}")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(res["error"])
        return res

    def _call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def pp(self, ids) -> dict:
        return self._call("pp", ids=[int(t) for t in ids])

    def tg(self, ids, n: int) -> dict:
        return self._call("tg", ids=[int(t) for t in ids], n=n)

    def batched(self, prompts, n: int, n_ctx_seq: int) -> dict:
        return self._call("batched", prompts=[[int(t) for t in p] for p in prompts], n=n, n_ctx_seq=n_ctx_seq)

    def rss(self) -> dict:
        return self._call("rss")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


def _stats(samples: list[float], n_tokens: int) -> dict:
    return {"tps": statistics.median(samples), "tps_min": min(samples), "tps_max": max(samples),
            "samples": samples, "n_tokens": n_tokens}


def _count(res: dict) -> int:
    """Tokens one result covers: positions filled (pp) or tokens generated over all sequences."""
    if "n_tokens" in res:
        return res["n_tokens"]
    toks = res["tokens"]
    return sum(len(t) for t in toks) if toks and isinstance(toks[0], list) else len(toks)


class _Bench:
    """Runs each test on every runner, recording results into one JSON-ready dict;
    ``last[test][runner name]`` keeps each runner's last raw result."""

    def __init__(self, cfg: BenchConfig, runners: dict, result: dict, log):
        self.cfg, self.runners, self.result, self.log = cfg, runners, result, log
        self.last: dict[str, dict] = {}

    def llama_failed(self, what: str, e: Exception) -> None:
        """Record llama.cpp's first failure; its numbers for ``what`` stay null."""
        self.log(f"llama.cpp: {what} failed: {e}")
        if not self.result["llama_cpp"]["error"]:
            self.result["llama_cpp"]["error"] = f"{what}: {e}"

    def _attempt(self, test: str, name: str, fn) -> bool:
        """fn() for runner ``name``: False (and llama.cpp's failure noted) when llama.cpp's
        runner raised RuntimeError; edge's errors propagate."""
        try:
            fn()
            return True
        except RuntimeError as e:
            if name == "edge":
                raise
            self.llama_failed(test, e)
            return False

    def measure(self, test: str, kind: str, n_seq: int, n_asked: int, warmup, call, only=None) -> dict:
        """Run ``warmup(runner)`` once on every runner (or the runners named in ``only``), then
        ``call(runner)`` reps times on each, the runners taking turns (edge, llama.cpp, edge,
        ...), so that a drift of the machine's speed during the test (other load, clocks, a
        shared host's memory bandwidth) reaches both alike."""
        row = {"test": test, "kind": kind, "n_seq": n_seq, "n_tokens_asked": n_asked,
               "edge": None, "llama_cpp": None, "edge_over_llama_cpp": None, "tokens_equal": None}
        self.last[test] = {}
        runners = {name: runner for name, runner in self.runners.items()
                   if runner is not None and (only is None or name in only)}
        results: dict[str, list] = {}
        for name, runner in list(runners.items()):
            self.log(f"{name}: {test}")
            if self._attempt(test, name, lambda: warmup(runner)):
                results[name] = []
        for _ in range(self.cfg.reps):
            for name in list(results):
                if not self._attempt(test, name, lambda: results[name].append(call(runners[name]))):
                    del results[name]
        for name, rs in results.items():
            self.last[test][name] = rs[-1]
            row[name] = _stats([_count(r) / r["s"] for r in rs], _count(rs[-1]))
            self.log(f"{name}: {test}: {row[name]['tps']:.1f} tokens/s")
        if row["edge"] and row["llama_cpp"]:
            row["edge_over_llama_cpp"] = row["edge"]["tps"] / row["llama_cpp"]["tps"]
            last = self.last[test]
            if "tokens" in last["edge"]:
                row["tokens_equal"] = last["edge"]["tokens"] == last["llama_cpp"]["tokens"]
        self.result["tests"].append(row)
        return row


def _random_ids(rng: np.random.Generator, shape, n_vocab: int, bos: int | None) -> np.ndarray:
    """Token ids uniform in [0, n_vocab) with BOS first in each row when the model adds BOS."""
    ids = rng.integers(0, n_vocab, shape)
    if bos is not None:
        ids[..., 0] = bos
    return ids


def _process_wall(cfg: BenchConfig, log) -> float | None:
    """Wall seconds of a fresh ``edge run -n 1`` (greedy, raw FIRST_PROMPT); None if it failed."""
    cmd = [sys.executable, "-m", "edge.cli", "run", "-m", str(cfg.model), "-n", "1", "--temp", "0", "--raw",
           "-t", str(cfg.threads), "-c", str(cfg.n_ctx), "-b", str(cfg.n_batch),
           "-ctk", cfg.cache_type_k, "-ctv", cfg.cache_type_v, *(["--batch-invariant"] if cfg.batch_invariant else []),
           FIRST_PROMPT]
    t0 = time.perf_counter()
    # no stdin: a piped one would join the prompt
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        log(f"edge: `edge run -n 1` failed (status {proc.returncode}): {proc.stderr.strip()[-300:]}")
        return None
    return time.perf_counter() - t0


def run_bench(cfg: BenchConfig, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """Run every test of ``cfg``; returns the JSON-ready result described in the module docstring.

    Raises ValueError for a bad config, GGUFError for a bad model file. llama.cpp's failures
    do not raise: they leave its numbers null and say why in result["llama_cpp"]["error"].
    """
    cfg.check()
    log(f"edge: fresh process, run -n 1 on {cfg.model.name}")
    wall = _process_wall(cfg, log)
    edge = EdgeRunner(cfg)
    gf = GGUFFile(cfg.model)
    try:
        tensor_types = tensor_type_counts(gf)
    finally:
        gf.close()
    result = {"model": edge.engine.name, "model_path": str(cfg.model), "model_bytes": cfg.model.stat().st_size,
              "tensor_types": tensor_types,
              "threads": cfg.threads, "n_ctx": cfg.n_ctx, "n_batch": cfg.n_batch, "reps": cfg.reps,
              "cache_type_k": cfg.cache_type_k, "cache_type_v": cfg.cache_type_v,
              "batch_invariant": cfg.batch_invariant, "seed": SEED, "tests": [], "kernels": kernels(),
              "peak_rss_mb": {"edge": None, "llama_cpp": None},
              "load_to_first_token_s": {"edge": edge.load_to_first_token_s, "llama_cpp": None},
              "process_first_token_wall_s": {"edge": wall, "llama_cpp": None},
              "llama_cpp": None}
    llama = None
    if cfg.llama_python:
        result["llama_cpp"] = {"python": cfg.llama_python, "version": None, "error": None}
        log(f"llama.cpp: loading {cfg.model.name} with {cfg.llama_python}")
        try:
            llama = LlamaRunner(cfg.llama_python, cfg, edge.first_ids)
            result["load_to_first_token_s"]["llama_cpp"] = llama.load_to_first_token_s
            result["process_first_token_wall_s"]["llama_cpp"] = llama.process_first_token_wall_s
            result["llama_cpp"]["version"] = llama.version
        except LlamaUnavailable as e:
            log(f"llama.cpp: not available, edge only: {e}")
            result["llama_cpp"]["error"] = str(e)
    try:
        _run_tests(cfg, _Bench(cfg, {"edge": edge, "llama_cpp": llama}, result, log), edge)
    finally:
        if llama is not None:
            llama.close()
    log("edge: measuring this machine's ceilings (memory read bandwidth, int8 multiply-adds)")
    result["ceilings"] = measure_ceilings(cfg.threads, edge.model)
    add_ceiling_fractions(result)
    return result


def step_cost(model) -> tuple[int, int]:
    """(weight bytes, multiply-adds) of the matrices one token goes through in ``model``'s forward:
    every Weight but token_embd unless it is the output (a row lookup, not a product), each
    expert tensor as n_expert_used / n_expert of its bytes. (A prefill token skips the output
    matrix: model.output.n_in * n_out of the multiply-adds.)"""
    from edge.models.weights import ExpertWeights, Weight

    used = getattr(model.args, "n_expert_used", 0)
    total_bytes = total_macs = 0.0
    seen = set()
    for owner in [model, *model.blocks]:
        for name, value in vars(owner).items():
            if id(value) in seen or (name == "token_embd" and model.output is not value):
                continue
            seen.add(id(value))
            if isinstance(value, ExpertWeights):
                share = used / len(value.experts)
                total_bytes += share * sum(w.rows.nbytes for w in value.experts)
                total_macs += share * len(value.experts) * value.n_in * value.n_out
            elif isinstance(value, Weight):
                total_bytes += value.rows.nbytes
                total_macs += value.n_in * value.n_out
    return int(total_bytes), int(total_macs)


def kernels() -> dict:
    """The kernel path edge runs here and the CPU numba compiles for: {"path", "cpu"}
    (kernels_cpu.simd.kernel_path, cpu_target)."""
    from kernels_cpu import simd

    return {"path": simd.kernel_path(), "cpu": simd.cpu_target()}


def measure_ceilings(threads: int, model) -> dict:
    """This machine's ceilings (kernels_cpu.ceilings) with ``threads`` threads, and the per-token
    cost of ``model`` (step_cost): the ``ceilings`` entry of run_bench's result."""
    from kernels_cpu import ceilings

    n_bytes, macs = step_cost(model)
    out = model.output
    return {"kernel_path": ceilings.kernel_path(), "features": ceilings.features(),
            "read_gb_s": ceilings.read_bandwidth() / 1e9, "int8_gmacs": ceilings.int8_throughput(threads) / 1e9,
            "weight_bytes_per_token": n_bytes, "macs_per_token": macs,
            "macs_per_prompt_token": macs - out.n_in * out.n_out}


def add_ceiling_fractions(result: dict) -> None:
    """Set RESULT["ceiling_fraction"] of every test and engine from result["ceilings"]."""
    c = result["ceilings"]
    for row in result["tests"]:
        for name in ("edge", "llama_cpp"):
            r = row[name]
            if r is None:
                continue
            compute = r["tps"] * c["macs_per_token"] / (c["int8_gmacs"] * 1e9)
            if row["kind"] == "spec" and row["test"].endswith("ngram"):
                r["ceiling_fraction"] = None   # several tokens per weight pass: no roofline of tokens/s
            elif row["kind"] == "pp":  # logits of the last row only
                r["ceiling_fraction"] = r["tps"] * c["macs_per_prompt_token"] / (c["int8_gmacs"] * 1e9)
            else:
                memory = r["tps"] / row["n_seq"] * c["weight_bytes_per_token"] / (c["read_gb_s"] * 1e9)
                r["ceiling_fraction"] = max(memory, compute)


def _run_tests(cfg: BenchConfig, b: _Bench, edge: EdgeRunner) -> None:
    tok = edge.engine.tokenizer
    bos = tok.bos_id if tok.add_bos else None
    n_vocab = edge.model.args.n_vocab
    rng = np.random.default_rng(SEED)
    pp_ids = _random_ids(rng, max(cfg.n_prompt, 1), n_vocab, bos)   # drawn with -p 0 too: the same batch prompts
    prompts = _random_ids(rng, (max(cfg.batch_sizes), BATCH_PROMPT_LEN), n_vocab, bos)
    first = edge.first_ids
    n = cfg.n_gen

    if cfg.n_prompt:
        b.measure(f"pp{cfg.n_prompt}", "pp", 1, cfg.n_prompt,
                  lambda r: r.pp(pp_ids[: min(cfg.n_prompt, 16)]), lambda r: r.pp(pp_ids))
    if n:
        tg = b.measure(f"tg{n}", "tg", 1, n, lambda r: r.tg(first, 2), lambda r: r.tg(first, n))
    for name, runner in b.runners.items():
        if runner is not None:
            try:
                b.result["peak_rss_mb"][name] = runner.rss()["peak_rss_mb"]
            except RuntimeError as e:
                b.llama_failed("rss", e)
    if not n:
        return
    if cfg.spec:
        ids = copy_prompt(edge.engine, n)
        plain = b.measure(f"tg{n} copy", "spec", 1, n, lambda r: r.copy(ids, 2, False),
                          lambda r: r.copy(ids, n, False), only=("edge",))
        spec = b.measure(f"tg{n} copy ngram", "spec", 1, n, lambda r: r.copy(ids, 2, True),
                         lambda r: r.copy(ids, n, True), only=("edge",))
        last = b.last[spec["test"]]["edge"]
        if last["tokens"] != b.last[plain["test"]]["edge"]["tokens"]:
            raise RuntimeError("speculative decoding gave other tokens than plain decoding (a bug)")
        spec["edge"].update(vs_plain=spec["edge"]["tps"] / plain["edge"]["tps"], drafted=last["drafted"],
                            accepted=last["accepted"])
    if cfg.grammar:
        from edge.grammar import ll_build_seconds, ll_tokenizer

        ids = json_prompt(edge.engine)
        plain = b.measure(f"tg{n} json", "grammar", 1, n, lambda r: r.constrained(ids, 2, False),
                          lambda r: r.constrained(ids, n, False), only=("edge",))
        t0 = time.perf_counter()
        ll_tokenizer(edge.engine.tokenizer)           # built once per tokenizer: timed here, not in the rows
        ll_s = ll_build_seconds.get(edge.engine.tokenizer.n_vocab, time.perf_counter() - t0)
        masked = b.measure(f"tg{n} json schema", "grammar", 1, n, lambda r: r.constrained(ids, 2, True),
                           lambda r: r.constrained(ids, n, True), only=("edge",))
        last = b.last[masked["test"]]["edge"]
        masked["edge"].update(vs_plain=masked["edge"]["tps"] / plain["edge"]["tps"],
                              mask_ms_per_token=1000 * last["mask_s"] / n, compile_ms=1000 * last["compile_s"],
                              ll_tokenizer_s=ll_s, eog_only_steps=last["eog_only_steps"])
    n_ctx_seq = -(-(BATCH_PROMPT_LEN + n) // 256) * 256
    rows = {}
    for B in cfg.batch_sizes:
        ps = prompts[:B]
        rows[B] = b.measure(f"tg{n} x{B}", "batched", B, B * n, lambda r: r.batched(ps, 2, n_ctx_seq),
                            lambda r: r.batched(ps, n, n_ctx_seq))
    ref = rows.get(1, tg)
    for row in rows.values():
        for name in ("edge", "llama_cpp"):
            if row[name] and ref[name]:
                row[name]["vs_1_seq"] = row[name]["tps"] / ref[name]["tps"]
