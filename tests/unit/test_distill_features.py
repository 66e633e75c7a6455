"""What `specd distill --design feature-head` feeds the head, trains it on, and how it scores it."""

from __future__ import annotations

import torch

from specd.engine import featurehead
from specd.tools import distill_features


def example(tokens: list[int], prompt_len: int) -> dict:
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "prompt_len": prompt_len}


def test_inputs_feed_the_previous_positions_state_and_zeros_in_the_prompt():
    states = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 3)  # state at p is p everywhere
    ids, fed, want, attn, loss_at = distill_features._inputs(
        [example([10, 11, 12, 13, 14, 15], 3), example([20, 21, 22, 23], 2)], [states, states[:4]], 3
    )
    assert ids[0].tolist() == [10, 11, 12, 13, 14, 15] and ids[1, :4].tolist() == [20, 21, 22, 23]
    # Position j >= prompt_len reads the state at j - 1; prompt positions read zeros.
    assert fed[0, :, 0].tolist() == [0, 0, 0, 2, 3, 4]
    assert fed[1, :, 0].tolist() == [0, 0, 1, 2, 0, 0]
    assert torch.equal(want[0], states)
    assert attn[1].tolist() == [1, 1, 1, 1, 0, 0]
    # Trained where drafting happens: from the prompt's length to the one before last.
    assert loss_at[0].tolist() == [False, False, False, True, True, False]
    assert loss_at[1].tolist() == [False, False, True, False, False, False]


def test_training_on_the_targets_states_makes_the_head_agree(tiny_target):
    """A few steps on the tiny target's own states raise the head's agreement with its argmax."""
    torch.manual_seed(0)
    vocab = torch.arange(int(tiny_target.config.vocab_size))
    head = featurehead.init_from_target(tiny_target, vocab)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 500, (24,)).tolist() for _ in range(8)]
    examples = [example(s, 6) for s in sequences]
    feats = distill_features.hidden_states(tiny_target, sequences)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses, agreement = [], []
    for _ in range(40):
        loss, agree = distill_features.feature_loss(head, examples, feats, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        agreement.append(agree)
    assert losses[-1] < 0.7 * losses[0]
    assert agreement[-1] > agreement[0] + 0.1
    # The embedding and the LM head stay the target's.
    assert torch.equal(head.lm_head.weight, tiny_target.get_output_embeddings().weight[vocab].float())


def test_evaluation_simulates_rounds_and_counts_a_perfect_head_fully(tiny_target, monkeypatch):
    """A head that always drafts the target's answer is accepted at every position of every round."""
    vocab = torch.arange(int(tiny_target.config.vocab_size))
    head = featurehead.init_from_target(tiny_target, vocab)
    prompt, answer = [5, 6, 7, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    seq = prompt + answer

    def perfect(self, hidden):
        # Row r of the forward is position r; the last row drafts the token after the fed ones.
        logits = torch.full((*hidden.shape[:-1], vocab.numel()), -1.0)
        n = hidden.shape[0] if hidden.dim() == 2 else 1
        if hidden.dim() == 1:
            logits[seq[perfect.length]] = 1.0
        else:
            for r in range(n):
                if r + 1 < len(seq):
                    logits[r, seq[r + 1]] = 1.0
        return logits

    real_forward = featurehead.FeatureHeadLM.forward

    def forward(self, input_ids, features, **kw):
        perfect.length = input_ids.shape[1]
        return real_forward(self, input_ids, features, **kw)

    monkeypatch.setattr(featurehead.FeatureHeadLM, "forward", forward)
    monkeypatch.setattr(type(head.lm_head), "draft_logits", perfect)
    report = distill_features.evaluate(head, tiny_target, [(prompt, answer)], k=4)
    assert report["per_token_agreement"] == 1.0
    assert report["acceptance_rate_k4"] == 1.0
    # 10 answer tokens: the first is the target's, then a round of 4 drafts + 1, then the last 4 drafts.
    assert report["mean_acceptance_length_k4"] == 5.0
