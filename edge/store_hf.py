"""GGUF files from the Hugging Face Hub: ``edge pull hf.co/USER/REPO[:QUANT]`` and file URLs.

Names. ``hf.co/USER/REPO[:QUANT]`` is Ollama's spelling (``huggingface.co/`` is taken too;
``:latest`` or no tag means the default); a file URL is the Hub's
``https://huggingface.co/USER/REPO/resolve/REV/PATH.gguf`` (or ``/blob/``). The file is stored
flat in the models folder as ``hf.co--USER--REPO--TAG.gguf``: ``--`` cannot occur in a Hub repo
id, so the name reads back, and ``edge list`` shows (and ``-m`` takes) ``hf.co/USER/REPO:TAG``
as well as that stem. TAG is the quant asked for (upper case), or, for a URL or the default
pick, the quant label in the file's name (its stem when it has none).

The file for a QUANT (Ollama's rule): among the repo's ``.gguf`` files (not ``mmproj`` ones),
the one whose name holds QUANT as a word (``Q4_K`` does not pick ``Q4_K_M``, nor ``Q4_0``
``IQ4_0``); with no QUANT, the ``Q4_K_M`` one, else the repo's only ``.gguf``. None or several:
an error listing what there is. Split files (``-00001-of-00003.gguf``) are refused.

Download, through huggingface_hub: ``HfApi.model_info(files_metadata=True)`` gives the commit,
each file's size and its LFS SHA-256; the file is fetched at that commit by huggingface_hub's
``get_hf_file_metadata`` (HEAD: Hub redirects, the token dropped for a CDN host, as
hf_hub_download does) and ``http_get`` (which resumes by itself, with a Range request, when a
connection drops mid-file). It goes to ``.STEM.gguf.SHA16.incomplete`` beside its destination,
kept on every error, Ctrl+C or kill, so that the next pull of the same file resumes it (a
Range request from its size); then it is checked (size, SHA-256), fsynced and renamed into
place, a sidecar ``.STEM.hf.json`` recording where it came from. hf_hub_download itself is not
used: in huggingface_hub 2.x it downloads into a per-process temporary file that it deletes on
any failure (no resume across pulls), and it would keep a second copy in its own cache. A lock
file keeps two pulls of one file apart.

The user's Hub token (``HF_TOKEN``, or ``hf auth login``'s) is sent to the Hub
(``HF_ENDPOINT``, default https://huggingface.co) only, never to another host named by a URL.
``HF_HUB_OFFLINE=1`` forbids the network. Every failure is a StoreError of one line.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from edge.files import atomic_write, commit

PREFIX = "hf.co"
DEFAULT_QUANT = "Q4_K_M"
_HUB = "https://huggingface.co"
_HUB_HOSTS = ("huggingface.co", "hf.co", "www.huggingface.co")
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"  # a Hub user / repo name
_NAME = re.compile(rf"(?:hf\.co|huggingface\.co)/(?P<user>{_PART})/(?P<repo>{_PART})(?::(?P<tag>[A-Za-z0-9._-]+))?")
_QUANT_LABEL = re.compile(r"(?<![A-Za-z0-9])(I?Q[0-9]+(?:_[A-Z0-9]+)*|TQ[12]_0|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_COPY_BYTES = 1 << 20


@dataclass(frozen=True)
class HubRef:
    """A parsed Hub model name or file URL: repo ``user/repo``, ``tag`` (upper case, None: the
    default pick), the Hub ``endpoint``, ``revision``, and for a URL the file's path in the repo."""

    user: str
    repo: str
    tag: str | None = None
    endpoint: str = field(default_factory=lambda: hub_endpoint())
    revision: str = "main"
    filename: str | None = None

    @property
    def repo_id(self) -> str:
        return f"{self.user}/{self.repo}"


def hub_endpoint() -> str:
    """The Hub's address: ``$HF_ENDPOINT`` (read now, not at import), default https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or _HUB).rstrip("/")


def is_hub_name(name: str) -> bool:
    """Whether ``name`` is meant as a Hub model (``hf.co/``, ``huggingface.co/``, an http(s) URL,
    or a stored ``hf.co--`` stem), valid or not."""
    n = name.strip()
    return n.startswith(("hf.co/", "huggingface.co/", "http://", "https://", f"{PREFIX}--"))


def parse(name: str) -> HubRef:
    """Parse ``hf.co/USER/REPO[:QUANT]``, a stored ``hf.co--USER--REPO--TAG`` stem, or a file URL.

    Raises:
        ValueError: with one line saying what is wrong with the name.
    """
    n = name.strip()
    if n.startswith(("http://", "https://")):
        return _parse_url(n)
    if n.startswith(f"{PREFIX}--"):
        parts = n.removesuffix(".gguf").split("--")
        if len(parts) == 4:
            n = f"{PREFIX}/{parts[1]}/{parts[2]}:{parts[3]}"
    m = _NAME.fullmatch(n)
    if m is None or any(".." in p or "--" in p for p in m.group("user", "repo")):
        raise ValueError(f"{name!r} is not a Hub model name: write hf.co/USER/REPO or hf.co/USER/REPO:QUANT "
                         f"(QUANT e.g. {DEFAULT_QUANT}, Q8_0)")
    tag = m["tag"]
    if tag is not None and (tag.lower() == "latest"):
        tag = None
    if tag is not None and ("--" in tag or tag.startswith(".")):
        raise ValueError(f"{name!r}: bad tag {tag!r}")
    return HubRef(m["user"], m["repo"], tag=tag.upper() if tag else None)


def _parse_url(url: str) -> HubRef:
    u = urlsplit(url)
    parts = [unquote(p) for p in u.path.split("/") if p]
    if len(parts) < 5 or parts[2] not in ("resolve", "blob") or not parts[-1].lower().endswith(".gguf"):
        raise ValueError(f"{url}: not the URL of a .gguf file on the Hub "
                         "(https://huggingface.co/USER/REPO/resolve/REVISION/FILE.gguf)")
    user, repo = parts[0], parts[1]
    if not (re.fullmatch(_PART, user) and re.fullmatch(_PART, repo)) or any(".." in p or "--" in p for p in (user, repo)):
        raise ValueError(f"{url}: {user}/{repo} is not a Hub repo id")
    endpoint = _HUB if u.hostname in _HUB_HOSTS else f"{u.scheme}://{u.netloc}"
    filename = "/".join(parts[4:])
    if ".." in parts[4:]:
        raise ValueError(f"{url}: bad file path {filename!r}")
    return HubRef(user, repo, endpoint=endpoint, revision=parts[3], filename=filename, tag=tag_of(filename))


def tag_of(filename: str) -> str:
    """The tag a file gets in its name: its last quant label (upper case), else its stem."""
    stem = Path(filename).name[: -len(".gguf")] if filename.lower().endswith(".gguf") else Path(filename).name
    labels = _QUANT_LABEL.findall(stem)
    tag = labels[-1].upper() if labels else re.sub(r"[^A-Za-z0-9._-]+|-{2,}", "-", stem).strip(".-") or "model"
    return tag


def display_name(stem: str) -> str:
    """``hf.co--USER--REPO--TAG`` -> ``hf.co/USER/REPO:TAG``; any other stem as it is."""
    parts = stem.split("--")
    return f"{PREFIX}/{parts[1]}/{parts[2]}:{parts[3]}" if len(parts) == 4 and parts[0] == PREFIX else stem


def stem(ref: HubRef, tag: str) -> str:
    """The store file's stem for ``ref`` stored under ``tag``."""
    return f"{PREFIX}--{ref.user}--{ref.repo}--{tag}"


def local_path(ref: HubRef, models: Path, any_one: bool = True) -> Path | None:
    """The stored file for ``ref``, if it is there (no network): the tag's file; with no tag,
    the Q4_K_M one, else (with ``any_one``) the repo's only stored file."""
    stored = sorted(models.glob(f"{PREFIX}--{ref.user}--{ref.repo}--*.gguf"))
    if ref.tag is not None:   # tags compare without case: a stem-tag (no quant label) keeps its case
        found = [p for p in stored if p.stem.split("--")[-1].upper() == ref.tag.upper()]
        return found[0] if found else None
    default = models / f"{stem(ref, DEFAULT_QUANT)}.gguf"
    if default in stored:
        return default
    return stored[0] if any_one and len(stored) == 1 else None


def manifest_path(gguf: Path) -> Path:
    """The sidecar that records where a pulled Hub file came from (``.STEM.hf.json``)."""
    return gguf.with_name(f".{gguf.stem}.hf.json")


# ---------------------------------------------------------------------- choosing the file
@dataclass(frozen=True)
class HubFile:
    """One file of a repo at a commit: path, size (bytes), LFS SHA-256 (or None) and git blob id."""

    path: str
    size: int
    sha256: str | None
    blob_id: str | None


def choose(files: list[HubFile], ref: HubRef) -> tuple[HubFile, str]:
    """The file ``ref`` names (module docstring) and the tag it is stored under. Raises
    ValueError listing the repo's .gguf files when none or several fit."""
    if ref.filename is not None:
        found = [f for f in files if f.path == ref.filename]
        if not found:
            raise ValueError(f"{ref.repo_id} has no file {ref.filename} at {ref.revision}")
        return found[0], ref.tag
    ggufs = [f for f in files if f.path.lower().endswith(".gguf") and "mmproj" not in Path(f.path).name.lower()]
    names = ", ".join(sorted(Path(f.path).name for f in ggufs)) or "none"
    if not ggufs:
        raise ValueError(f"{PREFIX}/{ref.repo_id} has no .gguf file")
    quant = ref.tag or DEFAULT_QUANT
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    picked = [f for f in ggufs if word.search(Path(f.path).name[:-5])]
    if not picked and ref.tag is None and len(ggufs) == 1:
        picked = ggufs
    if len(picked) != 1:
        what = "no" if not picked else f"{len(picked)}"
        raise ValueError(f"{PREFIX}/{ref.repo_id} has {what} .gguf file{'s' if len(picked) != 1 else ''} for "
                         f"{quant}; its .gguf files: {names}")
    if _SPLIT.search(picked[0].path):
        raise ValueError(f"{picked[0].path} is one part of a split GGUF file, which edge does not load")
    tag = ref.tag or (DEFAULT_QUANT if word.search(Path(picked[0].path).name[:-5]) else tag_of(picked[0].path))
    return picked[0], tag


# ---------------------------------------------------------------------- errors
def _network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's transport errors (huggingface_hub 2 uses httpx2, 1.x httpx, 0.x requests)."""
    found = []
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        with contextlib.suppress(ImportError):
            m = importlib.import_module(module)
            found += [getattr(m, n) for n in names if hasattr(m, n)]
    return tuple(found)


def hub_error(e: BaseException, ref: HubRef) -> str | None:
    """One line for an error huggingface_hub raised about ``ref``, or None if it is not one of them."""
    from huggingface_hub import errors as E

    where = f"{PREFIX}/{ref.repo_id}"
    if isinstance(e, E.OfflineModeIsEnabled):
        return f"cannot fetch {where}: offline mode is on (HF_HUB_OFFLINE); unset it to download"
    if isinstance(e, E.GatedRepoError):
        return (f"{where} is gated: accept its terms on {ref.endpoint}/{ref.repo_id} and set HF_TOKEN "
                "to a token of that account")
    if isinstance(e, E.RevisionNotFoundError):
        return f"{where} has no revision {ref.revision!r}"
    if isinstance(e, E.RepositoryNotFoundError):
        return (f"{where}: no such model repository on {ref.endpoint} (HTTP 404; if it is private, "
                "set HF_TOKEN)")
    if isinstance(e, E.EntryNotFoundError):
        return f"{where}: file not found at {ref.revision} (HTTP 404)"
    if isinstance(e, E.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return f"{where}: the Hub at {ref.endpoint} answered HTTP {status}"
    if isinstance(e, _network_errors()):
        return f"cannot reach {ref.endpoint} for {where} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no answer'}); check the network"
    return None


# ---------------------------------------------------------------------- pull
def _hub_token(ref: HubRef) -> bool | None:
    """What huggingface_hub should send: the user's token (None: implicit) to the Hub only."""
    return None if ref.endpoint.rstrip("/") in (hub_endpoint(), _HUB) else False


def list_files(ref: HubRef) -> tuple[str, list[HubFile]]:
    """(commit, files) of ``ref``'s repo at its revision (HfApi.model_info with files_metadata)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=ref.endpoint, token=_hub_token(ref)).model_info(
        ref.repo_id, revision=ref.revision, files_metadata=True)
    files = [HubFile(s.rfilename, s.size if s.size is not None else -1, s.lfs.sha256 if s.lfs else None, s.blob_id)
             for s in info.siblings or []]
    return info.sha, files


def fetch(ref: HubRef, commit_sha: str, file: HubFile, dest: Path, bars) -> None:
    """Download ``file`` at ``commit_sha`` into ``dest`` (resuming its ``.incomplete`` file), check
    it, write its manifest and rename it into place. Raises StoreError-worthy ValueError/OSError
    or huggingface_hub's errors (the caller words them)."""
    incomplete = dest.with_name(f".{dest.name}.{(file.sha256 or file.blob_id or 'nohash')[:16]}.incomplete")
    for stale in dest.parent.glob(f".{dest.name}.*.incomplete"):
        if stale != incomplete:
            stale.unlink(missing_ok=True)                       # another version of the file
    have = incomplete.stat().st_size if incomplete.is_file() else 0
    if have > file.size >= 0:
        incomplete.unlink()
        have = 0
    free = shutil.disk_usage(dest.parent).free
    if file.size > 0 and free < file.size - have:
        raise OSError(f"not enough disk space in {dest.parent}: need {file.size - have:,} bytes, {free:,} free")
    task = bars.add_task("download", total=max(file.size, 0))
    bars.update(task, completed=have)
    _http_download(ref, commit_sha, file, incomplete, have, bars, task)
    size = incomplete.stat().st_size
    if file.size >= 0 and size != file.size:
        incomplete.unlink()
        raise ValueError(f"{file.path}: downloaded {size:,} bytes, the Hub says {file.size:,}")
    _verify(incomplete, file, bars)
    with atomic_write(manifest_path(dest)) as tmp:
        tmp.write_text(json.dumps({"name": display_name(dest.stem), "endpoint": ref.endpoint, "repo": ref.repo_id,
                                   "revision": commit_sha, "file": file.path, "size": size,
                                   "sha256": file.sha256, "blob_id": file.blob_id}, indent=1) + "\n")
    commit(incomplete, dest)


def _http_download(ref: HubRef, commit_sha: str, file: HubFile, out: Path, have: int, bars, task) -> None:
    """Append the rest of the file from byte ``have`` to ``out`` with huggingface_hub's http_get."""
    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    token = _hub_token(ref)
    # the Hub's file URL, as hf_hub_url writes it (which only knows the endpoint of import time)
    url = f"{ref.endpoint}/{ref.repo_id}/resolve/{quote(commit_sha, safe='')}/{quote(file.path)}"
    meta = get_hf_file_metadata(url, token=token, endpoint=ref.endpoint)
    headers = build_hf_headers(token=token)
    location = meta.location or url
    if urlsplit(location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)                      # a signed CDN URL: no token there
    with open(out, "ab") as f:
        http_get(location, f, resume_size=have, headers=headers, expected_size=file.size if file.size >= 0 else None,
                 displayed_filename=Path(file.path).name, tqdm_class=_bar_class(bars, task))


def _bar_class(bars, task):
    """A tqdm look-alike for http_get that moves ``bars``' ``task`` (edge.store's progress sink)."""

    class _Bar:
        def __init__(self, total=None, initial=0, **_):
            bars.update(task, total=total, completed=initial)

        def update(self, n):
            bars.advance(task, n)

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return _Bar


def _verify(path: Path, file: HubFile, bars) -> None:
    """Check ``path`` against the Hub's SHA-256 (or, for a non-LFS file, its git blob id);
    on a mismatch the file is deleted (the next pull starts over) and ValueError names both."""
    digest = hashlib.sha256() if file.sha256 else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    want = file.sha256 or file.blob_id
    task = bars.add_task("verify", total=path.stat().st_size)
    with open(path, "rb") as f:
        while block := f.read(_COPY_BYTES):
            digest.update(block)
            bars.advance(task, len(block))
    got = digest.hexdigest()
    if want is not None and got != want:
        path.unlink()
        kind = "sha256" if file.sha256 else "git blob id"
        raise ValueError(f"{file.path}: {kind} mismatch: expected {want}, got {got}")


@contextlib.contextmanager
def lock(dest: Path):
    """Hold ``.NAME.lock`` beside ``dest`` for one pull; ValueError if another pull holds it."""
    import fcntl

    fd = os.open(dest.with_name(f".{dest.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another edge pull is downloading {display_name(dest.stem)}; wait for it") from None
        yield
    finally:
        os.close(fd)
