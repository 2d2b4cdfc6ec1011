"""Constrained decoding (edge.grammar) on a tiny random ChatML model whose vocabulary is single
characters and a few JSON pieces, so llguidance can spell JSON with it.

Expected values: the exact allowed token sets of a grammar (worked out by hand from the
vocabulary), the exact greedy text of a two-way grammar (the argmax of the model's own
logits over the two first letters), schema-valid JSON, the same tokens with and without
speculative decoding (prompt lookup and a draft model, whose drafts make the mask roll
back), and the server's error shape for bad schemas and grammars."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from edge.engine import Engine
from edge.grammar import GrammarError, GrammarMask, from_option, gbnf, json_schema, ll_tokenizer
from edge.sampling import SamplingParams
from edge.speculative import SpecParams
from tests.server_process import assert_error, running
from tests.tiny_chat import IM_END, IM_START, write_tiny_chat_model

SP = "\u2581"                 # a space, as the SentencePiece vocabulary of the tiny model writes it
CHARS = list('{}[]":,.-0123456789abcdefghijklmnopqrstuvwxyz') + ['{"', '":', '",', '"}', "true", "false", "null", SP]
TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"] + CHARS
ID = {t: i for i, t in enumerate(TOKENS)}
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [IM_START, ID["u"], ID["s"], ID["e"], ID["r"], IM_END, IM_START, ID["a"], ID[":"]]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag", "ok", "xs"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["ab", "cd", "ef"]}, "ok": {"type": "boolean"},
                         "xs": {"type": "array", "items": {"enum": ["ab", "cd"]}, "minItems": 1, "maxItems": 6}}}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("grammar") / "chars.gguf", pytest.MonkeyPatch(),
                                 tokens=TOKENS, n_vocab=len(TOKENS))


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine(model_path, n_ctx=256, batch_invariant=True)


def _text(engine, ids) -> str:
    return engine.tokenizer.decode(ids).decode()


def _generate(engine, grammar, max_tokens=64, params=GREEDY, prompt=PROMPT, stats=None):
    from edge.engine import GenerationStats

    stats = stats if stats is not None else GenerationStats()
    mask = GrammarMask(grammar, engine.tokenizer, len(prompt))
    ids = list(engine.generate(prompt, params, max_tokens, stats, processors=[mask]))
    return ids, stats.finish_reason, mask


def _allowed(mask, history, n_vocab) -> set[int]:
    out = mask(history, np.zeros(n_vocab, np.float32))
    assert set(np.unique(out[np.isfinite(out)])) <= {0.0}
    assert np.all(np.isfinite(out) | (out == -np.inf))
    return set(np.flatnonzero(np.isfinite(out)).tolist())


# ---- the mask --------------------------------------------------------------------------------------

def test_mask_bans_exactly_what_the_grammar_refuses(engine):
    tok = engine.tokenizer
    assert set(tok.eog_ids) == {IM_END}
    digits = {ID[c] for c in "0123456789"}
    mask = GrammarMask(gbnf('root ::= [1-9] [0-9]* "."?'), tok, len(PROMPT))
    assert _allowed(mask, PROMPT, tok.n_vocab) == digits - {ID["0"]}
    assert _allowed(mask, PROMPT + [ID["4"]], tok.n_vocab) == digits | {ID["."], IM_END}
    assert _allowed(mask, PROMPT + [ID["4"], ID["0"], ID["."]], tok.n_vocab) == {IM_END}   # complete: eog only
    # JSON, laid out as JSON_LAYOUT: the first token opens the object, as '{"' (the canonical
    # tokenization of '{' and the '"' the first required key needs); after
    # '{"id":' exactly one space, then a digit; after a value ', "' (no other whitespace)
    m = GrammarMask(json_schema(SCHEMA), tok, len(PROMPT))
    assert _allowed(m, PROMPT, tok.n_vocab) == {ID['{"']}
    spelled = [ID['{"'], ID["i"], ID["d"], ID['":']]
    assert _allowed(m, PROMPT + spelled, tok.n_vocab) == {ID[SP]}
    assert _allowed(m, PROMPT + spelled + [ID[SP]], tok.n_vocab) == digits
    assert _allowed(m, PROMPT + spelled + [ID[SP], ID["4"]], tok.n_vocab) == digits | {ID[","]}
    assert _allowed(m, PROMPT + spelled + [ID[SP], ID["4"], ID[","]], tok.n_vocab) == {ID[SP]}
    assert m.compile_seconds > 0 and m.mask_calls == 5


def test_repetition_inside_a_repeated_group(engine):
    """F20: llama.cpp's GBNF ("a"{2})+ (llguidance's converter dropped the group's parentheses
    and refused it): pairs of a, as many as wanted."""
    tok = engine.tokenizer
    for text in ('root ::= ("a"{2})+', 'root ::= ("a"{1,2}){2}', 'root ::= ("a"{2})? "b"'):
        assert gbnf(text).kind == "gbnf"
    mask = GrammarMask(gbnf('root ::= ("a"{2})+'), tok, len(PROMPT))
    assert _allowed(mask, PROMPT, tok.n_vocab) == {ID["a"]}
    assert _allowed(mask, PROMPT + [ID["a"]], tok.n_vocab) == {ID["a"]}
    assert _allowed(mask, PROMPT + [ID["a"]] * 2, tok.n_vocab) == {ID["a"], IM_END}
    assert _allowed(mask, PROMPT + [ID["a"]] * 3, tok.n_vocab) == {ID["a"]}


def test_logits_beyond_the_vocabulary_and_bias_are_banned(engine):
    tok = engine.tokenizer
    mask = GrammarMask(gbnf('root ::= "a" | "b"'), tok, 0)
    x = np.arange(tok.n_vocab + 3, dtype=np.float32)
    out = mask([], x)
    assert np.flatnonzero(np.isfinite(out)).tolist() == [ID["a"], ID["b"]] and out[ID["b"]] == ID["b"]


def test_history_sync_and_rollback_equal_a_fresh_mask(engine):
    """Whatever order histories come in (longer, shorter, diverging: a draft model's sampler and
    the verification share one mask), the mask equals a fresh one's for that history."""
    tok = engine.tokenizer
    grammar = json_schema(SCHEMA)
    shared = GrammarMask(grammar, tok, len(PROMPT))
    rng = random.Random(5)
    walk = [ID['{"'], ID["i"], ID["d"], ID['":'], ID[SP], ID["4"], ID["2"], ID[","], ID[SP], ID['"'], ID["t"],
            ID["a"], ID["g"], ID['":'], ID[SP], ID['"'], ID["c"], ID["d"], ID['",'], ID[SP], ID['"'], ID["o"],
            ID["k"], ID['":'], ID[SP], ID["true"]]
    histories = [walk[:rng.randint(0, len(walk))] for _ in range(40)]
    histories += [walk[:9] + [ID["z"]], walk[:4] + [ID["x"], ID["x"]], walk, walk[:3], [ID["}"]], walk[:12]]
    for h in histories:
        got = _allowed(shared, PROMPT + h, tok.n_vocab)
        assert got == _allowed(GrammarMask(grammar, tok, len(PROMPT)), PROMPT + h, tok.n_vocab), h
    assert not shared._matcher.is_error() and shared.rolled_back > 20


def test_ll_tokenizer_is_built_once_per_tokenizer(engine):
    a = ll_tokenizer(engine.tokenizer)
    assert ll_tokenizer(engine.tokenizer) is a and a.vocab_size == len(TOKENS)
    assert a.eos_tokens == [IM_END]


# ---- generation ------------------------------------------------------------------------------------

def test_two_way_grammar_follows_the_models_argmax(engine):
    """'yes' or 'no': the first letter is the argmax of the model's logits over y and n, the
    rest is forced, then the end-of-generation token ends it ("stop")."""
    ids, finish, _ = _generate(engine, gbnf('root ::= "yes" | "no"'))
    kv = engine.new_cache()
    logits = engine.prefill(PROMPT, kv)
    expect = "yes" if logits[ID["y"]] > logits[ID["n"]] else "no"
    assert _text(engine, ids) == expect and finish == "stop"
    plain = list(engine.generate(PROMPT, GREEDY, 3))
    assert _text(engine, plain) != expect               # the grammar changed the answer


def test_json_schema_answers_validate(engine):
    for seed in range(3):
        ids, finish, mask = _generate(engine, json_schema(SCHEMA), 80, SamplingParams(temperature=1.0, seed=seed))
        value = json.loads(_text(engine, ids))
        assert finish == "stop" and mask.done
        assert set(value) == {"id", "tag", "ok", "xs"} and 0 <= value["id"] <= 99 and isinstance(value["id"], int)
        assert value["tag"] in ("ab", "cd", "ef") and isinstance(value["ok"], bool)
        assert 1 <= len(value["xs"]) <= 6 and set(value["xs"]) <= {"ab", "cd"}


def test_length_before_the_grammar_completes(engine):
    ids, finish, mask = _generate(engine, json_schema(SCHEMA), 5)
    assert len(ids) == 5 and finish == "length" and not mask.done


def test_complete_grammar_ends_even_with_eog_banned(engine):
    banned = SamplingParams(temperature=0.0, logit_bias={IM_END: -float("inf")})
    ids, finish, _ = _generate(engine, gbnf('root ::= "ab"'), 10, banned)
    assert _text(engine, ids) == "ab" and finish == "stop"


def test_grammar_that_cannot_continue_ends_cleanly(engine):
    """Every token the grammar allows is banned (logit_bias): only the eog token is left."""
    banned = SamplingParams(temperature=0.0, logit_bias={ID["a"]: -float("inf")})
    ids, finish, mask = _generate(engine, gbnf('root ::= "ab"'), 10, banned)
    assert ids == [] and finish == "stop" and mask.eog_only_calls == 1
    refused = GrammarMask(gbnf('root ::= "ab"'), engine.tokenizer, len(PROMPT))
    assert _allowed(refused, PROMPT + [ID["b"]], engine.tokenizer.n_vocab) == {IM_END}


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculative_decoding_gives_the_same_tokens(model_path, engine, spec):
    """Greedy constrained tokens with speculation equal those without; the draft model (the same
    weights, so its drafts are kept) calls the shared mask with its drafts first, and the
    verification with the shorter history then rolls it back."""
    grammar = json_schema({"type": "array", "items": {"enum": ["ab", "cd", "abab"]}, "minItems": 8, "maxItems": 12})
    plain, finish, _ = _generate(engine, grammar, 60)
    e2 = Engine(model_path, n_ctx=256)
    draft = Engine(model_path, n_ctx=256) if spec == "draft" else None
    e2.set_speculative(SpecParams(spec, draft_p_min=0.0), draft)
    from edge.engine import GenerationStats

    stats = GenerationStats()
    ids, finish2, mask = _generate(e2, grammar, 60, stats=stats)
    assert ids == plain and finish2 == finish
    assert stats.n_drafted > 0 and not mask._matcher.is_error()
    if spec == "draft":
        assert stats.n_accepted > 0 and mask.rolled_back > 0


def test_bench_constrained_runner(model_path):
    """edge bench --grammar's runner: N tokens plain and with the schema, its mask timed."""
    from edge.bench import JSON_SCHEMA, BenchConfig, EdgeRunner, json_prompt

    runner = EdgeRunner(BenchConfig(model=model_path, n_ctx=256))
    ids = json_prompt(runner.engine)
    assert ids[0] == IM_START
    plain, masked = runner.constrained(ids, 12, False), runner.constrained(ids, 12, True)
    assert len(plain["tokens"]) == len(masked["tokens"]) == 12 and "mask_s" not in plain
    assert masked["mask_s"] > 0 and masked["compile_s"] > 0 and masked["eog_only_steps"] == 0
    answer = [masked["first"]] + masked["tokens"]
    assert _text(runner.engine, answer).startswith("[")
    check = GrammarMask(json_schema(JSON_SCHEMA), runner.engine.tokenizer, len(ids))
    check(ids + answer, np.zeros(len(TOKENS), np.float32))
    assert len(check._consumed) == 13 and not check._refused     # every token keeps to the schema


# ---- grammars and options --------------------------------------------------------------------------

@pytest.mark.parametrize("make,value,message", [
    (json_schema, {"type": "intger"}, "invalid JSON schema: Invalid type: intger"),
    (json_schema, False, "accepts no value"),
    (json_schema, "[1", "got a string that is not JSON"),
    (json_schema, 5, "must be an object or a boolean"),
    (gbnf, "root ::= foo", "Rule 'foo' not found"),
    (gbnf, "  ", "the grammar is empty"),
    (gbnf, 'root ::= "a" [', "invalid grammar"),
])
def test_bad_grammars_are_grammar_errors(make, value, message):
    with pytest.raises(GrammarError, match=message):
        make(value)


PETS = {"$defs": {"Cat": {"type": "object", "required": ["k", "meows"], "properties": {
                     "k": {"const": "cat"}, "meows": {"type": "integer"}}},
                 "Dog": {"type": "object", "required": ["k", "barks"], "properties": {
                     "k": {"enum": ["dog"]}, "barks": {"type": "number"}}}},
        "type": "object", "required": ["pet", "tags"], "properties": {
            "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                    "discriminator": {"propertyName": "k"}},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "uniqueItems": {"type": "boolean"}}}


def test_discriminated_one_of_and_unique_items():
    """F26: a oneOf whose branches a required const tells apart (pydantic's discriminated
    unions) is the anyOf it equals; uniqueItems (pydantic's set[...]) is dropped, not a 400 (a
    property named uniqueItems stays); other oneOfs stay llguidance's 400."""
    from edge.grammar import JSON_LAYOUT, prepare

    out = prepare(PETS)
    assert out["properties"]["pet"] == {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}
    assert out["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    assert out["properties"]["uniqueItems"] == {"type": "boolean"} and out["x-guidance"] == JSON_LAYOUT
    closed = {k: {**v, "additionalProperties": False} for k, v in PETS["$defs"].items()}   # llama.cpp's reading
    assert out["$defs"] == closed and PETS["properties"]["tags"]["uniqueItems"] is True   # a copy
    assert json_schema(PETS).kind == "json_schema"
    same = {"oneOf": [{"type": "object", "required": ["k"], "properties": {"k": {"const": 1}, "a": {}}},
                      {"type": "object", "required": ["k"], "properties": {"k": {"const": 1}, "b": {}}}]}
    assert "oneOf" in prepare(same)
    with pytest.raises(GrammarError, match="oneOf"):
        json_schema(same)


def test_listed_properties_close_an_object_as_llama_cpp_reads_it():
    """properties without additionalProperties admit no other key (llama.cpp's
    common/json-schema.cpp; the client pass got {"a": 1, "b": 2, "c": 3} for a schema of "a");
    an object without properties, or one that says additionalProperties, keeps its reading."""
    from edge.grammar import prepare

    out = prepare({"type": "object", "properties": {"a": {"type": "integer"}, "o": {"type": "object"}},
                   "required": ["a"]})
    assert out["additionalProperties"] is False and "additionalProperties" not in out["properties"]["o"]
    assert prepare({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True
    g = json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert "additionalProperties" not in json.loads(g.source)        # the client's schema as given


def test_options_read_files_and_name_the_flag(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"type": "integer"}))
    assert from_option("--json-schema", str(f)).kind == "json_schema"
    assert from_option("--json-schema", '{"type": "integer"}').source == '{"type": "integer"}'
    g = tmp_path / "g.gbnf"
    g.write_text('root ::= "a"')
    assert from_option("--grammar-file", str(g)).kind == "gbnf"
    with pytest.raises(GrammarError, match=r"^--json-schema: cannot read nope\.json: No such file"):
        from_option("--json-schema", "nope.json")
    with pytest.raises(GrammarError, match=r"^--grammar-file: invalid grammar"):
        g.write_text("root ::= x")
        from_option("--grammar-file", str(g))


def test_edge_run_options(model_path, tmp_path, capsys):
    from edge.cli import main

    args = ["run", "-m", str(model_path), "--raw", "--temp", "0", "-c", "128", "-n", "30", "ab"]
    assert main(args + ["--grammar", 'root ::= "yes" | "no"']) == 0
    out = capsys.readouterr()
    assert out.out in ("yes", "no") and "finish: stop" in out.err and "grammar: compiled in" in out.err
    assert main(args + ["-j", '{"type": "intger"}']) == 1
    assert capsys.readouterr().err.strip() == "edge run: error: --json-schema: invalid JSON schema: Invalid type: intger"
    assert main(args + ["--grammar-file", str(tmp_path / "none.gbnf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("edge run: error: --grammar-file: cannot read") and "\n" not in err
    assert main(args + ["-j", "{}", "--grammar", 'root ::= "a"']) == 1
    assert "give one of --json-schema, --grammar, not several" in capsys.readouterr().err


# ---- the server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with running(["-m", str(model_path), "-np", "2", "-c", "256"], tmp_path_factory.mktemp("gserve") / "serve.log",
                 60) as srv:
        yield srv


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("route,extra,param,needle", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "intger"}}}}}}, "response_format", "Invalid type: intger"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema object"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": False}}},
     "response_format", "accepts no value"),
    # F17: OpenAI's name and strict rules
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "must be 1-64 letters"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!!",
                                                                                          "schema": {}}}},
     "response_format.json_schema.name", "bad name!!"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes",
                                                                                          "schema": {}}}},
     "response_format.json_schema.strict", "must be a boolean"),
    # F4: a schema that is a string but no JSON
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": "string"}}},
     "response_format", "must be an object or a boolean, got a string that is not JSON"),
    # F5: no finite text
    ("/v1/chat/completions", {"grammar": 'root ::= x\nx ::= x "a"'}, "grammar", "admits no text"),
    ("/v1/completions", {"grammar": 'root ::= x\nx ::= x "a"'}, "grammar", "admits no text"),
    ("/v1/completions", {"json_schema": {"$ref": "#"}}, "json_schema", "admits no text"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
     "response_format", "admits no text"),
    # F3: response_format on /v1/completions too
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "intger"}}}}, "response_format", "Invalid type: intger"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'},
     "response_format", "give one"),
    ("/v1/chat/completions", {"json_schema": {"type": "intger"}}, "json_schema", "Invalid type: intger"),
    ("/v1/completions", {"json_schema": {"type": "intger"}}, "json_schema", "Invalid type: intger"),
    ("/v1/completions", {"grammar": "not a grammar ::="}, "grammar", "invalid grammar"),
    ("/v1/completions", {"grammar": "root ::= foo"}, "grammar", "Rule 'foo' not found"),
    ("/v1/completions", {"grammar": 'root ::= "a"', "json_schema": {}}, "grammar", "not both"),
])
def test_server_bad_schema_or_grammar_is_400(server, route, extra, param, needle):
    req = {"messages": HI} if "chat" in route else {"prompt": "hi"}
    status, body = server.post(route, {**req, "max_tokens": 4, **extra})
    err = assert_error(status, body, 400, param=param, code="invalid_value")
    assert needle in err["message"] and err["message"].startswith(param)


def test_server_response_format_type_unknown_is_400(server):
    status, body = server.post("/v1/chat/completions", {"messages": HI, "response_format": {"type": "xml"}})
    err = assert_error(status, body, 400, param="response_format", code="unsupported_value")
    assert "xml" in err["message"]
    status, body = server.post("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}})
    assert_error(status, body, 400, param="response_format", code="unsupported_value")


def test_server_response_format_without_type_is_400(server):
    """F2: OpenAI's 400 for a response_format without its type (not a silent plain answer)."""
    for route, req in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})):
        status, body = server.post(route, {**req, "response_format": {"json_schema": {"name": "x", "schema": {
            "type": "integer"}}}})
        err = assert_error(status, body, 400, param="response_format.type", code="invalid_value")
        assert err["message"].startswith("Missing required parameter: 'response_format.type'")


def test_server_null_flags_and_reserved_tools_variable(server):
    """F10: null for logprobs, stream and parallel_tool_calls is their default; F12: tools is a
    template variable the server sets itself; F5: a blank grammar is no grammar (as "")."""
    status, body = server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "temperature": 0,
                                                        "logprobs": None, "stream": None,
                                                        "parallel_tool_calls": None, "grammar": "  "})
    assert status == 200 and body["object"] == "chat.completion" and body["choices"][0]["logprobs"] is None
    status, body = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": None, "echo": None})
    assert status == 200 and body["object"] == "text_completion"
    status, body = server.post("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"tools": 5}})
    assert_error(status, body, 400, param="chat_template_kwargs.tools", code="invalid_value")


def test_server_constrained_answers(server, engine):
    """The server's answers equal the engine's for the same prompt ids and grammar; json_object
    gives an object; max_tokens cuts with "length"."""
    status, body = server.post("/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 20,
                                                   "grammar": 'root ::= "yes" | "no"'})
    ids, _, _ = _generate(engine, gbnf('root ::= "yes" | "no"'))
    assert status == 200 and body["choices"][0]["text"] == _text(engine, ids)
    assert body["choices"][0]["finish_reason"] == "stop"
    status, body = server.post("/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 80,
                                                   "json_schema": SCHEMA})
    ids, _, _ = _generate(engine, json_schema(SCHEMA), 80)
    assert status == 200 and body["choices"][0]["text"] == _text(engine, ids)
    status, body = server.post("/v1/chat/completions", {"messages": HI, "temperature": 0, "max_tokens": 120,
                                                        "response_format": {"type": "json_schema", "json_schema": {
                                                            "name": "t", "schema": SCHEMA, "strict": True}}})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert set(json.loads(body["choices"][0]["message"]["content"])) == set(SCHEMA["required"])
    status, body = server.post("/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 80,
                                                   "response_format": {"type": "json_schema", "json_schema": {
                                                       "name": "t", "schema": SCHEMA}}})     # F3
    assert status == 200 and body["choices"][0]["text"] == _text(engine, ids)
    status, body = server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 3, "temperature": 0,
                                                        "response_format": {"type": "json_object"}})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"].startswith("{") and body["usage"]["completion_tokens"] == 3
