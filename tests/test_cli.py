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
