"""EMR-Merging (darts_bench/merge/emr.py) against FusionBench's ``emr_merge`` and ``EMRTaskModulator`` on a tiny
decoder pool (every tensor of every task's model compared), its bit-packed record, and its materialised
per-task checkpoints."""

import json

import pytest
import torch

from darts_bench.merge.emr import (build_emr, emr_merge, load_record, pack_mask, reconstruct, task_dir,
                                   unpack_mask)

KW = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1)


def _pool(tied: bool, k: int = 3, seed: int = 0):
    """A random tiny Llama and ``k`` experts: the base plus 0.02 N(0, 1) noise on every parameter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tied, **KW))
    experts = []
    for _ in range(k):
        m = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tied, **KW))
        m.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.02 * torch.randn_like(p))
        experts.append(m)
    return base, experts


@pytest.mark.parametrize("tied", [True, False])
def test_emr_equals_fusion_bench_for_every_tasks_weights(tied):
    """Unified vector, masks and rescalers equal fusion-bench 0.2.33's ``emr_merge`` bit for bit, and each task's
    reconstructed weights equal its ``EMRTaskModulator`` applied to the base (a fresh modulated model per task:
    fusion-bench's ``set_task`` swaps in place, subtracting the previous task's delta, which drifts by about an
    ulp per swap, 1.2e-7 on this pool; ours rebuilds each task from the base)."""
    import fusion_bench.method.emr_merging.utils as fb  # the dev extra pins fusion-bench (MIT)
    base, experts = _pool(tied)
    bsd = {n: p.detach().clone() for n, p in base.named_parameters()}
    taus = [{n: p.detach() - bsd[n] for n, p in m.named_parameters()} for m in experts]
    u, masks, r = emr_merge(taus)
    fu, fm, fr = fb.emr_merge([{n: t.clone() for n, t in tv.items()} for tv in taus])
    assert torch.equal(r, fr) and r.dtype == torch.float32
    assert set(u) == set(fu) == set(bsd)
    for n in u:
        assert torch.equal(u[n], fu[n].float()), n
        for k in range(3):
            assert torch.equal(masks[n][k], fm[n][k]), (n, k)
    for k in range(3):
        from transformers import LlamaConfig, LlamaForCausalLM

        backbone = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tied, **KW))
        backbone.load_state_dict(base.state_dict())
        emr = fb.EMRModulatedModel(backbone=backbone, modulators={}, unified_task_vector=fu)
        emr.add_modulator(task_name="t", modulator=fb.EMRTaskModulator(mask={n: m[k] for n, m in fm.items()},
                                                                      rescaler=fr[k].clone()))
        emr.set_task("t")
        theirs = dict(emr.backbone.named_parameters())
        ours = reconstruct(bsd, u, {n: masks[n][k] for n in u}, r[k])
        for n in ours:
            assert torch.equal(ours[n], theirs[n].detach()), (k, n)


def test_emr_worked_example_by_hand():
    """Three experts, one 4-entry tensor, computed from the paper's equations by hand (the reference's
    per-tensor mean in the rescaler)."""
    t1, t2, t3 = torch.tensor([0.3, -0.2, 0.0, 0.5]), torch.tensor([-0.1, -0.4, 0.2, 0.1]), \
        torch.tensor([0.2, 0.1, -0.3, -0.6])
    u, masks, r = emr_merge([{"w": t1}, {"w": t2}, {"w": t3}])
    # sums 0.4, -0.5, -0.1, 0.0 -> signs +, -, -, - (a zero sum elects -1)
    assert torch.equal(masks["w"], torch.tensor([[True, True, False, False], [False, True, False, False],
                                                 [True, False, True, True]]))
    torch.testing.assert_close(u["w"], torch.tensor([0.3, -0.4, -0.3, -0.6]), rtol=0, atol=0)
    # rescaler_k = mean|tau_k| / mean|mask_k * tau_uni|
    want = torch.tensor([(1.0 / 4) / (0.7 / 4), (0.8 / 4) / (0.4 / 4), (1.2 / 4) / (1.2 / 4)])
    torch.testing.assert_close(r, want, rtol=1e-6, atol=0)
    theta = reconstruct({"w": torch.ones(4)}, u, {"w": masks["w"][1]}, r[1])["w"]
    torch.testing.assert_close(theta, torch.tensor([1.0, 1 - 0.4 * 2.0, 1.0, 1.0]), rtol=1e-6, atol=0)


def test_emr_refuses_an_expert_equal_to_the_base_and_mismatched_vectors():
    with pytest.raises(ValueError, match=r"agree with the elected sign nowhere"):
        emr_merge([{"w": torch.tensor([1.0, 2.0])}, {"w": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"task vector 1 differs .* \['w'\]"):
        emr_merge([{"w": torch.ones(2)}, {"w": torch.ones(3)}])
    with pytest.raises(ValueError, match="at least two"):
        emr_merge([{"w": torch.ones(2)}])


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
def test_mask_bit_packing_round_trips(n):
    g = torch.Generator().manual_seed(n)
    m = torch.rand(n, generator=g) > 0.5
    bits = pack_mask(m)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-n // 8)
    assert torch.equal(unpack_mask(bits, (n,)), m)
    m2 = m[: (n // 2) * 2].reshape(2, -1) if n > 1 else m.reshape(1, 1)
    assert torch.equal(unpack_mask(pack_mask(m2), tuple(m2.shape)), m2)


def test_build_emr_materialises_each_task_model_from_the_record(tmp_path):
    """``build_emr`` on a saved tiny pool: the record reloads to the same unified vector, masks and rescalers; each
    ``tasks/<expert>/`` checkpoint's weights equal the reconstruction bit for bit, and its forward equals the
    reconstructed state dict's forward; the record is about (1 + K/32)/K of K full checkpoints."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import tiny_llama_and_tokenizer
    from darts_bench.config import MergeSpec

    model, tok = tiny_llama_and_tokenizer(["def f(x): return x", "2 + 2 = 4", "write a poem"])
    dirs = {}
    for i, name in enumerate(["base", "code", "math", "instruction"]):
        m = type(model)(model.config)
        m.load_state_dict(model.state_dict())
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
        dirs[name] = tmp_path / name
        m.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    out = tmp_path / "emr"
    out.mkdir()
    spec = MergeSpec(name="emr", method="emr")
    experts = {e: dirs[e] for e in ("code", "math", "instruction")}
    rec = build_emr(spec, dirs["base"], experts, None, out)
    names, u, masks, r = load_record(out)
    assert names == ["code", "math", "instruction"]
    bsd = {n: p.detach() for n, p in model.named_parameters()}
    taus = [{n: p.detach() - bsd[n] for n, p in AutoModelForCausalLM.from_pretrained(experts[e]).named_parameters()}
            for e in names]
    u2, m2, r2 = emr_merge(taus)
    assert torch.equal(r, r2) and all(torch.equal(u[n], u2[n]) for n in u)
    assert all(torch.equal(masks[n][k], m2[n][k]) for n in u for k in range(3))
    assert json.loads((out / "emr.json").read_text())["rescalers"] == {e: float(r[k]) for k, e in enumerate(names)}
    assert rec["mask_density"]["code"] == pytest.approx(sum(int(m2[n][0].sum()) for n in u) / rec["parameters"])
    ids = tok(["2 + 2 = 4"], return_tensors="pt")["input_ids"]
    for k, e in enumerate(names):
        want = reconstruct(bsd, u, {n: masks[n][k] for n in u}, r[k])
        got = load_file(str(task_dir(out, e) / "model.safetensors"))
        assert all(torch.equal(got[n], want[n]) for n in want)
        loaded = AutoModelForCausalLM.from_pretrained(task_dir(out, e)).eval()
        ref = type(model)(model.config).eval()
        ref.load_state_dict({**model.state_dict(), **want})
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, ref(ids).logits)
        assert (task_dir(out, e) / "tokenizer.json").is_file()
    full = sum((task_dir(out, e) / "model.safetensors").stat().st_size for e in names)
    assert rec["record_bytes"] < 0.5 * full
