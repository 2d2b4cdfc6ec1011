"""Atomic writes and the temporary files of killed processes (edge.files; issue 14).

A session save and a conversation save are killed with SIGKILL while their temporary file is
written (their os.fsync hangs): the next save in that folder removes what they left, and
never the file of a writer that still runs.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import kill_when_printed
from tests.tiny_models import write_tiny_model

_HANG_IN_FSYNC = """
import os, sys, time
def _hang(fd):
    print("fsync", flush=True)
    time.sleep(600)
os.fsync = _hang
"""


def _kill_in_fsync(code: str, *args: str) -> int:
    """Run ``code`` in a child Python whose os.fsync says so and hangs; SIGKILL the child
    then (its temporary file is written, not yet renamed). Returns the child's pid."""
    return kill_when_printed([sys.executable, "-c", _HANG_IN_FSYNC + code, *args], "fsync")


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_remove_dead_temps_keeps_live_writers_and_other_files(tmp_path):
    from edge.files import make_temp, remove_dead_temps

    dead = _dead_pid()
    gone = [tmp_path / f".out.gguf.pid{dead}.0a1b.partial", tmp_path / f".other.pid{dead}.ff.partial"]
    gone[0].write_bytes(b"x")
    gone[1].mkdir()
    (gone[1] / "part1.whl").write_bytes(b"y")
    kept = [tmp_path / ".out.gguf.pid1.0a1b.partial", make_temp(tmp_path / "out.gguf"),   # alive: init, us
            tmp_path / f".out.gguf.pid{dead}.partial", tmp_path / f"out.gguf.pid{dead}.0a.partial",
            tmp_path / "out.gguf"]
    for p in kept:
        p.touch()
    assert kept[1].name.startswith(f".out.gguf.pid{os.getpid()}.")
    assert remove_dead_temps(tmp_path, "out.gguf") == [gone[0]]
    assert remove_dead_temps(tmp_path) == [gone[1]]
    assert sorted(tmp_path.iterdir()) == sorted(kept)


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    from edge.files import atomic_write

    dest = tmp_path / "f.txt"
    dest.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(dest) as tmp:
            tmp.write_text("new, half")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"] and dest.read_text() == "old"
    with atomic_write(dest) as tmp:
        tmp.write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"] and dest.read_text() == "new"
    assert dest.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_SESSION_SAVE = """
from edge.engine import Engine
from edge.sampling import SamplingParams
engine = Engine(sys.argv[1], n_ctx=64, block_size=4, kv_storage="anon")
list(engine.generate([1, 5, 17, 3, 88], SamplingParams(temperature=0.0), 1, session=sys.argv[2]))
"""


def test_a_killed_session_save_is_cleaned_by_the_next_save(tmp_path):
    """On 03fa838 the killed save's .s.session.tmp-PID stayed forever."""
    from edge.engine import Engine
    from edge.sampling import SamplingParams

    model = write_tiny_model(tmp_path / "m.gguf", arch="llama", head_dim=32)
    folder = tmp_path / "sessions"
    folder.mkdir()
    session = folder / "s.session"
    pid = _kill_in_fsync(_SESSION_SAVE, str(model), str(session))
    (left,) = folder.iterdir()
    assert "s.session" in left.name and str(pid) in left.name and left.stat().st_size > 0
    running = folder / f".s.session.pid{os.getppid()}.0a1b.partial"     # a writer still alive: kept
    running.touch()
    engine = Engine(model, n_ctx=64, block_size=4, kv_storage="anon")
    list(engine.generate([1, 5, 17, 3, 88], SamplingParams(temperature=0.0), 1, session=session))
    assert sorted(p.name for p in folder.iterdir()) == sorted([running.name, "s.session"])


_CHAT_SAVE = """
from pathlib import Path
from edge.chat import Conversation
conv = Conversation(model="m", messages=[{"role": "user", "content": "hi"}])
conv.save(Path(sys.argv[1]))
"""


def test_a_killed_conversation_save_is_cleaned_by_the_next_save(tmp_path):
    """Any conversation's save removes what killed saves left in the chats folder (on
    03fa838 a .ID.json.tmp-PID stayed forever)."""
    from edge.chat import Conversation

    pid = _kill_in_fsync(_CHAT_SAVE, str(tmp_path))
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".") and str(pid) in left.name
    conv = Conversation(model="m", messages=[{"role": "user", "content": "hello"}])
    path = conv.save(tmp_path)
    assert list(tmp_path.iterdir()) == [path]
