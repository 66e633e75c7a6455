"""`specd distill --design feature-head`: train a feature drafter (specd.engine.featurehead).

Phases after the shared data phase (specd.tools.distill), each resumable:

1. features: the target (in --teacher-dtype) reads every training answer with its
   prompt, teacher-forced, and its last hidden state at every position is kept
   (bfloat16), one file per data shard.
2. train: at every answer position j the head is fed token x_j and the target's
   hidden state at j - 1 (zeros inside the prompt, as served) and learns to predict
   the target's hidden state at j (smooth L1) and the distribution the target's LM
   head gives it over the draft vocabulary (cross-entropy). A second pass feeds some
   positions the head's own predictions from the first, as drafting beyond the first
   token does, and is trained the same way.
3. eval: the float32 target's greedy answers to the held-out prompts, drafted in
   rounds of k as the stack drafts them (the target's hidden states up to the last
   committed token, the head's own predictions after it), so the figures are
   speculation's acceptance, not one-step agreement.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specd.engine import featurehead
from specd.tools.distill_data import Work
from specd.tools.distill_train import train_loop

FEATURES = "features-{:05d}.pt"
# Share of the positions of the second pass fed the head's own prediction rather than the target's.
PREDICTED_SHARE = 0.5
# Weight of the cross-entropy to the target's distribution beside the hidden-state regression.
CE_WEIGHT = 0.1


@torch.inference_mode()
def hidden_states(target: Any, sequences: list[list[int]], batch_tokens: int = 4096) -> list[torch.Tensor]:
    """The target's last hidden state at every position of every sequence, teacher-forced: [len, H] bfloat16."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    i = 0
    while i < len(order):
        j, longest = i, 0
        while j < len(order) and max(longest, len(sequences[order[j]])) * (j - i + 1) <= batch_tokens:
            longest = max(longest, len(sequences[order[j]]))
            j += 1
        j = max(j, i + 1)
        part = order[i:j]
        length = max(len(sequences[k]) for k in part)
        ids = torch.zeros((len(part), length), dtype=torch.long)
        mask = torch.zeros((len(part), length), dtype=torch.long)
        for b, k in enumerate(part):
            ids[b, : len(sequences[k])] = torch.tensor(sequences[k])
            mask[b, : len(sequences[k])] = 1
        hidden = target.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for b, k in enumerate(part):
            out[k] = hidden[b, : len(sequences[k])].to(torch.bfloat16).clone()
        i = j
    return out


def phase_features(work: Work, target: Any) -> list[torch.Tensor]:
    """Hidden states of every example of every data shard (computed once per shard, then read back)."""
    out: list[torch.Tensor] = []
    shards = work.shards()
    for n, shard in enumerate(tqdm(shards, desc="features", unit="shard", file=sys.stderr)):
        path = work.path / FEATURES.format(n)
        if path.is_file():
            out += torch.load(path)
            continue
        start = time.monotonic()
        examples = torch.load(shard)["examples"]
        rows = hidden_states(target, [ex["tokens"].tolist() for ex in examples])
        torch.save(rows, work.path / (path.name + ".tmp"))
        (work.path / (path.name + ".tmp")).replace(path)
        work.add_time("features", time.monotonic() - start)
        out += rows
    return out


def _inputs(
    examples: list[dict[str, Any]], feats: list[torch.Tensor], hidden: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded token ids, fed features (zeros in the prompt), target states, attention and loss masks."""
    length = max(len(ex["tokens"]) for ex in examples)
    b = len(examples)
    ids = torch.zeros((b, length), dtype=torch.long)
    fed = torch.zeros((b, length, hidden))
    want = torch.zeros((b, length, hidden))
    attn = torch.zeros((b, length), dtype=torch.long)
    loss_at = torch.zeros((b, length), dtype=torch.bool)
    for i, (ex, f) in enumerate(zip(examples, feats, strict=True)):
        n, p = len(ex["tokens"]), ex["prompt_len"]
        ids[i, :n] = ex["tokens"].long()
        fed[i, p:n] = f[p - 1 : n - 1].float()
        want[i, :n] = f.float()
        attn[i, :n] = 1
        # Drafting starts after the first answer token: position p drafts the second.
        loss_at[i, p : n - 1] = True
    return ids, fed, want, attn, loss_at


def feature_loss(
    model: featurehead.FeatureHeadLM,
    examples: list[dict[str, Any]],
    feats: list[torch.Tensor],
    gen: torch.Generator,
) -> tuple[torch.Tensor, float]:
    """The loss of one batch and the first pass's agreement with the target's argmax."""
    ids, fed, want, attn, loss_at = _inputs(examples, feats, model.feature_size)
    head = model.lm_head.weight
    target_states = want[loss_at]
    teacher = (target_states @ head.T).float()
    p = teacher.softmax(-1)
    first = model(ids, fed, attention_mask=attn)

    def part(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = out[loss_at]
        logp = (h @ head.T).float().log_softmax(-1)
        loss = F.smooth_l1_loss(h.float(), target_states) + CE_WEIGHT * -(p * logp).sum(-1).mean()
        return loss, (logp.argmax(-1) == teacher.argmax(-1)).float().mean()

    loss1, agree = part(first)
    # Drafting on: position j is fed the head's own prediction of the state at j - 1.
    predicted = torch.cat([fed[:, :1], first[:, :-1].detach().float()], dim=1)
    use = (torch.rand(fed.shape[:2], generator=gen) < PREDICTED_SHARE) & loss_at
    use[:, 1:] &= loss_at[:, :-1]  # the first drafting position always reads the target's state
    fed2 = torch.where(use[..., None], predicted, fed)
    loss2, _ = part(model(ids, fed2, attention_mask=attn))
    return loss1 + loss2, float(agree)


def phase_train(
    args: argparse.Namespace,
    work: Work,
    model: featurehead.FeatureHeadLM,
    examples: list[dict[str, Any]],
    feats: list[torch.Tensor],
    seconds: float,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed)

    def step_loss(chosen: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        loss, agree = feature_loss(model, [examples[i] for i in chosen], [feats[i] for i in chosen], gen)
        return loss, {"agree": agree}

    frozen = {featurehead.EMBEDDING, featurehead.HEAD, "lm_head.draft_vocab"}
    return train_loop(args, work, model, examples, seconds, step_loss, frozen, (0.9, 0.95))


@torch.inference_mode()
def evaluate(
    model: featurehead.FeatureHeadLM, target: Any, refs: list[tuple[list[int], list[int]]], k: int = 4
) -> dict[str, Any]:
    """Acceptance of greedy speculation with this head, simulated round by round on the target's answers.

    Each round drafts up to k tokens after the committed ones: the head reads the target's hidden
    states of the committed positions and its own predictions after them; the round accepts the
    drafts up to the first that differs from the target's answer, and commits one token more.
    The first answer token is the target's alone, as in the stack. Per-token agreement is the
    first draft's (the target's state at every committed position), over every answer position.
    """
    vocab = model.lm_head.draft_vocab
    agree = positions = drafted = accepted = rounds = 0
    per_pos = [[0, 0] for _ in range(k)]
    for prompt, answer in refs:
        seq = prompt + answer
        p = len(prompt)
        states = hidden_states(target, [seq])[0]
        ids = torch.tensor([seq])
        fed = torch.zeros((1, len(seq), model.feature_size))
        fed[0, p:] = states[p - 1 : len(seq) - 1].float()
        out = model(ids, fed)[0]
        guess = vocab[model.lm_head.draft_logits(out).argmax(-1)]
        # Position j drafts the token at j + 1; drafting starts at position p (the second answer token).
        for j in range(p, len(seq) - 1):
            agree += int(guess[j] == seq[j + 1])
            positions += 1
        committed = p + 1
        while committed < len(seq):
            n = min(k, len(seq) - committed)
            tokens, feats = list(seq[:committed]), fed[0, :committed].clone()
            got = 0
            for _ in range(n):
                h = model(torch.tensor([tokens]), feats[None])[0, -1]
                d = int(vocab[model.lm_head.draft_logits(h).argmax()])
                if d != seq[len(tokens)]:
                    break
                got += 1
                tokens.append(d)
                feats = torch.cat([feats, h[None].float()])
            for j in range(min(n, got + 1)):
                per_pos[j][0] += 1
                per_pos[j][1] += j < got
            drafted, accepted, rounds = drafted + n, accepted + got, rounds + 1
            committed += got + 1
    return {
        "prompts": len(refs),
        "answer_tokens": sum(len(a) for _, a in refs),
        "per_token_agreement": round(agree / max(1, positions), 4),
        f"acceptance_rate_k{k}": round(accepted / max(1, drafted), 4),
        f"mean_acceptance_length_k{k}": round(1 + accepted / max(1, rounds), 3),
        f"per_position_k{k}": [round(a / max(1, d), 4) for d, a in per_pos],
    }
