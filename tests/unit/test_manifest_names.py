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


def test_a_relative_manifest_not_found_says_where_it_was_looked_for_and_names_the_one_beside_the_program(
        tmp_path, monkeypatch):
    """From /tmp, `tray launch -n 2 prog/p.py` whose ranks call tray.init(manifest="m.json"), with prog/m.json beside
    the program: "no manifest file 'm.json' ...; did you mean the file 'x.json'?", an unrelated file of /tmp."""
    (tmp_path / "prog").mkdir()
    (tmp_path / "prog" / "m.json").write_text("{}")
    (tmp_path / "x.json").write_text("{}")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as info:
        resolve_manifest("m.json", "prog/p.py")
    said = str(info.value)
    assert said.startswith(f"no manifest file 'm.json' in {tmp_path} (the working directory: a relative path is taken "
                           f"from there) and no built-in manifest of that name; the program's directory has "
                           f"'{tmp_path / 'prog' / 'm.json'}': give that path (built-in: "), said
    with pytest.raises(UsageError) as info:
        resolve_manifest("m.json")
    assert "did you mean" not in str(info.value) and "x.json" not in str(info.value), info.value
    with pytest.raises(UsageError, match=r"did you mean the file 'conf/my.json'\?"):
        resolve_manifest("conf/my.jsn")
    with pytest.raises(UsageError, match=r"^no manifest file '/nowhere/m.json' and no built-in"):
        resolve_manifest("/nowhere/m.json")
