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
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

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
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "TYPE", "SIZE", "PARAMS", "ARCH"]
    assert all(len(line) <= 80 for line in lines), lines
    rows = {line.split()[0]: line.split() for line in lines[1:] if not line.startswith("available")}
    assert rows["tiny"][1] == "Q8_0" and rows["tiny"][-1] == "llama"
    assert rows["hf.co/alice/Tiny-GGUF:Q8_0"][1] == "F32"     # no general.file_type: the tensors' type
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
    for name in ("tiny", str(outside), "../outside", "..", "qwen2.5-coder-0.5b-instruct"):
        assert main(["rm", name]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"edge rm: error: no pulled model named {name!r}; pulled models: none"), err
        assert err.count("\n") == 1
    assert outside.is_file()


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
    assert capsys.readouterr().out.splitlines() == [
        "NAME                         CREATED  STATUS    N_CTX  ARCHITECTURE",
        "qwen2.5-coder-0.5b-instruct  0        loaded    4096   qwen2",
        "gemma-3-270m                 0        unloaded  4096   qwen2"]
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
