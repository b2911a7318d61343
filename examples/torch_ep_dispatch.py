"""Expert-parallel dispatch written in torch over tray's peer views.

Every rank holds `tokens` tokens (bf16 rows of `hidden`) routed top-`topk` to `experts_per_rank * N`
experts; expert e lives on rank e // experts_per_rank. Each rank writes the rows bound for rank d straight
into d's receive buffer (its own slab of `tokens * topk` rows, at source-rank offset) through
`torch.from_dlpack(rank.peer_view("recv", d))`, with the (global token, expert) of each row and the row
count; one tray barrier; then every rank checks what it received, byte for byte, against what each
source must have sent (every rank can regenerate every rank's tokens: they come from seeded generators).

    tray launch -n 4 --manifest examples/torch_ep_dispatch.json examples/torch_ep_dispatch.py
    (GPUs visible: the cuda backend; add --backend host to run it on CPU with torch CPU tensors)

Run: tray launch -n 2 --backend host --manifest examples/torch_ep_dispatch.json examples/torch_ep_dispatch.py

No copy anywhere: the views are the buffers. On cuda the writes are torch kernels on torch's current
stream, and the barrier runs on that stream too (`rank.barrier(stream=...)`), after them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import tray

MANIFEST = Path(__file__).with_suffix(".json")
STEPS = 3  # dispatches in a row: the receive buffers are reused after a barrier


def make_tokens(source: int, step: int, tokens: int, hidden: int, experts: int,
                topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `source`'s tokens at `step`: x bf16 [tokens, hidden] and expert ids int64 [tokens, topk]."""
    gen = torch.Generator().manual_seed(1_000 * step + source)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    expert = torch.randn(tokens, experts, generator=gen).topk(topk, dim=1).indices
    return x, expert


def rows_for(dest: int, source: int, x: torch.Tensor, expert: torch.Tensor,
             experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `source` sends to `dest` (token-major, then k order): bf16 [m, hidden] and int32 [m, 2] =
    (global token id, expert)."""
    token, k = (expert // experts_per_rank == dest).nonzero(as_tuple=True)
    meta = torch.stack([source * x.shape[0] + token, expert[token, k]], dim=1).to(torch.int32)
    return x[token], meta


def main() -> int:
    backend = os.environ.get("TRAY_BACKEND", "host")
    if backend == "cuda":
        device = torch.device("cuda", int(os.environ["TRAY_DEVICE"]))
        torch.cuda.set_device(device)  # torch and tray share this GPU's primary context
    else:
        device = torch.device("cpu")
    if Path(os.environ.get("TRAY_MANIFEST", "")).name != MANIFEST.name:
        print(f"launch with this example's manifest: tray launch -n 4 --manifest {MANIFEST} {__file__}",
              file=sys.stderr)
        return 2
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        v = rank.resolved.vars  # the manifest's vars as resolved for this tray (--var overrides them)
        tokens, hidden, topk, experts_per_rank = v["tokens"], v["hidden"], v["topk"], v["experts_per_rank"]
        experts = experts_per_rank * n
        slab = tokens * topk  # rows each source may write into each destination
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        received = 0
        for step in range(STEPS):
            x, expert = make_tokens(me, step, tokens, hidden, experts, topk)
            x, expert = x.to(device), expert.to(device)
            for dest in range(n):
                rows, meta = rows_for(dest, me, x, expert, experts_per_rank)
                m = rows.shape[0]
                torch.from_dlpack(rank.peer_view("recv", dest))[me * slab:me * slab + m].copy_(rows)
                torch.from_dlpack(rank.peer_view("meta", dest))[me * slab:me * slab + m].copy_(meta)
                torch.from_dlpack(rank.peer_view("counts", dest))[me] = m
            rank.barrier(stream=stream)  # every rank's writes into this rank's buffers have landed
            recv = torch.from_dlpack(rank.buffer("recv"))
            meta_in = torch.from_dlpack(rank.buffer("meta"))
            counts = torch.from_dlpack(rank.buffer("counts")).cpu()
            for source in range(n):
                sx, sexpert = make_tokens(source, step, tokens, hidden, experts, topk)
                want_rows, want_meta = rows_for(me, source, sx, sexpert, experts_per_rank)
                m = int(counts[source])
                if m != want_rows.shape[0]:
                    raise AssertionError(f"step {step}: rank {me} got {m} rows from rank {source}, "
                                         f"expected {want_rows.shape[0]}")
                got_rows = recv[source * slab:source * slab + m].cpu()
                got_meta = meta_in[source * slab:source * slab + m].cpu()
                if not (torch.equal(got_rows.view(torch.int16), want_rows.view(torch.int16))
                        and torch.equal(got_meta, want_meta)):
                    raise AssertionError(f"step {step}: rows from rank {source} differ on rank {me}")
                received += m
            rank.barrier(stream=stream)  # nobody writes the next step before every rank has checked
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rank.synchronize()  # raises BarrierTimeout if a barrier on torch's stream timed out
        print(f"rank {me}: {STEPS} dispatches, {received} rows received from {n} ranks, byte-exact "
              f"({device.type}, {hidden} x bf16 per row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
