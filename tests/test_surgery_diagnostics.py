"""Behaviour signals: KL / top-1 agreement, the closable gap, the position-slope estimator."""

import math

import numpy as np
import pytest
import torch

from darts_bench.surgery.diagnostics import agreement, diagnose, gap_closed, position_slope


def test_kl_and_agreement_two_token_vocab():
    # expert p = [0.8, 0.2], model q = [0.4, 0.6] at token 0; identical at token 1
    le = torch.log(torch.tensor([[0.8, 0.2], [0.3, 0.7]]))
    lm = torch.log(torch.tensor([[0.4, 0.6], [0.3, 0.7]]))
    kl, agree = agreement(le, lm)
    expect0 = 0.8 * math.log(0.8 / 0.4) + 0.2 * math.log(0.2 / 0.6)
    assert kl.tolist() == pytest.approx([expect0, 0.0], abs=1e-6)
    assert agree.tolist() == [0.0, 1.0]


def test_gap_closed_is_one_when_corrected_equals_expert():
    """A 'head' that returns the expert's hidden state reaches the floor: gap closed = 1."""
    torch.manual_seed(0)
    n, d, V = 64, 6, 5
    he, hm = torch.randn(n, d), torch.randn(n, d)
    We, Wm = torch.randn(V, d), torch.randn(V, d)
    pos, ent = torch.arange(n) % 8, torch.rand(n) + 0.1

    class Oracle(torch.nn.Module):
        def forward(self, h, positions=None):
            return he

    base = diagnose(None, hm, he, pos, ent, float(ent.mean()), 5.0, We, Wm)
    row = diagnose(Oracle(), hm, he, pos, ent, float(ent.mean()), 5.0, We, Wm)
    assert row["kl_expert"] == pytest.approx(base["kl_floor"], abs=1e-6)
    assert gap_closed(base["kl_expert"], row["kl_expert"], base["kl_floor"]) == pytest.approx(1.0, abs=1e-6)
    assert gap_closed(base["kl_expert"], base["kl_expert"], base["kl_floor"]) == pytest.approx(0.0)
    assert row["rep_l1"] == 0.0
    assert gap_closed(1.0, 0.5, 1.0) is None  # no closable gap


def test_slope_on_synthetic_linear_curve():
    x = np.arange(100, dtype=float)
    y = 0.03 * x + 1.0
    r = position_slope(x, y, n_boot=100)
    assert r["slope"] == pytest.approx(0.03)
    assert r["ci_low"] == pytest.approx(0.03) and r["ci_high"] == pytest.approx(0.03)
    rng = np.random.default_rng(0)
    noisy = y + rng.normal(0, 0.5, size=100)
    groups = np.repeat(np.arange(10), 10)
    r2 = position_slope(np.tile(np.arange(10.0), 10), 0.03 * np.tile(np.arange(10.0), 10) + rng.normal(0, 0.01, 100),
                        n_boot=200, groups=groups)
    assert r2["ci_low"] < 0.03 < r2["ci_high"]
    r3 = position_slope(x, noisy, n_boot=200)
    assert r3["ci_low"] < r3["slope"] < r3["ci_high"]
