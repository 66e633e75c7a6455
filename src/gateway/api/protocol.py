"""OpenAI-compatible request bodies and what specd does with each of their fields.

Every field of OpenAI's request schemas is one of: implemented (declared with its type
here, its range checked by gateway.api.validation), refused with a 400 naming it unless it
has its neutral value (REFUSED), or accepted and ignored for a stated reason (IGNORED,
also in docs/api.md). Anything else is an unknown parameter and gets a 400 naming it too: a
misspelt `temprature` must not silently sample at temperature 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from gateway.api.tool_calls import ToolChoice, tool_choice
from gateway.api.validation import InvalidParameter, RequestedParams, generation_params
from gateway.round.scheduler import GenerationParams
from specd.engine.ranges import MAX_MESSAGES

# Refused unless absent, null, or the neutral value listed; the reason is in the 400.
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("deprecated by OpenAI for tools, which specd implements", ([],)),
    "function_call": ("deprecated by OpenAI for tool_choice, which specd implements", ("none",)),
    "audio": ("audio output is not implemented", ()),
    "modalities": ('only text output is implemented: ["text"]', (["text"],)),
    "prediction": ("predicted outputs are not implemented", ()),
    "reasoning_effort": ("the served model has no reasoning mode", ()),
    "verbosity": ("the served model has no verbosity control", ()),
    "web_search_options": ("web search is not implemented", ()),
    "moderation": ("moderation is not implemented; nothing would be screened", ()),
    "suffix": ("insertion (suffix) is not implemented", ("",)),
}

# Accepted and ignored, because ignoring them changes nothing a client can rely on.
IGNORED: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; specd has none",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring; specd has none",
    "metadata": "tags for stored completions; specd stores none",
    "store": "specd stores no completions, so there is nothing to retrieve later",
    "service_tier": "specd has one tier",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; specd has no cross-request cache",
    "prompt_cache_retention": "specd has no cross-request prompt cache",
    "prompt_cache_options": "specd has no cross-request prompt cache",
    "stream_options.include_obfuscation": "specd does not pad stream chunks, so there is nothing to turn off",
}


# apply_chat_template's own arguments, which chat_template_kwargs may not override.
TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # IGNORED


class _Request(BaseModel):
    # Strict: "5" is not an int here, as in OpenAI's API. Unknown fields are refused.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # vLLM's extension (HF's min-p sampling).
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extension: HF's repetition penalty.
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # specd extension: draft tokens per round for this request (0 = target-only), or
    # "auto" for adaptive speculation; absent follows the gateway's --speculative-mode.
    num_speculative_tokens: int | Literal["auto"] | None = None
    # specd extension: how drafting is scheduled against the verifier for this request
    # (validated with the other parameters); absent follows the gateway's --pipeline.
    pipeline: str | None = None
    # specd extension: the most siblings (alternative drafts, a token tree) beside each block's
    # chain for this request; absent follows the gateway's --speculative-siblings.
    speculative_siblings: int | None = None
    # specd extension: the most branches (blocks drafted after other likely verdicts) beside each
    # draft-ahead block for this request; absent follows the gateway's --speculative-branches.
    speculative_branches: int | None = None
    # vLLM's structured-output extensions (checked by gateway.api.validation): the output is a
    # full match of this regular expression, or exactly one of these strings.
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's alias of response_format {"type": "json_schema"}: the schema (an object, or its JSON text).
    guided_json: dict[str, Any] | str | None = None
    # vLLM's: keep the text of special tokens; keep the stop string that ended the output;
    # suppress every end-of-sequence token until this many tokens were generated.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    # Accepted and ignored (IGNORED says why).
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    def refused(self) -> InvalidParameter | None:
        """The first refused parameter set to something other than its neutral value."""
        for name, (reason, neutral) in REFUSED.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                return InvalidParameter(name, f"{name} is not supported: {reason}", "unsupported_parameter")
        return None

    def requested(self) -> RequestedParams:
        return RequestedParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            speculation=self.num_speculative_tokens,
            pipeline=self.pipeline,
            siblings=self.speculative_siblings,
            branches=self.speculative_branches,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            n=self.n,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            response_format=self.guided_json_format(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens,
        )

    def guided_json_format(self) -> dict[str, Any] | None:
        """guided_json as the response_format it stands for; raises InvalidParameter."""
        schema = self.guided_json
        if schema is None:
            return None
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidParameter("guided_json", f"guided_json is not JSON text: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidParameter("guided_json", "guided_json must be a JSON Schema object")
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}

    def generation_params(self, vocab_size: int) -> GenerationParams:
        return generation_params(self.requested(), vocab_size)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    echo: bool | None = False
    # The number of most likely alternatives (0-5) to return with each token's logprob.
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None  # REFUSED

    def requested(self) -> RequestedParams:
        return dataclasses.replace(
            super().requested(),
            logprobs=self.logprobs,
            prompt_logprobs=bool(self.echo and self.logprobs is not None),
            best_of=self.best_of,
        )

    def prompt_problem(self) -> InvalidParameter | None:
        v = self.prompt
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            return InvalidParameter("prompt", "batched prompts are not supported: send one prompt per request")
        if not v:
            return InvalidParameter("prompt", "prompt must not be empty")
        return None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as the assistant wrote it


class ToolCall(BaseModel):
    """A call an earlier assistant turn made, sent back with the conversation."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Text, or content parts of which only text ones are implemented (problem() says so of others).
    content: str | list[dict[str, Any]] | None = None
    # Accepted and ignored: the chat template has no place for a participant's name.
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""

    def problem(self, i: int) -> InvalidParameter | None:
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            kind = part.get("type")
            if kind != "text":
                return InvalidParameter(
                    f"messages.{i}.content.{j}",
                    f"content parts of type {kind!r} are not supported: the served model reads text only "
                    '(parts of type "text")',
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                return InvalidParameter(f"messages.{i}.content.{j}", 'a text part is {"type": "text", "text": "..."}')
        if self.tool_calls is not None and self.role != "assistant":
            return InvalidParameter(f"messages.{i}.tool_calls", "only an assistant message carries tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            return InvalidParameter(
                f"messages.{i}.tool_call_id", "a tool message, and only a tool message, names its tool_call_id"
            )
        return None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's format: arguments as an object)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments  # as written: the template shows it as text


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]

    @field_validator("messages", mode="before")
    @classmethod
    def _few_enough(cls, value: Any) -> Any:
        # Before each message is validated: validating hundreds of thousands takes seconds of the loop.
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages are allowed, got {len(value)}")
        return value

    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Checked by gateway.api.tool_calls (their types are the SDK's).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # REFUSED but response_format (any value but the neutral one is a 400).
    functions: list[Any] | None = None
    function_call: Any = None
    # {"type": "text" | "json_object" | "json_schema", ...}: checked by gateway.api.validation.
    response_format: dict[str, Any] | None = None
    # vLLM's chat template controls: extra variables for the template (e.g. enable_thinking),
    # whether it opens the assistant's turn, or continues the last (assistant) message instead.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None

    def requested(self) -> RequestedParams:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            # Either would silently override the other; OpenAI deprecated max_tokens for max_completion_tokens.
            raise InvalidParameter(
                "max_completion_tokens",
                f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                "disagree: set one of them",
            )
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        response_format = self.response_format
        if (guided := self.guided_json_format()) is not None:
            if response_format not in (None, {"type": "text"}):
                raise InvalidParameter(
                    "guided_json", "response_format and guided_json are mutually exclusive: guided_json is its alias"
                )
            response_format = guided
        tools = self.tool_choice_spec
        if tools is not None and tools.forced:
            if response_format is not None and response_format != {"type": "text"}:
                raise InvalidParameter(
                    "response_format", "response_format cannot be combined with a tool_choice that forces calls"
                )
            if self.guided_regex is not None or self.guided_choice is not None or self.guided_json is not None:
                raise InvalidParameter(
                    "tool_choice", "a tool_choice that forces calls takes no guided_regex, guided_choice or guided_json"
                )
            response_format = tools.response_format()
        return dataclasses.replace(
            super().requested(),
            max_tokens=max_tokens,
            logprobs=bool(self.logprobs),
            top_logprobs=self.top_logprobs,
            response_format=response_format,
        )

    @functools.cached_property
    def tool_choice_spec(self) -> ToolChoice | None:
        """The tools and the calls the request forces; raises InvalidParameter. Kept once checked:
        checking compiles the calls' grammar, and the parameters are read more than once."""
        return tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)

    def messages_problem(self) -> InvalidParameter | None:
        if not self.messages:
            return InvalidParameter("messages", "messages must hold at least one message")
        return next((p for i, m in enumerate(self.messages) if (p := m.problem(i)) is not None), None)

    def template_options(self) -> dict[str, Any]:
        """What apply_chat_template gets besides the messages and tools; raises InvalidParameter."""
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidParameter(
                "continue_final_message",
                "continue_final_message continues the last message, so add_generation_prompt must be false",
            )
        if self.continue_final_message and (not self.messages or self.messages[-1].role != "assistant"):
            raise InvalidParameter("continue_final_message", "continue_final_message needs a last assistant message")
        kwargs = self.chat_template_kwargs or {}
        if reserved := sorted(set(kwargs) & TEMPLATE_ARGUMENTS):
            raise InvalidParameter(
                "chat_template_kwargs", f"chat_template_kwargs cannot set {reserved}: the request's own fields do"
            )
        return {
            **kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (what the model may be shown), or None."""
        return [dict(t) for t in self.tools] if self.tools else None
