"""`edge run` (a completion streamed to stdout) and `edge chat` (the terminal app)."""
from __future__ import annotations

import sys
import time

from edge.cli.options import (add_model_args, add_sampling_args, add_spec_args, check_sizes, kernels_compiled,
                              load_engine, naming_flags, physical_cores, sampling_fields, set_speculative,
                              set_threads, spec_params)


def add_parsers(sub) -> None:
    """The run and chat subcommands."""
    run = sub.add_parser("run", help="generate text from a prompt, streamed to stdout",
                         description="Generate a completion. Instruct models get the prompt through "
                                     "their chat template; --raw sends it as is.")
    run.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt (read from stdin when absent)")
    run.add_argument("-p", "--prompt", default=None, help="the prompt, as llama.cpp's -p (instead of PROMPT)")
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
    add_spec_args(chat)
    chat.set_defaults(func=cmd_chat, batch_size=64)


def cmd_run(args) -> int:
    from edge.engine import GenerationStats
    from edge.sampling import SamplingParams
    from edge.tokenizer import StreamDecoder

    if args.prompt is not None and args.prompt_arg is not None:
        raise ValueError("give the prompt either as PROMPT or with -p, not both")
    if args.max_tokens < -1:
        raise ValueError(f"-n/--max-tokens must be -1 (no limit) or more, got {args.max_tokens}")
    prompt = args.prompt if args.prompt is not None else args.prompt_arg
    if prompt is None:
        prompt = sys.stdin.read()
        if prompt.endswith("\n"):   # one trailing newline, as llama.cpp's -f and `echo` add
            prompt = prompt[:-1]
    with naming_flags():
        params = SamplingParams(**sampling_fields(args))
    spec = spec_params(args)           # bad speculative options fail before the model loads
    grammar = grammar_option(args)     # so do bad schemas and grammars
    t_start = time.perf_counter()
    engine = load_engine(args)
    set_speculative(engine, args, spec)
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
    except Exception:
        if stats.n_generated:      # e.g. the disk filled while decoding: the error gets a line of its own
            print(file=sys.stderr, flush=True)
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
    if not kernels_compiled():
        print("note: first run: compiling edge's kernels for this CPU (about a minute on 2 cores, once)",
              file=sys.stderr, flush=True)
    # the terminal app lives outside edge/ (edge never imports textual); loaded for this command only
    from tui.app import ChatOptions, run_chat

    return run_chat(ChatOptions(model=args.model, system=args.system, settings=settings, n_ctx=args.ctx_size,
                                n_batch=args.batch_size, cache_type_k=args.cache_type_k,
                                cache_type_v=args.cache_type_v, resume=args.resume,
                                threads=args.threads or physical_cores(),
                                batch_invariant=args.batch_invariant, spec=spec, model_draft=model_draft))
