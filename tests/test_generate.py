"""The generation loop (edge/generate.py): the finish rules in their order, "no limit" as None,
the mask stage through a generation, and steps of k rows with k logits then taken back (the
shape speculative decoding needs), on the tiny ChatML model (tests/tiny_chat.py)."""
from __future__ import annotations

import numpy as np
import pytest

from edge.engine import Engine, GenerationStats
from edge.generate import GenerationLoop, Limits, Rows
from edge.sampling import SamplingParams, TokenMask
from tests.tiny_chat import IM_END, write_tiny_chat_model

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 9, 14, 3, 22]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "chat.gguf", pytest.MonkeyPatch())
    return Engine(path, n_ctx=16, n_batch=4, n_seq=3, block_size=4, kv_storage="anon")


def _script(*tokens):
    """A processor that allows only the next token of ``tokens`` (by the number generated)."""
    def allow(history, logits):
        logits[np.arange(len(logits)) != tokens[(len(history) - len(PROMPT)) % len(tokens)]] = -np.inf
        return logits
    return allow


def _run(loop, seq) -> list:
    """Admit ``seq``, run it to its end and free it; the Sampled list."""
    loop.admit(seq)
    try:
        return list(loop.run(seq))
    finally:
        loop.free(seq)


def test_max_tokens_none_runs_to_the_context_and_zero_samples_nothing(engine):
    stats = GenerationStats()
    out = list(engine.generate(PROMPT, GREEDY, None, stats, processors=[TokenMask([7])]))
    assert out == [7] * (16 - len(PROMPT) + 1)           # the last token has no position left
    assert (stats.finish_reason, stats.context_full, stats.n_generated) == ("length", True, 12)
    stats = GenerationStats()
    assert list(engine.generate(PROMPT, GREEDY, 0, stats)) == []
    assert (stats.finish_reason, stats.context_full, stats.n_generated) == ("length", False, 0)
    stats = GenerationStats()
    assert list(engine.generate(PROMPT, GREEDY, 3, stats, processors=[TokenMask([7])])) == [7, 7, 7]
    assert (stats.finish_reason, stats.context_full) == ("length", False)
    with pytest.raises(ValueError, match="max_tokens must be None \\(no limit\\) or an integer >= 0, got -1"):
        list(engine.generate(PROMPT, GREEDY, -1))


def test_an_end_of_generation_token_stops_unless_eog_is_off(engine):
    stats = GenerationStats()
    assert list(engine.generate(PROMPT, GREEDY, 5, stats, processors=[_script(8, IM_END)])) == [8]
    assert (stats.finish_reason, stats.n_generated) == ("stop", 1)
    loop = engine.loop()
    seq = loop.new(PROMPT, GREEDY, Limits(4, eog=False), [_script(8, IM_END)])
    outs = _run(loop, seq)
    assert [(o.token, o.generated, o.finish_reason) for o in outs] == [
        (8, True, None), (IM_END, True, None), (8, True, None), (IM_END, True, "length")]
    assert seq.tokens == PROMPT + [8, IM_END, 8, IM_END]


def test_stop_strings_end_the_text_before_them(engine):
    loop = engine.loop()
    seq = loop.new(PROMPT, GREEDY, Limits(10, stop=("<t6><t7>",)), [_script(5, 6, 7, 8)])
    outs = _run(loop, seq)
    assert [o.token for o in outs] == [5, 6, 7]
    assert [o.released.text for o in outs] == ["<t5>", "", ""]   # <t6> is held: it may start the stop
    assert (outs[-1].finish_reason, outs[-1].tail, seq.text.text) == ("stop", None, "<t5>")
    seq = loop.new(PROMPT, GREEDY, Limits(2, stop=("<t6><t7>",)), [_script(5, 6, 7, 8)])
    outs = _run(loop, seq)
    assert (outs[-1].finish_reason, outs[-1].tail.text, seq.text.text) == ("length", "<t6>", "<t5><t6>")


def test_k_rows_give_k_logits_and_rejected_rows_are_taken_back(engine):
    """A token and three drafts in one step give the logits of feeding them one by one
    (batch-invariant mode); rejecting the last two and going on gives the logits of a run that
    never saw them."""
    model = engine.model
    model.set_batch_invariant(True)
    try:
        kv = engine.kv
        loop = engine.loop()
        ref = loop.new(PROMPT, GREEDY)
        loop.admit(ref)
        spec = loop.new(PROMPT, GREEDY, lookahead=3)
        loop.admit(spec)
        try:
            loop.compute(ref)
            loop.compute(spec)
            one_by_one = [loop.step([Rows(ref.slot, [t])])[0] for t in (8, 30, 31, 32)]
            k_rows = loop.step([Rows(spec.slot, [8, 30, 31, 32], n_logits=4)])
            assert k_rows.shape == (4, model.args.n_vocab)
            assert all(np.array_equal(a, b) for a, b in zip(k_rows, one_by_one))
            spec.tokens += [8, 30]                          # accepted: 8 and the first draft
            loop.truncate(spec, len(PROMPT) + 2)
            assert (int(kv.pos[spec.slot]), kv.num_tokens(spec.slot)) == (7, 7)
            got = loop.step([Rows(spec.slot, [40, 41], n_logits=2)])
            fresh = loop.new(PROMPT + [8, 30], GREEDY)
            loop.admit(fresh)
            loop.compute(fresh)
            want = [loop.step([Rows(fresh.slot, [t])])[0] for t in (40, 41)]
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
            loop.free(fresh)
        finally:
            loop.free(ref)
            loop.free(spec)
    finally:
        model.set_batch_invariant(False)
        engine.clear_kv_cache()


def test_advance_steps_several_sequences_at_once(engine):
    loop = GenerationLoop(engine.model, engine.kv, engine.tokenizer, n_batch=8, threads=engine.threads)
    seqs = [loop.new(PROMPT, GREEDY, Limits(2), [TokenMask([t])]) for t in (11, 12)]
    for seq in seqs:
        loop.admit(seq)
    try:
        first = loop.advance(seqs)                      # 5 + 3 prompt rows: only the first gets logits
        assert [o.token for o in first] == [11]
        second = loop.advance(seqs)                     # the first's decode row, the second's last 2 rows
        assert [(o.token, o.finish_reason) for o in second] == [(11, "length"), (12, None)]
        last = loop.advance(seqs)
        assert [(o.token, o.finish_reason) for o in last] == [(12, "length")]
        assert loop.advance(seqs) == []                 # both finished
    finally:
        for seq in seqs:
            loop.free(seq)


def test_the_model_calls_the_layer_callback_before_each_layer(engine):
    seen = []
    cache = engine.model.new_cache(8)
    engine.model.forward([5, 6], cache, layer_callback=seen.append)
    assert seen == list(range(engine.model.args.n_layer)) and engine.model.args.n_layer == 2


def test_the_scheduler_serves_through_the_loop_and_a_bad_limit_fails_alone(engine):
    import queue

    from edge.server.scheduler import Delta, Failed, Finished, Request, Scheduler

    events: queue.Queue = queue.Queue()
    sched = Scheduler(engine, n_batch=4)
    try:
        reqs = [Request(PROMPT, GREEDY, lambda ev, i=i: events.put((i, ev)), max_tokens=m, stop=["<t6>"],
                        processors=[_script(*script)])
                for i, (m, script) in enumerate([(3, (5,)), (-1, (5,)), (9, (7, 5, 6, 5))])]
        for r in reqs:
            sched.submit(r)
        seen: dict[int, list] = {0: [], 1: [], 2: []}
        while sum(isinstance(e[-1], (Finished, Failed)) for e in seen.values() if e) < 3:
            i, ev = events.get(timeout=60)
            seen[i].append(ev)
    finally:
        sched.stop(timeout=60)
        engine.model.set_batch_invariant(False)
    text = {i: "".join(e.text for e in evs if isinstance(e, Delta)) for i, evs in seen.items()}
    assert (text[0], seen[0][-1]) == ("<t5><t5><t5>", Finished("length", 5, 3, seen[0][-1].cached_tokens))
    assert seen[1] == [Failed("ValueError: max_tokens must be None (no limit) or an integer >= 0, got -1")]
    assert (text[2], seen[2][-1].finish_reason, seen[2][-1].completion_tokens) == ("<t7><t5>", "stop", 3)
