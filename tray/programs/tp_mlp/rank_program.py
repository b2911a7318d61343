"""The rank side of `tray bench tp`: run as `python -m tray.programs.tp_mlp.rank_program CONFIG` inside a tray launched
with manifests/tp_mlp.json (tray/programs/tp_mlp/bench.py writes CONFIG).

Per message size S (bytes of bf16): the one-shot peer allreduce (`ar_peer`) is checked to the bit against
the member-order float32 sum every rank computes on the host, and to give every rank identical bytes;
NCCL's allreduce (`ar_nccl`) within bf16 tolerance; both timed captured. Where S is a whole number of
hidden-size rows, the TP MLP runs too (tokens = S / (2 * hidden)), through the peer allreduce and
through NCCL; rank 0 saves both outputs for the head to check against a 1-rank tray's full MLP.
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

SEED_X, SEED_W13, SEED_W2, SEED_P0, SEED_P1 = 11, 12, 13, 14, 15
# NOTE: NCCL sums bf16 in its own order with bf16 intermediates: a few bf16 ulps of the exact sum.
NCCL_TOLERANCE = 2e-2


class TpRank:
    def __init__(self, rank: Any, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.cfg = cfg
        self.backend = rank.backend
        self.G = rank.world_size
        self.me = rank.rank
        self.H, self.F = cfg["hidden"], cfg["ffn"]
        self.FL = self.F // self.G

    def launch(self, kernel: str, total: int, args: list[Any]) -> None:
        grid = max(1, min(MAX_FILL_GRID, math.ceil(total / FILL_BLOCK)))
        self.rank.kernel(kernel).launch((grid, 1, 1), (FILL_BLOCK, 1, 1), args)

    def fill(
        self,
        ptr: int,
        rows: int,
        cols: int,
        row_stride: int,
        index_base: int,
        rank_stride: int,
        seed: int,
        amplitude: float,
    ) -> None:
        self.launch(
            "ep_fill",
            rows * cols,
            [
                ptr,
                rows,
                cols,
                row_stride,
                index_base,
                self.me,
                rank_stride,
                self.cfg["seed"] * 16 + seed,
                fill_scale(amplitude),
            ],
        )

    def poison(self, buffer: str, nbytes: int) -> None:
        words = nbytes // 4
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
    def expected_sum(self, count: int, seed: int) -> np.ndarray:
        from tray.programs.ep_moe.twins import fill_bits
        from tray.programs.tp_mlp.twins import sum_members_bits

        s = self.cfg["seed"] * 16 + seed
        parts = [fill_bits(1, count, count, 0, g, count, s, fill_scale(1.0))[0] for g in range(self.G)]
        return sum_members_bits(parts)

    def check_allreduce(self, count: int) -> dict[str, Any]:
        for buf, seed in (("part0", SEED_P0), ("part1", SEED_P1)):
            self.fill(self.rank.buffer(buf).ptr, 1, count, count, 0, count, seed, 1.0)
        self.poison("out", count * 2)
        self.poison("out_nccl", count * 2)
        self.rank.synchronize()
        self.rank.exchange("tp.filled", count)
        v = {"count": count}
        self.rank.run("ar_peer", v)
        self.rank.run("ar_nccl", v)
        self.rank.synchronize()
        out = self.rank.read("out").view(np.uint16)[:count].copy()
        nccl = self.rank.read("out_nccl").view(np.uint16)[:count].copy()
        exact = np.array_equal(out, self.expected_sum(count, SEED_P1))
        digests = self.rank.exchange("tp.ar_digest", hashlib.sha256(out.tobytes()).hexdigest())
        want0 = _f64(self.expected_sum(count, SEED_P0))
        rel = float(np.linalg.norm(_f64(nccl) - want0) / max(np.linalg.norm(want0), 1e-30))
        return {
            "peer_exact": bool(exact),
            "peer_identical_on_all_ranks": len(set(digests)) == 1,
            "nccl_rel_err": rel if np.isfinite(rel) else float("nan"),
            "nccl_ok": bool(np.isfinite(rel) and rel <= NCCL_TOLERANCE),
        }

    # --- the MLP ------------------------------------------------------------------------------------------
    def check_mlp(self, tokens: int, out_dir: Path, label: int) -> dict[str, Any]:
        H = self.H
        self.fill(self.rank.buffer("x").ptr, tokens, H, H, 0, 0, SEED_X, 1.0)  # replicated input
        self.poison("out", tokens * H * 2)
        self.poison("out_nccl", tokens * H * 2)
        self.rank.synchronize()
        self.rank.exchange("tp.mlp_filled", tokens)
        v = {"tokens": tokens, "count": tokens * H}
        self.rank.run("mlp_peer", v)
        if self.G > 1:
            self.rank.run("mlp_nccl", v)
        self.rank.synchronize()
        out = self.rank.read("out").view(np.uint16)[: tokens * H].reshape(tokens, H).copy()
        checks: dict[str, Any] = {"nan_rows": nan_rows(out)}
        digests = self.rank.exchange("tp.mlp_digest", hashlib.sha256(out.tobytes()).hexdigest())
        checks["peer_identical_on_all_ranks"] = len(set(digests)) == 1
        if self.me == 0:
            np.save(out_dir / f"S{label}_peer.npy", out)
        if self.G > 1:
            nccl = self.rank.read("out_nccl").view(np.uint16)[: tokens * H].reshape(tokens, H).copy()
            checks["nan_rows"] += nan_rows(nccl)
            if self.me == 0:
                np.save(out_dir / f"S{label}_nccl.npy", nccl)
        return checks


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
        sampler = Sampler(rank, repeats=cfg["repeats"], warmup=cfg["warmup"], target_s=cfg["target_s"])
        results: dict[str, Any] = {
            "rank": rank.rank,
            "world_size": rank.world_size,
            "setup_s": setup_s,
            "device": rank.backend.info.name,
            "sizes": [],
        }
        t_sizes = time.perf_counter()
        for i, size in enumerate(cfg["sizes"]):
            count = size // 2
            tokens = count // tp.H if count % tp.H == 0 else 0
            entry: dict[str, Any] = {"bytes": size, "count": count, "tokens": tokens, "us": {}}
            if tp.G > 1:
                entry["allreduce"] = tp.check_allreduce(count)
                v = {"count": count}
                # ar_peer holds two allreduces (part0, part1): one barrier each, buffers alternate
                entry["us"]["ar_peer"] = sampler.us_per_call(lambda v=v: rank.run("ar_peer", v)) / 2
                entry["us"]["ar_nccl"] = sampler.us_per_call(lambda v=v: rank.run("ar_nccl", v))
            if tokens:
                entry["mlp"] = tp.check_mlp(tokens, out_dir, size)
                v = {"tokens": tokens, "count": count}
                entry["us"]["mlp_peer"] = sampler.us_per_call(lambda v=v: rank.run("mlp_peer", v)) / 2
                if tp.G > 1:
                    entry["us"]["mlp_nccl"] = sampler.us_per_call(lambda v=v: rank.run("mlp_nccl", v))
            rank.exchange("tp.size_done", size)
            results["sizes"].append(entry)
            print(f"tp: {size} B checked and timed ({i + 1} of {len(cfg['sizes'])} sizes, "
                  f"{time.perf_counter() - t_sizes:.1f} s)", flush=True)
        tag = "one" if tp.G == 1 else str(rank.rank)
        (out_dir / f"result_{tag}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
