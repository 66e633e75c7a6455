"""specd distill's data phase: prompts, the target's continuations, and the resumable work directory."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specd.engine import checkpoints
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.tools.workloads import prompts_for

STATE = "state.json"
CKPT = "train.pt"


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
