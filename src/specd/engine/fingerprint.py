"""Tokenizer identity: a draft with another tokenizer must be refused, not run.

A drafter whose ids mean other strings than the verifier's proposes tokens the
target rejects nearly always (or, worse, a mismatched gateway decodes garbage),
so every service reports this fingerprint and the gateway compares them.

What a drafter must share with its target is the vocabulary: the ids, their strings, and which
of them are special (no text spells those; the grammars and the chat template treat them apart).
Which ids a model's configuration names eos or lists as ends may differ: an instruct target's
generation_config.json lists more end ids than its base drafter's. The target's are the ones that
count (the gateway sends them to the drafter with each sequence), so those differences are told,
not refused (`vocabulary_differences` against `config_differences`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SPECIAL_ROLES = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class TokenizerFingerprint:
    vocab_size: int
    vocab_sha256: str
    special_token_ids: dict[str, int] = field(default_factory=dict)
    # Every id that ends a sequence (specd.engine.end_tokens), ascending: a drafter that stopped
    # elsewhere would draft past the target's end, and the grammars would disagree.
    end_token_ids: tuple[int, ...] = ()
    # Every id the tokenizer treats as special, ascending.
    special_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer: Any, end_token_ids: Iterable[int] | None = None) -> TokenizerFingerprint:
        """`end_token_ids`: specd.engine.end_tokens.end_token_ids of the model; default the tokenizer's eos alone."""
        vocab = tokenizer.get_vocab()
        canonical = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
        special = {}
        for role in SPECIAL_ROLES:
            tid = getattr(tokenizer, f"{role}_token_id", None)
            if tid is not None:
                special[role] = int(tid)
        if end_token_ids is None:
            end_token_ids = [special["eos"]] if "eos" in special else []
        ends = tuple(sorted(set(map(int, end_token_ids))))
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        return cls(len(vocab), digest, special, ends, special_ids(tokenizer))

    def differences(self, other: TokenizerFingerprint) -> list[str]:
        """Human-readable differences from `other`; empty when they match."""
        return self.vocabulary_differences(other) + self.config_differences(other)

    def vocabulary_differences(self, other: TokenizerFingerprint) -> list[str]:
        """How the vocabularies differ (ids, strings, which are special): what a drafter must share."""
        diffs = []
        if self.vocab_size != other.vocab_size:
            diffs.append(f"vocab size {self.vocab_size} != {other.vocab_size}")
        if self.vocab_sha256 != other.vocab_sha256:
            diffs.append(f"vocabulary hash {self.vocab_sha256[:12]} != {other.vocab_sha256[:12]}")
        if self.special_ids != other.special_ids:
            only = sorted(set(self.special_ids) - set(other.special_ids))
            missing = sorted(set(other.special_ids) - set(self.special_ids))
            diffs.append(f"special ids: {_few(only)} only here, {_few(missing)} only there")
        return diffs

    def config_differences(self, other: TokenizerFingerprint) -> list[str]:
        """How the configured roles and end ids differ: the target's count, so a drafter's may differ."""
        diffs = []
        for role in sorted(set(self.special_token_ids) | set(other.special_token_ids)):
            a, b = self.special_token_ids.get(role), other.special_token_ids.get(role)
            if a != b:
                diffs.append(f"{role} token id {a} != {b}")
        if self.end_token_ids != other.end_token_ids:
            diffs.append(f"end token ids {list(self.end_token_ids)} != {list(other.end_token_ids)}")
        return diffs


def special_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids `tokenizer` treats as special, ascending: its added tokens marked special. Not the
    ids its configuration gives roles (eos, pad): those are configuration, compared apart."""
    return tuple(sorted(int(i) for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special))


def _few(ids: list[int], shown: int = 8) -> str:
    if not ids:
        return "none"
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return "[" + ", ".join(map(str, ids[:shown])) + "]" + more
