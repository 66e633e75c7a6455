"""Tokenizer identity: a draft with another tokenizer must be refused, not run.

A drafter whose ids mean other strings than the verifier's proposes tokens the
target rejects nearly always (or, worse, a mismatched gateway decodes garbage),
so every service reports this fingerprint and the gateway compares them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

SPECIAL_ROLES = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class TokenizerFingerprint:
    vocab_size: int
    vocab_sha256: str
    special_token_ids: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerFingerprint:
        vocab = tokenizer.get_vocab()
        canonical = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
        special = {}
        for role in SPECIAL_ROLES:
            tid = getattr(tokenizer, f"{role}_token_id", None)
            if tid is not None:
                special[role] = int(tid)
        return cls(len(vocab), hashlib.sha256(canonical.encode()).hexdigest(), special)

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
        return diffs
