"""The rank side of `tray bench ep-moe`: run as `python -m tray.programs.ep_moe.rank_program CONFIG` inside a
tray launched with manifests/ep_moe.json (the bench, tray/programs/ep_moe/bench.py, writes CONFIG and each
rank's routing).

Per run (token count, routing): upload the router's output (topk_idx, topk_w) and the tokens, run the
layer eagerly over peer buffers (standard and low-latency mode) and over NCCL, check what the device
layout reports (rows per expert, dropped pairs, bad ids) against the head's prediction, save the outputs
(the head compares them with EP1 byte for byte); then time every phase captured, at each SM budget;
then replay the captured layer once more and check its output equals the eager one. A 1-rank tray is
EP1: the same programs (the dispatch is a local copy), no NCCL path, plus a float64 reference of sampled
tokens. In a job of several nodes (world spanning nodes: no peer mappings across them) the peer path's
dispatch and combine write this node's members through the peer tables and stage the other nodes' rows
locally, and an all-to-all across nodes carries those (manifests/ep_moe.json, "stage" and "across"); the
NCCL path runs as on one node; the low-latency mode and the ceiling (peer-only) are not run there.

The NCCL path's programs are timed as cfg["nccl_timing"] says: "captured" (default: graphs, as the peer
path) or "eager" (launched from Python between an eager barrier and device events, the peer path's
dispatch/combine/layer timed the same way beside them as `eager_*`, and its after-the-timing check an
eager rerun). With cfg["ll_phases"] (one node, cuda) each run then times the low-latency kernels' diagnosis
builds and records where their time goes, phase by phase (MoeRank.ll_phase_figures). Each figure's timing is
recorded in the run's `timing`. After every figure this rank's
result file is rewritten (`"complete": false` until the end), and the sampler appends each figure to
`samples_<tag>.jsonl`, so a run that hangs or dies keeps what was measured before it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tray.errors import TrayError
from tray.programs.ep_moe.gemm_tile import WGMMA_CAPABILITY

# NOTE: bf16 NaN in both halves of a u32: outputs are poisoned with it before each checked run.
POISON_WORD = 0x7FC07FC0
FILL_BLOCK = 256
# NOTE: grid-stride kernels: enough blocks to fill any GPU, bounded so tiny launches stay tiny.
MAX_FILL_GRID = 16384
SEED_X, SEED_W13, SEED_W2 = 1, 2, 3
# NOTE: threads per block of the data-movement kernels (their __launch_bounds__): with `blocks` blocks a
# launch occupies at most `blocks` SMs, so blocks is the SM budget.
MOVE_THREADS = 512
# the program of a whole layer on each path ("ll": the low-latency mode, one kernel per direction)
# ("fp8": the peer path with the FP8 dispatch, --dispatch bf16,fp8)
LAYER_OF = {"peer": "layer", "ll": "layer_ll", "nccl": "layer_nccl", "fp8": "layer_fp8"}
# the kernels of the device-count-driven expert phase, per --gemm that uses them (masked: mma.sync, any size;
# wgmma: Hopper warpgroup MMA, sm_90a only: a 4-stage ring, the weights by TMA, the gate/up GEMM writing
# silu(gate) * up itself); the others are never compiled
GEMM_KERNELS = {
    "ep_masked_gemm": ("masked",),
    "ep_masked_gemm_gather": ("masked",),
    "ep_wgmma_gemm": ("wgmma",),
    "ep_wgmma_swiglu_gather": ("wgmma",),
    "ep_silu_mul_rows": ("masked",),
}
# the program of the expert phase per device-count-driven --gemm.
# NOTE: one wgmma program at every batch: with the gate/up GEMM in SwiGLU mode the 4-stage ring was the faster at
# 4096 tokens per EP2 rank too (one H200, phases timed in alternation: 6148 / 4858 µs uniform / zipf against
# 6695 / 5268 for 3 stages; at 128 tokens 2618 / 2468 against 2710 / 2550; bench/results/h200/
# expert_gemm_swiglu_stages.json)
EXPERTS_PROGRAM = {"masked": "experts_masked", "wgmma": "experts_wgmma"}
# the low-latency kernels' diagnosis build (-DLL_PHASES=1) and its clock: loaded only for --ll-phases (cuda only)
LL_PHASE_KERNELS = ("ep_dispatch_ll_phases", "ep_combine_ll_phases", "ep_ll_clock")
# NOTE: ep_ll_clock's spin in the ll_clock program (manifests/ep_moe.json): 1 ms, so a 1 µs globaltimer granularity
# costs at most 0.1 % of the measured SM clock
LL_CLOCK_SPIN_NS = 1_000_000
# err[0] bits of the low-latency kernels (ep_moe.cu): a member's flag never came; the grid barrier never flipped
LL_WAIT_TIMEOUT, LL_GRID_TIMEOUT = 4, 16


def resolve_gemm(gemm: str, backend: str, capability: tuple[int, int] | None) -> str:
    """The expert GEMMs `--gemm` names on this rank's device: 'auto' is wgmma on a cuda device of compute
    capability 9.0 (faster at every batch size measured on H200, bench/results/h200/expert_gemm_wgmma.json), else
    masked (mma.sync; the host backend's twins); any other name is itself."""
    if gemm != "auto":
        return gemm
    return "wgmma" if backend == "cuda" and capability is not None and tuple(capability) == WGMMA_CAPABILITY \
        else "masked"


def nan_rows(bits: np.ndarray) -> int:
    """Rows of bf16 bits (u16 [rows, hidden]) holding any NaN: unwritten (poisoned) or broken."""
    return int((((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)).any(axis=1).sum())


def fill_scale(amplitude: float) -> float:
    """ep_fill's `scale` for values uniform in [-amplitude, amplitude)."""
    return amplitude / float(1 << 23)


def sm_count(rank: Any, backend_kind: str) -> int:
    """Streaming multiprocessors of this rank's GPU (1 on the host backend, where grids mean nothing)."""
    if backend_kind != "cuda":
        return 1
    from tray.backend.cuda import driver

    return driver.device_attribute(rank.backend.device, "MULTIPROCESSOR_COUNT")


Steps = list[tuple[str, dict[str, int]]]


class MoeRank:
    """One rank's view of the layer: buffers, fills, programs, checks and timings."""

    def __init__(self, rank: Any, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.cfg = cfg
        self.backend = rank.backend
        cfg["gemm"] = resolve_gemm(cfg["gemm"], cfg["backend"], getattr(rank.backend, "capability", None))
        self.world = rank.world_size
        self.me = rank.rank
        self.hidden, self.experts, self.topk, self.ffn = cfg["hidden"], cfg["experts"], cfg["topk"], cfg["ffn"]
        self.local = self.experts // self.world
        self.groups = cfg["groups"]
        self.ep1 = self.world == 1
        # nodes of the job (rank // local_world_size = node): with more than one, world spans nodes
        self.nnodes = self.world // (rank.env.local_world_size or self.world)
        self.sms = sm_count(rank, cfg["backend"])
        self.ref_slots: list[Any] = []  # pinned host buffers of the float64 reference, kept from run to run

    @property
    def paths(self) -> list[str]:
        """The paths this tray checks against EP1: EP1 runs the peer path and its low-latency mode (local
        copies), one node all three; a job of several nodes the peer path (peer tables within a node, the
        other nodes' rows staged and carried by all-to-alls across nodes) and the NCCL path. The low-latency
        mode waits on device flags of every member: within a node only. With cfg["dispatch"] naming "fp8"
        (one node) the peer path with the FP8 dispatch too, checked against EP1's FP8 path."""
        fp8 = ["fp8"] if "fp8" in self.cfg.get("dispatch", ("bf16",)) else []
        if self.ep1:
            return ["peer", "ll", *fp8]
        return ["peer", "nccl"] if self.nnodes > 1 else ["peer", "ll", "nccl", *fp8]

    # --- device setup ---------------------------------------------------------------------------------------
    def launch(self, kernel: str, total: int, args: list[Any]) -> None:
        grid = max(1, min(MAX_FILL_GRID, math.ceil(total / FILL_BLOCK)))
        self.rank.kernel(kernel).launch((grid, 1, 1), (FILL_BLOCK, 1, 1), args)

    def fill(self, buffer: str, rows: int, cols: int, rank_stride: int, seed: int, amplitude: float) -> None:
        ptr = self.rank.buffer(buffer).ptr
        self.launch(
            "ep_fill", rows * cols, [ptr, rows, cols, cols, 0, self.me, rank_stride, seed, fill_scale(amplitude)]
        )

    def words(self, buffer: str, value: int, nbytes: int | None = None) -> None:
        b = self.rank.buffer(buffer)
        words = (b.nbytes if nbytes is None else nbytes) // 4
        self.launch("ep_zero32", words, [b.ptr, words, value])

    def fill_weights(self) -> None:
        """w13 [L][2F][H] and w2 [L][H][F] of the global experts me*L .. me*L+L-1."""
        H, F, L = self.hidden, self.ffn, self.local
        seed = self.cfg["seed"]
        self.fill("w13", L * 2 * F, H, L * 2 * F * H, seed * 8 + SEED_W13, 6.0 / math.sqrt(H))
        self.fill("w2", L * H, F, L * H * F, seed * 8 + SEED_W2, 3.0 / math.sqrt(F))

    def encode_weight_maps(self) -> None:
        """The tensor maps through which the wgmma programs' TMA reads w13 [L][2F][H] and w2 [L][H][F] into
        wg_tmaps: w13's in boxes of 64 x 256 at 0, w2's (64 x 256) at 128, w13's for the SwiGLU gate/up GEMM (its
        gate and up boxes, 64 x 64) at 256. Only for the wgmma GEMMs on a GPU (the host twins read the weights
        directly)."""
        if self.cfg["gemm"] != "wgmma" or self.cfg["backend"] != "cuda":
            return
        from tray.programs.ep_moe.gemm_tile import swiglu_tile
        from tray.programs.ep_moe.tma import encode_weight_map, write_weight_maps

        H, F, L = self.hidden, self.ffn, self.local
        w13, w2 = self.rank.buffer("w13"), self.rank.buffer("w2")
        write_weight_maps(self.backend, self.rank.buffer("wg_tmaps"),
                          [encode_weight_map(w13.ptr, L, 2 * F, H, 256), encode_weight_map(w2.ptr, L, H, F, 256),
                           encode_weight_map(w13.ptr, L, 2 * F, H, swiglu_tile().b_box_rows)])

    def warm(self) -> None:
        """Load every kernel used and (--gemm cublas) make the cuBLAS handle before any barrier: first-use
        costs differ per rank and would otherwise eat into the barrier timeout."""
        if self.cfg["gemm"] == "wgmma" and self.cfg["backend"] == "cuda":
            from tray.programs.ep_moe.gemm_tile import require_wgmma

            require_wgmma(self.backend.capability)  # before NVRTC builds an sm_90a image the device cannot load
        for k in self.rank.manifest.kernels:
            if self.cfg["gemm"] not in GEMM_KERNELS.get(k.name, (self.cfg["gemm"],)):
                continue  # compiled only when used
            if k.name in LL_PHASE_KERNELS and not self.cfg.get("ll_phases"):
                continue  # the diagnosis build: only with --ll-phases (and no host twins)
            self.rank.kernel(k.name)
        if self.cfg["gemm"] == "cublas":  # NOTE: masked runs never load cuBLAS (its libraries: seconds cold)
            h13, slab, w13 = (self.rank.buffer(n) for n in ("h13", "slab", "w13"))
            self.backend.gemm(slab.ptr, w13.ptr, h13.ptr, min(8, h13.shape[0]), 2 * self.ffn, self.hidden, "bf16")
        self.backend.synchronize()

    # --- one run --------------------------------------------------------------------------------------------
    def upload(self, tokens: int, inputs: dict[str, np.ndarray]) -> None:
        """The router's output and this rank's tokens (global token index me * tokens + t, so EP1's
        tokens are EP-N's in rank order)."""
        self.rank.write("topk_idx", np.ascontiguousarray(inputs["topk_idx"]))
        self.rank.write("topk_w", np.ascontiguousarray(inputs["topk_w"]))
        self.fill("x", tokens, self.hidden, tokens * self.hidden, self.cfg["seed"] * 8 + SEED_X, 1.0)
        self.words("err", 0)
        self.backend.synchronize()

    def programs(self, v: dict[str, int]) -> dict[str, Steps]:
        """name -> programs, for the run vars `v` (tokens, cap, blocks, threads). With --gemm masked (or
        wgmma: the same contract on Hopper's warpgroup MMA) the experts read the received rows in place (the
        layout's slot_src), so nothing is copied between the layout and them; --gemm cublas runs dense
        per-expert GEMMs over the slab the fanout fills, and its dispatch figures include the fanout
        ("fanout": that kernel alone)."""
        masked = self.cfg["gemm"] in EXPERTS_PROGRAM
        if masked:
            experts: Steps = [(EXPERTS_PROGRAM[self.cfg["gemm"]], v)]
            fanout: Steps = []
        else:
            experts = [("expert", {**v, "e": e}) for e in range(self.local)]
            fanout = [("fanout", v)]
        dispatch_ll: Steps = [("dispatch_ll" if masked else "dispatch_ll_fanout", v)]
        arrive: Steps = [("dispatch", v), ("layout", v), *fanout]
        out: dict[str, Steps] = {
            "dispatch": arrive,
            "dispatch_send": [("dispatch", v)],
            "layout": [("layout", v)],
            **({} if masked else {"fanout": fanout}),
            "experts": experts,
            "combine": [("combine", v)],
            "reduce": [("reduce", v)],
            "layer": [*arrive, *experts, ("combine", v), ("reduce", v)],
        }
        if "ll" in self.paths:  # the low-latency mode: one kernel per direction, the same bytes
            out.update({
                "dispatch_ll": dispatch_ll,
                "combine_ll": [("combine_ll", v)],
                "layer_ll": [*dispatch_ll, *experts, ("combine_ll", v)],
            })
        if "fp8" in self.paths:  # rows sent as e4m3 + scales, rebuilt as bf16 in recv: the rest unchanged
            arrive_fp8: Steps = [("dispatch_fp8", v), ("layout", v), *fanout]
            out.update({
                "dispatch_fp8": arrive_fp8,
                "layer_fp8": [*arrive_fp8, *experts, ("combine", v), ("reduce", v)],
            })
        if "nccl" in self.paths:
            arrive_nccl: Steps = [("dispatch_nccl", v), ("layout", v), *fanout]
            out.update({
                "dispatch_nccl": arrive_nccl,
                "combine_nccl": [("combine_nccl", v)],
                "layer_nccl": [*arrive_nccl, *experts, ("combine_nccl", v), ("reduce", v)],
            })
        if self.nnodes == 1 and not self.ep1:  # the NVLink ceiling: peer copies to every member
            out["ceiling"] = [("ceiling", v)]
        return out

    def has_nccl(self, name: str) -> bool:
        """Whether figure `name` of programs() runs NCCL: the NCCL path's, and across nodes the peer path's
        programs that carry rows between nodes (those are timed and rechecked as --nccl-timing says)."""
        return name.endswith("_nccl") or (self.nnodes > 1 and name in ("dispatch", "dispatch_send", "combine", "layer"))

    def budget_vars(self, run: dict[str, Any], sms: int) -> dict[str, int]:
        """Run vars: tokens and cap from the head, and the SM budget."""
        return {"tokens": run["tokens"], "cap": run["cap"], "blocks": sms, "threads": MOVE_THREADS}

    def run(self, steps: Steps) -> None:
        for program, v in steps:
            self.rank.run(program, v)

    def poison(self, tokens: int) -> None:
        self.words("out", POISON_WORD, tokens * self.hidden * 2)
        self.words("comb", POISON_WORD, self.groups * tokens * self.hidden * 2)

    def read_out(self, tokens: int) -> np.ndarray:
        return self.rank.read("out").view(np.uint16).reshape(-1, self.hidden)[:tokens].copy()

    def checked_run(self, tokens: int, steps: Steps) -> tuple[np.ndarray, list[int]]:
        """Poison out and comb, zero err, run, return (out's first `tokens` rows as u16, err words)."""
        self.poison(tokens)
        self.words("err", 0)
        self.run(steps)
        self.rank.synchronize()
        return self.read_out(tokens), [int(w) for w in self.rank.read("err")]

    def check(
        self, tokens: int, inputs: dict[str, np.ndarray], v: dict[str, int], out_dir: Path, label: str
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Run both paths eagerly; save the outputs as {label}_*.npy. Returns (checks, outputs)."""
        progs = self.programs(v)
        checks: dict[str, Any] = {}
        outputs: dict[str, np.ndarray] = {}
        want_err = [2 if int(inputs["dropped"]) else 0, 0, int(inputs["dropped"]), 0]
        for path in self.paths:
            out, err = self.checked_run(tokens, progs[LAYER_OF[path]])
            rows = self.rank.read("expert_rows")
            checks[f"{path}_err_words"] = err
            checks[f"{path}_err_ok"] = err == want_err
            checks[f"{path}_expert_rows_ok"] = bool(np.array_equal(rows, inputs["expert_rows"]))
            checks[f"{path}_nan_rows"] = nan_rows(out)
            outputs[path] = out
            tag = ("ep1" if path == "peer" else f"ep1_{path}") if self.ep1 else f"{path}_r{self.me}"
            np.save(out_dir / f"{label}_{tag}.npy", out)
        if "ll" in outputs:
            checks["ll_equals_peer"] = bool(np.array_equal(outputs["ll"], outputs["peer"]))
        if "peer" in outputs and "nccl" in outputs:
            checks["nccl_equals_peer"] = bool(np.array_equal(outputs["nccl"], outputs["peer"]))
        return checks, outputs

    def rerun_equal(self, tokens: int, steps: Steps, eager: np.ndarray) -> bool:
        """Poison the outputs, run `steps` eagerly once more (after the timed runs): does out equal the first
        eager run's?"""
        self.poison(tokens)
        self.rank.synchronize()
        self.rank.barrier_of("world").launch()
        self.run(steps)
        self.rank.synchronize()
        return bool(np.array_equal(self.read_out(tokens), eager))

    def replayed_equal(self, tokens: int, steps: Steps, eager: np.ndarray) -> bool:
        """Capture `steps`, poison the outputs, replay the graph once: does out equal the eager run's?"""
        self.run(steps)  # eagerly once: plans and handles are built outside the capture
        self.rank.synchronize()
        graph = self.backend.capture(lambda: self.run(steps))
        try:
            self.poison(tokens)
            self.rank.synchronize()
            self.rank.barrier_of("world").launch()
            graph.replay()
            self.rank.synchronize()
        finally:
            graph.close()
        return bool(np.array_equal(self.read_out(tokens), eager))

    def timings(self, sampler: Any, run: dict[str, Any], budgets: list[int], nccl_timing: str = "captured",
                out: dict[str, dict[str, float]] | None = None, timing: dict[str, str] | None = None,
                save: Callable[[], None] = lambda: None) -> dict[str, dict[str, float]]:
        """{"sm<N>": {program: us}} for each SM budget N (the first budget also times the NCCL path), filled
        into `out` figure by figure (`save()` after each); `timing` gets program -> "captured" | "eager"."""
        out = {} if out is None else out
        timing = {} if timing is None else timing

        def take(figures: dict[str, float], key: str, steps: Steps, how: str, sms: int) -> None:
            t0 = time.perf_counter()
            figures[key] = sampler.us(lambda: self.run(steps), how, label=f"{run['label']} sm{sms} {key}")
            timing[key] = how
            print(f"  {key} at {sms} SMs ({how}): {figures[key]:.1f} us ({time.perf_counter() - t0:.2f} s)",
                  flush=True)
            save()

        for i, sms in enumerate(budgets):
            v = self.budget_vars(run, sms)
            figures: dict[str, float] = {}
            out[f"sm{v['blocks']}"] = figures
            progs = self.programs(v)
            for name, steps in progs.items():
                if i > 0 and (name.endswith("_nccl") or name in ("experts", "reduce")):
                    continue  # no SM budget applies: cuBLAS, NCCL, and the local reduce
                take(figures, name, steps, nccl_timing if self.has_nccl(name) else "captured", sms)
            if i == 0 and self.nnodes == 1 and "nccl" in self.paths and nccl_timing == "eager":
                # NOTE: the NCCL figures include Python's launch cost: the peer path timed the same way is
                # the fair comparison, reported beside the captured figures, never instead of them
                for name in ("dispatch", "combine", "layer"):
                    take(figures, f"eager_{name}", progs[name], "eager", sms)
            if "ceiling" in progs:
                figures["ceiling_ce"] = self.copy_engine_ceiling(sampler, run["tokens"]) if i == 0 else float("nan")
                save()
        return out

    def ll_phase_figures(self, sampler: Any, run: dict[str, Any], v: dict[str, int], production: dict[str, float],
                         eager_out: np.ndarray, expert_rows: np.ndarray) -> dict[str, Any]:
        """Where the low-latency kernels' time goes (tray/programs/ep_moe/ll_phases.py): their diagnosis builds
        (dispatch_ll_phases, combine_ll_phases: the same bytes, plus per-block phase stamps) timed as the
        production ones are (captured, launches back to back in one graph, sampler.us), the records of the
        last LAUNCH_SLOTS launches read back from ll_phases, checked and summarized per phase; the SM clock
        measured by ll_clock (and the driver's attribute beside it). `v`: the run vars (the first SM budget);
        `production`: that budget's figures (µs, dispatch_ll and combine_ll). The diagnosis builds must write
        what the production ones do: after them `out` (poisoned first) must equal the low-latency path's eager
        output `eager_out` (u16 [tokens, hidden]) and expert_rows the head's `expert_rows`; a difference is a
        problem in the entry, as is a record that fails its checks. Every rank of the tray calls this in the
        same order (the timings' barriers and the kernels' flags pair up). Raises TrayError when ll_phases
        cannot hold the grid (the tray's ll_phase_blocks var)."""
        from tray.programs.ep_moe import ll_phases as lp

        block_slots = self.rank.buffer("ll_phases").shape[2]
        if v["blocks"] > block_slots:
            raise TrayError(f"ll_phases holds {block_slots} blocks per launch, the grid has {v['blocks']}: launch "
                            f"the tray with --var ll_phase_blocks={v['blocks']} or more")
        # the low-latency layer once, so y holds its expert outputs whatever layer ran last (the FP8 one's differ)
        self.run(self.programs(v)[LAYER_OF["ll"]])
        self.words("ll_phases", 0)
        self.words("err", 0)
        self.poison(run["tokens"])
        self.backend.synchronize()
        us = {}
        for kernel in lp.KERNELS:
            program = f"{kernel}_ll_phases"
            us[kernel] = sampler.us(lambda p=program: self.run([(p, v)]), "captured",
                                    label=f"{run['label']} sm{v['blocks']} {program}")
        self.rank.run("ll_clock", v)
        self.rank.synchronize()
        phases, state = self.rank.read("ll_phases"), self.rank.read("ll_state")
        err = [int(w) for w in self.rank.read("err")]
        clock: dict[str, Any] = {"sm_ghz": lp.sm_clock_ghz(self.rank.read("ll_clock")), "spin_ns": LL_CLOCK_SPIN_NS}
        if self.cfg["backend"] == "cuda":
            from tray.backend.cuda import driver

            try:  # NOTE: the driver's maximum SM clock, beside the measured one; a figure we can do without
                clock["driver_ghz"] = driver.device_attribute(self.backend.device, "CLOCK_RATE") / 1e6
            except driver.CudaError as exc:
                clock["driver_ghz"], clock["driver_error"] = None, str(exc)
        entry: dict[str, Any] = {"us_phases_build": us,
                                 "us_production": {k: production.get(f"{k}_ll", float("nan")) for k in lp.KERNELS},
                                 "clock": clock, "err_words": err, "problems": []}
        if err[0] & (LL_WAIT_TIMEOUT | LL_GRID_TIMEOUT):
            entry["problems"].append(f"a phase launch gave up waiting (err words {err}): its stamps time a timeout")
        entry["out_equal"] = bool(np.array_equal(self.read_out(run["tokens"]), eager_out))
        entry["expert_rows_equal"] = bool(np.array_equal(self.rank.read("expert_rows"), expert_rows))
        if not (entry["out_equal"] and entry["expert_rows_equal"]):
            entry["problems"].append(f"the diagnosis build wrote other bytes than the production kernels: out equal "
                                     f"{entry['out_equal']}, expert_rows equal {entry['expert_rows_equal']}")
        for k, kernel in enumerate(lp.KERNELS):
            found = lp.kernel_records(phases, kernel, v["blocks"], int(state[k]))
            entry["problems"] += found.problems
            entry[kernel] = lp.summarize(kernel, found.records, clock["sm_ghz"])
        entry["ok"] = not entry["problems"]
        return entry

    def copy_engine_ceiling(self, sampler: Any, tokens: int) -> float:
        """The ceiling's bytes (tokens rows to every other rank, all ranks at once) moved by the copy
        engines (backend.copy into each peer's mapping), then a barrier."""
        chunk = tokens * self.hidden * 2
        src = self.rank.buffer("send").ptr
        dst = self.rank.peers("ceil_dst").ptrs
        barrier = self.rank.barrier_of("world")
        me = self.rank.group("world").index

        def body() -> None:
            for i in range(1, self.world):
                g = (me + i) % self.world
                self.backend.copy(dst[g] + me * chunk, src + (i - 1) * chunk, chunk)
            barrier.launch()

        try:
            return sampler.us_per_call(body, label=f"T{tokens} ceiling_ce")
        except TrayError as exc:  # NOTE: a figure we can do without; the kernel ceiling stands
            print(f"copy-engine ceiling failed: {type(exc).__name__}: {exc}", flush=True)
            return float("nan")

    # --- EP1 only: float64 reference ---------------------------------------------------------------------
    def reference(self, tokens: int, inputs: dict[str, np.ndarray], ref_tokens: list[int],
                  outs: dict[str, np.ndarray]) -> dict[str, Any]:
        """Rows `ref_tokens` of EP1's outputs `outs` (path -> u16 [tokens, hidden]: "peer", and "fp8" when
        run; rel_err is the peer path's, rel_err_fp8 the FP8 dispatch's) against float64 on the same bf16
        inputs and weights (see tray/programs/ep_moe/reference.py); pairs the capacity dropped
        (inputs["kept"] false) contribute nothing, as in the layer. Each expert's weights are read back once
        (into a ring of pinned buffers, one per reference thread and one more: no page faults, full copy
        speed) while earlier ones compute. The ring stays allocated for the next run (close_reference frees
        it)."""
        from tray.dtypes import bf16_bits_to_f32
        from tray.programs.ep_moe.reference import reference_rows, workers
        from tray.twins import at

        H, F = self.hidden, self.ffn
        x = self.rank.read("x").view(np.uint16).reshape(-1, H)[:tokens]
        w13, w2 = self.rank.buffer("w13"), self.rank.buffer("w2")
        n13, n2 = 2 * F * H, H * F  # elements of one expert's w13 and w2
        threads = max(1, min(workers(), np.unique(inputs["topk_idx"][ref_tokens]).size))
        while len(self.ref_slots) < threads + 1:
            self.ref_slots.append(self.backend.pinned_host((n13 + n2) * 2))
        slots = self.ref_slots
        calls = 0

        def expert_weights(e: int) -> tuple[np.ndarray, np.ndarray]:
            nonlocal calls
            slot = slots[calls % len(slots)]  # NOTE: reference_rows uses at most `threads` earlier results
            calls += 1
            self.backend.copy(slot.ptr, w13.ptr + e * n13 * 2, n13 * 2)
            self.backend.copy(slot.ptr + n13 * 2, w2.ptr + e * n2 * 2, n2 * 2)
            self.backend.synchronize()
            bits = at(slot.ptr, n13 + n2, np.uint16)
            return bits[:n13].reshape(2 * F, H), bits[n13:].reshape(H, F)

        ref, covered = reference_rows(x, inputs["topk_idx"], inputs["topk_w"], inputs["kept"], ref_tokens,
                                      expert_weights, threads=threads)
        def rel_err(out: np.ndarray) -> float:
            got = bf16_bits_to_f32(out[ref_tokens]).astype(np.float64)
            if not np.isfinite(got).all():
                return float("nan")
            return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))

        result: dict[str, Any] = {
            "ref_tokens": len(ref_tokens),
            "rel_err": rel_err(outs["peer"]),
            "experts_covered": covered,
        }
        result["finite"] = not math.isnan(result["rel_err"])
        if "fp8" in outs:
            result["rel_err_fp8"] = rel_err(outs["fp8"])
        return result


    def close_reference(self) -> None:
        """Free the reference's pinned buffers."""
        while self.ref_slots:
            self.ref_slots.pop().close()


def main(argv: list[str]) -> int:
    import tray

    # the host twins register on import: before init, which looks every manifest kernel up
    import tray.programs.ep_moe.twins

    cfg = json.loads(Path(argv[1]).read_text())
    out_dir = Path(cfg["out_dir"])
    t_start = time.perf_counter()

    def progress(what: str, since: float) -> None:  # NOTE: rank 0's lines show on the bench's stdout
        now = time.perf_counter()
        print(f"{what} ({now - since:.1f} s; {now - t_start:.1f} s since start)", flush=True)

    with tray.init() as rank:
        moe = MoeRank(rank, cfg)
        progress(f"ready: {rank.world_size} rank(s)", t_start)
        t0 = time.perf_counter()
        moe.warm()
        progress("setup: kernels loaded", t0)
        t1 = time.perf_counter()
        moe.fill_weights()
        moe.encode_weight_maps()
        rank.synchronize()
        progress(f"setup: weights of {moe.local} experts filled on the device", t1)
        setup_s = time.perf_counter() - t0
        rank.exchange("ep.ready", setup_s)
        from tray.bench.timing import Sampler

        tag = "ep1" if moe.ep1 else f"r{rank.rank}"
        sampler = Sampler(rank, repeats=cfg["repeats"], warmup=cfg["warmup"], target_s=cfg["target_s"],
                          log_path=out_dir / f"samples_{tag}.jsonl")
        # NOTE: a budget above the GPU's SM count is the whole GPU: the same figure, taken once
        budgets = list(dict.fromkeys(min(moe.sms, moe.sms if b == "all" else int(b)) for b in cfg["budgets"]))
        results: dict[str, Any] = {
            "rank": rank.rank,
            "world_size": rank.world_size,
            "nnodes": moe.nnodes,
            "paths": moe.paths,
            "setup_s": setup_s,
            "device": rank.backend.info.name,
            "gemm": cfg["gemm"],
            "sms": moe.sms,
            "nccl_timing": cfg.get("nccl_timing", "captured"),
            "complete": False,
            "runs": [],
        }
        try:
            run_all(rank, moe, cfg, sampler, budgets, results, tag, out_dir, progress)
        finally:
            moe.close_reference()
        results["complete"] = True
        write_results(out_dir / f"result_{tag}.json", results)
    return 0


def write_results(path: Path, results: dict[str, Any]) -> None:
    """Replace `path` with `results` as JSON at once (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def run_all(rank: Any, moe: MoeRank, cfg: dict[str, Any], sampler: Any, budgets: list[int], results: dict[str, Any],
            tag: str, out_dir: Path, progress: Callable[[str, float], None]) -> None:
    """Every run of cfg["runs"]: upload, check, time, check after replays, (EP1) reference; appends to
    results["runs"] when a run starts and rewrites this rank's result file after each step (its entry has
    "done": false until the run ends)."""
    nccl_timing = cfg.get("nccl_timing", "captured")
    path = out_dir / f"result_{tag}.json"

    def save() -> None:
        write_results(path, results)

    for run in cfg["runs"]:
        tokens, cap, label = run["tokens"], run["cap"], run["label"]
        t_run = time.perf_counter()
        inputs = dict(np.load(Path(run["inputs"]) / f"{tag}.npz"))
        v = moe.budget_vars(run, budgets[0])
        moe.upload(tokens, inputs)
        rank.exchange("ep.uploaded", label)
        entry: dict[str, Any] = {"label": label, "tokens": tokens, "cap": cap, "done": False}
        results["runs"].append(entry)
        entry["checks"], eager = moe.check(tokens, inputs, v, out_dir, label)
        save()
        rank.exchange("ep.checked", label)
        progress(f"{label}: checked", t_run)
        entry["us"], entry["timing"] = {}, {}
        moe.timings(sampler, run, budgets, nccl_timing, entry["us"], entry["timing"], save)
        rank.exchange("ep.timed", label)
        progress(f"{label}: timed", t_run)
        progs = moe.programs(v)
        for p, name in LAYER_OF.items():
            if p not in eager:
                continue
            if moe.has_nccl(name) and nccl_timing == "eager":
                # NOTE: NCCL is never captured in this mode: the check after the timed runs of a layer that
                # runs it (the NCCL path; across nodes also the peer path) is an eager rerun, said so
                entry["checks"][f"{p}_after_replay_how"] = "eager rerun"
                entry["checks"][f"{p}_after_replay_equal"] = moe.rerun_equal(tokens, progs[name], eager[p])
            else:
                entry["checks"][f"{p}_after_replay_equal"] = moe.replayed_equal(tokens, progs[name], eager[p])
            save()
        progress(f"{label}: outputs after a replay checked", t_run)
        if cfg.get("ll_phases") and "ll" in moe.paths:
            entry["ll_phases"] = moe.ll_phase_figures(sampler, run, v, entry["us"][f"sm{v['blocks']}"], eager["ll"],
                                                      inputs["expert_rows"])
            save()
            progress(f"{label}: low-latency phases recorded", t_run)
        if moe.ep1 and run.get("ref_tokens"):
            t_ref = time.perf_counter()
            ref = entry["reference"] = moe.reference(tokens, inputs, run["ref_tokens"], eager)
            progress(f"{label}: float64 reference of {ref['ref_tokens']} tokens, {ref['experts_covered']} experts",
                     t_ref)
        rank.exchange("ep.done", label)
        entry["done"] = True
        save()
        progress(f"{label}: done", t_run)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
