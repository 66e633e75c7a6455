"""Several choices for one request (OpenAI's `n` and `best_of`): one scheduler sequence each.

Each choice is its own sequence on both services, with its own randomness, so speculation
keeps every choice exact on its own. A seeded request gives choice i the seed
`choice_seed(seed, i)`: choice 0 keeps the request's seed, so it is the n = 1 output for
that seed, and the whole response is reproducible. `best_of` generates that many
candidates and keeps the `n` with the highest cumulative target logprob (the verifier's
raw logprobs of the generated tokens, which every candidate asks for).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from gateway.round.scheduler import Delta, Event, Failed, Finished, GenerationParams, Scheduler, _Sequence
from specd.engine.noise import splitmix64
from specd.engine.params import LogprobsRequest, TokenLogprob

_MASK64 = 0xFFFFFFFFFFFFFFFF


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: `seed` itself for choice 0,
    else SplitMix64(SplitMix64(seed) XOR index), a 64-bit value unrelated to the other choices'."""
    if index == 0:
        return seed
    return splitmix64(splitmix64(seed & _MASK64) ^ index)


@dataclass(frozen=True)
class Choices:
    """How many sequences a request runs, and how many choices it returns."""

    n: int = 1
    # Candidates generated; None when the client did not ask for best_of (then n, unranked).
    best_of: int | None = None

    @property
    def count(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranked(self) -> bool:
        return self.best_of is not None and self.best_of > 1


def choice_params(params: GenerationParams, choices: Choices) -> list[GenerationParams]:
    """The parameters of each sequence the request runs, choice 0 first."""
    out = []
    for i in range(choices.count):
        p = params
        seed = params.sampling.seed
        if seed is not None and i > 0:
            p = dataclasses.replace(p, sampling=dataclasses.replace(p.sampling, seed=choice_seed(seed, i)))
        if choices.ranked and p.logprobs is None:
            # Ranking needs each candidate's logprobs; the client gets them only if it asked.
            p = dataclasses.replace(p, logprobs=LogprobsRequest())
        if i > 0 and p.logprobs is not None and p.logprobs.prompt:
            # The prompt's logprobs are the same for every choice: choice 0 brings them.
            p = dataclasses.replace(p, logprobs=dataclasses.replace(p.logprobs, prompt=False))
        out.append(p)
    return out


@dataclass
class Outcome:
    """One sequence's whole output."""

    text: str
    finished: Finished
    logprobs: list[TokenLogprob]
    token_ids: list[int] = field(default_factory=list)

    @property
    def score(self) -> float:
        """best_of's ranking: the sum of the target's logprobs of the generated tokens."""
        return sum(lp.logprob for lp in self.logprobs)


class Gathered:
    """Every choice's whole output, from merged()'s events: what a unary reply returns."""

    def __init__(self, count: int) -> None:
        self.parts: list[list[str]] = [[] for _ in range(count)]
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(count)]
        self.finished: dict[int, Finished] = {}

    def add(self, index: int, event: Delta | Finished) -> None:
        if isinstance(event, Delta):
            self.parts[index].append(event.text)
            self.token_ids[index].extend(event.token_ids)
            self.logprobs[index].extend(event.logprobs)
        elif isinstance(event, Finished):
            self.finished[index] = event
        else:
            raise TypeError(f"not a choice's output: {event!r}")

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.parts)

    def outcomes(self) -> list[Outcome]:
        """Each choice's outcome, in choice order; only once complete."""
        assert self.complete, "a choice has not finished"
        return [
            Outcome("".join(self.parts[i]), self.finished[i], self.logprobs[i], self.token_ids[i])
            for i in range(len(self.parts))
        ]


def request_usage(ends: Sequence[Finished]) -> tuple[int, int]:
    """A request's (prompt tokens, completion tokens): the prompt once, and every generated token
    of every choice (as OpenAI counts n and best_of: the candidates best_of dropped included)."""
    return ends[0].prompt_tokens, sum(f.completion_tokens for f in ends)


def best(outcomes: Sequence[Outcome], choices: Choices) -> list[Outcome]:
    """The outcomes to return, in choice order: the n best by score when ranked (ties: the earlier)."""
    if not choices.ranked:
        return list(outcomes[: choices.n])
    order = sorted(range(len(outcomes)), key=lambda i: (-outcomes[i].score, i))
    return [outcomes[i] for i in order[: choices.n]]


async def merged(scheduler: Scheduler, seqs: Sequence[_Sequence]) -> AsyncIterator[tuple[int, Event]]:
    """Every sequence's events as (its index, event), in arrival order, until all have finished.

    Stops after the first Failed: the request fails as a whole. Leaving early (a failure, a
    client gone) cancels every sequence not yet finished, so none is left running.
    """
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def pump(i: int, seq: _Sequence) -> None:
        async for event in scheduler.events(seq):
            queue.put_nowait((i, event))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(seqs)]
    running = len(seqs)
    try:
        while running:
            i, event = await queue.get()
            yield i, event
            if isinstance(event, Failed):
                return
            if isinstance(event, Finished):
                running -= 1
    finally:
        for task in pumps:
            task.cancel()
        for seq in seqs:
            scheduler.cancel(seq)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)
