"""`specd distill`: train a cheap drafter for a target on the target's own outputs.

The drafter (see specd.draftlm) is a shallow model of the target's architecture:
a few of the target's decoder layers (copied, then trained), the target's input
embedding (frozen; borrowed from the target at load time unless --embedding copy)
and an LM head over the K tokens the target emits most often (initialised from
the target's head rows), mapped back to target ids.

Phases, each resumable from the work directory (--work-dir):

1. data: the target (in --teacher-dtype) answers training prompts, greedily and
   sampled, recording the top --top-k logits of every answer token. The prompts
   come from a bundled file of templates and subjects (data/distill_prompts.json)
   and, for --self-instruct of them, from the target itself (it writes a user turn);
   any prompt close to a held-out evaluation prompt is dropped.
2. vocab: the K most frequent answer tokens (stop tokens always included).
3. train: cross-entropy to the target's top-k distribution plus to its argmax, on
   answer positions, AdamW with a cosine schedule over the time budget.
4. eval: the float32 target's greedy answers to the held-out chat prompts, and
   how often the drafter's argmax agrees with them, teacher-forced (the per-token
   acceptance of greedy speculation) and simulated at k=4 as the stack would.

--budget-minutes bounds the whole run; --gen-share of it goes to data.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specd import checkpoints, draftlm, featurehead, models
from specd.kvcache import BatchedCausalLM, Row
from specd.placement import cpu_model
from specd.tools.workloads import prompts_for

STATE = "state.json"
CKPT = "train.pt"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specd distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="embedded", help="target: HF directory, .gguf file or 'embedded'")
    p.add_argument("--out", required=True, help="drafter directory to write (served by specd drafter --model DIR)")
    p.add_argument("--work-dir", default="", help="data and checkpoints (resume); default: under ~/.cache/specd")
    p.add_argument("--budget-minutes", type=float, default=55.0, help="wall-clock budget of the whole run")
    p.add_argument("--gen-share", type=float, default=0.4, help="share of the budget spent generating data")
    p.add_argument(
        "--design",
        choices=["feature-head", "shallow"],
        default="feature-head",
        help="feature-head: one layer reading the target's hidden states (EAGLE-style, specd.featurehead); "
        "shallow: --layers of the target's own layers, reading tokens only",
    )
    p.add_argument("--layers", default="first,last", help="shallow design: target layers copied (indices)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="K: tokens the drafter's head scores")
    p.add_argument("--prompts", default="", help="prompt file (JSON of groups, or JSONL); default: bundled")
    p.add_argument("--self-instruct", type=float, default=0.3, help="share of prompts the target writes itself")
    p.add_argument("--sampled-share", type=float, default=0.5, help="share of answers sampled, not greedy")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of sampled answers")
    p.add_argument("--max-new-tokens", type=int, default=160, help="longest answer generated")
    p.add_argument("--gen-batch", type=int, default=48, help="answers generated at once")
    p.add_argument("--teacher-dtype", default="bfloat16", choices=list(models.DTYPES))
    p.add_argument("--top-k", type=int, default=16, help="target logits kept per answer token")
    p.add_argument("--batch-tokens", type=int, default=6144, help="tokens per training step (padded)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--hard-weight", type=float, default=0.5, help="weight of the argmax term in the loss")
    p.add_argument("--train-dtype", default="bfloat16", choices=["float32", "bfloat16"], help="autocast dtype")
    p.add_argument("--max-steps", type=int, default=0, help="stop training after this many steps (0: budget)")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--save-dtype", default="bfloat16", choices=list(models.DTYPES), help="dtype of saved weights")
    p.add_argument("--embedding", choices=["borrow", "copy"], default="borrow", help="input embedding storage")
    p.add_argument("--eval-workload", default="chat", help="held-out prompts (bundled workload); '' skips eval")
    p.add_argument("--eval-max-tokens", type=int, default=96)
    p.add_argument("--eval-dtype", default="float32", choices=list(models.DTYPES), help="drafter dtype in eval")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# -- prompts ---------------------------------------------------------------


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def too_close(prompt: str, held_out: Sequence[str], threshold: float = 0.5) -> bool:
    """Whether `prompt` shares most of its words with a held-out prompt (Jaccard >= threshold)."""
    words = _words(prompt)
    for other in held_out:
        theirs = _words(other)
        union = words | theirs
        if union and len(words & theirs) / len(union) >= threshold:
            return True
    return False


def held_out_prompts() -> list[str]:
    from specd.tools.workloads import workload_names

    return [p for name in workload_names() for p in prompts_for(name)]


def training_prompts(path: str, seed: int) -> list[str]:
    if path:
        text = Path(path).read_text(encoding="utf-8")
    else:
        text = resources.files("specd.tools").joinpath("data/distill_prompts.json").read_text(encoding="utf-8")
    prompts: list[str] = []
    if path.endswith(".jsonl"):
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                prompts.append(row["prompt"] if "prompt" in row else row["messages"][-1]["content"])
    else:
        data = json.loads(text)
        for group in data.get("groups", []):
            prompts += [t.format(x=x) for t in group["templates"] for x in group["subjects"]]
        prompts += data.get("standalone", [])
    held = held_out_prompts()
    kept = sorted({p for p in prompts if not too_close(p, held)})
    random.Random(seed).shuffle(kept)
    return kept


# -- generation --------------------------------------------------------------


def chat_ids(tok: Any, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False).input_ids)


def stop_ids(tok: Any) -> set[int]:
    ids = {tok.eos_token_id}
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tok.unk_token_id:
        ids.add(im_end)
    return {i for i in ids if i is not None}


@torch.inference_mode()
def generate(
    model: Any,
    prefixes: list[list[int]],
    temperatures: list[float],
    max_new: int,
    stops: set[int],
    top_k: int,
    gen: torch.Generator,
    top_p: float = 0.95,
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Answer every prefix at once; per row: tokens, and the top-k ids and logits that chose each token.

    Runs on the services' BatchedCausalLM: a preallocated per-slot KV cache (no copy per step) where
    rows of different lengths share each forward and finished rows drop out.
    """
    dtype = next(model.parameters()).dtype
    b = len(prefixes)
    lengths = [len(p) for p in prefixes]
    # Bounded to what this batch can reach: one slot per prefix, its prompt and answer.
    lm = BatchedCausalLM(model, torch.device("cpu"), dtype, max_slots=b, max_positions=max(lengths) + max_new)
    logits = torch.cat(lm.forward([Row(i, 0, list(p), len(p) - 1) for i, p in enumerate(prefixes)]))
    temps = torch.tensor(temperatures, dtype=torch.float32)
    live = list(range(b))
    tokens: list[list[int]] = [[] for _ in range(b)]
    top_ids: list[list[torch.Tensor]] = [[] for _ in range(b)]
    top_vals: list[list[torch.Tensor]] = [[] for _ in range(b)]
    for _ in range(max_new):
        tv, ti = logits.topk(top_k, dim=-1)
        nxt = logits.argmax(-1)
        t_live = temps[live]
        sampled = (t_live > 0).nonzero().flatten()
        if sampled.numel():
            x = logits[sampled] / t_live[sampled, None]
            sv, si = x.sort(dim=-1, descending=True)
            probs = sv.softmax(-1)
            probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p, 0.0)
            pick = torch.multinomial(probs, 1, generator=gen).flatten()
            nxt[sampled] = si.gather(1, pick[:, None]).flatten()
        keep = []
        for j, r in enumerate(live):
            t = int(nxt[j])
            tokens[r].append(t)
            top_ids[r].append(ti[j].to(torch.int32))
            top_vals[r].append(tv[j].to(torch.float16))
            if t not in stops:
                keep.append(r)
        if not keep:
            break
        rows = []
        for r in keep:
            rows.append(Row(r, lengths[r], [tokens[r][-1]], 0))
            lengths[r] += 1
        live = keep
        logits = torch.cat(lm.forward(rows))
    return [(tokens[i], torch.stack(top_ids[i]), torch.stack(top_vals[i])) for i in range(b)]


def self_instruct(model: Any, tok: Any, n: int, stops: set[int], gen: torch.Generator, held: list[str]) -> list[str]:
    """User turns the target writes itself: sampled after the chat template's opening."""
    system = tok.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False)
    opening = system[: system.index("X")]
    prefix = list(tok(opening, add_special_tokens=False).input_ids)
    answers = generate(model, [prefix] * n, [1.0] * n, 48, stops, 1, gen)
    prompts = []
    for tokens, _, _ in answers:
        if not tokens or tokens[-1] not in stops:
            continue
        text = tok.decode(tokens[:-1], skip_special_tokens=True).strip()
        if 3 <= len(text.split()) <= 60 and not too_close(text, held):
            prompts.append(text)
    return prompts


# -- state -------------------------------------------------------------------


class Work:
    """The work directory: a JSON state, data shards and the training checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        f = path / STATE
        self.state: dict[str, Any] = json.loads(f.read_text()) if f.is_file() else {}

    def save(self) -> None:
        tmp = self.path / (STATE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        tmp.replace(self.path / STATE)

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("data-*.pt"))

    def add_time(self, phase: str, seconds: float) -> None:
        times = self.state.setdefault("seconds", {})
        times[phase] = times.get(phase, 0.0) + seconds
        self.save()

    def seconds(self, phase: str) -> float:
        return float(self.state.get("seconds", {}).get(phase, 0.0))


def default_work_dir(args: argparse.Namespace) -> Path:
    key = hashlib.sha256(f"{Path(args.out).resolve()}|{args.target}|{args.seed}".encode()).hexdigest()[:12]
    return checkpoints.cache_dir() / "distill" / f"{Path(args.out).name}-{key}"


def phase_data(args: argparse.Namespace, work: Work, target: Any, tok: Any, seconds: float) -> None:
    stops = stop_ids(tok)
    held = held_out_prompts()
    written = work.state.setdefault("prompts", training_prompts(args.prompts, args.seed))
    work.save()
    done = work.seconds("data")
    bar = tqdm(total=round(seconds), initial=min(round(done), round(seconds)), unit="s", desc="data", file=sys.stderr)
    batch_i = len(work.shards())
    while done < seconds:
        start = time.monotonic()
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + batch_i)
        rng = random.Random(args.seed * 7919 + batch_i)
        n_self = round(args.gen_batch * args.self_instruct)
        prompts = self_instruct(target, tok, n_self, stops, gen, held) if n_self else []
        n_written_by_target = len(prompts)
        cursor = work.state.get("cursor", 0)
        while len(prompts) < args.gen_batch:
            prompts.append(written[cursor % len(written)])
            cursor += 1
        temps = [args.temperature if rng.random() < args.sampled_share else 0.0 for _ in prompts]
        if cursor > len(written):  # a second pass over the written prompts: sample them all
            temps = [args.temperature] * len(prompts)
        prefixes = [chat_ids(tok, p) for p in prompts]
        answers = generate(target, prefixes, temps, args.max_new_tokens, stops, args.top_k, gen)
        examples = [
            {"tokens": torch.tensor(pre + ans, dtype=torch.int32), "prompt_len": len(pre), "ids": ti, "logits": tv}
            for pre, (ans, ti, tv) in zip(prefixes, answers, strict=True)
        ]
        shard = {"examples": examples, "prompts": prompts, "temperatures": temps}
        torch.save(shard, work.path / f"data-{batch_i:05d}.pt")
        batch_i += 1
        work.state["cursor"] = cursor
        elapsed = time.monotonic() - start
        work.add_time("data", elapsed)
        done += elapsed
        work.state["answer_tokens"] = work.state.get("answer_tokens", 0) + sum(len(a[0]) for a in answers)
        work.state["answers"] = work.state.get("answers", 0) + len(answers)
        work.state["self_instruct"] = work.state.get("self_instruct", 0) + n_written_by_target
        work.save()
        bar.update(min(round(elapsed), bar.total - bar.n))
        bar.set_postfix(answers=work.state["answers"], tokens=work.state["answer_tokens"])
    bar.close()


def load_examples(work: Work) -> list[dict[str, Any]]:
    examples = []
    for shard in work.shards():
        examples += torch.load(shard)["examples"]
    return examples


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


def model_card(args: argparse.Namespace, report: dict[str, Any]) -> str:
    ev, ev0, sec, tr = report.get("eval", {}), report.get("eval_init", {}), report["seconds"], report["train"]
    cmd = "specd distill " + " ".join(report["argv"])
    prompts = args.prompts or "src/specd/tools/data/distill_prompts.json"
    if args.embedding == "borrow":
        embedding = (
            "borrowed from the target at load time, not stored: `specd_drafter.json` names the target and "
            "the SHA-256 of its embedding, checked at load"
        )
    else:
        embedding = "stored in model.safetensors"
    lines = [
        f"# {Path(args.out).name}: a drafter distilled for {checkpoints.display_name(args.target)}",
        "",
        "Written by `specd distill` (src/specd/tools/distill.py); served by `specd drafter --model DIR`.",
        "",
        "## How it was made",
        "",
        f"- Command: `{cmd}` (seed {args.seed}).",
        f"- Wall-clock: {report['minutes']:.1f} min in all on {report['machine']}: data "
        f"{sec.get('data', 0) / 60:.1f} min, target hidden states {sec.get('features', 0) / 60:.1f} min, "
        f"training {sec.get('train', 0) / 60:.1f} min, "
        f"the rest ({sec.get('other', 0) / 60:.1f} min) loading, evaluation and saving.",
        f"- Data: {report['answers']} answers by the target ({args.teacher_dtype}), "
        f"{report['answer_tokens']} answer tokens with the target's top-{args.top_k} logits each; "
        f"{round(100 * args.sampled_share)}% sampled at temperature {args.temperature} (top-p 0.95), "
        f"the rest greedy. Prompts: {prompts} ({report['written_prompts']} templated prompts, none within "
        f"a word overlap of 0.5 of a held-out prompt) and {report['self_instruct']} user turns the target "
        "wrote itself. Nothing was downloaded.",
        *_model_lines(args, report, embedding),
        f"- Training: {tr['steps']} AdamW steps ({tr['epochs']:.2f} epochs, {tr['answer_tokens_seen']} answer "
        f"tokens), lr {args.lr} cosine; {_loss_text(args)}, "
        f"{args.train_dtype} autocast; final loss {report['final_loss']:.3f}.",
        f"- Weights saved in {args.save_dtype}: {report['weights_mb']:.1f} MB.",
        "",
    ]
    if ev:
        lines += [
            "## Held-out acceptance",
            "",
            f"The float32 target's greedy answers ({args.eval_max_tokens} tokens at most) to the {ev['prompts']} "
            f"`{args.eval_workload}` prompts of src/specd/tools/data/prompts.jsonl (never trained on), "
            f"{ev['answer_tokens']} tokens; the drafter in {args.eval_dtype}, fed the target's tokens. "
            "Per-token agreement is greedy speculation's per-token acceptance; the k=4 figures simulate "
            "rounds of 4 drafts as the stack runs them (the first token of an answer is target-only).",
            "",
            "| drafter | per-token agreement | acceptance rate, k=4 | mean acceptance length | per position |",
            "|---|---|---|---|---|",
        ]
        for name, e in (("initialised, untrained", ev0), ("distilled", ev)):
            if e:
                lines.append(
                    f"| {name} | {e['per_token_agreement']:.3f} | {e['acceptance_rate_k4']:.3f} | "
                    f"{e['mean_acceptance_length_k4']:.2f} | {e['per_position_k4']} |"
                )
        lines.append("")
    if "step_ms" in report:
        s = report["step_ms"]
        lines += [
            "One decode step of one sequence through the services' BatchedCausalLM, in this process: drafter "
            f"{s['drafter']:.2f} ms ({args.eval_dtype}), target {s['target']:.2f} ms (float32), ratio "
            f"{s['drafter'] / s['target']:.3f}.",
            "",
        ]
    return "\n".join(lines)


def _model_lines(args: argparse.Namespace, report: dict[str, Any], embedding: str) -> list[str]:
    vocab = (
        f"a head over the {report['draft_vocab']} tokens the target emits most often in that data (they cover "
        f"{100 * report['vocab_coverage']:.2f}% of the held-out answers' tokens), mapped back to target ids; "
        "other ids get probability 0"
    )
    if report["design"] == "feature-head":
        return [
            "- Model: a feature head (specd.featurehead, EAGLE-style): at position j it reads token j and the "
            "target's last hidden state at j - 1 (zeros inside the prompt), fuses them with one linear layer, "
            "and runs one decoder layer of the target's architecture (initialised from the target's last) and "
            f"its final norm; the output, a prediction of the target's hidden state at j, goes through {vocab}. "
            "Drafting past the first token it reads its own predicted states.",
            "- Input embedding and LM head rows: the target's, borrowed at load time, not stored: "
            "`specd_drafter.json` names the target and the SHA-256 of each, checked at load.",
        ]
    return [
        f"- Model: {report['layers_copied']} of the target's decoder layers (indices {report['layer_indices']}), "
        f"its final norm, and {vocab}.",
        f"- Input embedding: {embedding}.",
    ]


def _loss_text(args: argparse.Namespace) -> str:
    if args.design == "feature-head":
        return (
            "loss: smooth L1 to the target's hidden state + 0.1 x cross-entropy to the target's distribution "
            "over the draft vocabulary, at every answer position, in a pass reading the target's states and in "
            "a second pass where half the positions read the head's own predictions from the first"
        )
    return (
        f"loss {1 - args.hard_weight:g} x cross-entropy to the target's top-{args.top_k} distribution + "
        f"{args.hard_weight:g} x cross-entropy to its argmax"
    )


def machine() -> str:
    import platform

    name = cpu_model(platform.processor() or platform.machine())
    return f"{torch.get_num_threads()} threads of {name}, torch {torch.__version__}"


def main(argv: Sequence[str] | None = None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    wall = time.monotonic()
    budget = args.budget_minutes * 60
    work = Work(Path(args.work_dir) if args.work_dir else default_work_dir(args))
    print(f"specd distill: work directory {work.path}", file=sys.stderr)
    phases_before = work.seconds("data") + work.seconds("train") + work.seconds("other")
    tok = checkpoints.load_tokenizer(args.target)
    teacher = models.load_model(args.target, torch.device("cpu"), models.parse_dtype(args.teacher_dtype))
    reserve = min(0.15 * budget, 180.0)  # evaluation and saving
    phase_data(args, work, teacher, tok, args.gen_share * budget)
    examples = load_examples(work)
    if not examples:
        raise SystemExit("specd distill: no training data was generated within the budget")
    from specd.tools import distill_features  # it builds on this module's data phase

    feats = distill_features.phase_features(work, teacher) if args.design == "feature-head" else []
    del teacher
    target = models.load_model(args.target, torch.device("cpu"), torch.float32)
    stops = stop_ids(tok)
    vocab = choose_vocab(examples, args.draft_vocab, int(target.config.vocab_size), stops)
    refs = eval_references(args, work, tok) if args.eval_workload else []
    eval_dtype = models.parse_dtype(args.eval_dtype)
    report: dict[str, Any] = {"argv": raw, "machine": machine(), "design": args.design}
    train_seconds = max(1.0, budget - work.seconds("data") - work.seconds("features") - reserve)
    out = Path(args.out)
    if args.design == "feature-head":
        head = featurehead.init_from_target(target, vocab)
        if refs and "eval_init" not in work.state:
            work.state["eval_init"] = distill_features.evaluate(head, target, refs)
            work.save()
        report["eval_init"] = work.state.get("eval_init", {})
        report["train"] = distill_features.phase_train(args, work, head, examples, feats, train_seconds)
        if refs:
            report["eval"] = distill_features.evaluate(head.to(eval_dtype), target, refs)
        student: Any = head
        head_from = featurehead.target_head_name(checkpoints.materialize(args.target))
        head_sha = draftlm.tensor_sha256(draftlm.read_target_tensor(checkpoints.materialize(args.target), head_from))
        meta = {"target": args.target, "seed": args.seed, "head_sha256": head_sha}
        featurehead.save(head, out, meta, models.parse_dtype(args.save_dtype), head_from)
    else:
        layers = layer_indices(args.layers, int(target.config.num_hidden_layers))
        report.update(layer_indices=layers, layers_copied=len(layers))
        student = init_student(target, layers, vocab)
        if refs and "eval_init" not in work.state:
            work.state["eval_init"] = evaluate(student, refs, eval_dtype)
            work.save()
        report["eval_init"] = work.state.get("eval_init", {})
        report["train"] = phase_train(args, work, student, examples, train_seconds)
        if refs:
            report["eval"] = evaluate(student, refs, eval_dtype)
        meta = {"target": args.target, "layers_from": layers, "seed": args.seed}
        draftlm.save(student, out, meta, args.embedding == "borrow", models.parse_dtype(args.save_dtype))
    losses = report["train"]["losses"]
    report["final_loss"] = sum(losses[-20:]) / max(1, len(losses[-20:]))
    report["train"]["losses"] = losses[:: max(1, len(losses) // 200)]
    if refs:
        answer_tokens = [t for _, a in refs for t in a]
        in_vocab = set(vocab.tolist())
        report["vocab_coverage"] = sum(t in in_vocab for t in answer_tokens) / max(1, len(answer_tokens))
    else:
        report["vocab_coverage"] = float("nan")
    report["step_ms"] = {
        "drafter": step_ms(copy.deepcopy(student).to(eval_dtype).eval(), eval_dtype),
        "target": step_ms(target, torch.float32),
    }
    tok.save_pretrained(out)
    report.update(
        draft_vocab=int(vocab.numel()),
        answers=work.state.get("answers", 0),
        answer_tokens=work.state.get("answer_tokens", 0),
        written_prompts=len(work.state.get("prompts", [])),
        self_instruct=work.state.get("self_instruct", 0),
        seconds=dict(work.state.get("seconds", {})),
        weights_mb=(out / draftlm.WEIGHTS).stat().st_size / 1e6,
    )
    # Wall-clock of every run on this work directory: the timed phases, plus the rest of each completed run.
    this_run_phases = sum(report["seconds"].values()) - phases_before
    work.add_time("other", time.monotonic() - wall - this_run_phases)
    report["seconds"] = work.state["seconds"]
    report["minutes"] = sum(report["seconds"].values()) / 60
    (out / "README.md").write_text(model_card(args, report) + "\n")
    (out / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
    ev = report.get("eval", {})
    print(
        f"specd distill: wrote {out} ({report['weights_mb']:.1f} MB) in {report['minutes']:.1f} min; "
        f"held-out per-token agreement {ev.get('per_token_agreement', float('nan')):.3f}, "
        f"acceptance at k=4 {ev.get('acceptance_rate_k4', float('nan')):.3f}; "
        f"step {report['step_ms']['drafter']:.2f} ms vs target {report['step_ms']['target']:.2f} ms",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
