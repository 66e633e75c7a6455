"""The slot KV cache computes what each common architecture computes: its greedy tokens are
`generate`'s, sliding windows included, in rows of any lengths batched together."""

from __future__ import annotations

import dataclasses

import pytest
import tinymodels
import torch

from specd.engine import fused_llama
from specd.engine.attention_layout import AttentionLayout, UnsupportedAttention, layout
from specd.engine.checkpoints import ModelLoadError
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.models import load_model

PROMPTS = ([5, 17, 300, 42, 7], [900, 12, 77])
NEW = 28  # past every sliding window (tinymodels.SLIDING_WINDOW), prompt included


@pytest.fixture(scope="module", params=sorted(tinymodels.ARCHITECTURES))
def arch_model(request, tok):
    model = tinymodels.build_architecture(request.param, 0, len(tok), tok.bos_token_id, tok.eos_token_id)
    return request.param, model


def _generate(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _decode(lm: BatchedCausalLM, prompts: tuple[list[int], ...]) -> list[list[int]]:
    """Greedy decoding of every prompt at once, rows of different lengths in each forward."""
    outs: list[list[int]] = [[] for _ in prompts]
    fed = [0] * len(prompts)
    seqs = [list(p) for p in prompts]
    while any(len(o) < NEW for o in outs):
        rows, which = [], []
        for i, seq in enumerate(seqs):
            if len(outs[i]) >= NEW:
                continue
            take = len(seq) - fed[i] if fed[i] == 0 else 1
            rows.append(Row(slot=i, start=fed[i], tokens=seq[fed[i] : fed[i] + take], logits_from=take - 1))
            which.append(i)
        for i, logits in zip(which, lm.forward(rows), strict=True):
            fed[i] = len(seqs[i])
            token = int(logits[-1].argmax())
            seqs[i].append(token)
            outs[i].append(token)
    return outs


def test_greedy_tokens_are_generates_in_a_batch(arch_model):
    arch, model = arch_model
    expected = [_generate(model, p) for p in PROMPTS]
    lm = BatchedCausalLM(model, torch.device("cpu"), torch.float32, max_slots=4, max_positions=64)
    assert _decode(lm, PROMPTS) == expected, arch


def test_verify_shaped_forwards_give_the_same_logits(arch_model):
    """Several tokens per row at once, rows of different lengths: each position's logits are
    those of feeding the tokens one by one (to float rounding)."""
    arch, model = arch_model
    seq = PROMPTS[0] + _generate(model, PROMPTS[0])
    one = BatchedCausalLM(model, torch.device("cpu"), torch.float32, max_slots=4, max_positions=64)
    step = [one.forward([Row(0, i, [t], 0)])[0][0] for i, t in enumerate(seq)]
    many = BatchedCausalLM(model, torch.device("cpu"), torch.float32, max_slots=4, max_positions=64)
    got: list[torch.Tensor] = []
    pos = 0
    for size in (7, 3, 5, 1, 9, 4, len(seq)):
        if pos >= len(seq):
            break
        chunk = seq[pos : pos + size]
        # A second, shorter row in the same forward pads this one's batch.
        rows = [Row(0, pos, chunk, 0), Row(1, 0, seq[:2], 0)]
        got.extend(many.forward(rows)[0])
        pos += len(chunk)
    torch.testing.assert_close(torch.stack(got), torch.stack(step), rtol=1e-4, atol=1e-4, msg=arch)


def test_a_mask_without_the_window_is_not_the_model(arch_model, monkeypatch):
    """The window matters for the sliding architectures: drop it and the logits past it change."""
    arch, model = arch_model
    config = model.config.get_text_config()
    if layout(config).window is None:
        pytest.skip(f"{arch} has no sliding layer")
    seq = PROMPTS[0] + _generate(model, PROMPTS[0])
    right = BatchedCausalLM(model, torch.device("cpu"), torch.float32, max_slots=2, max_positions=64)
    wrong = BatchedCausalLM(model, torch.device("cpu"), torch.float32, max_slots=2, max_positions=64)
    wrong.attention = dataclasses.replace(wrong.attention, window=None)
    a = right.forward([Row(0, 0, seq, 0)])[0]
    b = wrong.forward([Row(0, 0, seq, 0)])[0]
    window = tinymodels.SLIDING_WINDOW
    torch.testing.assert_close(a[:window], b[:window])
    assert not torch.allclose(a[window:], b[window:], atol=1e-3)


def test_only_llama_takes_the_fused_forward(arch_model):
    arch, model = arch_model
    assert fused_llama.supports(model) == (arch == "llama")


def test_attention_patterns_it_cannot_mask_are_refused_by_name():
    from types import SimpleNamespace

    chunked = SimpleNamespace(layer_types=["full_attention", "chunked_attention"], sliding_window=None)
    with pytest.raises(UnsupportedAttention, match="chunked_attention"):
        layout(chunked)
    assert layout(type("Plain", (), {})()) == AttentionLayout()


def test_each_loads_with_an_attention_transformers_offers(tmp_path, tok):
    """SDPA where transformers offers it for the class, else its eager attention. Whether it does
    moves with the version (Gemma-2 for its soft-capping: refused in some, offered in others)."""
    chosen = set()
    for arch in ("gemma2", "qwen3"):
        model = tinymodels.build_architecture(arch, 0, len(tok), tok.bos_token_id, tok.eos_token_id)
        loaded = load_model(str(tinymodels.save(model, tok, tmp_path / arch)), torch.device("cpu"), torch.float32)
        offered = getattr(type(model), "_supports_sdpa", False)
        chosen.add(loaded.config._attn_implementation)
        assert loaded.config._attn_implementation == ("sdpa" if offered else "eager"), arch
    assert "sdpa" in chosen


def test_a_model_it_cannot_serve_exactly_is_refused_at_load_naming_why(tmp_path, tok):
    model = tinymodels.build_architecture("qwen2", 0, len(tok), tok.bos_token_id, tok.eos_token_id)
    model.config.layer_types = ["full_attention", "chunked_attention"]
    path = tinymodels.save(model, tok, tmp_path / "chunked")
    with pytest.raises(ModelLoadError, match=r"cannot serve .* exactly: .*chunked_attention"):
        load_model(str(path), torch.device("cpu"), torch.float32)
