"""TSV-M, Iso-C, Iso-CTS and SVC against FusionBench's own implementation (fusion-bench 0.2.33, MIT).

A tiny decoder pool (a 2-layer Llama with tied embeddings, base + 3 experts that differ from it in
every tensor: embeddings, attention and MLP matrices, norms) is merged by darts-bench
(:mod:`darts_bench.merge.svd`, reading the saved checkpoints) and by FusionBench's algorithm classes
(``TaskSingularVectorMerging``, ``ISO_C_Merge``, ``ISO_CTS_Merge``, ``SingularValueCalibration`` on a
``BaseModelPool`` of the same models in memory); every tensor must be bit-identical: both run the
same float32 operations (fp64 for SVC) in the same order on the same CPU, so any change of the math
(a truncation rank, a mean, the whitening, SVC's floor) shows as a difference.
"""

import contextlib
import copy
import io
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from darts_bench.config import MergeSpec
from darts_bench.merge.build import _svd_or_svc
from darts_bench.merge.mergekit_merge import merge_config_dict
from darts_bench.merge.svd import build_svd_merge, iso_c_matrix, svc_matrix, tsv_m_matrix
from darts_bench.pool.build import Pool
from darts_bench.pool.tiny import train_tokenizer

fb = pytest.importorskip("fusion_bench", reason="fusion-bench (the dev extra) is the reference implementation")
fb_svc = pytest.importorskip("fusion_bench.method.singular_value_calibration")
EXPERTS = ("code", "math", "instruction")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Base + 3 experts (tied embeddings, hidden 32, MLP 64, 2 layers, vocab ~270), each expert the
    base plus its own random shift of every tensor (seeded), saved as HF checkpoints; and the models."""
    root = tmp_path_factory.mktemp("svdpool")
    tok = train_tokenizer(["hello world, def f(x): return x + 1"] * 10, 270)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).eval()
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    g = torch.Generator().manual_seed(1)
    models = {}
    for i, e in enumerate(EXPERTS):
        m = LlamaForCausalLM(cfg).eval()
        m.load_state_dict({k: v + (0.02 * (i + 1)) * torch.randn(v.shape, generator=g)
                           for k, v in base.state_dict().items()})
        m.save_pretrained(root / e)
        tok.save_pretrained(root / e)
        models[e] = m
    return Pool(base=root / "base", experts={e: root / e for e in EXPERTS}, key="svdpool"), base, models


def _fb_pool(base, models, merged=None):
    p = fb.BaseModelPool({"_pretrained_": copy.deepcopy(base), **{e: copy.deepcopy(m) for e, m in models.items()}})
    if merged is not None:
        p.add_model("_merged_", merged)
    return p


def _quiet(fn):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn()


def _ours(pool, spec, out):
    out.mkdir()
    if spec.method in ("tsv_m", "iso_c", "iso_cts"):
        build_svd_merge(spec, pool.base, dict(pool.experts), out)
    else:
        _svd_or_svc(spec, merge_config_dict(spec, pool), pool, out, seed=0)
    return load_file(str(out / "model.safetensors"))


def _assert_same(ours: dict, ref: torch.nn.Module, base: torch.nn.Module):
    ref_sd = ref.state_dict()
    assert "lm_head.weight" not in ours  # tied: stored once, as the embedding
    assert set(ours) == set(ref_sd) - {"lm_head.weight"}
    moved = 0
    for k, v in ours.items():
        assert torch.equal(v, ref_sd[k]), f"{k}: max |diff| {(v - ref_sd[k]).abs().max().item():.3g}"
        moved += not torch.equal(v, base.state_dict()[k])
    assert moved == len(ours)  # every tensor merged, none left at the base


@pytest.mark.parametrize("weight", [1.0, 0.7])
def test_tsv_m_equals_fusion_bench(pool, tmp_path, weight):
    p, base, models = pool
    ours = _ours(p, MergeSpec(name="tsv", method="tsv_m", weight=weight), tmp_path / "m")
    ref = _quiet(lambda: fb.method.TaskSingularVectorMerging(alpha=weight).run(_fb_pool(base, models)))
    _assert_same(ours, ref, base)
    summary = json.loads((tmp_path / "m" / "svd_merge.json").read_text())
    assert summary["method"] == "tsv_m" and summary["matrices"] == 15  # embedding + 2 x (4 attention + 3 MLP)


def test_tsv_m_per_expert_weights_equal_fusion_bench_alpha_list(pool, tmp_path):
    p, base, models = pool
    w = {"code": 0.5, "math": 1.0, "instruction": 1.5}
    ours = _ours(p, MergeSpec(name="tsv", method="tsv_m", weight=w), tmp_path / "m")
    ref = _quiet(lambda: fb.method.TaskSingularVectorMerging(alpha=[0.5, 1.0, 1.5]).run(_fb_pool(base, models)))
    _assert_same(ours, ref, base)


@pytest.mark.parametrize("weight", [1.0, 1.3])
def test_iso_c_equals_fusion_bench(pool, tmp_path, weight):
    p, base, models = pool
    ours = _ours(p, MergeSpec(name="iso", method="iso_c", weight=weight), tmp_path / "m")
    ref = _quiet(lambda: fb.method.ISO_C_Merge(scaling_factor=weight).run(_fb_pool(base, models)))
    _assert_same(ours, ref, base)


@pytest.mark.parametrize("frac", [None, 0.5])
def test_iso_cts_equals_fusion_bench(pool, tmp_path, frac):
    p, base, models = pool
    ours = _ours(p, MergeSpec(name="isocts", method="iso_cts", weight=1.5, common_space_fraction=frac),
                 tmp_path / "m")
    ref = _quiet(lambda: fb.method.ISO_CTS_Merge(scaling_factor=1.5, common_space_fraction=frac or 0.8)
                 .run(_fb_pool(base, models)))
    _assert_same(ours, ref, base)


def test_svc_on_a_mergekit_merge_equals_fusion_bench(pool, tmp_path):
    """SVC on top of mergekit's TIES: FusionBench's ``SingularValueCalibration`` given our TIES merge
    (mergekit, before SVC) as ``_merged_``; the 1-D tensors stay the TIES merge's."""
    p, base, models = pool
    spec = MergeSpec(name="ties-svc", method="ties", density=0.5, weight=1.0, normalize=True, svc_alpha=0.1)
    ours = _ours(p, spec, tmp_path / "svc")
    plain = tmp_path / "plain"
    from darts_bench.merge.mergekit_merge import run_one_merge

    run_one_merge(merge_config_dict(spec, p), plain, 0, p.base)
    merged = LlamaForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    ties = {k: v.clone() for k, v in merged.state_dict().items()}
    ref = _quiet(lambda: fb_svc.SingularValueCalibration(alpha=0.1, accelerator="cpu")
                 .run(_fb_pool(base, models, merged)))
    ref_sd = ref.state_dict()
    for k, v in ours.items():
        assert torch.equal(v, ref_sd[k]), k
        assert torch.equal(v, ties[k]) == (v.dim() == 1), k  # matrices calibrated, vectors untouched
    assert json.loads((tmp_path / "svc" / "svd_merge.json").read_text())["svc"]["alpha"] == 0.1


def test_svc_on_tsv_m_equals_fusion_bench(pool, tmp_path):
    """TSV-M then SVC, as FusionBench's ``SingularValueCalibrationWithBaseMethod`` composes them, run as its
    two steps on fresh pools: the wrapper itself runs both on one in-memory pool, where TSV-M's
    ``load_state_dict`` into the pool's ``_pretrained_`` module makes SVC's base the merge (a pool of
    paths reloads the base; one of modules does not)."""
    p, base, models = pool
    ours = _ours(p, MergeSpec(name="tsv-svc", method="tsv_m", svc_alpha=0.2), tmp_path / "m")
    tsv = _quiet(lambda: fb.method.TaskSingularVectorMerging(alpha=1.0).run(_fb_pool(base, models)))
    before = tsv.state_dict()["model.layers.0.mlp.up_proj.weight"].clone()  # SVC calibrates its input in place
    ref = _quiet(lambda: fb_svc.SingularValueCalibration(alpha=0.2, accelerator="cpu")
                 .run(_fb_pool(base, models, tsv)))
    _assert_same(ours, ref, base)
    assert not torch.equal(ref.state_dict()["model.layers.0.mlp.up_proj.weight"], before)  # SVC moved it


def test_matrix_functions_by_hand():
    """Worked examples of the paper's equations (independent of FusionBench): Iso-C of two orthogonal
    rank-1 task vectors with singular values 3 and 1 gives both the mean 2; TSV-M of the same keeps
    each task's top singular triplet (r = 2, K = 2: one each), so it is their sum; SVC of the plain sum
    of two identical task vectors halves it (each projection coefficient s = 2 -> gamma = 2 / 4)."""
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    t1, t2 = 3 * torch.outer(e1, e1), torch.outer(e2, e2)
    assert torch.allclose(iso_c_matrix([t1, t2]), 2 * torch.eye(2), atol=1e-6)
    assert torch.allclose(tsv_m_matrix([t1, t2]), t1 + t2, atol=1e-6)
    base = torch.zeros(2, 2, dtype=torch.float64)
    tau = torch.tensor([[1.0, 2.0], [0.5, -1.0]], dtype=torch.float64)
    out = svc_matrix(base, [base + tau, base + tau], base + 2 * tau, alpha=0.1)
    assert torch.allclose(out, tau, atol=1e-12)
