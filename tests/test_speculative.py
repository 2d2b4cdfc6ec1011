"""Speculative decoding (edge/speculative.py, GenerationLoop.propose / sample_rows): lossless.

- Sampler.verify keeps the target's distribution (chi-square over many draws, any draft q).
- At temperature 0 the tokens with speculation (prompt lookup, a draft model) equal those
  without, token for token: on tiny models, on the goldens' prompts of the real models, and in
  the server's scheduler alongside 7 other streams.
- At temperature > 0 the first tokens' distribution over many seeded runs is the one without
  speculation (chi-square, both drafters).
- A draft rejected at every position, drafts at the end of the context, a stop string or
  max_tokens inside a draft, a generation closed mid-way: the same tokens, the KV cache and the
  draft model's cache left clean.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edge.engine import Engine, GenerationStats
from edge.generate import Limits
from edge.sampling import Sampler, SamplingParams, TokenMask
from edge.speculative import (Draft, Drafter, SpecParams, Speculator, SpeculativeError, _NgramIndex,
                              check_compatible)
from tests import tiny_models
from tests.conftest import golden, real_model_path
from tests.tiny_chat import write_tiny_chat_model

GREEDY = SamplingParams(temperature=0.0)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.09: significance 0.001."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi2_two_samples(a: dict, b: dict) -> tuple[float, int]:
    """Homogeneity chi-square of two count tables (categories with few counts pooled)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    na, nb = sum(a.values()), sum(b.values())
    rows, pool = [], [0, 0]
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        if x + y >= 20:
            rows.append((x, y))
        else:
            pool[0] += x
            pool[1] += y
    if sum(pool):
        rows.append(tuple(pool))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(rows) - 1


# ---- the rejection rule -------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["draft model q", "deterministic draft", "draft outside p"])
def test_verify_keeps_the_target_distribution(case):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(24) * 2).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=14, top_p=0.95, min_p=0.01, seed=3))
    ids, p = sampler.distribution(logits)
    want = dict(zip(ids.tolist(), p.tolist()))
    draw = np.random.default_rng(11)
    if case == "draft model q":                       # q overlaps p's support in part
        q_ids = np.array(sorted(set(ids[:6].tolist()) | {int(i) for i in np.flatnonzero(~np.isin(np.arange(24), ids))[:4]}))
        q_p = draw.random(q_ids.shape[0]) + 0.1
        q_p /= q_p.sum()
    n, counts, kept = 30000, {}, 0
    for _ in range(n):
        if case == "draft model q":
            d = int(draw.choice(q_ids, p=q_p))
            tok, ok = sampler.verify(logits, (), d, (q_ids, q_p))
        elif case == "deterministic draft":
            d = int(ids[1])
            tok, ok = sampler.verify(logits, (), d)
        else:
            d = int(np.flatnonzero(~np.isin(np.arange(24), ids))[0])
            tok, ok = sampler.verify(logits, (), d)
        counts[tok] = counts.get(tok, 0) + 1
        kept += ok
        assert ok == (tok == d)
    assert set(counts) <= set(want)                   # never a token the chain removed
    stat = sum((counts.get(t, 0) - n * pt) ** 2 / (n * pt) for t, pt in want.items())
    assert stat < _chi2_critical(len(want) - 1), (stat, len(want))
    if case == "deterministic draft":                 # a draft is kept with its probability under p
        assert abs(kept / n - want[int(ids[1])]) < 4 * math.sqrt(want[int(ids[1])] / n)
    if case == "draft outside p":
        assert kept == 0


def test_verify_with_q_equal_to_p_keeps_every_draft_and_greedy_decides_without_a_draw():
    logits = np.linspace(-2, 2, 16).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    ids, p = sampler.distribution(logits)
    assert all(sampler.verify(logits, (), int(t), (ids, p)) == (int(t), True) for t in ids[:5])
    greedy = Sampler(GREEDY)
    state = greedy._rng.bit_generator.state
    assert greedy.verify(logits, (), 15) == (15, True)
    assert greedy.verify(logits, (), 3) == (15, False)
    assert greedy._rng.bit_generator.state == state


# ---- prompt lookup, options, compatibility ------------------------------------------------------

def test_ngram_lookup_takes_the_longest_latest_match():
    idx = _NgramIndex(2, 4)
    h = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    assert idx.lookup(h, 3) == [7, 8, 6]              # no 3-gram 6,2,3 before; 2,3 last seen before 7
    idx = _NgramIndex(2, 4)
    assert idx.lookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], 2) == [4, 5]   # the 3-gram 1,2,3 wins
    assert idx.lookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3, 4], 9) == [5, 9, 2, 3, 7, 1, 2, 3, 4]
    assert idx.lookup([1, 2, 3, 4, 5], 4) == []       # taken back: rebuilt; 4,5 not seen before
    assert _NgramIndex(1, 1).lookup([6, 6], 4) == [6]


def test_bad_options_name_the_option():
    with pytest.raises(SpeculativeError, match="--spec-type must be one of none, ngram"):
        SpecParams("lookahead")
    with pytest.raises(SpeculativeError, match="--draft-max must be an integer >= 1, got 0"):
        SpecParams("ngram", draft_max=0)
    with pytest.raises(SpeculativeError, match=r"--draft-min \(5\) is larger than --draft-max \(4\)"):
        SpecParams("ngram", draft_max=4, draft_min=5)
    with pytest.raises(SpeculativeError, match=r"--draft-p-min must be a number in \[0, 1\], got 1.5"):
        SpecParams("draft", draft_p_min=1.5)
    assert SpecParams("ngram-simple").spec_type == "ngram" and SpecParams("draft-simple").spec_type == "draft"


# ---- tiny models ---------------------------------------------------------------------------------

PROMPT = [5, 9, 14, 3, 22, 5, 9, 14, 3, 22, 5, 9]


def _write_chat(path, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "GGUFWriter", __import__("tests.tiny_chat", fromlist=["_ChatWriter"])._ChatWriter)
        tiny_models.write_tiny_model(path, arch="qwen2", seed=seed)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target, draft): two tiny ChatML models with the same vocabulary, other weights."""
    folder = tmp_path_factory.mktemp("spec")
    target = Engine(write_tiny_chat_model(folder / "target.gguf", pytest.MonkeyPatch()), n_ctx=128, n_batch=16,
                    n_seq=2, block_size=4, kv_storage="anon", batch_invariant=True)
    draft = Engine(_write_chat(folder / "draft.gguf", seed=1), n_ctx=128, n_batch=16, n_seq=2, block_size=4,
                   kv_storage="anon", batch_invariant=True)
    yield target, draft
    target.set_speculative(SpecParams())


def _gen(engine, prompt, params, max_tokens, spec=None, draft=None, processors=(), stats=None):
    engine.clear_kv_cache()
    if draft is not None:
        draft.clear_kv_cache()
    engine.set_speculative(spec or SpecParams(), draft)
    stats = stats if stats is not None else GenerationStats()
    return list(engine.generate(prompt, params, max_tokens, stats, processors=processors)), stats


def _free(engine):
    return len(engine.kv._free_slots)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_tokens_equal_without_speculation(tiny, kind):
    target, draft = tiny
    drafted = accepted = 0
    for prompt in (PROMPT, [7, 1, 30, 31, 32, 33, 7, 1, 30], [40] * 5):
        want, _ = _gen(target, prompt, GREEDY, 30)
        got, st = _gen(target, prompt, GREEDY, 30, SpecParams(kind, draft_max=5, draft_p_min=0.0, ngram_min=1),
                       draft if kind == "draft" else None)
        assert got == want
        drafted, accepted = drafted + st.n_drafted, accepted + st.n_accepted
        assert _free(target) == target.n_seq
    assert drafted > accepted > 0                     # drafts were kept and refused


def test_a_draft_model_with_another_vocabulary_is_refused(tiny, tmp_path):
    target, _ = tiny
    other = Engine(tiny_models.write_tiny_model(tmp_path / "other.gguf", arch="qwen2", n_vocab=80),
                   n_ctx=16, kv_storage="anon")
    with pytest.raises(SpeculativeError, match="has 80 tokens, .* 96: more than 128 apart|differ at token"):
        check_compatible(target.tokenizer, other.tokenizer)
    renamed = Engine(tiny_models.write_tiny_model(tmp_path / "renamed.gguf", arch="qwen2",
                                                  tokens=[f"<u{i}>" for i in range(96)]), n_ctx=16, kv_storage="anon")
    with pytest.raises(SpeculativeError, match="differ at token 0"):
        target.set_speculative(SpecParams("draft"), renamed)
    with pytest.raises(SpeculativeError, match="needs a draft model"):
        target.set_speculative(SpecParams("draft"))


class _Scripted(Drafter):
    """Drafts ``make(history, k)``: the test's choice of tokens."""

    def __init__(self, make):
        self.make = make

    def propose(self, seqs, budgets):
        return [Draft(list(self.make(list(s.tokens), k))[:k]) for s, k in zip(seqs, budgets)]


def _scripted(engine, make, draft_max=4):
    engine.clear_kv_cache()
    engine.set_speculative(SpecParams("ngram", draft_max=draft_max))
    engine.speculator = Speculator(SpecParams("ngram", draft_max=draft_max), _Scripted(make))


@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3, None])
def test_a_draft_refused_at_any_position(tiny, wrong_at):
    """Drafts are the target's own greedy continuation but for one token: the tokens are those
    of plain decoding; the KV cache keeps exactly the tokens of the sequence."""
    target, _ = tiny
    want, _ = _gen(target, PROMPT, GREEDY, 24)

    def make(history, k):
        n = len(history) - len(PROMPT)
        d = list(want[n : n + k])
        if wrong_at is not None and wrong_at < len(d):
            d[wrong_at] = (d[wrong_at] + 1) % 96
        return d
    _scripted(target, make)
    loop = target.loop()
    seq = loop.new(PROMPT, GREEDY, Limits(24))
    loop.admit(seq)
    got = []
    try:
        for out in loop.run(seq):
            got += [out.token] if out.generated else []
            if out.finish_reason is None and seq.draft is None:
                assert target.kv.num_tokens(seq.slot) in (len(seq.tokens) - 1, len(seq.tokens))
    finally:
        loop.free(seq)
    assert got == want
    st = seq.spec
    assert st.drafted > 0 and (st.accepted < st.drafted) == (wrong_at is not None)
    target.set_speculative(SpecParams())


def test_drafts_stop_at_the_context_end(tiny):
    target, _ = tiny
    want, ref = _gen(target, PROMPT, GREEDY, None)
    _scripted(target, lambda h, k: want[len(h) - len(PROMPT):][:k] + [3] * k, draft_max=8)
    stats = GenerationStats()
    got = list(target.generate(PROMPT, GREEDY, None, stats))
    assert got == want and (stats.context_full, stats.finish_reason) == (ref.context_full, ref.finish_reason)
    assert stats.n_drafted > 0
    target.set_speculative(SpecParams())


def test_stop_string_and_max_tokens_inside_a_draft(tiny):
    target, _ = tiny
    script = [5, 6, 7, 8, 9, 10, 11, 12]

    def allow(history, logits):        # the target writes the script, the draft proposes it all at once
        n = len(history) - len(PROMPT)
        logits[np.arange(len(logits)) != script[n % len(script)]] = -np.inf
        return logits
    for limits in (Limits(20, stop=("<t7><t8>",)), Limits(3), Limits(6)):
        runs = []
        for spec in (False, True):
            if spec:
                _scripted(target, lambda h, k: (script * 3)[len(h) - len(PROMPT):][:k], draft_max=8)
            else:
                target.clear_kv_cache()
                target.set_speculative(SpecParams())
            loop = target.loop()
            seq = loop.new(PROMPT, GREEDY, limits, [allow], text=True)
            loop.admit(seq)
            try:
                outs = list(loop.run(seq))
            finally:
                loop.free(seq)
            runs.append(([o.token for o in outs if o.generated], outs[-1].finish_reason, seq.text.text,
                         seq.spec.drafted if seq.spec else 0))
        assert runs[0][:3] == runs[1][:3] and runs[1][3] > 0
    target.set_speculative(SpecParams())


def test_closing_the_generation_mid_way_frees_both_caches(tiny):
    target, draft = tiny
    for kind in ("ngram", "draft"):
        target.clear_kv_cache()
        draft.clear_kv_cache()
        target.set_speculative(SpecParams(kind, draft_max=4, draft_p_min=0.0), draft if kind == "draft" else None)
        gen = target.generate([40] * 5, GREEDY, 30)
        first = [next(gen) for _ in range(6)]
        gen.close()
        assert len(first) == 6 and _free(target) == target.n_seq
        assert _free(draft) == draft.n_seq
    target.set_speculative(SpecParams())


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_sampled_tokens_keep_their_distribution(tiny, kind):
    """Tokens 2-4 of 1200 seeded runs (temperature 1, top_k 8) with speculation against 1200
    without: homogeneity chi-square at significance 0.0001 for each position (six tests: a
    false alarm once in 1,700 seeds; the bugs it is for, a wrong residual or acceptance ratio,
    give statistics in the hundreds). The prompt holds every token once, so prompt lookup
    (1-grams) drafts at every step; the draft model (other weights) is refused almost always,
    so the residual draws are tested."""
    target, draft = tiny
    params = dict(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0)
    spec = SpecParams(kind, draft_max=3, draft_p_min=0.0, ngram_min=1)
    tables = {}
    drafted = 0
    for mode in ("plain", "spec"):
        target.clear_kv_cache()
        draft.clear_kv_cache()
        target.set_speculative(spec if mode == "spec" else SpecParams(), draft if kind == "draft" and mode == "spec" else None)
        counts = [{} for _ in range(3)]
        for run in range(1200):
            st = GenerationStats()
            toks = list(target.generate(list(range(3, 96)), SamplingParams(**params, seed=run + (0 if mode == "plain" else 10**6)),
                                        4, st, processors=[TokenMask(np.arange(3, 96))]))
            drafted += st.n_drafted
            for i in range(3):
                counts[i][toks[i + 1]] = counts[i].get(toks[i + 1], 0) + 1
        tables[mode] = counts
    assert drafted > 500
    for i in range(3):
        stat, df = _chi2_two_samples(tables["plain"][i], tables["spec"][i])
        assert df >= 3 and stat < _chi2_critical(df, z=3.72), (i, stat, df)
    target.set_speculative(SpecParams())


# ---- real models ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("gid", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_real_models_greedy_tokens_equal_with_prompt_lookup(gid):
    """The goldens' greedy prompts, and a prompt that asks for a file back (long enough for
    gemma's 512-token sliding window to take part): the same tokens with prompt lookup as
    without, in batch-invariant mode; drafts of the file are kept (a quarter of the tokens at least)."""
    engine = Engine(real_model_path(gid), n_ctx=2048, batch_invariant=True)
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(45))
    prompts = [engine.raw_prompt(c["prompt"]) for c in golden(gid, "greedy.json")["cases"][:2]]
    prompts.append(engine.raw_prompt(f"```python\n{code}```\nThe same code again:\n```python\n"))
    for i, ids in enumerate(prompts):
        n = 48 if i < 2 else 120
        want, _ = _gen(engine, ids, GREEDY, n)
        got, st = _gen(engine, ids, GREEDY, n, SpecParams("ngram"))
        assert got == want, (gid, i)
        if i == 2:
            assert len(ids) + n > 512 and st.n_accepted > n // 4, (st.n_drafted, st.n_accepted)
    engine.set_speculative(SpecParams())


@pytest.mark.slow
def test_scheduler_speculating_streams_equal_plain_ones():
    """Eight streams at once in the server's scheduler, all speculating (prompt lookup), give
    each the tokens of that request decoded alone without speculation."""
    import threading

    from edge.server.scheduler import Finished, Request, Scheduler

    path = real_model_path("qwen2.5-coder-0.5b")
    cases = golden("qwen2.5-coder-0.5b", "greedy.json")["cases"]
    alone = Engine(path, n_ctx=1024, batch_invariant=True)
    prompts = [alone.raw_prompt(c["prompt"] * (1 + i % 3)) for i, c in enumerate(cases * 2)]
    want = [_gen(alone, ids, GREEDY, 40)[0] for ids in prompts]
    engine = Engine(path, n_ctx=1024, n_seq=8, batch_invariant=True)
    engine.set_speculative(SpecParams("ngram"))
    sched = Scheduler(engine, n_batch=64)
    texts, done = [[] for _ in prompts], threading.Semaphore(0)
    try:
        for i, ids in enumerate(prompts):
            def emit(event, i=i):
                if isinstance(event, Finished):
                    done.release()
                elif hasattr(event, "text"):
                    texts[i].append(event.text)
                else:
                    texts[i].append(repr(event))
                    done.release()
            sched.submit(Request(ids, GREEDY, emit, max_tokens=40))
        for _ in prompts:
            assert done.acquire(timeout=300)
    finally:
        sched.stop(timeout=60)
    for i, ids in enumerate(prompts):
        assert "".join(texts[i]) == alone.tokenizer.decode(want[i]).decode("utf-8", "replace"), i
    assert sched.stats.draft_tokens > 0 and sched.stats.draft_accepted_tokens > 0


def test_server_speculates_per_request_and_cleans_up_after_a_disconnect(tiny, tmp_path):
    """edge serve --spec-type draft -md on the tiny models, through the openai client: the same
    text with drafts as with ``speculative.n_max: 0`` (llama-server's per-request field) and as
    the engine alone; drafted/accepted counters in /metrics; a stream dropped mid-way leaves no
    KV block held; a bad speculative field is a 400."""
    openai = pytest.importorskip("openai")
    from tests.server_process import Server, start_post

    target, draft = tiny
    srv = Server(["-m", str(target.path), "-md", str(draft.path), "--spec-type", "draft", "--draft-p-min", "0",
                  "--draft-max", "4", "-np", "3", "-c", "128", "-b", "16"], tmp_path / "serve.log")
    try:
        srv.wait_ready(180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0)
        prompts = [PROMPT, [7, 1, 30, 31, 32, 33, 7, 1, 30]]
        texts = {}
        for extra in ({}, {"speculative.n_max": 0}):
            for i, ids in enumerate(prompts):
                r = client.completions.create(model="target", prompt=ids, max_tokens=30, temperature=0, extra_body=extra)
                texts.setdefault(i, []).append(r.choices[0].text)
        want = [target.tokenizer.decode(_gen(target, ids, GREEDY, 30)[0]).decode() for ids in prompts]
        assert [texts[i] for i in range(2)] == [[w, w] for w in want]
        m = srv.metrics()
        assert m["edge_draft_tokens_total"] > m["edge_draft_accepted_tokens_total"] > 0
        conn = start_post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 100, "temperature": 0,
                                                   "stream": True, "ignore_eos": True})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read(200)
        conn.close()                                   # the client goes away mid-generation
        srv.wait_idle(30)
        status, body = srv.post("/v1/completions", {"prompt": "hi", "speculative.n_max": -1})
        assert status == 400 and "speculative.n_max" in json.dumps(body)
    finally:
        srv.stop()


def test_a_session_saved_at_the_end_of_a_speculative_generation(tiny, tmp_path):
    """edge chat's way (session_save="end"): the file holds the prompt and the kept tokens with
    the logits after them, and the next turn restores it and goes on as plain decoding does."""
    target, _ = tiny
    want, _ = _gen(target, PROMPT, GREEDY, 20)
    target.clear_kv_cache()
    target.set_speculative(SpecParams("ngram", draft_max=4, ngram_min=1))
    session = tmp_path / "chat.session"
    got = list(target.generate(PROMPT, GREEDY, 10, session=session, session_save="end"))
    target.clear_kv_cache()
    st = GenerationStats()
    more = list(target.generate(PROMPT + got, GREEDY, 10, st, session=session, session_save="end"))
    assert got + more == want and st.n_restored > len(PROMPT)
    target.set_speculative(SpecParams())
