"""Routing plans of the EP MoE layer: where every (token, k) pair lands, computed on the host.

Pure numpy, shared by the bench and the tests. The static shapes a captured graph needs come from a
fixed capacity per expert (`cap` rows) and, for the NCCL path, per (source, destination) pair of ranks
(`capp` rows). Within an expert, rows are in global token order (source rank, then token), so an
expert's GEMM sees exactly the same rows in the same places whether one rank holds every expert (EP1)
or each of G ranks holds experts/G of them: the outputs can match byte for byte.

A production router would compute the positions on the device (a prefix sum over the per-(source,
expert) counts, exchanged first); here routing is an input, so the host computes them once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tray.errors import UsageError

# NOTE: capacities are rounded up to whole 8-row groups: no GEMM needs it, but it keeps cap and capp
# stable when a different seed moves the largest expert by a row or two.
ROW_ALIGN = 8


class CapacityError(UsageError):
    """More rows go to an expert (or from one rank to another) than the capacity given."""


@dataclass(frozen=True)
class Routing:
    """Top-k routing of `num_tokens` tokens (global order: rank-major) over `num_experts` experts.

    `experts`: i32 [num_tokens, topk], distinct per token; `weights`: u16 [num_tokens, topk], the bf16
    bits of normalised weights (each row sums to ~1).
    """

    experts: np.ndarray
    weights: np.ndarray
    num_experts: int

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def topk(self) -> int:
        return int(self.experts.shape[1])


def random_routing(num_tokens: int, num_experts: int, topk: int, seed: int) -> Routing:
    """Uniformly random distinct experts per token, softmax weights over the k picks rounded to bf16."""
    from tray.dtypes import f32_to_bf16_bits

    if not 1 <= topk <= num_experts:
        raise UsageError(f"topk must be in 1..experts ({num_experts}), got {topk}")
    rng = np.random.default_rng(seed)
    keys = rng.random((num_tokens, num_experts), dtype=np.float32)
    experts = np.argsort(keys, axis=1, kind="stable")[:, :topk].astype(np.int32)
    logits = rng.standard_normal((num_tokens, topk))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return Routing(np.ascontiguousarray(experts), f32_to_bf16_bits(w.astype(np.float32)), num_experts)


def _round_up(n: int, align: int) -> int:
    return max(align, -(-n // align) * align)


@dataclass(frozen=True)
class RankInputs:
    """What one rank's kernels read (all C-contiguous; shapes for T tokens per rank, L = E / G experts).

    route_expert, route_pos: i32 [T, k]; route_weights: u16 [T, k] (bf16 bits); send_counts: i32 [E];
    combine_src: i32 [L * cap] (global pair id (src * T + t) * k + kk of each slab row, -1 if unused);
    pack_row: i32 [T, k] (row of the NCCL send buffer [G][capp] per pair); unpack_row: i32 [G * capp]
    (slab row of each NCCL receive row, -1 if unused); recv_counts: i32 [G, L] (what dispatch must
    deliver into this rank's counts).
    """

    route_expert: np.ndarray
    route_pos: np.ndarray
    route_weights: np.ndarray
    send_counts: np.ndarray
    combine_src: np.ndarray
    pack_row: np.ndarray
    unpack_row: np.ndarray
    recv_counts: np.ndarray


@dataclass(frozen=True)
class EpPlan:
    """A routing placed on `world_size` ranks of `tokens_per_rank` tokens each.

    `pos`: i32 [num_tokens, topk], the row of each pair within its expert's `cap` rows (global token
    order); `counts`: i32 [world_size, num_experts], pairs from each source rank to each expert;
    `capp`: rows per (source, destination) chunk of the NCCL path.
    """

    routing: Routing
    world_size: int
    tokens_per_rank: int
    cap: int
    capp: int
    pos: np.ndarray
    counts: np.ndarray

    @property
    def local_experts(self) -> int:
        return self.routing.num_experts // self.world_size

    def rank_inputs(self, rank: int) -> RankInputs:
        """The index arrays rank `rank` uploads (see RankInputs)."""
        G, T, k, L = self.world_size, self.tokens_per_rank, self.routing.topk, self.local_experts
        cap, capp = self.cap, self.capp
        rows = slice(rank * T, (rank + 1) * T)
        experts = self.routing.experts
        owner = experts // L  # [N, k] destination rank of every pair
        slab_row = (experts % L) * cap + self.pos  # [N, k] row in the owner's slab

        combine_src = np.full(L * cap, -1, np.int32)
        mine = owner == rank
        combine_src[slab_row[mine]] = np.flatnonzero(mine.reshape(-1)).astype(np.int32)

        # NCCL path: source s sends its pairs for destination p in its (t, k) order, as rows p * capp + j.
        order_in_chunk = _rank_within(owner.reshape(G, T * k))  # [G, T*k]
        pack_row = (owner[rows].reshape(-1) * capp + order_in_chunk[rank]).astype(np.int32).reshape(T, k)
        unpack_row = np.full(G * capp, -1, np.int32)
        to_me = owner.reshape(G, T * k) == rank
        for s in range(G):
            j = order_in_chunk[s][to_me[s]]
            unpack_row[s * capp + j] = slab_row.reshape(G, T * k)[s][to_me[s]]
        return RankInputs(
            route_expert=np.ascontiguousarray(experts[rows]),
            route_pos=np.ascontiguousarray(self.pos[rows]),
            route_weights=np.ascontiguousarray(self.routing.weights[rows]),
            send_counts=np.ascontiguousarray(self.counts[rank]),
            combine_src=combine_src,
            pack_row=np.ascontiguousarray(pack_row),
            unpack_row=unpack_row,
            recv_counts=np.ascontiguousarray(self.counts[:, rank * L : (rank + 1) * L]),
        )


def _rank_within(owner: np.ndarray) -> np.ndarray:
    """For each row of `owner` (i32 [G, n]), the index of every element among the earlier elements
    with the same value (0, 1, 2... per value, in order)."""
    out = np.empty_like(owner)
    for s in range(owner.shape[0]):
        row = owner[s]
        order = np.argsort(row, kind="stable")
        sorted_vals = row[order]
        starts = np.searchsorted(sorted_vals, sorted_vals, side="left")
        out[s][order] = np.arange(row.size) - starts
    return out


def plan_ep(routing: Routing, world_size: int, cap: int | None = None, capp: int | None = None) -> EpPlan:
    """Place `routing` on `world_size` ranks (num_tokens = world_size * tokens_per_rank).

    `cap` / `capp` default to the smallest capacity that fits, rounded up to ROW_ALIGN rows. Raises
    CapacityError naming the expert (or rank pair) when a given capacity is too small, UsageError
    when the experts or tokens do not divide over the ranks.
    """
    G, E, k, N = world_size, routing.num_experts, routing.topk, routing.num_tokens
    if G < 1 or E % G or N % G:
        raise UsageError(f"{E} experts and {N} tokens must divide evenly over {G} ranks")
    T, L = N // G, E // G
    flat = routing.experts.reshape(-1)
    order = np.argsort(flat, kind="stable")  # pairs grouped by expert, global (token, k) order inside
    expert_rows = np.bincount(flat, minlength=E)
    starts = np.concatenate([[0], np.cumsum(expert_rows)[:-1]])
    pos = np.empty(flat.size, np.int64)
    pos[order] = np.arange(flat.size) - starts[flat[order]]
    need = int(expert_rows.max()) if flat.size else 0
    if cap is None:
        cap = _round_up(need, ROW_ALIGN)
    elif need > cap:
        e = int(expert_rows.argmax())
        raise CapacityError(
            f"expert {e} receives {need} rows, more than cap {cap}; raise --cap (or leave it "
            "out: the bench sizes it from the routing)"
        )
    src = np.repeat(np.arange(G), T * k)
    counts = np.zeros((G, E), np.int32)
    np.add.at(counts, (src, flat), 1)
    chunk = counts.reshape(G, G, L).sum(axis=2)  # [source, destination] pairs
    need_p = int(chunk.max()) if chunk.size else 0
    if capp is None:
        capp = _round_up(need_p, ROW_ALIGN)
    elif need_p > capp:
        s, p = np.unravel_index(int(chunk.argmax()), chunk.shape)
        raise CapacityError(f"rank {s} sends {need_p} rows to rank {p}, more than capp {capp}")
    return EpPlan(routing, G, T, int(cap), int(capp), pos.astype(np.int32).reshape(N, k), counts)
