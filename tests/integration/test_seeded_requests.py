"""Seeded requests through real services: the same text whatever k, mode, concurrency or drafter."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import stack as st
from stack import base_url

MODEL = "target"
MAX_TOKENS = 12
REQUESTS: list[dict[str, Any]] = [
    {"prompt": "Once", "seed": 7, "temperature": 0.9, "top_p": 0.95},
    {"prompt": "The capital of France is", "seed": 8, "temperature": 1.0},
    {"prompt": "def add(a, b):", "seed": 9, "temperature": 0.7, "top_k": 40},
    {"prompt": "1, 2, 3,", "seed": 0, "temperature": 1.2, "top_p": 0.8},
    {"prompt": "Hello", "seed": 2**63, "temperature": 0.8},
    {"prompt": "Speculative decoding is", "seed": 12345, "temperature": 1.0, "top_k": 5},
    {"prompt": "a b c", "seed": 3, "temperature": 0.6, "top_p": 0.9},
    {"prompt": "Tell me a story about", "seed": 99, "temperature": 1.1},
    {"prompt": "Once upon a time", "seed": 5, "temperature": 1.4, "min_p": 0.05},
]


def complete(gateway: st.Service, request: dict[str, Any], **extra: Any) -> str:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, **request, **extra}
    r = httpx.post(base_url(gateway) + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def run_all(gateway: st.Service, clients: int, **extra: Any) -> list[str]:
    """Every request, from `clients` concurrent clients (1: one after another)."""
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda req: complete(gateway, req, **extra), REQUESTS))


@pytest.fixture(scope="module")
def target_only(gateway_for) -> list[str]:
    """A gateway with no drafter at all: what target-only sampling emits for each seed."""
    return run_all(gateway_for(0), 1)


GATEWAYS: dict[str, Callable[[Callable[..., st.Service]], st.Service]] = {
    "fixed-k4": lambda get: get(4),
    "auto-k4": lambda get: get(4, "--speculative-mode", "auto"),
}


@pytest.mark.parametrize("clients", [1, 8])
@pytest.mark.parametrize("name", list(GATEWAYS))
def test_seeded_text_is_the_target_only_text(gateway_for, target_only, name: str, clients: int):
    assert run_all(GATEWAYS[name](gateway_for), clients) == target_only


@pytest.mark.parametrize("k", [0, 3, "auto"])
def test_per_request_k_does_not_change_seeded_text(gateway_for, target_only, k):
    assert run_all(gateway_for(4, "--speculative-mode", "auto"), 8, num_speculative_tokens=k) == target_only


@pytest.mark.parametrize("pipeline", ["cohort", "ahead", "auto"])
def test_pipelines_do_not_change_seeded_text(gateway_for, target_only, pipeline):
    assert run_all(gateway_for(4), 8, pipeline=pipeline) == target_only


@pytest.mark.parametrize("clients", [1, 8])
def test_token_trees_do_not_change_seeded_text(gateway_for, target_only, clients):
    assert run_all(gateway_for(4), clients, speculative_siblings=2) == target_only


@pytest.mark.parametrize("clients", [1, 8])
def test_fan_out_draft_ahead_does_not_change_seeded_text(gateway_for, target_only, clients):
    """Branches guess the verifier's token with the request's own noise, as the main guess does."""
    assert run_all(gateway_for(4), clients, pipeline="ahead", speculative_branches=2) == target_only


def test_seeds_matter(gateway_for, target_only):
    other = [complete(gateway_for(0), {**req, "seed": req["seed"] + 1}) for req in REQUESTS]
    assert sum(a != b for a, b in zip(other, target_only, strict=True)) >= len(REQUESTS) - 1


def test_min_p_shapes_what_the_target_samples(gateway_for):
    """min_p = 1 keeps only the most likely token: sampled at any temperature, the greedy text."""
    gateway = gateway_for(4)
    for req in REQUESTS[:3]:
        greedy = complete(gateway, {"prompt": req["prompt"], "temperature": 0.0})
        assert complete(gateway, {**req, "temperature": 2.0, "min_p": 1.0}) == greedy
