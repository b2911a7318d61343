"""Bounded host waits (tray/backend/wait.py), the words they report (the executor's program descriptions,
captures' trails), the cuda facade's polling waits on a fake driver, and the bench sampler's timings and
figure log on a fake rank."""

from __future__ import annotations

import enum
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tray.backend import wait
from tray.backend.cuda import driver
from tray.bench.timing import MAX_REPS_PER_GRAPH, Sampler
from tray.errors import PeerFailure, SyncTimeout, UsageError
from tray.manifest import load_manifest
from tray.rank.executor import Plan, describe_op, program_title

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    """time.monotonic and time.sleep for a wait: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_a_finished_wait_costs_one_query_and_no_sleep() -> None:
    calls = []
    clock = FakeClock()
    wait.wait_until(lambda: calls.append(1) or True, "x", timeout_s=1.0, clock=clock.clock, sleep=clock.sleep,
                       spin_s=0)
    assert calls == [1] and clock.sleeps == []


def test_a_wait_past_its_deadline_names_what_and_the_last_work(monkeypatch) -> None:
    pending = wait.Pending()
    pending.note("program 'dispatch_nccl' (tokens=128): nccl alltoall on group 'world' (1024 x u32 per member)")
    clock = FakeClock()
    with pytest.raises(SyncTimeout) as info:
        wait.wait_until(lambda: False, "the stream of GPU 1", pending, 0.5, clock=clock.clock, sleep=clock.sleep,
                       spin_s=0)
    err = info.value
    assert isinstance(err, PeerFailure)
    assert 0.5 <= err.waited_s < 0.5 + wait.MAX_SLEEP_S * 1.01
    text = str(err)
    assert text.startswith("the stream of GPU 1 was not done after 0.5 s")
    assert "nccl alltoall on group 'world'" in text and "peer may have diverged" in text
    assert "TRAY_SYNC_TIMEOUT_S (now 0.5 s)" in text
    # the sleeps double from the first to the cap and stay there
    assert clock.sleeps[0] == wait.FIRST_SLEEP_S and max(clock.sleeps) == wait.MAX_SLEEP_S
    assert all(b == min(wait.MAX_SLEEP_S, 2 * a) for a, b in zip(clock.sleeps, clock.sleeps[1:]))


def test_short_waits_spin_without_sleeping() -> None:
    calls = []
    clock = FakeClock()

    def done() -> bool:
        clock.now += 1e-6  # a query takes a microsecond
        calls.append(1)
        return len(calls) > 50

    wait.wait_until(done, "x", timeout_s=1.0, clock=clock.clock, sleep=clock.sleep)
    assert len(calls) == 51 and clock.sleeps == []


def test_work_that_ends_at_the_deadline_is_not_a_hang() -> None:
    clock = FakeClock()
    start = clock.now
    wait.wait_until(lambda: clock.now - start >= 0.25, "x", timeout_s=0.25, clock=clock.clock, sleep=clock.sleep,
                       spin_s=0)


def test_a_failed_query_propagates_as_itself() -> None:
    def broken() -> bool:
        raise driver.CudaError("cuStreamQuery", "stream 0x1", "CUDA_ERROR_ILLEGAL_ADDRESS")

    with pytest.raises(driver.CudaError, match="ILLEGAL_ADDRESS"):
        wait.wait_until(broken, "x", timeout_s=1.0)


def test_the_deadline_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(wait.SYNC_TIMEOUT_ENV, raising=False)
    assert wait.sync_timeout_s() == wait.DEFAULT_SYNC_TIMEOUT_S
    monkeypatch.setenv(wait.SYNC_TIMEOUT_ENV, "0.05")
    assert wait.sync_timeout_s() == 0.05
    t0 = time.monotonic()
    with pytest.raises(SyncTimeout, match=r"now 0\.05 s"):
        wait.wait_until(lambda: False, "x")  # the real clock: a short wait, bounded
    assert time.monotonic() - t0 < 2.0
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv(wait.SYNC_TIMEOUT_ENV, bad)
        with pytest.raises(UsageError, match="TRAY_SYNC_TIMEOUT_S must be a positive, finite number"):
            wait.sync_timeout_s()


def test_pending_collects_a_trail_only_while_capturing() -> None:
    p = wait.Pending()
    p.note("a")
    assert p.last == "a" and p.end_trail() == []
    p.start_trail()
    for text in ("b", "b", "c", "b"):
        p.note(text)
    assert p.end_trail() == ["b", "c", "b"] and p.last == "b"
    p.note("d")
    assert p.end_trail() == []


def describe_program(program: str, vars: dict[str, int], ops) -> str:  # type: ignore[no-untyped-def]
    """What a bound plan of `program` says of itself (a timed-out wait names it)."""
    return Plan(program=program, steps=[], title=program_title(program, vars),
                ops=tuple(describe_op(o) for o in ops)).describe


def test_programs_are_described_with_their_collectives() -> None:
    m = load_manifest(str(REPO / "manifests" / "ep_moe.json"))
    vars_ = {"hidden": 64, "experts": 8, "topk": 2, "ffn": 32, "max_tokens": 4, "tokens": 4, "max_cap": 8, "cap": 8,
             "groups": 2, "blocks": 2, "threads": 64}
    prog = m.resolve(2, vars_).program("dispatch_nccl")
    text = describe_program("dispatch_nccl", {"tokens": 4}, prog.ops)
    assert text == ("program 'dispatch_nccl' (tokens=4): launch ep_dispatch, "
                    "nccl alltoall on group 'world' (8 x u32 per member), "
                    "nccl alltoall on group 'world' (256 x bf16 per member)")
    combine = m.resolve(2, vars_).program("combine")
    assert describe_program("combine", {}, combine.ops) == (
        "program 'combine': launch ep_combine, nccl alltoall across nodes on group 'world' (256 x bf16 per member), "
        "barrier 'world'")


# --- the facade's polling waits, on a fake driver ------------------------------------------------------


class FakeResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_NOT_READY = 600


def fake_cu(results: list[FakeResult]) -> SimpleNamespace:
    """cuStreamQuery / cuEventQuery answering `results` in turn (the last one forever)."""

    def query(_handle: object) -> tuple[FakeResult]:
        return (results.pop(0) if len(results) > 1 else results[0],)

    return SimpleNamespace(CUresult=FakeResult, cuStreamQuery=query, cuEventQuery=query,
                           cuGetErrorString=lambda err: (1, b""))


def test_stream_wait_polls_until_the_stream_is_done(monkeypatch) -> None:
    monkeypatch.setattr(driver, "cu", fake_cu([FakeResult.CUDA_ERROR_NOT_READY] * 3 + [FakeResult.CUDA_SUCCESS]))
    driver.stream_wait(7, "the stream of GPU 0", timeout_s=5.0)
    monkeypatch.setattr(driver, "cu", fake_cu([FakeResult.CUDA_ERROR_NOT_READY, FakeResult.CUDA_SUCCESS]))
    driver.event_wait(8, "the timer's stop event", timeout_s=5.0)


def test_stream_wait_times_out_naming_the_pending_work(monkeypatch) -> None:
    monkeypatch.setattr(driver, "cu", fake_cu([FakeResult.CUDA_ERROR_NOT_READY]))
    pending = wait.Pending()
    pending.note("a replay of a captured graph of: program 'dispatch_nccl': nccl alltoall on group 'world'")
    with pytest.raises(SyncTimeout, match="a replay of a captured graph of: program 'dispatch_nccl'"):
        driver.stream_wait(7, "the stream of GPU 0", pending, timeout_s=0.02)
    with pytest.raises(SyncTimeout, match="the timer's stop event was not done"):
        driver.event_wait(8, "the timer's stop event", pending, timeout_s=0.02)


def test_stream_wait_reports_a_device_fault_at_once(monkeypatch) -> None:
    monkeypatch.setattr(driver, "cu", fake_cu([FakeResult.CUDA_ERROR_ILLEGAL_ADDRESS]))
    monkeypatch.setattr(driver, "_current_ordinal", None)
    with pytest.raises(driver.CudaError, match=r"cuStreamQuery\(stream 0x7\): CUDA_ERROR_ILLEGAL_ADDRESS"):
        driver.stream_wait(7, "x", timeout_s=60.0)


# --- the sampler on a fake rank -------------------------------------------------------------------------


class FakeTimer:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def start(self) -> None:
        self.log.append("start")

    def stop(self) -> None:
        self.log.append("stop")

    def elapsed_s(self) -> float:
        return 1e-4


class FakeGraph:
    def __init__(self, log: list[str], n: int) -> None:
        self.log, self.n, self.closed = log, n, False

    def replay(self) -> None:
        self.log.append(f"replay{self.n}")

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.graphs: list[FakeGraph] = []

    def timer(self) -> FakeTimer:
        return FakeTimer(self.log)

    def capture(self, body) -> FakeGraph:
        self.log.append("capture")
        before = len(self.log)
        body()
        bodies = self.log[before:].count("body")
        del self.log[before:]  # a capture enqueues nothing that runs
        g = FakeGraph(self.log, bodies)
        self.graphs.append(g)
        return g


class FakeRank:
    """Records what the sampler does; `slowest` is the other ranks' single-body time (exchange answers it)."""

    def __init__(self, slowest: float) -> None:
        self.log: list[str] = []
        self.backend = FakeBackend(self.log)
        self.slowest = slowest
        self.topics: list[str] = []

    def barrier_of(self, group: str) -> SimpleNamespace:
        return SimpleNamespace(launch=lambda: self.log.append(f"barrier:{group}"))

    def exchange(self, topic: str, value: float) -> list[float]:
        self.topics.append(topic)
        return [value, self.slowest]

    def synchronize(self) -> None:
        self.log.append("sync")


def test_captured_timing_agrees_reps_and_logs_the_figure(tmp_path) -> None:
    rank = FakeRank(slowest=5e-4)
    log = tmp_path / "samples.jsonl"
    s = Sampler(rank, repeats=3, warmup=1, target_s=2e-3, log_path=log)
    us = s.us_per_call(lambda: rank.log.append("body"), label="T4 dispatch_nccl")
    assert us == pytest.approx(1e-4 / 4 * 1e6)  # 4 bodies per graph: 2 ms / the slowest rank's 0.5 ms
    assert rank.topics == ["tray.bench.timing"]
    assert [g.n for g in rank.backend.graphs] == [1, 4] and all(g.closed for g in rank.backend.graphs)
    assert rank.log.count("replay4") == 1 + 3 and rank.log.count("barrier:world") == 2 + 1 + 3
    line = json.loads(log.read_text())
    assert line["label"] == "T4 dispatch_nccl" and line["timing"] == "captured" and line["reps"] == 4
    assert line["us"] == pytest.approx(us) and len(line["samples_us"]) == 3


def test_eager_timing_never_captures(tmp_path) -> None:
    rank = FakeRank(slowest=1e-9)
    log = tmp_path / "samples.jsonl"
    s = Sampler(rank, repeats=2, warmup=1, target_s=2e-3, log_path=log)
    us = s.us(lambda: rank.log.append("body"), "eager", label="x")
    assert "capture" not in rank.log and not rank.backend.graphs
    assert rank.topics == ["tray.bench.timing.eager"]
    reps = round(2e-3 / 1e-4)  # this rank's 0.1 ms per body is the slowest
    assert reps < MAX_REPS_PER_GRAPH
    # 1 untimed + 2 single timed + (1 warmup + 2 samples) x reps, every timed one after a barrier
    assert rank.log.count("body") == 1 + 2 + 3 * reps and rank.log.count("barrier:world") == 2 + 3
    assert us == pytest.approx(1e-4 / reps * 1e6)
    s.us(lambda: None, "captured", label="y")
    assert [json.loads(x)["timing"] for x in log.read_text().splitlines()] == ["eager", "captured"]
    with pytest.raises(ValueError, match="timing must be one of"):
        s.us(lambda: None, "graph")


# --- what a failed EP bench keeps -----------------------------------------------------------------------


def test_a_failed_ep_bench_keeps_the_figures_taken_before(tmp_path, capsys) -> None:
    from tray.programs.ep_moe.bench import EpBenchArgs, partial_results, salvage

    work = tmp_path / "work"
    (work / "epn").mkdir(parents=True)
    (work / "epn" / "result_r0.json").write_text(json.dumps({"rank": 0, "complete": False, "runs": [{"us": {}}]}))
    lines = [json.dumps({"label": "uniform_T128 sm132 layer", "timing": "captured", "us": 5407.7}),
             '{"label": "uniform_T128 sm132 dispatch_nccl", "tim']  # the second cut short by the kill
    (work / "epn" / "samples_r0.jsonl").write_text("\n".join(lines))
    found = partial_results(work)
    assert list(found) == ["epn"]
    assert found["epn"]["results"][0]["complete"] is False
    assert found["epn"]["samples"]["samples_r0.jsonl"] == [json.loads(lines[0])]

    out = tmp_path / "ep.json"
    a = EpBenchArgs(nprocs=2, backend="host", json_path=str(out))
    salvage(a, work, "the epn tray failed (exit 1): SyncTimeout ...", 12.5)
    report = json.loads(out.read_text())
    assert report["partial"] is True and report["error"].startswith("the epn tray failed")
    assert report["trays"]["epn"]["samples"]["samples_r0.jsonl"][0]["us"] == 5407.7
    assert "PARTIAL results (1 figure(s)" in capsys.readouterr().err
    salvage(EpBenchArgs(nprocs=2, backend="host"), work, "x", 1.0)
    assert "1 figure(s) were taken before the failure; pass --json PATH" in capsys.readouterr().err


# --- the cuda backend's waits and graphs, on a fake driver -------------------------------------------------


def test_cuda_backend_sync_names_the_graph_replayed_and_closes_promptly(monkeypatch) -> None:
    from tray.backend.base import DeviceInfo
    from tray.backend.cuda.backend import CLOSE_AFTER_TIMEOUT_S, CudaBackend

    monkeypatch.setattr(driver, "cu", fake_cu([FakeResult.CUDA_ERROR_NOT_READY]))  # the stream never ends
    launched = []
    for name in ("ctx_set_current", "stream_begin_capture"):
        monkeypatch.setattr(driver, name, lambda *a: None)
    monkeypatch.setattr(driver, "stream_end_capture", lambda s: "graph")
    monkeypatch.setattr(driver, "graph_instantiate", lambda g: "exec")
    monkeypatch.setattr(driver, "graph_launcher", lambda e, s: lambda: launched.append(e))
    monkeypatch.setenv(wait.SYNC_TIMEOUT_ENV, "0.05")
    backend = CudaBackend(DeviceInfo(0, "GPU-x", "0000:00:00.0", -1), device=0, context=None, stream=7,
                          capability=(9, 0))
    graph = backend.capture(lambda: [backend.last_work.note(f"program {p!r}") for p in ("a", "b", "a")])
    backend.last_work.note("program 'c'")
    graph.replay()
    assert launched == ["exec"]
    with pytest.raises(SyncTimeout, match="the stream of GPU 0 was not done") as info:
        backend.synchronize()
    assert "a replay of a captured graph of: program 'a'; program 'b'; program 'a'" in str(info.value)
    assert backend._timed_out and CLOSE_AFTER_TIMEOUT_S < wait.DEFAULT_SYNC_TIMEOUT_S
