"""A user's own pair of each common architecture, served by `specd up` as a user runs it.

For Llama, Qwen2, Qwen3, Mistral, Phi-3 and Gemma-2 (tiny, random weights, the SmolLM2
tokenizer; sliding windows narrower than the sequences), a target and a perturbed copy as
its drafter: greedy output is `generate`'s token for token in float32, and generation stops
at every end id the target's generation_config.json lists, with OpenAI's finish_reason. The
second end id is crafted to be the greedy continuation of one prompt, so a server that
stopped only at the tokenizer's eos would run past it. The pair is an instruct target over a
base drafter: the drafter's generation_config.json lists the tokenizer's eos alone, so the
pair starts only because the target's end ids count, and the drafter learns them from the
gateway (tests/unit/test_own_pairs.py has each architecture's pair in process).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import stack as st
import tinymodels
import torch

from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc

# Through `specd up`: Llama (the fused forward) and Gemma-2 (transformers' forward, sliding windows,
# soft-capping). Every architecture of tinymodels.ARCHITECTURES is also served in process, where a
# service start costs nothing: its greedy tokens are generate's (tests/unit/test_architectures.py),
# and an instruct target with a base drafter starts, matches target-only output and stops at every
# end id (tests/unit/test_own_pairs.py).
ARCHITECTURES = ["gemma2", "llama"]
# The target's weights; another value (with other prompts) is an independent check of the same
# claims, the crafted end id included: SPECD_MATRIX_SEED=23 pytest tests/integration/test_model_matrix.py
SEED = int(os.environ.get("SPECD_MATRIX_SEED", "11"))
PROMPTS = (
    ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3,")
    if "SPECD_MATRIX_SEED" not in os.environ
    else ("Speculative decoding makes large models", '{"name": "specd", "version":', "Q: What is 2 + 2?\nA:", "a")
)
STOP_PROMPT = PROMPTS[0]
STOP_AT = 6  # the crafted end id is the STOP_PROMPT's 7th greedy token (or a later one new there)
MAX_TOKENS = 24


def _greedy(model, tok, prompt: str, ends: list[int] | None) -> list[int]:
    ids = tok.encode(prompt)
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=ends, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def _second_end(tokens: list[int], eos: int) -> int:
    """A token of `tokens` from STOP_AT on that appears there first and is not eos."""
    for i in range(STOP_AT, len(tokens)):
        if tokens[i] != eos and tokens[i] not in tokens[:i]:
            return tokens[i]
    raise AssertionError(f"no fresh token to end at in {tokens}")


class Pair:
    def __init__(self, arch: str, tok, root: Path) -> None:
        self.arch = arch
        self.target = tinymodels.build_architecture(arch, SEED, len(tok), tok.bos_token_id, tok.eos_token_id)
        draft = tinymodels.perturbed(self.target, 0.3, seed=SEED + 1)
        self.ends = [tok.eos_token_id, _second_end(_greedy(self.target, tok, STOP_PROMPT, None), tok.eos_token_id)]
        self.target.generation_config.eos_token_id = self.ends
        draft.generation_config.eos_token_id = tok.eos_token_id  # a base model's: one end id
        self.target_dir = tinymodels.save(self.target, tok, root / "target")
        self.draft_dir = tinymodels.save(draft, tok, root / "draft")
        self.references = {p: _greedy(self.target, tok, p, self.ends) for p in PROMPTS}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def served(request, tok, tmp_path_factory, log_dir) -> Iterator[tuple[Pair, str, dict[str, int], Path]]:
    arch = request.param
    pair = Pair(arch, tok, tmp_path_factory.mktemp(arch))
    log = log_dir / f"specd-up-{arch}.log"
    # Gemma-2 died here once, timing the target's step: it keeps the measured placement.
    placement = ("--placement", "auto" if arch == "gemma2" else "shared")
    args = (
        "--target-model", str(pair.target_dir),
        "--draft-model", str(pair.draft_dir),
        "--drafter", "model",
        "--drafter-dtype", "float32",
        "--quantize", "none",
        "-k", "4",
        "--speculative-mode", "fixed",
        "--max-context", "256",
        "--startup-timeout", "150",
        "--per-request-spec-decode-metrics", "summary",
        *placement,
    )  # fmt: skip
    start = time.monotonic()
    with st.specd_up(log, *args, timeout_s=180) as (base, ports):
        print(f"\n{arch}: specd up took {time.monotonic() - start:.1f} s to come up")
        yield pair, base, ports, log
    print(f"{arch}: {time.monotonic() - start:.1f} s in all")


def _grpc_generate(port: int, prompt: str) -> gateway_pb2.GenerateResponse:
    with grpc.insecure_channel(f"{st.HOST}:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        params = gateway_pb2.GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0)
        return stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=params), timeout=120)


def test_greedy_tokens_are_generates_and_every_end_id_stops(served):
    pair, _, ports, _ = served
    for prompt in PROMPTS:
        reply = _grpc_generate(ports["grpc"], prompt)
        expected = pair.references[prompt]
        assert list(reply.token_ids) == expected, (pair.arch, prompt)
        stopped = expected[-1] in pair.ends
        want = gateway_pb2.FINISH_REASON_STOP if stopped else gateway_pb2.FINISH_REASON_LENGTH
        assert reply.finish_reason == want, (pair.arch, prompt)
    # The crafted case: the second end id, not the tokenizer's eos, ends it, before max_tokens.
    stop = pair.references[STOP_PROMPT]
    assert stop[-1] == pair.ends[1] and len(stop) < MAX_TOKENS


def test_the_openai_api_stops_at_the_second_end_id_with_finish_reason_stop(served, tok):
    pair, base, _, _ = served
    body = {"model": "target", "prompt": STOP_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    stop = pair.references[STOP_PROMPT]
    assert choice["finish_reason"] == "stop", (pair.arch, reply)
    assert choice["text"] == tok.decode(stop[:-1], skip_special_tokens=True)
    assert reply["usage"]["completion_tokens"] == len(stop)
    # specd up passes the flag on: the request's own speculation statistics come with it.
    spec = reply["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 4 and spec["num_draft_tokens"] >= spec["num_spec_steps"] > 0


def test_the_fused_forward_serves_where_it_applies_and_transformers_elsewhere(served):
    pair, _, _, log = served
    text = log.read_text(errors="replace")
    name = type(pair.target).__name__
    if pair.arch == "llama":
        assert "the verifier runs the fused forward" in text
        assert "the drafter runs the fused forward" in text
    else:
        assert f"the verifier runs transformers' forward ({name} has no fused one)" in text
        assert "runs the fused forward" not in text
    assert f"sequences end at token ids {sorted(pair.ends)}" in text
    assert f"(end token ids [{pair.ends[0]}] != {sorted(pair.ends)}); the target's end ids count" in text
