"""`edge run` (a completion streamed to stdout) and `edge chat` (the terminal app)."""
from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

from edge.cli.options import (UsageError, add_model_args, add_sampling_args, add_spec_args, check_sizes,
                              compile_notes, is_terminal, load_engine, naming_flags, physical_cores, sampling_fields,
                              set_speculative, set_threads, spec_params)


def add_parsers(sub) -> None:
    """The run and chat subcommands."""
    run = sub.add_parser("run", help="generate text from a prompt, streamed to stdout",
                         description="Generate a completion. Instruct models get the prompt through "
                                     "their chat template; --raw sends it as is.")
    run.add_argument("prompt_arg", nargs="*", metavar="[MODEL] PROMPT",
                     help="the prompt; - reads it from stdin. Text piped to stdin is appended to PROMPT "
                          "(edge run 'Explain:' < file.py). A model name before it is taken as -m, as "
                          "`ollama run MODEL PROMPT` does")
    run.add_argument("-p", "--prompt", default=None, help="the prompt, as llama.cpp's -p (instead of PROMPT)")
    run.add_argument("-f", "--file", default=None, metavar="FILE",
                     help="read the prompt from FILE (appended to PROMPT when both are given), as llama.cpp's -f")
    add_model_args(run)
    add_sampling_args(run)
    run.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=-1,
                     help="tokens to generate, -1 = until end of generation or context (default: -1)")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument("-sys", "--system", default=None, help="system message (chat models)")
    run.add_argument("--session", "--prompt-cache", dest="session", default=None, metavar="FILE",
                     help="session file: restore the prompt's KV cache from it when it starts the "
                          "same way, and save the prompt's state to it (llama.cpp's --prompt-cache)")
    g = run.add_argument_group("constrained decoding (the answer follows a grammar; llguidance)")
    g.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="the answer is JSON valid against this JSON schema: its text, or a file holding it")
    g.add_argument("--grammar", default=None, metavar="GBNF", help="the answer follows this GBNF grammar")
    g.add_argument("--grammar-file", default=None, metavar="FILE", help="the answer follows the GBNF grammar in FILE")
    add_spec_args(run)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="chat with a model in the terminal (a textual app)",
                          description="A terminal chat: answers stream in as Markdown; Esc stops one; "
                                      "/help lists the commands. Conversations are saved under "
                                      "$EDGE_HOME/chats/ as they happen.")
    add_model_args(chat)
    add_sampling_args(chat)
    chat.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=-1,
                      help="most tokens per answer, -1 = until the end of the answer (default: -1)")
    chat.add_argument("-sys", "--system", default=None, help="system message")
    chat.add_argument("--resume", action="store_true",
                      help="reopen the last conversation (its KV cache too, when the model is the same)")
    chat.add_argument("--list", action="store_true",
                      help="list the saved conversations (id, date, model, first message) and exit")
    chat.add_argument("--delete", nargs="+", default=None, metavar="ID",
                      help="delete saved conversations (by id, a unique start of one, or /save name) and exit")
    add_spec_args(chat)
    chat.set_defaults(func=cmd_chat, batch_size=64)


def cmd_run(args) -> int:
    from edge.engine import GenerationStats
    from edge.sampling import SamplingParams
    from edge.tokenizer import StreamDecoder

    if args.max_tokens < -1:
        raise ValueError(f"-n/--max-tokens must be -1 (no limit) or more, got {args.max_tokens}")
    with naming_flags():
        params = SamplingParams(**sampling_fields(args))
    spec = spec_params(args)           # bad speculative options fail before the model loads
    grammar = grammar_option(args)     # so do bad schemas and grammars
    prompt = run_prompt(args)          # after the checks: reading stdin may wait
    t_start = time.perf_counter()
    with compile_notes(model_kernels=True):     # a cold numba cache: said (counted on a terminal) before any text
        engine = load_engine(args)
        set_speculative(engine, args, spec)
        engine.warm_up()
    if args.raw or engine.template is None:
        if not args.raw:
            print(f"note: {engine.name} has no chat template; the prompt is sent as is", file=sys.stderr)
        if args.system:
            print("note: --system is ignored: without a chat template there is no system turn",
                  file=sys.stderr)
        ids = engine.raw_prompt(prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        ids = engine.chat_prompt(messages)
    processors = []
    if grammar is not None:
        from edge.grammar import GrammarMask
        processors.append(GrammarMask(grammar, engine.tokenizer, len(ids)))
    stats = GenerationStats()
    decoder = StreamDecoder()
    out = sys.stdout
    try:
        max_tokens = None if args.max_tokens < 0 else args.max_tokens     # -n -1: no limit
        for tok in engine.generate(ids, params, max_tokens, stats, session=args.session,
                                   processors=processors):
            text = decoder.feed(engine.tokenizer.token_to_piece(tok, special=False))
            if text:
                out.write(text)
                out.flush()
    except BaseException as e:
        if stats.n_generated and (not isinstance(e, KeyboardInterrupt) or out.isatty()):
            print(file=out if isinstance(e, KeyboardInterrupt) else sys.stderr, flush=True)  # end the text's line
        raise
    out.write(decoder.flush())
    if out.isatty():
        out.write("\n")  # end the line for the shell prompt; piped output stays the model's text
    out.flush()
    total = time.perf_counter() - t_start
    print(f"\nprompt: {stats.n_prompt} tokens, TTFT {stats.ttft * 1000:.0f} ms, "
          f"{stats.prompt_tps:.1f} tokens/s | generated: {stats.n_generated} tokens, "
          f"{stats.gen_tps:.1f} tokens/s | finish: {stats.finish_reason}"
          f"{f' (context full: -c {args.ctx_size})' if stats.context_full else ''} | total {total:.1f} s"
          + (f" | drafted {stats.n_drafted}, accepted {stats.n_accepted}"
             + (f" ({100 * stats.n_accepted / stats.n_drafted:.0f} %)" if stats.n_drafted else "")
             if engine.speculator is not None else "")
          + (f" | grammar: compiled in {processors[0].compile_seconds * 1000:.1f} ms, mask "
             f"{1000 * processors[0].mask_seconds / max(1, processors[0].mask_calls):.2f} ms/token" if processors else "")
          + (f" | {stats.n_restored} prompt tokens restored from {args.session}" if stats.n_restored else "")
          + (f" | {args.session} held another prompt; it now holds this one" if stats.session_replaced else ""),
          file=sys.stderr)
    return 0


def _is_model_name(word: str) -> bool:
    """True when ``word`` names a model as -m takes it by name (a registry name or alias, a
    pulled store file's stem, a pulled Hub name), not a path."""
    from edge.store import find_entry, models_dir, store_hf

    if find_entry(word) is not None:
        return True
    if "/" in word and not store_hf.is_hub_name(word) or word.endswith(".gguf"):
        return False
    try:
        return store_hf.is_hub_name(word) or (models_dir() / f"{word}.gguf").is_file()
    except (OSError, ValueError):
        return False


def _is_path(word: str) -> bool:
    """True for a word that can only be a model file: it ends in .gguf (a Hub name aside)."""
    from edge.store import store_hf

    return word.lower().endswith(".gguf") and not store_hf.is_hub_name(word)


def _looks_like_model(word: str) -> bool:
    """A word shaped like a model name: letters, digits and ``-._:/`` only, with a digit and a
    ``-`` or ``:`` (gemma-3-270m, qwen2.5-coder:1.5b), unlike a prompt's first word."""
    import re

    return bool(re.fullmatch(r"[\w.:/-]+", word)) and any(c.isdigit() for c in word) and ("-" in word or ":" in word)


def _model_then_prompt(args, words: list[str]) -> str | None:
    """PROMPT from the positional words: ``MODEL PROMPT`` (Ollama's order) sets -m; a lone word
    that names a model is refused with the right command. Raises UsageError."""
    if len(words) >= 2 and args.model is None and (_is_model_name(words[0]) or _is_path(words[0])):
        args.model, words = words[0], words[1:]       # a path too: -m's "file not found" if it is not there
    elif len(words) >= 2 and args.model is None and args.prompt is None and _looks_like_model(words[0]):
        from edge.store import _all_names, did_you_mean

        hint = did_you_mean(words[0], _all_names())
        if hint:   # a misspelt model name would otherwise go to the default model as the prompt's first word
            raise UsageError(f"no model named {words[0]!r}{hint}; to send it as part of the prompt, quote the "
                             "whole prompt")
    if len(words) > 1:
        words = [" ".join(words)]                     # unquoted words: one prompt, as Ollama takes them
    if len(words) == 1 and args.model is None and args.prompt is None and args.file is None \
            and _is_model_name(words[0]):
        raise UsageError(f"{words[0]} is a model: edge run {words[0]} \"PROMPT\" (or edge chat -m {words[0]} to "
                         "chat with it)")
    return words[0] if words else None


def run_prompt(args, stdin=None) -> str:
    """The prompt of ``edge run``: PROMPT (or -p), then the text of -f FILE, then stdin's text
    when PROMPT is ``-`` or stdin is not a terminal (a pipe or a file: Ollama's ``ollama run
    MODEL "Explain:" < file.py``), the parts joined by a blank line; each part loses one trailing
    newline (as llama.cpp's -f and ``echo`` add).

    Raises:
        UsageError: PROMPT and -p both; no prompt at all with stdin a terminal.
        ValueError: FILE or stdin is not UTF-8 text, or the parts are all empty.
        OSError: FILE cannot be read.
    """
    stdin = sys.stdin if stdin is None else stdin
    if isinstance(args.prompt_arg, list):
        args.prompt_arg = _model_then_prompt(args, args.prompt_arg)
    if args.prompt is not None and args.prompt_arg is not None:
        raise UsageError("give the prompt either as PROMPT or with -p, not both")
    given = args.prompt if args.prompt is not None else args.prompt_arg
    parts = [given] if given not in (None, "-") else []
    if args.file is not None:
        try:
            parts.append(Path(args.file).read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"-f {args.file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if given == "-" or _piped(stdin):
        if stdin is None:
            raise UsageError("PROMPT is -, but there is no standard input to read it from")
        if given == "-" and is_terminal(stdin):
            print("reading the prompt from the terminal: end it with Ctrl+D", file=sys.stderr, flush=True)
        elif not _readable_within(stdin, 1.0):     # a pipe nobody writes to: say what is awaited
            print("reading the prompt from stdin (piped): waiting for its end (< /dev/null to pipe nothing)",
                  file=sys.stderr, flush=True)
        try:
            parts.append(stdin.read())
        except UnicodeDecodeError as e:
            raise ValueError(f"stdin is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not parts or (given is None and args.file is None and not parts[-1]):
        raise UsageError("no prompt: give it as PROMPT, -p TEXT or -f FILE, pipe it to stdin, or use "
                         "`edge chat` to talk")
    parts = [p[:-1] if p.endswith("\n") else p for p in parts]
    prompt = "\n\n".join(p for p in parts if p)
    if not prompt:
        raise ValueError("the prompt is empty")
    return prompt


def _piped(stream) -> bool:
    """Whether ``stream`` is text piped or redirected in: a pipe, a regular file or a socket
    (not a terminal, /dev/null or another device, which could be endless: /dev/zero)."""
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (AttributeError, OSError, ValueError):   # None, closed, or a pseudo-file (pytest's)
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def _readable_within(stream, seconds: float) -> bool:
    """Whether ``stream`` has data (or its end) to read within ``seconds``."""
    import select

    try:
        return bool(select.select([stream], [], [], seconds)[0])
    except (OSError, ValueError, TypeError):
        return True


def grammar_option(args):
    """The edge.grammar.Grammar of -j/--json-schema, --grammar or --grammar-file (None without);
    raises ValueError (GrammarError) for more than one, a bad file, schema or grammar."""
    from edge.grammar import from_option

    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema), ("--grammar", args.grammar),
                                               ("--grammar-file", args.grammar_file)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(f for f, _ in given)}, not several")
    return from_option(*given[0]) if given else None


def cmd_chat(args) -> int:
    from edge.chat import ChatSettings

    if args.list:
        return list_saved_chats()
    if args.delete:
        return delete_saved_chats(args.delete)
    if not (is_terminal(sys.stdin) and is_terminal(sys.stdout)):    # before any escape code is written
        print('edge chat: error: chat needs a terminal (stdin and stdout); from a script or a pipe, use: '
              'edge run "PROMPT"', file=sys.stderr)
        return 2
    if args.max_tokens < -1:
        raise ValueError(f"-n/--max-tokens must be -1 (no limit) or more, got {args.max_tokens}")
    check_sizes(args)
    with naming_flags():
        settings = ChatSettings(max_tokens=args.max_tokens, **sampling_fields(args))
    spec = spec_params(args)
    from edge.cli.models import resolve_with_bars
    if args.model is not None:   # a wrong name fails here, before the screen changes
        resolve_with_bars(args.model)
    model_draft = str(resolve_with_bars(args.model_draft)) if args.model_draft else None
    set_threads(args.threads)
    # the terminal app lives outside edge/ (edge never imports textual); loaded for this command only
    from tui.app import ChatOptions, run_chat

    return run_chat(ChatOptions(model=args.model, system=args.system, settings=settings, n_ctx=args.ctx_size,
                                n_batch=args.batch_size, cache_type_k=args.cache_type_k,
                                cache_type_v=args.cache_type_v, resume=args.resume,
                                threads=args.threads or physical_cores(),
                                batch_invariant=args.batch_invariant, spec=spec, model_draft=model_draft))


def list_saved_chats() -> int:
    """``edge chat --list``: the saved conversations, newest first: a line with the id (what
    --delete and /load take), the last change (local time) and the model, then the first user
    message (with the /save name) on an indented line cut to the terminal's width (80 columns
    when not a terminal). Returns 0."""
    import shutil
    from datetime import datetime

    from edge.chat import chats_dir, list_chats

    chats = list_chats()
    if not chats:
        print(f"no saved chats in {chats_dir()}")
        return 0
    width = max(80, shutil.get_terminal_size((80, 24)).columns) if is_terminal(sys.stdout) else 80
    id_width = max(len(c.id) for c in chats)
    print(f"{'ID':<{id_width}}  {'DATE':<16}  MODEL / FIRST MESSAGE")
    for c in chats:
        try:
            when = datetime.fromisoformat(c.updated).astimezone().strftime("%Y-%m-%d %H:%M")
        except ValueError:
            when = c.updated[:16]
        model = Path(c.model).stem if c.model.endswith(".gguf") else c.model
        print(_cut(f"{c.id:<{id_width}}  {when:<16}  {model}", width))
        first = " ".join(next((m["content"] for m in c.messages if m["role"] == "user"), c.draft or "").split())
        print(_cut(f"  {f'[{c.title}] ' if c.title else ''}{first}", width))
    return 0


def delete_saved_chats(names: list[str]) -> int:
    """``edge chat --delete ID...``: delete each conversation (its .json and its KV cache file);
    a name that is not exactly one saved chat is an error line. Returns 0, or 1 if any failed."""
    from edge.chat import ChatError, delete_chat

    status = 0
    for name in names:
        try:
            conv = delete_chat(name)
        except ChatError as e:
            print(f"edge chat: error: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"deleted {conv.id}" + (f" ({conv.title})" if conv.title else ""))
    return status


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
