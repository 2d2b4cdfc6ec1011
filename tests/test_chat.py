"""edge.chat: conversations, their files, and turns on the real default model (greedy), with
stops from another thread and the KV session that carries a chat across processes."""
from __future__ import annotations

import json
import shutil
import threading

import pytest

from edge.chat import ChatError, ChatRunner, ChatSettings, Conversation, find_chat, list_chats
from edge.engine import ContextLengthExceeded, Engine, GenerationStats
from edge.tokenizer import StreamDecoder

pytestmark = pytest.mark.slow

GREEDY = ChatSettings(temperature=0.0, max_tokens=24)


def _engine(path, **kw) -> Engine:
    return Engine(path, n_ctx=kw.pop("n_ctx", 2048), n_batch=kw.pop("n_batch", 64), kv_storage="anon", **kw)


def _generate_text(engine: Engine, ids: list[int], max_tokens: int) -> str:
    """The greedy answer to ``ids`` computed from scratch (no session, no prefix cache)."""
    engine.clear_kv_cache()
    dec = StreamDecoder()
    out = [dec.feed(engine.tokenizer.token_to_piece(t, special=False))
           for t in engine.generate(ids, ChatSettings(temperature=0.0).sampling, max_tokens)]
    return "".join(out) + dec.flush()


@pytest.fixture(scope="module")
def qwen(qwen_path):
    return _engine(qwen_path)


def test_threads_apply_on_the_worker_thread(qwen, tmp_path):
    """numba's thread count is per OS thread: an answer on a new thread (the app's worker) runs
    its kernels on the runner's -t, not numba's default."""
    import threading

    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one CPU: -t 1 is numba's default")
    conv = Conversation(model="qwen", settings=GREEDY)
    seen: list[int] = []
    runner = ChatRunner(qwen, conv, tmp_path, threads=1)
    worker = threading.Thread(target=runner.answer, args=("Hi", lambda s: seen.append(numba.get_num_threads())))
    worker.start()
    worker.join(120)
    assert seen and set(seen) == {1}


def test_two_turns_stream_the_greedy_answers_and_reuse_the_history(qwen, tmp_path):
    conv = Conversation(model="qwen", system="You are a terse assistant.", settings=GREEDY)
    runner = ChatRunner(qwen, conv, tmp_path)
    streamed: list[str] = []
    r1 = runner.answer("What is the capital of France?", streamed.append)
    assert r1.text and not r1.stopped
    assert "".join(streamed) == r1.text
    assert "Paris" in r1.text
    # the chat's first answer is the model's greedy answer to the same prompt computed alone
    first_prompt = qwen.chat_prompt([{"role": "system", "content": "You are a terse assistant."},
                                     {"role": "user", "content": "What is the capital of France?"}])
    assert r1.stats.n_prompt == len(first_prompt)
    assert r1.text == _generate_text(qwen, first_prompt, 24)
    r2 = runner.answer("And of Italy?", lambda s: None)
    assert "Rome" in r2.text
    # the second turn restored the first (prompt and answer) from the session file
    assert r2.stats.n_restored >= len(first_prompt) + r1.stats.n_generated - 1
    assert r2.stats.n_prompt == len(Conversation(model="q", system=conv.system, messages=conv.messages[:3])
                                    .prompt_ids(qwen))
    assert r2.n_tokens == r2.stats.n_prompt + r2.stats.n_generated
    saved = json.loads(conv.path(tmp_path).read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert saved["messages"][3]["content"] == r2.text
    assert conv.session_path(tmp_path).stat().st_size > 0


def test_resume_in_a_new_engine_restores_the_session_and_answers_the_same(qwen_path, tmp_path):
    a = _engine(qwen_path)
    here, there = tmp_path / "here", tmp_path / "there"
    conv = Conversation(model="qwen", settings=GREEDY)
    runner = ChatRunner(a, conv, here)
    runner.answer("Name a prime number greater than 10.", lambda s: None)
    shutil.copytree(here, there)
    loaded = find_chat(conv.id, there)
    assert loaded.messages == conv.messages
    b = _engine(qwen_path)                 # a fresh engine, as after `edge chat --resume`
    resumed = ChatRunner(b, loaded, there).answer("Another one?", lambda s: None)
    assert resumed.stats.n_restored > 0 and resumed.stats.n_cached == 0
    assert resumed.stats.n_restored >= resumed.stats.n_prompt - 20   # only the new turn computed
    continued = runner.answer("Another one?", lambda s: None)       # the same turn, never closed
    assert resumed.text == continued.text and resumed.stats.n_prompt == continued.stats.n_prompt


def test_stop_from_another_thread_keeps_what_was_written(qwen, tmp_path):
    conv = Conversation(model="qwen", settings=ChatSettings(temperature=0.0, max_tokens=200))
    runner = ChatRunner(qwen, conv, tmp_path)
    seen: list[str] = []

    def on_text(piece):
        seen.append(piece)
        if len(seen) == 3:
            threading.Thread(target=runner.stop).start()

    result = runner.answer("Write a long story about a lighthouse keeper.", on_text)
    assert result.stopped
    assert 3 <= result.stats.n_generated <= 6          # stopped after the token being computed
    assert result.text == "".join(seen)
    saved = json.loads(conv.path(tmp_path).read_text())["messages"][-1]
    assert saved == {"role": "assistant", "content": result.text, "stopped": True}
    # the next turn continues after the stopped answer
    nxt = runner.answer("Thanks.", lambda s: None)
    assert nxt.text and not nxt.stopped


def test_stop_while_the_prompt_is_computed_takes_the_message_back(qwen_path, tmp_path):
    engine = _engine(qwen_path, n_batch=16)
    conv = Conversation(model="qwen", settings=GREEDY)
    runner = ChatRunner(engine, conv, tmp_path)
    runner._stop.set()       # as if Esc came before the first chunk (answer() clears it first)
    original = engine.prefill

    def prefill(ids, cache, seq=0, stop=None):
        runner.stop()
        return original(ids, cache, seq=seq, stop=stop)

    engine.prefill = prefill
    result = runner.answer("word " * 100, lambda s: None)
    assert result.stopped and result.text == "" and result.n_tokens == 0
    assert conv.messages == [] and conv.draft == "word " * 100
    saved = json.loads(conv.path(tmp_path).read_text())
    assert saved["messages"] == [] and saved["draft"] == "word " * 100


def test_a_conversation_longer_than_n_ctx_is_refused_and_left_unchanged(qwen_path, tmp_path):
    engine = _engine(qwen_path, n_ctx=64)
    conv = Conversation(model="qwen", settings=GREEDY)
    runner = ChatRunner(engine, conv, tmp_path)
    with pytest.raises(ContextLengthExceeded):
        runner.answer("tell me " * 80, lambda s: None)
    assert conv.messages == []


def test_a_session_file_of_another_model_is_replaced(qwen, gemma_path, tmp_path):
    gemma = _engine(gemma_path)
    raw = Conversation(model="gemma", mode="raw", settings=GREEDY)
    ChatRunner(gemma, raw, tmp_path).answer("The quick brown fox", lambda s: None)
    conv = Conversation(model="qwen", settings=GREEDY, id=raw.id + "-q")
    conv.session_path(tmp_path).write_bytes(raw.session_path(tmp_path).read_bytes())
    result = ChatRunner(qwen, conv, tmp_path).answer("Say hello.", lambda s: None)
    assert result.text and result.stats.n_restored == 0


def test_raw_mode_continues_the_text(gemma_path, tmp_path):
    gemma = _engine(gemma_path)
    conv = Conversation(model="gemma", mode="raw", settings=GREEDY)
    result = ChatRunner(gemma, conv, tmp_path).answer("The capital of France is", lambda s: None)
    assert conv.prompt_ids(gemma)[: result.stats.n_prompt] == gemma.raw_prompt("The capital of France is")
    assert result.text == _generate_text(gemma, gemma.raw_prompt("The capital of France is"), 24)


def test_files_round_trip_and_bad_files_are_named(tmp_path):
    conv = Conversation(model="m", system="s", settings=ChatSettings(temperature=0.2, seed=7),
                        messages=[{"role": "user", "content": "hi"}], title="greeting")
    conv.save(tmp_path)
    back = Conversation.load(conv.path(tmp_path))
    assert back == conv
    older = Conversation(model="m", id="20200101-000000-aaaa", updated="2020-01-01T00:00:00+00:00",
                         messages=[{"role": "user", "content": "old"}])
    older.save(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    assert [c.id for c in list_chats(tmp_path)][0] == conv.id     # newest first, bad files skipped
    assert find_chat("greeting", tmp_path).id == conv.id
    assert find_chat("20200101", tmp_path).id == older.id
    with pytest.raises(ChatError, match="no saved chat named 'nope'"):
        find_chat("nope", tmp_path)
    with pytest.raises(ChatError, match="broken.json: not a chat file"):
        Conversation.load(tmp_path / "broken.json")
    with pytest.raises(ChatError, match="broken.json: not a chat file"):   # named: says why
        find_chat("broken", tmp_path)
    damaged: list = []
    list_chats(tmp_path, damaged)
    assert sorted(p.name for p, _ in damaged) == ["broken.json", "other.json"]
    empty = Conversation(model="m")               # nothing said: no file, not listed
    assert not empty.save(tmp_path).exists()
    with pytest.raises(ChatError, match="not an edge chat file"):
        Conversation.load(tmp_path / "other.json")


def test_settings_parse_and_check_values():
    s = ChatSettings()
    assert s.with_value("temperature", "0.3").temperature == 0.3
    assert s.with_value("seed", "-1").seed is None and s.with_value("seed", "42").seed == 42
    assert s.with_value("max_tokens", "100").max_tokens == 100
    with pytest.raises(ChatError, match="temperature takes a number, got 'hot'"):
        s.with_value("temperature", "hot")
    with pytest.raises(ChatError, match="top_p must be"):
        s.with_value("top_p", "2")
    with pytest.raises(ChatError, match="max_tokens must be -1"):
        s.with_value("max_tokens", "-5")
    assert GenerationStats().n_generated == 0
