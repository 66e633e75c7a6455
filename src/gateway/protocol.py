"""OpenAI-compatible request bodies (the subset specd serves) and their checks."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.scheduler import GenerationParams
from specd.sampling import SamplingParams

NonNegFloat = Annotated[float, Field(ge=0.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    # Strict: "5" is not an int here, as in OpenAI's API; unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: NonNegFloat | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # specd extension: draft tokens per round for this request (0 = target-only), or
    # "auto" for adaptive speculation; absent follows the gateway's --speculative-mode.
    num_speculative_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    # specd extension: how drafting is scheduled against the verifier for this request;
    # absent follows the gateway's --pipeline.
    pipeline: Literal["sequential", "cohort", "ahead"] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    def generation_params(self) -> GenerationParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        return GenerationParams(
            max_tokens=self.max_tokens,
            sampling=SamplingParams(
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=top_k,
                seed=self.seed,
            ),
            stop=stop,
            ignore_eos=self.ignore_eos,
            speculation=self.num_speculative_tokens,
            pipeline=self.pipeline,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("batched prompts are not supported: send one prompt per request")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def generation_params(self) -> GenerationParams:
        params = super().generation_params()
        if self.max_completion_tokens is not None and self.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.max_completion_tokens)
        return params
