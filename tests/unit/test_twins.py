"""The host-twin registry: `@tray.twin` registers, the host backend finds it, an unknown kernel is named."""

from __future__ import annotations

import numpy as np
import pytest

import tray
from tray import twins
from tray.backend.host import HostBackend
from tray.errors import UsageError


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(twins, "_TWINS", dict(twins._TWINS))
    return twins


def test_a_user_twin_runs_on_the_host_backend(registry):
    @tray.twin("test_scale")
    def scale(backend, grid, block, dst: int, count: int, factor: float) -> None:
        registry.f32_at(dst, count)[:] *= factor

    assert "test_scale" in registry.registered()
    data = np.arange(4, dtype=np.float32)
    backend = HostBackend.open(0)
    kernel = backend.load_kernel("test_scale", b"", "test_scale", (), False)
    assert kernel is not None
    registry.lookup("test_scale")(backend, (1, 1, 1), (1, 1, 1), data.ctypes.data, 4, 2.0)
    assert data.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_an_unknown_kernel_names_itself_and_how_to_register_a_twin(registry):
    with pytest.raises(UsageError, match=r'kernel \'nope\' has no host twin .*@tray\.twin\("nope"\)'):
        HostBackend.open(0).load_kernel("nope", b"", "nope", (), False)


def test_a_second_twin_under_a_taken_name_is_refused(registry):
    registry.twin("test_once")(lambda *a: None)
    with pytest.raises(UsageError, match="already has a host twin"):

        @registry.twin("test_once")
        def other(*args) -> None:
            pass
