"""``edge chat``: a terminal chat with a local model, on textual.

The conversation scrolls above an input box; answers stream in as Markdown (code blocks
highlighted), a reasoning model's thinking streams into a collapsed block above its answer
(click it or focus it and press Enter to read it); a status bar shows the model, the context used (tokens / n_ctx) and the TTFT and
tokens/s of the last answer. The engine runs in a worker thread (edge.chat.ChatRunner), so the
interface never waits for it: Esc stops an answer at once and keeps what was written.

Keys: Enter sends; Ctrl+J (or Shift+Enter where the terminal reports it) starts a new line;
F2 switches to multi-line input (Enter starts a new line, Ctrl+S sends); Ctrl+L empties the
input box; Esc stops the answer; Ctrl+P opens the command palette; F1 shows help; Ctrl+D (on
an empty input box), /bye and Ctrl+Q quit, as Ollama's. Ctrl+C copies a selection, stops an
answer, and twice within 2 s (or once while the model loads) leaves with status 130, as SIGINT
does. Commands typed in the input box are listed in HELP.

Loading a model runs a warm-up (edge.engine.Engine.warm_up) before "ready", so that the first
answer waits on no kernel compile; on a cold numba cache the status bar counts the kernels
compiled meanwhile (edge.compile_watch).
"""
from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Collapsible, Markdown, Static, TextArea

from edge.chat import ChatError, ChatRunner, ChatSettings, Conversation, answer_parts, chats_dir, find_chat, \
    list_chats
from edge.engine import ContextLengthExceeded
from edge.kv.cache import KVNoSpace

SETTING_COMMANDS = {  # command -> ChatSettings field
    "/temp": "temperature", "/top-k": "top_k", "/top-p": "top_p", "/min-p": "min_p",
    "/repeat-penalty": "repeat_penalty", "/repeat-last-n": "repeat_last_n",
    "/presence-penalty": "presence_penalty", "/frequency-penalty": "frequency_penalty",
    "/seed": "seed", "/max-tokens": "max_tokens",
}

HELP = """\
**Commands** (type them in the input box, or pick them with Ctrl+P)

| command | does |
|---|---|
| `/new` | start a new conversation (this one stays saved) |
| `/system TEXT` | set the system message (`/system` shows it, `/system -` removes it) |
| `/temp X` | temperature, 0 = greedy; also `/top-k`, `/top-p`, `/min-p`, `/repeat-penalty`, `/repeat-last-n`, `/presence-penalty`, `/frequency-penalty`, `/seed` (-1 = random), `/max-tokens` (-1 = no limit); without a value: shows it |
| `/model NAME` | switch to another pulled model (`/model` lists them) |
| `/save [NAME]` | save now, under a name you can `/load` |
| `/load NAME` | reopen a saved conversation (`/load` lists them) |
| `/copy` | copy the last answer to the clipboard |
| `/help` | this help |
| `/bye`, `/quit` | leave (conversations are saved as they happen); Ctrl+D on an empty line too |

**Keys** Enter sends · Ctrl+J or Shift+Enter new line · F2 multi-line input (Enter new line,
Ctrl+S sends) · Ctrl+L empties the input box · Esc (or Ctrl+C) stops the answer · Ctrl+P commands ·
Ctrl+D on an empty line, /bye or Ctrl+Q quits (a message whose answer had not begun is kept for
next time) · Ctrl+C twice quits too
"""


@dataclass
class ChatOptions:
    """What ``edge chat`` was started with (see edge.cli)."""

    model: str | None = None
    system: str | None = None
    settings: ChatSettings = field(default_factory=ChatSettings)
    n_ctx: int = 4096
    n_batch: int = 64
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    resume: bool = False
    folder: Path | None = None
    threads: int | None = None      # -t: the kernels' threads on the answer worker (None: numba's default)
    batch_invariant: bool = False   # --batch-invariant (edge.engine.Engine.batch_invariant)
    spec: object = None             # edge.speculative.SpecParams (None: no speculative decoding)
    model_draft: str | None = None  # -md: the draft model for spec_type "draft"


def load_engine(model: str | None, options: ChatOptions):
    """The Engine for ``model`` (a name or a path; None: the default model, pulled on first use),
    with speculative decoding when the options ask for it."""
    from edge.engine import Engine
    from edge.store import resolve_model

    engine = Engine(resolve_model(model), n_ctx=options.n_ctx, n_batch=options.n_batch,
                    cache_type_k=options.cache_type_k, cache_type_v=options.cache_type_v,
                    batch_invariant=options.batch_invariant)
    if options.spec is not None and options.spec.enabled:
        draft = None
        if options.model_draft:
            draft = Engine(resolve_model(options.model_draft), n_ctx=options.n_ctx, n_batch=options.n_batch,
                           cache_type_k=options.cache_type_k, cache_type_v=options.cache_type_v,
                           batch_invariant=True)
        engine.set_speculative(options.spec, draft)
    return engine


# ------------------------------------------------------------------------------------- widgets
class UserMessage(Static):
    """A message the user sent."""


class Note(Static):
    """A line from edge itself (model loaded, setting changed, errors)."""


class Answer(Markdown):
    """The model's answer, streamed in as Markdown."""


class Thinking(Collapsible):
    """A reasoning model's thinking above its answer: collapsed, dim, streamed in as plain text."""

    def __init__(self, text: str = "", done: bool = True):
        self._body = Static(text, markup=False, classes="thinking-text")
        self.text = text
        super().__init__(self._body, title="thought" if done else "thinking…", collapsed=True)

    def append(self, text: str) -> None:
        self.text += text
        self._body.update(self.text)

    def done(self) -> None:
        """The thinking ended (the answer began, or the turn ended)."""
        self.title = "thought"


SINGLE_LINE_KEYS = "Enter send · ^J new line · Esc stop · ^P commands · F1 help"
MULTI_LINE_KEYS = "multi-line: Enter new line · ^S send · F2 back · Esc stop"


class ChatInput(TextArea):
    """The input box: Enter sends (or, in multi-line mode, starts a new line: Ctrl+S sends)."""

    BINDINGS = [Binding("ctrl+s", "send", "send", show=False),
                Binding("ctrl+l", "clear_input", "clear", show=False)]

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    multiline = False

    async def _on_key(self, event) -> None:
        # handled here, in key order: as bindings they ran after keys typed in the same burst
        if event.key in ("ctrl+j", "shift+enter") or (event.key == "enter" and self.multiline):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_send()
            return
        if event.key == "ctrl+d" and not self.text:     # end of input: leave, as Ollama's chat
            event.stop()
            event.prevent_default()
            self.app.run_command("/bye")
            return
        await super()._on_key(event)

    def action_clear_input(self) -> None:
        self.clear()

    def action_send(self) -> None:
        text = self.text.rstrip("\n")
        if text.strip():
            self.clear()
            self.post_message(self.Submitted(text))


class TextArrived(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class ReasoningArrived(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class TurnEnded(Message):
    def __init__(self, result=None, error: str | None = None, user_text: str = ""):
        super().__init__()
        self.result, self.error, self.user_text = result, error, user_text


class Compiling(Message):
    """numba compiled a kernel while the model loads (edge.compile_watch)."""


class EngineNote(Message):
    """A line from the load worker for the conversation view."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


class EngineReady(Message):
    def __init__(self, engine=None, error: str | None = None, model: str | None = None):
        super().__init__()
        self.engine, self.error, self.model = engine, error, model


# ------------------------------------------------------------------------------- palette
class ChatCommands(Provider):
    """The command palette's entries: every /command, a model switch per pulled model and a
    load per recent chat. Commands that take a value put ``/command `` in the input box."""

    def _entries(self) -> list[tuple[str, str, object]]:
        app: ChatApp = self.app  # type: ignore[assignment]
        entries = [
            ("New conversation", "/new: start a new chat; this one stays saved", partial(app.run_command, "/new")),
            ("Save conversation", "/save: save now", partial(app.run_command, "/save")),
            ("Copy last answer", "/copy: to the clipboard", partial(app.run_command, "/copy")),
            ("Help", "/help: commands and keys", partial(app.run_command, "/help")),
            ("Toggle multi-line input", "F2: Enter starts a new line, Ctrl+S sends", app.action_toggle_multiline),
            ("Set system message…", "/system TEXT", partial(app.prefill_input, "/system ")),
        ]
        for command, name in SETTING_COMMANDS.items():
            value = getattr(app.conversation.settings, name) if app.conversation else None
            entries.append((f"Set {name.replace('_', ' ')}… (now {value})", f"{command} VALUE",
                            partial(app.prefill_input, f"{command} ")))
        for name in app.pulled_models():
            entries.append((f"Switch model: {name}", f"/model {name}", partial(app.run_command, f"/model {name}")))
        for conv in list_chats(app.options.folder)[:20]:
            label = conv.title or conv.id
            entries.append((f"Load chat: {label}", f"/load {label} ({len(conv.messages)} messages, {conv.model})",
                            partial(app.run_command, f"/load {label}")))
        return entries

    async def discover(self) -> Hits:
        for name, help_text, callback in self._entries():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, callback in self._entries():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)


# ----------------------------------------------------------------------------------- app
class ChatApp(App):
    """The chat application (module docstring). ``engine_loader(model, options)`` makes an
    Engine (tests may pass their own)."""

    TITLE = "edge chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    CSS = """
    Screen { layout: vertical; }
    #log { height: 1fr; padding: 0 1; }
    UserMessage { margin: 1 0 0 0; padding: 0 1; background: $boost; color: $text; }
    Answer { margin: 0; padding: 0 1 0 1; }
    Thinking { margin: 1 0 0 0; padding: 0; border: none; background: transparent; }
    Thinking .thinking-text { color: $text-muted; text-style: italic; padding: 0 1; }
    Note { margin: 1 0 0 0; color: $text-muted; }
    ChatInput { height: auto; max-height: 8; min-height: 3; border: round $accent; }
    ChatInput.multiline { border: round $warning; }
    #status { height: 1; width: 1fr; background: $panel; }
    """
    BINDINGS = [
        Binding("escape", "stop", "stop", show=False),
        Binding("f1", "help", "help", show=False),
        Binding("f2", "toggle_multiline", "multi-line", show=False),
        Binding("ctrl+q", "quit", "quit", show=False, priority=True),
        Binding("ctrl+c", "interrupt", "interrupt", show=False),   # after the input box's copy of a selection
    ]

    def __init__(self, options: ChatOptions, engine_loader=load_engine):
        super().__init__()
        self.options = options
        self.engine_loader = engine_loader
        self.engine = None
        self.runner: ChatRunner | None = None
        self.conversation: Conversation | None = None
        self.generating = False
        self.loading = False
        self.n_tokens = 0
        self.last_ttft: float | None = None
        self.last_tps: float | None = None
        self.last_drafts: tuple[int, int] | None = None   # speculative decoding: (accepted, drafted)
        self._answer: Answer | None = None
        self._thinking: Thinking | None = None
        self._stream = None
        self._pending_load: Conversation | None = None
        self.turns_ended = 0        # answers finished, stopped or failed (tests and tools wait on it)
        self.compile_watch = None   # edge.compile_watch.CompileWatch of the load running now
        self._last_interrupt = 0.0  # when Ctrl+C last asked to leave

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="log")
        yield ChatInput(id="input", soft_wrap=True, show_line_numbers=False, tab_behavior="focus")
        yield Static("loading…", id="status")

    def on_mount(self) -> None:
        if not self.is_headless:     # SIGINT (kill -INT) leaves as Ctrl+C does at the terminal
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, lambda: self.exit(return_code=130))
        self.set_interval(1.0, self._tick)
        box = self.query_one("#input", ChatInput)
        box.border_title = SINGLE_LINE_KEYS
        box.focus()
        conv = None
        if self.options.resume:
            damaged: list = []
            chats = list_chats(self.options.folder, damaged)
            if damaged and (not chats or damaged[0][0].stat().st_mtime > chats[0].path(self.options.folder).stat().st_mtime):
                self.note(f"the last chat file cannot be read: {damaged[0][1]}"
                          + ("; opening the one before it" if chats else ""))
            if chats:
                conv = chats[0]
            else:
                self.note("no saved conversation to resume: starting a new one")
        self._pending_load = conv
        model = conv.model if conv is not None and self.options.model is None else self.options.model
        self.start_loading(model)

    def on_resize(self, event) -> None:
        self.call_after_refresh(self.log_view.scroll_end, animate=False)   # keep the last lines in view

    # ------------------------------------------------------------------ helpers
    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one("#log", VerticalScroll)

    def note(self, text: str, markup: bool = False) -> Note:
        widget = Note(text, markup=markup)
        self.log_view.mount(widget)
        self.log_view.scroll_end(animate=False)
        return widget

    def update_status(self) -> None:
        parts = []
        watch = self.compile_watch
        if self.loading and watch is not None and watch.started is not None:
            parts.append(f"compiling kernels (first run only): {watch.count} compiled, {watch.seconds:.0f} s…")
        elif self.loading:
            parts.append("loading model…")
        elif self.engine is not None:
            parts.append(self.model_name())
            parts.append(f"{min(self.n_tokens, self.engine.n_ctx)}/{self.engine.n_ctx} tokens")
            if self.generating:
                parts.append("answering… (Esc stops)")
            else:
                if self.last_ttft is not None:
                    parts.append(f"TTFT {self.last_ttft:.2f} s")
                if self.last_tps is not None:
                    parts.append(f"{self.last_tps:.1f} tok/s")
                if self.last_drafts is not None:
                    parts.append("drafts {}/{} kept".format(*self.last_drafts))
        self.query_one("#status", Static).update(" " + " │ ".join(parts))

    def model_name(self) -> str:
        return Path(self.engine.path).stem if self.engine is not None else "-"

    def pulled_models(self) -> list[str]:
        from edge.store import list_models

        return [m["name"] for m in list_models() if m["error"] is None]

    def prefill_input(self, text: str) -> None:
        box = self.query_one("#input", ChatInput)
        box.text = text
        box.move_cursor(box.document.end)
        box.focus()

    def show_conversation(self) -> None:
        """Clear the view and show the current conversation's messages."""
        log = self.log_view
        log.remove_children()
        conv = self.conversation
        if conv.system and conv.mode == "chat":
            self.note(f"system: {conv.system}")
        for m in conv.messages:
            if m["role"] == "user":
                log.mount(UserMessage(m["content"], markup=False))
            else:
                parts = answer_parts(m, self.runner is not None and self.runner.reasoning)
                if parts.reasoning:
                    log.mount(Thinking(parts.reasoning))
                log.mount(Answer(parts.content + (" *(stopped)*" if m.get("stopped") else "")))
        log.scroll_end(animate=False)

    # ------------------------------------------------------------------ engine loading
    def start_loading(self, model: str | None) -> None:
        self.loading = True
        self.update_status()
        self._load_worker(model)

    def _tick(self) -> None:
        if self.loading and self.compile_watch is not None and self.compile_watch.compiling:
            self.update_status()    # the compile's seconds

    def on_compiling(self, message: Compiling) -> None:
        self.update_status()

    @work(thread=True, exclusive=True, group="load")
    def _load_worker(self, model: str | None) -> None:
        from edge.compile_watch import CompileWatch

        def first() -> None:
            self.post_message(EngineNote("compiling edge's kernels for this CPU (first run only: about a minute "
                                         "on 2 cores; later runs load them from numba's cache)…"))

        self.compile_watch = CompileWatch(first, lambda n, name: self.post_message(Compiling()))
        try:
            with self.compile_watch:     # loaded and warmed up: the first answer waits on no compile
                engine = self.engine_loader(model, self.options)
                engine.warm_up()
        except Exception as e:   # a bad name or file: the user picks another
            self.post_message(EngineReady(error=f"{type(e).__name__}: {e}" if not str(e) else str(e), model=model))
            return
        self.post_message(EngineReady(engine=engine, model=model))

    def on_engine_ready(self, message: EngineReady) -> None:
        self.loading = False
        if message.error is not None:
            self.note(f"cannot load model {message.model or 'default'}: {message.error}")
            if self.engine is None:
                self.note("pick a pulled model with /model NAME (or Ctrl+P)")
            self.update_status()
            return
        old = self.engine
        self.engine = message.engine
        if old is not None and old is not self.engine:
            old.clear_kv_cache()
            self.last_ttft = self.last_tps = self.last_drafts = None
        model_arg = message.model or Path(self.engine.path).stem
        conv, self._pending_load = self._pending_load, None
        if conv is None:
            if self.conversation is None:
                conv = Conversation(model=model_arg, system=self.options.system, settings=self.options.settings)
            else:   # a model switch keeps the conversation
                conv = self.conversation
                conv.model = model_arg
        notes = []
        if self.engine.template is None:
            if conv.mode == "chat" and conv.messages:
                notes.append(f"{self.model_name()} has no chat template: this conversation cannot go on with "
                             "it; starting a new one")
                conv = Conversation(model=model_arg, settings=conv.settings)
            conv.mode = "raw"
            notes.append(f"{self.model_name()} has no chat template: raw completion mode. What you type is "
                         "continued as plain text (no turns, no system message).")
        elif conv.mode == "raw" and not conv.messages:
            conv.mode = "chat"
        elif conv.mode == "raw":
            notes.append("this conversation is a raw completion; the model's chat template is not used")
        conv.model = model_arg
        self.conversation = conv
        self.runner = ChatRunner(self.engine, conv, self.options.folder or chats_dir(), self.options.threads)
        self.show_conversation()
        watch = self.compile_watch
        if watch is not None and watch.started is not None:    # said while loading; the view was cleared since
            notes.insert(0, f"compiled {watch.count} kernels in {watch.seconds:.0f} s (first run only: later runs "
                            "load them from numba's cache)")
        for text in notes:
            self.note(text)
        self.note(f"model {self.model_name()} ready (n_ctx {self.engine.n_ctx}); "
                  "type a message, /help for commands")
        if conv.draft and not self.query_one("#input", ChatInput).text:
            self.prefill_input(conv.draft)     # a message stopped before its answer, kept
        try:
            self.n_tokens = len(conv.prompt_ids(self.engine)) if conv.messages else 0
        except Exception:
            self.n_tokens = 0
        self.update_status()

    # ------------------------------------------------------------------ sending
    @on(ChatInput.Submitted)
    def on_submitted(self, message: ChatInput.Submitted) -> None:
        text = message.text
        if text.startswith("/"):
            self.run_command(text.strip())
            return
        if self.generating:
            self.note("an answer is being written: Esc stops it")
            self.prefill_input(text)
            return
        if self.runner is None:
            self.note("no model loaded yet")
            self.prefill_input(text)
            return
        self.log_view.mount(UserMessage(text, markup=False))
        self._answer = Answer("")
        self.log_view.mount(self._answer)
        self._stream = Markdown.get_stream(self._answer)
        self.log_view.scroll_end(animate=False)
        self.generating = True
        self.update_status()
        self._answer_worker(text)

    @work(thread=True, exclusive=True, group="answer")
    def _answer_worker(self, text: str) -> None:
        try:
            result = self.runner.answer(text, lambda piece: self.post_message(TextArrived(piece)),
                                        lambda piece: self.post_message(ReasoningArrived(piece)))
        except ContextLengthExceeded as e:
            self.post_message(TurnEnded(error=f"{e} (start a /new conversation, or restart with a larger -c)",
                                        user_text=text))
            return
        except KVNoSpace as e:     # the disk under $EDGE_HOME is full: once space is freed, send again
            self.post_message(TurnEnded(error=f"{e}; then send your message again", user_text=text))
            return
        except Exception as e:     # shown in the chat, never a crash
            self.post_message(TurnEnded(error=f"{type(e).__name__}: {e}", user_text=text))
            return
        self.post_message(TurnEnded(result=result, user_text=text))

    async def on_reasoning_arrived(self, message: ReasoningArrived) -> None:
        if self._answer is None:
            return
        if self._thinking is None:
            self._thinking = Thinking(done=False)
            await self.log_view.mount(self._thinking, before=self._answer)
        self._thinking.append(message.text)
        self.log_view.scroll_end(animate=False)

    async def on_text_arrived(self, message: TextArrived) -> None:
        if self._thinking is not None:
            self._thinking.done()
        if self._stream is not None:
            await self._stream.write(message.text)
            self.log_view.scroll_end(animate=False)

    async def on_turn_ended(self, message: TurnEnded) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.generating = False
        if self._thinking is not None:
            self._thinking.done()
            self._thinking = None
        result = message.result
        if message.error is not None:
            if self._answer is not None and not self._answer.source:
                await self._answer.remove()
            self.note(message.error)
            if self.conversation and (not self.conversation.messages
                                      or self.conversation.messages[-1]["role"] != "user"):
                self.prefill_input(message.user_text)
        elif result.stopped and not result.text:   # stopped before the first token
            if self._answer is not None:
                await self._answer.remove()
            user_widgets = self.log_view.query(UserMessage)
            if user_widgets:
                await user_widgets.last().remove()
            self.note("stopped before the answer began; your message is back in the input box")
            self.prefill_input(message.user_text)
        else:
            if result.stopped and self._answer is not None:
                await self._answer.append(" *(stopped)*")
            elif (result.stats.finish_reason == "length" and not result.stats.context_full
                  and self._answer is not None):     # -n / /max-tokens cut it: say so, as (stopped) does
                await self._answer.append(" *(length limit: /max-tokens N raises it)*")
            stats = result.stats
            self.last_ttft = stats.ttft
            self.last_tps = stats.gen_tps if stats.n_generated > 1 else None
            self.last_drafts = (stats.n_accepted, stats.n_drafted) if stats.n_drafted else None
            self.n_tokens = result.n_tokens
            if stats.context_full:
                self.note(f"the context is full ({self.engine.n_ctx} tokens): start a /new conversation")
        self._answer = None
        self.turns_ended += 1
        self.update_status()
        self.log_view.scroll_end(animate=False)

    # ------------------------------------------------------------------ actions
    async def action_quit(self) -> None:
        await self._stop_and_wait()
        self.exit()

    async def action_interrupt(self) -> None:
        """Ctrl+C (a selection in the input box is copied before this): while the model loads,
        leave (status 130); during an answer, stop it; else, a second Ctrl+C within 2 s leaves."""
        now = time.monotonic()
        if self.loading or now - self._last_interrupt < 2.0:
            await self._stop_and_wait()
            self.exit(return_code=130)
            return
        self._last_interrupt = now
        if self.generating:
            self.action_stop()
        else:
            self.note("Ctrl+C again leaves; so do Ctrl+D on an empty line, /bye and Ctrl+Q")

    def on_engine_note(self, message: EngineNote) -> None:
        self.note(message.text)

    async def _stop_and_wait(self, timeout: float = 10.0) -> None:
        """Stop a running answer and wait (a token or a prompt chunk) until the worker has
        saved the conversation: the partial answer, or the message as the draft."""
        if self.runner is None or not self.generating:
            return
        self.runner.stop()
        for _ in range(int(timeout / 0.05)):
            if not self.runner.busy:
                return
            await asyncio.sleep(0.05)

    def action_stop(self) -> None:
        if self.generating and self.runner is not None:
            self.runner.stop()

    def action_help(self) -> None:
        self.run_command("/help")

    def action_toggle_multiline(self) -> None:
        box = self.query_one("#input", ChatInput)
        box.multiline = not box.multiline
        box.set_class(box.multiline, "multiline")
        box.border_title = MULTI_LINE_KEYS if box.multiline else SINGLE_LINE_KEYS
        self.note("multi-line input: Enter starts a new line, Ctrl+S sends" if box.multiline
                  else "single-line input: Enter sends, Ctrl+J starts a new line")

    # ------------------------------------------------------------------ commands
    def run_command(self, line: str) -> None:
        """Do a /command (see HELP); unknown commands and bad values get a note."""
        command, _, arg = line.partition(" ")
        arg = arg.strip()
        command = command.lower()
        busy = self.generating or self.loading
        if command in ("/quit", "/exit", "/bye"):
            self.run_worker(self.action_quit())
        elif command == "/help":
            self.log_view.mount(Answer(HELP))
            self.log_view.scroll_end(animate=False)
        elif command == "/copy":
            answers = [m for m in (self.conversation.messages if self.conversation else []) if m["role"] == "assistant"]
            if not answers:
                self.note("no answer to copy yet")
            else:
                text = answer_parts(answers[-1], self.runner is not None and self.runner.reasoning).content
                self.copy_to_clipboard(text)
                self.note(f"copied the last answer ({len(text)} characters) to the clipboard")
        elif busy and command in ("/new", "/system", "/model", "/load", *SETTING_COMMANDS):
            self.note(f"{command} waits until the answer is done (Esc stops it)" if self.generating
                      else f"{command} waits until the model is loaded")
        elif self.engine is None and command in ("/new", "/system", "/save", *SETTING_COMMANDS):
            self.note(f"{command}: no model is loaded yet (/model NAME loads one)")
        elif command == "/new":
            old = self.conversation
            self.conversation = Conversation(model=old.model if old else (self.options.model or ""),
                                             mode="raw" if self.engine is not None and self.engine.template is None else "chat",
                                             system=old.system if old else self.options.system,
                                             settings=old.settings if old else self.options.settings)
            self.runner = ChatRunner(self.engine, self.conversation, self.options.folder or chats_dir(),
                                     self.options.threads)
            self.n_tokens, self.last_ttft, self.last_tps, self.last_drafts = 0, None, None, None
            self.show_conversation()
            self.note("new conversation")
            self.update_status()
        elif command == "/system":
            conv = self.conversation
            if not arg:
                self.note(f"system message: {conv.system!r}" if conv.system else "no system message")
            elif conv.mode == "raw":
                self.note("raw completion mode has no system message")
            else:
                if arg == "-" and conv.system is None:
                    self.note("there is no system message to remove")
                    return
                conv.system = None if arg == "-" else arg
                conv.save(self.options.folder)
                self.note("system message removed" if conv.system is None else f"system message set: {arg}")
        elif command in SETTING_COMMANDS:
            name = SETTING_COMMANDS[command]
            conv = self.conversation
            if not arg:
                self.note(f"{name} = {getattr(conv.settings, name)}")
                return
            try:
                conv.settings = conv.settings.with_value(name, arg)
            except ChatError as e:
                self.note(str(e))
                return
            conv.save(self.options.folder)
            self.note(f"{name} = {getattr(conv.settings, name)}")
        elif command == "/model":
            names = self.pulled_models()
            if not arg:
                self.note("pulled models: " + (", ".join(names) or "none") + " (switch with /model NAME)")
            else:
                self.note(f"loading {arg}…")
                self.start_loading(arg)
        elif command == "/save":
            conv = self.conversation
            if arg:
                conv.title = arg
            path = conv.save(self.options.folder)
            self.note(f"saved to {path}" + (f" as {arg!r} (reopen with /load {arg})" if arg else ""))
        elif command == "/load":
            if not arg:
                chats = list_chats(self.options.folder)[:10]
                self.note("saved chats: " + (", ".join(f"{c.title or c.id} ({len(c.messages)} messages)"
                                                       for c in chats) or "none") + " (reopen with /load NAME)")
                return
            try:
                conv = find_chat(arg, self.options.folder)
            except ChatError as e:
                self.note(str(e))
                return
            same_model = self.engine is not None and conv.model in (Path(self.engine.path).stem, str(self.engine.path),
                                                                     self.conversation.model if self.conversation else None)
            if same_model:
                self._pending_load = conv
                self.on_engine_ready(EngineReady(engine=self.engine, model=conv.model))
            else:
                self._pending_load = conv
                self.note(f"loading {conv.model} for this chat…")
                self.start_loading(conv.model)
        else:
            self.note(f"unknown command {command}; /help lists them")


def run_chat(options: ChatOptions) -> int:
    """Run the app until the user quits; returns the exit status (0). Raises KeyboardInterrupt
    when Ctrl+C or SIGINT ended it (edge.cli prints one line and exits with 130)."""
    app = ChatApp(options)
    app.run()
    if app.return_code == 130:
        raise KeyboardInterrupt
    return 0

