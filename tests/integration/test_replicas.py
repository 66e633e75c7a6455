"""Two drafters and two verifiers behind one gateway: sequences spread over all four, greedy
output stays the target's own, and a verifier that stops only moves new requests to the other."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import stack as st
from prometheus_client.parser import text_string_to_metric_families
from references import PROMPTS as ALL_PROMPTS
from references import api_text, greedy_references

PROMPTS = list(ALL_PROMPTS)
MAX_TOKENS = 16


@dataclass
class Replicas:
    verifiers: list[st.Service]
    drafters: list[st.Service]
    metrics_ports: dict[str, int]  # service address -> its --metrics-port
    gateway: st.Service


@pytest.fixture(scope="module")
def replicas(model_dirs, log_dir) -> Iterator[Replicas]:
    started: list[st.Service] = []
    metrics_ports: dict[str, int] = {}
    try:
        # Spawn all five before waiting for any: model loading overlaps. The tiny draft model
        # almost never agrees with the target, so the second drafter serves the target itself:
        # sequences placed there have every draft accepted, and both paths cross the pools.
        for kind, model, extra in [
            ("verifier", model_dirs["target"], []),
            ("verifier", model_dirs["target"], []),
            ("drafter", model_dirs["draft"], ["--quantize", "none"]),
            ("drafter", model_dirs["target"], ["--quantize", "none"]),
        ]:
            port, metrics_port = st.free_port(), st.free_port()
            args = ["--host", st.HOST, "--port", str(port), "--model", str(model), "--dtype", "float32"]
            args += ["--metrics-port", str(metrics_port), *extra]
            started.append(st.spawn(kind, args, log_dir, port))
            metrics_ports[started[-1].address] = metrics_port
        verifiers = [s for s in started if s.name == "verifier"]
        drafters = [s for s in started if s.name == "drafter"]
        gateway = st.spawn_gateway(
            ",".join(v.address for v in verifiers),
            ",".join(d.address for d in drafters),
            [
                "--tokenizer", str(model_dirs["target"]),
                "--num-speculative-tokens", "4",
                "--speculative-mode", "fixed",
                "--backend-health-interval-s", "0.5",
            ],
            log_dir,
        )  # fmt: skip
        started.append(gateway)
        for service in started[:-1]:
            st.ready_backend(service)
        st.ready_gateway(gateway)
        yield Replicas(verifiers, drafters, metrics_ports, gateway)
    finally:
        st.stop_all(list(reversed(started)))


@pytest.fixture(scope="module")
def references(tok, tiny_target) -> dict[str, list[int]]:
    return greedy_references(tok, tiny_target, PROMPTS, MAX_TOKENS)


def scrape(url: str) -> dict[str, float]:
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text)
        for s in family.samples
    }


def test_sequences_spread_over_every_replica_and_stay_exact(replicas, references, tok):
    texts = st.complete_texts(st.base_url(replicas.gateway), PROMPTS, MAX_TOKENS)
    for prompt, text in zip(PROMPTS, texts, strict=True):
        assert text == api_text(tok, references[prompt]), prompt
    gateway = scrape(st.base_url(replicas.gateway) + "/metrics")
    for service in [*replicas.verifiers, *replicas.drafters]:
        key = f"specd_backend_sequences_placed_total{{address={service.address}}}{{service={service.name}}}"
        assert gateway[key] >= 1, (service.name, service.address, gateway)
        assert gateway[f"specd_backend_up{{address={service.address}}}{{service={service.name}}}"] == 1
        # The service itself ran rounds for them, not just opened them.
        own = scrape(f"http://{st.HOST}:{replicas.metrics_ports[service.address]}/metrics")
        assert own[f"specd_{service.name}_rounds_total"] >= 1, (service.name, service.address)
    assert gateway["specd_spec_decode_num_accepted_tokens_total"] > 0
    health = httpx.get(st.base_url(replicas.gateway) + "/health").json()
    assert [r["healthy"] for r in health["verifier_replicas"]] == [True, True]
    assert [r["open_sequences"] for r in health["drafter_replicas"]] == [0, 0]


def test_a_stopped_verifier_replica_takes_no_new_requests(replicas, references, tok):
    stopped, other = replicas.verifiers
    stopped.stop()
    # Requests right after the failure: an open on the dead replica moves to the other one.
    prompts = PROMPTS[:4]
    texts = st.complete_texts(st.base_url(replicas.gateway), prompts, MAX_TOKENS)
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == api_text(tok, references[prompt]), prompt
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(st.base_url(replicas.gateway) + "/health")
        states = {r["address"]: r["healthy"] for r in health.json()["verifier_replicas"]}
        if not states[stopped.address] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert health.status_code == 200 and states == {stopped.address: False, other.address: True}
    before = scrape(st.base_url(replicas.gateway) + "/metrics")
    texts = st.complete_texts(st.base_url(replicas.gateway), PROMPTS[4:8], MAX_TOKENS)
    for prompt, text in zip(PROMPTS[4:8], texts, strict=True):
        assert text == api_text(tok, references[prompt]), prompt
    after = scrape(st.base_url(replicas.gateway) + "/metrics")
    placed = "specd_backend_sequences_placed_total{{address={}}}{{service=verifier}}"
    assert after[placed.format(other.address)] - before[placed.format(other.address)] == 4
    assert after[placed.format(stopped.address)] == before[placed.format(stopped.address)]
    assert after[f"specd_backend_up{{address={stopped.address}}}{{service=verifier}}"] == 0
