"""Seeded fuzzing of model files: every metadata field, broken, through ``edge run``.

A model file is untrusted input (a download), so whatever its metadata says, ``edge run -m
FILE -n 2`` (``--raw`` on the real headers, whose chat prompt would cost a prefill of tens of
tokens) must answer normally (exit 0) or with exit 1 and one ``error:`` line from a
GGUFError naming the key (or a chat template's or the sampler's own error), within 2 s of
CPU and 1 GiB of peak RSS: never a signal, a traceback, a hang or a memory blow-up.
tests/fuzz_worker.py runs the cases in a worker process watched by the test (deadline, RSS
ceiling, death by signal) and checks that contract.

Cases: for each file, every metadata key it has and every key its architecture reads
(llama, qwen2, gemma3: :data:`ARCH_KEYS`; the tokenizer's: :data:`OTHER_KEYS`) when absent,
each set in turn to the values of :func:`mutations`: 0, 1, -1, 2^31, 2^32-1, 2^63-1, 10^9,
the value -1, +1 and doubled, a value of the wrong type (float for an integer, a string, an
array), other strings, shortened and lengthened arrays, and the key removed. Files: tiny
random models of the three architectures (tests/tiny_models.py), and the headers of the real
gemma-3-270m and qwen2.5-coder-0.5b over a sparse data section (nothing written, so a case
costs no disk), which only the slow test uses.

CI mode (default): every single mutation of the tiny models, and a seeded sample of
:data:`REAL_SAMPLE` per real header. Long mode, by hand: ``EDGE_FUZZ_LONG=1`` runs every single
mutation of the real headers too, plus ``EDGE_FUZZ_RANDOM`` (default 1000) random cases of 2
to 4 mutations at once on random files, seeded by ``EDGE_FUZZ_SEED`` (default 0). Each test
prints the number of cases, their outcomes and the worst CPU time, wall time and peak RSS.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from tests.fuzz_worker import Worker
from tests.gguf_mutate import Header
from tests.tiny_models import write_tiny_model

LONG = os.environ.get("EDGE_FUZZ_LONG") == "1"
SEED = int(os.environ.get("EDGE_FUZZ_SEED", "0"))
N_RANDOM = int(os.environ.get("EDGE_FUZZ_RANDOM", "1000"))
REAL_SAMPLE = 12
WARM_UP_CPU_LIMIT = 900.0   # CPU seconds of an unchanged model's first run: a fresh checkout compiles its kernels

_COMMON = {"block_count": "int", "context_length": "int", "embedding_length": "int", "feed_forward_length": "int",
           "attention.head_count": "int", "attention.head_count_kv": "int", "attention.key_length": "int",
           "attention.value_length": "int", "attention.layer_norm_rms_epsilon": "float", "rope.freq_base": "float",
           "rope.dimension_count": "int", "rope.scaling.type": "str", "rope.scaling.factor": "float"}
ARCH_KEYS = {"llama": _COMMON, "qwen2": _COMMON,
             "gemma3": {**_COMMON, "attention.sliding_window": "int", "attention.sliding_window_pattern": "int",
                        "rope.freq_base_swa": "float", "final_logit_softcapping": "float"}}
OTHER_KEYS = {"general.architecture": "str", "general.name": "str", "general.alignment": "int",
              "tokenizer.ggml.model": "str", "tokenizer.ggml.pre": "str", "tokenizer.ggml.tokens": "array",
              "tokenizer.ggml.scores": "array", "tokenizer.ggml.token_type": "array",
              "tokenizer.ggml.merges": "array", "tokenizer.ggml.bos_token_id": "int",
              "tokenizer.ggml.eos_token_id": "int", "tokenizer.ggml.unknown_token_id": "int",
              "tokenizer.ggml.padding_token_id": "int", "tokenizer.ggml.eot_token_id": "int",
              "tokenizer.ggml.add_bos_token": "bool", "tokenizer.ggml.add_eos_token": "bool",
              "tokenizer.ggml.add_space_prefix": "bool", "tokenizer.chat_template": "str"}
OTHER_STRINGS = {"general.architecture": ["llama", "qwen2", "gemma3", "mamba"],
                 "tokenizer.ggml.model": ["llama", "gpt2", "bert"],
                 "tokenizer.ggml.pre": ["default", "qwen2", "llama-bpe", "no-such-pre"],
                 "rope.scaling.type": ["none", "linear", "yarn"],
                 "tokenizer.chat_template": ["{{ messages[0]['content'] }}", "{% for %}",
                                             "{{ raise_exception('no') }}"]}
_INT_TYPES = {VT.UINT8: (0, 2**8 - 1), VT.INT8: (-2**7, 2**7 - 1), VT.UINT16: (0, 2**16 - 1),
              VT.INT16: (-2**15, 2**15 - 1), VT.UINT32: (0, 2**32 - 1), VT.INT32: (-2**31, 2**31 - 1),
              VT.UINT64: (0, 2**64 - 1), VT.INT64: (-2**63, 2**63 - 1)}
_FLOAT_TYPES = (VT.FLOAT32, VT.FLOAT64)


def _int(v: int, vtype: VT = VT.UINT32):
    """(type, None, v) in ``vtype`` if it holds v, else in the 64-bit type that does."""
    lo, hi = _INT_TYPES[vtype]
    return (vtype if lo <= v <= hi else VT.INT64 if v < 0 else VT.UINT64), None, v


def _kind(field) -> str:
    vtype = field[0]
    if vtype in _INT_TYPES:
        return "int"
    return {VT.FLOAT32: "float", VT.FLOAT64: "float", VT.STRING: "str", VT.BOOL: "bool"}.get(vtype, "array")


def mutations(key: str, field, kind: str) -> list[tuple[str, object]]:
    """(label, new field or None to remove) for one key; ``field`` is its (value_type,
    array_type, value) in the file, or None when absent."""
    v = None if field is None else field[2]
    out: list[tuple[str, object]] = []
    if kind == "int":
        native = field[0] if field is not None else VT.UINT32
        values = [0, 1, -1, 2**31, 2**32 - 1, 2**63 - 1, 10**9]
        if v is not None:
            values += [v - 1, v + 1, 2 * v]
        out += [(f"= {x}", _int(x, native)) for x in dict.fromkeys(values)]
        x = 1 if v is None else v
        out += [("float", (VT.FLOAT32, None, float(x))), ("string", (VT.STRING, None, str(x))),
                ("array", (VT.ARRAY, VT.INT32, np.array([x], np.int64))), ("bool", (VT.BOOL, None, True))]
    elif kind == "float":
        values = [0.0, 1.0, -1.0, 1e9, 3.4e38, math.inf, -math.inf, math.nan]
        if v is not None:
            values += [v * 2, v - 1, v + 1]
        out += [(f"= {x!r}", (VT.FLOAT32, None, x)) for x in values]
        x = 1.0 if v is None else float(v)
        as_int = int(min(max(x, 0), 10**9)) if math.isfinite(x) else 1
        out += [("float64", (VT.FLOAT64, None, x)), ("int", (VT.UINT32, None, as_int)),
                ("string", (VT.STRING, None, repr(x))), ("array", (VT.ARRAY, VT.FLOAT32, np.array([x])))]
    elif kind == "str":
        s = "" if v is None else v
        alts = OTHER_STRINGS.get(key, OTHER_STRINGS.get(key.split(".", 1)[-1], []))
        out += [(f"= {x!r}", (VT.STRING, None, x)) for x in dict.fromkeys(["", "x", s + "x", *alts]) if x != s]
        out += [("int", (VT.UINT32, None, 1)), ("array", (VT.ARRAY, VT.STRING, [s]))]
    elif kind == "bool":
        out += [(f"= {not v}", (VT.BOOL, None, not v)), ("int", (VT.UINT32, None, 2)),
                ("string", (VT.STRING, None, "true"))]
    elif kind == "array" and field is not None and field[1] != VT.ARRAY:
        atype, arr = field[1], field[2]
        n = len(arr)
        as_list = list(arr) if atype == VT.STRING else np.asarray(arr)
        first = as_list[:1]
        out += [("one short", (VT.ARRAY, atype, as_list[:-1])), ("empty", (VT.ARRAY, atype, as_list[:0])),
                ("one more", (VT.ARRAY, atype, (list(as_list) + [f"<extra{n}>"]) if atype == VT.STRING
                              else np.concatenate([as_list, as_list[:1]]))),
                ("scalar", (VT.UINT32, None, n)),
                ("elements int32", (VT.ARRAY, VT.INT32, np.zeros(n, np.int32))),
                ("elements float32", (VT.ARRAY, VT.FLOAT32, np.zeros(n, np.float32))),
                ("elements string", (VT.ARRAY, VT.STRING, [str(x) for x in first] * n))]
    elif kind == "array":
        out += [("string", (VT.STRING, None, "x"))]
    if field is not None:
        out.append(("removed", None))
    return out


def single_cases(header: Header) -> list[tuple[str, dict]]:
    """(label, changes) for every key of the file and every key its architecture reads."""
    arch = header.fields["general.architecture"][2]
    keys = {f"{arch}.{k}": kind for k, kind in ARCH_KEYS.get(arch, {}).items()} | OTHER_KEYS
    keys |= {k: _kind(f) for k, f in header.fields.items() if k not in keys}
    cases = []
    for key, kind in keys.items():
        field = header.fields.get(key)
        if field is not None and kind != _kind(field) and not (kind == "float" and field[0] in _INT_TYPES):
            kind = _kind(field)
        cases += [(f"{key} {label}", {key: new}) for label, new in mutations(key, field, kind)]
    return cases


class Fuzz:
    """Runs cases through one worker, writing each mutated file anew; tallies the outcomes."""

    def __init__(self, tmp: Path):
        self.tmp, self.worker, self.n = tmp, Worker(), 0
        self.outcomes: Counter = Counter()
        self.problems: list[str] = []
        self.worst = {"cpu": (0.0, ""), "wall": (0.0, ""), "peak_rss": (0, "")}

    def _run(self, header: Header, changes: dict, sparse: bool, cpu_limit: float | None = None):
        path = header.write(self.tmp / f"case{self.n}.gguf", changes, sparse=sparse)
        try:
            # a real header's chat prompt would cost a prefill of tens of tokens: raw there
            raw = ["--raw"] if sparse else []
            return self.worker.run(["run", "-m", path, "-n", "2", "-c", "512", "-t", "1", *raw, "Hi <t1>"],
                                   cpu_limit)
        finally:
            os.unlink(path)

    def warm_up(self, headers: dict[str, Header], sparse: set) -> None:
        """Each file unchanged (must answer), outside the counts and budgets: a worker's first
        run of a model loads (in a fresh checkout: compiles) numba's kernels for its types,
        which is no case's cost."""
        for name, header in headers.items():
            res = self._run(header, {}, name in sparse, cpu_limit=WARM_UP_CPU_LIMIT)
            problem = res.problem(cpu_budget=math.inf)
            if res.rc != 0 or problem:
                self.problems.append(f"{name} unchanged: exit {res.rc}: {problem or res.stderr[-300:]}")

    def run(self, name: str, header: Header, changes: dict, label: str, sparse: bool,
            headers: dict[str, Header], sparse_names: set) -> None:
        if not self.worker.alive():   # a case killed the worker: the new one warms up first
            self.warm_up(headers, sparse_names)
        self.n += 1
        res = self._run(header, changes, sparse)
        problem = res.problem()
        if problem:
            self.problems.append(f"{name}: {label}: {problem}")
        self.outcomes["ok" if res.rc == 0 else f"refused ({res.error_types[0]})" if res.error_types and res.rc == 1
                      else "problem"] += 1
        for what in self.worst:
            if getattr(res, what) > self.worst[what][0]:
                self.worst[what] = (getattr(res, what), f"{name}: {label}")

    def report(self, title: str) -> str:
        w = self.worst
        return (f"\n{title}: {self.n} cases, {dict(self.outcomes)}, {self.worker.started} worker start(s); "
                f"worst CPU {w['cpu'][0]:.2f} s ({w['cpu'][1]}), "
                f"worst wall {w['wall'][0]:.2f} s ({w['wall'][1]}), "
                f"peak RSS {w['peak_rss'][0] / 2**20:.0f} MiB ({w['peak_rss'][1]})")


def _tiny_headers(tmp: Path) -> dict[str, Header]:
    """Tiny models of each architecture with the optional keys their loaders read written."""
    specs = {"llama": dict(arch="llama", head_dim=16, rope_dims=16, rope_freqs=True, rope_scaling_factor=2.0),
             "qwen2": dict(arch="qwen2"),
             "gemma3": dict(arch="gemma3", head_dim=32, rope_dims=32, sliding_window=4, swa_pattern=2, n_layer=3)}
    return {name: Header(write_tiny_model(tmp / f"{name}.gguf", **kw)) for name, kw in specs.items()}


def _random_cases(rng: random.Random, pools: dict[str, list], n: int):
    """n cases of 2-4 single mutations of one file, merged (later ones win on a key)."""
    names = sorted(pools)
    for _ in range(n):
        name = rng.choice(names)
        picks = rng.sample(pools[name], rng.randint(2, 4))
        changes: dict = {}
        for _, ch in picks:
            changes.update(ch)
        yield name, " + ".join(label for label, _ in picks), changes


def _run_all(capsys, title, fuzz: Fuzz, headers: dict[str, Header], sparse: set, cases):
    try:
        for name, label, changes in cases:
            fuzz.run(name, headers[name], changes, label, name in sparse, headers, sparse)
    finally:
        fuzz.worker.close()
        with capsys.disabled():
            print(fuzz.report(title))
    assert not fuzz.problems, f"{len(fuzz.problems)} of {fuzz.n} cases broke the contract:\n" + \
        "\n".join(fuzz.problems[:40])


def test_fuzz_tiny_models(capsys):
    """Every single mutation of tiny llama, qwen2 and gemma3 models (and, in long mode, random
    combinations of them) ends in an answer or one error line, in budget."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        headers = _tiny_headers(tmp)
        pools = {name: single_cases(h) for name, h in headers.items()}
        cases = [(name, label, ch) for name, pool in pools.items() for label, ch in pool]
        if LONG:
            cases += list(_random_cases(random.Random(SEED), pools, N_RANDOM))
        _run_all(capsys, "fuzz, tiny models" + (" (long)" if LONG else ""), Fuzz(tmp), headers, set(), cases)


@pytest.mark.slow
def test_fuzz_real_headers(capsys, gemma_path, qwen_path):
    """The real gemma-3-270m and qwen2.5-coder-0.5b headers over sparse data: a seeded sample
    of single mutations (all of them, and random combinations, in long mode)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        headers = {"gemma-3-270m": Header(gemma_path), "qwen2.5-coder-0.5b": Header(qwen_path)}
        pools = {name: single_cases(h) for name, h in headers.items()}
        rng = random.Random(SEED)
        cases = [(name, label, ch) for name, pool in pools.items()
                 for label, ch in (pool if LONG else rng.sample(pool, REAL_SAMPLE))]
        if LONG:
            cases += list(_random_cases(rng, pools, N_RANDOM // 4))
        _run_all(capsys, "fuzz, real headers" + (" (long)" if LONG else ""), Fuzz(tmp), headers,
                 set(headers), cases)
