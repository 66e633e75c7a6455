"""Counter-based Gumbel noise: a pure function of (seed, position, stream, token id).

Seeded requests draw every random number from here instead of from a stateful
torch.Generator, so a token's noise does not depend on how many numbers were
drawn before it: not on k, on the batch, on whether a drafter was consulted, or
on which service computes it. The uniforms come from integer hashing on int64
tensors, exact on any device, so the drafter and the verifier use the same ones
even when one runs on a CPU and the other on a GPU. (The Gumbel transform's logs
may differ in the last bit between devices; that can change whether a draft is
accepted in a near-tie, never which token the verifier emits.)

Keys are built in Python from the request's 64-bit seed with SplitMix64 (one key
per (seed, position, stream)); the per-token value is Wellons' lowbias32 hash of
the key mixed with the token id, computed only at the tokens that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Annotations only, and tensor methods rather than torch functions below: the gateway
    # imports splitmix64 from here and must not import torch.
    import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_TOP_BIT32 = 1 << 31
# The float32 uniform keeps 24 of the 32 hash bits, as torch.rand does for float32:
# u = (h + 0.5) / 2**24, rounded to float32 (exact below 2**23; above, h + 0.5 rounds to an
# even integer), then capped at the largest float32 below 1, where the top value rounded to
# 1.0 and made the Gumbel noise infinite. So u lies strictly inside (0, 1) and -log(-log(u))
# is at most GUMBEL_MAX.
_UNIFORM_BITS = 24
_BELOW_ONE = 1.0 - 2.0**-24
# The largest value `gumbel` returns: -log(-log(u)) at the largest u, 16.6355 (float32);
# what bounds a token's noisy score from above, with a margin for another device's logs.
GUMBEL_MAX = 16.64

# Streams separate independent uses of one seed at one position. The drafter and
# the verifier share TOKEN on purpose: that shared noise is the coupling.
TOKEN_STREAM = 0


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int, stream: int = TOKEN_STREAM) -> int:
    """The 32-bit key of one (seed, position, stream); any int seed (taken mod 2**64)."""
    h = splitmix64(seed & _MASK64)
    h = splitmix64(h ^ (position & _MASK64))
    h = splitmix64(h ^ (stream & _MASK64))
    return h >> 32


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """x = (x * c) mod 2**32 in place, for int64 x in [0, 2**32), without overflowing int64.

    x * c would overflow for c >= 2**31 (signed overflow, which torch does not
    define), so the top bit of c is applied as a shift of x's lowest bit.
    """
    if c < _TOP_BIT32:
        return x.mul_(c).bitwise_and_(_MASK32)
    low_bit = (x & 1) << 31
    return x.mul_(c - _TOP_BIT32).add_(low_bit).bitwise_and_(_MASK32)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    # A bijection on 32-bit values with near-ideal avalanche (C. Wellons, "hash prospector"),
    # in place: the vocabulary-wide tensors of a seeded round make temporaries the cost.
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def token_hashes(tokens: torch.Tensor) -> torch.Tensor:
    """The per-token half of `hash32`: depends on the token id only, so a caller may keep it."""
    # Hashing the token first makes nearby ids unrelated before they meet the key.
    return _lowbias32_(tokens & _MASK32)


def hash32(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """32-bit hash of (key, token) pairs: int64 tensors that broadcast together, keys < 2**32."""
    return hash32_of(keys, token_hashes(tokens))


def hash32_of(keys: torch.Tensor, hashed_tokens: torch.Tensor) -> torch.Tensor:
    """`hash32` from the tokens' `token_hashes` (left unchanged)."""
    return _lowbias32_(keys ^ hashed_tokens)


def uniform(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) at (key, token) pairs (broadcast)."""
    return _uniform_of(hash32(keys, tokens))


def _uniform_of(hashes: torch.Tensor) -> torch.Tensor:
    top = (hashes >> (32 - _UNIFORM_BITS)).float()
    return top.add_(0.5).mul_(1.0 / (1 << _UNIFORM_BITS)).clamp_(max=_BELOW_ONE)


def gumbel(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise at (key, token) pairs (float32, the broadcast shape of the inputs)."""
    return gumbel_of(keys, token_hashes(tokens))


def gumbel_of(keys: torch.Tensor, hashed_tokens: torch.Tensor) -> torch.Tensor:
    """`gumbel` from the tokens' `token_hashes` (left unchanged)."""
    return _uniform_of(hash32_of(keys, hashed_tokens)).log_().neg_().log_().neg_()
