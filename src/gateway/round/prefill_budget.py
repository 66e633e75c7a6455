"""How many prompt tokens the drafter may prefill in one round, beside one verify.

The drafter prefills its chunks while the verifier verifies, and the round waits for both, so
a chunk that takes longer than the verify stalls every running stream. A drafter is often far
slower per prompt token than the verifier (an int8 weight-only copy runs its large prefill
matrix products much slower than float32 ones), so the verifier's token budget does not fit it:
the drafter's budget is what it can prefill in the time a verify takes, less the drafts it
makes beside that verify (another cohort's block, a draft-ahead block), from measurements of
both. A sequence whose drafter prefill is not done yet runs target-only meanwhile. The drafter
prefills this way whether or not the verifier's prefill is chunked (`--prefill-chunk-tokens`,
which only caps it here): a whole prompt prefilled at a join would stall the round after the
verify for as long as the drafter takes over it.
"""

from __future__ import annotations

from gateway.round.costs import Ewma, LinearCost

# Before anything is measured: a chunk small enough to cost little, large enough to time.
FIRST_CHUNK = 32
# Never less than this per round, or a long prompt would never finish on a slow drafter.
MIN_CHUNK = 8


class DrafterPrefillBudget:
    """A prefill exchange's time is a fixed cost plus one per token (`LinearCost`, fitted to every
    prefill-only exchange, so the budget keeps following the drafter whatever the chunks' sizes);
    the budget is the tokens whose time fits in a verify's. Until the chunks have varied in size
    the fit has no slope, and each token is charged the mean time per token, fixed cost included:
    a smaller budget, whose chunks then vary. The budget stays between what the mean fits and
    twice that, so it reaches sizes the fit has not seen a step at a time. Where the fixed cost
    alone outlasts the verify, no chunk fits and each stalls its round anyway: chunks then grow
    to what costs twice the fixed cost."""

    def __init__(self, cap: int) -> None:
        self.cap = cap  # --prefill-chunk-tokens; 0: no cap, only what fits behind a verify
        self.cost = LinearCost(forget=0.9)
        self.verify_ns = Ewma(0.3)
        # The verifier's opens: their time against the prompt tokens they prefilled.
        self.open_cost = LinearCost(forget=0.9)

    def observe_prefill(self, tokens: int, elapsed_ns: float) -> None:
        """A drafter exchange that only prefilled `tokens` prompt tokens, and how long it took."""
        if tokens > 0 and elapsed_ns > 0:
            self.cost.observe(tokens, elapsed_ns)

    def observe_verify(self, elapsed_ns: float) -> None:
        """A verifier exchange, which the drafter's chunk should fit behind."""
        if elapsed_ns > 0:
            self.verify_ns.observe(elapsed_ns)

    def observe_open(self, tokens: int, elapsed_ns: float) -> None:
        """A verifier open that prefilled `tokens` prompt tokens, and how long it took."""
        if tokens > 0 and elapsed_ns > 0:
            self.open_cost.observe(tokens, elapsed_ns)

    def fits_beside_open(self, tokens: int) -> int:
        """Prompt tokens the drafter can prefill in the time the verifier takes to open sequences
        prefilling `tokens`; 0 until both have been timed, or where the drafter's fixed cost alone
        would outlast the open."""
        if self.cost.samples == 0 or self.open_cost.samples == 0:
            return 0
        fixed_v, per_token_v = self.open_cost.coefficients()
        mean_tokens_v, mean_ns_v = self.open_cost.means()
        open_ns = fixed_v + per_token_v * tokens if per_token_v > 0 else mean_ns_v / mean_tokens_v * tokens
        fixed, per_token = self.cost.coefficients()
        if per_token <= 0:
            mean_tokens, mean_ns = self.cost.means()
            fixed, per_token = 0.0, mean_ns / mean_tokens  # every token charged the mean, fixed cost included
        fit = int((open_ns - fixed) / per_token)
        return fit if fit >= MIN_CHUNK else 0

    def fits(self, busy_ns: float = 0.0) -> int:
        """Prompt tokens the drafter can prefill in the time of one verify (FIRST_CHUNK until both are
        timed), less `busy_ns` of other work it does beside that verify (drafts), down to MIN_CHUNK."""
        verify = self.verify_ns.value
        if self.cost.samples == 0 or verify is None:
            return FIRST_CHUNK
        verify -= busy_ns
        mean_tokens, mean_ns = self.cost.means()
        fixed, per_token = self.cost.coefficients()
        if per_token > 0 and fixed > max(verify, 0.0):
            # The exchange's fixed cost alone outlasts what is left of the verify (a GPU's eager
            # prefill, a drafter busy with drafts): every chunk stalls the round by at least that,
            # so fewer chunks stall it less in all. A chunk may take up to twice the fixed cost,
            # reached by at most doubling the chunks measured so far.
            return max(MIN_CHUNK, int(min(fixed / per_token, 2 * mean_tokens)))
        if verify <= 0:
            return MIN_CHUNK
        at_mean = verify / (mean_ns / mean_tokens)  # every token charged the mean, fixed cost included
        fit = (verify - fixed) / per_token if per_token > 0 else at_mean
        # Never below the mean's: where the exchange's fixed cost takes most of a verify, the fit
        # leaves almost nothing, yet that cost is paid whatever the chunk, so small chunks only
        # make more rounds pay it. At most twice the mean's: a slope fitted to chunks of nearly
        # one size can be far too flat, and one chunk too large stalls a round.
        return max(MIN_CHUNK, int(min(max(fit, at_mean), 2 * at_mean)))

    def tokens(self, busy_ns: float = 0.0) -> int:
        """This round's budget of drafter prefill tokens (what fits behind a verify beside `busy_ns` of
        drafting, within the cap if one is set)."""
        fits = self.fits(busy_ns)
        return min(self.cap, fits) if self.cap > 0 else fits
