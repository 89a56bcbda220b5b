"""Expert Merging (darts_bench/merge/expert_merging.py): its loss on a worked example computed by hand, one
optimisation step on a tiny decoder against the step computed independently (finite differences of a loss
written with other torch ops, then AdamW's first step by hand), the data order and the spec's validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from darts_bench.config import MergeSpec
from darts_bench.merge.expert_merging import (SigmoidLayerWiseMerge, alignment_loss, balanced_order,
                                              learn_coefficients, merged_names, pad_batches, regulariser)


def test_alignment_loss_worked_example():
    """Two sequences, V = 2, d = 2; the second has a pad position (its logits and hidden states are garbage and
    must not count). By hand, T = 1:
      seq 0, pos 0: teacher p = softmax(0, ln 3) = (1/4, 3/4), student log q = (-ln 2, -ln 2): CE = ln 2
      seq 0, pos 1: teacher p = (1/2, 1/2), student log q = log softmax(ln 3, 0) = (ln 3/4, ln 1/4):
                    CE = -(ln(3/4) + ln(1/4)) / 2
      hidden: pos 0 diff (1, 2): mean_d 2.5; pos 1 diff 0: seq 0's MSE (2.5 + 0) / 2 = 1.25
      seq 1, pos 0 only: teacher p = (1/2, 1/2), student (0, 0): CE = ln 2; hidden diff (3, 0): 4.5
    With T = 2 the logits (doubled here) give the same distributions and the CE is scaled by T^2 = 4."""
    ln3 = math.log(3)
    zt = torch.tensor([[[0.0, ln3], [0.0, 0.0]], [[0.0, 0.0], [50.0, -50.0]]])
    zs = torch.tensor([[[0.0, 0.0], [ln3, 0.0]], [[0.0, 0.0], [-50.0, 50.0]]])
    hs = torch.tensor([[[1.0, 2.0], [0.5, 0.5]], [[3.0, 0.0], [9.0, 9.0]]])
    ht = torch.tensor([[[0.0, 0.0], [0.5, 0.5]], [[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    ce0 = (math.log(2) - (math.log(3 / 4) + math.log(1 / 4)) / 2) / 2
    got = alignment_loss(zs, zt, hs, ht, mask, 1.0, 0.5)
    torch.testing.assert_close(got, torch.tensor([ce0 + 0.5 * 1.25, math.log(2) + 0.5 * 4.5]), rtol=1e-6, atol=0)
    got2 = alignment_loss(2 * zs, 2 * zt, None, None, mask, 2.0, 0.5)
    torch.testing.assert_close(got2, torch.tensor([4 * ce0, 4 * math.log(2)]), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="no real token"):
        alignment_loss(zs, zt, None, None, torch.tensor([[1, 1], [0, 0]]), 1.0, 0.0)


def test_regulariser_by_hand():
    """R = weight * sum |sigmoid(w) - init| / L: w = logit(0.1) everywhere but one entry at 0 (sigmoid 0.5)."""
    w = torch.full((2, 4), math.log(0.1 / 0.9))
    w[1, 2] = 0.0
    assert regulariser(w, 0.1, 5.0).item() == pytest.approx(5.0 * 0.4 / 4, rel=1e-6)


def _tiny_pool():
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    experts = []
    for _ in range(2):
        m = LlamaForCausalLM(LlamaConfig(**kw)).eval()
        m.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.3 * torch.randn_like(p))
        for p in m.parameters():
            p.requires_grad_(False)
        experts.append(m)
    for p in base.parameters():
        p.requires_grad_(False)
    return base, experts


def test_excluded_tensors_are_the_codes_defaults():
    base, _ = _tiny_pool()
    names = merged_names([n for n, _ in base.named_parameters()])
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert not [n for n in names if "embed" in n or "lm_head" in n or "norm" in n]
    assert len(names) == 2 * 7  # 7 linear weights a layer


def _reference_loss(base, experts, w, names, batch, layer, T, hidden_weight, init, sparsity_weight):
    """The step objective written independently: merged state dict by the formula, the HF model run on it,
    CE as KL + teacher entropy, per-sequence means by explicit loops."""
    sd = {n: p.detach().clone().double() for n, p in base.named_parameters()}
    for l, n in enumerate(names):
        sd[n] = sd[n] + sum(torch.sigmoid(w[k, l]).double() * (dict(e.named_parameters())[n].double() - sd[n])
                            for k, e in enumerate(experts))
    student = type(base)(base.config).double().eval()
    student.load_state_dict(sd, strict=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    total = 0.0
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        x = ids[b:b + 1, :n]
        so = student(input_ids=x, output_hidden_states=True)
        te = experts[batch["teacher"][b]].double()(input_ids=x, output_hidden_states=True)
        experts[batch["teacher"][b]].float()
        logp_t = F.log_softmax(te.logits[0] / T, -1)
        kl = F.kl_div(F.log_softmax(so.logits[0] / T, -1), logp_t, log_target=True, reduction="none").sum(-1)
        ent = -(logp_t.exp() * logp_t).sum(-1)
        ce = (kl + ent).mean() * T * T
        mse = F.mse_loss(so.hidden_states[layer][0], te.hidden_states[layer][0])
        total += float((ce + hidden_weight * mse).detach())
    reg = sparsity_weight * float((torch.sigmoid(w.double()) - init).abs().sum()) / w.shape[1]
    return total / ids.shape[0] + reg


def test_one_step_on_a_tiny_decoder_matches_the_independent_step():
    """Loss at the start equals the independent loss (float32 vs float64: 1e-5 relative); the first AdamW step
    is w1 = w0 (1 - lr wd) - lr g_c / (|g_c| + eps) (Adam's bias-corrected first step), g_c the gradient clipped to
    norm 1, g from central finite differences of the independent loss in float64. At the start the regulariser
    sits at its kink (sigmoid(w0) - init is exactly 0 in float32, and torch's subgradient of |x| at 0 is 0), so g
    is the alignment's alone: the finite differences leave the regulariser out (in float64 sigmoid(w0) is 0.1 plus
    a rounding that would add a spurious slope)."""
    base, experts = _tiny_pool()
    merge = SigmoidLayerWiseMerge(base, [dict(e.named_parameters()) for e in experts])
    seqs = [[1, 5, 9, 3, 7], [2, 4, 6], [8, 8, 1, 2]]
    batch = pad_batches(seqs, [0, 1, 0], 3, 0)[0]
    spec = MergeSpec(name="em", method="expert_merging", steps=1, lr=0.05, hidden_weight=0.5, temperature=2.0)
    w0 = torch.full(merge.shape, math.log(0.1 / 0.9))
    w1, hist = learn_coefficients(merge, [batch], experts, 1, spec)
    ref = _reference_loss(base, experts, w0, merge.names, batch, 1, 2.0, 0.5, 0.1, 5.0)
    assert hist[0]["loss"] == pytest.approx(ref, rel=1e-5) and hist[0]["reg"] == 0.0 and hist[0]["lr"] == 0.05
    h = 1e-3
    g = torch.zeros(merge.shape, dtype=torch.float64)
    for k in range(2):
        for l in range(merge.shape[1]):
            wp, wm = w0.clone().double(), w0.clone().double()
            wp[k, l] += h
            wm[k, l] -= h
            g[k, l] = (_reference_loss(base, experts, wp, merge.names, batch, 1, 2.0, 0.5, 0.1, 0.0)
                       - _reference_loss(base, experts, wm, merge.names, batch, 1, 2.0, 0.5, 0.1, 0.0)) / (2 * h)
    assert (g.abs() > 1e-7).all(), g  # every coefficient moves the loss (the smallest |g| is about 4e-7)
    gc = g * min(1.0, 1.0 / (float(g.norm()) + 1e-6))  # clip_grad_norm_ to 1
    want = w0.double() * (1 - 0.05 * 1e-5) - 0.05 * gc / (gc.abs() + 1e-8)
    big = g.abs() > 1e-5  # float32 gradients of |g| < 1e-6 carry ~10% rounding, which Adam's eps 1e-8 turns into ~1e-4
    torch.testing.assert_close(w1.double()[big], want[big], rtol=0, atol=1e-6)
    torch.testing.assert_close(w1.double(), want, rtol=0, atol=5e-4)
    assert torch.equal(torch.sign(w1.double() - w0.double()), -torch.sign(g)) and big.sum() >= 16
    assert (w1 != w0).all()


def test_balanced_order_interleaves_tasks_and_cycles():
    prompts = {"b": ("e2", ["b0", "b1"]), "a": ("e1", ["a0", "a1", "a2"])}
    order = balanced_order(prompts, 7, seed=0)
    assert [t for t, _ in order] == ["a", "b", "a", "b", "a", "a", "b"]
    assert sorted(p for t, p in order[:5]) == ["a0", "a1", "a2", "b0", "b1"] and order[5:] == order[:2]
    assert balanced_order(prompts, 7, seed=0) == order


def test_expert_merging_spec_defaults_and_validation():
    s = MergeSpec(name="em", method="expert_merging")
    assert (s.steps, s.lr, s.init, s.batch_size, s.temperature, s.sparsity_weight, s.hidden_weight,
            s.calibration_split) == (2, 0.5, 0.1, 8, 1.0, 5.0, 1.0, "transductive")
    with pytest.raises(ValueError, match=r"init 1.5 must be in \(0, 1\)"):
        MergeSpec(name="em", method="expert_merging", init=1.5)
    with pytest.raises(ValueError, match="takes no alpha"):
        MergeSpec(name="em", method="expert_merging", alpha=0.5)
    with pytest.raises(ValueError, match="takes no temperature"):
        MergeSpec(name="ada", method="adamerging", temperature=2.0)
    with pytest.raises(ValueError, match="weight is a mergekit option"):
        MergeSpec(name="e", method="emr", weight=0.5)
    assert "temperature" not in MergeSpec(name="ta", method="task_arithmetic", weight=0.3).model_dump()
