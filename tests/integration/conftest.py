from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import stack as st

# Every test here runs three or more service processes of tiny models beside pytest on a machine
# with a few cores; with torch's default of one intra-op thread per core they oversubscribe the
# cores, and tiny models gain nothing from a second thread. The services inherit this; a setting
# already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def backends(model_dirs, log_dir) -> Iterator[tuple[st.Service, st.Service]]:
    """One verifier (tiny target) and one drafter (perturbed copy), shared by the session."""
    # Spawned together, then waited for: their start-ups overlap.
    verifier = st.spawn_backend("verifier", ["--model", str(model_dirs["target"]), "--dtype", "float32"], log_dir)
    drafter = st.spawn_backend(
        "drafter", ["--model", str(model_dirs["draft"]), "--dtype", "float32", "--quantize", "none"], log_dir
    )
    try:
        st.ready_backend(verifier)
        st.ready_backend(drafter)
    except BaseException:
        st.stop_all([verifier, drafter])
        raise
    yield verifier, drafter
    drafter.stop()
    verifier.stop()


@pytest.fixture(scope="session")
def gateway_for(backends, model_dirs, log_dir) -> Iterator[Callable[..., st.Service]]:
    """Gateways over the shared backends, one per k, started on first use."""
    verifier, drafter = backends
    started: dict[tuple, st.Service] = {}

    def get(k: int, *extra: str) -> st.Service:
        key = (k, *extra)
        if key not in started:
            started[key] = st.start_gateway(
                verifier,
                drafter if k > 0 else None,
                [
                    "--tokenizer",
                    str(model_dirs["target"]),
                    "--num-speculative-tokens",
                    str(k),
                    # Tests of the round mechanics want k drafts every round unless they ask otherwise.
                    *(() if "--speculative-mode" in extra else ("--speculative-mode", "fixed")),
                    *extra,
                ],
                log_dir,
            )
        return started[key]

    yield get
    st.stop_all(list(started.values()))
