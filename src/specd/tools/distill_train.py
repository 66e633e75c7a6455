"""specd distill's training phase: the student's vocabulary and layers, its loss, the training loop and evaluation."""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from specd.engine import draftlm, models
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.tools.distill_data import CKPT, Work, chat_ids, generate, stop_ids
from specd.tools.workloads import prompts_for


def choose_vocab(examples: list[dict[str, Any]], size: int, vocab_size: int, stops: set[int]) -> torch.Tensor:
    """The `size` target ids the target most often puts first (its greedy choices), stop tokens always in."""
    counts: Counter[int] = Counter()
    for ex in examples:
        counts.update(ex["ids"][:, 0].tolist())
        counts.update(ex["tokens"][ex["prompt_len"] :].tolist())
    size = min(size, vocab_size)
    chosen = [t for t in stops if t < vocab_size]
    for t, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    if len(chosen) < size:  # fewer distinct tokens seen than K: fill with the rest, by id
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][: size - len(chosen)]
    return torch.tensor(chosen, dtype=torch.long)


# -- the student -------------------------------------------------------------


def layer_indices(spec: str, num_layers: int) -> list[int]:
    names = {"first": 0, "last": num_layers - 1}
    out = [names[part.strip()] if part.strip() in names else int(part) for part in spec.split(",")]
    if not out or any(not 0 <= i < num_layers for i in out):
        raise ValueError(f"--layers {spec!r}: indices must lie in [0, {num_layers})")
    return out


def init_student(target: Any, layers: list[int], vocab: torch.Tensor) -> Any:
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    for attr in ("layer_types",):
        if isinstance(getattr(config, attr, None), list):
            setattr(config, attr, [getattr(config, attr)[i] for i in layers])
    embedding = target.get_input_embeddings().weight.detach().float().clone()
    student = draftlm.build_model(config, vocab, embedding)
    with torch.no_grad():
        for dst, src in zip(student.model.layers, layers, strict=True):
            state = {k: v.float() for k, v in target.model.layers[src].state_dict().items()}
            dst.load_state_dict(state)
        student.model.norm.load_state_dict({k: v.float() for k, v in target.model.norm.state_dict().items()})
        student.lm_head.weight.copy_(target.get_output_embeddings().weight.detach().float()[vocab])
    for i, layer in enumerate(student.model.layers):
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = i
    return student.float()


def batches(examples: list[dict[str, Any]], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar lengths, each at most `batch_tokens` padded tokens, in random order."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    out = []
    for chunk_start in range(0, len(order), 256):
        chunk = sorted(order[chunk_start : chunk_start + 256], key=lambda i: len(examples[i]["tokens"]))
        cur: list[int] = []
        longest = 0
        for i in chunk:
            n = len(examples[i]["tokens"])
            if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
                out.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def loss_of(student: Any, examples: list[dict[str, Any]], index: torch.Tensor, hard_weight: float) -> torch.Tensor:
    length = max(len(ex["tokens"]) for ex in examples)
    ids = torch.zeros((len(examples), length), dtype=torch.long)
    attn = torch.zeros((len(examples), length), dtype=torch.long)
    bi, pj, tid, tval = [], [], [], []
    for b, ex in enumerate(examples):
        n = len(ex["tokens"])
        ids[b, :n] = ex["tokens"].long()
        attn[b, :n] = 1
        p, m = ex["prompt_len"], len(ex["ids"])
        bi.append(torch.full((m,), b))
        pj.append(torch.arange(p - 1, p - 1 + m))
        tid.append(ex["ids"].long())
        tval.append(ex["logits"].float())
    hidden = student.model(input_ids=ids, attention_mask=attn).last_hidden_state
    h = hidden[torch.cat(bi), torch.cat(pj)]
    logp = student.lm_head.draft_logits(h).float().log_softmax(-1)
    tid_all, tval_all = torch.cat(tid), torch.cat(tval)
    didx = index[tid_all]
    inside = didx >= 0
    teacher = tval_all.masked_fill(~inside, float("-inf"))
    usable = inside.any(-1)
    p = teacher[usable].softmax(-1)
    lp = logp[usable].gather(1, didx[usable].clamp(min=0))
    soft = -(p * lp.masked_fill(~inside[usable], 0.0)).sum(-1).mean()
    first = didx[:, 0]
    hard_rows = first >= 0
    hard = -logp[hard_rows].gather(1, first[hard_rows, None]).mean() if hard_rows.any() else soft * 0
    return (1 - hard_weight) * soft + hard_weight * hard


def phase_train(
    args: argparse.Namespace, work: Work, student: Any, examples: list[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    """Train the shallow design: cross-entropy to the target's top-k distribution and its argmax."""
    index = draftlm.target_index(student.lm_head.draft_vocab, student.config.vocab_size)

    def step_loss(chosen: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        return loss_of(student, [examples[i] for i in chosen], index, args.hard_weight), {}

    return train_loop(args, work, student, examples, seconds, step_loss, {draftlm.EMBEDDING_KEY}, (0.9, 0.98))


def train_loop(
    args: argparse.Namespace,
    work: Work,
    model: Any,
    examples: list[dict[str, Any]],
    seconds: float,
    step_loss: Callable[[list[int]], tuple[torch.Tensor, dict[str, float]]],
    frozen: set[str],
    betas: tuple[float, float],
) -> dict[str, Any]:
    """AdamW with warm-up and a cosine schedule over the time budget (or --max-steps), batches of
    similar lengths, resumable from the work directory's checkpoint (which leaves out `frozen`).

    `step_loss(example indices)` returns a batch's loss and figures to show beside it."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=betas)
    ckpt = work.path / CKPT
    step, epoch, pos, tokens_seen = 0, 0, 0, 0
    losses: list[float] = []
    if ckpt.is_file():
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["opt"])
        step, epoch, pos, tokens_seen = saved["step"], saved["epoch"], saved["pos"], saved["tokens"]
        losses = saved.get("losses", [])
    done = work.seconds("train")
    autocast = args.train_dtype == "bfloat16"

    def save_ckpt() -> None:
        trainable = {k: v for k, v in model.state_dict().items() if k not in frozen}
        state = {"model": trainable, "opt": opt.state_dict(), "step": step, "epoch": epoch, "pos": pos}
        torch.save({**state, "tokens": tokens_seen, "losses": losses}, work.path / (CKPT + ".tmp"))
        (work.path / (CKPT + ".tmp")).replace(ckpt)

    model.train()
    bar = tqdm(total=round(seconds), initial=min(round(done), round(seconds)), unit="s", desc="train", file=sys.stderr)
    last_ckpt = time.monotonic()
    plan = batches(examples, args.batch_tokens, random.Random(args.seed * 31 + epoch))
    shown: dict[str, list[float]] = {}
    while done < seconds and (not args.max_steps or step < args.max_steps):
        if pos >= len(plan):
            epoch, pos = epoch + 1, 0
            plan = batches(examples, args.batch_tokens, random.Random(args.seed * 31 + epoch))
        start = time.monotonic()
        frac = min(1.0, done / seconds) if not args.max_steps else step / args.max_steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        chosen = plan[pos]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, figures = step_loss(chosen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step, pos = step + 1, pos + 1
        tokens_seen += sum(len(examples[i]["ids"]) for i in chosen)
        losses.append(round(float(loss.detach()), 4))
        elapsed = time.monotonic() - start
        done += elapsed
        work.add_time("train", elapsed)
        bar.update(min(round(done) - bar.n, bar.total - bar.n))
        for name, value in {"loss": losses[-1], **figures}.items():
            shown.setdefault(name, []).append(value)
        recent = {name: f"{sum(v[-20:]) / len(v[-20:]):.3f}" for name, v in shown.items()}
        bar.set_postfix(step=step, epoch=epoch, lr=f"{lr:.1e}", **recent)
        if time.monotonic() - last_ckpt > args.checkpoint_minutes * 60:
            save_ckpt()
            last_ckpt = time.monotonic()
    bar.close()
    save_ckpt()
    model.eval()
    epochs = epoch + pos / max(1, len(plan))
    return {"steps": step, "epochs": epochs, "answer_tokens_seen": tokens_seen, "losses": losses}


# -- evaluation ---------------------------------------------------------------


def eval_references(args: argparse.Namespace, work: Work, tok: Any) -> list[tuple[list[int], list[int]]]:
    """The float32 target's greedy answers to the held-out prompts: (prompt ids, answer ids)."""
    path = work.path / f"eval-{args.eval_workload}-{args.eval_max_tokens}.pt"
    if path.is_file():
        return torch.load(path)
    target = models.load_model(args.target, torch.device("cpu"), torch.float32)
    prompts = list(prompts_for(args.eval_workload))
    prefixes = [chat_ids(tok, p) for p in prompts]
    refs = []
    for i in range(0, len(prefixes), 16):
        part = prefixes[i : i + 16]
        answers = generate(target, part, [0.0] * len(part), args.eval_max_tokens, stop_ids(tok), 1, torch.Generator())
        refs += [(pre, ans[0]) for pre, ans in zip(part, answers, strict=True)]
    torch.save(refs, path)
    return refs


@torch.inference_mode()
def evaluate(student: Any, refs: list[tuple[list[int], list[int]]], dtype: torch.dtype, k: int = 4) -> dict[str, Any]:
    """Teacher-forced agreement with the target's greedy answers, and acceptance simulated at k drafts a round."""
    model = copy.deepcopy(student).to(dtype).eval()
    matches_all: list[list[bool]] = []
    for prompt, answer in refs:
        ids = torch.tensor([prompt + answer])
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        logits = model.lm_head(hidden[len(prompt) - 1 : len(prompt) - 1 + len(answer)])
        matches_all.append((logits.argmax(-1) == torch.tensor(answer)).tolist())
    agree = sum(sum(m) for m in matches_all) / max(1, sum(len(m) for m in matches_all))
    drafted = accepted = rounds = 0
    per_pos = [[0, 0] for _ in range(k)]
    for m in matches_all:
        t = 1  # the stack's first round of a sequence is target-only
        while t < len(m):
            n = min(k, len(m) - t)
            acc = 0
            while acc < n and m[t + acc]:
                acc += 1
            for j in range(min(n, acc + 1)):
                per_pos[j][0] += 1
                per_pos[j][1] += j < acc
            drafted, accepted, rounds = drafted + n, accepted + acc, rounds + 1
            t += acc + 1
    return {
        "prompts": len(refs),
        "answer_tokens": sum(len(m) for m in matches_all),
        "per_token_agreement": round(agree, 4),
        f"acceptance_rate_k{k}": round(accepted / max(1, drafted), 4),
        f"mean_acceptance_length_k{k}": round(1 + accepted / max(1, rounds), 3),
        f"per_position_k{k}": [round(a / max(1, d), 4) for d, a in per_pos],
    }


def step_ms(model: Any, dtype: torch.dtype, n: int = 30) -> float:
    """Median time of one single-sequence decode step through the drafter service's BatchedCausalLM."""
    lm = BatchedCausalLM(model, torch.device("cpu"), dtype, max_slots=1, max_positions=128 + n)
    lm.forward([Row(0, 0, list(range(100, 228)), 127)])
    times = []
    for i in range(n):
        start = time.perf_counter()
        lm.forward([Row(0, 128 + i, [100 + i], 0)])
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


# -- output ------------------------------------------------------------------
