"""A reasoning model's thinking in `edge chat`: ChatRunner streams the <think> block apart from
the answer, and the app shows it collapsed above the answer (textual's Pilot), on the tiny
reasoning model (tests/tiny_reasoning.py) driven to known text."""
from __future__ import annotations

import functools
import json
import time

import pytest

from edge.chat import ChatRunner, ChatSettings, Conversation, answer_parts
from edge.reasoning import Split
from tests.tiny_reasoning import ANSWER, OPENED, REASONING, SPLIT_TAGS, WHOLE_TAGS, driving_body, \
    write_tiny_reasoning_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from edge.engine import Engine
    path = write_tiny_reasoning_model(tmp_path_factory.mktemp("reasoning") / "tiny_think.gguf", pytest.MonkeyPatch())
    return Engine(path, n_ctx=128, n_batch=16)


def _settings(words) -> ChatSettings:
    body = driving_body(words)
    return ChatSettings(max_tokens=body["max_tokens"], temperature=0.0, repeat_penalty=body["repeat_penalty"],
                        repeat_last_n=-1, logit_bias={int(k): v for k, v in body["logit_bias"].items()})


def _answer(engine, folder, words):
    """(calls as (kind, text) in order, the TurnResult, the conversation)."""
    engine.clear_kv_cache()
    conv = Conversation(model="tiny_think", settings=_settings(words))
    runner = ChatRunner(engine, conv, folder)
    calls = []
    result = runner.answer("hi", lambda t: calls.append(("content", t)), lambda t: calls.append(("reasoning", t)))
    return calls, result, conv


@pytest.mark.parametrize("words", [WHOLE_TAGS, SPLIT_TAGS], ids=["whole-tags", "split-tags"])
def test_runner_streams_the_thinking_first(engine, tmp_path, words):
    calls, result, conv = _answer(engine, tmp_path, words)
    kinds = [k for k, _ in calls]
    assert kinds == sorted(kinds, key=lambda k: k == "content")
    assert "".join(t for k, t in calls if k == "reasoning") == REASONING
    assert "".join(t for k, t in calls if k == "content") == ANSWER
    assert not any(c in t for _, t in calls for c in "<>")
    saved = json.loads(conv.path(tmp_path).read_text())["messages"][-1]
    assert saved["content"] == result.text and result.text.endswith(ANSWER) and "reasoning_opened" not in saved
    assert answer_parts(saved, True) == Split(REASONING, ANSWER)
    assert answer_parts(saved, False).content == result.text       # not a reasoning model: all answer


def test_runner_with_a_template_that_opens_think(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "chat_prompt", functools.partial(engine.chat_prompt, variables={"open_think": True}))
    calls, result, conv = _answer(engine, tmp_path, OPENED)
    assert result.text == f"{REASONING}</think>{ANSWER}"
    assert calls[0] == ("reasoning", "Hmm") and "".join(t for k, t in calls if k == "content") == ANSWER
    saved = conv.messages[-1]
    assert saved["reasoning_opened"] is True
    assert answer_parts(saved, True) == Split(REASONING, ANSWER)


async def _until(pilot, predicate, timeout=60.0):
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out waiting for the app"
        await pilot.pause(0.05)


def test_app_shows_the_thinking_collapsed_above_the_answer(engine, tmp_path):
    import asyncio

    from tui.app import Answer, ChatApp, ChatInput, ChatOptions, Thinking

    def loader(model, options):
        engine.clear_kv_cache()
        return engine

    async def run():
        options = ChatOptions(model="tiny_think", settings=_settings(WHOLE_TAGS), n_ctx=128, folder=tmp_path / "chats")
        app = ChatApp(options, engine_loader=loader)
        async with app.run_test(size=(80, 24)) as pilot:
            await _until(pilot, lambda: app.runner is not None and not app.loading)
            box = app.query_one("#input", ChatInput)
            box.text = "hi"
            await pilot.press("enter")
            await _until(pilot, lambda: app.turns_ended == 1)
            await pilot.pause(0.1)
            log = list(app.log_view.children)
            thinking, answer = app.query_one(Thinking), app.query(Answer).last()
            assert log.index(thinking) == log.index(answer) - 1          # right above the answer
            assert (thinking.text, thinking.collapsed, thinking.title) == (REASONING, True, "thought")
            assert answer.source == ANSWER + " *(length limit: /max-tokens N raises it)*"   # driven to max_tokens
            app.show_conversation()                                      # as a reopened chat shows it
            await pilot.pause(0.1)
            assert [t.text for t in app.query(Thinking)] == [REASONING]
            assert app.query(Answer).last().source == ANSWER

    asyncio.run(run())
