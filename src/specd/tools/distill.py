"""`specd distill`: train a cheap drafter for a target on the target's own outputs.

The drafter (see specd.engine.draftlm) is a shallow model of the target's architecture:
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
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specd.engine import checkpoints, draftlm, featurehead, models
from specd.engine.cpus import cpu_model
from specd.tools import distill_features
from specd.tools.distill_data import Work, default_work_dir, load_examples, phase_data, stop_ids
from specd.tools.distill_train import (
    choose_vocab,
    eval_references,
    evaluate,
    init_student,
    layer_indices,
    phase_train,
    step_ms,
)


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
        help="feature-head: one layer reading the target's hidden states (EAGLE-style, specd.engine.featurehead); "
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
            "- Model: a feature head (specd.engine.featurehead, EAGLE-style): at position j it reads token j and the "
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
    feats = distill_features.phase_features(work, teacher) if args.design == "feature-head" else []
    del teacher
    target = models.load_model(args.target, torch.device("cpu"), torch.float32)
    stops = stop_ids(tok)
    vocab = choose_vocab(examples, args.draft_vocab, int(target.config.vocab_size), stops)
    refs = eval_references(args, work, tok) if args.eval_workload else []
    report: dict[str, Any] = {"argv": raw, "machine": machine(), "design": args.design}
    train_seconds = max(1.0, budget - work.seconds("data") - work.seconds("features") - reserve)
    if args.design == "feature-head":
        student: Any = _train_feature_head(args, work, target, vocab, refs, examples, feats, report, train_seconds)
    else:
        student = _train_layers(args, work, target, vocab, refs, examples, report, train_seconds)
    _write_report(args, work, report, refs, vocab, student, target, tok, phases_before, wall)


def _train_feature_head(
    args: argparse.Namespace,
    work: Work,
    target: Any,
    vocab: torch.Tensor,
    refs: list[Any],
    examples: list[Any],
    feats: list[Any],
    report: dict[str, Any],
    train_seconds: float,
) -> Any:
    """Train a feature head on the target's hidden states, evaluate it and save it to --out."""
    eval_dtype = models.parse_dtype(args.eval_dtype)
    out = Path(args.out)
    head = featurehead.init_from_target(target, vocab)
    if refs and "eval_init" not in work.state:
        work.state["eval_init"] = distill_features.evaluate(head, target, refs)
        work.save()
    report["eval_init"] = work.state.get("eval_init", {})
    report["train"] = distill_features.phase_train(args, work, head, examples, feats, train_seconds)
    if refs:
        report["eval"] = distill_features.evaluate(head.to(eval_dtype), target, refs)
    head_from = featurehead.target_head_name(checkpoints.materialize(args.target))
    head_sha = draftlm.tensor_sha256(draftlm.read_target_tensor(checkpoints.materialize(args.target), head_from))
    meta = {"target": args.target, "seed": args.seed, "head_sha256": head_sha}
    featurehead.save(head, out, meta, models.parse_dtype(args.save_dtype), head_from)
    return head


def _train_layers(
    args: argparse.Namespace,
    work: Work,
    target: Any,
    vocab: torch.Tensor,
    refs: list[Any],
    examples: list[Any],
    report: dict[str, Any],
    train_seconds: float,
) -> Any:
    """Train a small LM from some of the target's layers, evaluate it and save it to --out."""
    eval_dtype = models.parse_dtype(args.eval_dtype)
    out = Path(args.out)
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
    return student


def _write_report(
    args: argparse.Namespace,
    work: Work,
    report: dict[str, Any],
    refs: list[Any],
    vocab: torch.Tensor,
    student: Any,
    target: Any,
    tok: Any,
    phases_before: float,
    wall: float,
) -> None:
    """Measure the drafter's step, then write the tokenizer, the model card and distill.json beside it."""
    eval_dtype = models.parse_dtype(args.eval_dtype)
    out = Path(args.out)
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
