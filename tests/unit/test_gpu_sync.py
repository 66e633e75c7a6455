"""On a GPU a round waits for the device only where it reads back its verdicts or its draft
blocks (specd.engine.cuda_graphs.read_back): no other host synchronisation, eager or graphed. Needs CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from tinymodels import build_model

from drafter_service.engine import ModelDrafter
from specd.engine import cuda_graphs, fused_llama
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import SamplingParams
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask
from verifier_service.engine import VerifierEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [11, 22, 33, 44, 55, 11, 22]
CUDA = torch.device("cuda")


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Any synchronising CUDA call in the block raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def lm(vocab: int) -> BatchedCausalLM:
    return BatchedCausalLM(fused_llama.fuse(build_model(0, vocab, 1, 2)).to(CUDA), CUDA, torch.float32)


def graph(engine_lm: BatchedCausalLM, length: int) -> None:
    engine_lm.static = cuda_graphs.StaticForward(engine_lm, 8, length, capture=CUDA.type == "cuda")
    engine_lm.static.capture_all([cuda_graphs.Bucket(b, n, 512) for b in (1, 2) for n in range(1, length + 1)])


@pytest.mark.parametrize("graphed", [False, True])
def test_a_greedy_verify_waits_only_for_its_verdicts(graphed: bool, fingerprint: TokenizerFingerprint, tok) -> None:
    target = lm(len(tok))
    engine = VerifierEngine(target, fingerprint, 8, 512, 8)
    if graphed:
        graph(target, 5)
    errors, _ = engine.open([SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT[:4], GREEDY)])
    assert errors == [None, None]
    committed = {"a": len(PROMPT), "b": 4}
    for _ in range(3):
        with no_sync():
            results, _ = engine.verify([VerifyTask(s, n, [5, 6, 7, 8]) for s, n in committed.items()])
        for r in results:
            assert r.error is None
            committed[r.sequence_id] += r.num_accepted + 1


@pytest.mark.parametrize("graphed", [False, True])
def test_greedy_draft_steps_wait_only_for_the_block(graphed: bool, fingerprint: TokenizerFingerprint, tok) -> None:
    draft = lm(len(tok))
    engine = ModelDrafter(draft, fingerprint, 8, 512, 8, 16)
    if graphed:
        graph(draft, 2)
    errors, _ = engine.open([SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT[:4], GREEDY)])
    assert errors == [None, None]
    committed = {"a": PROMPT[:], "b": PROMPT[:4]}
    for step in range(3):
        tasks = [DraftTask(s, [9] if step else [], len(c) + (1 if step else 0), 4) for s, c in committed.items()]
        with no_sync():
            proposals, _ = engine.draft(tasks)
        for p in proposals:
            assert p.error is None and len(p.tokens) == 4
        for s in committed:
            committed[s] = committed[s] + ([9] if step else [])
