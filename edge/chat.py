"""Conversations for ``edge chat``: what was said, how it is sampled, where it is kept, and
turns generated on an :class:`~edge.engine.Engine` that another thread can stop at once.

edge/ never imports textual: the terminal app (the ``tui`` package) drives a
:class:`ChatRunner` from a worker thread and shows what it reports.

Files, under ``$EDGE_HOME/chats/`` (:func:`chats_dir`)::

    <id>.json      the conversation, rewritten atomically after every message
    <id>.session   the KV cache of the conversation so far (edge.session's format), written
                   after every answer, so that ``edge chat --resume`` continues the chat
                   without computing its history again (same model only: the file names it).
                   A cache, within a budget: after each answer the oldest chats' files are
                   deleted until all fit in $EDGE_CHAT_CACHE_MB (default 512 MB; the current
                   chat's is kept): :func:`prune_sessions`

The JSON object (format "edge-chat", version 1): ``id``, ``title`` (or null), ``created`` and
``updated`` (ISO 8601 UTC), ``model`` (what ``-m`` resolved: a registry name or a path),
``mode`` ("chat": turns through the model's chat template; "raw": the text is continued as
it is, for models without a template), ``system`` (or null), ``settings`` (the sampling
fields of :class:`~edge.sampling.SamplingParams` and ``max_tokens``), ``messages``, a list
of ``{"role": "user" | "assistant", "content": str}`` (an answer stopped by the user has
``"stopped": true``; a reasoning model's answer keeps its ``<think>`` block in the content, and
has ``"reasoning_opened": true`` when the chat template wrote the ``<think>``), and ``draft`` (a message stopped before its answer began, or null). Raw
mode keeps the text as alternating user and assistant pieces too. A conversation with nothing
in it has no file.
"""
from __future__ import annotations

import json
import os
import secrets
import threading
import time
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

from edge.engine import ContextLengthExceeded, Engine, GenerationStats, GenerationStopped
from edge.reasoning import ReasoningSplitter, Split, is_reasoning_model, prompt_opens_reasoning, split_reasoning
from edge.files import atomic_write, remove_dead_temps
from edge.sampling import SamplingParams
from edge.session import SessionError
from edge.threads import use_threads
from edge.files import edge_home
from edge.tokenizer import StreamDecoder

FORMAT, VERSION = "edge-chat", 1
DEFAULT_SESSION_BUDGET_MB = 512     # the chats' KV cache files together ($EDGE_CHAT_CACHE_MB)


class ChatError(ValueError):
    """A chat file that cannot be read or a command that cannot be done; says why."""


def chats_dir() -> Path:
    """Where conversations are kept: ``edge_home() / "chats"`` (may not exist yet)."""
    return edge_home() / "chats"


class ChatSettings:
    """Sampling settings of a conversation: a SamplingParams (llama.cpp's names and defaults,
    as ``edge run``; its fields read as attributes, e.g. ``settings.temperature``) and
    ``max_tokens`` (-1 = until the end of the answer or of the context).

    ``ChatSettings(max_tokens=16, temperature=0.0)``: keywords other than max_tokens are
    SamplingParams fields. Raises InvalidParameter naming a bad field.
    """

    NAMES = tuple(f.name for f in fields(SamplingParams) if f.name != "logit_bias") + ("max_tokens",)

    def __init__(self, max_tokens: int = -1, **sampling):
        self.sampling = SamplingParams(**sampling)
        self.max_tokens = max_tokens

    def __getattr__(self, name: str):
        if name != "sampling" and name in self.NAMES:
            return getattr(self.sampling, name)
        raise AttributeError(name)

    def __eq__(self, other) -> bool:
        return isinstance(other, ChatSettings) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return f"ChatSettings({self.to_json()})"

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.NAMES}

    @classmethod
    def from_json(cls, obj: dict) -> "ChatSettings":
        """From a chat file's ``settings`` (unknown keys ignored). Raises InvalidParameter."""
        return cls(**{k: v for k, v in obj.items() if k in cls.NAMES})

    def with_value(self, name: str, text: str) -> "ChatSettings":
        """A copy with setting ``name`` set from the text ``text`` (as typed after /temp ...).
        Raises ChatError saying what the setting takes."""
        if name not in self.NAMES:
            raise ChatError(f"unknown setting {name!r}")
        try:
            if name == "seed":
                value = None if text.strip() in ("-1", "random", "none") else int(text)
            elif name in ("top_k", "repeat_last_n", "max_tokens"):
                value = int(text)
            else:
                value = float(text)
        except ValueError:
            raise ChatError(f"{name} takes a number, got {text!r}") from None
        if name == "max_tokens" and value < -1:
            raise ChatError(f"max_tokens must be -1 (no limit) or more, got {value}")
        try:
            return ChatSettings.from_json({**self.to_json(), name: value})
        except ValueError as e:
            raise ChatError(str(e)) from None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


@dataclass
class Conversation:
    """One chat (see the module docstring for its file)."""

    model: str
    mode: str = "chat"
    system: str | None = None
    settings: ChatSettings = field(default_factory=ChatSettings)
    messages: list[dict] = field(default_factory=list)
    title: str | None = None
    draft: str | None = None         # a message typed but not answered (stopped before its answer)
    id: str = field(default_factory=_new_id)
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)

    # ---------------------------------------------------------------- files
    def path(self, folder: Path | None = None) -> Path:
        return (folder or chats_dir()) / f"{self.id}.json"

    def session_path(self, folder: Path | None = None) -> Path:
        return (folder or chats_dir()) / f"{self.id}.session"

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "id": self.id, "title": self.title,
                "created": self.created, "updated": self.updated, "model": self.model, "mode": self.mode,
                "system": self.system, "settings": self.settings.to_json(), "messages": self.messages,
                "draft": self.draft}

    def save(self, folder: Path | None = None) -> Path:
        """Write the conversation to ``<folder>/<id>.json`` atomically (temporary file, fsync,
        rename; edge.files.atomic_write, and the temporary files of killed saves in the folder
        are removed); returns the path. A conversation with nothing in it (no message, draft or
        title) has no file (an old one is removed). Raises OSError when it cannot be written."""
        folder = folder or chats_dir()
        folder.mkdir(parents=True, exist_ok=True)
        self.updated = _now()
        path = self.path(folder)
        if not self.messages and not self.draft and not self.title:   # nothing said: no file
            path.unlink(missing_ok=True)
            return path
        remove_dead_temps(folder)       # what killed saves of any conversation left
        with atomic_write(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, ensure_ascii=False, indent=1)
        return path

    @classmethod
    def load(cls, path: Path) -> "Conversation":
        """Read a conversation file. Raises ChatError naming the file and the fault."""
        try:
            obj = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ChatError(f"{path}: {e.strerror or e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatError(f"{path}: not a chat file ({e})") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ChatError(f"{path}: not an edge chat file")
        if obj.get("version") != VERSION:
            raise ChatError(f"{path}: chat file version {obj.get('version')!r}, this edge reads {VERSION}")
        try:
            messages = obj["messages"]
            if not all(isinstance(m, dict) and m.get("role") in ("user", "assistant")
                       and isinstance(m.get("content"), str) for m in messages):
                raise ChatError(f"{path}: a message is not a user or assistant message with text content")
            settings = ChatSettings.from_json(obj.get("settings", {}))
            return cls(model=str(obj["model"]), mode=obj.get("mode", "chat"), system=obj.get("system"),
                       settings=settings, messages=list(messages), title=obj.get("title"),
                       draft=obj.get("draft") if isinstance(obj.get("draft"), str) else None, id=str(obj["id"]),
                       created=obj.get("created", _now()), updated=obj.get("updated", _now()))
        except (KeyError, TypeError, AttributeError) as e:
            raise ChatError(f"{path}: missing or malformed field {e}") from None
        except ValueError as e:      # a setting out of range
            raise ChatError(f"{path}: {e}") from None

    # ---------------------------------------------------------------- prompts
    def prompt_ids(self, engine: Engine) -> list[int]:
        """The token ids of the whole conversation, ready for the next answer: through the
        model's chat template (mode "chat"), or the concatenated text (mode "raw")."""
        if self.mode == "raw":
            return engine.raw_prompt("".join(m["content"] for m in self.messages))
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
                   [{"role": m["role"], "content": m["content"]} for m in self.messages]
        return engine.chat_prompt(messages)


def list_chats(folder: Path | None = None, damaged: list | None = None) -> list[Conversation]:
    """Saved conversations with at least one message, most recently updated first. Files
    that cannot be read are left out; with ``damaged`` (a list), each is appended to it as
    (path, ChatError), most recently modified first."""
    folder = folder or chats_dir()
    found, bad = [], []
    for path in folder.glob("*.json"):
        try:
            conv = Conversation.load(path)
        except ChatError as e:
            bad.append((path, e))
            continue
        if conv.messages or conv.draft:
            found.append(conv)
    if damaged is not None:
        damaged.extend(sorted(bad, key=lambda pe: pe[0].stat().st_mtime, reverse=True))
    return sorted(found, key=lambda c: (c.updated, c.id), reverse=True)


def find_chat(name: str, folder: Path | None = None) -> Conversation:
    """The saved conversation whose title or id is ``name`` (or whose id starts with it; the
    most recent of several). Raises ChatError: the file's fault when ``name`` names a damaged
    file, else listing what there is."""
    folder = folder or chats_dir()
    path = folder / f"{name}.json"
    if path.is_file():
        return Conversation.load(path)       # a damaged file says so
    chats = list_chats(folder)
    for match in ([c for c in chats if c.title == name or c.id == name],
                  [c for c in chats if c.id.startswith(name)]):
        if match:
            return match[0]
    known = ", ".join((c.title or c.id) for c in chats[:8]) or "none yet"
    raise ChatError(f"no saved chat named {name!r}; recent chats: {known}")


def delete_chat(name: str, folder: Path | None = None) -> Conversation:
    """Delete the saved conversation ``name`` (its id, the one id that starts with it, or its
    /save title) with its KV cache file; returns it.

    Raises:
        ChatError: no saved chat, or several, answer to ``name`` (listing them); OSError when a
            file cannot be removed.
    """
    folder = folder or chats_dir()
    chats = list_chats(folder)
    match = ([c for c in chats if c.id == name or c.title == name]
             or [c for c in chats if c.id.startswith(name)] if name else [])
    if len(match) != 1:
        listed = ", ".join(c.id for c in (match or chats)[:8]) or "none"
        raise ChatError(f"{len(match)} saved chats are named {name!r}: {listed}" if match
                        else f"no saved chat named {name!r}; saved chats: {listed} (edge chat --list)")
    conv = match[0]
    conv.session_path(folder).unlink(missing_ok=True)
    conv.path(folder).unlink()
    return conv


def session_budget_bytes() -> int:
    """The bytes the chats' KV cache files (``<id>.session``) may take together:
    ``$EDGE_CHAT_CACHE_MB`` megabytes (default 512); 0 keeps only the current chat's."""
    try:
        mb = float(os.environ.get("EDGE_CHAT_CACHE_MB", "") or DEFAULT_SESSION_BUDGET_MB)
    except ValueError:
        mb = DEFAULT_SESSION_BUDGET_MB
    return max(0, int(mb * 1e6))


def prune_sessions(folder: Path | None = None, keep: str | None = None, budget: int | None = None) -> list[Path]:
    """Delete the oldest ``<id>.session`` files of ``folder`` (by modification time) until the
    rest fit in ``budget`` bytes (default :func:`session_budget_bytes`), and those whose chat is
    gone; chat ``keep``'s is never deleted. Conversations themselves (``.json``) stay: a chat
    whose KV cache was deleted computes its history again on its next turn. Returns the files
    deleted. Raises nothing: a file that cannot be removed or read is left."""
    folder = folder or chats_dir()
    budget = session_budget_bytes() if budget is None else budget
    files = []
    for path in folder.glob("*.session"):
        try:
            st = path.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, path))
    removed, total = [], 0
    for _, size, path in sorted(files, key=lambda f: f[0], reverse=True):
        mine = path.stem == keep
        if mine or (path.with_suffix(".json").is_file() and total + size <= budget):
            total += size
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def answer_parts(message: dict, reasoning: bool) -> Split:
    """An assistant message's reasoning and answer (``reasoning``: the model is a reasoning
    model; otherwise all of it is the answer)."""
    if not reasoning:
        return Split("", message["content"])
    return split_reasoning(message["content"], opened=bool(message.get("reasoning_opened")))


class _Router:
    """Text to ``on_text`` and ``on_reasoning`` through a ReasoningSplitter, reasoning first."""

    def __init__(self, splitter: ReasoningSplitter, on_text, on_reasoning):
        self.splitter, self.on_text, self.on_reasoning = splitter, on_text, on_reasoning

    def __call__(self, text: str) -> None:
        self._send(self.splitter.push(text))

    def finish(self) -> None:
        self._send(self.splitter.finish())

    def _send(self, split: Split) -> None:
        if split.reasoning:
            self.on_reasoning(split.reasoning)
        if split.content:
            self.on_text(split.content)


@dataclass
class TurnResult:
    """What one answer came to: its text, whether the user stopped it, its timings, and how
    many tokens of the context the conversation now uses."""

    text: str
    stopped: bool
    stats: GenerationStats
    n_tokens: int


class ChatRunner:
    """Generates a conversation's answers on an engine.

    :meth:`answer` runs on a worker thread and calls ``on_text`` with each piece of text as it
    is decoded; :meth:`stop` (any thread) ends it after the token being computed, keeping
    what was written. The KV state is saved to the conversation's session file after every
    answer (Engine.generate with session_save="end"), and restored from it on the next turn:
    the history is not computed again, in this process or after ``--resume``.

    ``threads``: the kernels' thread count (``-t``) for the thread :meth:`answer` runs on (numba's
    count is per OS thread: a worker thread would start with numba's default); None: as it is.
    """

    def __init__(self, engine: Engine, conversation: Conversation, folder: Path | None = None,
                 threads: int | None = None):
        self.engine = engine
        self.threads = threads
        self.conversation = conversation
        self.folder = folder or chats_dir()
        self._stop = threading.Event()
        self.busy = False
        source = engine.template.source if engine.template is not None else None
        self.reasoning = is_reasoning_model(source, engine.tokenizer)   # answers may open with <think>

    def stop(self) -> None:
        """Ask the running answer to end after the current token (no-op when idle)."""
        self._stop.set()

    def answer(self, user_text: str, on_text, on_reasoning=None) -> TurnResult:
        """Append the user's message, generate the answer (streamed to ``on_text(str)``),
        append it (also when stopped: what was written is kept) and save the conversation.
        With ``on_reasoning`` and a reasoning model in chat mode, the ``<think>`` block is
        streamed to ``on_reasoning(str)`` and only the rest to ``on_text`` (edge.reasoning).
        Stopped before the first token (while the prompt is computed), the user's message is
        taken back and kept as the conversation's ``draft``: the result has ``stopped`` and no text.

        Raises ContextLengthExceeded when the conversation no longer fits n_ctx, InvalidParameter
        for bad settings (the user's message is then taken back), OSError when the chat folder
        cannot be written.
        """
        use_threads(self.threads)
        conv = self.conversation
        params = conv.settings.sampling
        conv.messages.append({"role": "user", "content": user_text})
        conv.draft = None
        self._stop.clear()
        self.busy = True
        stats = GenerationStats()
        decoder = StreamDecoder()
        pieces: list[str] = []
        stopped = False
        opened = False
        try:
            ids = conv.prompt_ids(self.engine)
            if len(ids) > self.engine.n_ctx:
                raise ContextLengthExceeded(len(ids), self.engine.n_ctx)
            thinks = self.reasoning and conv.mode == "chat"
            opened = thinks and prompt_opens_reasoning(self.engine.tokenizer, ids)
            split = thinks and on_reasoning is not None
            emit = _Router(ReasoningSplitter(opened), on_text, on_reasoning) if split else on_text
            conv.save(self.folder)
            session = conv.session_path(self.folder)
            try:
                gen = self._generate(ids, params, stats, session)
                tok = next(gen, None)
            except SessionError:     # made with another model or KV type, or damaged: start anew
                session.unlink(missing_ok=True)
                stats = GenerationStats()
                gen = self._generate(ids, params, stats, session)
                tok = next(gen, None)
            try:
                while tok is not None:
                    text = decoder.feed(self.engine.tokenizer.token_to_piece(tok, special=False))
                    if text:
                        pieces.append(text)
                        emit(text)
                    if self._stop.is_set():
                        stopped = True
                        break
                    tok = next(gen, None)
            finally:
                gen.close()          # saves the session (prompt and answer so far), frees the slot
            tail = decoder.flush()
            if tail:
                pieces.append(tail)
                emit(tail)
            if split:
                emit.finish()
        except GenerationStopped:       # kept as the draft: the app puts it back in the input box
            conv.messages.pop()
            conv.draft = user_text
            conv.save(self.folder)
            return TurnResult("", True, stats, 0)
        except BaseException:
            if not pieces:           # nothing was written: the turn did not happen
                conv.messages.pop()
                conv.save(self.folder)
                raise
            stopped = True
            raise
        finally:
            self.busy = False
            if pieces or (conv.messages and conv.messages[-1]["role"] == "user"):
                message = {"role": "assistant", "content": "".join(pieces)}
                if stopped:
                    message["stopped"] = True
                if opened:
                    message["reasoning_opened"] = True
                conv.messages.append(message)
                conv.save(self.folder)
            prune_sessions(self.folder, keep=conv.id)
        return TurnResult("".join(pieces), stopped, stats, stats.n_prompt + stats.n_generated)

    def _generate(self, ids, params, stats, session):
        max_tokens = self.conversation.settings.max_tokens      # the file's -1 is no limit
        return self.engine.generate(ids, params, None if max_tokens < 0 else max_tokens, stats, session=session,
                                    session_save="end", stop=self._stop)
