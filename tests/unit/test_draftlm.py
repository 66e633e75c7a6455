"""The distilled drafter's truncated head, its save/load, and what `specd distill` feeds it."""

from __future__ import annotations

import pytest
import tinymodels
import torch

from specd.engine import checkpoints, draftlm
from specd.engine.params import SamplingParams
from specd.engine.sampling import probabilities
from specd.tools import distill_data, distill_train


def head(vocab=(5, 2, 9, 0), target_vocab=12, hidden=8, seed=0):
    torch.manual_seed(seed)
    h = draftlm.DraftVocabHead(hidden, torch.tensor(vocab), target_vocab)
    with torch.no_grad():
        h.weight.normal_()
    return h


def test_draft_logits_land_on_their_target_ids():
    h = head()
    x = torch.randn(3, 8)
    small, full = h.draft_logits(x), h(x)
    assert full.shape == (3, 12)
    assert torch.equal(full[:, h.draft_vocab], small)
    outside = [i for i in range(12) if i not in (5, 2, 9, 0)]
    assert torch.isneginf(full[:, outside]).all()
    # Draft row j is target id draft_vocab[j], and the reverse index maps it back.
    index = draftlm.target_index(h.draft_vocab, 12)
    assert index[5] == 0 and index[2] == 1 and index[9] == 2 and index[0] == 3
    assert (index[outside] == -1).all()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(0.7, top_p=0.9, top_k=3)],
)
def test_q_is_a_distribution_over_target_ids(params):
    h = head()
    q = probabilities(h(torch.randn(4, 8)), [params] * 4)
    assert q.shape == (4, 12)
    assert torch.isfinite(q).all()
    assert torch.allclose(q.sum(-1), torch.ones(4))
    outside = [i for i in range(12) if i not in (5, 2, 9, 0)]
    assert (q[:, outside] == 0).all()
    # Greedy: the argmax is the target id of the best draft row.
    if params.greedy:
        x = torch.randn(1, 8)
        assert int(probabilities(h(x), [params]).argmax()) == int(h.draft_vocab[h.draft_logits(x).argmax()])


def test_head_refuses_bad_vocabularies():
    with pytest.raises(ValueError):
        draftlm.DraftVocabHead(8, torch.tensor([1, 1]), 12)
    with pytest.raises(ValueError):
        draftlm.DraftVocabHead(8, torch.tensor([12]), 12)


def test_save_and_load_with_a_borrowed_embedding(tmp_path, tok):
    target = tinymodels.build_model(0, len(tok), tok.bos_token_id, tok.eos_token_id, layers=3)
    target_dir = tinymodels.save(target, tok, tmp_path / "target")
    vocab = torch.tensor([tok.eos_token_id, *range(100, 163)])
    student = distill_train.init_student(target, [0, 2], vocab)
    out = tmp_path / "drafter"
    draftlm.save(student, out, {"target": str(target_dir)}, borrow_embedding=True, dtype=torch.float32)
    tok.save_pretrained(out)
    assert checkpoints.is_distilled(out)
    loaded = draftlm.load(out, torch.float32, lambda spec: spec)
    ids = torch.tensor([[1, 100, 120, 5]])
    with torch.no_grad():
        a = student.lm_head(student.model(input_ids=ids).last_hidden_state)
        b = loaded.lm_head(loaded.model(input_ids=ids).last_hidden_state)
    assert torch.allclose(a, b, atol=1e-5)
    # A target whose embedding differs is refused.
    other = tinymodels.build_model(7, len(tok), tok.bos_token_id, tok.eos_token_id, layers=3)
    other_dir = tinymodels.save(other, tok, tmp_path / "other")
    with pytest.raises(ValueError, match="embedding"):
        draftlm.load(out, torch.float32, lambda spec: other_dir)


def test_held_out_prompts_are_kept_out_of_training():
    held = distill_data.held_out_prompts()
    assert distill_data.too_close(held[0], held)
    assert distill_data.too_close(held[0].upper() + "!", held)
    assert not distill_data.too_close("Write a limerick about a robot learning to paint.", held)
    prompts = distill_data.training_prompts("", seed=0)
    assert len(prompts) > 1000
    assert not set(prompts) & set(held)
    assert prompts == distill_data.training_prompts("", seed=0)


def test_vocab_keeps_stop_tokens_and_takes_the_most_frequent():
    ex = {"tokens": torch.tensor([1, 2, 7, 7, 7, 8], dtype=torch.int32), "prompt_len": 2}
    ex["ids"] = torch.tensor([[7, 3], [7, 3], [7, 3], [8, 3]], dtype=torch.int32)
    vocab = distill_train.choose_vocab([ex], 3, 20, {0})
    assert vocab.tolist() == [0, 7, 8]
    assert len(set(distill_train.choose_vocab([ex], 10, 20, {0}).tolist())) == 10
