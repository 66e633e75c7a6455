"""A distilled drafter: a shallow causal LM of the target's architecture with a truncated head.

`specd distill` (specd.tools.distill) writes such a drafter; the drafter service
serves it like any causal LM. A drafter directory holds:

- ``config.json``: the HF config of the shallow model (the target's, with fewer
  layers; ``vocab_size`` stays the target's, so every target id can be fed);
- ``model.safetensors``: its decoder layers, final norm, the draft head
  ``lm_head.weight`` [K, hidden] and ``draft_vocab`` [K], the target id of each head row;
  the input embedding too, unless it is borrowed from the target (below);
- ``specd_drafter.json``: what makes it a specd drafter: the format version, the draft
  vocabulary size and, when the embedding is borrowed, the target to read it from and
  the SHA-256 of its bytes (a different target is refused at load time);
- the target's tokenizer files, so the tokenizer fingerprint matches the verifier's.

The head scores only the K draft-vocabulary tokens and scatters them into a
target-sized row, every other token getting -inf: the drafter's distribution is
over target ids and gives probability 0 to tokens outside the draft vocabulary.
The verifier's rule keeps the output exact whatever the drafter proposes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specd.engine.checkpoints import MANIFEST

FORMAT = "specd-distilled-drafter"
VERSION = 2
# Version 2 added the feature-head design ("design": "feature-head", specd.engine.featurehead); a reader of
# version 1 would take such a directory for a shallow model, so it is refused there by its version.
SHALLOW_VERSION = 1
WEIGHTS = "model.safetensors"
EMBEDDING_KEY = "model.embed_tokens.weight"


class DraftVocabHead(nn.Module):
    """An LM head over K draft tokens whose logits come back indexed by target id.

    `draft_vocab[j]` is the target id of row j; ids must be distinct and below
    `out_features` (the target's vocabulary size). `forward` returns
    [..., out_features] logits with -inf outside the draft vocabulary;
    `draft_logits` returns the [..., K] scores themselves (training).
    """

    def __init__(self, hidden_size: int, draft_vocab: torch.Tensor, target_vocab_size: int) -> None:
        super().__init__()
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
        if draft_vocab.numel() == 0:
            raise ValueError("the draft vocabulary is empty")
        if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= target_vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {target_vocab_size})")
        if torch.unique(draft_vocab).numel() != draft_vocab.numel():
            raise ValueError("draft vocabulary ids must be distinct")
        self.in_features = hidden_size
        self.out_features = target_vocab_size
        self.weight = nn.Parameter(torch.zeros(draft_vocab.numel(), hidden_size))
        self.register_buffer("draft_vocab", draft_vocab)

    @property
    def draft_size(self) -> int:
        return int(self.draft_vocab.numel())

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.draft_logits(hidden)
        out = small.new_full((*small.shape[:-1], self.out_features), float("-inf"))
        out[..., self.draft_vocab] = small
        return out


def target_index(draft_vocab: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """[target_vocab_size] -> draft index of each target id, -1 outside the draft vocabulary."""
    index = torch.full((target_vocab_size,), -1, dtype=torch.long)
    index[draft_vocab.long()] = torch.arange(draft_vocab.numel())
    return index


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def read_target_tensor(model_dir: Path, name: str) -> torch.Tensor:
    """One tensor of a saved HF checkpoint, read without loading the model."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = [model_dir / json.loads(index.read_text())["weight_map"][name]]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                return f.get_tensor(name)
    raise KeyError(f"{name} is not in the safetensors files of {model_dir}")


def build_model(config: Any, draft_vocab: torch.Tensor, embedding: torch.Tensor | None = None) -> Any:
    """The shallow LlamaForCausalLM-like model with a DraftVocabHead (untrained weights)."""
    from transformers import AutoModelForCausalLM

    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.lm_head = DraftVocabHead(config.hidden_size, draft_vocab, config.vocab_size)
    if embedding is not None:
        model.get_input_embeddings().weight = nn.Parameter(embedding.float(), requires_grad=False)
    return model


def manifest(path: str | Path) -> dict[str, Any]:
    data = json.loads((Path(path) / MANIFEST).read_text())
    if data.get("format") != FORMAT or int(data.get("version", 0)) > VERSION:
        raise ValueError(f"{path}/{MANIFEST} is not a {FORMAT} manifest of version {VERSION} or below")
    return data


def save(model: Any, path: Path, meta: dict[str, Any], borrow_embedding: bool, dtype: torch.dtype) -> None:
    """Write the drafter's config, weights (in `dtype`) and manifest into `path` (tokenizer: the caller)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    config.num_hidden_layers = len(model.model.layers)
    config.tie_word_embeddings = False
    config.save_pretrained(path)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == EMBEDDING_KEY and borrow_embedding:
            continue
        if name == "lm_head.draft_vocab":
            tensors["draft_vocab"] = t.to(torch.int32).contiguous()
        elif t.is_floating_point():
            tensors[name] = t.detach().to(dtype).contiguous()
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    info = {"format": FORMAT, "version": SHALLOW_VERSION, **meta}
    info["draft_vocab_size"] = int(model.lm_head.draft_size)
    info["target_vocab_size"] = int(config.vocab_size)
    if borrow_embedding:
        info["embedding"] = {"from": meta["target"], "sha256": tensor_sha256(model.get_input_embeddings().weight)}
    (path / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")


def load(path: str | Path, dtype: torch.dtype, materialize: Any) -> Any:
    """Load a drafter directory as a causal LM; `materialize(spec)` resolves the target for a borrowed embedding."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    info = manifest(path)
    if info.get("design") == "feature-head":
        raise ValueError(f"{path} holds a feature head: load it with specd.engine.models.load_distilled")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    tensors = load_file(str(path / WEIGHTS))
    draft_vocab = tensors.pop("draft_vocab").long()
    embedding = tensors.pop(EMBEDDING_KEY, None)
    borrowed = info.get("embedding")
    if embedding is None:
        if not borrowed:
            raise ValueError(f"{path}: no input embedding in {WEIGHTS} and none borrowed in {MANIFEST}")
        target_dir = materialize(borrowed["from"])
        embedding = read_target_tensor(Path(target_dir), EMBEDDING_KEY)
        if tensor_sha256(embedding) != borrowed["sha256"]:
            raise ValueError(
                f"{path} borrows the input embedding of {borrowed['from']!r}, but that model's embedding "
                "is not the one it was trained with"
            )
    model = build_model(config, draft_vocab, embedding)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    missing = [m for m in missing if m not in (EMBEDDING_KEY, "lm_head.draft_vocab") and "rotary" not in m]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit the config (missing {missing}, unexpected {unexpected})")
    model.to(dtype)
    model.eval()
    return model
