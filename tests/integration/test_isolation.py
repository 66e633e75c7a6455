"""Failure isolation in a real gateway: an exception while handling one sequence fails that one
alone (a 500 naming an error id the gateway's log can find), and the others finish unharmed."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import httpx
import stack as st
from faulty_gateway import VICTIM_MAX_TOKENS

FAULTY = Path(__file__).with_name("faulty_gateway.py")
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is"]
MAX_TOKENS = 20
MODEL = "target"


async def complete_all(base: str, max_tokens: list[int]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        return await asyncio.gather(
            *(
                client.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0})
                for p, n in zip(PROMPTS, max_tokens, strict=True)
            )
        )


def test_an_exception_for_one_sequence_in_a_real_gateway_fails_that_one_alone(
    backends, gateway_for, model_dirs, log_dir
):
    verifier, drafter = backends
    args = ["--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "4"]
    faulty = st.start_gateway(verifier, drafter, args, log_dir, command=[sys.executable, str(FAULTY)])
    try:
        limits = [MAX_TOKENS, VICTIM_MAX_TOKENS, MAX_TOKENS, MAX_TOKENS]
        got = asyncio.run(complete_all(st.base_url(faulty), limits))
        want = asyncio.run(complete_all(st.base_url(gateway_for(4)), limits))
        victim = got[1]
        assert victim.status_code == 500, victim.text
        error = victim.json()["error"]
        error_id = re.search(r"error id ([0-9a-f]{12})", error["message"])
        assert error_id, error
        assert f"internal error {error_id.group(1)}" in faulty.output()
        for i in (0, 2, 3):
            assert got[i].status_code == 200, got[i].text
            assert got[i].json()["choices"][0]["text"] == want[i].json()["choices"][0]["text"]
        # The gateway goes on serving, and the victim's kind of failure stays its own.
        again = asyncio.run(complete_all(st.base_url(faulty), [MAX_TOKENS] * len(PROMPTS)))
        assert [r.status_code for r in again] == [200] * len(PROMPTS)
    finally:
        faulty.stop()
