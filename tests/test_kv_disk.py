"""The KV pool file on a full or read-only file system (issue 14).

$EDGE_HOME is a real tmpfs of a few hundred KiB, mounted in a private mount namespace of the
command under test (``unshare -m`` as root, ``unshare -rm`` otherwise), so that a context
needs more disk than there is: ``edge run`` prints one error line and exits 1 (it died of
SIGBUS when the pool's pages got their disk blocks on first write; also when it restores a
session), ``edge serve`` answers that request 503 and goes on serving, ``edge chat`` shows the
error and takes the next message. A read-only $EDGE_HOME puts the pool in anonymous memory. The tiny random llama
model has 4 KiB of K/V per token: a 16-token block is 64 KiB over its 2 layers.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_process import Server, sse_events, start_post
from tests.tiny_models import write_tiny_model

BLOCK = 64 * 1024                     # bytes of one 16-token block over all pools of the tiny model
LONG = "hello world " * 10            # 163 tokens: 11 blocks, 704 KiB
NO_ROOM = "free some space there or set EDGE_HOME to a folder on a file system with room"


@functools.cache
def _unshare_flags() -> tuple[str, ...] | None:
    """unshare's flags that give a command a private mount namespace where it may mount a
    tmpfs, or None when this machine allows neither."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for flags in ((("-m",),) if os.geteuid() == 0 else ()) + (("-rm",),):
            try:
                r = subprocess.run(["unshare", *flags, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', d],
                                   capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                return None
            if r.returncode == 0:
                return flags
    return None


def _in_tmpfs(home: Path, options: str) -> list[str]:
    """The argv prefix that runs a command with a new tmpfs (mount ``options``) at ``home``."""
    flags = _unshare_flags()
    if flags is None:
        pytest.skip("cannot mount a tmpfs: needs root (unshare -m) or unprivileged user namespaces (unshare -rm)")
    home.mkdir(exist_ok=True)
    return ["unshare", *flags, "sh", "-c", 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"', "sh",
            options, str(home)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kv_disk") / "tiny.gguf"
    return write_tiny_model(path, arch="llama", head_dim=256, n_head=2, n_head_kv=2, n_embd=64)


def _edge(prefix: list[str], home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGE_HOME": str(home), "NUMBA_NUM_THREADS": "1"}
    return subprocess.run([*prefix, sys.executable, "-m", "edge.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _n_tokens(model: Path, text: str) -> int:
    from edge.engine import Engine
    return len(Engine(model, n_ctx=256, kv_storage="anon").raw_prompt(text))


def test_run_on_a_full_file_system_is_one_error_line(tiny, tmp_path):
    """A prompt whose K/V needs more than the 256 KiB of the file system: one line, exit 1
    (on 03fa838: SIGBUS, status -7, no message). A short prompt on the same file system runs."""
    home = tmp_path / "home"
    run = ["run", "-m", str(tiny), "--raw", "-c", "256", "-n", "4", "--temp", "0"]
    r = _edge(_in_tmpfs(home, "size=256k"), home, *run, "-p", LONG)
    needed = -(-_n_tokens(tiny, LONG) // 16) * BLOCK
    assert (r.returncode, r.stdout) == (1, ""), r.stderr
    assert r.stderr.splitlines()[-1] == (f"edge run: error: no space for the KV cache in {home}/kv (No space left on "
                                         f"device): the next step needs {needed // 1024}.0 KiB more, 256.0 KiB are "
                                         f"free; {NO_ROOM}")
    assert "Traceback" not in r.stderr
    r = _edge(_in_tmpfs(home, "size=256k"), home, *run, "-p", "hello")
    assert r.returncode == 0 and "generated: 4 tokens" in r.stderr, r.stderr


def test_session_restore_on_a_full_file_system(tiny, tmp_path):
    """Restoring a session writes its K/V into the pool: with no room for it, the same error
    line (on 03fa838: SIGBUS)."""
    session = tmp_path / "s.session"
    run = ["run", "-m", str(tiny), "--raw", "-c", "256", "-n", "2", "--temp", "0", "-p", LONG, "--session",
           str(session)]
    assert _edge([], tmp_path / "roomy", *run).returncode == 0 and session.is_file()
    home = tmp_path / "home"
    r = _edge(_in_tmpfs(home, "size=256k"), home, *run)
    needed = -(-_n_tokens(tiny, LONG) // 16) * BLOCK      # the whole saved prompt
    assert (r.returncode, r.stdout) == (1, ""), r.stderr
    assert r.stderr.splitlines()[-1] == (f"edge run: error: no space for the KV cache in {home}/kv (No space left on "
                                         f"device): the next step needs {needed // 1024}.0 KiB more, 256.0 KiB are "
                                         f"free; {NO_ROOM}")


@pytest.mark.slow
def test_default_model_runs_out_of_disk_while_decoding(qwen_path, tmp_path):
    """The default model with q8_0 K/V (one layer's block is 2176 bytes: blocks share pages)
    on a 512 KiB file system: the prompt fits, the disk runs out a few tokens in. The text so
    far is the text of a run with room, then one error line of its own, exit 1."""
    home = tmp_path / "home"
    run = ["run", "-m", str(qwen_path), "-ctk", "q8_0", "-ctv", "q8_0", "-c", "512", "-n", "20", "--temp", "0",
           "-p", "Count from 1 to 100, separated by spaces."]
    full = _edge(_in_tmpfs(home, "size=512k"), home, *run)
    roomy = _edge([], tmp_path / "roomy", *run)
    assert roomy.returncode == 0 and "generated: 20 tokens" in roomy.stderr, roomy.stderr
    assert full.returncode == 1 and full.stdout and roomy.stdout.startswith(full.stdout), (full.stdout, roomy.stdout)
    assert full.stderr.splitlines()[-2:] == ["", f"edge run: error: no space for the KV cache in {home}/kv (No space "
                                                 f"left on device): the next step needs 102.0 KiB more, 0 B are free; "
                                                 f"{NO_ROOM}"]


def test_run_with_a_read_only_edge_home(tiny, tmp_path):
    """Nothing of the pool outlives the process: with $EDGE_HOME read-only it is anonymous
    memory, and the answer is the same (on 03fa838: "error: .../kv: Read-only file system")."""
    home = tmp_path / "home"
    run = ["run", "-m", str(tiny), "--raw", "-c", "256", "-n", "8", "--temp", "0", "-p", "hello"]
    ro = _edge(_in_tmpfs(home, "ro,size=256k"), home, *run)
    rw = _edge([], tmp_path / "rw", *run)
    assert ro.returncode == 0 and "generated: 8 tokens" in ro.stderr, ro.stderr
    assert ro.stdout == rw.stdout and rw.stdout


def _complete(srv: Server, prompt: list[int], stream: bool = False):
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": stream}
    status, _, raw = srv.request("POST", "/v1/completions", body)
    return status, raw if stream else json.loads(raw)


def _room(srv: Server, home: Path) -> Path:
    """``home`` as the server process sees it (its own mount namespace)."""
    return Path(f"/proc/{srv.proc.pid}/root{home}")


def test_serve_on_a_full_file_system(tiny, tmp_path):
    """A request whose K/V does not fit the 512 KiB file system gets a 503 in the OpenAI error
    shape (streamed: an error event) once the free blocks have given their space back, its
    blocks are freed, and the server serves the next ones; when the disk fills from outside,
    a request fails the same way and succeeds once the space is back (on 03fa838 the first
    long prompt killed the server with SIGBUS)."""
    home = tmp_path / "home"
    srv = Server(["-m", str(tiny), "-np", "2", "-c", "256"], tmp_path / "serve.log",
                 prefix=_in_tmpfs(home, "size=512k"), env={"EDGE_HOME": str(home)})
    try:
        srv.wait_ready(60)
        status, body = _complete(srv, list(range(1, 21)))          # 20 + 3 positions: 2 blocks
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        long = [50 + i % 40 for i in range(200)]                     # 200 positions: 13 blocks
        status, body = _complete(srv, long)
        assert (status, body) == (503, {"error": {
            "message": f"no space for the KV cache in {home}/kv (No space left on device): the next step needs "
                       f"{13 * BLOCK // 1024}.0 KiB more, 512.0 KiB are free; {NO_ROOM}",
            "type": "server_error", "param": None, "code": "insufficient_storage"}})
        status, raw = _complete(srv, long, stream=True)
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        assert status == 200 and events[-1]["error"]["code"] == "insufficient_storage", raw
        assert srv.wait_idle()["edge_kv_blocks_used"] == 0
        status, body = _complete(srv, list(range(1, 21)))
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body

        filler = _room(srv, home) / "filler"                          # the disk fills from outside
        with open(filler, "wb") as f:
            try:
                f.write(b"x" * (512 * 1024))
            except OSError:
                pass
        medium = [2 + i % 40 for i in range(100)]                    # 7 blocks: 448 KiB
        status, body = _complete(srv, medium)
        assert status == 503 and body["error"]["code"] == "insufficient_storage", body
        filler.unlink()
        status, body = _complete(srv, medium)
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        assert srv.get("/health") == (200, {"status": "ok"}) and srv.proc.poll() is None
    finally:
        srv.stop()


def test_serve_a_request_without_room_leaves_a_running_one_alone(tiny, tmp_path):
    """While a stream decodes, a request whose K/V cannot fit gets its 503; the stream goes on
    to its last token with the text it has alone. The disk is filled from outside to 316 KiB
    free: always room for the stream's 4 blocks, never for the other's 13, in whichever order
    the scheduler gets to them."""
    home = tmp_path / "home"
    srv = Server(["-m", str(tiny), "-np", "2", "-c", "256"], tmp_path / "serve.log",
                 prefix=_in_tmpfs(home, "size=1m"), env={"EDGE_HOME": str(home)})
    try:
        srv.wait_ready(60)
        (_room(srv, home) / "filler").write_bytes(b"x" * (704 * 1024))
        stream = {"prompt": [1, 2, 3, 4], "max_tokens": 60, "temperature": 0, "stream": True,
                  "logit_bias": {"2": -100}}                          # no end-of-generation token: 60 tokens
        conn = start_post(srv, "/v1/completions", stream)
        response = conn.getresponse()
        first = response.readline()
        assert response.status == 200 and first.startswith(b"data: {"), first
        status, body = _complete(srv, [50 + i % 40 for i in range(200)])
        assert status == 503 and body["error"]["code"] == "insufficient_storage", body
        events = sse_events(first + response.read())
        conn.close()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        status, _, raw = srv.request("POST", "/v1/completions", {**stream, "stream": False})
        alone = json.loads(raw)
        assert status == 200 and alone["usage"]["completion_tokens"] == 60, alone
        assert ("".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]) == (alone["choices"][0]["text"], "length")
    finally:
        srv.stop()


def test_serve_with_a_read_only_edge_home(tiny, tmp_path):
    """On 03fa838 the model never loaded (/health 503: the pool folder could not be made)."""
    home = tmp_path / "home"
    srv = Server(["-m", str(tiny), "-np", "2", "-c", "256"], tmp_path / "serve.log",
                 prefix=_in_tmpfs(home, "ro,size=64k"), env={"EDGE_HOME": str(home)})
    try:
        srv.wait_ready(60)
        status, body = _complete(srv, [50 + i % 40 for i in range(200)])
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    finally:
        srv.stop()


_CHAT_APP = """
import asyncio, json, sys
from pathlib import Path
from edge.chat import ChatSettings
from tui.app import ChatApp, ChatInput, ChatOptions, Note

async def main(model, folder, long):
    app = ChatApp(ChatOptions(model=model, settings=ChatSettings(temperature=0.0, max_tokens=4), n_ctx=256,
                              folder=Path(folder)))
    out = {}
    async with app.run_test(size=(80, 24)) as pilot:
        while app.runner is None or app.loading:
            await pilot.pause(0.05)
        for key, text in (("long", long), ("short", "hello")):
            box = app.query_one("#input", ChatInput)
            box.text = text
            before = app.turns_ended
            await pilot.press("enter")
            while app.turns_ended == before:
                await pilot.pause(0.05)
            out[key] = {"errors": [str(n.content) for n in app.query(Note) if str(n.content).startswith("no space")],
                        "input": box.text, "messages": [m["role"] for m in app.conversation.messages]}
    print(json.dumps(out))

asyncio.run(main(*sys.argv[1:]))
"""


def test_chat_on_a_full_file_system_keeps_the_app_usable(tiny, tmp_path):
    """edge chat: the message whose K/V does not fit is refused with the error as a note and
    put back in the input box; the next message is answered (in the space the refused
    message's first chunk took). On 03fa838 the app died of SIGBUS."""
    home = tmp_path / "home"
    env = {**os.environ, "EDGE_HOME": str(home), "NUMBA_NUM_THREADS": "1"}
    r = subprocess.run([*_in_tmpfs(home, "size=256k"), sys.executable, "-c", _CHAT_APP, str(tiny),
                        str(tmp_path / "chats"), LONG], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    # edge chat prefills 64 tokens (4 blocks, 256 KiB) at a time: the first chunk fills the disk
    error = (f"no space for the KV cache in {home}/kv (No space left on device): the next step needs 256.0 KiB "
             f"more, 0 B are free; {NO_ROOM}; then send your message again")
    assert out == {"long": {"errors": [error], "input": LONG, "messages": []},
                   "short": {"errors": [error], "input": "", "messages": ["user", "assistant"]}}


_WINDOW = """
import json, os, sys
import numpy as np
from edge.gguf_file import GGUFFile
from edge.kv.cache import PagedKVCache
from edge.models import load_model

model = load_model(GGUFFile(sys.argv[1]))
cache = PagedKVCache(model.args, 1024, block_size=16, home=sys.argv[2])
s, _ = cache.new_sequence(list(range(1, 65)))
used = []
for i in range(0, 64, 16):
    model.forward(list(range(1 + i, 17 + i)), cache, seq_ids=np.zeros(16, int))
    st = os.fstatvfs(cache._file.fileno())
    used.append((st.f_blocks - st.f_bfree) * st.f_frsize)
print(json.dumps({"storage": cache.storage, "used": used, "backed": np.flatnonzero(cache._backed[1]).tolist(),
                  "table": cache.manager.block_table(s, 1).tolist()}))
"""


def test_window_blocks_give_their_disk_space_back(tmp_path):
    """Gemma's sliding-window blocks get disk space when written and give it back when they
    leave the window (hole punched; backed again when reused): on a 1 MiB tmpfs the pool holds
    the full-attention blocks and the window's."""
    model = write_tiny_model(tmp_path / "g.gguf", arch="gemma3", n_layer=6, head_dim=256, sliding_window=32,
                             n_head=1, n_head_kv=1)
    home = tmp_path / "home"
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    r = subprocess.run([*_in_tmpfs(home, "size=1m"), sys.executable, "-c", _WINDOW, str(model), str(home)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    per_block = 16 * 256 * 2 * 2                 # K and V of one layer, f16
    # layer 5 of 6 attends to everything, 0..4 to a window of 32. After block k is written:
    # k + 1 global blocks; the window (positions p-31..p) keeps blocks 0 and 1 at 32 tokens,
    # 1 and 2 at 48, 2 and 3 at 64
    assert out == {"storage": "file", "used": [(k + 1) * per_block + min(k + 1, 2) * 5 * per_block for k in range(4)],
                   "backed": [2, 3], "table": [-1, -1, 2, 3]}


def test_pool_storage_falls_back_to_anonymous_memory(tmp_path, monkeypatch):
    """Where $EDGE_HOME/kv cannot hold a pool file (a file in the way) or its file system cannot
    allocate ahead (posix_fallocate: EOPNOTSUPP, as tmpfs-less FUSE or musl without emulation),
    the pool is anonymous memory; a file system that is full right now keeps the file (the
    forward that needs space says so)."""
    import errno

    from edge.gguf_file import GGUFFile
    from edge.kv.cache import PagedKVCache
    from edge.models import load_model

    args = load_model(GGUFFile(write_tiny_model(tmp_path / "l.gguf", arch="llama"))).args
    (tmp_path / "file").write_text("not a folder")
    assert PagedKVCache(args, 64, home=tmp_path / "file").storage == "anon"
    assert PagedKVCache(args, 64, home=tmp_path / "ok").storage == "file"
    for code, storage in ((errno.EOPNOTSUPP, "anon"), (errno.ENOSPC, "file")):
        def refuse(fd, offset, length, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "posix_fallocate", refuse)
        assert PagedKVCache(args, 64, home=tmp_path / "ok").storage == storage
    assert list((tmp_path / "ok" / "kv").iterdir()) == []
