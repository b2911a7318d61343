"""The rank side of `tray bench tp`: run as `python -m tray.programs.tp_mlp.rank_program CONFIG` inside a tray launched
with manifests/tp_mlp.json (tray/programs/tp_mlp/bench.py writes CONFIG).

Allreduce sweep, per message size S (bytes of bf16), each path timed captured and then checked on the
outputs of its timed replays: the low-latency one-shot in both line formats (`ar_ll`: 2 bf16 and a 32-bit
flag per word; `ar_ll3`: 3 bf16 and a 16-bit flag), at the sizes up to the config's ll_sweep_bytes that their
receive slots hold: S <= 2 * ll_max_count; also at the config's other launch shapes, keys `ar_ll[t512,l2]`,
`ar_ll3[t128,l1]`), the one-shot (`ar_one`) and the
two-shot (`ar_two`) peer allreduces to the bit against the member-order float32 sum every rank computes
on the host (and identical on every rank); NCCL's (`ar_nccl`, and on cuda `ar_nccl_win`: the same allreduce
on buffers registered as symmetric NCCL windows, NCCL's window kernels) element by element within bf16 tolerance
of the float64 sum. `wrong` counts the elements that failed. After the low-latency path's replays its state
words are read: a timeout raises LLTimeout naming the missing ranks, a refused launch UsageError.

MLP, per token count T: the TP layer (x [T, hidden] replicated, w13 column-split, w2 row-split) through
the one-shot, the low-latency one-shot (where timed), the two-shot and NCCL. The peer paths must give
identical bytes; rank 0 saves its outputs for the head to check against a 1-rank tray's full layer.

TP runs within each node of the job (the manifest's group `node`): G is the node's rank count and `me` this
rank's index among them; on a job of several nodes every node computes the same layer and allreduces on its
own, so every rank's outputs are the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tray.programs.ep_moe.rank_program import FILL_BLOCK, MAX_FILL_GRID, POISON_WORD, fill_scale, nan_rows
from tray.programs.tp_mlp.ll import LL_VAR_PREFIX, LLShape

SEED_X, SEED_W13, SEED_W2, SEED_P0, SEED_P1 = 11, 12, 13, 14, 15
# NOTE: NCCL sums bf16 in its own order with bf16 intermediates: a few bf16 ulps of the exact sum. An
# element is wrong when it is off by more than 2^-5 of its magnitude plus 2^-5 of the message's rms.
NCCL_REL_TOL = 2.0**-5
TP_GROUP = "node"  # the manifest's group of the TP programs: the ranks of each node
LL_PROGRAMS = ("ar_ll", "ar_ll3")  # the low-latency line formats: 2 bf16 | 32-bit flag, 3 bf16 | 16-bit flag


class TpRank:
    def __init__(self, rank: Any, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.cfg = cfg
        self.backend = rank.backend
        tp = rank.group(TP_GROUP)
        self.G = tp.size
        self.me = tp.index
        self.H, self.F = cfg["hidden"], cfg["ffn"]
        self.FL = self.F // self.G
        self.windows = False  # win_send / win_recv registered as NCCL windows (register_windows)

    def launch(self, kernel: str, total: int, args: list[Any]) -> None:
        grid = max(1, min(MAX_FILL_GRID, math.ceil(total / FILL_BLOCK)))
        self.rank.kernel(kernel).launch((grid, 1, 1), (FILL_BLOCK, 1, 1), args)

    def fill(self, ptr: int, rows: int, cols: int, row_stride: int, index_base: int, rank_stride: int, seed: int,
             amplitude: float) -> None:
        self.launch("ep_fill", rows * cols, [ptr, rows, cols, row_stride, index_base, self.me, rank_stride,
                                             self.cfg["seed"] * 16 + seed, fill_scale(amplitude)])

    def poison(self, buffer: str, nbytes: int) -> None:
        words = -(-nbytes // 4)
        self.launch("ep_zero32", words, [self.rank.buffer(buffer).ptr, words, POISON_WORD])

    def warm(self) -> None:
        for k in self.rank.manifest.kernels:
            self.rank.kernel(k.name)
        x, w13, h13 = (self.rank.buffer(n) for n in ("x", "w13", "h13"))
        self.backend.gemm(x.ptr, w13.ptr, h13.ptr, 1, 2 * self.FL, self.H, "bf16")
        self.backend.synchronize()

    def fill_weights(self) -> None:
        """This rank's shard of the full w1 [F][H], w3 [F][H] (rows r*FL..) and w2 [H][F] (columns r*FL..)."""
        H, F, FL = self.H, self.F, self.FL
        w13, w2 = self.rank.buffer("w13").ptr, self.rank.buffer("w2").ptr
        a13, a2 = 6.0 / math.sqrt(H), 3.0 / math.sqrt(F)
        self.fill(w13, FL, H, H, 0, FL * H, SEED_W13, a13)  # gate rows of w1
        self.fill(w13 + FL * H * 2, FL, H, H, F * H, FL * H, SEED_W13, a13)  # up rows of w3
        self.fill(w2, H, FL, F, 0, FL, SEED_W2, a2)

    # --- allreduce alone -------------------------------------------------------------------------------
    def partials(self, count: int, seed: int) -> list[np.ndarray]:
        """Every member's partial (bf16 bits) as `ep_fill` writes it: the host's copy of the inputs."""
        from tray.programs.ep_moe.twins import fill_bits

        s = self.cfg["seed"] * 16 + seed
        return [fill_bits(1, count, count, 0, g, count, s, fill_scale(1.0))[0] for g in range(self.G)]

    def read_out(self, buffer: str, count: int) -> np.ndarray:
        return self.rank.read(buffer).view(np.uint16)[:count].copy()

    def allreduce(self, sampler: Any, count: int) -> tuple[dict[str, float], dict[str, Any]]:
        """Time the three paths at `count` elements and check each on what its timed replays left."""
        from tray.programs.tp_mlp.twins import sum_members_bits

        rank = self.rank
        for buf, seed in (("part0", SEED_P0), ("part1", SEED_P1)):
            self.fill(rank.buffer(buf).ptr, 1, count, count, 0, count, seed, 1.0)
        p0 = self.partials(count, SEED_P0)
        want = {"part0": sum_members_bits(p0), "part1": sum_members_bits(self.partials(count, SEED_P1))}
        v = {"count": count}
        us: dict[str, float] = {}
        checks: dict[str, Any] = {"wrong": {}}
        # ar_ll, ar_ll3 and ar_one reduce part0 then part1 (buffers alternate): what stays in `out` is part1's
        paths = [("ar_one", "ar_oneshot", "part1"), ("ar_two", "ar_twoshot", "part0")]
        shapes: dict[str, dict[str, int]] = {}  # key -> the vars of a launch shape other than the manifest's
        if self.ll_timed(count):
            paths[:0] = [("ar_ll", "ar_ll", "part1"), ("ar_ll3", "ar_ll3", "part1")]
            for shape in self.ll_shapes:
                paths.insert(len(shapes) + 2, (shape.program, shape.key, "part1"))
                shapes[shape.key] = shape.vars()
        for program, key, last in paths:
            self.poison("out", count * 2)
            rank.synchronize()
            rank.exchange("tp.poisoned", count)
            divisor = 2 if program in ("ar_one", *LL_PROGRAMS) else 1
            pv = {**v, **shapes.get(key, {})}
            us[key] = sampler.us_per_call(lambda p=program, pv=pv: rank.run(p, pv)) / divisor
            if program in LL_PROGRAMS:
                rank.synchronize()
                self.check_ll()
            out = self.read_out("out", count)
            checks["wrong"][key] = int(np.count_nonzero(out != want[last]))
            digests = rank.exchange("tp.ar_digest", hashlib.sha256(out.tobytes()).hexdigest())
            checks[f"{key}_identical_on_all_ranks"] = len(set(digests)) == 1
        self.poison("out_nccl", count * 2)
        rank.synchronize()
        us["ar_nccl"] = sampler.us_per_call(lambda: rank.run("ar_nccl", v))
        exact = sum(_f64(p) for p in p0)
        checks["wrong"]["ar_nccl"] = _nccl_wrong(_f64(self.read_out("out_nccl", count)), exact)
        if self.windows:
            # NCCL's strongest formulation here: the same allreduce on buffers registered as symmetric windows
            # (its window kernels, NCCL 2.27+); part0's bytes copied in, the result checked as above
            send = rank.buffer("win_send")
            self.backend.copy(send.ptr, rank.buffer("part0").ptr, count * 2)
            self.poison("win_recv", count * 2)
            rank.synchronize()
            us["ar_nccl_win"] = sampler.us_per_call(lambda: rank.run("ar_nccl_win", v))
            checks["wrong"]["ar_nccl_win"] = _nccl_wrong(_f64(self.read_out("win_recv", count)), exact)
        return us, checks

    def register_windows(self) -> bool:
        """Register win_send and win_recv as symmetric NCCL windows of the TP group (a group-wide step: every rank
        calls it); False where the collectives have none (the host backend, an NCCL before 2.27), said once."""
        from tray.errors import UsageError

        coll = self.rank.collectives(TP_GROUP)
        # NOTE: the registration blocks until every member registers; this tray-wide step first is bounded and
        # names a rank that never comes
        self.rank.exchange("tp.windows", 0)
        try:
            for name in ("win_send", "win_recv"):
                buf = self.rank.buffer(name)
                coll.register_window(buf.ptr, buf.nbytes)
        except UsageError as exc:
            if self.rank.rank == 0:
                print(f"tp: no NCCL windows: {exc}", flush=True)
            return False
        return True

    def ll_timed(self, count: int) -> bool:
        """Whether the low-latency path is timed at `count` elements: within the config's ll_sweep_bytes and
        the receive slots."""
        return 2 * count <= self.cfg.get("ll_sweep_bytes", 2 * count) and count <= self.ll_max_count

    def manifest_ll_shape(self, program: str = "ar_ll") -> LLShape:
        """The manifest's launch shape of a low-latency program (vars ll_threads / ll_lines for `ar_ll`,
        ll3_threads / ll3_lines for `ar_ll3`)."""
        prefix = LL_VAR_PREFIX[program]
        v = self.rank.resolved.vars
        return LLShape(int(v[f"{prefix}_threads"]), int(v[f"{prefix}_lines"]), program)

    @property
    def ll_shape(self) -> LLShape:
        """The manifest's launch shape of `ar_ll`."""
        return self.manifest_ll_shape("ar_ll")

    @property
    def ll_shapes(self) -> list[LLShape]:
        """The config's other launch shapes of the low-latency path, either format (each program's manifest shape
        left out: `ar_ll` and `ar_ll3` time it)."""
        shapes = (LLShape(*s) for s in self.cfg.get("ll_shapes", []))  # [threads, lines(, program)]
        return [s for s in shapes if s != self.manifest_ll_shape(s.program)]

    @property
    def ll_max_count(self) -> int:
        """The largest count the low-latency path's receive slots hold (manifest var ll_max_count, floored to lines)."""
        return int(self.rank.resolved.vars["ll_max_count"]) // 4 * 4

    def check_ll(self) -> None:
        """Raise what the low-latency allreduce recorded in ll_state (LLTimeout, UsageError); call after a sync."""
        from tray.programs.tp_mlp.ll import check_state

        g = self.rank.group(TP_GROUP)
        check_state([int(w) for w in self.rank.read("ll_state")], g.name, g.members, g.index,
                    int(self.rank.resolved.vars["ll_timeout_ns"]))

    # --- the MLP ------------------------------------------------------------------------------------------
    def mlp(self, sampler: Any, tokens: int, out_dir: Path) -> tuple[dict[str, float], dict[str, Any]]:
        """Time the layer through each path; check what the timed replays left (rank 0 saves it)."""
        rank, H = self.rank, self.H
        self.fill(rank.buffer("x").ptr, tokens, H, H, 0, 0, SEED_X, 1.0)  # replicated input
        v = {"tokens": tokens, "count": tokens * H}
        us: dict[str, float] = {}
        outs: dict[str, np.ndarray] = {}
        paths = [("mlp_one", "out", 2)] + ([("mlp_two", "out", 1), ("mlp_nccl", "out_nccl", 1)] if self.G > 1 else [])
        if self.G > 1 and self.ll_timed(tokens * H):
            paths.insert(1, ("mlp_ll", "out", 2))
        for program, buf, divisor in paths:
            self.poison(buf, tokens * H * 2)
            rank.synchronize()
            rank.exchange("tp.mlp_poisoned", tokens)
            us[program] = sampler.us_per_call(lambda p=program: rank.run(p, v)) / divisor
            outs[program] = self.read_out(buf, tokens * H).reshape(tokens, H)
            if program == "mlp_ll":
                self.check_ll()
        checks: dict[str, Any] = {"nan_rows": sum(nan_rows(o) for o in outs.values())}
        digests = rank.exchange("tp.mlp_digest", hashlib.sha256(outs["mlp_one"].tobytes()).hexdigest())
        checks["peer_identical_on_all_ranks"] = len(set(digests)) == 1
        if "mlp_two" in outs:
            checks["two_shot_equals_one_shot"] = bool(np.array_equal(outs["mlp_two"], outs["mlp_one"]))
        if "mlp_ll" in outs:
            checks["ll_equals_one_shot"] = bool(np.array_equal(outs["mlp_ll"], outs["mlp_one"]))
        if rank.rank == 0:  # one copy: on a job of several nodes every node's member 0 holds the same bytes
            np.save(out_dir / f"T{tokens}_peer.npy", outs["mlp_one"])
            if "mlp_nccl" in outs:
                np.save(out_dir / f"T{tokens}_nccl.npy", outs["mlp_nccl"])
        return us, checks


def _nccl_wrong(got: np.ndarray, exact: np.ndarray) -> int:
    """Elements of an NCCL sum `got` off the float64 `exact` by more than NCCL_REL_TOL of their magnitude plus
    NCCL_REL_TOL of the message's rms (NaN counts as off)."""
    rms = float(np.sqrt(np.mean(exact**2))) if exact.size else 0.0
    with np.errstate(invalid="ignore"):
        return int(np.count_nonzero(~(np.abs(got - exact) <= NCCL_REL_TOL * (np.abs(exact) + rms))))


def _f64(bits: np.ndarray) -> np.ndarray:
    from tray.dtypes import bf16_bits_to_f32

    return bf16_bits_to_f32(bits).astype(np.float64)


def main(argv: list[str]) -> int:
    import tray

    # the host twins register on import: before init, which looks every manifest kernel up
    import tray.programs.tp_mlp.twins
    from tray.bench.timing import Sampler

    cfg = json.loads(Path(argv[1]).read_text())
    out_dir = Path(cfg["out_dir"])
    with tray.init() as rank:
        tp = TpRank(rank, cfg)
        t0 = time.perf_counter()
        tp.warm()
        tp.fill_weights()
        rank.synchronize()
        setup_s = time.perf_counter() - t0
        rank.exchange("tp.ready", setup_s)
        # each sample starts after an eager barrier of the node's ranks: the TP group, never a barrier across nodes
        sampler = Sampler(rank, repeats=cfg["repeats"], warmup=cfg["warmup"], target_s=cfg["target_s"],
                          group=TP_GROUP)
        results: dict[str, Any] = {"rank": rank.rank, "world_size": rank.world_size, "tp_size": tp.G,
                                   "tp_group": list(rank.group(TP_GROUP).members), "setup_s": setup_s,
                                   "device": rank.backend.info.name, "sizes": [], "tokens": [],
                                   "ll_max_bytes": int(rank.resolved.vars["ll_max_bytes"]),
                                   "ll_max_count": tp.ll_max_count,
                                   "ll_shape": [tp.ll_shape.threads, tp.ll_shape.lines],
                                   "ll3_shape": [tp.manifest_ll_shape("ar_ll3").threads,
                                                 tp.manifest_ll_shape("ar_ll3").lines]}
        t_start = time.perf_counter()
        sizes = cfg["sizes"] if tp.G > 1 else []
        if sizes and rank.backend.name == "cuda" and cfg.get("nccl_windows", True):
            tp.windows = tp.register_windows()
        for i, size in enumerate(sizes):
            count = size // 2
            us, checks = tp.allreduce(sampler, count)
            results["sizes"].append({"bytes": size, "count": count, "us": us, "checks": checks})
            rank.exchange("tp.size_done", size)
            print(f"tp: {size} B timed and checked ({i + 1} of {len(sizes)} sizes, "
                  f"{time.perf_counter() - t_start:.1f} s)", flush=True)
        for i, tokens in enumerate(cfg["tokens"]):
            us, checks = tp.mlp(sampler, tokens, out_dir)
            results["tokens"].append({"tokens": tokens, "us": us, "checks": checks})
            rank.exchange("tp.tokens_done", tokens)
            print(f"tp: layer at {tokens} tokens timed and checked ({i + 1} of {len(cfg['tokens'])}, "
                  f"{time.perf_counter() - t_start:.1f} s)", flush=True)
        tag = "one" if tp.G == 1 else str(rank.rank)
        (out_dir / f"result_{tag}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
