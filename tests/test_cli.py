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
    assert len(got) == 1 and got[0].startswith(f"no model file or known model named {missing!r}")
    assert state.load_error == f"StoreError: {got[0]}" and state.scheduler is None
    state = ServerState(ServerConfig(model=missing))
    state.load()
    assert state.load_error == f"StoreError: {got[0]}"


def test_uncompiled_weight_types_names_the_missing(monkeypatch, tmp_path):
    """The note before a compile of a new weight type names the types whose matmul kernel has
    no numba cache index yet, each once, float types never."""
    from types import SimpleNamespace as NS

    import numpy as np

    from gguf import GGMLQuantizationType as T

    import kernels_cpu.matmul_kernels as mk
    from edge.cli.options import uncompiled_weight_types

    present = tmp_path / "kernel.nbi"
    present.write_bytes(b"")

    def fake_kernel(t, n_rows, batch_invariant=False):
        path = present if t == T.Q8_0 else tmp_path / "missing.nbi"
        return NS(_cache=NS(_cache_file=NS(_index_path=str(path))))

    monkeypatch.setattr(mk, "quant_kernel", fake_kernel)
    weight = lambda t: NS(ggml_type=t, rows=np.zeros((8, 34), np.uint8))  # noqa: E731
    model = NS(weights=lambda: [weight(T.Q8_0), weight(T.IQ4_XS), weight(T.F32), weight(T.IQ4_XS), weight(T.Q4_K)])
    assert uncompiled_weight_types(model) == ["IQ4_XS", "Q4_K"]
    monkeypatch.setattr(mk, "quant_kernel", lambda t, n, bi=False: present)  # no numba cache layout: say nothing
    assert uncompiled_weight_types(model) == []
