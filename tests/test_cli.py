"""The `edge` command line: usage errors belong to the command that was given."""
import pytest

from edge.cli import main


@pytest.mark.parametrize("argv, unknown", [(["run", "--bogus", "hi"], "--bogus"), (["run", "hi", "--bogus"], "--bogus"),
                                           (["serve", "--nope"], "--nope"), (["list", "extra"], "extra"),
                                           (["quantize", "a.gguf", "b.gguf", "Q8_0", "--x"], "--x")])
def test_unknown_option_is_the_commands_usage_error(argv, unknown, capsys):
    """`edge run --bogus` prints edge run's usage and `edge run: error: unrecognized arguments`,
    as `edge run -n abc` does, exit status 2; not the top-level `edge` usage."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: edge {argv[0]} ")
    assert err.splitlines()[-1] == f"edge {argv[0]}: error: unrecognized arguments: {unknown}"


def test_unknown_command_is_the_top_level_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bogus"])
    assert exc.value.code == 2
    assert "edge: error: argument COMMAND: invalid choice: 'bogus'" in capsys.readouterr().err


def test_serve_exits_when_the_model_fails_to_load(tmp_path):
    """A model that does not load (here an architecture edge lacks) ends `edge serve` with one
    error line and exit 1, as `edge run` does, instead of a server answering 503 for ever."""
    import subprocess
    import sys

    from edge.models import ARCHITECTURES
    from tests.tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / "mixtral.gguf", arch="mixtral")
    proc = subprocess.run([sys.executable, "-m", "edge.cli", "serve", "-m", str(path), "--unix-socket", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"edge serve: error: {path}: architecture 'mixtral' is not supported "
                      f"(supported: {', '.join(sorted(ARCHITECTURES))})"]
    assert "Traceback" not in proc.stderr


def test_server_state_reports_a_load_failure_once(tmp_path):
    """ServerState.load keeps the error for /health and hands it to on_load_error (once); a
    config without the callback only keeps it."""
    from edge.server.app import ServerConfig, ServerState

    missing = str(tmp_path / "none.gguf")
    got: list[str] = []
    state = ServerState(ServerConfig(model=missing, on_load_error=got.append))
    state.load()
    assert got == [f"file not found: {missing}"]     # a path-like name is a path only
    assert state.load_error == f"StoreError: {got[0]}" and state.scheduler is None
    state = ServerState(ServerConfig(model=missing))
    state.load()
    assert state.load_error == f"StoreError: {got[0]}"


# ------------------------------------------------------------------ a newcomer's first hour
import http.server
import re
import json
import os
import socket
import subprocess
import sys
import threading

from gguf import GGMLQuantizationType as Q

from tests.tiny_models import write_tiny_model


def _edge(*argv, env=None, input=None, timeout=120):
    """`python -m edge.cli ARGV` in a subprocess: the real command, its exit status and output."""
    return subprocess.run([sys.executable, "-m", "edge.cli", *argv], capture_output=True, text=True, timeout=timeout,
                          input=input, env={**os.environ, **(env or {})}, check=False)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An EDGE_HOME of tiny fixture models: tiny (Q8_0 matrices, a license and a chat template)
    and an hf.co file with its manifest; never the real store."""
    home = tmp_path / "home"
    models = home / "models"
    models.mkdir(parents=True)
    write_tiny_model(models / "tiny.gguf", types={r: Q.Q8_0 for r in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                       "ffn_gate", "ffn_up", "ffn_down")},
                     n_embd=64, metadata={"general.license": "apache-2.0", "general.file_type": 7,
                                          "tokenizer.chat_template": "\n".join(f"line {i}" for i in range(12))})
    write_tiny_model(models / "hf.co--alice--Tiny-GGUF--Q8_0.gguf")
    (models / ".hf.co--alice--Tiny-GGUF--Q8_0.hf.json").write_text("{}")
    monkeypatch.setenv("EDGE_HOME", str(home))
    return models


def test_edge_alone_prints_the_help():
    proc = _edge()
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("usage: edge ") and "run " in proc.stdout and "Start with: edge run" in proc.stdout


def test_list_fits_80_columns_with_the_file_type(store, capsys):
    (store / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 64)     # its error is cut to fit too
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "TYPE", "SIZE", "PARAMS", "ARCH"]
    assert all(len(line) <= 80 for line in lines), lines
    rows = {line.split()[0]: line.split() for line in lines[1:] if not line.startswith("available")}
    assert rows["tiny"][1] == "Q8_0" and rows["tiny"][-1] == "llama"
    assert rows["hf.co/alice/Tiny-GGUF:Q8_0"][1] == "F32"     # no general.file_type: the tensors' type
    assert rows["broken"][1:5] == ["?", "0", "kB", "unreadable:"]
    assert any(line.startswith("available to pull: qwen2.5-coder-0.5b-instruct") for line in lines)


def test_show_prints_what_ollama_show_does(store, capsys):
    from edge.gguf_file import GGUFFile

    n_params = sum(t.n_elements for t in GGUFFile(store / "tiny.gguf").tensors.values())
    assert main(["show", "tiny"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines() if not line.startswith("    file "))   # a path is a path
    for key, value in (("architecture", "llama"), ("parameters", f"{n_params / 1e3:.2f}K"), ("quantization", "Q8_0"),
                       ("context length", "256"), ("embedding length", "64")):
        assert f"    {key:<18}{value}\n" in out, (key, out)
    assert "  Chat template\n    line 0\n" in out and "    line 7\n" in out and "line 8\n" not in out
    assert "4 more lines (edge show tiny --template)" in out
    assert "  License\n    apache-2.0\n" in out
    assert main(["show", "tiny", "--template"]) == 0
    assert capsys.readouterr().out == "\n".join(f"line {i}" for i in range(12)) + "\n"
    assert main(["show", "qwen2.5-coder-1.5b-instruct"]) == 1      # not pulled here: nothing is downloaded
    assert capsys.readouterr().err == ("edge show: error: model qwen2.5-coder-1.5b-instruct is not pulled; run: "
                                       "edge pull qwen2.5-coder-1.5b-instruct\n")


def test_rm_removes_from_the_store_only(store, tmp_path, capsys):
    outside = tmp_path / "outside.gguf"
    write_tiny_model(outside)
    (store / "linked.gguf").symlink_to(outside)
    assert main(["rm", "tiny", "hf.co/alice/Tiny-GGUF:Q8_0", "linked"]) == 0
    assert capsys.readouterr().out == "deleted tiny\ndeleted hf.co/alice/Tiny-GGUF:Q8_0\ndeleted linked\n"
    assert sorted(p.name for p in store.iterdir()) == [] and outside.is_file()   # the link, not its target
    for name in ("tiny", "..", "qwen2.5-coder-0.5b-instruct"):
        assert main(["rm", name]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"edge rm: error: no pulled model named {name!r}; pulled models: none"), err
        assert err.count("\n") == 1
    for name in (str(outside), "../outside"):           # a path is refused as a path
        assert main(["rm", name]) == 1
        assert capsys.readouterr().err == (f"edge rm: error: {name} is a path: give the model's name as `edge list` "
                                           f"shows it (only files in the store, {store}, are removed)\n")
    assert outside.is_file()
    write_tiny_model(store / "tiny.gguf")             # a path into the store: its name is the hint
    assert main(["rm", str(store / "tiny.gguf")]) == 1
    assert capsys.readouterr().err.startswith(f"edge rm: error: {store / 'tiny.gguf'} is a path: give the model's "
                                              "name: tiny (only files")
    assert main(["rm", "tin"]) == 1                   # a typo: the name it is closest to
    assert "no pulled model named 'tin' (did you mean 'tiny'?); pulled models: tiny" in capsys.readouterr().err
    assert main(["rm", "tiny"]) == 0 and capsys.readouterr().out == "deleted tiny\n"


def test_a_missing_path_is_file_not_found_not_a_registry_error(tmp_path):
    for arg, want in ((str(tmp_path / "nope.gguf"), f"file not found: {tmp_path / 'nope.gguf'}"),
                      ("nope.gguf", "file not found: nope.gguf"), ("./models/x", "file not found: ./models/x"),
                      (str(tmp_path), f"{tmp_path}: is a directory, not a .gguf file")):
        proc = _edge("run", "-m", arg, "hi", env={"EDGE_HOME": str(tmp_path / "home")})
        assert proc.returncode == 1 and proc.stderr == f"edge run: error: {want}\n", proc.stderr


class _FakeServer(http.server.BaseHTTPRequestHandler):
    answers: dict = {}

    def do_GET(self):  # noqa: N802
        status, body = self.answers.get(self.headers.get("Authorization"), self.answers[None])
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ps_lists_what_the_server_has_loaded(fake_server, capsys):
    port = str(fake_server)
    model = {"id": "qwen2.5-coder-0.5b-instruct", "object": "model", "created": 0, "owned_by": "edge",
             "status": "loaded", "meta": {"n_ctx": 4096, "architecture": "qwen2"}}
    _FakeServer.answers = {None: (401, {"error": {"message": "no key"}}),
                           "Bearer k": (200, {"object": "list", "data": [model, {**model, "id": "gemma-3-270m",
                                                                                 "status": "unloaded"}]})}
    assert main(["ps", "--port", port, "--api-key", "k"]) == 0
    assert capsys.readouterr().out.splitlines() == [       # the pulled but unloaded gemma is not shown
        "NAME                         CREATED  STATUS  N_CTX  ARCHITECTURE",
        "qwen2.5-coder-0.5b-instruct  0        loaded  4096   qwen2"]
    assert main(["ps", "--port", port]) == 1
    assert "wants an API key: --api-key KEY or EDGE_API_KEY" in capsys.readouterr().err
    _FakeServer.answers = {None: (503, {"error": {"message": "the model is loading; retry shortly"}})}
    assert main(["ps", "--port", port]) == 0
    assert capsys.readouterr().out == (f"the edge server on 127.0.0.1:{port} has no model ready: "
                                       "the model is loading; retry shortly\n")
    _FakeServer.answers = {None: (404, b"<html>not found</html>")}
    assert main(["ps", "--port", port]) == 1
    assert "but not as an edge server does (HTTP 404)" in capsys.readouterr().err


def test_ps_without_a_server():
    port = _free_port()
    proc = _edge("ps", "--port", str(port))
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"no edge server is running on 127.0.0.1:{port}\n")
    proc = _edge("ps")
    if proc.returncode == 1:        # unless a developer's edge serve is running on 8080
        assert proc.stderr == "no edge server is running on 127.0.0.1:8080\n"


def test_download_bars_fit_80_columns_and_show_the_total():
    """The pull's bars, under one line naming the model: each line fits 80 columns and shows
    the bytes done of the total."""
    import io
    import re

    from rich.console import Console

    from edge.cli.models import download_bars

    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    with download_bars("qwen2.5-coder-1.5b-instruct", console) as bars:
        download = bars.add_task("download", total=1_117_320_768)
        join = bars.add_task("join", total=1_117_320_768)
        bars.update(download, completed=558_000_000, description="download 11/22")
        bars.update(join, completed=500_000_000, description="join 10/22")
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue()).replace("\r", "\n")
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0] == "pulling qwen2.5-coder-1.5b-instruct"
    assert all(len(line) <= 80 for line in lines), lines
    assert any(line.startswith("download 11/22") and "0.6/1.1 GB" in line for line in lines), lines
    assert any(line.startswith("join 10/22") and "0.5/1.1 GB" in line for line in lines), lines


def _run_args(*argv):
    from edge.cli import build_parser

    return build_parser().parse_args(["run", *argv])


def test_run_prompt_from_argument_file_and_stdin(tmp_path):
    """PROMPT, then -f FILE, then a piped stdin (Ollama's `ollama run M "Explain:" < file.py`),
    joined by blank lines; `-` reads stdin alone; a terminal or a device is never read."""
    from edge.cli.generate import run_prompt

    code = tmp_path / "code.py"
    code.write_text("print('hi')\n")

    def piped(text):
        path = tmp_path / "stdin.txt"
        path.write_text(text)
        return open(path)

    assert run_prompt(_run_args("Explain:"), piped("print('hi')\n")) == "Explain:\n\nprint('hi')"
    assert run_prompt(_run_args("-"), piped("from stdin\n")) == "from stdin"
    assert run_prompt(_run_args("Explain:", "-f", str(code)), open(os.devnull)) == "Explain:\n\nprint('hi')"
    assert run_prompt(_run_args("-f", str(code)), open(os.devnull)) == "print('hi')"
    assert run_prompt(_run_args("-p", "A", "-f", str(code)), piped("B")) == "A\n\nprint('hi')\n\nB"
    assert run_prompt(_run_args("only this"), piped("")) == "only this"
    read, write = os.pipe()
    os.write(write, "through a pipe\n".encode())
    os.close(write)
    with open(read) as pipe:
        assert run_prompt(_run_args("Say:"), pipe) == "Say:\n\nthrough a pipe"
    from edge.cli.options import UsageError
    with pytest.raises(UsageError, match="no prompt: give it as PROMPT"):
        run_prompt(_run_args(), open(os.devnull))
    with pytest.raises(UsageError, match="either as PROMPT or with -p"):
        run_prompt(_run_args("-p", "a", "b"), open(os.devnull))
    with pytest.raises(FileNotFoundError):
        run_prompt(_run_args("-f", str(tmp_path / "none.txt")), open(os.devnull))


def test_run_without_a_prompt_at_a_terminal_is_a_usage_error():
    """No PROMPT and stdin a terminal: a usage error at once (exit 2), not a silent wait."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "edge.cli", "run"], stdin=slave, capture_output=True, text=True,
                              timeout=60, check=False)
    finally:
        os.close(master)
        os.close(slave)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("usage: edge run ")
    assert proc.stderr.splitlines()[-1] == ("edge run: error: no prompt: give it as PROMPT, -p TEXT or -f FILE, pipe "
                                            "it to stdin, or use `edge chat` to talk")
    proc = _edge("run", "-f", "/nonexistent/prompt.txt")
    assert (proc.returncode, proc.stderr) == (1, "edge run: error: /nonexistent/prompt.txt: No such file or directory\n")


def test_chat_without_a_terminal_is_one_line_pointing_to_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "edge.cli", "chat"], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=60, check=False, env={**os.environ, "EDGE_HOME": str(tmp_path)})
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr == (b'edge chat: error: chat needs a terminal (stdin and stdout); from a script or a pipe, '
                           b'use: edge run "PROMPT"\n')


def _saved_chat(folder, first, model="qwen2.5-coder-0.5b-instruct", title=None, session_bytes=0):
    from edge.chat import Conversation

    conv = Conversation(model=model, title=title, messages=[{"role": "user", "content": first},
                                                            {"role": "assistant", "content": "ok"}])
    conv.save(folder)
    if session_bytes:
        conv.session_path(folder).write_bytes(b"s" * session_bytes)
    return conv


def test_chat_list_and_delete(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGE_HOME", str(tmp_path))
    folder = tmp_path / "chats"
    a = _saved_chat(folder, "What is   the capital\nof France? " + "x" * 100, session_bytes=10)
    b = _saved_chat(folder, "Write a haiku", model="/some/where/my-model.gguf", title="poem")
    assert main(["chat", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "DATE", "MODEL", "/", "FIRST", "MESSAGE"] and len(lines) == 5
    assert all(len(line) <= 80 for line in lines)
    i = next(i for i, line in enumerate(lines) if line.startswith(a.id))
    assert re.fullmatch(rf"{a.id}  \d{{4}}-\d\d-\d\d \d\d:\d\d  qwen2.5-coder-0.5b-instruct", lines[i])
    assert lines[i + 1].startswith("  What is the capital of France? xxx") and lines[i + 1].endswith("x…")
    i = next(i for i, line in enumerate(lines) if line.startswith(b.id))
    assert lines[i].endswith("  my-model") and lines[i + 1] == "  [poem] Write a haiku"
    assert main(["chat", "--delete", a.id, "poem", "nope"]) == 1
    out, err = capsys.readouterr()
    assert out == f"deleted {a.id}\ndeleted {b.id} (poem)\n"
    assert err == "edge chat: error: no saved chat named 'nope'; saved chats: none (edge chat --list)\n"
    assert list(folder.iterdir()) == []
    assert main(["chat", "--list"]) == 0 and capsys.readouterr().out == f"no saved chats in {folder}\n"


def test_chat_kv_cache_files_stay_within_their_budget(tmp_path, monkeypatch):
    """prune_sessions keeps the newest chats' KV cache files within the budget (the current
    chat's always), deletes those of chats that are gone, and never a conversation."""
    import time as _time

    from edge.chat import prune_sessions, session_budget_bytes

    folder = tmp_path / "chats"
    chats = []
    for i in range(5):
        chats.append(_saved_chat(folder, f"chat {i}", session_bytes=400))
        os.utime(chats[-1].session_path(folder), (_time.time() - 100 + i, _time.time() - 100 + i))
    (folder / "orphan.session").write_bytes(b"o")
    removed = prune_sessions(folder, keep=chats[0].id, budget=1000)
    left = sorted(p.stem for p in folder.glob("*.session"))
    # newest first: chat 4 (400), chat 3 (800), chat 2 would make 1200; chat 0 is kept (current)
    assert left == sorted([chats[0].id, chats[3].id, chats[4].id]), left
    assert sorted(p.stem for p in removed) == sorted([chats[1].id, chats[2].id, "orphan"])
    assert len(list(folder.glob("*.json"))) == 5
    monkeypatch.setenv("EDGE_CHAT_CACHE_MB", "2.5")
    assert session_budget_bytes() == 2_500_000
    monkeypatch.setenv("EDGE_CHAT_CACHE_MB", "")
    assert session_budget_bytes() == 512_000_000


def test_compile_notes_say_when_numba_compiles():
    """A note when numba starts compiling (never when it compiles nothing); on a terminal, a
    line that counts the kernels and ends "done"."""
    import io

    import numba

    from edge.cli.options import compile_notes

    class Tty(io.StringIO):
        def isatty(self):
            return True

    quiet = io.StringIO()
    with compile_notes(stream=quiet):
        pass
    assert quiet.getvalue() == ""
    plain, tty = io.StringIO(), Tty()
    for stream, value in ((plain, 1), (tty, 2)):
        @numba.njit(cache=False)
        def fresh(x):
            return x + 1

        with compile_notes(stream=stream) as watch:
            assert fresh(value) == value + 1
        assert watch.count == 1
    assert plain.getvalue().startswith("note: compiling ") and plain.getvalue().count("\n") == 1
    final = tty.getvalue().split("\r\x1b[K")[-1]
    assert re.fullmatch(r"compiling (kernels \(first run only\)|new kernels)\.\.\. done: 1 in \d+ s\n", final), final


def test_quantize_takes_a_store_name(store, tmp_path, capsys):
    write_tiny_model(store / "tiny-f32.gguf", n_embd=256, n_ff=256)
    out = tmp_path / "out.gguf"
    assert main(["quantize", "tiny-f32", str(out), "Q8_0", "--dry-run"]) == 0
    assert "Q8_0:" in capsys.readouterr().out
    assert main(["quantize", "qwen2.5-coder-0.5b-instruct", str(out), "Q8_0"]) == 1     # not pulled: not downloaded
    assert "model qwen2.5-coder-0.5b-instruct is not pulled; run: edge pull" in capsys.readouterr().err
    assert main(["quantize", "missing.gguf", str(out), "Q8_0"]) == 1
    assert capsys.readouterr().err == "edge quantize: error: file not found: missing.gguf\n"


def test_on_sigint_inside_an_llvm_callback_is_delivered_again(monkeypatch):
    """Ctrl+C landing in numba's ctypes callbacks (where an exception would be lost) is not
    raised there but delivered again; elsewhere it is a KeyboardInterrupt."""
    import signal as _signal
    import edge.cli as cli

    later = []
    monkeypatch.setattr(cli, "_deliver_later", lambda: later.append(1))
    cli._interrupt.clear()

    def _raw_object_cache_notify():
        return sys._getframe()

    cli._on_sigint(_signal.SIGINT, _raw_object_cache_notify())
    assert later == [1] and cli._interrupt.is_set()
    with pytest.raises(KeyboardInterrupt):
        cli._on_sigint(_signal.SIGINT, sys._getframe())
    cli._interrupt.clear()


@pytest.mark.slow
def test_ctrl_c_at_any_moment_exits_130_with_one_line_and_leaves_numba_cache_usable(tmp_path, gemma_path):
    """SIGINT to `edge run` on a cold numba cache (its own NUMBA_CACHE_DIR) at several moments of
    the start and the kernel compile: status 130, stderr the compile note (if it had begun)
    and "interrupted", nothing else (no traceback, no "Exception ignored", no "no compiled
    object yet"). Then the same cache completes, gives the text of a warm cache, and the next
    run compiles nothing; SIGINT while the answer streams ends its line and says the same."""
    import signal
    import time

    model = write_tiny_model(tmp_path / "tiny.gguf", types={r: Q.Q8_0 for r in ("attn_q", "attn_k", "attn_v",
                                                                              "attn_output", "ffn_gate", "ffn_up",
                                                                              "ffn_down")})
    cold = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "EDGE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "edge.cli", "run", "-m", str(model), "--raw", "-n", "6", "--temp", "0", "-c", "256",
           "<t1><t2>"]

    def interrupt(delay, argv=cmd, wait_for=None, env=cold):
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env)
        if wait_for:
            assert len(proc.stdout.read(1)) == 1      # the answer has begun
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err.decode()

    notes = []
    for delay in (0.3, 1.5, 4.0, 7.0, 11.0):
        code, out, err = interrupt(delay)
        if code == 0:           # the compile was over before this moment: nothing left to interrupt
            break
        lines = err.splitlines()
        assert code == 130 and out == b"" and lines[-1] == "interrupted", (delay, err)
        assert all(line.startswith("note: compiling kernels") for line in lines[:-1]) and len(lines) <= 2, err
        notes += lines[:-1]
    assert notes, "no interrupt landed during the compile"
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, env=cold, timeout=900, check=False)
    warm = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=900, check=False,
                          env={**os.environ, "EDGE_HOME": str(tmp_path / "home")})
    assert done.returncode == 0 and warm.returncode == 0, done.stderr
    assert done.stdout == warm.stdout and done.stdout.startswith(b"<t")
    again = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, env=cold, timeout=300, check=False)
    assert again.returncode == 0 and b"compiling" not in again.stderr, again.stderr
    # while the answer streams (a real model, this checkout's numba cache)
    code, out, err = interrupt(0.5, [sys.executable, "-m", "edge.cli", "run", "-m", str(gemma_path), "-n", "2000",
                                     "--temp", "0", "Once upon a time"], wait_for=True, env=dict(os.environ))
    assert code == 130 and err.splitlines()[-1] == "interrupted" and "Traceback" not in err, err


def test_quantize_says_so_before_a_compile(tmp_path):
    """`edge quantize` on a cold numba cache (its own NUMBA_CACHE_DIR): a note on stderr as the
    quantizer's kernels compile; with them in the cache, none."""
    src = write_tiny_model(tmp_path / "f32.gguf", n_embd=256, n_ff=256)
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    for note in (True, False):
        proc = _edge("quantize", str(src), str(tmp_path / "q8.gguf"), "Q8_0", env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ("note: compiling kernels (first run only; later runs load them from numba's cache)"
                               "...\n" if note else ""), proc.stderr


def test_compile_notes_cut_short_do_not_say_done():
    import io

    import numba

    from edge.cli.options import compile_notes

    class Tty(io.StringIO):
        def isatty(self):
            return True

    @numba.njit(cache=False)
    def fresh(x):
        return x - 1

    tty = Tty()
    with pytest.raises(KeyboardInterrupt), compile_notes(stream=tty):
        fresh(3)
        raise KeyboardInterrupt
    import re                       # the seconds: 0 on an idle machine, more on a loaded one

    assert re.search(r"compiled, \d+ s\n$", tty.getvalue()) and "done" not in tty.getvalue(), tty.getvalue()


@pytest.mark.slow
def test_ps_against_a_real_edge_serve(tmp_path, gemma_path):
    """`edge ps` reads what a real `edge serve` answers on GET /v1/models (on a Unix socket, so
    that no developer's server on 8080 is in the way), API key included."""
    from tests.server_process import running

    sock = str(tmp_path / "edge.sock")
    with running(["-m", str(gemma_path), "-c", "512", "-np", "1"], tmp_path / "serve.log", timeout=300, uds=sock,
                 api_key="secret"):
        proc = _edge("ps", "--unix-socket", sock, env={"EDGE_API_KEY": "secret"})
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].split()[:2] == ["NAME", "CREATED"] and "N_CTX" in lines[0], lines
        assert lines[1].startswith("gemma-3-270m ") and " 512 " in lines[1] and "gemma3" in lines[1], lines
        proc = _edge("ps", "--unix-socket", sock, env={"EDGE_API_KEY": ""})
        assert proc.returncode == 1 and "wants an API key" in proc.stderr
    proc = _edge("ps", "--unix-socket", sock)
    assert (proc.returncode, proc.stderr) == (1, f"no edge server is running on unix:{sock}\n")


def test_threads_beyond_numbas_pool_are_said(store):
    """-t above numba's pool size runs the pool's threads and says so (it was silent)."""
    out = _edge("run", "tiny", "<t1><t2>", "--raw", "-n", "2", "--temp", "0", "-c", "64", "-t", "999", env={},
                input="", timeout=300)
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if line.startswith("note: -t 999: numba's thread pool has ")]
    assert len(notes) == 1 and notes[0].endswith(" (NUMBA_NUM_THREADS, default: this machine's CPUs); using "
                                                 + notes[0].split("has ")[1].split(" ")[0])


def test_run_takes_ollamas_model_then_prompt(store):
    """`edge run MODEL PROMPT` (Ollama's order) runs MODEL; a lone model name is a usage error
    naming the right command; loose words are one PROMPT."""
    env = {}                                # the store fixture set EDGE_HOME
    both = _edge("run", "tiny", "<t1><t2>", "--raw", "-n", "3", "--temp", "0", "-c", "64", env=env,
                 input="", timeout=300)
    flag = _edge("run", "-m", "tiny", "<t1><t2>", "--raw", "-n", "3", "--temp", "0", "-c", "64", env=env,
                 input="", timeout=300)
    assert both.returncode == flag.returncode == 0, both.stderr
    assert both.stdout == flag.stdout and both.stdout
    lone = _edge("run", "tiny", env=env, input="")
    assert lone.returncode == 2
    assert lone.stderr.splitlines()[-1] == ('edge run: error: tiny is a model: edge run tiny "PROMPT" (or edge chat '
                                            '-m tiny to chat with it)')
    loose = _edge("run", "tiny", "<t1>", "<t2>", "--raw", "-n", "3", "--temp", "0", "-c", "64", env=env, input="",
                  timeout=300)                # unquoted words are one prompt, as Ollama takes them
    assert loose.returncode == 0 and loose.stdout == _edge("run", "-m", "tiny", "<t1> <t2>", "--raw", "-n", "3",
                                                           "--temp", "0", "-c", "64", env=env, input="").stdout
    missing = _edge("run", "./nope.gguf", "hi", env=env, input="")   # a path first: the model, not found
    assert missing.returncode == 1 and missing.stderr.splitlines()[-1] == "edge run: error: file not found: ./nope.gguf"
    typo = _edge("run", "gemma-3-27m", "Say", "ok", env=env, input="")  # a misspelt name is not the prompt
    assert typo.returncode == 2 and typo.stderr.splitlines()[-1] == (
        "edge run: error: no model named 'gemma-3-27m' (did you mean 'gemma-3-270m'?); to send it as part of the "
        "prompt, quote the whole prompt")
