"""Small text checks shared by the parsers of names, ids and messages."""

from __future__ import annotations


def is_digits(s: str) -> bool:
    """Whether `s` is a non-negative integer in ASCII digits. str.isdigit() alone passes '²' (which int() refuses)
    and '٠' (which int() reads as 0): an identity or topic carrying them must not pass for a number."""
    return s.isascii() and s.isdigit()
