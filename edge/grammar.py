"""Constrained decoding: a grammar bans, at each step, the tokens that cannot continue it.

The grammar engine is llguidance (github.com/guidance-ai/llguidance): it compiles a JSON
schema, a GBNF grammar (llama.cpp's format, grammars/README.md there) or a Lark grammar, and
for a state of the text computes the bitmask of the vocabulary's tokens that keep the text a
prefix of the grammar's language. edge feeds it its own tokenizer (:func:`ll_tokenizer`: the
bytes of every token, built once per tokenizer and cached), and :class:`GrammarMask` is a
logits processor of the sampler's mask stage (edge.sampling: after logit_bias and penalties,
before top_k; greedy included) that keeps an ``llguidance.LLMatcher`` in step with the
history it is given.

Sync: the mask stage is called with the whole history (prompt, then generated tokens). The
mask remembers the generated tokens its matcher has consumed; a longer history is consumed
on, a shorter or different one (speculative decoding: a draft model's sampler calls the same
processors with its drafts, then the target's verification with the shorter accepted
history) is rolled back to the common prefix first. A token the grammar refuses is never
consumed (``try_consume_tokens``), so the matcher never enters llguidance's error state.

End: when the grammar is complete (the matcher accepts end of text) the mask allows the
model's end-of-generation tokens (Tokenizer.eog_ids, all of them), so the sequence ends with
finish_reason "stop" through edge's eog rule; when the grammar is complete and nothing more
can follow, those are the only tokens allowed. A history the grammar cannot continue (a
token it refuses, a grammar no token of the vocabulary can continue, or every allowed token
banned by logit_bias) also leaves only the eog tokens (kept finite): the generation ends
cleanly instead of failing in the sampler.

Cost on qwen2.5-coder-0.5b (151,936 tokens): ll_tokenizer about 1.1 s once; a JSON schema
compiles in about 1-2 ms; a mask step (consume, bitmask, apply) 0.1-0.4 ms (README).
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_ERROR_CHARS = 400     # llguidance's messages can carry parser state dumps: the first lines do
# The layout of JSON answers: no free whitespace, ", " and ": " between items (as llama.cpp's and
# OpenAI's answers read). llguidance's default lets a model put any amount of whitespace between
# tokens, and small models then write blanks until max_tokens (breaker20 F1).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or JSON schema llguidance cannot compile; the message names the problem."""


@dataclass(frozen=True)
class Grammar:
    """A grammar ready for llguidance: ``kind`` ("json_schema", "gbnf" or "lark"), ``source``
    (the text as given, for messages) and ``definition`` (llguidance's grammar definition, a
    JSON string; LLMatcher's input). Build with :func:`json_schema`, :func:`gbnf`."""

    kind: str
    source: str
    definition: str


def json_schema(schema) -> Grammar:
    """The grammar of JSON values valid against ``schema`` (a dict, a JSON string of one, or a
    bool: true = any JSON value), as :func:`prepare` gives it to llguidance (laid out compactly;
    another keyword llguidance does not implement is an error, not ignored).

    Raises:
        GrammarError: not a JSON object / bool, ``false`` (no value is valid).
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"a JSON schema must be an object or a boolean, got a string that is not JSON "
                               f"({e})") from None
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError("the JSON schema false accepts no value")
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    import llguidance

    text = json.dumps(schema)
    try:
        definition = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(prepare(schema)))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {_short(str(e))}") from None
    return _checked(Grammar("json_schema", text, definition))


def prepare(schema: dict) -> dict:
    """``schema`` as edge gives it to llguidance: laid out as JSON_LAYOUT unless it sets its own
    ``x-guidance`` (llguidance's options: whitespace_flexible, whitespace_pattern, ...); a
    ``oneOf`` whose branches a required ``const`` property tells apart (pydantic's discriminated
    unions) as the ``anyOf`` it equals; ``uniqueItems`` dropped (not enforced: llguidance has no
    such constraint; pydantic's ``set[...]`` parses duplicates anyway); objects closed as
    llama.cpp reads them (:func:`closed`). Returns a new schema."""
    root = schema

    def rewrite(node: dict) -> dict:
        node.pop("uniqueItems", None)
        if isinstance(node.get("oneOf"), list) and _disjoint(node["oneOf"], root):
            node["anyOf"] = node.pop("oneOf")
            node.pop("discriminator", None)
        return node

    out = closed(map_schemas(schema, rewrite))
    return out if "x-guidance" in out else {**out, "x-guidance": JSON_LAYOUT}


def closed(schema):
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists
    ``properties`` and says nothing of other keys, as llama.cpp reads such a schema
    (common/json-schema.cpp: properties without additionalProperties admit no other key; an
    object without properties admits any): a value holds no invented keys. Schemas under
    ``allOf`` are left as they are (their objects are merged). Returns a new schema."""

    def close(node: dict) -> dict:
        if isinstance(node.get("properties"), dict) and "allOf" not in node and not any(
                k in node for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
            node["additionalProperties"] = False
        return node

    return map_schemas(schema, close, skip=("allOf",))


def _disjoint(branches: list, root: dict) -> bool:
    """True when one property is required with a distinct ``const`` (or one-value ``enum``) in
    every branch (local ``$ref`` branches followed once), so no value matches two branches."""
    tags = []
    for branch in branches:
        if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
            branch = _local_ref(root, branch["$ref"])
        if not isinstance(branch, dict) or not isinstance(branch.get("properties"), dict):
            return False
        consts = {}
        for name, prop in branch["properties"].items():
            if name in (branch.get("required") or ()) and isinstance(prop, dict):
                if "const" in prop:
                    consts[name] = json.dumps(prop["const"], sort_keys=True)
                elif isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1:
                    consts[name] = json.dumps(prop["enum"][0], sort_keys=True)
        tags.append(consts)
    common = set.intersection(*(set(t) for t in tags)) if tags else set()
    return any(len({t[name] for t in tags}) == len(tags) for name in common)


def _local_ref(root: dict, ref: str):
    """The subschema a "#/..." JSON pointer names in ``root``, or None."""
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
               "contains", "propertyNames", "not", "if", "then", "else")


def map_schemas(schema, fn, skip: tuple[str, ...] = ()):
    """``schema`` with ``fn`` (dict -> dict, given a copy) applied to it and then to each of its
    subschemas (the JSON Schema keywords that hold schemas, not the keys of ``properties``);
    keywords in ``skip`` are left as they are. Returns a new schema."""
    if not isinstance(schema, dict):
        return schema
    out = fn(dict(schema))
    for key in _SUBSCHEMA_MAPS:
        if key not in skip and isinstance(out.get(key), dict):
            out[key] = {k: map_schemas(v, fn, skip) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if key not in skip and isinstance(out.get(key), list):
            out[key] = [map_schemas(v, fn, skip) for v in out[key]]
    for key in _SUBSCHEMAS:
        if key not in skip and isinstance(out.get(key), dict):
            out[key] = map_schemas(out[key], fn, skip)
        elif key == "items" and key not in skip and isinstance(out.get(key), list):
            out[key] = [map_schemas(v, fn, skip) for v in out[key]]
    return out


def gbnf(text: str) -> Grammar:
    """The grammar of a GBNF text (llama.cpp's format; a Lark grammar is taken too, as
    llguidance's grammar_from does).

    Raises:
        GrammarError: not a str, empty, or not convertible (an undefined rule, bad syntax).
    """
    if not isinstance(text, str):
        raise GrammarError(f"a grammar must be a string, got {type(text).__name__}")
    if not text.strip():
        raise GrammarError("the grammar is empty")
    import llguidance

    _fix_gbnf_converter()
    try:
        definition = llguidance.grammar_from("gbnf", text)
    except Exception as e:          # the converter raises ValueError, and others on odd input
        raise GrammarError(f"invalid grammar: {_short(str(e))}") from None
    return _checked(Grammar("gbnf", text, definition))


def _fix_gbnf_converter() -> None:
    """llguidance 1.9.1's GBNF -> Lark converter (llguidance.gbnf_to_lark) writes a repetition
    inside a repeated group without the group's parentheses (``("a"{2})+`` becomes
    ``"a"{2,2}+``, which its Lark parser refuses; llama.cpp takes it): a repetition is not
    atomic. Set once, while the converter's class still inherits ASTNode's answer."""
    from llguidance import gbnf_to_lark

    node = getattr(gbnf_to_lark, "RepetitionNode", None)
    if node is not None and "is_atomic" not in vars(node):
        node.is_atomic = lambda self: False


def lark(text: str) -> Grammar:
    """The grammar of a Lark text in llguidance's dialect (``%json {schema}`` embeds a JSON
    schema; llguidance's docs/syntax.md). Raises GrammarError when llguidance refuses it."""
    import llguidance

    try:
        definition = llguidance.grammar_from("lark", text)
    except Exception as e:          # as gbnf: ValueError, and others on odd input
        raise GrammarError(f"invalid grammar: {_short(str(e))}") from None
    return _checked(Grammar("lark", text, definition))


def from_option(flag: str, value: str) -> Grammar:
    """The grammar of a command-line option (llama-cli's names): ``--json-schema`` JSON text, or
    a file holding it when ``value`` does not start like JSON; ``--grammar`` GBNF text;
    ``--grammar-file`` a GBNF file.

    Raises:
        GrammarError: naming ``flag``, for an unreadable file or a schema / grammar llguidance
            refuses.
    """
    from pathlib import Path

    text = value
    inline_json = value.lstrip().startswith("{") or value.strip() in ("true", "false")
    if flag == "--grammar-file" or (flag == "--json-schema" and not inline_json):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            hint = " (neither a file nor a JSON object)" if flag == "--json-schema" else ""
            raise GrammarError(f"{flag}: cannot read {value}: {why}{hint}") from None
    try:
        return json_schema(text) if flag == "--json-schema" else gbnf(text)
    except GrammarError as e:
        raise GrammarError(f"{flag}: {e}") from None


def any_json_object() -> Grammar:
    """OpenAI's JSON mode (response_format json_object): any JSON object."""
    return json_schema({"type": "object"})


def _checked(grammar: Grammar) -> Grammar:
    """``grammar`` once llguidance compiles it without a vocabulary (LLMatcher.validate_grammar);
    raises GrammarError with its message otherwise."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar.definition)
    if error:
        what = "JSON schema" if grammar.kind == "json_schema" else "grammar"
        raise GrammarError(f"invalid {what}: {_short(error)}")
    return grammar


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS - 3] + "..."


# ---- the tokenizer llguidance sees --------------------------------------------------------------

class _EdgeVocab:
    """What llguidance.TokenizerWrapper reads of a tokenizer: the bytes of each token
    (Tokenizer.token_to_piece with special=True), EOS / BOS ids, the special tokens (control,
    unknown, unused and end-of-generation ones: grammar text never matches them), and a call
    that tokenizes bytes as edge does (parse_special off), as a continuation: llguidance
    tokenizes forced text with it, so a SentencePiece space prefix would be a wrong token."""

    def __init__(self, tokenizer):
        from edge.tokenizer import TokenAttr

        special = TokenAttr.CONTROL | TokenAttr.UNKNOWN | TokenAttr.UNUSED
        n = tokenizer.n_vocab
        self._tokenizer = weakref.ref(tokenizer)   # a strong one would keep ll_tokenizer's cache key alive
        self.tokens = [tokenizer.token_to_piece(i, special=True) for i in range(n)]
        self.special_token_ids = sorted({i for i in range(n) if tokenizer.token_attr(i) & special}
                                        | set(tokenizer.eog_ids))
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids, default=0)
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, data: bytes | str) -> list[int]:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            return []
        return tokenizer.encode(data, add_special=False, parse_special=False, space_prefix=False)


_ll_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ll_lock = threading.Lock()
ll_build_seconds: dict[int, float] = {}   # n_vocab -> seconds the last ll_tokenizer build took


def ll_tokenizer(tokenizer):
    """The llguidance.LLTokenizer of an edge Tokenizer (built on first use, then cached for the
    tokenizer's life; about 1.1 s for 151,936 tokens). Its EOS tokens are all the model's
    end-of-generation tokens, so a complete grammar allows each of them."""
    with _ll_lock:
        ll = _ll_cache.get(tokenizer)
        if ll is None:
            import llguidance

            t0 = time.perf_counter()
            eog = sorted(tokenizer.eog_ids)
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_EdgeVocab(tokenizer)),
                                        n_vocab=tokenizer.n_vocab, eos_token=eog or None)
            ll_build_seconds[tokenizer.n_vocab] = time.perf_counter() - t0
            _ll_cache[tokenizer] = ll
        return ll


# ---- the mask stage -----------------------------------------------------------------------------

class GrammarMask:
    """A logits processor (edge.sampling.LogitsProcessor) that bans every token the grammar
    refuses after the history (module docstring: sync, end).

    Args:
        grammar: a :class:`Grammar`.
        tokenizer: the model's edge Tokenizer.
        n_prompt: the prompt's length: history[n_prompt:] is the constrained text.
    Attributes:
        compile_seconds: the grammar's compile time (LLMatcher construction).
        mask_seconds, mask_calls: time spent in calls and their count (for measurements).
        eog_only_calls: calls that left only end-of-generation tokens (grammar complete or
            refused).
        rolled_back: tokens taken back from the matcher (histories that went back).
    Raises:
        GrammarError: llguidance refuses the grammar (its message), or no token can start it
            (it admits no finite text, or none in this vocabulary).
    """

    def __init__(self, grammar: Grammar, tokenizer, n_prompt: int):
        import llguidance
        import llguidance.numpy as llnp

        self.grammar, self.n_prompt = grammar, int(n_prompt)
        self._ll = ll_tokenizer(tokenizer)
        t0 = time.perf_counter()
        self._matcher = llguidance.LLMatcher(self._ll, grammar.definition, log_level=0)
        self.compile_seconds = time.perf_counter() - t0
        what = "JSON schema" if grammar.kind == "json_schema" else "grammar"
        if self._matcher.is_error():
            raise GrammarError(f"invalid {what}: {_short(self._matcher.get_error())}")
        self._fill = llnp.fill_next_token_bitmask
        self._n_vocab = tokenizer.n_vocab
        self._eog = np.array(sorted(tokenizer.eog_ids), np.int64)
        self._bitmask = llnp.allocate_token_bitmask(1, self._n_vocab)
        self._allowed: np.ndarray | None = None     # bool[n_vocab] for the consumed tokens
        first = self._allowed_tokens()                # the first mask (computed once anyway)
        if not self._matcher.is_accepting() and (self._matcher.is_stopped() or not first.any()):
            raise GrammarError(f"the {what} admits no text the model can write (a rule that never ends, such as "
                               "left recursion or a $ref cycle)")
        self._consumed: list[int] = []              # generated tokens the matcher has consumed
        self._refused = False                       # the history holds a token the grammar refuses
        self.mask_seconds, self.mask_calls, self.eog_only_calls, self.rolled_back = 0.0, 0, 0, 0

    @property
    def done(self) -> bool:
        """True when the constrained text so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting() and not self._refused

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        self._sync(history)
        n = logits.shape[0]
        if self._refused or self._matcher.is_stopped():
            self._only_eog(logits)
        else:
            allowed = self._allowed_tokens()
            m = min(n, self._n_vocab)
            logits[:m][~allowed[:m]] = -np.inf
            logits[m:] = -np.inf
            if logits.max() == -np.inf:              # nothing allowed is left: end cleanly
                self._only_eog(logits)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_calls += 1
        return logits

    def _only_eog(self, logits: np.ndarray) -> None:
        """Leave only the end-of-generation tokens, finite (a banned one gets logit 0)."""
        self.eog_only_calls += 1
        eog = self._eog[self._eog < logits.shape[0]]
        keep = logits[eog]
        logits[:] = -np.inf
        logits[eog] = np.where(np.isfinite(keep), keep, 0.0)

    def _allowed_tokens(self) -> np.ndarray:
        if self._allowed is None:
            self._fill(self._matcher, self._bitmask)
            bits = np.unpackbits(self._bitmask.view(np.uint8), count=self._n_vocab, bitorder="little")
            self._allowed = bits.view(bool)
        return self._allowed

    def _sync(self, history: Sequence[int]) -> None:
        """Roll the matcher back to the longest common prefix of what it consumed and
        history[n_prompt:], then consume the rest of that (up to a token it refuses)."""
        done = self._consumed
        tail = list(history[self.n_prompt:])
        k = len(done)
        if tail[:k] == done:
            common = k
        else:
            common = 0
            for a, b in zip(done, tail):
                if a != b:
                    break
                common += 1
        if common < k:
            self._matcher.rollback(k - common)
            self.rolled_back += k - common
            del done[common:]
            self._allowed = None
        new = tail[common:]
        self._refused = False
        if new:
            n_ok = self._matcher.try_consume_tokens([int(t) for t in new])
            done.extend(new[:n_ok])
            self._refused = n_ok < len(new)
            if n_ok:
                self._allowed = None


class LazyGrammarMask:
    """A logits processor whose grammar starts at a trigger (llama.cpp's lazy grammars,
    common_grammar_trigger): the generated text is free until it ends with ``trigger`` at a
    token boundary; from the token after it, ``grammar`` constrains the rest as GrammarMask
    does. Tool calls in tool_choice "auto": the answer may be text, but a call, once opened,
    names a given function with arguments valid against its schema.

    Syncs by the history as GrammarMask does: a history that goes back before the trigger
    takes the grammar off again. A trigger that ends inside a token (merged with the text
    after it) starts nothing: the answer stays free there (the tool-call parser still reads it).

    Args:
        trigger: the text that opens the constrained part (e.g. "<tool_call>").
        grammar: a :class:`Grammar` of the text after the trigger.
        tokenizer: the model's edge Tokenizer.
        n_prompt: the prompt's length: history[n_prompt:] is the generated text.
    Raises:
        GrammarError: llguidance refuses the grammar (compiled at once, so a request fails
            before it is queued).
    """

    def __init__(self, trigger: str, grammar: Grammar, tokenizer, n_prompt: int):
        self.trigger, self.grammar, self.n_prompt = trigger.encode(), grammar, int(n_prompt)
        self._tokenizer = tokenizer
        self._spare: GrammarMask | None = GrammarMask(grammar, tokenizer, n_prompt)   # checks the grammar now
        self.compile_seconds = self._spare.compile_seconds
        self._tokens: list[int] = []      # the generated tokens seen
        self._text = b""                  # their bytes
        self._ends: list[int] = []        # len(_text) after each token
        self._start: int | None = None    # tokens before the constrained part (trigger included)
        self._mask: GrammarMask | None = None
        self.triggered = 0                # times the grammar was started (for tests and metrics)

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        self._sync(history)
        return logits if self._mask is None else self._mask(history, logits)

    def _sync(self, history: Sequence[int]) -> None:
        tail = history[self.n_prompt:]
        common = 0
        for a, b in zip(self._tokens, tail):
            if a != int(b):
                break
            common += 1
        if common < len(self._tokens):
            del self._tokens[common:], self._ends[common:]
            self._text = self._text[:self._ends[-1] if self._ends else 0]
            if self._start is not None and self._start > common:
                self._start, self._mask = None, None
        for tok in tail[common:]:
            self._tokens.append(int(tok))
            self._text += self._tokenizer.token_to_piece(int(tok), special=True)
            self._ends.append(len(self._text))
            if self._start is None and self._text.endswith(self.trigger):
                self._start = len(self._tokens)
                self._mask, self._spare = self._spare or GrammarMask(self.grammar, self._tokenizer, 0), None
                self._mask.n_prompt = self.n_prompt + self._start
                self.triggered += 1
