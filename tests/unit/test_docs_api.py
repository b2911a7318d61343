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
    missing = [n for n in _public(Collectives) if callable(getattr(Collectives, n)) and f"`{n}(" not in API]
    missing += [n for n in tray.__all__ if n not in API]
    assert not missing, f"docs/api.md says nothing of {missing}"


def test_tray_init_has_the_signature_the_reference_gives():
    assert str(inspect.signature(tray.init)) == "(manifest: 'str | None' = None, timeout_s: 'float' = 60.0) -> 'Rank'"
    assert "`tray.init(manifest=None, timeout_s=60.0) -> Rank`" in API


def test_collectives_addresses_numpy_ints_host_memory_and_unusual_subclasses():
    """address(): a numpy integer is the address it holds (it has an __array_interface__ of its own, which gave the
    scalar's own address); host memory is refused where the collectives move device memory; a subclass whose
    parameters are named like the wrapper's helpers, or keyword-only, still gets its addresses."""
    import numpy as np
    import pytest

    from tray.backend.base import address
    from tray.errors import UsageError

    p = 94673625796240
    assert address(np.int64(p), "x") == p and address(p + np.int64(8), "x") == p + 8
    host = np.zeros(4)
    assert address(host, "x") == host.__array_interface__["data"][0]
    with pytest.raises(UsageError, match="an array in host memory; these collectives move device memory"):
        address(host, "allreduce send_ptr", device=True)
    with pytest.raises(UsageError, match="got str"):
        address("0x10", "x")

    class Odd(Collectives):
        device_memory = True

        def allreduce(self, send_ptr, recv_ptr, count, dtype, stream=None):
            return send_ptr, recv_ptr

        def allgather(self, send_ptr, recv_ptr, count, dtype, *, stream=None):   # keyword-only stream
            return send_ptr, recv_ptr, stream

        def reducescatter(self, send_ptr, recv_ptr, count, dtype, stream=None):
            return None

        def alltoall(self, send_ptr, recv_ptr, count, dtype, stream=None):
            return None

        def sendrecv(self, send_ptr, recv_ptr, count, dtype, peer_index, stream=None):
            return None

        def register_window(self, address, nbytes):   # a parameter named as the helper is
            return address

        def close(self):
            return None

    c = Odd()
    assert c.allreduce(np.uint64(16), recv_ptr=np.int32(32), count=1, dtype="f32") == (16, 32)
    assert c.allgather(np.int64(1), 2, 1, "f32", stream=5) == (1, 2, 5)
    assert c.register_window(np.int64(48), 8) == 48
    with pytest.raises(UsageError, match="register_window address: an array in host memory"):
        c.register_window(host, 8)


def test_addresses_refuse_scalars_and_bools_and_leave_delegating_or_odd_methods_working():
    """A numpy float scalar or 0-d array has an __array_interface__ of its own few bytes; True is no address. A
    subclass method taking *args (delegating), with a parameter named `type`, or a lambda, still works."""
    import numpy as np
    import pytest

    from tray.backend.base import address
    from tray.errors import UsageError

    for bad in (np.float64(3.0), np.array(7), True):
        with pytest.raises(UsageError):
            address(bad, "x")

    class Base(Collectives):
        def allreduce(self, send_ptr, recv_ptr, count, dtype, stream=None):
            return send_ptr, recv_ptr

        def allgather(self, send_ptr, recv_ptr, count, type, stream=None):   # `type` as a parameter's name
            return send_ptr, type

        reducescatter = lambda self, send_ptr, recv_ptr, count, dtype, stream=None: send_ptr  # noqa: E731
        alltoall = reducescatter

        def sendrecv(self, send_ptr, recv_ptr, count, dtype, peer_index, stream=None):
            return None

        def close(self):
            return None

    class Delegating(Base):
        def allreduce(self, *args, **kwargs):
            return super().allreduce(*args, **kwargs)

    assert Delegating().allreduce(np.int64(8), 16, 1, "f32") == (8, 16)
    assert Base().allgather(np.int64(8), 16, 1, "f32") == (8, "f32")
    assert Base().reducescatter(np.int64(24), 0, 1, "f32") == 24


def test_collectives_addresses_refuse_strided_tensors_and_arrays():
    """A tensor or array is its first element's address, and the collectives take `count` elements from there
    without gaps: a strided one (a column, a transpose) would be read or written as other elements than its own,
    silently, so it is refused; contiguous ones, slices of rows and size-1 dimensions included, are taken."""
    import numpy as np
    import pytest

    from tray.backend.base import address
    from tray.errors import UsageError

    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert address(a[2:4], "x") == a.__array_interface__["data"][0] + 2 * 16   # rows: contiguous
    assert address(a[:1, :], "x") == a.__array_interface__["data"][0]
    assert address(a[:, :1][:1], "x") == a.__array_interface__["data"][0]      # one element, whatever the strides
    for strided in (a[:, 1], a.T, a[::2]):
        with pytest.raises(UsageError, match="allreduce send_ptr: a non-contiguous array"):
            address(strided, "allreduce send_ptr")
    torch = pytest.importorskip("torch", reason="torch (CPU) is installed by `make test`; this run has none")
    t = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    assert address(t[2:4], "x") == t.data_ptr() + 2 * 16
    for strided in (t[:, 1], t.t(), t[::2]):
        with pytest.raises(UsageError, match=r"allreduce recv_ptr: a non-contiguous tensor \(shape \[\d+(, \d+)?\]"):
            address(strided, "allreduce recv_ptr")
    # torch's channels_last (a conv's weights, gradients): dense, from its first element on; taken as before
    w = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert address(w, "x") == w.data_ptr()
    v = torch.zeros(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    assert address(v, "x") == v.data_ptr()
    with pytest.raises(UsageError, match="a non-contiguous tensor"):
        address(w[:, :2], "x")  # channels of a channels_last tensor: gaps


def test_every_list_of_the_heads_exit_codes_has_them_all():
    from tray.cli import LAUNCH_EPILOG

    texts = {"README.md": (REPO / "README.md").read_text(), "docs/cli.md": (REPO / "docs" / "cli.md").read_text(),
             "docs/api.md": API, "tray launch --help": LAUNCH_EPILOG}
    for where, text in texts.items():
        said = " ".join(text.split())  # the lists wrap across lines
        missing = [c for c in ("0 ", "1 a rank failed", "2 usage", "3 ", "130 interrupted") if c not in said]
        assert not missing, f"{where}: the head's exit codes lack {missing}"


class _Plain(Collectives):
    """Collectives that say what they were given (the addresses), for the wrapper's tests."""

    def __init__(self, size=2, log=None):
        from tray.backend.base import GroupInfo

        self.group = GroupInfo(name="g", members=tuple(range(size)), index=0)
        self.log = log if log is not None else []

    def allreduce(self, send_ptr, recv_ptr, count, dtype, stream=None):
        self.log.append("body")
        return send_ptr, recv_ptr

    def allgather(self, send_ptr, recv_ptr, count, dtype, stream=None):
        return send_ptr, recv_ptr

    def reducescatter(self, send_ptr, recv_ptr, count, dtype, stream=None):
        return send_ptr, recv_ptr

    def alltoall(self, send_ptr, recv_ptr, count, dtype, stream=None):
        return send_ptr, recv_ptr

    def sendrecv(self, send_ptr, recv_ptr, count, dtype, peer_index, stream=None):
        return send_ptr, recv_ptr

    def close(self):
        return None


def _temporary(log: list[str]) -> type:
    """A tensor-like class whose objects say in `log` when they are freed."""

    class Temporary:
        def data_ptr(self):
            return 4096

        def __del__(self):
            log.append("freed")

    return Temporary


def test_a_temporary_given_to_a_collective_lives_until_the_collective_returns():
    """`c.allreduce(torch.full((1024,), 7.0), y, 1024, "f32")`: the wrapper rebound its parameter to the address,
    which dropped the last reference to the temporary (the callee owns its arguments): the tensor was freed before
    the collective read it (garbage in y, and a SIGSEGV later on 4 ranks)."""
    log: list[str] = []
    Temporary = _temporary(log)

    c = _Plain(log=log)
    got = c.allreduce(Temporary(), 8192, 1, "f32")  # NOTE: not inside an assert, whose rewriting keeps the temporary
    assert got == (4096, 8192)
    assert log == ["body", "freed"]


def test_a_typed_object_of_another_element_type_or_too_small_is_refused_by_name():
    """A float32 array given to a bf16 allreduce was added as bf16, silently; an array smaller than what the
    collective writes there was written past its end."""
    import numpy as np
    import pytest

    from tray.errors import UsageError

    c = _Plain(size=4)
    f32, ok = np.zeros(64, np.float32), np.zeros(256, np.float32)
    with pytest.raises(UsageError, match=r"its send is a float32 array of 256 B, and the collective reads 512 B"):
        c.allreduce(f32, ok, np.int64(128), "f32")  # a numpy count is judged as an int
    with pytest.raises(UsageError, match=r"its send is a complex64 array, whose elements it would add as f32: pass a "
                                         r"f32 array; to reduce its bytes"):
        c.allreduce(np.zeros(8, np.complex64), ok, 8, "f32")  # no dtype of tray's to name
    with pytest.raises(UsageError, match=r"^allreduce of 64 bf16: its send is a float32 array, whose elements it would "
                                         r"add as bf16: pass dtype 'f32', or a bf16 array; to reduce its bytes as "
                                         r"bf16 elements on purpose, reinterpret it first"):
        c.allreduce(f32, ok, 64, "bf16")
    with pytest.raises(UsageError, match=r"^reducescatter of 64 f32: its send is a float32 array of 256 B, and the "
                                         r"collective reads 1024 B there \(4 blocks of 64, one per member\): pass a "
                                         r"count that fits it, or a larger array$"):
        c.reducescatter(f32, ok, 64, "f32")
    with pytest.raises(UsageError, match=r"^allgather of 64 f32: its receive is a float32 array of 256 B, and the "
                                         r"collective writes 1024 B there"):
        c.allgather(f32, f32, 64, "f32")
    # a byte mover takes raw bits of another type; what fits is taken; an int says nothing of itself
    assert c.allgather(np.zeros(64, np.uint32), ok, 64, "f32")[0] > 0
    assert c.alltoall(ok, ok, 64, "f32")[0] > 0 and c.allreduce(f32, 1234, 64, "f32")[1] == 1234
    torch = pytest.importorskip("torch", reason="torch (CPU) is installed by `make test`; this run has none")
    with pytest.raises(UsageError, match=r"its receive is a float32 tensor, whose elements it would add as bf16: pass "
                                         r"dtype 'f32'"):
        c.allreduce(torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64), 64, "bf16")
    assert c.allreduce(torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16), 64, "bf16")


def test_a_strided_receive_is_told_to_copy_the_result_back_not_to_pass_a_copy():
    """The advice for a strided send (`.contiguous()`) given for a receive had the result written into a copy the
    caller never sees."""
    import numpy as np
    import pytest

    from tray.backend.base import address
    from tray.errors import UsageError

    a = np.zeros((8, 4), np.float32)
    with pytest.raises(UsageError, match=r"receive into a contiguous array .* and copy that into this one .*: a "
                                         r"\.contiguous\(\) copy given here would take the result in its place$"):
        address(a[:, 1], "allreduce recv_ptr")
    with pytest.raises(UsageError, match=r"pass a contiguous one \(\.contiguous\(\) or np\.ascontiguousarray"):
        address(a[:, 1], "allreduce send_ptr")


def test_a_collective_bound_under_another_name_and_a_parameter_named_as_the_wrappers_own_still_hold():
    """`allreduce = _reduce` was judged as `_reduce` (no check at all), and a parameter named `_tray_a0` was overwritten
    by the wrapper's own local, freeing a temporary again."""
    import numpy as np
    import pytest

    from tray.errors import UsageError

    log: list[str] = []
    Temporary = _temporary(log)

    class Renamed(_Plain):
        def _reduce(self, send_ptr, recv_ptr, count, dtype, stream=None):
            return send_ptr, recv_ptr

        allreduce = _reduce

        def allgather(self, _tray_a0, recv_ptr, count, dtype, stream=None):
            log.append("body")
            return _tray_a0, recv_ptr

    c = Renamed()
    with pytest.raises(UsageError, match="^allreduce of 8 bf16: its send is a float32 array"):
        c.allreduce(np.zeros(8, np.float32), 8192, 8, "bf16")
    got = c.allgather(Temporary(), 8192, 1, "f32")
    assert got == (4096, 8192) and log == ["body", "freed"], log
