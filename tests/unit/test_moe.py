"""The EP MoE plan and the kernels' arithmetic (as the numpy twins define it), without a tray."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tray.dtypes import bf16_bits_to_f32, f32_to_bf16_bits
from tray.errors import UsageError
from tray.programs.ep_moe.plan import capacity, expected, parse_routing, random_routing, reference_tokens
from tray.programs.ep_moe.twins import ep_exp_f32, fill_bits, groups_used, reduce_groups_bits, silu_mul_f32
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
        ep_exp_f32(np.array([-1e4, 1e4], np.float32)).tolist() == ep_exp_f32(np.array([-87, 88], np.float32)).tolist()
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
    comb = f32_to_bf16_bits(rng.standard_normal((3, 5, 16)).astype(np.float32))
    idx = np.array([[0, 4], [5, 1], [2, 3], [-1, 5], [9, -3]], np.int32)  # 6 experts, 3 groups of 2
    used = groups_used(idx, 6, 3)
    assert used.tolist() == [[1, 0, 1], [1, 0, 1], [0, 1, 0], [0, 0, 1], [0, 0, 0]]
    acc = np.zeros((5, 16), np.float32)
    for q in range(3):
        acc = np.where(used[:, q, None], acc + bf16_bits_to_f32(comb[q]), acc)
    assert np.array_equal(reduce_groups_bits(comb, used), acc.astype(BF16).view(np.uint16))
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


@pytest.mark.parametrize("skew", [0.0, 1.5])
def test_routing_is_distinct_normalised_and_skewable(skew):
    r = random_routing(2048, 32, 4, seed=5, skew=skew)
    assert all(len(set(row)) == 4 for row in r.experts.tolist())
    assert np.allclose(bf16_bits_to_f32(r.weights).sum(axis=1), 1, atol=2e-2)
    counts = np.bincount(r.experts.ravel(), minlength=32)
    mean = counts.mean()
    if skew == 0:
        assert counts.max() < 1.5 * mean and counts.min() > 0.5 * mean
    else:
        assert counts.max() > 3 * mean  # a hot expert
    assert np.array_equal(r.experts, random_routing(2048, 32, 4, seed=5, skew=skew).experts)
    assert parse_routing("uniform") == 0 and parse_routing("zipf") == 1 and parse_routing("zipf:0.5") == 0.5
    with pytest.raises(UsageError, match="zipf:S"):
        parse_routing("zipf:-1")


def test_capacity_is_declared_not_fitted():
    assert capacity("worst", 4, 128, 8, 256) == 512  # every token of every rank may pick an expert
    assert capacity("4", 4, 128, 8, 256) == 64  # 4 x the mean of 16 rows
    assert capacity("1.1", 2, 10, 2, 8) == 8  # ceil(5.5) = 6, rounded up to 8 rows
    assert capacity("1000", 2, 10, 2, 8) == 20  # never above the worst case
    for bad in ("0", "-1", "lots"):
        with pytest.raises(UsageError, match="--capacity"):
            capacity(bad, 2, 10, 2, 8)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_expected_layout_counts_drops_and_nvlink_rows(G):
    T, E, k, cap = 32, 16, 4, 10
    r = random_routing(G * T, E, k, seed=6, skew=1.0)
    x = expected(r, G, cap)
    per_expert = np.bincount(r.experts.ravel(), minlength=E)
    assert x.expert_rows.tolist() == np.minimum(per_expert, cap).tolist()
    assert x.dropped.sum() == np.maximum(per_expert - cap, 0).sum() == (~x.kept).sum() > 0
    for e in range(E):  # the pairs kept are each expert's first cap pairs in global (token, slot) order
        t, kk = np.nonzero(r.experts == e)
        assert x.kept[t, kk].tolist() == [i < cap for i in range(t.size)]
    L = E // G
    for s in range(G):
        owners = [set((r.experts[t] // L).tolist()) for t in range(s * T, (s + 1) * T)]
        assert x.dispatch_rows[s] == sum(len(o - {s}) for o in owners)
        assert x.local_rows[s] == sum(s in o for o in owners)
    assert np.array_equal(expected(r, 1, cap).kept, x.kept)  # EP1 keeps the same pairs
    tokens = reference_tokens(r, x.kept, extra=3)
    assert set(r.experts[tokens][x.kept[tokens]].tolist()) == set(np.flatnonzero(x.expert_rows))


@pytest.mark.parametrize("threads", [1, 3])
def test_float64_reference_by_expert_equals_the_layer_token_by_token(monkeypatch, threads):
    import tray.programs.ep_moe.reference as refmod

    monkeypatch.setattr(refmod, "BLOCK_ROWS", 16)  # several row blocks per weight matrix
    N, H, F, E, k = 20, 64, 24, 8, 3
    rng = np.random.default_rng(3)
    x = f32_to_bf16_bits(rng.standard_normal((N, H)).astype(np.float32))
    w13 = f32_to_bf16_bits((rng.standard_normal((E, 2 * F, H)) / 8).astype(np.float32))
    w2 = f32_to_bf16_bits((rng.standard_normal((E, H, F)) / 5).astype(np.float32))
    r = random_routing(N, E, k, seed=4, skew=1.0)
    kept = rng.random((N, k)) < 0.8
    kept[5] = False  # a token whose pairs were all dropped: its reference is 0
    tokens = [0, 5, 7, 19]
    asked: list[int] = []

    def weights(e):
        asked.append(e)
        return w13[e], w2[e]

    got, covered = refmod.reference_rows(x, r.experts, r.weights, kept, tokens, weights, threads=threads)
    f = lambda b: bf16_bits_to_f32(b).astype(np.float64)  # noqa: E731
    want = np.zeros((len(tokens), H))
    for i, t in enumerate(tokens):
        for kk in np.flatnonzero(kept[t]):
            e = r.experts[t, kk]
            h = f(x[t]) @ f(w13[e]).T
            act = h[:F] / (1 + np.exp(-h[:F])) * h[F:]
            want[i] += f(r.weights[t, kk]) * (act @ f(w2[e]).T)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert not got[1].any()
    used = sorted(set(r.experts[tokens][kept[tokens]].tolist()))
    assert asked == used and covered == len(used)  # each expert read once, in ascending order
