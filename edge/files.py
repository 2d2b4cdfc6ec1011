"""edge's files: where they live (edge_home), atomic writes, the temporary files a killed
process leaves, and the checks an output path passes before any work.

A file edge writes (a model, a session, a conversation, an imatrix, a logits file) first goes
to a temporary file beside it, ``.NAME.pidPID.RANDOM.partial`` (a folder of that name for
downloads), is fsynced and then renamed over ``NAME``: a reader sees the old file or the
whole new one, never a part. An error or Ctrl+C removes the temporary file; a process killed
with SIGKILL (or a machine that stopped) cannot, so whoever next writes ``NAME`` (or lists the
folder) calls :func:`remove_dead_temps`: the process id in the name says whether its writer
still runs, and only those of processes that are gone are deleted.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

TEMP_SUFFIX = ".partial"
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.pid(?P<pid>\d+)\.[^./]+" + re.escape(TEMP_SUFFIX))


def make_temp(dest: str | os.PathLike, folder: bool = False) -> Path:
    """Create an empty temporary file (or, with ``folder``, a directory) beside ``dest``, named
    for this process. The file gets the mode a new file gets (0666 less the umask), the folder
    0700.

    Raises OSError when it cannot be created.
    """
    dest = Path(dest)
    while True:
        tmp = dest.with_name(f".{dest.name}.pid{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            if folder:
                tmp.mkdir(mode=0o700)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def commit(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Make the finished temporary file ``tmp`` the file ``dest``: fsync it, rename it over
    ``dest`` and fsync the folder (skipped where the file system cannot fsync a folder).

    Raises OSError (``tmp`` is left for the caller to remove).
    """
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dest)
    with contextlib.suppress(OSError):
        fsync_dir(Path(dest).parent)


@contextlib.contextmanager
def atomic_write(dest: str | os.PathLike) -> Iterator[Path]:
    """Write ``dest`` atomically: yields a new temporary file beside it (make_temp) for the
    caller to write; when the block ends normally it becomes ``dest`` (commit), on any
    exception (Ctrl+C too) it is removed and ``dest`` is left as it was. Temporary files that
    killed processes left for ``dest`` are removed first (remove_dead_temps).

    Raises OSError when the temporary file cannot be created or committed.
    """
    dest = Path(dest)
    remove_dead_temps(dest.parent, dest.name)
    tmp = make_temp(dest)
    try:
        yield tmp
        commit(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_dead_temps(folder: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Delete the temporary files and folders (make_temp's) in ``folder`` whose process is gone:
    those for the file ``name``, or for any name. Returns what was deleted; what cannot be
    (another user's, removed meanwhile) is skipped."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.fullmatch(entry.name)
        if m is None or (name is not None and m["name"] != name) or _alive(int(m["pid"])):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that a rename in it is durable. Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def edge_home() -> Path:
    """The edge data directory: ``$EDGE_HOME`` if set and non-empty, else ``~/.cache/edge``."""
    home = os.environ.get("EDGE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "edge"


def file_starts_with(path: str | os.PathLike, magic: bytes) -> bool:
    """True when the file at ``path`` begins with the bytes ``magic`` (False if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def check_output_file(out: str | os.PathLike, label: str = "", inputs: dict | None = None,
                      error: type[Exception] = ValueError) -> None:
    """Before any work, that ``out`` can be written as an output file: not a directory, in an
    existing folder this process can write to, and not one of ``inputs`` (name -> path of the
    files the command reads; the same file also through links: writing it would destroy the
    input), nor an existing device, FIFO or socket (the rename at the end would replace it: ``-o
    /dev/null`` as root would replace /dev/null). Raises ``error`` with one line, ``label`` (e.g.
    "-o ") before the path."""
    raw = os.fspath(out)
    if not raw or raw.endswith(os.sep):
        raise error(f"{label}{raw!r} is not the path of a file")
    out = Path(out)
    if out.is_dir():
        raise error(f"{label}{out} is a directory; give the path of a file")
    if not out.parent.is_dir():
        raise error(f"{label}{out}: the folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise error(f"{label}{out}: cannot write in the folder {out.parent}")
    for what, path in (inputs or {}).items():
        if path is not None and out.exists() and Path(path).exists() and os.path.samefile(out, path):
            raise error(f"{label}{out} is the {what} file; give another output path")
    if out.exists() and not out.is_file():
        raise error(f"{label}{out} exists and is not a regular file (a device, FIFO or socket); give the path "
                    "of a file")
