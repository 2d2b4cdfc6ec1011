"""llama-server's native API on `edge serve` (edge.server.llama_server), over plain HTTP.

One server per module on the default model (qwen2.5-coder-0.5b-instruct, a coder model with FIM
tokens; -np 2, -c 2048, --slot-save-path): /infill whose greedy middle makes the file compile and
whose second request in the same file reuses the prefix cache, llama.vscode's request through
the infill sampler (sampled at temperature 1, ending on EOG), /completion's object and its
server-sent events (prompt progress, timings per token), ``timings`` consistent with the token
counts on every route (OpenAI's too), logit_bias in llama-server's forms, n_indent, n_predict 0,
/props, /slots with a save / erase / restore round trip that gives the same continuation,
/apply-template, /tokenize with_pieces, and llama-server's error shape. The FIM prompt layout and
the refusal of a model without FIM tokens are checked on the tokenizers alone, /slots actions
without --slot-save-path on the app without a model. Greedy and short answers throughout.
"""
from __future__ import annotations

import json
import time

import pytest

from edge.gguf_file import GGUFFile
from edge.server import llama_server as L
from edge.server import protocol as P
from edge.server.app import ServerConfig
from edge.server.asgi import create_app
from edge.tokenizer import Tokenizer
from tests.server_process import running, sse_events

N_CTX = 2048
GREEDY = {"temperature": 0}
MEAN_PREFIX = ("import math\n\n\ndef stdev(xs):\n    \"\"\"The standard deviation of xs.\"\"\"\n    m = mean(xs)\n"
               "    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))\n\n\ndef mean(xs):\n")
MEAN_SUFFIX = "\n\n\nprint(mean([1, 2, 3]))\n"
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively in a loop.\"\"\"\n"


@pytest.fixture(scope="module")
def server(qwen_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lserve")
    with running(["-m", str(qwen_path), "-np", "2", "-c", str(N_CTX), "--slot-save-path", str(folder / "slots")],
                 folder / "serve.log") as srv:
        srv.slot_dir = folder / "slots"
        yield srv


@pytest.fixture(scope="module")
def qwen_tok(qwen_path):
    return Tokenizer.from_gguf(GGUFFile(qwen_path))


def _ok(server, path: str, body: dict) -> dict:
    status, out = server.post(path, body)
    assert status == 200, out
    return out


def _llama_error(status: int, body: dict, want: int, kind: str | None = None) -> str:
    """The message of an error in llama-server's shape {"error": {"code", "message", "type"}}
    (edge adds "param" when a field is at fault)."""
    assert status == want, body
    err = body["error"]
    assert set(body) == {"error"} and {"code", "message", "type"} <= set(err) <= {"code", "message", "type", "param"}
    assert err["code"] == want and isinstance(err["message"], str) and err["message"]
    assert err["type"] == (kind or {400: "invalid_request_error", 501: "not_supported_error"}[want])
    return err["message"]


def _check_timings(t: dict, predicted: int, evaluated: int) -> None:
    assert set(t) == {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    assert t["predicted_n"] == predicted and t["prompt_n"] + t["cache_n"] == evaluated and t["prompt_n"] >= 1
    assert t["prompt_ms"] > 0 and t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    assert t["prompt_per_second"] == pytest.approx(1e3 * t["prompt_n"] / t["prompt_ms"])
    if predicted > 1:
        assert t["predicted_ms"] > 0
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / predicted)
        assert t["predicted_per_second"] == pytest.approx(1e3 * predicted / t["predicted_ms"])


# ---- the FIM prompt, on the tokenizers ----------------------------------------------------------

def test_fim_prompt_layout(qwen_tok):
    ids = qwen_tok.special_ids
    enc = lambda s: qwen_tok.encode(s, add_special=False, parse_special=False)   # noqa: E731
    pre, suf, mid = ids["fim_pre"], ids["fim_suf"], ids["fim_mid"]
    out = L.fim_prompt(qwen_tok, "def f(x):\n", "\nprint(f(1))\n", [], enc("    return"), 512, -1, N_CTX)
    assert out == [pre] + enc("def f(x):\n") + enc("    return") + [suf] + enc("\nprint(f(1))\n") + [mid]
    extra = [L.ExtraChunk(filename="util.py", text="X = 1\n")]
    out = L.fim_prompt(qwen_tok, "a = 1\n", "", extra, [], 512, 16, N_CTX)
    want = ([ids["fim_rep"]] + enc("myproject\n") + [ids["fim_sep"]] + enc("util.py\n") + enc("X = 1\n")
            + [ids["fim_sep"]] + enc("filename\n") + [pre] + enc("a = 1\n") + [suf, mid])
    assert out == want
    # code that spells a special token stays text; the prefix keeps its end, the suffix its start
    assert pre not in L.fim_prompt(qwen_tok, "<|fim_prefix|>", "", [], [], 512, -1, N_CTX)[1:]
    long = "".join(f"x{i} = {i}\n" for i in range(400))
    out = L.fim_prompt(qwen_tok, long, long, [], [], 64, -1, N_CTX)
    n = len(enc(long))
    cut = -(-(n - 48) // L.FIM_ALIGN) * L.FIM_ALIGN         # at most 48 tokens, cut at a multiple of 64
    kept = n - cut
    assert 48 - L.FIM_ALIGN < kept <= 48 and out[1 : 1 + kept] == enc(long)[cut:]
    assert out[2 + kept : 16 + kept] == enc(long)[:14] and len(out) == 3 + kept + 14
    # typing at the end keeps the start of the prompt while the cut stays
    more = L.fim_prompt(qwen_tok, long + "y", long, [], [], 64, -1, N_CTX)
    assert more[1:kept] == out[1:kept] or kept + 1 > 48


@pytest.mark.parametrize("name", ["smollm2_path", "gemma_path"])
def test_fim_refused_without_fim_tokens(name, request):
    tok = Tokenizer.from_gguf(GGUFFile(request.getfixturevalue(name)))
    with pytest.raises(P.APIError) as e:
        L.fim_prompt(tok, "a", "b", [], [], 512, -1, N_CTX, "m")
    assert e.value.status == 501 and L.error_response("/infill", e.value).body.startswith(
        b'{"error":{"code":501,"message":"Infill is not supported')           # llama-server's not_supported_error
    assert e.value.message.startswith("Infill is not supported by this model: prefix token is missing. suffix token "
                                      "is missing. middle token is missing. ")


def test_slot_actions_without_save_path():
    from starlette.testclient import TestClient

    client = TestClient(create_app(ServerConfig(model=None), load=False), base_url="http://127.0.0.1")
    r = client.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 501
    assert r.json() == {"error": {"code": 501, "type": "not_supported_error", "message":
                                  "This server does not support slots action. Start it with `--slot-save-path`"}}


# ---- /infill ------------------------------------------------------------------------------------

def test_infill_compiles_and_reuses_the_prefix_cache(server):
    out = _ok(server, "/infill", {"input_prefix": MEAN_PREFIX, "input_suffix": MEAN_SUFFIX, "n_predict": 48, **GREEDY})
    middle = out["content"]
    assert middle.strip() and out["stop_type"] in ("eos", "limit") and out["stop"] is True
    compile(MEAN_PREFIX + middle + MEAN_SUFFIX, "x.py", "exec")
    assert out["prompt"].startswith("<|fim_prefix|>import math") and out["prompt"].endswith("<|fim_middle|>")
    _check_timings(out["timings"], out["tokens_predicted"], out["tokens_evaluated"])
    first = out["timings"]
    # the next keystroke in the same file: the prompt starts the same, its blocks are cached
    out = _ok(server, "/infill", {"input_prefix": MEAN_PREFIX + "    n = len(xs)\n", "input_suffix": MEAN_SUFFIX,
                                  "n_predict": 8, **GREEDY})
    assert out["timings"]["cache_n"] >= 16 and out["timings"]["prompt_n"] < first["prompt_n"]


def test_infill_repository_context_and_editor_fields(server):
    """llama.vscode's two requests: the context warm-up (n_predict 0, samplers []) and a
    completion with its sampler list, n_indent and time limits."""
    extra = [{"filename": "stats/util.py", "text": "def mean(xs):\n    return sum(xs) / len(xs)\n"}]
    warm = _ok(server, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
                                   "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500,
                                   "t_max_predict_ms": 1})
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["timings"]["predicted_n"] == 0
    assert warm["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>stats/util.py\ndef mean(xs):")
    assert "<|file_sep|>filename\n<|fim_prefix|>" in warm["prompt"]
    out = _ok(server, "/infill", {"input_prefix": "from stats.util import mean\n\n\ndef variance(xs):\n",
                                  "input_suffix": "\n", "input_extra": extra, "prompt": "    m = ", "n_predict": 24,
                                  "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
                                  "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500,
                                  "t_max_predict_ms": 250, **GREEDY})
    assert "<|fim_prefix|>from stats.util import mean\n\n\ndef variance(xs):\n    m = <|fim_suffix|>" in out["prompt"]
    assert out["timings"]["cache_n"] >= 16        # the warm-up cached the repository part
    gs = out["generation_settings"]        # samplers left out of the list are off; greedy stays greedy
    assert (gs["top_k"], gs["top_p"], gs["min_p"], gs["temperature"]) == (40, 0.99, 0.0, 0.0)
    # llama.vscode's n_cmpl (its max_parallel_completions, 3 by default): an array of completions,
    # as many as -np allows (2 here)
    outs = _ok(server, "/infill", {"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    return ",
                                   "n_predict": 6, "n_cmpl": 2, "top_k": 40, "top_p": 0.99, "seed": 7,
                                   "samplers": ["top_k", "top_p", "infill"]})
    assert isinstance(outs, list) and [o["index"] for o in outs] == [0, 1]
    assert all(o["tokens_predicted"] >= 1 and o["prompt"] == outs[0]["prompt"] for o in outs)
    assert "n_cmpl must be in 1..2" in _llama_error(*server.post("/infill", {"input_prefix": "a", "input_suffix": "b",
                                                                            "n_cmpl": 3}), 400)


# llama.vscode's completion request, field for field (llama.vim sends the same samplers): no
# temperature in the sampler list, so tokens are drawn at temperature 1 from what top_k, top_p and
# infill leave
VSCODE = {"prompt": "", "n_predict": 128, "top_k": 40, "top_p": 0.99, "stream": False,
          "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
          "t_max_predict_ms": 1000}


def test_infill_sampler_on_llama_vscodes_request(server):
    """The infill sampler is applied (generation_settings lists it): the middle it samples
    completes the file and ends on an end-of-generation token (measured: " + b\n" in 30 of 30
    draws; without "infill" 3 of 10, the others running on past the function until the time
    limit). Infill before a sampler that is on is refused; "infill" works on /v1/completions'
    sampler list too."""
    prefix, suffix = "def add(a, b):\n    return a", "\n\n\nprint(add(1, 2))\n"
    extra = [{"filename": "calc/sub.py", "text": "def sub(a, b):\n    return a - b\n"}]
    out = _ok(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, **VSCODE})
    assert out["content"].strip() and out["stop"] is True and out["stop_type"] == "eos"
    compile(prefix + out["content"] + suffix, "add.py", "exec")
    gs = out["generation_settings"]
    assert gs["samplers"][-1] == "infill"
    assert (gs["top_k"], gs["top_p"], gs["min_p"], gs["temperature"]) == (40, 0.99, 0.0, 1.0)
    msg = _llama_error(*server.post("/infill", {"input_prefix": prefix, "input_suffix": suffix,
                                                **VSCODE, "samplers": ["infill", "top_k", "top_p"]}), 400)
    assert "infill" in msg and "top_k" in msg
    status, body = server.post("/v1/completions", {"prompt": "def add(a, b):\n", "max_tokens": 4, "top_k": 40,
                                                   "samplers": ["top_k", "top_p", "min_p", "temperature", "infill"]})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


# ---- /completion ----------------------------------------------------------------------------------

def test_completion_object(server, qwen_tok):
    out = _ok(server, "/completion", {"prompt": PROMPT, "n_predict": 10, "return_tokens": True, "n_probs": 2,
                                      **GREEDY})
    assert set(out) == {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
                        "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated", "stop_type",
                        "stopping_word", "tokens_cached", "timings", "completion_probabilities"}
    assert out["model"] == "qwen2.5-coder-0.5b-instruct" and out["prompt"] == PROMPT and out["stop"] is True
    assert out["stop_type"] == "limit" and out["stopping_word"] == "" and out["truncated"] is False
    assert out["tokens_predicted"] == 10 == len(out["tokens"]) and 0 <= out["id_slot"] < 2
    assert out["tokens_evaluated"] == len(qwen_tok.encode(PROMPT, add_special=False, parse_special=True))
    assert qwen_tok.decode(out["tokens"]).decode() == out["content"] and out["has_new_line"] == ("\n" in out["content"])
    assert out["tokens_cached"] == out["tokens_evaluated"] + 9
    _check_timings(out["timings"], 10, out["tokens_evaluated"])
    gs = out["generation_settings"]
    assert gs["n_predict"] == 10 and gs["temperature"] == 0 and gs["n_probs"] == 2 and gs["n_ctx"] == N_CTX
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"]
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and len(p["top_logprobs"]) == 2
        assert p["top_logprobs"][0]["id"] == p["id"] and p["logprob"] == pytest.approx(p["top_logprobs"][0]["logprob"])
        assert bytes(p["bytes"]).decode(errors="ignore") == p["token"]
    # a stop word, and the same prompt as token ids and text mixed
    ids = qwen_tok.encode(PROMPT, add_special=False, parse_special=True)
    word = out["content"].split()[1]
    out2 = _ok(server, "/completion", {"prompt": [*ids[:-1], qwen_tok.decode(ids[-1:]).decode()], "n_predict": 10,
                                       "stop": [word], **GREEDY})
    assert out2["tokens_evaluated"] == len(ids) and out2["stop_type"] == "word" and out2["stopping_word"] == word
    assert out2["content"] == out["content"][: out["content"].index(word)]


def test_completion_stream(server):
    base = _ok(server, "/completion", {"prompt": PROMPT + "    ", "n_predict": 8, "return_tokens": True, **GREEDY})
    status, ctype, raw = server.request("POST", "/completion", {"prompt": PROMPT + "    ", "n_predict": 8,
                                                                "stream": True, "return_progress": True,
                                                                "timings_per_token": True, **GREEDY})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(raw)]            # no [DONE] on llama-server's native routes
    progress, parts, last = events[0], events[1:-1], events[-1]
    pp = progress["prompt_progress"]
    assert pp["total"] == base["tokens_evaluated"] == pp["processed"] and pp["cache"] <= pp["total"]
    assert parts and all(p["stop"] is False and "timings" in p for p in parts)
    assert "".join(p["content"] for p in parts) == base["content"]
    assert [t for p in parts for t in p["tokens"]] == base["tokens"]
    assert [p["tokens_predicted"] for p in parts] == [p["timings"]["predicted_n"] for p in parts]
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == [] and last["stop_type"] == "limit"
    _check_timings(last["timings"], 8, base["tokens_evaluated"])


def test_progress_of_a_long_prompt_and_several_prompts(server):
    """A prompt longer than -b (512) is computed in two steps: a progress event after each."""
    prompt = "".join(f"y{i} = {i}\n" for i in range(110))
    status, _, raw = server.request("POST", "/completion", {"prompt": prompt, "n_predict": 1, "stream": True,
                                                            "return_progress": True, **GREEDY})
    events = [json.loads(e) for e in sse_events(raw)]
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    total = events[-1]["tokens_evaluated"]
    assert total > 512 and [p["processed"] for p in progress] == [512, total]
    assert all(p["total"] == total and p["cache"] == 0 for p in progress)
    assert progress[0]["time_ms"] <= progress[1]["time_ms"]
    # several prompts: one answer each, in order
    outs = _ok(server, "/completion", {"prompt": ["The capital of France is", "def add(a, b):\n"], "n_predict": 2,
                                       **GREEDY})
    assert [o["index"] for o in outs] == [0, 1] and [o["prompt"] for o in outs] == ["The capital of France is",
                                                                                     "def add(a, b):\n"]


def test_n_predict_zero_caches_the_prompt(server):
    prompt = PROMPT + "# n_predict 0 only computes this prompt, once\n"
    out = _ok(server, "/completion", {"prompt": prompt, "n_predict": 0})
    assert out["content"] == "" and out["tokens_predicted"] == 0 and out["stop_type"] == "limit"
    again = _ok(server, "/completion", {"prompt": prompt, "n_predict": 1, **GREEDY})
    assert again["timings"]["cache_n"] >= 16


def test_logit_bias_forms(server, qwen_tok):
    prompt = "The capital of France is"
    first = _ok(server, "/completion", {"prompt": prompt, "n_predict": 1, "return_tokens": True, **GREEDY})["tokens"][0]
    text = qwen_tok.decode([first]).decode()
    for bias in ([[first, False]], {str(first): -100}, [[text, False]]):
        out = _ok(server, "/completion", {"prompt": prompt, "n_predict": 1, "return_tokens": True, "logit_bias": bias,
                                          **GREEDY})
        assert out["tokens"][0] != first, bias


def test_n_indent_ends_the_block(server):
    out = _ok(server, "/completion", {"prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
                                      "n_predict": 24, "n_indent": 4, **GREEDY})
    lines = out["content"].split("\n")
    assert out["stop_type"] == "limit" and out["tokens_predicted"] < 24
    assert all(line.startswith("    ") for line in lines[:-1]) and not lines[-1].strip()


# ---- timings on OpenAI's routes ------------------------------------------------------------------

def test_openai_routes_carry_timings(server):
    out = _ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, **GREEDY})
    u = out["usage"]
    _check_timings(out["timings"], u["completion_tokens"], u["prompt_tokens"])
    out = _ok(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5,
                                               **GREEDY})
    u = out["usage"]
    _check_timings(out["timings"], u["completion_tokens"], u["prompt_tokens"])
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}],
                                                 "stream_options": {"include_usage": True}})):
        status, _, raw = server.request("POST", path, {**body, "max_tokens": 5, "stream": True, **GREEDY})
        chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
        done = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(done) == 1 and done[0]["timings"]["predicted_n"] >= 1
        assert "timings" in chunks[-1] and all("timings" not in c for c in chunks[:-1] if c not in done)


# ---- /props, /slots, /apply-template, /tokenize ---------------------------------------------------

def test_props(server):
    status, out = server.get("/props")
    assert status == 200
    assert out["total_slots"] == 2 and out["model_path"].endswith("qwen2.5-coder-0.5b-instruct.gguf")
    assert out["default_generation_settings"]["n_ctx"] == N_CTX and out["model_alias"] == "qwen2.5-coder-0.5b-instruct"
    params = out["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    assert "<|im_start|>" in out["chat_template"] and out["eos_token"] == "<|im_end|>"
    assert out["modalities"] == {"vision": False, "video": False, "audio": False}
    assert out["build_info"].startswith("edge ") and out["is_sleeping"] is False
    _llama_error(*server.post("/props", {}), 501)


def test_slots_save_erase_restore(server):
    out = _ok(server, "/completion", {"prompt": PROMPT, "n_predict": 12, **GREEDY})
    slot, text = out["id_slot"], out["content"]
    deadline = time.monotonic() + 10
    while True:        # the answer can arrive a moment before the scheduler retires its sequence
        status, slots = server.get("/slots")
        if slots[slot]["is_processing"] is False or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200 and [s["id"] for s in slots] == [0, 1]
    s = slots[slot]
    assert s["is_processing"] is False and s["n_ctx"] == N_CTX and s["prompt"] == PROMPT
    assert s["n_prompt_tokens"] == out["tokens_evaluated"] and s["next_token"][0]["n_decoded"] == 12
    assert s["params"]["n_predict"] == 12 and s["generated"] == text
    saved = _ok(server, f"/slots/{slot}?action=save", {"filename": "fib.bin"})
    n = out["tokens_evaluated"] + 11              # the last token has no K/V yet
    assert saved["n_saved"] == n and saved["n_written"] == (server.slot_dir / "fib.bin").stat().st_size
    assert saved["filename"] == "fib.bin" and saved["timings"]["save_ms"] > 0
    assert _ok(server, f"/slots/{slot}?action=erase", {})["n_erased"] == out["tokens_evaluated"] + 12
    cold = _ok(server, "/completion", {"prompt": PROMPT, "n_predict": 12, **GREEDY})
    assert cold["timings"]["cache_n"] == 0 and cold["content"] == text
    _ok(server, f"/slots/{cold['id_slot']}?action=erase", {})
    restored = _ok(server, f"/slots/{slot}?action=restore", {"filename": "fib.bin"})
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    warm = _ok(server, "/completion", {"prompt": PROMPT, "n_predict": 12, **GREEDY})
    assert warm["timings"]["cache_n"] >= 16 and warm["content"] == text
    # errors
    assert "Invalid filename" in _llama_error(*server.post(f"/slots/{slot}?action=save", {"filename": "../x.bin"}), 400)
    assert "Invalid filename" in _llama_error(*server.post("/slots/0?action=save", {"filename": ".hidden"}), 400)
    _llama_error(*server.post("/slots/0?action=restore", {"filename": "never-saved.bin"}), 400)
    _llama_error(*server.post("/slots/0?action=explode", {}), 400)
    _llama_error(*server.post("/slots/9?action=erase", {}), 400)
    _llama_error(*server.post("/slots/x?action=erase", {}), 400)


def test_apply_template_gives_the_chat_prompt(server):
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}]
    prompt = _ok(server, "/apply-template", {"messages": messages})["prompt"]
    assert prompt == ("<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\nCapital of Italy?"
                      "<|im_end|>\n<|im_start|>assistant\n")
    chat = _ok(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, **GREEDY})
    out = _ok(server, "/completion", {"prompt": prompt, "n_predict": 4, **GREEDY})
    assert out["content"] == chat["choices"][0]["message"]["content"]


def test_tokenize_with_pieces(server):
    text = "héllo 𝄞 world<|im_end|>"
    status, out = server.post("/tokenize", {"content": text, "with_pieces": True})
    assert status == 200
    pieces = out["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw == text.encode() and any(isinstance(p["piece"], list) for p in pieces)
    assert pieces[-1]["piece"] == "<|im_end|>"
    status, plain = server.post("/tokenize", {"content": text})
    assert plain["tokens"] == [p["id"] for p in pieces]


# ---- errors ---------------------------------------------------------------------------------------

def test_errors_in_llama_servers_shape(server):
    status, _, raw = server.request("POST", "/completion", b"{not json")
    _llama_error(status, json.loads(raw), 400)
    assert "input_prefix" in _llama_error(*server.post("/infill", {"input_suffix": ""}), 400)
    _llama_error(*server.post("/completion", {}), 400)
    _llama_error(*server.post("/completion", {"prompt": "x", "samplers": ["temperature", "top_k"]}), 400)
    _llama_error(*server.post("/completion", {"prompt": "x", "post_sampling_probs": True}), 400)
    _llama_error(*server.post("/completion", {"prompt": "x", "mirostat": 2}), 400)
    _llama_error(*server.post("/completion", {"prompt": [1, 10 ** 9]}), 400)
    status, body = server.post("/completion", {"prompt": "x " * (N_CTX + 8), "n_predict": 1})
    assert body["error"].pop("n_ctx") == N_CTX and body["error"].pop("n_prompt_tokens") > N_CTX  # llama-server's fields
    _llama_error(status, body, 400, "exceed_context_size_error")
