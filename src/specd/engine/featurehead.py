"""A feature drafter: one decoder layer that reads the target's hidden states (EAGLE-style).

The target's last hidden state at a position (the input of its LM head) says far
more about the next tokens than the tokens themselves. The feature head drafts
from it: at position j it is fed token x_j and the target's hidden state at
position j - 1, fuses the two (`fc`), runs one decoder layer of the target's
architecture over its own KV cache, and returns a prediction of the target's
hidden state at position j; the target's own LM head rows (borrowed, over a
draft vocabulary) turn that into the next token's logits. Drafting further, it
feeds each drafted token beside its own predicted hidden state.

The verifier returns the hidden states of the positions it commits (`specd.features`
carries them); prompt positions are fed a zero feature by design (training does the
same), so only generated positions need them. A position whose hidden state has not
arrived yet (a block the verifier is still checking, an old verifier, a lost message)
is fed the head's own prediction, or zeros: drafts get worse, never wrong, since the
verifier's rule keeps the output exact.

`BatchedCausalLM` serves it like any causal LM: `base_model` takes `features`
beside `input_ids`, and `feature_size` tells it to pass them (`kvcache.Row.features`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specd.engine import draftlm
from specd.engine.draftlm import DraftVocabHead
from specd.engine.kvcache import cache_keyword

DESIGN = "feature-head"


class FeatureBase(nn.Module):
    """Token embedding and feature, fused, through one decoder layer: what `BatchedCausalLM` calls."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import AutoModel

        self.config = config
        hidden = int(config.hidden_size)
        # The target's embedding table and one decoder layer, final norm and rotary tables.
        self.body = AutoModel.from_config(config, attn_implementation="sdpa")
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)

    @property
    def cache_keyword(self) -> str:
        """The keyword the decoder body takes its KV cache by."""
        return cache_keyword(self.body)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor | None = None, **kwargs: Any) -> Any:
        embedded = self.body.embed_tokens(input_ids)
        if features is None:
            features = torch.zeros_like(embedded)
        fused = self.fc(torch.cat([embedded, features.to(embedded.dtype)], dim=-1))
        return self.body(inputs_embeds=fused, **kwargs)


class FeatureHeadLM(nn.Module):
    """The feature drafter as a causal LM: `config`, `base_model`, an LM head and `feature_size`."""

    def __init__(self, config: Any, draft_vocab: torch.Tensor, head_weight: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.base_model = FeatureBase(config)
        self.lm_head = DraftVocabHead(int(config.hidden_size), draft_vocab, int(config.vocab_size))
        with torch.no_grad():
            self.lm_head.weight.copy_(head_weight[self.lm_head.draft_vocab].float())
        # The LM head is the target's: frozen, borrowed at load time, never stored.
        self.lm_head.weight.requires_grad_(False)
        self.feature_size = int(config.hidden_size)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.base_model.body.embed_tokens

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Predicted target hidden states [batch, length, hidden] (training; serving goes through base_model)."""
        return self.base_model(input_ids=input_ids, features=features, **kwargs).last_hidden_state


def head_config(target_config: Any) -> Any:
    """The target's config with one decoder layer."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[-1:]
    config.tie_word_embeddings = False
    return config


def init_from_target(target: Any, draft_vocab: torch.Tensor) -> FeatureHeadLM:
    """A feature head initialised from the target: its last decoder layer, final norm, embedding and
    LM head rows; `fc` starts as the mean of token embedding and feature."""
    config = head_config(target.config)
    model = FeatureHeadLM(config, draft_vocab, target.get_output_embeddings().weight.detach())
    body = model.base_model.body
    with torch.no_grad():
        body.embed_tokens.weight.copy_(target.get_input_embeddings().weight.detach().float())
        body.layers[0].load_state_dict({k: v.float() for k, v in target.model.layers[-1].state_dict().items()})
        body.norm.load_state_dict({k: v.float() for k, v in target.model.norm.state_dict().items()})
        hidden = int(config.hidden_size)
        model.base_model.fc.weight.zero_()
        model.base_model.fc.bias.zero_()
        model.base_model.fc.weight[:, :hidden] = 0.5 * torch.eye(hidden)
        model.base_model.fc.weight[:, hidden:] = 0.5 * torch.eye(hidden)
    body.embed_tokens.weight.requires_grad_(False)
    if hasattr(body.layers[0], "self_attn") and hasattr(body.layers[0].self_attn, "layer_idx"):
        body.layers[0].self_attn.layer_idx = 0
    return model.float()


# -- the drafter's per-sequence feature state ---------------------------------------------


@dataclass
class FeatureTrack:
    """What a drafter knows of one sequence's target hidden states, by position.

    `real[p]` is the target's hidden state at position p (from the verifier);
    `predicted[p]` the head's own prediction of it (from a drafting step). Feeding
    position j needs the hidden state at j - 1; positions before `prompt_len`
    are fed zeros by design. `fed_right` counts the leading cached positions fed
    with their real feature: a cached position past it is worth feeding again
    once its real feature arrives.
    """

    prompt_len: int
    real: dict[int, torch.Tensor] = field(default_factory=dict)
    predicted: dict[int, torch.Tensor] = field(default_factory=dict)
    fed_right: int = 0

    def add_real(self, start: int, rows: torch.Tensor) -> None:
        for j in range(rows.shape[0]):
            self.real[start + j] = rows[j]
            self.predicted.pop(start + j, None)

    def feature_for(self, position: int) -> tuple[torch.Tensor | None, bool]:
        """The feature to feed at `position` (None: zeros) and whether it is the right one."""
        if position < self.prompt_len:
            return None, True
        real = self.real.get(position - 1)
        if real is not None:
            return real, True
        return self.predicted.get(position - 1), False

    def right_prefix(self, cached: int) -> int:
        return max(self.fed_right, min(cached, self.prompt_len))

    def keep(self, confirmed: int, cached: int) -> int:
        """How much of a cache whose first `confirmed` positions the tokens confirm to keep: up to the
        first position fed without its real feature, if that feature has arrived since."""
        right = self.right_prefix(cached)
        if right < confirmed and self.feature_for(right)[1]:
            return right
        return confirmed

    def features(self, start: int, count: int) -> tuple[torch.Tensor | None, int]:
        """Features for positions start..start+count-1 ([count, H], or None when all are zeros), and how
        many leading ones are right."""
        rows = [self.feature_for(start + j) for j in range(count)]
        right = self.right_count(start, count)
        if all(f is None for f, _ in rows):
            return None, right
        width = next(f for f, _ in rows if f is not None).shape[-1]
        out = torch.zeros((count, width), dtype=next(f for f, _ in rows if f is not None).dtype)
        for j, (f, _) in enumerate(rows):
            if f is not None:
                out[j] = f
        return out, right

    def right_count(self, start: int, count: int) -> int:
        """How many leading positions of start..start+count-1 have their real feature."""
        right = 0
        while right < count and self.feature_for(start + right)[1]:
            right += 1
        return right

    def fed(self, start: int, count: int, right: int) -> None:
        """Positions start..start+count-1 were fed, the first `right` of them with their real feature."""
        if start <= self.right_prefix(start):
            self.fed_right = start + right
        # Features before the right prefix are fed already and not needed again.
        for p in [p for p in self.real if p < self.fed_right - 1]:
            del self.real[p]
        for p in [p for p in self.predicted if p < self.fed_right - 1]:
            del self.predicted[p]


# -- storage ------------------------------------------------------------------------------

EMBEDDING = "base_model.body.embed_tokens.weight"
HEAD = "lm_head.weight"
TARGET_HEAD = "lm_head.weight"


def target_head_name(model_dir: Path) -> str:
    """The target tensor its LM head reads: its own head, or the input embedding it is tied to."""
    try:
        draftlm.read_target_tensor(model_dir, TARGET_HEAD)
    except KeyError:
        return draftlm.EMBEDDING_KEY
    return TARGET_HEAD


def save(model: FeatureHeadLM, path: Path, meta: dict[str, Any], dtype: torch.dtype, head_from: str) -> None:
    """Write config, trained weights (in `dtype`) and manifest; the embedding and LM head stay the
    target's, named with their SHA-256 so a different target is refused at load time."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    tensors = {"draft_vocab": model.lm_head.draft_vocab.to(torch.int32).contiguous()}
    for name, t in model.state_dict().items():
        if name not in (EMBEDDING, HEAD, "lm_head.draft_vocab") and t.is_floating_point():
            tensors[name] = t.detach().to(dtype).contiguous()
    save_file(tensors, str(path / draftlm.WEIGHTS), metadata={"format": "pt"})
    info = {"format": draftlm.FORMAT, "version": draftlm.VERSION, "design": DESIGN, **meta}
    info["draft_vocab_size"] = int(model.lm_head.draft_size)
    info["target_vocab_size"] = int(model.config.vocab_size)
    info["feature_size"] = model.feature_size
    info["embedding"] = {"from": meta["target"], "sha256": draftlm.tensor_sha256(model.get_input_embeddings().weight)}
    info["head"] = {"from": meta["target"], "tensor": head_from, "sha256": meta["head_sha256"]}
    (path / draftlm.MANIFEST).write_text(json.dumps(info, indent=2) + "\n")


def load(path: Path, info: dict[str, Any], dtype: torch.dtype, materialize: Any) -> FeatureHeadLM:
    """A feature head from its directory; `materialize(spec)` resolves the target it borrows from."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    tensors = load_file(str(path / draftlm.WEIGHTS))
    draft_vocab = tensors.pop("draft_vocab").long()
    target_dir = Path(materialize(info["embedding"]["from"]))
    borrowed = {}
    for key, spec in (("embedding", info["embedding"]), ("head", info["head"])):
        tensor = draftlm.read_target_tensor(target_dir, spec.get("tensor", draftlm.EMBEDDING_KEY))
        if draftlm.tensor_sha256(tensor) != spec["sha256"]:
            raise ValueError(
                f"{path} borrows the {key} of {spec['from']!r}, but that model's is not the one it was trained with"
            )
        borrowed[key] = tensor
    model = FeatureHeadLM(config, draft_vocab, borrowed["head"])
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(borrowed["embedding"].float())
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    missing = [m for m in missing if m not in (EMBEDDING, HEAD, "lm_head.draft_vocab") and "rotary" not in m]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit the config (missing {missing}, unexpected {unexpected})")
    model.to(dtype)
    model.eval()
    return model
