"""Session files (edge.session): a sequence saved by one engine and restored by another
continues exactly as the uninterrupted run; damaged, foreign or mismatched files are refused
with a clear error; an interrupted save leaves the old file whole."""
import os
import subprocess
import sys

import pytest

from edge.engine import Engine, GenerationStats
from edge.sampling import SamplingParams
from edge.session import SessionError, load_session
from tests.tiny_models import write_tiny_model

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 17, 3, 88, 42, 42, 7, 60, 9, 33, 91, 4, 14, 50, 61, 70, 11, 23]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_path(request, tmp_path_factory):
    kw = dict(arch="llama", head_dim=32) if request.param == "llama" else \
        dict(arch="gemma3", n_layer=6, head_dim=32, sliding_window=5, n_head=2, n_head_kv=1)
    return write_tiny_model(tmp_path_factory.mktemp("m") / f"{request.param}.gguf", **kw)


def _engine(path, **kw):
    return Engine(path, n_ctx=64, block_size=4, kv_storage="anon", **kw)


def _generate(engine, prompt, n, session=None):
    stats = GenerationStats()
    return list(engine.generate(prompt, GREEDY, n, stats, session=session)), stats


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_restored_session_continues_like_uninterrupted(model_path, tmp_path, kv_type):
    want, _ = _generate(_engine(model_path, cache_type_k=kv_type, cache_type_v=kv_type), PROMPT, 12)
    f = tmp_path / "s.session"
    first, stats = _generate(_engine(model_path, cache_type_k=kv_type, cache_type_v=kv_type), PROMPT, 12, f)
    assert first == want and stats.n_restored == 0 and f.is_file()
    # another engine (as another process would): the whole prompt comes from the file
    again, stats = _generate(_engine(model_path, cache_type_k=kv_type, cache_type_v=kv_type), PROMPT, 12, f)
    assert again == want and stats.n_restored == len(PROMPT)
    # a longer prompt that starts with the saved one: restore, compute the rest, save anew
    longer = PROMPT + want[:5]
    cont, stats = _generate(_engine(model_path, cache_type_k=kv_type, cache_type_v=kv_type), longer, 7, f)
    assert stats.n_restored == len(PROMPT) and cont == want[5:]
    assert load_session(f, _engine(model_path, cache_type_k=kv_type, cache_type_v=kv_type)).tokens.tolist() == longer


def test_other_prompt_replaces_the_session(model_path, tmp_path):
    f = tmp_path / "s.session"
    _generate(_engine(model_path), PROMPT, 2, f)
    other = [2, 9, 9, 9, 9, 9]   # nothing in common
    got, stats = _generate(_engine(model_path), other, 4, f)
    assert stats.n_restored == 0 and stats.session_replaced and got == _generate(_engine(model_path), other, 4)[0]
    assert load_session(f, _engine(model_path)).tokens.tolist() == other


def test_shared_prefix_of_another_prompt_is_reused(model_path, tmp_path):
    """As llama.cpp's --prompt-cache: a prompt that shares its first tokens with the session
    restores those (the last prompt token is always computed, for its logits), then the file
    holds the new prompt. Gemma's window layers (window 5) keep only the last 4 positions of a
    19-token session, so a 10-token prefix cannot come from it; a session shorter than the
    window keeps every position."""
    gemma = "gemma3" in str(model_path)
    f = tmp_path / "s.session"
    _generate(_engine(model_path), PROMPT, 2, f)
    for prompt, n_restored in ((PROMPT[:10] + [2, 2, 2], 0 if gemma else 10),
                               (PROMPT[:7], 0 if gemma else 6)):
        _generate(_engine(model_path), PROMPT, 2, f)          # the file holds PROMPT again
        got, stats = _generate(_engine(model_path), prompt, 6, f)
        assert got == _generate(_engine(model_path), prompt, 6)[0]
        # a prompt that starts the saved one leaves the file (llama.cpp saves only new tokens)
        starts_saved = PROMPT[: len(prompt)] == prompt
        assert (stats.n_restored, stats.session_replaced) == (n_restored, not starts_saved), prompt
        assert load_session(f, _engine(model_path)).tokens.tolist() == (PROMPT if starts_saved else prompt)
    short, f2 = PROMPT[:4], tmp_path / "short.session"       # shorter than Gemma's window
    _generate(_engine(model_path), short, 2, f2)
    got, stats = _generate(_engine(model_path), short[:3] + [8, 8], 6, f2)
    assert stats.n_restored == 3 and got == _generate(_engine(model_path), short[:3] + [8, 8], 6)[0]


def test_prompt_of_n_ctx_tokens_gets_one_token(model_path):
    """A prompt that fills the context still gets its one token (the sampled token needs no
    KV cell), finish reason length; one more token is an error naming both numbers."""
    from edge.engine import ContextLengthExceeded
    prompt = (PROMPT * 4)[:64]
    got, stats = _generate(_engine(model_path), prompt, 5)
    assert len(got) == 1 and stats.finish_reason == "length" and stats.context_full
    with pytest.raises(ContextLengthExceeded, match="the prompt has 65 tokens but the context size .* is 64"):
        _generate(_engine(model_path), prompt + [1], 5)


def test_damaged_and_foreign_files_are_refused(model_path, tmp_path):
    f = tmp_path / "s.session"
    _generate(_engine(model_path), PROMPT, 1, f)
    raw = f.read_bytes()
    cases = {
        "flip": (raw[:200] + bytes([raw[200] ^ 1]) + raw[201:], "truncated or corrupted"),
        "short": (raw[:-100], "truncated or corrupted"),
        "text": (b"hello, this is not a session at all" * 4, "not an edge session file"),
        "version": (raw[:8] + (7).to_bytes(4, "little") + raw[12:], "version 7 is not supported"),
    }
    for name, (data, message) in cases.items():
        bad = tmp_path / f"{name}.session"
        bad.write_bytes(data)
        with pytest.raises(SessionError, match=message):
            _generate(_engine(model_path), PROMPT, 1, bad)
        assert bad.read_bytes() == data, name          # a refused file is not overwritten
    with pytest.raises(SessionError, match="not a regular file"):
        _generate(_engine(model_path), PROMPT, 1, "/dev/zero")     # endless: must not be read
    link = tmp_path / "link.session"
    link.symlink_to(f)
    _generate(_engine(model_path), PROMPT[:-2] + [2], 1, link)    # another prompt: replaced through the link
    assert link.is_symlink() and load_session(f, _engine(model_path)).tokens.tolist() == PROMPT[:-2] + [2]
    _generate(_engine(model_path), PROMPT, 1, f)
    with pytest.raises(SessionError, match="KV cache types f16/f16 in the file, this run uses q8_0/f16"):
        _generate(_engine(model_path, cache_type_k="q8_0"), PROMPT, 1, f)
    other = write_tiny_model(tmp_path / "other.gguf", arch="llama", head_dim=32, seed=5)
    with pytest.raises(SessionError, match="made with model"):
        _generate(_engine(other), PROMPT, 1, f)


def test_interrupted_save_keeps_the_old_file(model_path, tmp_path, monkeypatch):
    f = tmp_path / "s.session"
    _generate(_engine(model_path), PROMPT, 1, f)
    before = f.read_bytes()

    def fail(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        _generate(_engine(model_path), PROMPT[:-3] + [5, 5, 5], 1, f)
    assert f.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.session"]


def test_real_model_session_across_processes(qwen_path, tmp_path):
    """`edge run --session`: one process saves, another restores the whole prompt (no
    prefill) and prints the uninterrupted run's greedy text."""
    f = tmp_path / "q.session"
    cmd = [sys.executable, "-m", "edge.cli", "run", "-m", str(qwen_path), "-n", "24", "--temp", "0",
           "Write a Python function that reverses a string."]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    first = subprocess.run(cmd + ["--session", str(f)], capture_output=True, text=True, timeout=600)
    second = subprocess.run(cmd + ["--session", str(f)], capture_output=True, text=True, timeout=600)
    assert plain.returncode == first.returncode == second.returncode == 0, second.stderr
    assert first.stdout == second.stdout == plain.stdout
    assert "restored" not in first.stderr
    assert "39 prompt tokens restored from" in second.stderr
