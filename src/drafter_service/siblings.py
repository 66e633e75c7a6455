"""Sibling drafts (DraftTask.num_siblings): alternative leaves beside the chain's least sure drafts.

No forward of their own: each drafting step notes, for the rows that asked for siblings, how
sure it was of its chain token and what it would have proposed instead, from the logits or q
it already computed; after the chain, the least sure depths get a sibling each.

- greedy: the likeliest token other than the chain's (its surety: softmax of the logits);
- seeded: the token the request's noise ranks best after the chain's (any fixed choice is
  exact there, since the verifier's token is a function of p and the noise);
- unseeded: another draw from the same sparse q, made after the chain with a generator of its
  own, so it is independent of the chain's draw (the multi-candidate rule needs that) and
  the chain's draws are the ones it would have had without siblings.

A grammar's mask is in the logits and q already, so an alternative it refuses has probability
0 and is no candidate.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from specd.engine.cuda_graphs import read_back
from specd.engine.sampling import gumbel_argmax, sample
from specd.engine.sequences import SequenceState
from specd.engine.tasks import DraftProposal, DraftTask, SparseDist


def wanting(notes: SiblingNotes, active: Sequence[tuple[int, SequenceState, int]], rows: Sequence[int]) -> list[int]:
    """Positions in `rows` (indices into `active`) of the rows whose sequences asked for siblings."""
    return [n for n, r in enumerate(rows) if active[r][0] in notes.wanted]


def greedy_notes(logits: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """Per row of logits [R, V] (masked, penalized) whose chain token is chain [R]: (log softmax
    of the chain token, the likeliest other token, whether that one is allowed), float64 [R, 3]."""
    x = logits.float()
    chosen = chain[:, None]
    sure = (x.gather(1, chosen) - x.logsumexp(dim=-1, keepdim=True))[:, 0]
    others = x.scatter(1, chosen, float("-inf"))
    alt = others.argmax(dim=-1)
    allowed = others.gather(1, alt[:, None])[:, 0].isfinite()
    return torch.stack([sure.double(), alt.double(), allowed.double()], dim=1)


def seeded_notes(q: torch.Tensor, keys: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """Per row of q [R, V] whose chain token chain [R] is its noisy argmax under keys [R]: (log q
    of the chain token, the noisy argmax of the other tokens, whether that one has q > 0)."""
    chosen = chain[:, None]
    sure = q.gather(1, chosen)[:, 0].log()
    others = q.scatter(1, chosen, 0.0)
    alt = gumbel_argmax(others, keys)
    allowed = others.gather(1, alt[:, None])[:, 0] > 0
    return torch.stack([sure.double(), alt.double(), allowed.double()], dim=1)


def sibling_generator(state: SequenceState) -> torch.Generator:
    """The sequence's generator for sibling draws: on the host (a sibling is drawn from a sparse q
    already there), seeded from the chain generator's seed, so a test that fixes one fixes both."""
    if state.sibling_generator is None:
        assert state.generator is not None
        digest = hashlib.blake2b(f"siblings {state.generator.initial_seed()}".encode(), digest_size=8).digest()
        state.sibling_generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return state.sibling_generator


Candidate = tuple[float, int, int | SparseDist]  # (log surety of the chain token, depth, alternative)


class SiblingNotes:
    """What a round's drafting steps noted for the sequences that asked for siblings, keyed by
    (proposal index, depth); the device's part is read back once."""

    def __init__(self, tasks: Sequence[DraftTask]) -> None:
        self.wanted = {i for i, t in enumerate(tasks) if t.num_siblings > 0}
        self._keys: list[tuple[int, int]] = []
        self._rows: list[torch.Tensor] = []
        self._read: list[list[float]] = []
        self._host: list[tuple[int, int, float, SparseDist]] = []

    def add_device(self, keys: Sequence[tuple[int, int]], notes: torch.Tensor) -> None:
        """`greedy_notes` or `seeded_notes` of the rows keyed (proposal index, depth)."""
        self._keys.extend(keys)
        self._rows.append(notes)

    def add_sampled(self, i: int, depth: int, token: int, dist: SparseDist) -> None:
        """An unseeded chain token and the sparse q it was drawn from."""
        prob = dist.probs[dist.token_ids.index(token)]
        self._host.append((i, depth, math.log(prob) if prob > 0 else -math.inf, dist))

    def read_with(self, tokens: torch.Tensor) -> list[int]:
        """Read back token ids `tokens` and the device notes so far in one wait for the device."""
        if not self._rows:
            return read_back(tokens)
        values = read_back(torch.cat([tokens.double(), torch.cat(self._rows).flatten()]))
        n = tokens.shape[0]
        self._read.extend(values[j : j + 3] for j in range(n, len(values), 3))
        self._rows = []
        return [int(v) for v in values[:n]]

    def _candidates(self) -> dict[int, list[Candidate]]:
        if self._rows:
            self._read.extend(read_back(torch.cat(self._rows)))
            self._rows = []
        out: dict[int, list[Candidate]] = {i: [] for i in self.wanted}
        for (i, depth), (sure, alt, allowed) in zip(self._keys, self._read, strict=True):
            if allowed:
                out[i].append((sure, depth, int(alt)))
        for i, depth, sure, dist in self._host:
            out[i].append((sure, depth, dist))
        return out

    def attach(
        self, tasks: Sequence[DraftTask], proposals: list[DraftProposal], states: dict[int, SequenceState]
    ) -> None:
        """Append each proposal's siblings after its chain, with their parents (and their brother's
        q, for an unseeded sequence); depths the chain did not reach get none."""
        for i, candidates in self._candidates().items():
            proposal = proposals[i]
            chain = len(proposal.tokens)
            reached = [c for c in candidates if c[1] < chain]
            # Least sure first; between equals the shallower, whose acceptance more drafts wait on.
            chosen = sorted(reached, key=lambda c: (c[0], c[1]))[: min(tasks[i].num_siblings, chain)]
            if not chosen:
                continue
            proposal.parents = list(range(-1, chain - 1))
            for _, depth, alt in sorted(chosen, key=lambda c: c[1]):
                if isinstance(alt, SparseDist):
                    drawn = sample(torch.tensor(alt.probs), sibling_generator(states[i]))
                    proposal.tokens.append(alt.token_ids[drawn])
                    proposal.dists.append(alt)
                else:
                    proposal.tokens.append(alt)
                proposal.parents.append(depth - 1)
