"""The reasoning splitter on every split of texts with tags, the detection of reasoning models
and prompts that open <think>, and the reasoning budget (edge.reasoning) on a toy tokenizer
and on the tiny reasoning model (tests/tiny_reasoning.py)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from edge.reasoning import ReasoningBudget, ReasoningSplitter, is_reasoning_model, prompt_opens_reasoning, \
    split_reasoning, tag_ids
from tests.tiny_reasoning import ANSWER, ID, OPENED, REASONING, WHOLE_TAGS, driving_body, \
    write_tiny_reasoning_model

# (text, opened) -> (reasoning, content)
CASES = [
    (("<think>Hmm ok</think>The answer", False), ("Hmm ok", "The answer")),
    (("  <think>\nHmm\n\nok \n</think>\n\nThe answer\n", False), ("Hmm\n\nok", "The answer\n")),
    (("<think></think>The answer", False), ("", "The answer")),
    (("<think>a < b </ c <th</think>d>", False), ("a < b </ c <th", "d>")),
    (("<think>Hmm </thi", False), ("Hmm </thi", "")),                  # never closed: all reasoning
    (("<think>Hmm", False), ("Hmm", "")),
    (("<thin", False), ("", "<thin")),                                   # a piece of the tag, then the end
    (("<thinking>x</thinking>", False), ("", "<thinking>x</thinking>")),
    (("The answer <think>x</think>", False), ("", "The answer <think>x</think>")),
    (("  The answer", False), ("", "  The answer")),
    (("\nHmm ok</think>\n\nThe answer", True), ("Hmm ok", "The answer")),
    (("Hmm ok", True), ("Hmm ok", "")),
    (("</think>The answer", True), ("", "The answer")),
    (("Hmm <think>x</think>y</think>z", True), ("Hmm <think>x", "y</think>z")),
]
TAG_FREE = {0, 1, 2, 5, 10, 11, 12}   # cases whose only '<' / '>' are the tags


def _stream(pieces: list[str], opened: bool) -> list[tuple[str, str]]:
    """Every non-empty release as (kind, text), in order."""
    s = ReasoningSplitter(opened)
    out = []
    for split in [s.push(p) for p in pieces] + [s.finish()]:
        out += [(k, t) for k, t in (("reasoning", split.reasoning), ("content", split.content)) if t]
    assert (s.reasoning, s.content) == ("".join(t for k, t in out if k == "reasoning"),
                                        "".join(t for k, t in out if k == "content"))
    return out


@pytest.mark.parametrize("i", range(len(CASES)))
def test_whole_text(i):
    (text, opened), want = CASES[i]
    got = split_reasoning(text, opened)
    assert (got.reasoning, got.content) == want


@pytest.mark.parametrize("i", range(len(CASES)))
def test_every_split_into_three_pieces(i):
    """Cut at every pair of points (and char by char): the same split, the reasoning released
    before any content, and for tag-free texts no '<' or '>' in either stream."""
    (text, opened), want = CASES[i]
    cuts = [[text[:a], text[a:b], text[b:]] for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2)]
    for pieces in cuts + [list(text)]:
        out = _stream(pieces, opened)
        got = ("".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content"))
        assert got == want, pieces
        kinds = [k for k, _ in out]
        assert kinds == sorted(kinds, key=lambda k: k == "content"), (pieces, out)
        if i in TAG_FREE:
            assert not any(c in t for _, t in out for c in "<>"), (pieces, out)


def test_text_is_released_as_soon_as_it_cannot_be_a_tag():
    s = ReasoningSplitter()
    assert (s.push("<th").reasoning, s.push("ink>Hm").reasoning) == ("", "Hm")
    assert s.push("m </").reasoning == "m"          # " </" may begin </think>: held
    assert s.push("b>").reasoning == " </b>"
    assert s.in_reasoning
    split = s.push("</think>\n")
    assert (split.reasoning, split.content, s.in_reasoning) == ("", "", False)
    assert s.push("\nAns").content == "Ans"


class ToyTokenizer:
    """encode by a table of tag texts; token_to_piece of a tag id is its text."""

    def __init__(self, tags: dict[str, list[int]]):
        self.tags = tags

    def encode(self, text, add_special, parse_special):
        return list(self.tags.get(text, [90, 91]))

    def token_to_piece(self, tid, special=False):
        return next((t.encode() for t, ids in self.tags.items() if ids == [tid]), b"x")

    def decode(self, ids, unparse_special=False):
        return b"".join(self.token_to_piece(t) for t in ids)


def _allowed(proc, history, n_vocab=32) -> list[int]:
    logits = np.zeros(n_vocab, np.float32)
    out = proc(history, logits)
    return np.flatnonzero(np.isfinite(out)).tolist()


def test_budget_forces_each_token_of_a_multi_token_close():
    tok = ToyTokenizer({"<think>": [10], "</think>": [20, 21, 22]})
    prompt = [1, 2, 3]
    proc = ReasoningBudget(tok, len(prompt), budget=2)
    everything = list(range(32))
    assert _allowed(proc, prompt) == everything                      # nothing generated
    assert _allowed(proc, prompt + [10, 5]) == everything            # one reasoning token
    assert _allowed(proc, prompt + [10, 5, 6]) == [20]               # two: close it
    assert _allowed(proc, prompt + [10, 5, 6, 20]) == [21]
    assert _allowed(proc, prompt + [10, 5, 6, 20, 21]) == [22]
    assert _allowed(proc, prompt + [10, 5, 6, 20, 21, 22]) == everything
    assert _allowed(proc, prompt + [10, 5, 6, 20, 21, 22, 7, 8, 9]) == everything
    assert _allowed(proc, prompt + [10, 5, 20]) == [21]              # the model began </think> itself
    assert _allowed(proc, prompt + [10, 20, 21, 22, 5, 6]) == everything   # closed in time
    assert _allowed(proc, prompt + [5, 6, 7, 8]) == everything       # no block at the start


def test_budget_zero_and_a_block_opened_by_the_prompt():
    tok = ToyTokenizer({"<think>": [10], "</think>": [20]})
    assert _allowed(ReasoningBudget(tok, 2, budget=0, opened=True), [1, 10]) == [20]
    assert _allowed(ReasoningBudget(tok, 2, budget=0), [1, 2, 10]) == [20]
    assert _allowed(ReasoningBudget(tok, 2, budget=3, opened=True), [1, 10, 4, 5]) == list(range(32))
    assert _allowed(ReasoningBudget(tok, 2, budget=3, opened=True), [1, 10, 4, 5, 6]) == [20]
    with pytest.raises(ValueError, match="budget must be >= 0"):
        ReasoningBudget(tok, 2, budget=-1)


def test_detection_by_template_or_vocabulary():
    plain = ToyTokenizer({})
    assert not is_reasoning_model("{{ messages }}", plain) and not is_reasoning_model(None, plain)
    for source in ("{{ '<think>' }}", "{% if m.reasoning_content %}", "{% if enable_thinking %}"):
        assert is_reasoning_model(source, plain)
    assert is_reasoning_model(None, ToyTokenizer({"<think>": [10], "</think>": [20]}))
    assert not is_reasoning_model(None, ToyTokenizer({"<think>": [10]}))
    assert tag_ids(ToyTokenizer({"<think>": [10]}), "</think>") is None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from edge.engine import Engine
    path = write_tiny_reasoning_model(tmp_path_factory.mktemp("reasoning") / "tiny.gguf", pytest.MonkeyPatch())
    return Engine(path, n_ctx=128, n_batch=16)


def test_tiny_model_is_a_reasoning_model_and_its_prompts(engine):
    tok = engine.tokenizer
    assert is_reasoning_model(engine.template.source, tok)
    assert (tag_ids(tok, "<think>"), tag_ids(tok, "</think>")) == ([ID["<think>"]], [ID["</think>"]])
    hi = [{"role": "user", "content": "hi"}]
    assert not prompt_opens_reasoning(tok, engine.chat_prompt(hi))
    assert prompt_opens_reasoning(tok, engine.chat_prompt(hi, variables={"open_think": True}))
    assert not prompt_opens_reasoning(tok, engine.chat_prompt(hi, variables={"enable_thinking": False}))   # <think></think>


def _generate(engine, words, budget=None, **variables):
    from edge.sampling import SamplingParams
    body = driving_body(words)
    params = SamplingParams(temperature=0.0, repeat_penalty=body["repeat_penalty"], repeat_last_n=-1,
                            logit_bias={int(k): v for k, v in body["logit_bias"].items()})
    ids = engine.chat_prompt([{"role": "user", "content": "hi"}], variables=variables)
    procs = [] if budget is None else [ReasoningBudget(engine.tokenizer, len(ids), budget,
                                                      prompt_opens_reasoning(engine.tokenizer, ids))]
    out = list(engine.generate(ids, params, max_tokens=len(words), processors=procs))
    return out, engine.tokenizer.decode(out).decode()


def test_budget_on_the_tiny_model(engine):
    want = [ID[w] for w in WHOLE_TAGS]
    out, text = _generate(engine, WHOLE_TAGS)
    assert out == want and split_reasoning(text) == split_reasoning(f"<think>{REASONING}</think>{ANSWER}")
    assert _generate(engine, WHOLE_TAGS, budget=2)[0] == want          # closed within the budget
    out, text = _generate(engine, WHOLE_TAGS, budget=1)                # </think> forced after "Hmm"
    assert out == [ID[w] for w in ["<think>", "Hmm", "</think>", "▁ok", "The", "▁answer", "▁is", "▁4", "."]]
    assert (split_reasoning(text).reasoning, split_reasoning(text).content) == ("Hmm", "okThe answer is 4.")
    out, _ = _generate(engine, WHOLE_TAGS, budget=0)
    assert out[:3] == [ID["<think>"], ID["</think>"], ID["Hmm"]]
    out, text = _generate(engine, OPENED, budget=0, open_think=True)  # the prompt opened it: closed at once
    assert out[:2] == [ID["</think>"], ID["Hmm"]]
    assert split_reasoning(text, opened=True).reasoning == ""


def test_server_split_and_a_constrained_request(engine):
    """edge.server.thinking.ChatReasoning: a reasoning model's answer split (opened or not), and
    none for a request a grammar constrains (the constraint holds from the first token)."""
    from edge.server.thinking import ChatReasoning
    hi = [{"role": "user", "content": "hi"}]
    plain, opened = engine.chat_prompt(hi), engine.chat_prompt(hi, variables={"open_think": True})
    text = f"<think>{REASONING}</think>{ANSWER}"
    both = {"reasoning_content": REASONING, "reasoning": REASONING}
    assert ChatReasoning(engine, plain).message(text) == {"role": "assistant", "content": ANSWER, **both}
    assert ChatReasoning(engine, opened).message(f"{REASONING}</think>{ANSWER}") == \
        {"role": "assistant", "content": ANSWER, **both}
    for ids in (plain, opened):
        r = ChatReasoning(engine, ids, budget=3, constrained=True)
        assert (r.message(text), r.processors) == ({"role": "assistant", "content": text}, [])
        assert ChatReasoning(engine, ids, constrained=True).deltas("<think>a", final=True) == [{"content": "<think>a"}]
    streamed = ChatReasoning(engine, plain)
    assert streamed.deltas("<think>Hm") == [{"reasoning_content": "Hm", "reasoning": "Hm"}]
    assert streamed.deltas("m</think>\n\nThe") == [{"reasoning_content": "m", "reasoning": "m"}, {"content": "The"}]
    assert streamed.deltas(" end", final=True) == [{"content": " end"}]
