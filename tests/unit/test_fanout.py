"""Fan-out draft-ahead (DraftTask.num_branches): blocks drafted after other likely verdicts."""

from __future__ import annotations

import torch

from specd.engine.errors import ErrorKind
from specd.engine.params import SamplingParams
from specd.engine.sequences import BranchCache, SequenceTable
from specd.engine.tasks import SequenceSpec

GREEDY = SamplingParams(temperature=0.0)


def test_branch_slots_are_lent_beside_the_sequences_and_never_starve_an_open():
    table = SequenceTable(None, 100, 2, 64, torch.device("cpu"), branch_slots=2)
    assert table.open([SequenceSpec("a", [1, 2, 3], GREEDY)])[0] == [None]
    state = table.get("a")
    lent = [table.take_branch_slot() for _ in range(3)]
    assert lent[2] is None and len({state.slot, *lent[:2]}) == 3  # two lent, each its own slot
    state.branches = [BranchCache(slot, []) for slot in lent[:2] if slot is not None]
    assert table.free_slots == 1 and table.branches_held == 2
    errors, _ = table.open([SequenceSpec("b", [1], GREEDY), SequenceSpec("c", [1], GREEDY)])
    assert errors[0] is None and errors[1] is not None and errors[1].kind == ErrorKind.RESOURCE_EXHAUSTED
    table.close(["a"])  # its branches with it
    assert table.free_slots == 3 and table.branches_held == 0
