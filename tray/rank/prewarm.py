"""`python -m tray.rank.prewarm PROGRAM [ARGS]`: run a rank's Python program (a script, `-m module` or
`-c code`, as `python` would) while its GPU context is made in the background (cuda backend only)."""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    args = sys.argv[1:]
    if not args:
        raise SystemExit("usage: python -m tray.rank.prewarm (SCRIPT | -m MODULE | -c CODE) [ARGS...]")
    if os.environ.get("TRAY_BACKEND") == "cuda":
        from tray.backend.cuda import prewarm

        prewarm.start(int(os.environ.get("TRAY_DEVICE", "0")))
    if args[0] == "-m" and len(args) > 1:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c" and len(args) > 1:
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
