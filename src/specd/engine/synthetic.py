"""`--load-format synthetic`: weights made, not loaded, for a target and a drafter whose greedy
tokens agree at a set rate.

Every weight of the config.json's shape is made on the device at its real size, and every kernel
runs as it would with a checkpoint's weights, so a step costs what the real model's does; only the
text is meaningless. The construction:

- the input embeddings are random directions, and each layer's output projections (o_proj and
  down_proj) are scaled down so far that the residual stream still points along the current
  token's embedding after the last layer: the layers' work is done, but does not move the argmax;
- the LM head maps each token to a fixed successor: its row for token v sums the embedding
  directions of the tokens whose successor v is, scaled so that at temperature 1 the successor
  has about SUCCESSOR_PROB of the probability (less where the hidden size is tiny, as random
  directions are then less orthogonal);
- the successors form one cycle through the vocabulary from the seed (end tokens and ids past the
  tokenizer's left out, so a greedy request neither stops early nor emits an id the tokenizer
  lacks), so a greedy sequence visits every token before it repeats one;
- a drafter built from the same seed with agreement α names the target's successor for a random
  fraction α of the cycle's tokens (from the seed) and another token's successor for the rest (one
  disagreeing token alone keeps the target's: there is no other to swap with).

The target is the drafter with agreement 1. Both models only need the same seed and tokenizer:
their hidden sizes and depths may differ. Tied embeddings are untied, as one matrix cannot both
place a token and name its successor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from specd.engine.checkpoints import ModelLoadError

log = logging.getLogger(__name__)

# The successor's nominal probability at temperature 1: sampled requests then mostly follow the
# chain, and a sampled draft is accepted about as often as a greedy one, a little less.
SUCCESSOR_PROB = 0.9
# How far o_proj and down_proj are scaled down: their outputs stay well above float16's smallest
# normal value, and summed over a 32-layer 8B body they move the residual stream a small fraction
# of the embedding's length.
OUTPUT_SCALE = 1e-2
# At load, a probe of PROBE_TOKENS tokens of the cycle: at least MIN_PROBE_AGREEMENT of them must
# have their constructed successor as argmax, or the construction does not hold for the
# architecture (layers whose outputs are renormalized to the embeddings' size, say).
PROBE_TOKENS = 64
MIN_PROBE_AGREEMENT = 0.98


@dataclass(frozen=True)
class SyntheticSpec:
    """What a synthetic model is made from: the seed both models share, and how often this one's
    successor is the target's (1 for the target itself)."""

    seed: int = 0
    agreement: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.agreement <= 1.0 or math.isnan(self.agreement):
            raise ValueError(f"--synthetic-agreement must be between 0 and 1, not {self.agreement!r}")
        if self.seed < 0:
            raise ValueError(f"--synthetic-seed must be >= 0, not {self.seed}")

    def describe(self) -> str:
        """How ModelInfo.weights and the logs name these weights."""
        if self.agreement == 1.0:
            return f"synthetic (seed {self.seed})"
        return f"synthetic (seed {self.seed}, agreement {self.agreement:g})"


def cycle(vocab_size: int, tokens: int, end_ids: Iterable[int], seed: int) -> torch.Tensor:
    """The order of the target's successor cycle: the ids below min(vocab_size, tokens) that end no
    sequence, shuffled by `seed`."""
    limit = min(vocab_size, tokens)
    members = torch.ones(limit, dtype=torch.bool)
    ends = [i for i in end_ids if 0 <= i < limit]
    members[ends] = False
    ids = members.nonzero().flatten()
    if len(ids) < 2:
        raise ModelLoadError(f"synthetic weights need at least 2 ordinary tokens, not {len(ids)}")
    generator = torch.Generator().manual_seed(seed)
    return ids[torch.randperm(len(ids), generator=generator)]


def successors(vocab_size: int, order: torch.Tensor, spec: SyntheticSpec) -> torch.Tensor:
    """The next token for every id below vocab_size (int64, on the CPU), as the model `spec`
    makes names it: the target's cycle where it agrees, another member of the cycle elsewhere."""
    length = len(order)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    position = torch.full((vocab_size,), -1, dtype=torch.int64)
    position[order] = torch.arange(length)
    # Ids outside the cycle (end tokens, padding rows) lead into it at a place the seed picks.
    outside = position < 0
    position[outside] = torch.randint(length, (int(outside.sum()),), generator=generator)
    nexts = order[(position + 1) % length]
    # Exactly round((1 - α) * length) members of the cycle disagree. They pass their successors
    # round among themselves, so every successor stays one token's: a head row that summed
    # several tokens' directions would compete with the others in a small hidden size.
    disagree = order[torch.randperm(length, generator=generator)[: round((1 - spec.agreement) * length)]]
    if len(disagree) >= 2:
        nexts[disagree] = nexts[disagree.roll(1)]
    return nexts


def logit_scale(cycle_length: int, hidden_size: int) -> float:
    """The successor's logit that gives it about SUCCESSOR_PROB at temperature 1. The other tokens'
    logits are about normal with variance scale² / hidden_size (random directions' overlaps), so
    their summed weight is about (cycle_length - 1) * exp(scale² / (2 * hidden_size)); scale solves
    scale - scale² / (2 * hidden_size) = logit(SUCCESSOR_PROB) + log(cycle_length - 1)."""
    wanted = math.log(SUCCESSOR_PROB / (1 - SUCCESSOR_PROB)) + math.log(max(cycle_length - 1, 1))
    if 2 * wanted >= hidden_size:
        return 2 * wanted  # no solution: as decisive as such a narrow model gets
    return hidden_size * (1 - math.sqrt(1 - 2 * wanted / hidden_size))


def make(model: Any, synthetic: SyntheticSpec, tokens: int, end_ids: Iterable[int]) -> Any:
    """`model`, built from its untied config (see `untie`) on its device, with synthetic weights;
    `tokens` is the tokenizer's length and `end_ids` the ids that end a sequence."""
    head = model.get_output_embeddings().weight
    order = cycle(head.shape[0], tokens, end_ids, synthetic.seed)
    nexts = successors(head.shape[0], order, synthetic)
    with torch.no_grad():
        shape(model, nexts.to(head.device), logit_scale(len(order), head.shape[1]))
    held = probe(model, order[:PROBE_TOKENS], nexts)
    if held < MIN_PROBE_AGREEMENT:
        raise ModelLoadError(
            f"synthetic weights do not hold for {model.config.model_type}: on a probe, {held:.0%} of the tokens' "
            "argmax is the constructed successor (its layers' outputs are not small beside the embeddings)"
        )
    log.info("synthetic weights: %.0f%% of a probe's argmax is the constructed successor", 100 * held)
    return model.eval()


def untie(config: Any) -> None:
    """One matrix cannot both place each token and name its successor: the head gets its own."""
    text = config.get_text_config()
    for c in {id(config): config, id(text): text}.values():
        if getattr(c, "tie_word_embeddings", False):
            log.info("synthetic weights: the LM head is untied from the input embeddings")
            c.tie_word_embeddings = False


def shape(model: Any, nexts: torch.Tensor, scale: float) -> None:
    """Embeddings, output projections and head as the module docstring says."""
    embed = model.get_input_embeddings().weight
    embed.normal_(0.0, 1.0)
    scaled = 0
    for name, module in model.named_modules():
        if name.endswith(("o_proj", "down_proj")) and isinstance(module, torch.nn.Linear):
            module.weight.mul_(OUTPUT_SCALE)
            scaled += 1
    if scaled == 0:
        raise ModelLoadError(f"synthetic weights need o_proj and down_proj layers; {type(model).__name__} has none")
    head = model.get_output_embeddings().weight
    if head.shape[0] != embed.shape[0]:
        raise ModelLoadError(
            f"synthetic weights need as many embeddings as head rows, not {embed.shape[0]} and {head.shape[0]}"
        )
    # The final norm leaves a row of length sqrt(hidden): this sets the successor's logit to `scale`.
    rows = torch.zeros(head.shape, dtype=torch.float32, device=head.device)
    rows.index_add_(0, nexts, torch.nn.functional.normalize(embed.float(), dim=1))
    head.copy_(rows.mul_(scale / math.sqrt(head.shape[1])))


def probe(model: Any, tokens: torch.Tensor, nexts: torch.Tensor) -> float:
    """The fraction of `tokens`, fed as one sequence, whose argmax is their constructed successor."""
    device = model.get_output_embeddings().weight.device
    with torch.inference_mode():
        logits = model(tokens.unsqueeze(0).to(device)).logits[0]
    return float((logits.argmax(-1).cpu() == nexts[tokens]).float().mean())
