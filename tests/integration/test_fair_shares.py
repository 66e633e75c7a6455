"""Fair shares with real processes: one API key's requests with n = 8 cannot take every batch slot."""

from __future__ import annotations

import asyncio
import time

import httpx
import stack as st


async def run(url: str) -> tuple[list[httpx.Response], float]:
    hog = {"Authorization": "Bearer key-one"}
    other = {"Authorization": "Bearer key-two"}
    many = {"model": st.MODEL, "prompt": "Hello", "max_tokens": 48, "n": 8, "temperature": 0, "ignore_eos": True}
    one = {"model": st.MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        hogs = [asyncio.create_task(client.post("/v1/completions", json=many, headers=hog)) for _ in range(4)]
        await asyncio.sleep(0.3)  # the hog's requests are in
        start = time.monotonic()
        r = await client.post("/v1/completions", json=one, headers=other)
        took = time.monotonic() - start
        assert r.status_code == 200, r.text
        return await asyncio.gather(*hogs), took


def test_four_requests_with_n_8_from_one_key_leave_room_for_another_key(gateway_for):
    gateway = gateway_for(0, "--api-key", "key-one,key-two", "--max-sequences-per-key", "8", "--max-batch", "8")
    replies, took = asyncio.run(run(st.base_url(gateway)))
    print(f"the other key's request took {took:.2f} s; the hog's: {[r.status_code for r in replies]}")
    assert sorted(r.status_code for r in replies) == [200, 429, 429, 429]
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert "holds 8 of its 8 sequences" in refused.json()["error"]["message"]
    assert took < 1.0
