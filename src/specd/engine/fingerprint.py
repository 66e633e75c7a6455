"""Tokenizer identity: a draft with another tokenizer must be refused, not run.

A drafter whose ids mean other strings than the verifier's proposes tokens the
target rejects nearly always (or, worse, a mismatched gateway decodes garbage),
so every service reports this fingerprint and the gateway compares them.
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
        return cls(len(vocab), hashlib.sha256(canonical.encode()).hexdigest(), special, ends)

    def differences(self, other: TokenizerFingerprint) -> list[str]:
        """Human-readable differences from `other`; empty when they match."""
        diffs = []
        if self.vocab_size != other.vocab_size:
            diffs.append(f"vocab size {self.vocab_size} != {other.vocab_size}")
        if self.vocab_sha256 != other.vocab_sha256:
            diffs.append(f"vocabulary hash {self.vocab_sha256[:12]} != {other.vocab_sha256[:12]}")
        for role in sorted(set(self.special_token_ids) | set(other.special_token_ids)):
            a, b = self.special_token_ids.get(role), other.special_token_ids.get(role)
            if a != b:
                diffs.append(f"{role} token id {a} != {b}")
        if self.end_token_ids != other.end_token_ids:
            diffs.append(f"end token ids {list(self.end_token_ids)} != {list(other.end_token_ids)}")
        return diffs
