"""Numbers that look drawn at random from an integer alone: the same in every process and run, with no state to
keep or send, so a worker can place record ``i`` without a table of all of them."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mixed(x: int) -> int:
    """A 64-bit integer that looks random from ``x`` (SplitMix64's finaliser over ``x``'s 64 bits): neighbouring
    and periodic inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
