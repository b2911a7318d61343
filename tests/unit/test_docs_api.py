"""docs/api.md against the code: every public call of a Rank, of the collectives and of the package is in the
reference (a method added without a word there fails here)."""

from __future__ import annotations

import inspect

from conftest import REPO

import tray
from tray.backend.base import Collectives
from tray.rank import Rank

API = (REPO / "docs" / "api.md").read_text()


def _public(cls: type) -> list[str]:
    return [n for n, _ in inspect.getmembers(cls) if not n.startswith("_")]


def test_every_public_call_of_a_rank_is_in_the_reference():
    missing = [n for n in _public(Rank) if f"`{n}(" not in API and f"`{n}`" not in API]
    assert not missing, f"docs/api.md says nothing of Rank.{missing}"


def test_every_collective_and_every_name_tray_exports_is_in_the_reference():
    missing = [n for n in _public(Collectives) if n != "group" and f"`{n}(" not in API]
    missing += [n for n in tray.__all__ if n not in API]
    assert not missing, f"docs/api.md says nothing of {missing}"


def test_tray_init_has_the_signature_the_reference_gives():
    assert str(inspect.signature(tray.init)) == "(manifest: 'str | None' = None, timeout_s: 'float' = 60.0) -> 'Rank'"
    assert "`tray.init(manifest=None, timeout_s=60.0) -> Rank`" in API
