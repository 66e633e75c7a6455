"""The in-process peer: Hugging Face `generate` with an assistant model or prompt lookup.

`specd bench` runs it with the same models, k and prompts as the specd stack,
one request at a time (assisted generation only supports batch size 1), and
records each request's timings with a streamer so TTFT and inter-token gaps
are measured the same way as over HTTP.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specd.engine.checkpoints import load_tokenizer
from specd.engine.models import load_model, parse_device, parse_dtype
from specd.engine.quant import quantize_copy
from specd.tools.benchstats import RequestResult


@dataclass(frozen=True)
class HfConfig:
    target: str = "embedded"
    target_dtype: str = "float32"
    draft: str = "embedded"  # a model spec, "ngram" for prompt lookup, or "none" for target-only
    draft_dtype: str = "bfloat16"
    draft_quantize: str = "auto"  # as the drafter service's --quantize: auto, int8, int4 or none
    device: str = "cpu"
    k: int = 4


class _Clock:
    """A streamer that timestamps every chunk `generate` emits (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens += int(value.numel())

    def end(self) -> None:
        pass


class HfBaseline:
    def __init__(self, config: HfConfig) -> None:
        self.config = config
        device = parse_device(config.device)
        self.tokenizer = load_tokenizer(config.target)
        self.target = load_model(config.target, device, parse_dtype(config.target_dtype))
        self.assistant: Any = None
        self.quantized = "none"
        if config.draft not in ("ngram", "none"):
            if config.draft_quantize == "none":
                assistant = load_model(config.draft, device, parse_dtype(config.draft_dtype))
            else:
                # Quantized from float32, as the drafter service does.
                assistant = load_model(config.draft, device, torch.float32)
                self.quantized = quantize_copy(assistant, config.draft_quantize)
                assistant.to(parse_dtype(config.draft_dtype))
            self.assistant = assistant
        self.device = device

    @property
    def name(self) -> str:
        c = self.config
        if c.draft == "none":
            return f"HF generate, target {c.target_dtype}"
        if c.draft == "ngram":
            return f"HF generate(prompt_lookup_num_tokens={c.k})"
        return f"HF generate(assistant_model={self.quantized}/{c.draft_dtype}, num_assistant_tokens={c.k})"

    def _kwargs(
        self, max_tokens: int, temperature: float, ignore_eos: bool, seed: int, top_p: float = 1.0
    ) -> dict[str, Any]:
        c = self.config
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "pad_token_id": self.tokenizer.eos_token_id}
        if ignore_eos:
            kwargs["min_new_tokens"] = max_tokens
        if temperature > 0:
            torch.manual_seed(seed)
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if c.draft == "ngram":
            kwargs["prompt_lookup_num_tokens"] = c.k
        elif self.assistant is not None:
            # Fixed k, as specd's fixed mode: no schedule, no confidence early exit.
            kwargs.update(
                assistant_model=self.assistant,
                num_assistant_tokens=c.k,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,
            )
        return kwargs

    def generate(
        self, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool, seed: int, top_p: float = 1.0
    ) -> RequestResult:
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer(rendered, add_special_tokens=False, return_tensors="pt").input_ids.to(self.device)
        clock = _Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                streamer=clock,
                **self._kwargs(max_tokens, temperature, ignore_eos, seed, top_p),
            )
        end = time.perf_counter()
        new = out[0, ids.shape[1] :].tolist()
        times = clock.times or [end]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return RequestResult(
            times[0] - start, end - start, len(new), gaps, self.tokenizer.decode(new, skip_special_tokens=True)
        )

    def run(
        self,
        prompts: Sequence[str],
        max_tokens: int,
        temperature: float,
        ignore_eos: bool,
        progress: Any = None,
        top_p: float = 1.0,
    ) -> list[RequestResult]:
        self.generate(prompts[0], 8, temperature, ignore_eos, 0, top_p)  # first-call costs stay out of the figures
        results = []
        for i, prompt in enumerate(prompts):
            results.append(self.generate(prompt, max_tokens, temperature, ignore_eos, i, top_p))
            if progress is not None:
                progress.update(1)
        return results
