"""The examples run as documented, on the host backend."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import REPO

EXAMPLES = REPO / "examples"


def test_torch_ep_dispatch_on_host(tray_env):
    pytest.importorskip("torch", reason="torch (CPU) is installed by `make test`; this run has none")
    n = 2
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", str(n), "--backend", "host", "--manifest",
                        str(EXAMPLES / "torch_ep_dispatch.json"), str(EXAMPLES / "torch_ep_dispatch.py"),
                        tray_env.marker], timeout_s=120)
    assert run.returncode == 0, run.output
    rows = [int(m) for m in re.findall(r"3 dispatches, (\d+) rows received from 2 ranks, byte-exact", run.stdout)]
    assert len(rows) == n, run.stdout
    steps, tokens, topk = 3, 16, 2  # the example's STEPS and its manifest's vars
    assert sum(rows) == steps * n * tokens * topk, rows  # every (token, k) pair arrived exactly once
