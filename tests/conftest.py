from __future__ import annotations

import os
from pathlib import Path

import httpx._transports.default
import pytest
import tinymodels
import torch

# The tests start their own services, each with the backend token it needs or none: a token an
# operator exported for `specd up` in this shell would make every test's own call to a service
# UNAUTHENTICATED.
for name in ("SPECD_BACKEND_TOKEN", *(f"SPECD_{s}_BACKEND_TOKEN_FILE" for s in ("DRAFTER", "VERIFIER", "GATEWAY"))):
    os.environ.pop(name, None)


def _shared_default_ssl_context(make):
    """httpx makes a new default SSL context, reading the CA bundle, for every client, and so for
    each `httpx.post`: about 20 ms of CPU, thousands of times a run, for calls to plain-HTTP
    loopback services. The default one is made once here; a test that passes its own (TLS) is
    given its own."""
    made: dict[bool, object] = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None or not trust_env:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if True not in made:
            made[True] = make()
        return made[True]

    return create_ssl_context


httpx._transports.default.create_ssl_context = _shared_default_ssl_context(httpx._transports.default.create_ssl_context)


# Tests that compare latencies measured a moment apart, or bound a stall of the round loop in
# milliseconds: another worker's load beside them would decide them. `make test` runs them after the
# others, with no other test beside them.
SERIAL = frozenset(
    {
        "test_real_model.py",
        "test_fair_shares.py",
        "test_hostile_load.py",
        "test_prefill_beside_rounds.py",
        # auto's choice of pipeline learns from the fakes' timed exchanges (sleeps of 20 ms)
        "test_auto_pipeline.py",
    }
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m serial` (make test's second run) need not import the other test files: collecting all of
    them costs each run seconds of CPU (torch, transformers, the clients' SDKs)."""
    serial_run = config.getoption("markexpr") == "serial"
    if serial_run and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return collection_path.name not in SERIAL or None
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """The tests' own forwards (tiny models, and the references integration tests compute with
    transformers) gain little from intra-op threads, and beside the other worker and the services
    the tests start, OpenMP spin-waiting makes them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tok():
    return tinymodels.tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tok):
    return tinymodels.build_model(0, len(tok), tok.bos_token_id, tok.eos_token_id)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    return tinymodels.perturbed(tiny_target, 0.35, seed=1)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tok, tiny_target, tiny_draft) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "target": tinymodels.save(tiny_target, tok, root / "target"),
        "draft": tinymodels.save(tiny_draft, tok, root / "draft"),
    }
