"""Structured output: a JSON Schema or a grammar compiled by llguidance into a token mask at every position.

A sequence's constraint travels as JSON Schema text (`SequenceSpec.json_schema`; OpenAI's
`json_object` is `{"type": "object"}`) or as an llguidance grammar (`SequenceSpec.grammar`:
vLLM's guided_regex and guided_choice, built by `regex_grammar` and `choice_grammar`); each
service compiles it against its own tokenizer with the same options, so the drafter's and
the verifier's masks agree. The constraint
covers the generated tokens only, never the prompt. End-of-sequence is allowed exactly
when the grammar accepts what was generated, and is then the only token left once nothing
can follow (a closed top-level object).

The verifier masks the target's logits at every verified position (`masks_along`: row j
is what may follow the output plus drafts[:j]), so p is the constrained distribution and
the exact rules sample from it unchanged; it then commits the accepted drafts and the
next token (`commit`). The model drafter masks its own logits the same way
(`sync`, then `allowed` and `push` per draft step). No torch on the wire, no gRPC here.

Why llguidance and not xgrammar: see docs/benchmarks.md ("Grammar engine").
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance

from specd.engine.prefix import common_prefix

# The services' tokenizer and mask code imports llguidance.hf (transformers), numpy and torch
# where it runs: the gateway imports this module only to validate grammars, and must not import torch.
if TYPE_CHECKING:
    import torch

# Fixed separators and no free whitespace: a model cannot pad the JSON forever, and the
# output looks like json.dumps'. Both services must compile with these same options.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# OpenAI's response_format {"type": "json_object"}: any JSON object.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


log = logging.getLogger(__name__)


_SOURCE_PATH = re.compile(r"(?:[\w.~-]*/)+[\w.-]+\.rs(?::\d+)*")


def one_line(message: str, limit: int = 300) -> str:
    """An engine's error as a client may see it: its first line, cut short. llguidance can put a
    native panic's backtrace, with the paths it was built from, after it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0]
    if "panicked at" in first:  # the panic's message is on the line after its source location
        first = "the grammar engine failed: " + (lines[1] if len(lines) > 1 else "panic")
    first = _SOURCE_PATH.sub("<source>", first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


class GrammarError(ValueError):
    """A schema llguidance cannot compile, or tokens the grammar does not allow."""


def canonical(schema: Mapping[str, Any] | bool) -> str:
    """The wire form of a schema: compact JSON text, keys in the client's order (properties
    are generated in the order the schema lists them, as OpenAI's strict mode does)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def compile_text(schema_text: str = "", grammar: str = "") -> str:
    """The llguidance grammar of a JSON Schema's text, or `grammar` as is."""
    return _grammar(schema_text) if schema_text else grammar


def dry_run_problem(matcher: llguidance.LLMatcher) -> str | None:
    """Why a freshly compiled matcher can never produce an output (its first mask in error, or
    empty where the empty output is not accepted either), or None."""
    if not matcher.is_error():
        mask = matcher.compute_bitmask()
        if not matcher.is_error() and (any(mask) or matcher.is_accepting()):
            return None
    return one_line(matcher.get_error()) or "no output can ever satisfy it"


def _grammar(schema_text: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from None


def regex_grammar(pattern: str) -> str:
    """The grammar whose output is a full match of `pattern` (llguidance builds it: it knows
    how its Lark dialect quotes a regex)."""
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Sequence[str]) -> str:
    """The Lark grammar whose output is exactly one of `choices`: an alternation of string
    literals, quoted as JSON strings (which llguidance's Lark dialect reads)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_problem(grammar: str) -> str | None:
    """Why llguidance cannot compile `grammar`, or None."""
    try:
        return one_line(llguidance.LLMatcher.validate_grammar(grammar)) or None
    except (ValueError, TypeError) as exc:
        return one_line(str(exc))


def schema_problem(schema_text: str) -> str | None:
    """Why llguidance cannot compile `schema_text`, or None (no tokenizer needed: the gateway's check)."""
    try:
        grammar = _grammar(schema_text)
    except GrammarError as exc:
        return str(exc)
    return one_line(llguidance.LLMatcher.validate_grammar(grammar)) or None


class GrammarCompiler:
    """One per service: the tokenizer's byte-level view, built once (about 0.6 s for 49k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_token_ids: Sequence[int] = ()) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos = int(tokenizer.eos_token_id)
        # Every end id (specd.engine.end_tokens) is handled by GrammarMatcher, never by llguidance.
        self.ends = frozenset(map(int, end_token_ids)) | {self.eos}
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos)

    def matcher(self, schema_text: str = "", grammar: str = "", ends: frozenset[int] | None = None) -> GrammarMatcher:
        """The matcher of a JSON Schema or of an llguidance grammar (exactly one of them).
        `ends`: the sequence's end ids (the target's, sent by the gateway); default this service's."""
        if bool(schema_text) == bool(grammar):
            raise GrammarError("give exactly one of a JSON schema and a grammar")
        what = "JSON schema" if schema_text else "grammar"
        m = llguidance.LLMatcher(self._tokenizer, _grammar(schema_text) if schema_text else grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"cannot compile the {what}: {one_line(m.get_error())}")
        return GrammarMatcher(m, self.vocab_size, self.ends if ends is None else ends, self.eos)


def grammar_compiler(tokenizer: Any, vocab_size: int, end_token_ids: Sequence[int] = ()) -> GrammarCompiler | None:
    """The service's grammar engine, or None (with a warning) if its tokenizer does not fit the
    model's vocabulary: the service still serves, and refuses constrained sequences.
    `end_token_ids`: the model's end ids (specd.engine.end_tokens); the tokenizer's eos is always one."""
    try:
        return GrammarCompiler(tokenizer, vocab_size, end_token_ids)
    except Exception as exc:
        log.warning("structured output is off: no grammar engine for this tokenizer (%s)", exc)
        return None


class GrammarMatcher:
    """The grammar state of one sequence, following the tokens it consumed (`tokens`).

    End-of-sequence is kept here, not in llguidance: each end id is allowed exactly where the
    grammar accepts, ends the output, and whatever follows it (a verifier's bonus token after an
    accepted EOS draft) is never output, so it is recorded but constrains nothing.
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, ends: frozenset[int], eos: int | None = None
    ) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.ends = ends
        self._end_index = sorted(ends)
        # llguidance allows its tokenizer's eos where the grammar accepts; where that id does not
        # end this sequence (a drafter's own eos, not among the target's ends) it is masked.
        self._foreign_eos = eos if eos is not None and eos not in ends and eos < vocab_size else None
        self.tokens: list[int] = []
        # Index in `tokens` of the EOS that ended the output, if any.
        self._ended_at: int | None = None

    @property
    def ended(self) -> bool:
        return self._ended_at is not None

    def _in_grammar(self) -> int:
        """How many of `tokens` llguidance has consumed."""
        return len(self.tokens) if self._ended_at is None else self._ended_at

    def allowed(self) -> torch.Tensor:
        """Bool [V]: the tokens that may come next (EOS only where the grammar accepts; nothing after EOS)."""
        import numpy as np
        import torch

        if self.ended:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        if self._m.is_error():
            raise GrammarError(one_line(self._m.get_error()))
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        out = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(np.bool_))
        out[[e for e in self._end_index if e < self.vocab_size]] = self._m.is_accepting()
        if self._foreign_eos is not None:
            out[self._foreign_eos] = False
        return out

    def push(self, tokens: Sequence[int]) -> None:
        for t in map(int, tokens):
            if self.ended:
                pass  # after EOS: never output
            elif t in self.ends:
                if not self._m.is_accepting():
                    raise GrammarError("end-of-sequence is not allowed before the output is complete")
                self._ended_at = len(self.tokens)
            elif not self._m.consume_token(t):
                raise GrammarError(f"token {t} is not allowed here: {one_line(self._m.get_error())}")
            self.tokens.append(t)

    def pop(self, n: int) -> None:
        if n <= 0:
            return
        before = self._in_grammar()
        del self.tokens[-n:]
        if self._ended_at is not None and self._ended_at >= len(self.tokens):
            self._ended_at = None
        undo = before - self._in_grammar()
        if undo and not self._m.rollback(undo):
            raise GrammarError(f"cannot roll back {undo} tokens: {one_line(self._m.get_error())}")

    def sync(self, tokens: Sequence[int]) -> None:
        """Follow `tokens` (the output so far): keep the common prefix, roll back the rest, consume what is new."""
        n = common_prefix(self.tokens, tokens)
        self.pop(len(self.tokens) - n)
        self.push(tokens[n:])

    def masks_along(self, drafts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Bool [k + 1, V]: row j allows what may follow the output plus drafts[:j].

        Consumes the drafts as far as the grammar allows them and returns how many it
        consumed; `commit` settles the state once the verdict is known. A draft the
        grammar refuses gets p = 0 in its own row, so it is rejected there by every rule,
        and the rows after it are never used: they are left unconstrained.
        """
        import torch

        rows = torch.ones((len(drafts) + 1, self.vocab_size), dtype=torch.bool)
        consumed = 0
        for j in range(len(drafts) + 1):
            if self.ended:
                break  # rows after an EOS draft are never output
            rows[j] = self.allowed()
            if j == len(drafts) or not rows[j, drafts[j]]:
                break
            self.push([drafts[j]])
            consumed += 1
        return rows, consumed

    def commit(self, consumed: int, accepted: int, next_token: int) -> None:
        """After `masks_along` consumed `consumed` drafts: keep the `accepted` first, then `next_token`."""
        self.pop(consumed - accepted)
        self.push([next_token])


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] with every token the grammar refuses at -inf (a new tensor)."""
    if not bool(allowed.any(dim=-1).all()):
        raise GrammarError("the grammar allows no token at this position")
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
