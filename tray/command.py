"""The `tray` command's entry point (`tray` on PATH and `python -m tray`), kept apart from tray.cli so a Ctrl-C
while the command is still loading (its imports take ~50-100 ms) ends it in one line and exit 130, as one during a
launch does, rather than in a traceback through the import machinery: nothing was started then."""

from __future__ import annotations

import sys
from typing import NoReturn


def program() -> NoReturn:
    try:
        from tray.cli import program as run
    except KeyboardInterrupt:
        try:
            sys.stderr.write("tray: interrupted while the command was loading; nothing was started\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # stderr closed or gone: the status says it
            pass
        raise SystemExit(130) from None
    run()
