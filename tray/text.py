"""Small text checks shared by the parsers of names, ids, numbers and messages."""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Iterable


def is_digits(s: str) -> bool:
    """Whether `s` is a non-negative integer in ASCII digits. str.isdigit() alone passes '²' (which int() refuses)
    and '٠' (which int() reads as 0): an identity or topic carrying them must not pass for a number."""
    return s.isascii() and s.isdigit()


def is_bool(value: object) -> bool:
    """Python's bool or numpy's (np.True_, a 0-d bool array): what a count or a timeout never is."""
    return isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b"


def seconds_value(value: object) -> float:
    """`value` as a float number of seconds, NaN for what is no number (a bool, numpy's too, a str, bytes, what
    float() refuses); an int beyond a float's range is +-inf. The caller refuses what is not > 0."""
    if isinstance(value, (str, bytes)) or is_bool(value):
        return math.nan
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond a float's range: an endless wait when positive
        return math.inf if operator.index(value) > 0 else -math.inf  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def int_index(value: object) -> int:
    """The int an integer holds (a numpy integer's too, as `operator.index`), never a bool's: neither Python's nor
    numpy's, which numpy before 2.3 still gives an `__index__` (deprecated) that takes np.True_ for 1. Raises
    TypeError for what is no integer."""
    if is_bool(value):
        raise TypeError(f"{type(value).__name__} is a bool, not an integer")
    return operator.index(value)  # type: ignore[arg-type]


def ranks_text(ranks: Iterable[int]) -> str:
    """'rank 2' / 'ranks 2,3' for a message, in the order given."""
    rs = list(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(str(r) for r in rs)


def printable(s: str) -> str:
    """`s` with every character a terminal would act on (controls, escapes) written as its escape: a name from
    outside (a stranger's socket identity) said in a line of ours."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def path_text(path: str | os.PathLike[str]) -> str:
    """`path` as UTF-8 text whatever its bytes: those that are not UTF-8 as \\xNN (for a message, or the wire)."""
    return os.fsencode(path).decode(errors="backslashreplace")


def text_path(text: str) -> str:
    """The path `path_text` wrote as `text`, as the file system names it."""
    return os.fsdecode(re.sub(rb"\\x([0-9a-f]{2})", lambda m: bytes([int(m[1], 16)]), text.encode()))
