"""A model-free drafter (the suffix drafter `specd up` runs on the CPU, or the n-gram one) never
imports torch: not with the drafter service's modules, and not while it builds its engine, opens
greedy, sampled and seeded sequences, drafts for them and closes them. Its start, and every
restart by `specd up`'s supervisor, then waits on no tensor library. Run in a fresh interpreter,
since this test process has torch loaded already."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys
import drafter_service.server as server
from drafter_service.config import DrafterConfig
from specd.engine.params import SamplingParams
from specd.engine.tasks import DraftTask, SequenceSpec
print('torch' in sys.modules)
engine, info = server.build_engine(DrafterConfig(drafter=sys.argv[1]))
prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
specs = [
    SequenceSpec("greedy", prompt, SamplingParams(temperature=0.0)),
    SequenceSpec("sampled", prompt, SamplingParams(temperature=0.8)),
    SequenceSpec("seeded", prompt, SamplingParams(temperature=0.8, seed=3), json_schema='{"type": "object"}'),
]
errors, _ = engine.open(specs)
assert errors == [None, None, None], errors
proposals, _ = engine.draft([DraftTask(s.sequence_id, [], len(prompt), 4) for s in specs])
assert all(p.error is None for p in proposals), [p.error for p in proposals]
assert proposals[0].tokens[:2] == [7, 8], proposals[0].tokens
assert engine.close([s.sequence_id for s in specs]) == 3
print('torch' in sys.modules)
"""


@pytest.mark.parametrize("drafter", ["suffix", "ngram"])
def test_a_model_free_drafter_runs_without_torch(drafter: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE, drafter], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    after_import, after_use = out.stdout.split()
    assert after_import == "False", "importing drafter_service.server imports torch"
    assert after_use == "False", f"building and using the {drafter} drafter imports torch"
