"""Checks of the arguments a rank program passes to `Rank`'s calls: a wrong type is a UsageError saying what the
call takes, what it got and what to pass, never the TypeError or AttributeError of whatever first touched it."""

from __future__ import annotations

from tray.errors import UsageError
from tray.text import int_index, seconds_value


def shown(value: object) -> str:
    """`value` for a message: its type and a bounded repr."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


def name_arg(call: str, what: str, value: object) -> str:
    """A name (of a buffer, group, kernel, program, state, topic): a str (a subclass too)."""
    if not isinstance(value, str):
        raise UsageError(f"{call}: {what} is a name, a str, got {shown(value)}; pass the name as the manifest "
                         "declares it (a string)")
    return value


def seconds_arg(call: str, value: object) -> float:
    """A timeout in seconds: a real number > 0 (inf: no end); not a bool, a string or NaN."""
    t = seconds_value(value)
    if not t > 0:
        raise UsageError(f"{call}: timeout_s must be a number of seconds > 0 (inf: no end), got {shown(value)}")
    return t


def stream_arg(call: str, value: object) -> int | None:
    """A stream handle: None or an int >= 0 (torch's `cuda_stream`, a numpy integer too); not a bool."""
    if value is None:
        return None
    try:
        handle = int_index(value)
    except TypeError:
        handle = None
    if handle is None or handle < 0:
        raise UsageError(f"{call}: stream must be an int CUDA stream handle >= 0 (e.g. "
                         f"torch.cuda.current_stream().cuda_stream) or None for the rank's own, got {shown(value)}")
    return handle


def int_arg(call: str, what: str, value: object) -> int:
    """An integer (a numpy integer is the int it holds); not a bool, a float or a string."""
    try:
        return int_index(value)
    except TypeError:
        raise UsageError(f"{call}: {what} must be an int, got {shown(value)}") from None
