"""The one validator of generation parameters, for the HTTP and the gRPC API alike.

Each API only translates its own encoding into `RequestedParams` (None where the client
left a parameter unset); everything about ranges and combinations is decided here, from
specd.engine.ranges, so both APIs refuse the same values with the same message (HTTP 400 with
`param` set, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.api.choices import Choices
from gateway.api.json_schemas import closed
from gateway.failures import InvalidParameter  # there for the scheduler's refusals too
from gateway.round.scheduler import PIPELINES, GenerationParams
from specd.engine.grammar import (
    JSON_OBJECT_SCHEMA,
    canonical,
    choice_grammar,
    grammar_problem,
    regex_grammar,
    schema_problem,
)
from specd.engine.params import LogprobsRequest, Penalties, SamplingParams
from specd.engine.ranges import (
    MAX_GUIDED_CHOICE_CHARS,
    MAX_GUIDED_CHOICES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_SEQUENCES,
    RANGES,
)


def validation_refusal(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str, str | None]:
    """The 400 (message, code, param) for a request body its pydantic model refused with `errors`:
    the same words whether the route refused it or the worker that screens large bodies did
    (gateway.api.body_screen)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", "invalid_json", None
    if first.get("type") == "extra_forbidden":
        name = ".".join(loc)
        return (
            f"unknown parameter {name!r}: specd refuses parameters it does not implement "
            "rather than ignore them (docs/api.md lists every parameter)",
            "unknown_parameter",
            name,
        )
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors
    )
    return message, "invalid_value", ".".join(loc) or None


@dataclass(frozen=True)
class RequestedParams:
    """Generation parameters as a client sent them; None means unset."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    ignore_eos: bool = False
    # None: the gateway's --speculative-mode; "auto"; or a k.
    speculation: int | str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Token id (an int, or its decimal string as in OpenAI's JSON) -> bias.
    logit_bias: Mapping[int, float] | Mapping[str, float] | None = None
    # Chat and gRPC: a bool, with top_logprobs. Completions: the number of alternatives
    # (0-5), which also turns logprobs on.
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    # Also the prompt's logprobs (completions' echo, gRPC's prompt_logprobs).
    prompt_logprobs: bool = False
    n: int | None = None
    best_of: int | None = None
    # None: the gateway's --pipeline; else "sequential", "cohort" or "ahead".
    pipeline: str | None = None
    # None: the gateway's --speculative-siblings; else the most siblings beside a block's chain.
    siblings: int | None = None
    # None: the gateway's --speculative-branches; else the most branches beside a draft-ahead block.
    branches: int | None = None
    # OpenAI's response_format, as sent: {"type": "text" | "json_object" | "json_schema", ...}.
    response_format: Mapping[str, Any] | None = None
    # vLLM's structured-output extensions: a regular expression the whole output matches, or
    # the strings the output must be one of. At most one constraint per request.
    guided_regex: str | None = None
    guided_choice: Sequence[str] | None = None
    # The gateway's --json-undeclared-keys: JSON objects may hold keys their schema does not
    # declare unless it forbids them (JSON Schema's own default) instead of only where it allows them.
    undeclared_keys: bool = False
    # vLLM's: the text of special tokens is left out (True) or kept; a stop string ends the
    # output and is left out (False) or kept.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: no end-of-sequence token before this many generated tokens (the scheduler adds
    # the ids it stops on to the penalties both services apply).
    min_tokens: int = 0


def check(name: str, value: object, range_name: str | None = None) -> None:
    """Refuse `value` unless it is in the range of `range_name` (default: `name`)."""
    if value is None:
        return
    problem = RANGES[range_name or name].problem(name, value)
    if problem:
        raise InvalidParameter(name, problem)


def generation_params(raw: RequestedParams, vocab_size: int) -> GenerationParams:
    """Validate every parameter and build what the scheduler runs; raises InvalidParameter."""
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "top_logprobs",
        "n",
        "best_of",
    ):
        check(name, getattr(raw, name))
    stop = (raw.stop,) if isinstance(raw.stop, str) else tuple(raw.stop or ())
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidParameter("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}")
    spec = raw.speculation
    if spec is not None and spec != "auto" and (isinstance(spec, bool) or not isinstance(spec, int) or spec < 0):
        raise InvalidParameter("num_speculative_tokens", f"num_speculative_tokens must be 'auto' or >= 0, got {spec!r}")
    if raw.pipeline is not None and raw.pipeline not in PIPELINES:
        raise InvalidParameter("pipeline", f"pipeline must be one of {', '.join(PIPELINES)}, got {raw.pipeline!r}")
    siblings = extension_count("speculative_siblings", raw.siblings)
    branches = extension_count("speculative_branches", raw.branches)
    top_k = raw.top_k if raw.top_k is not None and raw.top_k > 0 else 0  # -1 and 0 both disable it
    constraint = structured_output(raw)
    check_min_tokens(raw, constraint)
    return GenerationParams(
        max_tokens=raw.max_tokens,
        sampling=SamplingParams(
            temperature=1.0 if raw.temperature is None else float(raw.temperature),
            top_p=1.0 if raw.top_p is None else float(raw.top_p),
            top_k=top_k,
            seed=raw.seed,
            min_p=0.0 if raw.min_p is None else float(raw.min_p),
        ),
        stop=stop,
        ignore_eos=raw.ignore_eos,
        speculation=spec,
        penalties=Penalties.of(
            presence=float(raw.presence_penalty or 0.0),
            frequency=float(raw.frequency_penalty or 0.0),
            repetition=1.0 if raw.repetition_penalty is None else float(raw.repetition_penalty),
            bias=logit_bias(raw.logit_bias, vocab_size),
            min_tokens=raw.min_tokens,
        ),
        logprobs=logprobs_request(raw),
        pipeline=raw.pipeline,
        siblings=siblings,
        branches=branches,
        skip_special_tokens=raw.skip_special_tokens,
        include_stop=raw.include_stop_str_in_output,
        **constraint,
    )


def extension_count(name: str, value: Any) -> int | None:
    """A specd extension's count (speculative_siblings, speculative_branches): unset, or an integer >= 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise InvalidParameter(name, f"{name} must be an integer >= 0, got {value!r}")
    return value


def check_min_tokens(raw: RequestedParams, constraint: Mapping[str, str]) -> None:
    """min_tokens in range, and not where the output's end is not its to hold back."""
    if isinstance(raw.min_tokens, bool) or not isinstance(raw.min_tokens, int) or raw.min_tokens < 0:
        raise InvalidParameter("min_tokens", f"min_tokens must be an integer >= 0, got {raw.min_tokens!r}")
    if not raw.min_tokens:
        return
    if raw.max_tokens is not None and raw.min_tokens > raw.max_tokens:
        raise InvalidParameter(
            "min_tokens", f"min_tokens ({raw.min_tokens}) must not exceed max_tokens ({raw.max_tokens})"
        )
    if any(constraint.values()):
        # A grammar may be complete before min_tokens, with end-of-sequence the only token left.
        raise InvalidParameter("min_tokens", "min_tokens cannot be combined with a structured-output constraint")


def structured_output(raw: RequestedParams) -> dict[str, str]:
    """The request's one output constraint, as GenerationParams' json_schema or grammar."""
    given = [
        name
        for name, value in (
            ("response_format", None if json_schema(raw.response_format) == "" else raw.response_format),
            ("guided_regex", raw.guided_regex),
            ("guided_choice", raw.guided_choice),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise InvalidParameter(
            given[-1], f"{' and '.join(given)} are mutually exclusive: a request takes one structured-output constraint"
        )
    if raw.guided_regex is not None:
        return {"grammar": guided_grammar("guided_regex", raw.guided_regex, raw.ignore_eos)}
    if raw.guided_choice is not None:
        return {"grammar": guided_grammar("guided_choice", raw.guided_choice, raw.ignore_eos)}
    return {"json_schema": json_schema(raw.response_format, raw.ignore_eos, raw.undeclared_keys)}


def choices_problem(param: str, value: str | Sequence[str]) -> InvalidParameter | None:
    """What is wrong with a guided_choice list's shape or size, before any grammar is built."""
    if isinstance(value, str) or not value or not all(isinstance(c, str) for c in value):
        return InvalidParameter(param, "guided_choice must be a non-empty list of strings")
    if len(value) > MAX_GUIDED_CHOICES or sum(map(len, value)) > MAX_GUIDED_CHOICE_CHARS:
        return InvalidParameter(
            param,
            f"guided_choice takes at most {MAX_GUIDED_CHOICES} strings of {MAX_GUIDED_CHOICE_CHARS} characters "
            f"in all; got {len(value)} of {sum(map(len, value))}",
        )
    return None


def guided_grammar(param: str, value: str | Sequence[str], ignore_eos: bool) -> str:
    """The llguidance grammar of a guided_regex or a guided_choice; raises InvalidParameter."""
    if param == "guided_regex":
        if not isinstance(value, str) or not value:
            raise InvalidParameter(param, "guided_regex must be a non-empty regular expression")
        try:
            grammar = regex_grammar(value)
        except (ValueError, TypeError) as exc:
            raise InvalidParameter(param, f"guided_regex is not a regular expression: {exc}") from None
    else:
        if (problem := choices_problem(param, value)) is not None:
            raise problem
        grammar = choice_grammar(list(value))
    if ignore_eos:
        # The output ends where the grammar is complete; past it, no token is allowed.
        raise InvalidParameter("ignore_eos", f"ignore_eos cannot be combined with {param}")
    if problem := grammar_problem(grammar):
        raise InvalidParameter(param, f"{param} is not supported by the grammar engine: {problem}")
    return grammar


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def json_schema(
    response_format: Mapping[str, Any] | None, ignore_eos: bool = False, undeclared_keys: bool = False
) -> str:
    """The canonical JSON Schema text a response_format asks for; "" for none or text. Unless
    `undeclared_keys`, an object that lists its properties holds no other key where its schema
    does not allow them explicitly (gateway.api.json_schemas.closed), as vLLM's default backend."""
    if response_format is None:
        return ""
    if not isinstance(response_format, Mapping) or response_format.get("type") not in RESPONSE_FORMAT_TYPES:
        raise InvalidParameter(
            "response_format", f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}"
        )
    kind = response_format["type"]
    extra = sorted(set(response_format) - {"type", *(("json_schema",) if kind == "json_schema" else ())})
    if extra:
        raise InvalidParameter("response_format", f"response_format of type {kind} has unknown fields: {extra}")
    if kind == "text":
        return ""
    if kind == "json_object":
        schema: Any = JSON_OBJECT_SCHEMA
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise InvalidParameter(
                "response_format", "response_format.json_schema must be an object with a string name and a schema"
            )
        if unknown := sorted(set(spec) - set(JSON_SCHEMA_KEYS)):
            raise InvalidParameter("response_format", f"response_format.json_schema has unknown fields: {unknown}")
        if spec.get("strict") not in (None, True, False):
            raise InvalidParameter("response_format", "response_format.json_schema.strict must be a boolean")
        # Absent: any JSON value, as OpenAI allows. strict or not, the schema is enforced.
        schema = spec.get("schema", {})
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidParameter("response_format", "response_format.json_schema.schema must be a JSON object")
    if ignore_eos:
        raise InvalidParameter("ignore_eos", "ignore_eos cannot be combined with a JSON response_format")
    text = canonical(schema if undeclared_keys else closed(schema))
    if problem := schema_problem(text):
        raise InvalidParameter("response_format", f"response_format: the JSON schema is not supported: {problem}")
    return text


def choices(raw: RequestedParams, max_n: int, stream: bool = False) -> Choices:
    """How many choices the request returns (n) and generates (best_of); raises InvalidParameter."""
    for name in ("n", "best_of"):
        value = getattr(raw, name)
        check(name, value)
        if value is not None and value > max_n:
            raise InvalidParameter(name, f"{name} must be at most {max_n} (the gateway's --max-n), got {value}")
    n = 1 if raw.n is None else raw.n
    if raw.best_of is not None:
        if raw.best_of < n:
            raise InvalidParameter("best_of", f"best_of must be at least n ({n}), got {raw.best_of}")
        if stream and raw.best_of > 1:
            # The choices returned are known only once every candidate has finished.
            raise InvalidParameter("best_of", "best_of greater than 1 cannot be streamed")
    return Choices(n, raw.best_of)


def logit_bias(bias: Mapping[int, float] | Mapping[str, float] | None, vocab_size: int) -> dict[int, float]:
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParameter(
            "logit_bias", f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            token = int(key)
        if token is None or not 0 <= token < vocab_size:
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}")
        check("logit_bias", value)
        out[token] = float(value)
    return out


def logprobs_request(raw: RequestedParams) -> LogprobsRequest | None:
    if isinstance(raw.logprobs, int) and not isinstance(raw.logprobs, bool):
        # Completions: logprobs is the number of alternatives; top_logprobs is not its parameter.
        check("logprobs", raw.logprobs, "completion_logprobs")
        return LogprobsRequest(top=raw.logprobs, prompt=raw.prompt_logprobs)
    if not raw.logprobs:
        if raw.top_logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        if raw.prompt_logprobs:
            raise InvalidParameter("prompt_logprobs", "prompt_logprobs requires logprobs to be true")
        return None
    return LogprobsRequest(top=raw.top_logprobs or 0, prompt=raw.prompt_logprobs)


def encode_prompt(tokenizer: Any, text: str, param: str = "prompt", **kwargs: Any) -> list[int]:
    """Token ids of `text`; text that cannot be encoded (a lone UTF-16 surrogate) is a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameter(param, f"{param} is not valid Unicode text: {exc.reason} at {exc.start}") from None
    return list(tokenizer.encode(text, **kwargs))
