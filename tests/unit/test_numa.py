"""GPU -> NUMA node from sysfs (a fake sysfs tree), cpulists, and the -1 case."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture
def numa(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAY_SYSFS", str(tmp_path))
    import tray.numa

    mod = importlib.reload(tray.numa)
    yield mod, tmp_path
    monkeypatch.delenv("TRAY_SYSFS")
    importlib.reload(tray.numa)


def _device(root, bus, node):
    d = root / "bus/pci/devices" / bus
    d.mkdir(parents=True)
    (d / "numa_node").write_text(f"{node}\n")


def test_cpulist_parsing(numa):
    mod, _ = numa
    assert mod.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert mod.parse_cpulist("") == ()


def test_gpu_node_and_cpus(numa):
    mod, root = numa
    _device(root, "0000:1b:00.0", 1)
    node = root / "devices/system/node/node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("32-35\n")
    # CUDA prints an 8-digit PCI domain; sysfs has 4
    p = mod.placement_for("00000000:1B:00.0")
    assert p.node == 1 and p.cpus == (32, 33, 34, 35) and p.bound
    assert mod.prepare_binding(p) is not None


def test_minus_one_means_unbound(numa):
    mod, root = numa
    _device(root, "0000:2a:00.0", -1)
    p = mod.placement_for("0000:2a:00.0")
    assert p.node == -1 and not p.bound
    assert mod.prepare_binding(p) is None
    assert mod.placement_for(None).node == -1
    assert mod.gpu_numa_node("0000:ff:00.0") == -1  # no such device
