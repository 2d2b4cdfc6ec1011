"""Speculative decoding against plain decoding, greedy, on two workloads (issue 19):

    python tools/bench_spec.py [-m MODEL] [-md DRAFT] [-n 400] [-t 2] [-r 3] [--llama-python PY]

- edit: a 351-line Python file (tools/data/edit_this_file.txt) in the prompt, asked back whole
  with a function renamed: the answer repeats the prompt, prompt lookup should shine;
- prose: a story, where drafts are mostly wrong: the adaptive policy must cost almost nothing.

For each workload: decode tokens/s (generated tokens after the first / time from the first to
the last; the prompt is computed before) without speculation, with prompt lookup (--spec-type
ngram) and, with -md, with the draft model; the tokens of every mode are checked equal. All
modes run batch-invariant (speculation needs it; one-row decode costs the same either way).
With --llama-python (llama-cpp-python's interpreter, tools/build_oracle.sh), the same prompts
through llama.cpp, plain and with llama-cpp-python's prompt-lookup drafter
(LlamaPromptLookupDecoding, num_pred_tokens 10), as anchors. Medians of -r runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EDIT = ("Here is a Python file:\n```python\n{code}```\nRename the function `chats_dir` to "
        "`conversations_dir` (its definition and every call) and return the whole file, nothing else.")
PROSE = "Write a long, original story about a lighthouse keeper who finds a message in a bottle."

LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
a = json.loads(sys.argv[1])
out = {}
for mode in ("none", "lookup"):
    n_ctx = max(len(ids) for ids in a["prompts"].values()) + a["n"] + 64
    llm = Llama(a["model"], n_ctx=n_ctx, n_batch=512, n_threads=a["threads"], n_threads_batch=a["threads"],
                verbose=False, logits_all=mode == "lookup",     # its drafter verifies from every row's logits
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if mode == "lookup" else None)
    for name, ids in a["prompts"].items():
        runs = []
        for _ in range(a["reps"]):
            llm.reset()
            t_first, n = None, 0
            for chunk in llm.create_completion(ids, max_tokens=a["n"], temperature=0.0, top_k=1, stream=True):
                n += 1
                if t_first is None:
                    t_first = time.perf_counter()
            runs.append((n - 1) / (time.perf_counter() - t_first))
        out[f"{name}/{mode}"] = sorted(runs)[len(runs) // 2]
    del llm
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="target model (default: the default model)")
    ap.add_argument("-md", "--model-draft", default=None, help="draft model (adds the draft mode)")
    ap.add_argument("-n", "--n-predict", type=int, default=400, help="tokens generated per run (default 400)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="runs per mode, median reported (default 3)")
    ap.add_argument("--draft-max", type=int, default=16, help="--draft-max (default 16)")
    ap.add_argument("--llama-python", default=None, help="llama-cpp-python's interpreter: llama.cpp anchors")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--llama-only", action="store_true", help="only the llama.cpp anchors (with --llama-python)")
    args = ap.parse_args()

    from edge.engine import Engine, GenerationStats
    from edge.sampling import SamplingParams
    from edge.speculative import SpecParams
    from edge.store import resolve_model
    from edge.threads import use_threads

    use_threads(args.threads)
    path = resolve_model(args.model)
    code = (ROOT / "tools" / "data" / "edit_this_file.txt").read_text()
    n_ctx = 8192
    engine = Engine(path, n_ctx=n_ctx, batch_invariant=True)
    draft = (Engine(resolve_model(args.model_draft), n_ctx=n_ctx, batch_invariant=True)
             if args.model_draft else None)
    prompts = {"edit": engine.chat_prompt([{"role": "user", "content": EDIT.format(code=code)}]),
               "prose": engine.chat_prompt([{"role": "user", "content": PROSE}])}
    modes = ["none", "ngram"] + (["draft"] if draft else [])
    greedy = SamplingParams(temperature=0.0)
    results: dict = {"model": path.name, "draft": Path(draft.path).name if draft else None,
                     "threads": args.threads, "n_predict": args.n_predict}
    for name, ids in prompts.items() if not args.llama_only else ():
        ref = None
        for mode in modes:
            speeds, stats = [], None
            for _ in range(args.reps):
                engine.clear_kv_cache()
                if draft:
                    draft.clear_kv_cache()
                engine.set_speculative(SpecParams(mode, draft_max=args.draft_max), draft if mode == "draft" else None)
                stats = GenerationStats()
                toks = list(engine.generate(ids, greedy, args.n_predict, stats))
                speeds.append(stats.gen_tps)
                if ref is None:
                    ref = toks
                elif toks != ref:
                    print(f"error: {name}/{mode}: tokens differ from plain decoding", file=sys.stderr)
                    return 1
            tps = statistics.median(speeds)
            results[f"{name}/{mode}"] = {"tokens_per_s": tps, "prompt_tokens": len(ids), "generated": len(ref),
                                         "drafted": stats.n_drafted, "accepted": stats.n_accepted}
            base = results[f"{name}/none"]["tokens_per_s"]
            acc = f", accepted {stats.n_accepted}/{stats.n_drafted}" if stats.n_drafted else ""
            print(f"{name:6s} {mode:6s} {tps:7.1f} tokens/s  {tps / base:5.2f}x{acc}  "
                  f"(prompt {len(ids)}, generated {len(ref)})", flush=True)
    if args.llama_python:
        payload = json.dumps({"model": str(path), "threads": args.threads, "reps": args.reps,
                              "n": args.n_predict, "prompts": prompts})
        proc = subprocess.run([args.llama_python, "-c", LLAMA_SCRIPT, payload], capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        anchors = json.loads(proc.stdout.strip().splitlines()[-1])
        for key, tps in anchors.items():
            results[f"llama.cpp {key}"] = {"tokens_per_s": tps}
            name = key.split("/")[0]
            print(f"llama.cpp {key:14s} {tps:7.1f} tokens/s  {tps / anchors[f'{name}/none']:5.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
