"""`edge chat`, the textual app, driven by textual's Pilot on the real default model (greedy),
and the real command in an 80x24 tmux pane."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge.chat import ChatSettings, list_chats
from tui.app import Answer, ChatApp, ChatInput, ChatOptions, Note, UserMessage, load_engine

pytestmark = pytest.mark.slow

_ENGINES: dict = {}


def _cached_loader(model, options):
    """load_engine, one Engine per model for the whole module (loading is not what is tested
    here); each app clears the KV cache of the engine it gets."""
    key = (str(model), options.n_ctx)
    if key not in _ENGINES:
        _ENGINES[key] = load_engine(model, options)
    engine = _ENGINES[key]
    engine.clear_kv_cache()
    return engine


def _options(tmp_path, qwen_path, **kw) -> ChatOptions:
    settings = kw.pop("settings", ChatSettings(temperature=0.0, max_tokens=16))
    return ChatOptions(model=str(qwen_path), settings=settings, n_ctx=2048, folder=tmp_path / "chats", **kw)


async def _until(pilot, predicate, timeout=120.0):
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.05)


async def _ready(pilot):
    app = pilot.app
    await _until(pilot, lambda: app.runner is not None and not app.loading)


@contextlib.asynccontextmanager
async def _chat(options):
    """A ChatApp on an 80x24 screen with its model loaded: yields (app, pilot)."""
    app = ChatApp(options, engine_loader=_cached_loader)
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(pilot)
        yield app, pilot


async def _send(pilot, text: str):
    app = pilot.app
    box = app.query_one("#input", ChatInput)
    box.focus()
    box.text = text
    before = app.turns_ended
    await pilot.press("enter")
    await _until(pilot, lambda: app.turns_ended > before)
    await pilot.pause(0.1)


def _notes(app) -> list[str]:
    return [str(n.content) for n in app.query(Note)]


def _status(app) -> str:
    return str(app.query_one("#status").content)


def _run(coro):
    return asyncio.run(coro)


def test_a_question_gets_a_streamed_answer_and_the_status_bar(tmp_path, qwen_path):
    async def go():
        async with _chat(_options(tmp_path, qwen_path)) as (app, pilot):
            await _send(pilot, "What is the capital of France? Answer in one sentence.")
            users = list(app.query(UserMessage))
            answers = list(app.query(Answer))
            assert len(users) == 1 and len(answers) == 1
            assert "Paris" in answers[0].source
            conv = app.conversation
            assert conv.messages[-1]["content"] in answers[0].source
            status = _status(app)
            assert "qwen2.5-coder-0.5b-instruct" in status
            assert f"{app.n_tokens}/2048 tokens" in status and app.n_tokens > 20
            assert "TTFT" in status and "tok/s" in status
            saved = json.loads((tmp_path / "chats" / f"{conv.id}.json").read_text())
            assert saved["messages"][0]["content"] == "What is the capital of France? Answer in one sentence."
    _run(go())


def test_escape_stops_the_answer_and_keeps_the_text(tmp_path, qwen_path):
    async def go():
        opts = _options(tmp_path, qwen_path, settings=ChatSettings(temperature=0.0, max_tokens=400))
        async with _chat(opts) as (app, pilot):
            box = app.query_one("#input", ChatInput)
            box.text = "Write a long story about a dragon who learns to cook."
            await pilot.press("enter")
            await _until(pilot, lambda: app._answer is not None and len(app._answer.source) > 20)
            t0 = time.monotonic()
            await pilot.press("escape")
            await _until(pilot, lambda: not app.generating, timeout=5)
            assert time.monotonic() - t0 < 2.0       # at once: after the token being computed
            msg = app.conversation.messages[-1]
            assert msg["role"] == "assistant" and msg.get("stopped") is True
            assert 0 < len(msg["content"]) < 1500
            assert "(stopped)" in list(app.query(Answer))[-1].source
            # the chat goes on
            app.conversation.settings = ChatSettings(temperature=0.0, max_tokens=2)
            await _send(pilot, "Thanks!")
            assert app.conversation.messages[-1]["role"] == "assistant"
            assert not app.conversation.messages[-1].get("stopped")
            # cut by the length limit (2 tokens): marked as such, not as stopped
            assert list(app.query(Answer))[-1].source.endswith(" *(length limit: /max-tokens N raises it)*")
    _run(go())


def test_commands(tmp_path, qwen_path, gemma_path):
    async def go():
        async with _chat(_options(tmp_path, qwen_path)) as (app, pilot):

            async def command(text):
                box = app.query_one("#input", ChatInput)
                box.text = text
                await pilot.press("enter")
                await pilot.pause(0.1)

            await command("/temp 0.5")
            assert app.conversation.settings.temperature == 0.5
            await command("/temp hot")
            assert app.conversation.settings.temperature == 0.5
            assert "temperature takes a number, got 'hot'" in _notes(app)[-1]
            await command("/top-k 7")
            await command("/max-tokens 12")
            await command("/seed 3")
            s = app.conversation.settings
            assert (s.top_k, s.max_tokens, s.seed) == (7, 12, 3)
            await command("/temp 0")
            await command("/system Answer with one word.")
            assert app.conversation.system == "Answer with one word."
            await _send(pilot, "What color is the sky on a clear day?")
            first_id = app.conversation.id
            answer = app.conversation.messages[-1]["content"]
            await command("/copy")
            assert app.clipboard == answer
            await command("/save sky")
            assert json.loads((tmp_path / "chats" / f"{first_id}.json").read_text())["title"] == "sky"
            await command("/help")
            assert "/model NAME" in list(app.query(Answer))[-1].source
            await command("/new")
            assert app.conversation.id != first_id and app.conversation.messages == []
            assert app.conversation.system == "Answer with one word."     # a new chat keeps the settings
            assert not list(app.query(UserMessage))
            await command("/load sky")
            await _until(pilot, lambda: app.conversation.id == first_id)
            assert [m["content"] for m in app.conversation.messages][1] == answer
            assert len(list(app.query(UserMessage))) == 1
            await command("/nonsense")
            assert "unknown command /nonsense" in _notes(app)[-1]
            # switch to a model without a chat template: a notice and raw completion mode
            await command(f"/model {gemma_path}")
            await _until(pilot, lambda: not app.loading and app.engine is not None
                         and Path(app.engine.path).name == gemma_path.name)
            assert app.conversation.mode == "raw"
            assert any("no chat template" in n for n in _notes(app))
            await _send(pilot, "The capital of France is")
            assert app.conversation.messages[-1]["role"] == "assistant"
            assert "gemma-3-270m" in _status(app)
            await command("/system hello")
            assert "raw completion mode has no system message" in _notes(app)[-1]
            # and back
            await command(f"/model {qwen_path}")
            await _until(pilot, lambda: not app.loading and Path(app.engine.path).name == qwen_path.name)
            assert app.engine.template is not None
    _run(go())


def test_input_keys(tmp_path, qwen_path):
    async def go():
        async with _chat(_options(tmp_path, qwen_path)) as (app, pilot):
            box = app.query_one("#input", ChatInput)
            await pilot.press("h", "i", "ctrl+j", "y", "o", "ctrl+j", "!")    # one burst: in key order
            assert box.text == "hi\nyo\n!"
            await pilot.press("ctrl+l")
            assert box.text == ""
            await pilot.press("f2", "a", "enter", "b")
            assert box.text == "a\nb" and "Enter new line" in box.border_title
            await pilot.press("ctrl+s")
            await _until(pilot, lambda: app.turns_ended == 1)
            assert app.conversation.messages[0]["content"] == "a\nb"
            await pilot.press("f2")
            assert "Enter send" in box.border_title
    _run(go())


def test_command_palette_fills_the_input(tmp_path, qwen_path):
    async def go():
        async with _chat(_options(tmp_path, qwen_path)) as (app, pilot):
            await pilot.press("ctrl+p")
            await pilot.pause(0.2)
            for ch in "temperature":
                await pilot.press(ch)
            await pilot.pause(0.5)
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert app.query_one("#input", ChatInput).text == "/temp "
    _run(go())


def test_resume_reopens_the_last_chat_and_restores_its_kv_cache(tmp_path, qwen_path):
    async def first():
        async with _chat(_options(tmp_path, qwen_path)) as (app, pilot):
            await _send(pilot, "Say the word apple.")
            return app.conversation.id, list(app.conversation.messages)

    chat_id, messages = _run(first())

    async def second():
        async with _chat(_options(tmp_path, qwen_path, resume=True)) as (app, pilot):
            assert app.conversation.id == chat_id and app.conversation.messages == messages
            assert len(list(app.query(UserMessage))) == 1 and len(list(app.query(Answer))) == 1
            seen = {}
            original = app.runner.answer

            def spy(text, *callbacks):
                result = original(text, *callbacks)
                seen["stats"] = result.stats
                return result

            app.runner.answer = spy
            await _send(pilot, "And the word pear.")
            stats = seen["stats"]
            assert stats.n_restored >= stats.n_prompt - 20      # the history was not computed again
    _run(second())
    assert list_chats(tmp_path / "chats")[0].id == chat_id


def test_model_without_template_at_start(tmp_path, gemma_path, qwen_path):
    async def go():
        opts = _options(tmp_path, qwen_path)
        opts.model = str(gemma_path)
        async with _chat(opts) as (app, pilot):
            assert app.conversation.mode == "raw"
            assert any("raw completion mode" in n for n in _notes(app))
            await _send(pilot, "Once upon a time")
            assert app.conversation.messages[-1]["content"]
    _run(go())


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt install tmux)")
def test_edge_chat_in_an_80x24_tmux_pane(tmp_path, qwen_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    for p in Path(qwen_path).parent.glob("*.gguf"):
        (home / "models" / p.name).symlink_to(p)
    session = "edge-test"
    # a private tmux server (-L): a server already running (the user's) would start the command
    # with its own environment, not this one
    tmux = ["tmux", "-L", f"edge-test-{os.getpid()}"]
    env = {**os.environ, "EDGE_HOME": str(home), "TERM": "xterm-256color"}
    edge = str(Path(sys.executable).with_name("edge"))
    cmd = f"{edge} chat --temp 0 -n 24 -c 2048"
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], env=env, check=True)

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_for(text, timeout=180):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            s = screen()
            if text in s:
                return s
            time.sleep(0.3)
        raise AssertionError(f"{text!r} did not appear; the screen:\n{screen()}")

    try:
        wait_for("ready")
        subprocess.run([*tmux, "send-keys", "-t", session, "What is the capital of France?", "Enter"], check=True)
        shown = wait_for("tok/s")
        lines = shown.splitlines()
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        assert "Paris" in shown
        assert "qwen2.5-coder-0.5b-instruct" in lines[-1] and "/2048 tokens" in lines[-1]
        (tmp_path / "screen.txt").write_text(shown)
        subprocess.run([*tmux, "send-keys", "-t", session, "C-q"], check=True)
        t0 = time.monotonic()
        while subprocess.run([*tmux, "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() - t0 < 10, "edge chat did not quit on Ctrl+Q"
            time.sleep(0.2)
        chats = list((home / "chats").glob("*.json"))
        assert len(chats) == 1
        assert json.loads(chats[0].read_text())["messages"][0]["content"] == "What is the capital of France?"
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_bye_ctrl_d_and_ctrl_c_leave(tmp_path, qwen_path):
    """/bye and Ctrl+D on an empty line leave (status 0), as Ollama's chat; Ctrl+D with text
    deletes; Ctrl+C once says how to leave, twice within 2 s leaves with status 130."""
    async def leave_with(keys, text=""):
        async with _chat(_options(tmp_path, qwen_path)) as (app, pilot):
            box = app.query_one("#input", ChatInput)
            box.text = text
            await pilot.press(*keys)
            await pilot.pause(0.3)
            return app.return_code, box.text, _notes(app)

    assert _run(leave_with(["enter"], "/bye"))[0] == 0
    assert _run(leave_with(["ctrl+d"]))[0] == 0
    code, text, _ = _run(leave_with(["home", "ctrl+d"], "ab"))
    assert code is None and text == "b"          # not empty: Ctrl+D deletes, the chat stays
    code, _, notes = _run(leave_with(["ctrl+c"]))
    assert code is None and notes[-1] == "Ctrl+C again leaves; so do Ctrl+D on an empty line, /bye and Ctrl+Q"
    assert _run(leave_with(["ctrl+c", "ctrl+c"]))[0] == 130


def test_a_compile_while_loading_is_shown_before_ready(tmp_path, qwen_path):
    """A kernel numba must compile while the model loads (a cold cache) is said in the view and
    counted in the status bar before "ready"; the loader's engine is warmed up before ready."""
    import numba

    seen = []

    def loader(model, options):
        @numba.njit(cache=False)
        def new_kernel(x):          # a function numba has never compiled: a real compile
            return x * 2 + 1

        engine = _cached_loader(model, options)
        assert new_kernel(20) == 41
        warm = engine.warm_up

        def spy():
            seen.append(("warm_up", app.loading))
            warm()

        engine.warm_up = spy
        return engine

    async def go():
        nonlocal app
        app = ChatApp(_options(tmp_path, qwen_path), engine_loader=loader)
        async with app.run_test(size=(80, 24)) as pilot:
            await _ready(pilot)
            notes = _notes(app)
            compiled = [i for i, n in enumerate(notes) if re.fullmatch(r"compiled \d+ kernels in \d+ s \(first run "
                                                                       r"only: later runs load them from numba's cache\)", n)]
            ready = [i for i, n in enumerate(notes) if " ready (n_ctx " in n]
            assert len(compiled) == 1 and len(ready) == 1 and compiled[0] < ready[0], notes
            assert app.compile_watch.count >= 1 and seen == [("warm_up", True)]
            assert shown and shown[0] == "compiling edge's kernels for this CPU (first run only: about a minute on 2 " \
                                         "cores; later runs load them from numba's cache)…"

    app = None
    shown = []
    original = ChatApp.on_engine_note

    def spy_note(self, message):
        shown.append(message.text)
        original(self, message)

    ChatApp.on_engine_note = spy_note
    try:
        _run(go())
    finally:
        ChatApp.on_engine_note = original
    from edge.compile_watch import CompileWatch
    assert isinstance(app.compile_watch, CompileWatch)
