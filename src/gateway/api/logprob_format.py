"""The target's logprobs in the shapes clients parse: OpenAI chat, OpenAI completions, gRPC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specd.engine.params import TokenLogprob
from specd.proto.speculative.v1 import gateway_pb2


class TokenTexts:
    """Each token's text on its own, as logprobs entries name tokens (cached: a few repeat a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_content(lps: Sequence[TokenLogprob], text: TokenTexts) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` of a chat completion (or of one streamed chunk)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [
        {
            **entry(lp.token_id, lp.logprob),
            "top_logprobs": [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)],
        }
        for lp in lps
    ]


def completion_logprobs(
    lps: Sequence[TokenLogprob], text: TokenTexts, offset: int = 0, unscored_first: int | None = None
) -> dict[str, list[Any]]:
    """`choices[].logprobs` of a legacy completion (or of one streamed chunk).

    `unscored_first`: an echoed prompt's first token, which nothing before it scores
    (null logprob, as OpenAI's echo). Text offsets count from `offset` characters into
    the choice's whole text.
    """
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        nonlocal offset
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(token)

    if unscored_first is not None:
        add(text(unscored_first), None, None)
    for lp in lps:
        # OpenAI: the chosen token is always among them, so up to logprobs + 1 entries.
        top = {text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        top[text(lp.token_id)] = lp.logprob
        add(text(lp.token_id), lp.logprob, top)
    return out


def grpc_logprobs(lps: Sequence[TokenLogprob], text: TokenTexts) -> list[gateway_pb2.GeneratedTokenLogprob]:
    return [
        gateway_pb2.GeneratedTokenLogprob(
            token_id=lp.token_id,
            token=text(lp.token_id),
            logprob=lp.logprob,
            top=[
                gateway_pb2.GeneratedTokenAlternative(token_id=t, token=text(t), logprob=v)
                for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ],
        )
        for lp in lps
    ]
