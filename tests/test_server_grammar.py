"""Constrained decoding through `edge serve` on the default model (qwen2.5-coder-0.5b-instruct)
with the official openai client: response_format json_schema on 20 varied schemas (nested
objects, arrays with bounds, enums, bounded numbers, required and optional fields), the client's
``chat.completions.parse`` with a pydantic model, json_object, llama-server's json_schema and
grammar fields, streamed equal to not streamed. Greedy, short answers, one server.

Expected values: every answer parses and is valid against its schema (checked by hand below,
the subset of JSON Schema the schemas use), or is one of a grammar's sentences."""
from __future__ import annotations

import json
from typing import Literal

import pytest

from tests.server_process import running

openai = pytest.importorskip("openai", reason="the server tests talk through the official openai client "
                                               "(pip install -e .[test])")
pydantic = pytest.importorskip("pydantic")
MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def server(qwen_path, tmp_path_factory):
    with running(["-m", str(qwen_path), "-np", "2", "-c", "1024"], tmp_path_factory.mktemp("gserve") / "serve.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=300)


def _valid(value, schema: dict, path: str = "$") -> None:
    """Assert ``value`` is valid against ``schema`` (type, properties, required,
    additionalProperties false, items, minItems, maxItems, enum, minimum, maximum)."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    kind = schema.get("type")
    if kind is not None:
        assert isinstance(value, types[kind]) and not (kind in ("integer", "number") and isinstance(value, bool)), \
            (path, value, kind)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if "minimum" in schema:
        assert value >= schema["minimum"], (path, value)
    if "maximum" in schema:
        assert value <= schema["maximum"], (path, value)
    if kind == "object":
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= set(value), (path, value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (path, value)
        for key, sub in props.items():
            if key in value:
                _valid(value[key], sub, f"{path}.{key}")
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), (path, value)
        for i, item in enumerate(value):
            _valid(item, schema.get("items", {}), f"{path}[{i}]")


SCHEMAS = [
    ("a person", {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 18, "maximum": 65},
                                 "email": {"type": "string"}}}),
    ("a todo list of three items", {"type": "object", "required": ["items"], "additionalProperties": False,
                                    "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
                                        "type": "object", "required": ["title", "done"], "additionalProperties": False,
                                        "properties": {"title": {"type": "string"}, "done": {"type": "boolean"}}}}}}),
    ("the weather in Paris", {"type": "object", "required": ["city", "sky", "celsius"], "additionalProperties": False,
                              "properties": {"city": {"type": "string"},
                                             "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                             "celsius": {"type": "number", "minimum": -30, "maximum": 45}}}),
    ("a book with its author", {"type": "object", "required": ["title", "author", "year"],
                                "additionalProperties": False,
                                "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1800,
                                                                                     "maximum": 2025},
                                               "author": {"type": "object", "required": ["first", "last"],
                                                          "additionalProperties": False,
                                                          "properties": {"first": {"type": "string"},
                                                                         "last": {"type": "string"}}}}}),
]
S = {"type": "string", "maxLength": 40}           # short strings: greedy answers end within max_tokens


def _obj(required, **props):
    return {"type": "object", "additionalProperties": False, "required": list(required), "properties": props}


SCHEMAS += [
    ("a point in 3D", _obj("xyz", x={"type": "number"}, y={"type": "number"}, z={"type": "number"})),
    ("a yes/no verdict with a reason", _obj(["verdict", "reason"], verdict={"type": "boolean"}, reason=S)),
    ("an HTTP status", _obj(["code", "phrase"], code={"type": "integer", "minimum": 100, "maximum": 599}, phrase=S)),
    ("a list of three prime numbers", {"type": "array", "minItems": 3, "maxItems": 3,
                                       "items": {"type": "integer", "minimum": 2, "maximum": 100}}),
    ("a traffic light state", _obj(["light"], light={"enum": ["red", "amber", "green"]})),
    ("a product", _obj(["name", "price", "tags"], name=S, price={"type": "number", "minimum": 0, "maximum": 10000},
                       tags={"type": "array", "maxItems": 4, "items": S})),
    ("a chess move", _obj(["from", "to", "piece"], piece={"enum": ["king", "queen", "rook", "bishop", "knight", "pawn"]},
                          **{"from": {"type": "string", "maxLength": 2}, "to": {"type": "string", "maxLength": 2}})),
    ("a rating of a film", _obj(["film", "stars"], film=S, stars={"type": "integer", "minimum": 1, "maximum": 5})),
    ("a Python function signature", _obj(["name", "args", "returns"], name=S,
                                         args={"type": "array", "maxItems": 4, "items": _obj(["name", "type"], name=S, type=S)},
                                         returns=S)),
    ("a matrix of 2 by 2 integers", {"type": "array", "minItems": 2, "maxItems": 2,
                                     "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer"}}}),
    ("an address", _obj(["street", "city", "zip", "country"], street=S, city=S, zip=S,
                        country={"enum": ["FR", "DE", "US", "JP"]})),
    ("a git commit", _obj(["hash", "message", "files_changed"], hash={"type": "string", "maxLength": 12}, message=S,
                          files_changed={"type": "integer", "minimum": 0, "maximum": 50})),
    ("a temperature conversion", _obj(["celsius", "fahrenheit"], celsius={"type": "number", "minimum": -50, "maximum": 50},
                                      fahrenheit={"type": "number"})),
    ("a recipe with two ingredients", _obj(["dish", "ingredients"], dish=S,
                                           ingredients={"type": "array", "minItems": 2, "maxItems": 2,
                                                        "items": _obj(["item", "grams"], item=S,
                                                                      grams={"type": "integer", "minimum": 1, "maximum": 1000})})),
    ("a server config", _obj(["host", "port", "tls", "workers"], host=S, port={"type": "integer", "minimum": 1, "maximum": 65535},
                             tls={"type": "boolean"}, workers={"type": "integer", "minimum": 1, "maximum": 16})),
    ("an optional nickname and a required name", _obj(["name"], name=S, nickname=S)),
]


@pytest.mark.parametrize("what,schema", SCHEMAS, ids=["-".join(w.split()[1:3]) for w, _ in SCHEMAS])
def test_json_schema_answers_validate(client, what, schema):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Give {what} as JSON."}], temperature=0, max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    _valid(json.loads(choice.message.content), schema)


class Step(pydantic.BaseModel):
    explanation: str
    output: str


class MathAnswer(pydantic.BaseModel):
    steps: list[Step]
    final_answer: int
    confidence: Literal["low", "high"]


def test_client_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, temperature=0, max_tokens=300, response_format=MathAnswer,
                                      messages=[{"role": "user", "content": "Solve 8x + 7 = 23 step by step."}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, MathAnswer) and r.choices[0].finish_reason == "stop"
    assert parsed.confidence in ("low", "high") and all(isinstance(s, Step) for s in parsed.steps)


class Math(pydantic.BaseModel):
    steps: list[Step]
    final_answer: str


def test_openai_math_example_finishes(client):
    """OpenAI's structured-output example (Step / Math, "Solve 8x + 7 = -23."): the JSON is laid
    out compactly (edge.grammar.JSON_LAYOUT), so the 0.5b model closes it instead of writing
    blanks after '{' until max_tokens (breaker20 F1); streamed the same."""
    kw = dict(model=MODEL, temperature=0, max_tokens=200, response_format=Math,
              messages=[{"role": "user", "content": "Solve 8x + 7 = -23."}])
    r = client.chat.completions.parse(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Math) and choice.message.parsed.steps
    text = choice.message.content
    assert text.startswith('{"steps": [{"explanation": "') and "  " not in text and "\n" not in text
    assert json.loads(text) == choice.message.parsed.model_dump()
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == text and final.choices[0].finish_reason == "stop"


class Cat(pydantic.BaseModel):
    pet_type: Literal["cat"]
    lives: int


class Dog(pydantic.BaseModel):
    pet_type: Literal["dog"]
    good: bool


class Owner(pydantic.BaseModel):
    name: str
    pet: Cat | Dog = pydantic.Field(discriminator="pet_type")
    hobbies: set[str]


def test_client_parse_with_a_discriminated_union_and_a_set(client):
    """F26: pydantic's discriminated union (oneOf + discriminator) and set[str] (uniqueItems)
    through chat.completions.parse: an Owner, not a 400."""
    schema = Owner.model_json_schema()
    assert "oneOf" in schema["properties"]["pet"] and schema["properties"]["hobbies"]["uniqueItems"] is True
    r = client.chat.completions.parse(model=MODEL, temperature=0, max_tokens=120, response_format=Owner,
                                      messages=[{"role": "user", "content": "Alice has a dog; she likes chess."}])
    parsed = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop" and isinstance(parsed, Owner)
    assert parsed == Owner(name="Alice", pet=Dog(pet_type="dog", good=True), hobbies={"chess"})


def test_json_object_streamed_equals_not_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}], temperature=0,
              max_tokens=80, response_format={"type": "json_object"})
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert r.choices[0].finish_reason == "length" and text.lstrip().startswith("{")


def test_llama_server_fields(client):
    r = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", temperature=0, max_tokens=8,
                                  extra_body={"grammar": 'root ::= " " ("yes" | "no")'})
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop"
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 3}
    r = client.completions.create(model=MODEL, prompt="Three digits as a JSON array:", temperature=0, max_tokens=20,
                                  extra_body={"json_schema": schema})
    _valid(json.loads(r.choices[0].text), schema)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a color."}],
                                       temperature=0, max_tokens=8,
                                       extra_body={"grammar": 'root ::= "red" | "green" | "blue"'})
    assert r.choices[0].message.content in ("red", "green", "blue")
