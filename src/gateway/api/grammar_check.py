"""Constraints fail at the door: each JSON schema, regex, choice list or grammar is compiled
against the gateway's tokenizer and dry-run (its first token mask) at admission, and a JSON
schema that only infinitely nested values satisfy is found (`finite_schema`), so one that can
never match is a 400 with one line, not a failure in the round. No torch here."""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

from gateway.api.finite_schema import never_finite
from gateway.api.validation import InvalidParameter, RequestedParams
from gateway.round.scheduler import GenerationParams
from specd.engine.grammar import compile_text, dry_run_problem, one_line


class GrammarCheck:
    def __init__(self, tokenizer: Any) -> None:
        import llguidance.hf  # transformers, not torch: built once per tokenizer

        eos = tokenizer.eos_token_id
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos)

    def problem(self, schema_text: str = "", grammar: str = "") -> str | None:
        """Why the constraint can never match, or None."""
        if schema_text:
            endless = never_finite(json.loads(schema_text))
            if endless:
                return endless
        try:
            matcher = llguidance.LLMatcher(self._tokenizer, compile_text(schema_text, grammar), log_level=0)
        except (ValueError, TypeError) as exc:
            return one_line(str(exc))
        return dry_run_problem(matcher)


@functools.lru_cache(maxsize=4)
def grammar_check(tokenizer: Any) -> GrammarCheck:
    return GrammarCheck(tokenizer)


def check_constraint(tokenizer: Any, params: GenerationParams, raw: RequestedParams) -> None:
    """Raise InvalidParameter, naming the request's constraint, if it can never match."""
    if not params.json_schema and not params.grammar:
        return
    given = [n for n in ("guided_regex", "guided_choice") if getattr(raw, n) is not None]
    param = given[0] if given else "response_format" if params.json_schema else "tool_choice"
    problem = grammar_check(tokenizer).problem(params.json_schema, params.grammar)
    if problem:
        raise InvalidParameter(param, f"{param} can never be satisfied: {problem}")
