"""`--manifest NAME`: built-in manifests by name; a file of that name wins."""

from __future__ import annotations

import pytest

from tray.errors import UsageError
from tray.manifest.names import builtin_manifests, format_builtins, resolve_manifest


def test_manifest_names_resolve_to_builtins_and_paths_win(tmp_path, monkeypatch):
    known = builtin_manifests()
    assert {"peer_fill", "ep_moe", "peer_barrier"} <= set(known)
    assert all(known.values()), known  # every built-in says what it is
    assert resolve_manifest("peer_fill").endswith("peer_fill.json")
    assert resolve_manifest("ep_moe.json").endswith("ep_moe.json")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "peer_fill").write_text("{}")  # a file of that name wins over the built-in
    assert resolve_manifest("peer_fill") == "peer_fill"
    with pytest.raises(UsageError, match=r"did you mean 'ep_moe'\?.*built-in: .*peer_barrier"):
        resolve_manifest("ep_mo")
    with pytest.raises(UsageError, match="no manifest file 'nothing/here.json'"):
        resolve_manifest("nothing/here.json")
    listing = format_builtins().splitlines()
    assert len(listing) == len(known) and listing[0].split()[0] == sorted(known)[0]

