"""The bench's in-process peer (`--modes hf` and `hf-target`): HF `generate` with the same models,
on the tiny ones. Its figures are only a baseline if it runs what it says: assisted greedy
decoding is target-only greedy decoding, whatever drafts, and the timings are the request's."""

from __future__ import annotations

import pytest

from specd.tools.hf_baseline import HfBaseline, HfConfig

PROMPTS = ["Tell me a short story about a cat.", "What is two plus two?", "Name three colours."]
TOKENS = 12


@pytest.fixture(scope="module")
def reference(model_dirs):
    peer = HfBaseline(HfConfig(target=str(model_dirs["target"]), draft="none"))
    assert peer.name == "HF generate, target float32"
    return peer.run(PROMPTS, TOKENS, 0.0, ignore_eos=True)


@pytest.mark.parametrize(
    ("draft", "quantize", "name"),
    [
        ("draft", "none", "HF generate(assistant_model=none/float32, num_assistant_tokens=3)"),
        ("draft", "int8", "HF generate(assistant_model=int8/float32, num_assistant_tokens=3)"),
        ("ngram", "none", "HF generate(prompt_lookup_num_tokens=3)"),
    ],
)
def test_assisted_greedy_output_is_the_targets(model_dirs, reference, draft, quantize, name):
    config = HfConfig(
        target=str(model_dirs["target"]),
        draft=str(model_dirs[draft]) if draft in model_dirs else draft,
        draft_dtype="float32",
        draft_quantize=quantize,
        k=3,
    )
    peer = HfBaseline(config)
    assert peer.name == name
    results = peer.run(PROMPTS, TOKENS, 0.0, ignore_eos=True)
    assert [r.text for r in results] == [r.text for r in reference]
    for r in results:
        assert r.completion_tokens == TOKENS
        assert 0 < r.ttft_s <= r.e2e_s
        # One gap between consecutive chunks; a chunk may hold several accepted tokens.
        assert len(r.chunk_gaps_s) <= TOKENS - 1
        assert all(gap >= 0 for gap in r.chunk_gaps_s)


def test_sampled_requests_are_reproducible_and_differ_by_seed(model_dirs):
    config = HfConfig(target=str(model_dirs["target"]), draft=str(model_dirs["draft"]), draft_quantize="none", k=3)
    peer = HfBaseline(config)
    first = [r.text for r in peer.run(PROMPTS, TOKENS, 1.0, ignore_eos=True)]
    again = [r.text for r in peer.run(PROMPTS, TOKENS, 1.0, ignore_eos=True)]
    assert first == again
    # Request i is seeded with i: the same prompt under two seeds gives two samples.
    same_prompt = [peer.generate(PROMPTS[0], TOKENS, 1.0, True, seed).text for seed in (0, 1)]
    assert same_prompt[0] != same_prompt[1]


def test_sampled_requests_take_the_benchs_top_p(model_dirs):
    peer = HfBaseline(HfConfig(target=str(model_dirs["target"]), draft="none"))
    assert peer._kwargs(TOKENS, 1.0, False, 0, top_p=0.5)["top_p"] == 0.5
    # A nucleus of one token is the greedy choice, at any temperature.
    greedy = peer.generate(PROMPTS[0], TOKENS, 0.0, True, 0).text
    assert peer.generate(PROMPTS[0], TOKENS, 2.0, True, 3, top_p=1e-6).text == greedy
