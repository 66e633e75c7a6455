"""`specd up --drafter`: which drafter service each choice starts, and what auto picks and why."""

from __future__ import annotations

# `specd up --drafter` choices that run no model: the drafter service's own --drafter names.
MODEL_FREE = ("ngram", "suffix")


def auto_drafter(draft_model: str | None, target: str, device: str) -> tuple[str, str]:
    """What `--drafter auto` runs, and why (said at start-up)."""
    from specd.engine.checkpoints import EMBEDDED_DRAFTER

    if draft_model == EMBEDDED_DRAFTER:
        return "distilled", "the distilled drafter was named"
    if draft_model in (None, target) and device == "cpu":
        return "suffix", (
            "on the CPU the model drafter would be the target itself (its weights, its kernel), so a draft "
            "would cost a target step; the model-free suffix drafter drafts for almost nothing"
        )
    # The shipped distilled drafter (a feature head) agrees with the target on about a third of
    # held-out greedy tokens (src/specd/data/smollm2-135m-drafter/README.md), too few to beat the quantized
    # copy: auto keeps the copy until a distilled drafter reaches the 0.70.
    named = "the draft model named" if draft_model not in (None, target) else f"a copy of the target on {device}"
    return "model", named


def resolve_drafter(
    choice: str, draft_model: str | None, target: str, quantize: str, device: str = "cpu"
) -> tuple[str, str, str]:
    """`specd up --drafter` -> (kind, drafter service --model, --quantize)."""
    from specd.engine.checkpoints import EMBEDDED, EMBEDDED_DRAFTER

    if choice == "auto":
        choice = auto_drafter(draft_model, target, device)[0]
    if choice == "distilled":
        if draft_model is None and target != EMBEDDED:
            raise SystemExit("specd up: --drafter distilled needs --draft-model DIR (from specd distill) here")
        return "distilled", draft_model or EMBEDDED_DRAFTER, "none"
    if choice in ("int8", "int4"):
        return choice, draft_model or target, choice
    return choice, draft_model or target, quantize
