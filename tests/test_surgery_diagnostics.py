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


# ------------------------------------------------------------------ position sets, shared template
def _prefix_case(n_seq=24, prefix=6, d=8, V=11, seed=0):
    """A synthetic calibration set: every sequence starts with the same ``prefix`` token ids (a chat
    template), then a prompt tail and a continuation of varying lengths. The expert's hidden state is
    random per token except that on the shared prefix it is the same in every sequence (its context is
    the same); the merged model's state equals the expert's everywhere except on the prefix, where it
    is off by a per-position offset."""
    from darts_bench.surgery.data import TokenView
    from darts_bench.surgery.train import TokenData

    g = torch.Generator().manual_seed(seed)
    template = torch.randint(0, V, (prefix,), generator=g).tolist()
    seqs, plens = [], []
    for i in range(n_seq):
        tail, cont = 3 + i % 4, 4 + (i * 7) % 5
        body = [(i * 13 + 5 * k + 1) % V for k in range(tail + cont)]
        seqs.append(template + body)
        plens.append(prefix + tail)
    meta = {"sequences": seqs, "prompt_len": plens}
    pre_e = torch.randn(prefix, d, generator=g)  # the prefix's expert state, the same in every sequence
    offset = torch.randn(prefix, d, generator=g)  # the merged model's bias on the prefix only
    he, hm, pos, sq = [], [], [], []
    for i, s in enumerate(seqs):
        e = torch.randn(len(s), d, generator=g)
        e[:prefix] = pre_e
        m = e.clone()
        m[:prefix] += offset
        he.append(e), hm.append(m), pos.append(torch.arange(len(s))), sq.append(torch.full((len(s),), i))
    data = TokenData(torch.cat(hm), torch.cat(he), torch.cat(pos), torch.cat(sq),
                     torch.rand(sum(map(len, seqs)), generator=g) + 0.1)
    W_e = torch.randn(V, d, generator=g)
    W_m = W_e + 0.3 * torch.randn(V, d, generator=g)
    return meta, TokenView(data, torch.arange(len(data.positions))), offset, W_e, W_m


def test_shared_template_and_position_sets():
    from darts_bench.surgery.data import position_sets, shared_template, template_mask

    meta = {"sequences": [[7, 8, 1, 2, 3], [7, 8, 4, 2, 5, 6], [7, 8, 9, 2]], "prompt_len": [3, 3, 2]}
    # positions 0, 1 (prefix) and 3 (token 2 in every sequence) are shared; position 4 is past the shortest
    assert shared_template(meta) == {0: 7, 1: 8, 3: 2}
    assert shared_template({"sequences": [[1, 2]], "prompt_len": [1]}) == {}
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    sq = torch.tensor([0] * 5 + [1] * 6 + [2] * 4)
    tmpl = shared_template(meta)
    assert template_mask(pos, sq, meta, tmpl).tolist() == [1, 1, 0, 1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1]
    sets = position_sets(pos, sq, meta, tmpl)
    # gen: prompt_len - 1 .. len - 2 without the template: seq 0 -> 2 (3 is template); seq 1 -> 2, 4;
    # seq 2 (prompt_len 2) -> 1 is template, 2 -> kept; last positions never
    assert pos[sets["gen"]].tolist() == [2, 2, 4, 2] and sq[sets["gen"]].tolist() == [0, 1, 1, 2]
    # prompt: 0 .. prompt_len - 2, without the template: nothing left here (all prefix)
    assert sets["prompt"].sum() == 0
    # another set's token at a template position that differs from the template is kept
    ref = {"sequences": [[7, 8, 3, 5]], "prompt_len": [2]}
    assert template_mask(torch.arange(4), torch.zeros(4, dtype=torch.long), ref, tmpl).tolist() == [1, 1, 0, 0]
    with pytest.raises(IndexError, match="outside the 3 sequences"):
        template_mask(torch.tensor([9]), torch.tensor([0]), meta, tmpl)


def test_gen_signals_unchanged_by_a_head_that_fixes_the_shared_prefix():
    """Merged and expert states differ only on a shared prefix; a DARTS head whose position bias
    undoes that offset closes the whole all-position gap, yet every `_gen` (and `_prompt`) signal and
    interval equals the uncorrected merge's: the template is excluded, so memorising it scores nothing."""
    from darts_bench.stages.train import diagnose_rows
    from darts_bench.surgery.data import shared_template
    from darts_bench.surgery.heads import build_head

    meta, val, offset, W_e, W_m = _prefix_case()
    template = shared_template(meta)
    assert sorted(template) == list(range(6))
    fix = build_head("darts", val.dim, rank=2, max_len=32)
    with torch.no_grad():
        fix.pos_bias[:6] = -offset  # exactly the prefix's offset, nothing elsewhere
    heads = {"none": None, "darts": fix, "surgery": build_head("surgery", val.dim, rank=2)}  # surgery: identity
    # the reference set: one sequence's continuation
    ref_meta = {"sequences": [meta["sequences"][0]], "prompt_len": [meta["prompt_len"][0]]}
    from darts_bench.surgery.data import answer_prediction_mask

    one = val.base.select(torch.nonzero(val.base.seq_index == 0)[:, 0])
    keep = answer_prediction_mask(one.positions, one.seq_index, ref_meta).nonzero()[:, 0]
    ref = one.select(keep)
    d = diagnose_rows(heads, val, meta, template, lambda: iter([ref]), ref.seq_index.numpy(), 0,
                      mean_h=0.6, w_max=5.0, W_e=W_e, W_m=W_m, seed=3)
    assert d["template"]["n_positions"] == 6 == d["template"]["prefix_len"]
    assert d["template"]["n_excluded_tokens"]["held_out"] == 6 * 24
    # all positions: the head fixes the prefix, so it reaches the expert everywhere (gap closed 1)
    assert d["none"]["rep_l1"] > 0 and d["darts"]["rep_l1"] == pytest.approx(0.0, abs=1e-6)
    assert d["darts"]["gap_closed"] == pytest.approx(1.0, abs=1e-5)
    assert d["intervals"]["paired"]["kl_expert"]["value"] < 0
    # gen / prompt: the merged states already equal the expert's there; the head changes nothing
    for s in ("gen", "prompt"):
        assert d["none"][s]["n_tokens"] > 0 and d["none"][s]["rep_l1"] == 0.0
        for k in ("rep_l1", "rep_l1_ew", "kl_expert", "agree_top1", "kl_floor"):
            assert d["darts"][s][k] == d["none"][s][k], (s, k)
        if s == "gen":
            assert d["darts"][s]["kl_by_position"] == d["none"][s]["kl_by_position"]
        assert d["darts"][s]["gap_closed"] is None  # no closable gap: KL already at the floor
        assert d["darts"][s]["slope"] == d["none"][s]["slope"]
        iv = d[f"intervals_{s}"]
        assert iv["darts"]["kl_expert"] == iv["none"]["kl_expert"]
        assert iv["paired"]["kl_expert"]["value"] == 0.0 == iv["paired"]["agree_top1"]["value"]
        assert iv["darts"]["kl_expert"]["n_sequences"] == 24
    # the template is in no per-position curve of gen / prompt
    assert min(int(p) for p in d["none"]["gen"]["l1_by_position"]) >= 6
    assert "kl_by_position" not in d["none"]["prompt"]  # per-position curves: all positions and gen only
    assert 0 in d["none"]["kl_by_position"]  # the all-position curve keeps it


def test_intervals_recompute_from_per_sequence():
    """Every interval in the diagnostics is a function of `per_sequence` alone: recomputed with
    `sequence_bootstrap` over sequences (token mean = sum of sums / sum of counts; gap closed from the
    same means), after a JSON round trip, it gives the same numbers, bitwise."""
    import json

    from darts_bench.report.stats import sequence_bootstrap
    from darts_bench.stages.train import diagnose_rows
    from darts_bench.surgery.data import answer_prediction_mask, shared_template
    from darts_bench.surgery.heads import build_head

    meta, val, offset, W_e, W_m = _prefix_case(seed=1)
    val.base.h_merged[val.base.positions >= 6] += 0.2 * torch.randn(int((val.base.positions >= 6).sum()), val.dim)
    template = shared_template(meta)
    heads = {"none": None}
    for k, method in enumerate(("surgery", "darts")):
        h = build_head(method, val.dim, rank=2, max_len=32, seed=k)
        with torch.no_grad():
            h.up.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(k))
        heads[method] = h
    ref_meta = {"sequences": meta["sequences"][:3], "prompt_len": meta["prompt_len"][:3]}
    part = val.base.select(torch.nonzero(val.base.seq_index < 3)[:, 0])
    ref = part.select(answer_prediction_mask(part.positions, part.seq_index, ref_meta).nonzero()[:, 0])
    d = json.loads(json.dumps(diagnose_rows(heads, val, meta, template, lambda: iter([ref]), ref.seq_index.numpy(),
                                            0, mean_h=0.6, w_max=5.0, W_e=W_e, W_m=W_m, seed=5)))
    nb, seed = d["bootstrap"]["n_boot"], d["bootstrap"]["seed"]
    for s_name, key in (("gen", "intervals_gen"), ("prompt", "intervals_prompt"), ("all", "intervals"),
                        ("reference", "intervals_reference")):
        ps = d["per_sequence"][s_name]
        n = np.asarray(ps["n_tokens"], dtype=np.float64)
        units = np.arange(len(n))

        def mean(row, k, i):
            return float(np.asarray(ps[row][k])[i].sum() / n[i].sum())

        def gap(row, i):
            g = mean("none", "kl_sum", i) - mean("none", "floor_sum", i)
            return (mean("none", "kl_sum", i) - mean(row, "kl_sum", i)) / g if g > 1e-12 else float("nan")

        for row in ("none", "surgery", "darts"):
            assert sequence_bootstrap(units, lambda i: mean(row, "kl_sum", i), nb, seed) == d[key][row]["kl_expert"]
            assert sequence_bootstrap(units, lambda i: mean(row, "agree_sum", i), nb, seed) == d[key][row]["agree_top1"]
            if row != "none":
                assert sequence_bootstrap(units, lambda i: gap(row, i), nb, seed) == d[key][row]["gap_closed"]
        p = d[key]["paired"]
        assert sequence_bootstrap(units, lambda i: mean("darts", "kl_sum", i) - mean("surgery", "kl_sum", i),
                                  nb, seed) == p["kl_expert"]
        assert sequence_bootstrap(units, lambda i: gap("darts", i) - gap("surgery", i), nb, seed) == p["gap_closed"]
        # the point values are the token means of the set itself
        if s_name != "all" and s_name != "reference":
            assert d["darts"][s_name]["kl_expert"] == pytest.approx(p["kl_expert"]["value"] + d["surgery"][s_name]["kl_expert"])
            assert sum(ps["n_tokens"]) == d["none"][s_name]["n_tokens"]
    assert len(d["per_sequence"]["gen"]["sequence"]) == 24 and len(d["per_sequence"]["reference"]["sequence"]) == 3


def test_blocked_vocabulary_work_is_bitwise_the_whole_tensor_computation():
    """The row-blocked paths (``lm_head_entropy``, ``ExpertDistribution``: issue "Every head of a merge in
    one pass", diagnostics ~1.5x and feature forwards 2x faster on 2 cores) give bitwise the values of
    the whole-tensor calls they replace, for block sizes that do and do not divide the token count, in
    float32 and bfloat16 (CPU)."""
    from darts_bench.surgery.diagnostics import ExpertDistribution
    from darts_bench.surgery.losses import kl_divergence, lm_head_entropy, next_token_entropy

    torch.manual_seed(0)
    n, d, V = 300, 32, 1000
    for dtype in (torch.float32, torch.bfloat16):
        lm_head = torch.nn.Linear(d, V, bias=False).to(dtype)
        h = torch.randn(n, d, dtype=dtype)
        whole = next_token_entropy(lm_head(h))
        # 300 tokens in blocks of 299 would leave a 1-row tail (a matmul of other rounding): row_blocks
        # splits them near-equally instead
        for logit_rows, entropy_rows in ((512, 64), (128, 64), (100, 7), (299, 1), (37, 300)):
            assert torch.equal(lm_head_entropy(lm_head, h, logit_rows, entropy_rows), whole), (dtype, logit_rows)
    le, lm = torch.randn(n, V) * 3, torch.randn(n, V) * 3
    le[5] = lm[5]  # one token where the model is the expert: KL 0, agreement 1
    kl_whole = kl_divergence(le, lm)
    agree_whole = (le.argmax(-1) == lm.argmax(-1)).float()
    for rows in (64, 7, n):
        kl, agree = ExpertDistribution(le, rows).compare(lm)
        assert torch.equal(kl, kl_whole) and torch.equal(agree, agree_whole), rows
    assert kl_whole[5] == 0 and agree_whole[5] == 1
    assert torch.equal(agreement(le, lm)[0], kl_whole)
    from darts_bench.surgery.losses import row_blocks

    assert row_blocks(300, 299) == [(0, 150), (150, 300)] and row_blocks(5, 512) == [(0, 5)] and row_blocks(0, 8) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_is_argmax_on_ties_nan_and_inf(dtype):
    """``first_argmax`` (``torch.max(x, -1).indices``, what the diagnostics' top-1 agreement and the scoring's
    ``greedy`` use) gives ``argmax``'s index: the first of tied maxima, NaN as the maximum, on rows of
    small-integer logits (many ties), with NaN and inf, at 1 and 2 threads, on a vocabulary-sized and a
    short row, and in the agreement of an expert with a model whose top logits tie."""
    from darts_bench.surgery.diagnostics import ExpertDistribution
    from darts_bench.surgery.losses import first_argmax

    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for V in (49_152, 1_003, 3):
                x = torch.randint(0, 4, (130, V), generator=g).to(dtype)
                x[3, V // 2] = float("nan")
                x[4] = float("nan")
                x[5, -2:] = float("inf")
                x[6] = 7  # every entry tied: index 0
                want = x.argmax(-1)
                assert torch.equal(first_argmax(x), want), (nt, V)
                assert want[6] == 0 and want[4] == 0 and want[3] == V // 2
    finally:
        torch.set_num_threads(threads)
    le = torch.randint(0, 3, (64, 500), generator=g).float()
    lm = torch.randint(0, 3, (64, 500), generator=g).float()
    _, agree = ExpertDistribution(le).compare(lm)
    assert torch.equal(agree, (le.argmax(-1) == lm.argmax(-1)).float())


def test_grouped_diagnostics_equal_one_call_per_group():
    """``diagnose_rows(..., groups=...)`` (the task-agnostic rows' one pass: routed and shared heads of
    both methods beside one plain-merge row) gives, per group, exactly the JSON of a call with that
    group's heads alone."""
    import json

    from darts_bench.stages.train import diagnose_rows
    from darts_bench.surgery.data import answer_prediction_mask, shared_template
    from darts_bench.surgery.heads import build_head

    meta, val, offset, W_e, W_m = _prefix_case(seed=2)
    val.base.h_merged[val.base.positions >= 6] += 0.2 * torch.randn(int((val.base.positions >= 6).sum()), val.dim)
    template = shared_template(meta)
    heads = {}
    for k, (kind, method) in enumerate((("a", "surgery"), ("a", "darts"), ("b", "surgery"), ("b", "darts"))):
        h = build_head(method, val.dim, rank=2, max_len=32, seed=k)
        with torch.no_grad():
            h.up.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(k))
        heads[f"{kind}/{method}"] = h
    ref_meta = {"sequences": meta["sequences"][:3], "prompt_len": meta["prompt_len"][:3]}
    part = val.base.select(torch.nonzero(val.base.seq_index < 3)[:, 0])
    ref = part.select(answer_prediction_mask(part.positions, part.seq_index, ref_meta).nonzero()[:, 0])
    args = (val, meta, template, lambda: iter([ref]), ref.seq_index.numpy(), 0)
    kw = {"mean_h": 0.6, "w_max": 5.0, "W_e": W_e, "W_m": W_m, "seed": 4}
    groups = {g: {"none": "none", "surgery": f"{g}/surgery", "darts": f"{g}/darts"} for g in ("a", "b")}
    together = diagnose_rows({"none": None, **heads}, *args, **kw, groups=groups)
    assert set(together) == {"a", "b"}
    for g in groups:
        alone = diagnose_rows({"none": None, "surgery": heads[f"{g}/surgery"], "darts": heads[f"{g}/darts"]},
                              *args, **kw)
        assert json.dumps(together[g], sort_keys=True) == json.dumps(alone, sort_keys=True), g
    assert together["a"]["darts"]["kl_expert"] != together["b"]["darts"]["kl_expert"]
    with pytest.raises(ValueError, match="needs the row 'none'"):
        diagnose_rows({"none": None, **heads}, *args, **kw, groups={"a": {"darts": "a/darts"}})


@pytest.mark.parametrize("overflow", ["clamp", "zero", "bucket"])
def test_factored_head_logits_equal_lm_head_on_the_head_output(overflow):
    """A low-rank head's logits from the plain merge's (``HeadLogits``: ``W h - (W U) relu(D h) +
    (W b)[p]``) equal ``lm_head`` on the head's output up to float32 rounding; ``Diagnostics`` with
    and without the factored form give the same KL (1e-6 relative), agreement and L1 for plain,
    Surgery and DARTS heads (positions past ``max_len`` included), and the rank-matched head (rank
    near ``d``) is not factored."""
    from darts_bench.surgery.diagnostics import Diagnostics, HeadLogits
    from darts_bench.surgery.heads import build_head
    from darts_bench.surgery.train import TokenData

    torch.manual_seed(0)
    n, d, V = 700, 64, 3000
    W_e, W_m = torch.randn(V, d) * 0.3, torch.randn(V, d) * 0.3
    hm = torch.randn(n, d)
    he = hm + 0.3 * torch.randn(n, d)
    pos = torch.arange(n) % 70  # 10 sequences of 70 tokens; max_len 48 below: overflow handled
    heads = [None]
    for k, method in enumerate(("surgery", "darts", "darts_pos_only")):
        h = build_head(method, d, rank=4, max_len=48, overflow=overflow, seed=k)
        with torch.no_grad():
            h.up.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(10 + k))
            if h.pos_bias is not None:
                h.pos_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(20 + k))
        heads.append(h)
    big = build_head("surgery", d, rank=40, max_len=48, seed=9)
    assert [HeadLogits.pays(h, d) for h in heads[1:]] == [True] * 3 and not HeadLogits.pays(big, d)
    for h in heads[1:]:
        want = h(hm, pos) @ W_m.T
        got = HeadLogits(h, W_m).logits(hm @ W_m.T, hm, pos)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    data = TokenData(h_merged=hm, h_expert=he, positions=pos, weight_source=torch.rand(n),
                     seq_index=torch.arange(n) // 70)
    res = {f: Diagnostics(lambda: [data], 1.0, 5.0, W_e, W_m, batch_tokens=256, factored=f).many(heads + [big])
           for f in (True, False)}
    for a, b in zip(res[True], res[False]):
        assert a["per_token_l1"] == b["per_token_l1"] and a["per_token_agree"] == b["per_token_agree"]
        assert np.allclose(a["per_token_kl"], b["per_token_kl"], rtol=1e-6, atol=1e-9)
        assert a["kl_expert"] == pytest.approx(b["kl_expert"], rel=1e-6)
    assert res[True][0]["per_token_kl"] == res[False][0]["per_token_kl"]  # the plain row: the same matmul
    assert res[True][-1]["per_token_kl"] == res[False][-1]["per_token_kl"]  # not factored


@pytest.mark.parametrize("overflow", ["clamp", "zero", "bucket"])
def test_position_bias_rows_computed_once_per_stream(overflow):
    """A DARTS head's ``W b`` rows are computed once per distinct bias row over all the blocks a
    ``HeadLogits`` serves (a single new row too: it goes with a copy of itself), not once per block; the
    logits equal the per-block computation (the bias rows of each block's distinct positions, the way
    before 2026-12-05) within float32 rounding, and ``lm_head`` on the head's output likewise."""
    from darts_bench.surgery.diagnostics import HeadLogits
    from darts_bench.surgery.heads import build_head

    torch.manual_seed(1)
    d, V = 64, 3000
    W = torch.randn(V, d) * 0.3
    head = build_head("darts", d, rank=4, max_len=48, overflow=overflow, seed=3)
    with torch.no_grad():
        head.up.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
        head.pos_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
    f = HeadLogits(head, W)
    # a table over the byte budget is never made: the rows of each block's distinct positions, nothing kept
    per_block = HeadLogits(head, W, table_bytes=(head.pos_bias.shape[0] + 1) * V * 4 - 1)
    blocks = [torch.arange(70), torch.arange(30), torch.arange(40, 75), torch.tensor([75, 75, 3]),
              torch.tensor([90])]  # the last two blocks need one new row each (bucket: 75 and 90 share none)
    seen, distinct = set(), 0
    for pos in blocks:
        hm = torch.randn(len(pos), d)
        plain = hm @ W.T
        got = f.logits(plain, hm, pos)
        assert torch.allclose(per_block.logits(plain, hm, pos), got, rtol=1e-6, atol=1e-5)
        distinct += len(torch.unique(head.bias_index(pos)[0]))
        assert per_block.bias_rows_computed == distinct and not per_block._bias
        idx, keep = head.bias_index(pos)
        seen |= set(idx.tolist())
        assert f.bias_rows_computed == len(seen)
        rows, inv = torch.unique(idx, return_inverse=True)  # the per-block computation
        wb = (head.pos_bias[rows] @ W.T)[inv] * keep[:, None]
        want = plain - torch.relu(hm @ head.down.weight.T) @ (W @ head.up.weight).T + wb
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-5)
        assert torch.allclose(got, head(hm, pos) @ W.T, rtol=1e-5, atol=1e-5)
    assert f.bias_rows_computed < sum(len(torch.unique(head.bias_index(p)[0])) for p in blocks)


def test_factored_logits_of_a_routed_head_equal_lm_head_on_its_output():
    """A head chosen per sequence (the ``@routed`` rows) whose heads are all low-rank is factored too: each
    token's logits come from its routed head's factors. They equal ``lm_head`` on the routed head's output
    up to float32 rounding, and ``Diagnostics`` gives the same KL (1e-6 relative), agreements and L1 with
    and without the factored form. A routed head with a full-rank head among its heads is not factored;
    the factored logits of a routed head need the tokens' sequences."""
    from darts_bench.surgery.diagnostics import Diagnostics, HeadLogits
    from darts_bench.surgery.heads import build_head
    from darts_bench.surgery.routing import sequence_routed_head
    from darts_bench.surgery.train import TokenData

    torch.manual_seed(1)
    n, d, V, L = 600, 64, 2500, 60
    W_e, W_m = torch.randn(V, d) * 0.3, torch.randn(V, d) * 0.3
    hm = torch.randn(n, d)
    he = hm + 0.3 * torch.randn(n, d)
    pos, seq = torch.arange(n) % L, torch.arange(n) // L  # 10 sequences
    subs = {}
    for k, (task, method) in enumerate((("code", "darts"), ("math", "surgery"), ("chat", "darts"))):
        h = build_head(method, d, rank=4, max_len=48, seed=k)
        with torch.no_grad():
            h.up.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(30 + k))
            if h.pos_bias is not None:
                h.pos_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(40 + k))
        subs[task] = h
    seq_task = {i: ("code", "math", "chat")[i % 3] for i in range(10)}
    routed = sequence_routed_head(subs, seq_task)
    assert HeadLogits.pays(routed, d)
    want = routed(hm, pos, seq) @ W_m.T
    got = HeadLogits(routed, W_m).logits(hm @ W_m.T, hm, pos, seq_index=seq)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # a head's tokens in one run (one sequence; sequences 1-3, one head each) are computed in place (views), tokens
    # spread over the block (every sequence) gathered and scattered: bitwise the same logits either way
    f = HeadLogits(routed, W_m)
    for a, b in ((0, 60), (60, 200), (0, n)):
        plain, which = hm[a:b] @ W_m.T, routed.which(seq[a:b])
        got = f.logits(plain, hm[a:b], pos[a:b], seq_index=seq[a:b])
        gathered = torch.empty_like(plain)
        for k in which.unique().tolist():
            idx = (which == k).nonzero()[:, 0]
            gathered[idx] = f._one(k, plain[idx], hm[a:b][idx], pos[a:b][idx], None)
        assert torch.equal(got, gathered)
    with pytest.raises(ValueError, match="needs each token's seq_index"):
        HeadLogits(routed, W_m).logits(hm @ W_m.T, hm, pos)
    assert not HeadLogits.pays(sequence_routed_head({**subs, "big": build_head("surgery", d, rank=40)}, seq_task), d)
    data = TokenData(h_merged=hm, h_expert=he, positions=pos, weight_source=torch.rand(n), seq_index=seq)
    res = {f: Diagnostics(lambda: [data], 1.0, 5.0, W_e, W_m, batch_tokens=256, factored=f).many([None, routed])
           for f in (True, False)}
    a, b = res[True][1], res[False][1]
    assert a["per_token_l1"] == b["per_token_l1"] and a["per_token_agree"] == b["per_token_agree"]
    assert np.allclose(a["per_token_kl"], b["per_token_kl"], rtol=1e-6, atol=1e-9)
    assert a["kl_expert"] != res[True][0]["kl_expert"]  # the head changes the logits


def test_known_plain_row_and_floor_are_reused_bitwise():
    """A second ``Diagnostics`` over the same stream with the first one's ``known`` computes neither the
    plain merge's row nor the KL floor, and gives exactly the first one's values (every per-token list);
    ``diagnose_rows`` with a ``known`` dict filled by an earlier call gives the JSON of a fresh call. A
    stream of another length with that ``known`` raises."""
    import json

    from darts_bench.stages.train import diagnose_rows
    from darts_bench.surgery.data import answer_prediction_mask, shared_template
    from darts_bench.surgery.diagnostics import Diagnostics
    from darts_bench.surgery.heads import build_head

    meta, val, offset, W_e, W_m = _prefix_case(seed=3)
    val.base.h_merged[val.base.positions >= 6] += 0.2 * torch.randn(int((val.base.positions >= 6).sum()), val.dim)
    heads = {}
    for k, method in enumerate(("surgery", "darts", "surgery")):
        h = build_head(method, val.dim, rank=2 + 4 * (k == 2), max_len=32, seed=k)
        with torch.no_grad():
            h.up.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(k))
        heads[f"{method}{k}"] = h
    rows = [None, *heads.values()]
    first = Diagnostics(lambda: val.batches(50), 0.6, 5.0, W_e, W_m, batch_tokens=40)
    assert first.known is None
    want = first.many(rows)
    assert (first.plain_computations, first.floor_computations) == (1, 1)
    again = Diagnostics(lambda: val.batches(50), 0.6, 5.0, W_e, W_m, batch_tokens=40, known=first.known)
    got = again.many(rows)
    assert (again.plain_computations, again.floor_computations) == (0, 0)
    assert json.dumps(got) == json.dumps(want)
    assert json.dumps(again.many([None])) == json.dumps(want[:1])  # nothing but known rows: no logits at all
    short = Diagnostics(lambda: [val.select(torch.arange(30))], 0.6, 5.0, W_e, W_m, known=first.known)
    with pytest.raises(ValueError, match="token stream changed"):
        short.many([None])

    template = shared_template(meta)
    ref_meta = {"sequences": meta["sequences"][:3], "prompt_len": meta["prompt_len"][:3]}
    part = val.base.select(torch.nonzero(val.base.seq_index < 3)[:, 0])
    ref = part.select(answer_prediction_mask(part.positions, part.seq_index, ref_meta).nonzero()[:, 0])
    args = (val, meta, template, lambda: iter([ref]), ref.seq_index.numpy(), 0)
    kw = {"mean_h": 0.6, "w_max": 5.0, "W_e": W_e, "W_m": W_m, "seed": 4}
    known: dict = {}
    pair = {"none": None, "surgery": heads["surgery0"], "darts": heads["darts1"]}
    assert json.dumps(diagnose_rows(pair, *args, **kw, known=known)) == json.dumps(diagnose_rows(pair, *args, **kw))
    assert set(known) == {"val", "reference"}
    control = {"none": None, "surgery": heads["surgery2"]}
    assert json.dumps(diagnose_rows(control, *args, **kw, known=known)) == json.dumps(diagnose_rows(control, *args, **kw))


def test_seeds_share_one_reference_pass_and_give_their_own_calls_bitwise(monkeypatch):
    """``diagnose_seeds`` (the train stage's call per (merge, task, split)): three head seeds, each with its own
    held-out sequences, heads (factored rank 1 and unfactored rank 4, a DARTS table), entropy normaliser,
    bootstrap seed and ``groups``, over one reference-answer stream. The reference answers get one pass (the
    plain row and the KL floor once), each seed's held-out tokens their own, and each seed's result is the JSON
    of its own ``diagnose_rows`` call; every seed's ``known`` gets the reference stream's entry."""
    import json

    from darts_bench.stages.train import diagnose_rows, diagnose_seeds
    from darts_bench.surgery.data import TokenView, answer_prediction_mask, shared_template
    from darts_bench.surgery.diagnostics import Diagnostics, HeadLogits
    from darts_bench.surgery.heads import build_head

    meta, val, _, W_e, W_m = _prefix_case(seed=5)
    base = val.base
    base.h_merged[base.positions >= 6] += 0.2 * torch.randn(int((base.positions >= 6).sum()), val.dim)
    template = shared_template(meta)
    ref_meta = {"sequences": meta["sequences"][:4], "prompt_len": meta["prompt_len"][:4]}
    part = base.select(torch.nonzero(base.seq_index < 4)[:, 0])
    ref = part.select(answer_prediction_mask(part.positions, part.seq_index, ref_meta).nonzero()[:, 0])
    runs = []
    for s in range(3):
        held = torch.randperm(24, generator=torch.Generator().manual_seed(s))[:6]
        view = TokenView(base, torch.isin(base.seq_index, held).nonzero()[:, 0])
        heads = {"none": None}
        for k, (method, rank) in enumerate((("surgery", 1), ("darts", 1), ("surgery", 4))):
            h = build_head(method, val.dim, rank=rank, max_len=32, seed=10 * s + k)
            with torch.no_grad():
                h.up.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(10 * s + k))
                if h.pos_bias is not None:
                    h.pos_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(s))
            heads[f"{method}{rank}"] = h
        assert HeadLogits.pays(heads["surgery1"], val.dim) and not HeadLogits.pays(heads["surgery4"], val.dim)
        groups = {"heads": {"none": "none", "surgery": "surgery1", "darts": "darts1"},
                  "control": {"none": "none", "surgery": "surgery4"}} if s != 1 else None
        runs.append({"heads": heads, "val": view, "mean_h": 0.5 + 0.1 * s, "seed": 7 + s, "groups": groups})
    shared = (meta, template, lambda: iter([ref]), ref.seq_index.numpy(), 0)
    want = [json.dumps(diagnose_rows(r["heads"], r["val"], *shared, mean_h=r["mean_h"], w_max=5.0, W_e=W_e, W_m=W_m,
                                     seed=r["seed"], groups=r["groups"])) for r in runs]
    passes: list[tuple[int, int, int]] = []
    real = Diagnostics.per_token

    def counting(self, heads):
        out = real(self, heads)
        passes.append((len(heads), self.plain_computations, self.floor_computations))
        return out

    monkeypatch.setattr(Diagnostics, "per_token", counting)
    knowns = [{}, {}, {}]
    got = diagnose_seeds([{**r, "known": k} for r, k in zip(runs, knowns)], meta, template, lambda: iter([ref]),
                         ref.seq_index.numpy(), 0, 5.0, W_e, W_m)
    assert [json.dumps(g) for g in got] == want
    assert passes == [(10, 1, 1), (4, 1, 1), (4, 1, 1), (4, 1, 1)]  # reference: plain + 3 x 3 heads; held-out x 3
    assert all(k["reference"]["floor"] is knowns[0]["reference"]["floor"] for k in knowns)
    assert all("val" in k for k in knowns)
    again = diagnose_seeds([{**r, "known": k} for r, k in zip(runs, knowns)], meta, template, lambda: iter([ref]),
                           ref.seq_index.numpy(), 0, 5.0, W_e, W_m)
    assert [json.dumps(g) for g in again] == want and passes[4:] == [(10, 0, 0)] + [(4, 0, 0)] * 3
