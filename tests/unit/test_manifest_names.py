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
    with pytest.raises(UsageError, match=r"the manifest's name is empty .*or leave --manifest out for the default"):
        resolve_manifest("")  # `--manifest "$M"` with M unset: refused, not the default manifest
    listing = format_builtins().splitlines()
    assert len(listing) == len(known) and listing[0].split()[0] == sorted(known)[0]



def test_a_manifest_that_is_a_directory_is_said_to_be_one(tmp_path, monkeypatch):
    """It was "no manifest file 'conf' and no built-in manifest of that name", of a directory that is there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    with pytest.raises(UsageError, match=r"^manifest 'conf' is a directory, not a manifest file; give the manifest's "
                                         r"JSON file$"):
        resolve_manifest("conf")
    (tmp_path / "conf" / "m.json").write_text("{}")
    with pytest.raises(UsageError, match=r"a directory, not a manifest file; give the manifest's JSON file \(in it: "
                                         r"m.json\)$"):
        resolve_manifest("conf/")
    (tmp_path / "peer_fill").mkdir()  # a directory of a built-in's name does not hide the built-in
    assert resolve_manifest("peer_fill").endswith("peer_fill.json")


def test_a_manifest_on_a_pipe_is_named_a_pipe(tmp_path, monkeypatch):
    """`--manifest /dev/stdin` fed by a pipe, `<(...)`, a FIFO: said to be a pipe (every rank reads the file by its
    path), not "no manifest file" for a path that is there; a directory of a built-in's name hides nothing."""
    import os

    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match=r"manifest '.*m.json' is a FIFO \(a pipe\), not a regular file: every rank "
                                         r"reads the manifest by its path.*save it to a file"):
        resolve_manifest(str(fifo))
    r, w = os.pipe()
    try:
        with pytest.raises(UsageError, match=f"manifest '/dev/fd/{r}' is a FIFO"):
            resolve_manifest(f"/dev/fd/{r}")
    finally:
        os.close(r)
        os.close(w)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "peer_fill").mkdir()
    assert resolve_manifest("peer_fill").endswith("peer_fill.json")


def test_a_file_name_close_to_one_there_is_suggested_and_long_descriptions_are_cut(tmp_path, monkeypatch):
    (tmp_path / "my.json").write_text("{}")
    with pytest.raises(UsageError, match=r"did you mean the file '.*/my\.json'\?"):
        resolve_manifest(str(tmp_path / "my.jsn"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"did you mean the file 'my\.json'\?"):
        resolve_manifest("my.jsn")
    with pytest.raises(UsageError) as err:  # nothing close: no file suggested
        resolve_manifest("other.txt")
    assert "the file" not in str(err.value)
    known = builtin_manifests()
    for line in format_builtins().splitlines():
        name, text = line.split(maxsplit=1)
        assert len(text) <= 104 and (text == known[name] or (text.endswith(" ...") and
                                                              known[name].startswith(text[:-4]))), line
