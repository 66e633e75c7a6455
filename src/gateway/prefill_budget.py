"""How many prompt tokens the drafter may prefill in one round, beside one verify.

The drafter prefills its chunks while the verifier verifies, and the round waits for both, so
a chunk that takes longer than the verify stalls every running stream. A drafter is often far
slower per prompt token than the verifier (an int8 weight-only copy runs its large prefill
matrix products much slower than float32 ones), so the verifier's token budget does not fit it:
the drafter's budget is what it can prefill in the time a verify takes, from measurements of
both. A sequence whose drafter prefill is not done yet runs target-only meanwhile. The drafter
prefills this way whether or not the verifier's prefill is chunked (`--prefill-chunk-tokens`,
which only caps it here): a whole prompt prefilled at a join would stall the round after the
verify for as long as the drafter takes over it.
"""

from __future__ import annotations

from gateway.speculation import Ewma

# Before anything is measured: a chunk small enough to cost little, large enough to time.
FIRST_CHUNK = 32
# Never less than this per round, or a long prompt would never finish on a slow drafter.
MIN_CHUNK = 8


class DrafterPrefillBudget:
    def __init__(self, cap: int) -> None:
        self.cap = cap  # --prefill-chunk-tokens; 0: no cap, only what fits behind a verify
        self.ns_per_token = Ewma(0.3)
        self.verify_ns = Ewma(0.3)

    def observe_prefill(self, tokens: int, elapsed_ns: float) -> None:
        """A drafter exchange that only prefilled `tokens` prompt tokens, and how long it took.

        Exchanges of a few tokens are left out: their fixed cost would read as a per-token one."""
        if tokens >= FIRST_CHUNK and elapsed_ns > 0:
            self.ns_per_token.observe(elapsed_ns / tokens)

    def observe_verify(self, elapsed_ns: float) -> None:
        """A verifier exchange, which the drafter's chunk should fit behind."""
        if elapsed_ns > 0:
            self.verify_ns.observe(elapsed_ns)

    def fits(self) -> int:
        """Prompt tokens the drafter can prefill in the time of one verify (FIRST_CHUNK until both are timed)."""
        if self.ns_per_token.value is None or self.verify_ns.value is None:
            return FIRST_CHUNK
        return max(MIN_CHUNK, int(self.verify_ns.value / self.ns_per_token.value))

    def tokens(self) -> int:
        """This round's budget of drafter prefill tokens (what fits behind a verify, within the cap if one is set)."""
        return min(self.cap, self.fits()) if self.cap > 0 else self.fits()
