"""Routings of the EP MoE layer and what the device layout must make of them, computed on the host.

Pure numpy, shared by the bench and the tests. The layer itself lays the routing out on the device
(manifests/kernels/ep_moe.cu: dispatch, layout): the host draws a routing (the router's output),
sizes the capacity from a declared rule (never from the routing being timed), and predicts what the
device must report (rows per expert, dropped pairs, bytes that cross NVLink) so the bench can check it.

Positions: within an expert, pairs are in global token order (source rank, then token, then top-k slot),
so an expert's GEMM sees the same rows in the same places whether one rank holds every expert (EP1) or
each of G ranks holds experts/G of them. Pairs at positions >= cap are dropped (counted, never silent).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tray.errors import UsageError

# NOTE: capacities are whole 8-row groups: tensor-core GEMM tiles like M % 8 == 0.
ROW_ALIGN = 8


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


def random_routing(num_tokens: int, num_experts: int, topk: int, seed: int, skew: float = 0.0) -> Routing:
    """Distinct experts per token drawn without replacement from a Zipf-like popularity
    p(e) ~ 1 / (1 + rank(e)) ** skew (skew 0: uniform; the ranks are a seeded permutation, so the hot
    experts land on any rank), softmax weights over the k picks rounded to bf16."""
    from tray.dtypes import f32_to_bf16_bits

    if not 1 <= topk <= num_experts:
        raise UsageError(f"topk must be in 1..experts ({num_experts}), got {topk}")
    if skew < 0:
        raise UsageError(f"skew must be >= 0 (0 is uniform), got {skew}")
    rng = np.random.default_rng(seed)
    popularity = 1.0 / (1.0 + rng.permutation(num_experts)) ** skew
    # Gumbel top-k: the k largest log p + Gumbel noise are a draw without replacement proportional to p
    keys = np.log(popularity)[None, :] + rng.gumbel(size=(num_tokens, num_experts))
    experts = np.argsort(-keys, axis=1, kind="stable")[:, :topk].astype(np.int32)
    logits = rng.standard_normal((num_tokens, topk))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return Routing(np.ascontiguousarray(experts), f32_to_bf16_bits(w.astype(np.float32)), num_experts)


def parse_routing(text: str) -> float:
    """`uniform` -> 0.0, `zipf` -> 1.0, `zipf:S` -> S (the skew of random_routing)."""
    if text == "uniform":
        return 0.0
    if text == "zipf":
        return 1.0
    if text.startswith("zipf:"):
        try:
            skew = float(text[5:])
        except ValueError:
            skew = -1.0
        if skew >= 0:
            return skew
    raise UsageError(f"a routing is 'uniform', 'zipf' or 'zipf:S' with S >= 0, got {text!r}")


def capacity(spec: str, world_size: int, tokens_per_rank: int, topk: int, num_experts: int) -> int:
    """Rows per expert a graph allows. `worst`: every token of every rank may pick the expert
    (world_size * tokens_per_rank, nothing can drop); a float F: ceil(F * mean rows per expert), rounded
    up to ROW_ALIGN, at most the worst case (pairs beyond it are dropped and counted)."""
    worst = world_size * tokens_per_rank
    if spec == "worst":
        return worst
    try:
        factor = float(spec)
    except ValueError:
        factor = -1.0
    if not factor > 0:
        raise UsageError(f"--capacity is 'worst' or a positive factor of the mean rows per expert, got {spec!r}")
    mean = worst * topk / num_experts
    cap = -(-int(np.ceil(factor * mean)) // ROW_ALIGN) * ROW_ALIGN
    return int(min(max(cap, ROW_ALIGN), worst))


@dataclass(frozen=True)
class Expected:
    """What the device layout of `routing` on `world_size` ranks must produce, and what it moves.

    `expert_rows`: i32 [num_experts], rows each expert holds (min(pairs, cap)); `dropped`: i64
    [world_size], pairs beyond cap at each (owner) rank; `kept`: bool [num_tokens, topk], pairs not
    dropped; `dispatch_rows`: i64 [world_size], (token, destination) rows each source sends to other
    ranks (the combine sends as many back); `local_rows`: i64 [world_size], those kept on the source.
    """

    expert_rows: np.ndarray
    dropped: np.ndarray
    kept: np.ndarray
    dispatch_rows: np.ndarray
    local_rows: np.ndarray


def expected(routing: Routing, world_size: int, cap: int) -> Expected:
    """Raises UsageError when experts or tokens do not divide over the ranks."""
    G, E, N, k = world_size, routing.num_experts, routing.num_tokens, routing.topk
    if G < 1 or E % G or N % G:
        raise UsageError(f"{E} experts and {N} tokens must divide over {G} ranks")
    T, L = N // G, E // G
    flat = routing.experts.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")  # pairs by expert, global (token, slot) order inside
    per_expert = np.bincount(flat, minlength=E)
    starts = np.concatenate([[0], np.cumsum(per_expert)[:-1]])
    pos = np.empty(flat.size, np.int64)
    pos[order] = np.arange(flat.size) - starts[flat[order]]
    over = np.maximum(per_expert - cap, 0)
    hit = np.zeros((N, G), bool)
    hit[np.repeat(np.arange(N), k), flat // L] = True
    src = np.arange(N) // T
    own = hit[np.arange(N), src]
    return Expected(
        expert_rows=np.minimum(per_expert, cap).astype(np.int32),
        dropped=over.reshape(G, L).sum(axis=1),
        kept=(pos < cap).reshape(N, k),
        dispatch_rows=np.bincount(src, weights=hit.sum(axis=1) - own, minlength=G).astype(np.int64),
        local_rows=np.bincount(src, weights=own, minlength=G).astype(np.int64),
    )


def reference_tokens(routing: Routing, kept: np.ndarray, extra: int, cover: bool = True) -> list[int]:
    """`extra` evenly spaced tokens, and with `cover` tokens whose float64 reference covers every expert
    that keeps a pair (the first token of each expert not yet covered, in expert order).
    `kept`: bool [num_tokens, topk], the pairs the capacity keeps."""
    chosen: set[int] = set()
    covered = np.zeros(routing.num_experts, bool)
    for e in range(routing.num_experts if cover else 0):
        if covered[e]:
            continue
        tokens = np.nonzero((routing.experts == e) & kept)[0]
        if tokens.size:
            t = int(tokens[0])
            chosen.add(t)
            covered[routing.experts[t][kept[t]]] = True
    n = routing.num_tokens
    chosen.update(int(i) for i in np.linspace(0, n - 1, min(extra, n)).round())
    return sorted(chosen)
