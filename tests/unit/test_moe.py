"""The EP MoE plan and the kernels' arithmetic (as the numpy twins define it), without a tray."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tray.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from tray.programs.ep_moe.plan import CapacityError, plan_ep, random_routing
from tray.programs.ep_moe.twins import ep_exp_f32, fill_bits, reduce_bits, silu_mul_f32
from tray.programs.tp_mlp.twins import sum_members_bits

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_bf16_rounding_is_round_to_nearest_even():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    f = f[~np.isnan(f)]
    specials = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            3.3895314e38,
            -3.3895314e38,
            1e-40,
            1.00390625,
            1.01171875,
            np.finfo(np.float32).max,
        ],
        np.float32,
    )
    f = np.concatenate([f, specials])
    assert np.array_equal(f32_to_bf16_bits(f), f.astype(BF16).view(np.uint16))
    assert (f32_to_bf16_bits(np.array([np.nan, -np.nan], np.float32)) == 0x7FC0).all()
    assert np.array_equal(bf16_bits_to_f32(np.array([0x3F80, 0xC000], np.uint16)), [1.0, -2.0])


def test_exp_polynomial_is_float32_accurate():
    x = np.linspace(-87, 88, 400_001, dtype=np.float32)
    got = ep_exp_f32(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 4e-7
    assert np.isnan(ep_exp_f32(np.array([np.nan], np.float32))).all()
    assert (
        ep_exp_f32(np.array([-1e4, 1e4], np.float32)).tolist()
        == ep_exp_f32(np.array([-87, 88], np.float32)).tolist()
    )


def test_silu_mul_matches_float64_to_bf16_precision():
    rng = np.random.default_rng(1)
    g = (rng.standard_normal(100_000) * 6).astype(np.float32)
    u = rng.standard_normal(100_000).astype(np.float32)
    got = silu_mul_f32(g, u).astype(np.float64)
    g64 = g.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * u
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)) < 1e-5


def test_reduce_and_member_sum_are_float32_in_fixed_order():
    rng = np.random.default_rng(2)
    comb = f32_to_bf16_bits(rng.standard_normal((5, 3, 16)).astype(np.float32))
    w = f32_to_bf16_bits(rng.random((5, 3)).astype(np.float32))
    acc = np.zeros((5, 16), np.float32)
    for k in range(3):
        acc = acc + bf16_bits_to_f32(w)[:, k, None] * bf16_bits_to_f32(comb)[:, k]
    assert np.array_equal(reduce_bits(comb, w), acc.astype(BF16).view(np.uint16))
    parts = [f32_to_bf16_bits(rng.standard_normal(64).astype(np.float32)) for _ in range(4)]
    s = np.float32(0) + bf16_bits_to_f32(parts[0])
    for p in parts[1:]:
        s = s + bf16_bits_to_f32(p)
    assert np.array_equal(sum_members_bits(parts), s.astype(BF16).view(np.uint16))


def test_fill_is_the_same_value_in_every_layout():
    full = fill_bits(8, 6, 6, 0, 0, 0, seed=3, scale=2.0**-23)  # one tensor [8, 6]
    rows_of_rank1 = fill_bits(4, 6, 6, 0, 1, 4 * 6, seed=3, scale=2.0**-23)  # rows 4..7
    cols_of_rank1 = fill_bits(8, 3, 6, 0, 1, 3, seed=3, scale=2.0**-23)  # columns 3..5
    assert np.array_equal(rows_of_rank1, full[4:])
    assert np.array_equal(cols_of_rank1, full[:, 3:])
    v = bf16_bits_to_f32(full)
    assert (np.abs(v) <= 1).all() and np.unique(full).size > 40
    assert not np.array_equal(full, fill_bits(8, 6, 6, 0, 0, 0, seed=4, scale=2.0**-23))


@pytest.mark.parametrize("G", [1, 2, 4])
def test_plan_places_rows_in_global_token_order(G):
    T, E, k = 32, 16, 4
    routing = random_routing(G * T, E, k, seed=5)
    plan = plan_ep(routing, G)
    ex = routing.experts
    assert all(len(set(row)) == k for row in ex.tolist())
    w = bf16_bits_to_f32(routing.weights)
    assert np.allclose(w.sum(axis=1), 1, atol=2e-2)
    for e in range(E):
        tokens, _ = np.nonzero(ex == e)
        assert plan.pos[ex == e].tolist() == list(
            range(len(tokens))
        )  # row j is the j-th token in global order
    assert plan.cap % 8 == 0 and plan.cap >= np.bincount(ex.ravel(), minlength=E).max()
    assert plan.counts.sum() == G * T * k
    # the same routing on one rank gives every pair the same row
    one = plan_ep(routing, 1, cap=plan.cap)
    assert np.array_equal(one.pos, plan.pos)


def test_rank_inputs_invert_each_other():
    G, T, E, k = 4, 16, 8, 2
    routing = random_routing(G * T, E, k, seed=6)
    plan = plan_ep(routing, G)
    L = E // G
    inputs = [plan.rank_inputs(r) for r in range(G)]
    for r, inp in enumerate(inputs):
        used = inp.combine_src >= 0
        pair = inp.combine_src[used]
        # every slab row maps back to a pair routed to this rank's expert at that row
        rows = np.flatnonzero(used)
        assert np.array_equal(routing.experts.reshape(-1)[pair], r * L + rows // plan.cap)
        assert np.array_equal(plan.pos.reshape(-1)[pair], rows % plan.cap)
        assert np.array_equal(inp.recv_counts.sum(axis=0), np.bincount(rows // plan.cap, minlength=L))
        # NCCL path: what s packs for r at chunk row j is unpacked by r into the same slab row
        for s in range(G):
            src = inputs[s]
            dest = src.pack_row.reshape(-1) // plan.capp
            j = src.pack_row.reshape(-1) % plan.capp
            to_r = dest == r
            slab_rows = (src.route_expert.reshape(-1)[to_r] % L) * plan.cap + src.route_pos.reshape(-1)[to_r]
            assert np.array_equal(inp.unpack_row[s * plan.capp + j[to_r]], slab_rows)


def test_capacity_overflow_is_an_error():
    routing = random_routing(64, 4, 2, seed=7)
    with pytest.raises(CapacityError, match=r"expert \d+ receives \d+ rows, more than cap 8"):
        plan_ep(routing, 2, cap=8)
    with pytest.raises(CapacityError, match=r"rank \d sends \d+ rows to rank \d, more than capp 8"):
        plan_ep(routing, 2, capp=8)
