"""Per-API-key rate limits (no network)."""

from __future__ import annotations

import asyncio

from gateway.api.limits import RateLimiter, api_key


def test_api_key_is_the_bearer_token():
    assert api_key("Bearer sk-abc") == "sk-abc"
    assert api_key("bearer  sk-abc ") == "sk-abc"
    assert api_key("Basic dXNlcg==") == ""
    assert api_key(None) == ""


def test_each_key_has_its_own_budget():
    async def run() -> tuple[list[bool], list[bool], bool]:
        limiter = RateLimiter(3, max_wait_s=0.05)
        alice = [await limiter.allow("alice") for _ in range(5)]
        bob = [await limiter.allow("bob") for _ in range(3)]
        await asyncio.sleep(1.05)  # a period later alice may send again
        return alice, bob, await limiter.allow("alice")

    alice, bob, later = asyncio.run(run())
    assert alice == [True, True, True, False, False]
    assert bob == [True, True, True]
    assert later


def test_disabled_limiter_allows_everything():
    limiter = RateLimiter(0)
    assert not limiter.enabled
    assert all(asyncio.run(limiter.allow("k")) for _ in range(100))


def test_below_one_request_per_second():
    async def run() -> list[bool]:
        limiter = RateLimiter(0.5, max_wait_s=0.05)  # one request per 2 s
        return [await limiter.allow("k") for _ in range(2)]

    assert asyncio.run(run()) == [True, False]
