"""The data merges: AdaMerging's coefficients and RegMean's closed form against hand-computed values,
then both as rows of a micro run (built from the calibration prompts, cached, heads, evaluation)."""

import json
import math

import numpy as np
import pytest
import torch

from darts_bench.config import ConfigError, MergeSpec, load_config
from darts_bench.merge.adamerging import LayerWiseMerge, learn_coefficients, mean_entropy
from darts_bench.merge.regmean import input_grams, regmean_linear

SCALE = 4.0  # logit norm of the toy below
D_STAR = np.array([2.0, -1.0, -1.0]) / math.sqrt(6)  # the least-entropy unit direction of 3 logits
LAM_STAR = (0.7, 0.2)
T1, T2 = np.array([1.0, 0.5, -0.3]), np.array([0.2, -1.0, 0.6])
C = 1.5 * D_STAR - LAM_STAR[0] * T1 - LAM_STAR[1] * T2  # base weights: c + 0.7 t1 + 0.2 t2 = 1.5 d*


class Toy(torch.nn.Module):
    """One parameter tensor W [3, 1]; logits ``SCALE * W[:, 0] / ||W[:, 0]||`` at every position, so the
    entropy depends on W's direction only and has a finite minimiser."""

    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.as_tensor(w, dtype=torch.float64)[:, None].clone(), requires_grad=False)

    def forward(self, input_ids, attention_mask):
        u = self.weight[:, 0]
        return (SCALE * u / u.norm()).expand(*input_ids.shape, -1)


def _toy():
    merge = LayerWiseMerge(Toy(C), [{"weight": torch.tensor(C + t)[:, None]} for t in (T1, T2)])
    batch = (torch.zeros(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [1, 1, 0]]))
    return merge, batch


def _entropy(u):
    z = SCALE * u / np.linalg.norm(u)
    p = np.exp(z - z.max())
    p /= p.sum()
    return -(p * np.log(p)).sum(), p, z


def test_mean_entropy_counts_real_positions_only():
    logits = torch.tensor([[[0.0, 0.0], [5.0, -5.0]], [[1.0, 0.0], [9.0, 9.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    h = [-(q * math.log(q) + (1 - q) * math.log(1 - q)) for q in (0.5, 1 / (1 + math.exp(-10)), 1 / (1 + math.exp(-1)))]
    assert mean_entropy(logits, mask).item() == pytest.approx(sum(h) / 3, abs=1e-6)


def test_adamerging_first_step_is_the_hand_computed_adam_step():
    """lambda starts at 0.3; the entropy gradient by hand (chain rule through the softmax and the
    normalisation: dH/dz = -p (log p + H), dz/du = s (I - u^ u^T) / ||u||, du/dlambda_k = t_k), then
    Adam's first step lambda - lr * g / (|g| + eps) (bias-corrected m = g, v = g^2)."""
    merge, batch = _toy()
    u = C + 0.3 * T1 + 0.3 * T2
    H, p, _ = _entropy(u)
    uh = u / np.linalg.norm(u)
    dz = -p * (np.log(p) + H)
    du = SCALE / np.linalg.norm(u) * (np.eye(3) - np.outer(uh, uh)) @ dz
    g = np.array([T1 @ du, T2 @ du])
    lam0 = torch.full((2, 1), 0.3, requires_grad=True)
    loss = merge.loss(lam0, batch)
    loss.backward()
    assert loss.item() == pytest.approx(H, abs=1e-6)
    np.testing.assert_allclose(lam0.grad[:, 0].numpy(), g, rtol=1e-5, atol=1e-8)
    lam1, hist = learn_coefficients(merge, [batch], steps=1, lr=0.01, init=0.3, seed=0)
    np.testing.assert_allclose(lam1[:, 0].numpy(), 0.3 - 0.01 * g / (np.abs(g) + 1e-8), rtol=0, atol=1e-7)
    assert hist == [pytest.approx(H, abs=1e-6)]


def test_adamerging_finds_the_entropy_minimiser():
    """By construction the merged direction equals d* = (2, -1, -1)/sqrt(6) at lambda = (0.7, 0.2), and d*
    is the least-entropy unit direction (checked here on 20,000 random directions); a 121 x 121 grid over
    [-1, 2]^2 (step 0.025) finds the same point; AdaMerging from 0.3 reaches it within 1e-3."""
    merge, batch = _toy()
    rng = np.random.default_rng(0)
    h_star = _entropy(D_STAR)[0]

    def entropies(u):  # [n, 3] -> [n]
        z = SCALE * u / np.linalg.norm(u, axis=1, keepdims=True)
        lp = z - z.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        return -(np.exp(lp) * lp).sum(1)

    assert entropies(rng.normal(size=(20000, 3))).min() >= h_star - 1e-12
    grid = np.stack(np.meshgrid(np.linspace(-1, 2, 121), np.linspace(-1, 2, 121), indexing="ij"), -1).reshape(-1, 2)
    h = entropies(C + grid[:, :1] * T1 + grid[:, 1:] * T2)
    assert tuple(grid[h.argmin()]) == pytest.approx(LAM_STAR, abs=1e-9) and h.min() == pytest.approx(h_star, abs=1e-12)
    with torch.no_grad():  # the merged model's loss at the grid minimum is that entropy (fp32 softmax)
        assert merge.loss(torch.tensor([[0.7], [0.2]]), batch).item() == pytest.approx(h_star, abs=1e-6)
    lam, hist = learn_coefficients(merge, [batch], steps=400, lr=0.03, init=0.3, seed=0)
    np.testing.assert_allclose(lam[:, 0].numpy(), LAM_STAR, atol=1e-3)
    assert hist[-1] == pytest.approx(h_star, abs=1e-6) and hist[0] > hist[-1] + 0.04


def test_corpus_entropy_is_the_token_weighted_mean_of_the_batch_losses_bit_for_bit():
    """The entropy before and after (``corpus_entropy``: the merged tensors once for all batches) is the
    real-token-weighted mean of ``loss`` per batch (each batch recombining the tensors itself), to the
    bit, on a random two-layer Llama with right padding; an all-padding corpus is refused by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    experts = [{n: p + 0.02 * torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(3)]
    merge = LayerWiseMerge(model, experts)
    ids = torch.randint(0, 61, (7, 9))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[4, 2:] = 0
    mask[6, 7:] = 0
    batches = [(ids[i:i + 3], mask[i:i + 3]) for i in range(0, 7, 3)]  # 3 + 3 + 1 prompts
    lam = 0.3 + 0.1 * torch.randn(merge.shape)
    with torch.no_grad():
        want = sum(merge.loss(lam, b).item() * int(b[1].sum()) for b in batches) / int(mask.sum())
    assert merge.corpus_entropy(lam, batches) == want
    with pytest.raises(ValueError, match="at least one real"):
        merge.corpus_entropy(lam, [(ids[:1], torch.zeros_like(ids[:1]))])


def test_regmean_linear_is_the_closed_form():
    rng = np.random.default_rng(0)
    X = [rng.normal(size=(40, 5)) * s for s in (1.0, 2.0, 0.5)]
    W = [rng.normal(size=(3, 5)) for _ in X]
    for alpha in (1.0, 0.9, 0.0):
        G = [x.T @ x for x in X]
        Gt = [alpha * g + (1 - alpha) * np.diag(np.diag(g)) for g in G]
        want = np.linalg.inv(sum(Gt)) @ sum(g @ w.T for g, w in zip(Gt, W))  # [d_in, d_out]
        got = regmean_linear([torch.tensor(g) for g in G], [torch.tensor(w) for w in W], alpha)
        np.testing.assert_allclose(got.numpy(), want.T, atol=1e-6, rtol=0)
    # alpha = 1 is the least-squares fit of the stacked regressions
    ls = np.linalg.lstsq(np.vstack(X), np.vstack([x @ w.T for x, w in zip(X, W)]), rcond=None)[0]
    np.testing.assert_allclose(regmean_linear([torch.tensor(x.T @ x) for x in X], [torch.tensor(w) for w in W], 1.0)
                               .numpy(), ls.T, atol=1e-6)
    # identical Gram matrices: the simple average
    g = torch.tensor(X[0].T @ X[0])
    np.testing.assert_allclose(regmean_linear([g, g, g], [torch.tensor(w) for w in W], 0.9).numpy(),
                               np.mean(W, axis=0), atol=1e-6)
    with pytest.raises(ValueError, match="singular"):
        regmean_linear([torch.zeros(5, 5)], [torch.tensor(W[0])], 1.0)


def test_input_grams_share_a_product_between_projections_of_one_input_bit_for_bit():
    """``input_grams`` reuses the Gram matrix of the input q / k / v (and gate / up) projections share; each
    module's matrix is still X^T X of its own inputs over the real positions, equal to the bit to a hook
    per module computing its own, over batches with padding (a random two-layer Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from darts_bench.merge.regmean import linear_modules

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 61, (5, 7))
    mask = torch.ones_like(ids)
    mask[2, 4:] = 0
    batches = [(ids[:3], mask[:3]), (ids[3:], mask[3:])]
    own: dict[str, torch.Tensor] = {}
    state = {}

    def hook(name):
        def fn(_m, inputs, _o):
            x = inputs[0][state["mask"]].double()
            own[name] = own[name] + x.T @ x if name in own else x.T @ x
        return fn

    mods = linear_modules(model)
    handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
    with torch.no_grad():
        for i, m in batches:
            state["mask"] = m.bool()
            model(input_ids=i, attention_mask=m)
    for h in handles:
        h.remove()
    grams, tokens = input_grams(model, batches)
    assert tokens == int(mask.sum()) and set(grams) == set(own) == set(mods) and len(mods) == 2 * 7 + 1  # lm_head untied
    assert all(torch.equal(grams[n], own[n]) for n in own)
    layer = "model.layers.1"
    assert torch.equal(grams[f"{layer}.self_attn.q_proj"], grams[f"{layer}.self_attn.v_proj"])
    assert torch.equal(grams[f"{layer}.mlp.gate_proj"], grams[f"{layer}.mlp.up_proj"])
    assert not torch.equal(grams[f"{layer}.self_attn.q_proj"], grams[f"{layer}.self_attn.o_proj"])


def test_data_merge_specs_validated():
    spec = MergeSpec(name="ada", method="adamerging")
    assert (spec.steps, spec.lr, spec.init, spec.batch_size, spec.calibration_split) == (100, 1e-3, 0.3, 8, "transductive")
    assert MergeSpec(name="rm", method="regmean").alpha == 0.9
    # a mergekit merge serialises (and hashes) without the data fields
    assert set(MergeSpec(name="t", method="task_arithmetic", weight=0.3).model_dump()) == {
        "name", "method", "weight", "density", "normalize", "int8_mask", "dtype"}
    for bad, msg in [({"method": "adamerging", "alpha": 0.5}, "adamerging takes no alpha"),
                     ({"method": "regmean", "steps": 3}, "regmean takes no steps"),
                     ({"method": "ties", "density": 0.2, "lr": 1e-3}, "ties takes no lr"),
                     ({"method": "regmean", "weight": 0.3}, "weight is a mergekit option"),
                     ({"method": "adamerging", "density": 0.3}, "takes no density"),
                     ({"method": "regmean", "alpha": 1.5}, "less than or equal to 1"),
                     ({"method": "adamerging", "steps": 0}, "greater than or equal to 1")]:
        with pytest.raises(ValueError, match=msg):
            MergeSpec(name="m", **bad)
    with pytest.raises(ConfigError, match="calibration_split 'inductive' is not one of calibration.splits"):
        load_config("tiny", ['merges=[{"name": "a", "method": "adamerging", "calibration_split": "inductive"}]',
                             "calibration.splits=[transductive]"])


# ------------------------------------------------------------------------------ micro pool
ADA = {"name": "ada", "method": "adamerging", "steps": 3, "batch_size": 4, "lr": 0.01}
RM = {"name": "rm", "method": "regmean", "batch_size": 4}


@pytest.mark.micro
def test_data_merges_on_the_micro_pool(micro_pipeline, micro_cfg_path, tmp_path, caplog):
    """Both merges build from the micro run's calibration prompts, record what they learned, are cached
    (no rebuild on a second call; a new key when steps or the data change), and RegMean's layers are the
    closed form of the Gram matrices computed here."""
    from safetensors.torch import load_file

    from darts_bench.merge import build_merges
    from darts_bench.merge.data import load_model, prompt_batches, prompts_by_task

    cfg = load_config(str(micro_cfg_path), [f"merges={json.dumps([ADA, RM])}"])
    pool, loaded = micro_pipeline.pool(), micro_pipeline.loaded_tasks()
    work = tmp_path / "work"
    with pytest.raises(ValueError, match="needs the run's calibration prompts"):
        build_merges(cfg, pool, work)
    merges = build_merges(cfg, pool, work, loaded)
    rec = json.loads((merges["ada"] / "adamerging.json").read_text())
    prompts = prompts_by_task(cfg, loaded, "transductive")
    assert rec["data"]["prompts"] == {t: {"expert": e, "n": len(p)} for t, (e, p) in prompts.items()}
    assert len(prompts) == 3 and all(len(p) == 6 for _, p in prompts.values())
    n_params = len(list(load_model(pool.base, "cpu").named_parameters()))
    assert set(rec["coefficients"]) == {"code", "math", "instruction"}
    assert all(len(v) == n_params for v in rec["coefficients"].values())
    assert len(rec["entropy"]["per_step"]) == 3 and rec["entropy"]["final"] < rec["entropy"]["initial"]
    lam = np.array([list(v.values()) for v in rec["coefficients"].values()])
    # 3 Adam steps of lr 0.01 from 0.3: each moves a coefficient by about lr (exactly lr on the first step)
    assert np.all(np.abs(lam - 0.3) <= 1.5 * 3 * 0.01) and np.abs(lam - 0.3).max() > 0.02
    # the written weights are base + sum_k lambda tau_k
    base, merged = load_file(str(pool.base / "model.safetensors")), load_file(str(merges["ada"] / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    want = base[name] + sum(rec["coefficients"][e][name] * (load_file(str(pool.experts[e] / "model.safetensors"))[name]
                                                            - base[name]) for e in rec["coefficients"])
    torch.testing.assert_close(merged[name], want, atol=1e-6, rtol=0)
    # RegMean: one layer against regmean_linear of Gram matrices computed here, norms averaged
    rm = load_file(str(merges["rm"] / "model.safetensors"))
    layer = "model.layers.1.self_attn.o_proj"
    grams, ws = [], []
    for e in ("code", "math", "instruction"):
        m = load_model(pool.experts[e], "cpu")
        ps = [p for _, (ex, pp) in sorted(prompts.items()) if ex == e for p in pp]
        grams.append(input_grams(m, prompt_batches(loaded.tokenizer, ps, 4, cfg.calibration.max_prompt_tokens))[0][layer])
        ws.append(dict(m.named_parameters())[f"{layer}.weight"].detach())
    torch.testing.assert_close(rm[f"{layer}.weight"], regmean_linear(grams, ws, 0.9).float(), atol=1e-5, rtol=1e-5)
    norm = "model.layers.1.input_layernorm.weight"
    torch.testing.assert_close(rm[norm], torch.stack([load_file(str(pool.experts[e] / "model.safetensors"))[norm]
                                                      for e in ("code", "math", "instruction")]).mean(0))
    assert (merges["rm"] / "tokenizer.json").is_file() and (merges["rm"] / "generation_config.json").is_file()
    # cached: same dirs, weights untouched
    mtimes = {m: (d / "model.safetensors").stat().st_mtime_ns for m, d in merges.items()}
    with caplog.at_level("INFO", logger="darts_bench"):
        assert build_merges(cfg, pool, work, loaded) == merges
    assert {m: (d / "model.safetensors").stat().st_mtime_ns for m, d in merges.items()} == mtimes
    assert sum("cached" in r.message for r in caplog.records) == 2
    # the key follows the steps and the data; a mergekit field of no data merge leaves it alone
    more = load_config(str(micro_cfg_path), [f"merges={json.dumps([{**ADA, 'steps': 4}, RM])}"])
    other = build_merges(more, pool, work, loaded)
    assert other["ada"] != merges["ada"] and other["rm"] == merges["rm"]
    ind = load_config(str(micro_cfg_path), [f"merges={json.dumps([{**ADA, 'calibration_split': 'inductive'}])}"])
    assert build_merges(ind, pool, work, loaded)["ada"] != merges["ada"]


@pytest.mark.micro
def test_data_merge_rows_get_heads_and_evaluation(micro_cfg_path, micro_pipeline, tmp_path):
    """A micro run whose merges are AdaMerging and RegMean: both get Surgery and DARTS rows, every row
    is evaluated on every task, and results.json's manifest carries the learned coefficients."""
    from darts_bench.pipeline import Pipeline

    micro_pipeline.pool()  # the session's pool (same work dir, cached)
    cfg = load_config(str(micro_cfg_path), [f"merges={json.dumps([ADA, RM])}", f"out_dir={tmp_path / 'results'}"])
    pipe = Pipeline(cfg)
    try:
        pipe.report()
    finally:
        pipe.close()
    res = json.loads((tmp_path / "results" / "results.json").read_text())
    rows = {r["model"]: r for r in res["rows"]}
    for m in ("ada", "rm"):
        for row in (m, f"{m}+surgery", f"{m}+darts"):
            assert row in rows, sorted(rows)
            assert all(isinstance(rows[row][f"{t}_ref_nll"], float) for t in ("humaneval", "gsm8k", "alpacaeval"))
        assert rows[f"{m}+darts"]["merge"] == m
    det = res["manifest"]["merge_details"]
    assert set(det) == {"ada", "rm"} and det["rm"]["alpha"] == 0.9
    assert set(det["ada"]["coefficients"]) == {"code", "math", "instruction"} and "per_step" not in det["ada"]["entropy"]
    # claim 7 (heads on top of a strong merge) is computed over both merges and recomputes from the files
    from darts_bench.report.recompute import recompute

    claims_md = (tmp_path / "results" / "claims.md").read_text()
    # claim 7: the data merges' heads against their plain merges, decided over (strong merge, task) cells
    assert "| 7 | a DARTS head still helps on top of a strong merge (head vs plain merge): kl_expert_gen " \
           "(transductive) |" in claims_md
    assert "| 7-darts | transductive | ada | humaneval | kl_expert_gen |" in claims_md
    assert "| 7-surgery | inductive | rm | gsm8k | kl_expert_gen |" in claims_md
    assert recompute(tmp_path / "results")["mismatches"] == []


def test_regmean_needs_every_experts_task_before_any_stage(tmp_path):
    """RegMean's data are each expert's own task's prompts: a suite without an expert's task fails before
    any work (the run's preflight and ``darts-bench validate``), naming the merge and the experts."""
    from darts_bench.checks import check_data_merges
    from darts_bench.listing import validate
    from darts_bench.pipeline import Pipeline

    cfg = load_config("tiny", [f"merges={json.dumps([RM, ADA])}", f"work_dir={tmp_path / 'w'}"])
    with pytest.raises(ValueError, match=r"merge 'rm' \(regmean\) .* expert\(s\) \['code', 'instruction'\] have no task"):
        Pipeline(cfg, suite="gsm8k")
    assert any(e.startswith("merges: ValueError: merge 'rm' (regmean)") for e in validate(cfg, "gsm8k", str(tmp_path / "o")))
    check_data_merges(cfg, ["humaneval", "gsm8k", "alpacaeval"])  # every expert covered
    ada_only = load_config("tiny", [f"merges={json.dumps([ADA])}"])
    check_data_merges(ada_only, ["gsm8k"])  # AdaMerging pools whatever tasks have an expert
    base_only = load_config("tiny", [f"merges={json.dumps([RM])}", 'evaluate.rows=["base", "expert:*"]'])
    check_data_merges(base_only, ["gsm8k"])  # no merge is built


def test_regmean_leaves_a_tied_output_layer_to_the_embedding_average():
    """A tied ``lm_head`` is the input embedding (averaged), not a linear layer of its own; an untied one is
    merged in closed form like every other ``nn.Linear``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from darts_bench.merge.regmean import linear_modules

    kw = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1)
    tied = linear_modules(Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **kw)))
    untied = linear_modules(LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **kw)))
    layer = {f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(tied) == layer and set(untied) == layer | {"lm_head"}
