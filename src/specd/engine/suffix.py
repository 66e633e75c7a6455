"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): counted tries of every substring of at
most `depth` tokens, one over each request's prompt and output and one per tenant over its latest
responses, and the continuation of the longest match of a context's suffix, ranked by frequency.

A trie of bounded depth rather than a full suffix tree: appending a token touches the at most
`depth` nodes of the suffixes that end at it, so an update costs O(depth) per new token and never
rescans; a response leaves the global trie by the same walk, decrementing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ROOT = 0


class SuffixTrie:
    """Nodes are ids into parallel lists; node n is one substring, `count[n]` its occurrences
    (each within `depth` tokens of where it starts), `stamp[n]` when it last occurred (ties go to
    the more recent continuation, as prompt lookup prefers the latest match)."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.children: list[dict[int, int] | None] = [None]
        self.count = [0]
        self.stamp = [0]
        self.level = [0]
        # Bumped when a node is freed, so a cursor holding it can tell it is gone.
        self.generation = [0]
        self._free: list[int] = []
        self.clock = 0

    @property
    def nodes(self) -> int:
        return len(self.count) - len(self._free)

    def _child(self, node: int, token: int) -> int:
        kids = self.children[node]
        if kids is None:
            kids = self.children[node] = {}
        child = kids.get(token)
        if child is not None:
            return child
        if self._free:
            child = self._free.pop()
            self.children[child] = None
            self.count[child] = 0
            self.level[child] = self.level[node] + 1
        else:
            child = len(self.count)
            self.children.append(None)
            self.count.append(0)
            self.stamp.append(0)
            self.level.append(self.level[node] + 1)
            self.generation.append(0)
        kids[token] = child
        return child

    def extend(self, active: list[int], tokens: Iterable[int]) -> list[int]:
        """Count `tokens` as following the text whose suffix nodes (shortest first, lengths
        1, 2, ...) are `active`; returns the suffix nodes after them."""
        depth = self.depth
        for token in tokens:
            self.clock += 1
            nxt = []
            for node in (ROOT, *active):
                if self.level[node] >= depth:
                    break
                child = self._child(node, token)
                self.count[child] += 1
                self.stamp[child] = self.clock
                nxt.append(child)
            active = nxt
        return active

    def follow(self, active: Sequence[int], tokens: Iterable[int]) -> list[int]:
        """The nodes of the suffixes of (text of `active`) + `tokens` that occur, counting nothing."""
        nodes = list(active)
        for token in tokens:
            nxt = []
            for node in (ROOT, *nodes):
                kids = self.children[node]
                child = kids.get(token) if kids is not None else None
                if child is not None:
                    nxt.append(child)
            nodes = nxt
        return nodes

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `extend([], tokens)`: every substring of at most `depth` tokens counted once less;
        a substring counted no more leaves the trie, with everything under it (counted no more either)."""
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start : start + self.depth]:
                kids = self.children[node]
                assert kids is not None, "removing text the trie never held"
                child = kids[token]
                self.count[child] -= 1
                if self.count[child] == 0:
                    del kids[token]
                    self._release(child)
                    break
                node = child

    def _release(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            kids = self.children[n]
            if kids:
                stack.extend(kids.values())
            self.children[n] = None
            self.generation[n] += 1
            self._free.append(n)


@dataclass
class Draft:
    """A proposal: a chain of drafts, and leaves beside it (`siblings`: (parent, token), the
    parent an index into the chain or -1), with the chain's score (the sum of its estimated
    probabilities, SuffixDecoding's score) and the length of the match it continues."""

    chain: list[int] = field(default_factory=list)
    siblings: list[tuple[int, int]] = field(default_factory=list)
    score: float = 0.0
    match: int = 0


@dataclass(frozen=True)
class Limits:
    """How big a draft may grow: at most `factor` x the match's length in chain tokens, and no
    draft whose estimated probability (the product of its path's frequencies) is below `min_prob`."""

    factor: float = 2.0
    min_prob: float = 0.1


def _ranked(trie: SuffixTrie, node: int) -> tuple[int, list[tuple[int, int]]]:
    """The node's continuations' total count, and its best two (token, child)."""
    kids = trie.children[node]
    if not kids:
        return 0, []
    count, stamp = trie.count, trie.stamp
    total = 0
    best: list[tuple[int, int, int, int]] = []  # (count, stamp, token, child), best first
    for token, child in kids.items():
        c = count[child]
        total += c
        key = (c, stamp[child], token, child)
        if len(best) < 2:
            best.append(key)
            best.sort(reverse=True)
        elif key > best[1]:
            best[1] = key
            if key > best[0]:
                best[0], best[1] = best[1], best[0]
    return total, [(b[2], b[3]) for b in best]


def continue_from(trie: SuffixTrie, node: int, k: int, limits: Limits, match: int) -> Draft:
    """The likeliest continuation of the node's substring, at most min(k, factor x match) long,
    with each position's runner-up as a candidate sibling."""
    draft = Draft(match=match)
    size = min(k, int(limits.factor * match))
    p = 1.0
    alternatives: list[tuple[float, int, int]] = []
    while len(draft.chain) < size:
        total, best = _ranked(trie, node)
        if not best:
            break
        token, child = best[0]
        q = p * trie.count[child] / total
        if q < limits.min_prob:
            break
        if len(best) > 1:
            alternatives.append((p * trie.count[best[1][1]] / total, len(draft.chain) - 1, best[1][0]))
        draft.chain.append(token)
        draft.score += q
        p, node = q, child
    alternatives.sort(key=lambda a: -a[0])
    draft.siblings = [(parent, token) for prob, parent, token in alternatives if prob >= limits.min_prob]
    return draft


def deepest(trie: SuffixTrie, nodes: Sequence[int]) -> tuple[int, int]:
    """The longest of the suffix nodes that has a continuation, and its length; (ROOT, 0) if none."""
    for node in reversed(nodes):
        if trie.children[node]:
            return node, trie.level[node]
    return ROOT, 0


class GlobalTrie:
    """One tenant's trie over its latest `capacity` responses (an LRU: the oldest leaves first)."""

    def __init__(self, depth: int, capacity: int) -> None:
        self.trie = SuffixTrie(depth)
        self.capacity = capacity
        self.responses: OrderedDict[int, list[int]] = OrderedDict()
        self._next = 0

    def add(self, response: Sequence[int]) -> None:
        if not response or self.capacity <= 0:
            return
        self.trie.extend([], response)
        self.responses[self._next] = list(response)
        self._next += 1
        while len(self.responses) > self.capacity:
            _, oldest = self.responses.popitem(last=False)
            self.trie.remove(oldest)


class Cursor:
    """Where a text's suffixes stand in a trie, kept as the text grows; nodes the trie freed since
    (their responses left the cache) drop out."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.nodes: list[int] = []
        self.generations: list[int] = []

    def valid(self) -> list[int]:
        generation = self.trie.generation
        nodes = [n for n, g in zip(self.nodes, self.generations, strict=True) if generation[n] == g]
        if len(nodes) != len(self.nodes):
            # A freed node's longer suffixes were freed with it: what is left is still a prefix.
            self._keep(nodes)
        return nodes

    def _keep(self, nodes: list[int]) -> None:
        self.nodes = nodes
        self.generations = [self.trie.generation[n] for n in nodes]

    def advance(self, tokens: Sequence[int]) -> None:
        nodes = self.trie.follow(self.valid(), tokens)
        self._keep(nodes[: self.trie.depth - 1])


class GlobalTries:
    """The tenants' global tries: at most `tenants` of them, the least recently used dropped."""

    def __init__(self, depth: int, capacity: int, tenants: int) -> None:
        self.depth, self.capacity, self.tenants = depth, capacity, tenants
        self._tries: OrderedDict[str, GlobalTrie] = OrderedDict()

    def get(self, tenant: str) -> GlobalTrie:
        found = self._tries.get(tenant)
        if found is None:
            found = self._tries[tenant] = GlobalTrie(self.depth, self.capacity)
            while len(self._tries) > self.tenants:
                self._tries.popitem(last=False)
        self._tries.move_to_end(tenant)
        return found
