"""Gates: pass/fail qualification runs of a tray (`tray gate peer-barrier`)."""

from __future__ import annotations

GATES = ("peer-barrier",)
