"""A user's own pair starts and serves: an instruct target over a base drafter of one vocabulary.

Of each architecture of the model matrix (tinymodels.ARCHITECTURES), in process, shaped as
Llama-3.1-8B-Instruct over its base: the target's generation_config.json lists three end ids
(the base's eos, its own eos and one more) and its tokenizer names `<|im_end|>` eos; the
drafter's lists one and its tokenizer names `<|endoftext|>` eos. The gateway's check admits
the pair with one logged line; the drafter, told the target's end ids with each sequence,
drafts nothing past one; the output is the target's alone and ends at each of its end ids.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tinymodels
import torch
from engine_backends import EngineDrafter, EngineVerifier

from drafter_service.engine import ModelDrafter
from gateway.backends import check_compatible
from gateway.round.scheduler import Delta, Finished, GenerationParams, Scheduler
from specd.engine.checkpoints import load_tokenizer
from specd.engine.end_tokens import end_token_ids
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.models import LoadedModel, load_for_serving
from specd.engine.params import Penalties, SamplingParams
from verifier_service.engine import VerifierEngine

SEED = 11
K = 4
MAX_TOKENS = 16
PROMPT_TEXT = "The capital of France is"
STOP_AT = 5  # the crafted end id is the prompt's 6th greedy token (or a later one new there)
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


def _greedy(model: Any, prompt: list[int], ends: list[int] | None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=ends, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@dataclass
class Pair:
    arch: str
    prompt: list[int]
    ends: list[int]  # the target's, ascending
    target: LoadedModel
    draft: LoadedModel
    reference: list[int]  # `generate`'s greedy tokens of the target, ending at its end ids


def _build(arch: str, tok: Any, root: Path) -> Pair:
    base_eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert base_eos != tok.eos_token_id
    target = tinymodels.build_architecture(arch, SEED, len(tok), tok.bos_token_id, tok.eos_token_id)
    prompt = tok.encode(PROMPT_TEXT)
    free = _greedy(target, prompt, None)
    crafted = next(t for n, t in enumerate(free) if n >= STOP_AT and t not in (base_eos, tok.eos_token_id, *free[:n]))
    ends = sorted({base_eos, tok.eos_token_id, crafted})
    # Close to the target, so its greedy blocks reach the crafted end id, on the device path too.
    draft = tinymodels.perturbed(target, 0.05, seed=SEED + 1)
    target.generation_config.eos_token_id = ends
    draft.config.eos_token_id = draft.generation_config.eos_token_id = base_eos
    base_tok = copy.deepcopy(tok)
    base_tok.eos_token = "<|endoftext|>"
    target_dir = tinymodels.save(target, tok, root / "instruct")
    draft_dir = tinymodels.save(draft, base_tok, root / "base")
    loaded = [load_for_serving(str(d), "cpu", "float32") for d in (target_dir, draft_dir)]
    return Pair(arch, prompt, ends, *loaded, reference=_greedy(target, prompt, ends))


@pytest.fixture(scope="module", params=sorted(tinymodels.ARCHITECTURES))
def pair(request, tok, tmp_path_factory) -> Pair:
    return _build(request.param, tok, tmp_path_factory.mktemp(request.param))


def _backends(pair: Pair) -> tuple[EngineVerifier, EngineDrafter]:
    verifier = VerifierEngine(
        BatchedCausalLM(pair.target.model, CPU, torch.float32), pair.target.fingerprint, 2, 64, K + 1
    )
    lm = BatchedCausalLM(pair.draft.model, CPU, torch.float32)
    drafter = ModelDrafter(lm, pair.draft.fingerprint, 2, 64, K + 1, lm.vocab_size)
    return EngineVerifier(verifier, 2), EngineDrafter(drafter, 2)


def test_the_pair_starts_with_one_line_on_what_the_drafter_configures_apart(pair, caplog):
    t, d = pair.target.fingerprint, pair.draft.fingerprint
    assert t.end_token_ids == tuple(pair.ends) and len(d.end_token_ids) == 1
    assert d.vocabulary_differences(t) == [] and d.differences(t)  # the rule before refused this pair
    tokenizer = load_tokenizer(str(pair.target.tokenizer.name_or_path))
    gateway = TokenizerFingerprint.of(tokenizer, end_token_ids(tokenizer.name_or_path, tokenizer))
    verifier, drafter = _backends(pair)
    with caplog.at_level(logging.INFO, logger="gateway.backends"):
        check_compatible(gateway, verifier, drafter)  # type: ignore[arg-type]
    told = [r.getMessage() for r in caplog.records if r.name == "gateway.backends"]
    assert len(told) == 1, told
    assert f"eos token id {d.special_token_ids['eos']} != {t.special_token_ids['eos']}" in told[0]
    assert f"end token ids {list(d.end_token_ids)} != {pair.ends}" in told[0]


def _serve(pair: Pair, requests: list[GenerationParams], speculate: bool) -> tuple[list[tuple[list[int], str]], list]:
    """Each request's tokens and finish reason, and every chain the drafter proposed."""
    verifier, drafter = _backends(pair)
    chains: list[list[int]] = []
    draft = drafter.draft

    async def recorded(request: Any) -> Any:
        reply = await draft(request)
        chains.extend(list(p.token_ids) for p in reply.proposals)
        return reply

    drafter.draft = recorded  # type: ignore[method-assign]
    sched = Scheduler(
        pair.target.tokenizer, verifier, drafter if speculate else None, K if speculate else 0, 2, pair.ends,
        speculative_mode="fixed",
    )  # fmt: skip
    # Every sequence joins the drafter at its open: one that joined late would draft less here.
    sched.drafter_prefill.fits_beside_open = lambda tokens: 1 << 20  # type: ignore[method-assign]

    async def one(params: GenerationParams) -> tuple[list[int], str]:
        ids: list[int] = []
        async for event in sched.events(sched.submit(list(pair.prompt), params)):
            if isinstance(event, Delta):
                ids.extend(event.token_ids)
            else:
                assert isinstance(event, Finished)
                return ids, event.reason
        raise AssertionError("no finish")

    async def main() -> list[tuple[list[int], str]]:
        sched.start()
        try:
            return [await one(p) for p in requests]
        finally:
            await sched.stop()

    return asyncio.run(main()), chains


def _requests(pair: Pair) -> list[GenerationParams]:
    """The plain prompt, which ends at the crafted end id, in blocks of K and of K - 1 (so that
    one of them drafts it inside a block); then one ending at each end id as its 4th token
    (min_tokens holds every end back before it, a bias brings that one then)."""
    plain = [GenerationParams(MAX_TOKENS, GREEDY, speculation=k) for k in (K, K - 1)]
    penalties = [Penalties.of(bias={e: 100.0}, min_tokens=3) for e in pair.ends]
    return [*plain, *(GenerationParams(MAX_TOKENS, GREEDY, penalties=p) for p in penalties)]


def test_the_pair_stops_at_every_end_id_of_the_target_with_its_output(pair):
    requests = _requests(pair)
    served, chains = _serve(pair, requests, speculate=True)
    alone, _ = _serve(pair, [dataclasses.replace(r, speculation=None) for r in requests], speculate=False)
    assert served == alone, pair.arch
    assert served[0] == served[1] == (pair.reference, "stop")
    assert pair.reference[-1] not in pair.target.tokenizer.all_special_ids
    for (tokens, reason), end in zip(served[2:], pair.ends, strict=True):
        assert reason == "stop" and len(tokens) == 4 and tokens[-1] == end, (pair.arch, end, tokens)
    # The drafter ended its blocks where the target ends: at an end id of the target, not its own one alone.
    ends = set(pair.ends)
    drafted_ends = {t for chain in chains for t in chain if t in ends}
    assert drafted_ends == ends, (pair.arch, drafted_ends)
    past = [chain for chain in chains if any(t in ends for t in chain[:-1])]
    assert not past, (pair.arch, past)
