"""Merges through mergekit checked against values computed by hand on two tensors."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from darts_bench.config import MergeSpec
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm
from darts_bench.merge import merge_config_dict, run_one_merge
from darts_bench.pool.build import Pool
from darts_bench.pool.tiny import train_tokenizer

T1, T2 = "model.layers.0.mlp.up_proj.weight", "lm_head.weight"
EXPERTS = ("code", "math", "instruction")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Base + 3 experts differing from the base on two tensors only, by hand-chosen deltas."""
    root = tmp_path_factory.mktemp("toy")
    tok = train_tokenizer(["hello world, def f(x): return x"] * 10, 270)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    g = torch.Generator().manual_seed(1)
    deltas = {}
    sd = base.state_dict()
    for i, e in enumerate(EXPERTS):
        m = LlamaForCausalLM(cfg)
        d1 = torch.randn(sd[T1].shape, generator=g)
        d2 = torch.randn(sd[T2].shape, generator=g) * (1.0 if e == "code" else 0.0)  # T2: code only
        new = {k: v.clone() for k, v in sd.items()}
        new[T1] += d1
        new[T2] += d2
        m.load_state_dict(new)
        m.save_pretrained(root / e)
        tok.save_pretrained(root / e)
        deltas[e] = {T1: d1, T2: d2}
    pool = Pool(base=root / "base", experts={e: root / e for e in EXPERTS}, key="toy")
    return pool, {k: v.clone() for k, v in sd.items()}, deltas, root


def _merge(toy, spec, seed=0):
    pool, base, deltas, root = toy
    out = root / f"out-{spec.name}-{seed}"
    run_one_merge(merge_config_dict(spec, pool), out, seed, pool.base)
    return load_file(str(out / "model.safetensors")), out


def _stack(deltas, k):
    return torch.stack([deltas[e][k] for e in EXPERTS])  # [3, ...]


def test_task_arithmetic_exact(toy):
    _, base, deltas, _ = toy
    merged, _ = _merge(toy, MergeSpec(name="ta", method="task_arithmetic", weight=0.5))
    for k in (T1, T2):
        torch.testing.assert_close(merged[k], base[k] + 0.5 * _stack(deltas, k).sum(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"], rtol=0, atol=0)


def test_linear_is_weight_average(toy):
    _, base, deltas, _ = toy
    merged, _ = _merge(toy, MergeSpec(name="lin", method="linear", weight=1.0, normalize=True))
    for k in (T1, T2):
        experts = base[k] + _stack(deltas, k)
        torch.testing.assert_close(merged[k], experts.mean(0), rtol=0, atol=1e-6)


def _ties_by_hand(base, d, density):
    """TIES (Yadav et al. 2023): trim to top-`density` magnitudes per expert, elect the sign of the
    summed trimmed deltas, average the deltas agreeing with it (weights 1, normalized)."""
    k = int(density * d[0].numel())
    trimmed = []
    for di in d:
        flat = di.flatten()
        keep = torch.zeros_like(flat)
        keep[flat.abs().topk(k).indices] = 1
        trimmed.append((flat * keep).view_as(di))
    t = torch.stack(trimmed)
    sign = torch.sign(t.sum(0))
    agree = (torch.sign(t) == sign) & (t != 0)
    num = (t * agree).sum(0)
    den = agree.sum(0).clamp_min(1)
    return base + num / den


@pytest.mark.parametrize("density", [1.0, 0.5])
def test_ties_by_hand(toy, density):
    _, base, deltas, _ = toy
    merged, _ = _merge(toy, MergeSpec(name=f"ties{density}", method="ties", weight=1.0, density=density,
                                      normalize=True))
    for k in (T1, T2):
        torch.testing.assert_close(merged[k], _ties_by_hand(base[k], _stack(deltas, k), density), rtol=0, atol=1e-5)


def test_dare_linear_density_one_equals_task_arithmetic(toy):
    _, base, deltas, _ = toy
    merged, _ = _merge(toy, MergeSpec(name="dl1", method="dare_linear", weight=0.5, density=1.0))
    for k in (T1, T2):
        torch.testing.assert_close(merged[k], base[k] + 0.5 * _stack(deltas, k).sum(0), rtol=0, atol=1e-6)


def test_dare_masks_reproducible_from_seed(toy):
    _, base, deltas, _ = toy
    spec = MergeSpec(name="dare", method="dare_linear", weight=1.0, density=0.5)
    a, _ = _merge(toy, spec, seed=3)
    b, _ = _merge(toy, spec.model_copy(update={"name": "dare_b"}), seed=3)
    c, _ = _merge(toy, spec.model_copy(update={"name": "dare_c"}), seed=4)
    assert torch.equal(a[T1], b[T1]) and torch.equal(a[T2], b[T2])
    assert not torch.equal(a[T1], c[T1])
    # DARE (Yu et al. 2024) as mergekit 0.1.5 implements it: a Bernoulli(density) mask, then the kept
    # delta is rescaled to the original L1 norm. T2 differs from the base in the code expert only,
    # so the merged delta there is mask * delta_code * s with one scale s = |d|_1 / |mask * d|_1.
    d = deltas["code"][T2]
    got = a[T2] - base[T2]
    kept = got != 0
    s = got[kept] / d[kept]
    torch.testing.assert_close(s, torch.full_like(s, float(s[0])), rtol=1e-5, atol=0)
    torch.testing.assert_close(got.abs().sum(), d.abs().sum(), rtol=1e-5, atol=0)
    assert 0.3 < kept.float().mean() < 0.7


def test_merged_checkpoint_reloads_generates_and_keeps_eos(toy):
    pool, *_ = toy
    _, out = _merge(toy, MergeSpec(name="reload", method="ties", weight=1.0, density=0.5, normalize=True))
    model, tok = load_causal_lm(out)
    base_model, _ = load_causal_lm(pool.base)
    assert model.generation_config.eos_token_id == base_model.generation_config.eos_token_id == tok.eos_token_id
    tm = HFTextModel("m", model, tok)
    outs = tm.generate(["hello", "def f"], max_new_tokens=5)
    assert len(outs) == 2 and all(isinstance(o[0], str) for o in outs)


def test_merge_written_in_shards_equals_the_one_file_merge(toy):
    """``out_shard_size`` bounds the output shard mergekit holds: a TIES merge written in 4 KB shards is
    Hugging Face's sharded layout (``model-0000k-of-0000n.safetensors`` + an index naming every tensor)
    with every tensor bitwise equal to the one-file merge's, and it loads, generates greedily and gives
    its output matrix exactly as the one-file merge does."""
    import json

    from darts_bench.pool.checkpoint import INDEX_NAME, lm_head_weight

    pool, *_ = toy
    spec = MergeSpec(name="shards", method="ties", weight=1.0, density=0.5, normalize=True)
    root = toy[3]
    run_one_merge(merge_config_dict(spec, pool), root / "one", 0, pool.base)
    run_one_merge(merge_config_dict(spec, pool), root / "sharded", 0, pool.base, out_shard_size=4096)
    assert [p.name for p in (root / "one").glob("*.safetensors")] == ["model.safetensors"]
    shards = sorted(p.name for p in (root / "sharded").glob("*.safetensors"))
    one = load_file(str(root / "one" / "model.safetensors"))
    # a tensor above the bound gets a shard of its own: lm_head and embed_tokens (270 x 8 fp32, 8,640 bytes each)
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    weight_map = json.loads((root / "sharded" / INDEX_NAME).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(one) and sorted(set(weight_map.values())) == shards
    for name in shards:
        part = load_file(str(root / "sharded" / name))
        assert sum(v.numel() * v.element_size() for v in part.values()) <= 4096 or len(part) == 1
        for k, v in part.items():
            assert weight_map[k] == name and torch.equal(v, one[k]), k
    assert torch.equal(lm_head_weight(root / "sharded"), lm_head_weight(root / "one"))
    outs = []
    for d in ("one", "sharded"):
        model, tok = load_causal_lm(root / d)
        outs.append(HFTextModel(d, model, tok).generate(["hello", "def f"], max_new_tokens=6))
    assert outs[0] == outs[1]


def test_out_shard_bytes_is_an_eighth_of_the_merge_within_bounds(toy):
    """The default output shard (:func:`out_shard_bytes`): 64 MiB for a small merge (one file), an eighth of a
    SmolLM2-135M fp32 merge (538,060,032 bytes), mergekit's 5e9 cap for a 70B bf16 one; ``merge_bytes`` counts
    the base's elements from the headers in the merge's dtype."""
    from darts_bench.merge.mergekit_merge import MERGEKIT_OUT_SHARD_BYTES, merge_bytes, out_shard_bytes

    assert out_shard_bytes(10**6) == 64 * 2**20
    assert out_shard_bytes(538_060_032) == 67_257_504
    assert out_shard_bytes(140 * 10**9) == MERGEKIT_OUT_SHARD_BYTES == 5 * 10**9
    pool, base, *_ = toy
    n = sum(v.numel() for v in base.values())
    assert merge_bytes(pool.base, "float32") == 4 * n and merge_bytes(pool.base, "bfloat16") == 2 * n


@pytest.fixture(scope="module")
def padded_toy(toy, tmp_path_factory):
    """The toy pool with one expert that appends a [PAD] token (vocab + 1), as WizardMath does."""
    import shutil

    from transformers import AutoTokenizer

    pool, base, deltas, root = toy
    padded = tmp_path_factory.mktemp("padded") / "instruction"
    shutil.copytree(pool.experts["instruction"], padded)
    tok = AutoTokenizer.from_pretrained(str(padded))
    tok.add_special_tokens({"additional_special_tokens": ["[PAD2]"]})
    model = LlamaForCausalLM.from_pretrained(str(padded))
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(padded)
    tok.save_pretrained(padded)
    return Pool(base=pool.base, experts={**pool.experts, "instruction": padded}, key="padded"), base, deltas, root


def test_appended_vocab_is_an_error_by_default(padded_toy):
    from darts_bench.pool.build import PoolMismatchError, check_compatible

    pool = padded_toy[0]
    with pytest.raises(PoolMismatchError, match="vocab_alignment: base"):
        check_compatible(pool.base, pool.experts)


@pytest.mark.parametrize("method", ["ties", "linear"])
def test_appended_vocab_merges_on_the_base_vocab(padded_toy, method):
    from darts_bench.pool.build import check_compatible

    pool, base, deltas, root = padded_toy
    check_compatible(pool.base, pool.experts, vocab_alignment="base")
    spec = MergeSpec(name=f"pad-{method}", method=method, weight=1.0, normalize=True,
                     density=0.5 if method == "ties" else None)
    out = root / f"out-padded-{method}"
    run_one_merge(merge_config_dict(spec, pool, vocab_alignment="base"), out, 0, pool.base)
    merged = load_file(str(out / "model.safetensors"))
    assert merged["model.embed_tokens.weight"].shape == base["model.embed_tokens.weight"].shape
    assert merged[T2].shape == base[T2].shape
    if method == "ties":  # embeddings equal the base's in every model: unchanged by the merge
        torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_every_merge_dir_holds_mergekit_config_that_mergekit_rebuilds(toy, tmp_path):
    """``mergekit_config.yml`` in each merge dir: mergekit's own schema accepts it and names the
    method; `mergekit-yaml` (its click command, in process) rebuilds the same weights from it with
    the seed the file's comment names; the file is outside the manifest, so a merge cached before
    it (file removed here) is reused as it is, unrebuilt, and gets the file back."""
    import hashlib
    import json

    import yaml
    from click.testing import CliRunner
    from mergekit.config import MergeConfiguration
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    from darts_bench.artifacts import MANIFEST, verify
    from darts_bench.config import load_config
    from darts_bench.merge import build_merges
    from darts_bench.merge.mergekit_merge import MERGEKIT_CONFIG

    pool = toy[0]
    cfg = load_config("micro", ['merges=[{"name": "dare", "method": "dare_ties", "density": 0.5}, '
                                '{"name": "lin", "method": "linear"}]', "seed=3"])
    merges = build_merges(cfg, pool, tmp_path / "work")
    sha = {m: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for m, d in merges.items()}
    for spec in cfg.merges:
        d = merges[spec.name]
        text = (d / MERGEKIT_CONFIG).read_text()
        conf = MergeConfiguration.model_validate(yaml.safe_load(text))
        assert conf.merge_method == spec.method
        assert f"--random-seed {cfg.seed}" in text
        assert MERGEKIT_CONFIG not in json.loads((d / MANIFEST).read_text())["files"]
        assert verify(d) is None
    # mergekit alone, from the file, with the seed it names: the same tensors
    out = tmp_path / "rebuilt"
    res = CliRunner().invoke(mergekit_yaml, [str(merges["dare"] / MERGEKIT_CONFIG), str(out), "--random-seed",
                                             str(cfg.seed), "--no-lazy-unpickle", "--quiet"])
    assert res.exit_code == 0, res.output
    ours, theirs = load_file(str(merges["dare"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # a merge cached before the file existed: reused (same dir, untouched weights), file written
    (merges["dare"] / MERGEKIT_CONFIG).unlink()
    mtime = (merges["dare"] / "model.safetensors").stat().st_mtime_ns
    again = build_merges(cfg, pool, tmp_path / "work")
    assert again == merges
    assert (merges["dare"] / "model.safetensors").stat().st_mtime_ns == mtime
    assert hashlib.sha256((merges["dare"] / "model.safetensors").read_bytes()).hexdigest() == sha["dare"]
    assert (merges["dare"] / MERGEKIT_CONFIG).is_file() and verify(merges["dare"]) is None


def _mapped_paths() -> set[str]:
    """The files mapped into this process (``/proc/self/maps``, resolved paths)."""
    out = set()
    for line in open("/proc/self/maps", encoding="utf-8"):
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(parts[5].strip())
    return out


@pytest.mark.micro
@pytest.mark.parametrize("method", ["ties", "dare_ties"])
def test_streamed_merge_writes_the_same_bytes_and_closes_its_inputs(micro_pipeline, tmp_path, method):
    """``run_one_merge`` streams its inputs (each tensor from its own short-lived mapping): on the
    micro pool the weight files equal, byte for byte, those of mergekit's own loaders
    (``stream=False``; TIES, and DARE-TIES whose random masks come from the seed) and, for the
    pipeline's own ``ties`` merge, the cached merge dir. Afterwards no input safetensors file is still
    mapped into the process and mergekit's ``LoaderCache`` holds none of the pool's models."""
    from mergekit.config import MergeConfiguration
    from mergekit.io.tasks import LoaderCache

    from darts_bench.artifacts import file_sha256

    pool = micro_pipeline.pool()
    spec = next(s for s in micro_pipeline.cfg.merges if s.method == "ties")
    if method == "dare_ties":
        spec = MergeSpec(name="dare", method="dare_ties", weight=1.0, density=0.5, normalize=True)
    cd = merge_config_dict(spec, pool)
    inputs = {str(p.resolve()) for d in [pool.base, *pool.experts.values()] for p in Path(d).glob("*.safetensors")}
    refs = list(MergeConfiguration.model_validate(cd).referenced_models())

    run_one_merge(cd, tmp_path / "stream", 3, pool.base)
    assert not inputs & _mapped_paths(), "a streamed merge left input files mapped"
    assert not any(r in LoaderCache().loaders for r in refs)
    run_one_merge(cd, tmp_path / "eager", 3, pool.base, stream=False)
    files = sorted(p.name for p in (tmp_path / "stream").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "eager").iterdir())
    weights = [f for f in files if f.endswith(".safetensors")]
    assert weights == ["model.safetensors"]
    for f in files:
        assert file_sha256(tmp_path / "stream" / f) == file_sha256(tmp_path / "eager" / f), f
    if method == "ties":  # the pipeline's own merge (its seed) is byte-identical to a streamed one
        run_one_merge(cd, tmp_path / "seeded", micro_pipeline.cfg.seed, pool.base)
        cached = micro_pipeline.merge()[spec.name]
        for f in weights:
            assert file_sha256(tmp_path / "seeded" / f) == file_sha256(cached / f)


# ------------------------------------------------------------------ per-expert settings, mergekit's newer methods
def test_per_expert_weights_and_lambda_by_hand(toy):
    """``weight: {expert: w}`` reaches each model's parameters; ``lambda`` scales the merged task vector."""
    _, base, deltas, _ = toy
    w = {"code": 0.2, "math": 0.5, "instruction": 1.0}
    merged, _ = _merge(toy, MergeSpec.model_validate({"name": "ta_w", "method": "task_arithmetic", "weight": w,
                                                      "lambda": 0.5}))
    for k in (T1, T2):
        want = base[k] + 0.5 * sum(w[e] * deltas[e][k] for e in EXPERTS)
        torch.testing.assert_close(merged[k], want, rtol=0, atol=1e-6)


def test_per_expert_density_ties_by_hand(toy):
    _, base, deltas, _ = toy
    dens = {"code": 1.0, "math": 0.5, "instruction": 0.25}
    merged, _ = _merge(toy, MergeSpec(name="ties_d", method="ties", weight=1.0, density=dens, normalize=True))
    d = _stack(deltas, T1)
    trimmed = []
    for e, di in zip(EXPERTS, d):  # TIES's trim with each expert's own density, then as _ties_by_hand
        flat, keep = di.flatten(), torch.zeros(di.numel())
        keep[flat.abs().topk(int(dens[e] * di.numel())).indices] = 1
        trimmed.append((flat * keep).view_as(di))
    want = _ties_by_hand(base[T1], torch.stack(trimmed), 1.0)
    torch.testing.assert_close(merged[T1], want, rtol=0, atol=1e-5)


def test_breadcrumbs_by_hand(toy):
    """Model Breadcrumbs (Davari & Belilovsky 2024): per task vector, drop the largest ``gamma`` share of
    magnitudes and the smallest, keeping ``density`` of the entries; then task arithmetic (no rescale)."""
    _, base, deltas, _ = toy
    merged, _ = _merge(toy, MergeSpec(name="bc", method="breadcrumbs", weight=0.5, density=0.5, gamma=0.125))
    out = base[T1].clone()
    for e in EXPERTS:
        flat = deltas[e][T1].flatten()
        n = flat.numel()
        order = flat.abs().argsort()
        keep = order[n - int(0.125 * n) - int(0.5 * n): n - int(0.125 * n)]
        kept = torch.zeros_like(flat)
        kept[keep] = flat[keep]
        out += 0.5 * kept.view_as(out)
    torch.testing.assert_close(merged[T1], out, rtol=0, atol=1e-6)


def test_model_stock_by_hand(toy):
    """Model Stock (Jang et al. 2024): t = K cos / (1 + (K - 1) cos) from the mean pairwise cosine of the task
    vectors (per tensor), merged = t * mean(experts) + (1 - t) * base."""
    _, base, deltas, _ = toy
    merged, _ = _merge(toy, MergeSpec(name="ms", method="model_stock"))
    d = [deltas[e][T1].flatten() for e in EXPERTS]
    cos = torch.stack([torch.dot(d[i], d[j]) / (d[i].norm() * d[j].norm()) for i in range(3) for j in range(i + 1, 3)])
    c = cos.mean()
    t = 3 * c / (1 + 2 * c)
    want = t * (base[T1] + _stack(deltas, T1).mean(0)) + (1 - t) * base[T1]
    torch.testing.assert_close(merged[T1], want, rtol=0, atol=1e-5)


def test_della_is_seeded_and_moves_with_epsilon(toy):
    """DELLA (Deep et al. 2024): random drops with magnitude-ranked keep probabilities in density +- epsilon,
    rescaled; mergekit's random_seed (the run seed) fixes them."""
    _, base, deltas, _ = toy
    spec = MergeSpec(name="della", method="della_linear", weight=0.5, density=0.5, epsilon=0.1)
    a, _ = _merge(toy, spec, seed=3)
    b, _ = _merge(toy, spec.model_copy(update={"name": "della2"}), seed=3)
    c, _ = _merge(toy, MergeSpec(name="della3", method="della_linear", weight=0.5, density=0.5, epsilon=0.3), seed=3)
    assert torch.equal(a[T1], b[T1]) and not torch.equal(a[T1], c[T1])
    ta = base[T1] + 0.5 * _stack(deltas, T1).sum(0)
    assert not torch.equal(a[T1], ta)
    kept = (a[T1] - base[T1]).ne(0).float().mean().item()  # some entries of the sum dropped by every expert
    assert 0.5 < kept < 1.0


def test_merge_spec_refuses_knobs_of_other_methods():
    with pytest.raises(ValueError, match="method ties takes no epsilon"):
        MergeSpec(name="t", method="ties", density=0.2, epsilon=0.1)
    with pytest.raises(ValueError, match="DELLA needs density"):
        MergeSpec(name="d", method="della", density=0.9, epsilon=0.15)
    with pytest.raises(ValueError, match="model_stock sets its own"):
        MergeSpec(name="m", method="model_stock", weight=0.5)
    with pytest.raises(ValueError, match="needs density"):
        MergeSpec(name="b", method="breadcrumbs")
    with pytest.raises(ValueError, match="svc_alpha calibrates a training-free merge"):
        MergeSpec(name="r", method="regmean", svc_alpha=0.1)
    with pytest.raises(ValueError, match="takes no common_space_fraction"):
        MergeSpec(name="i", method="iso_c", common_space_fraction=0.5)
    # unset knobs leave the serialised spec (and so every existing merge's cache key) as it was
    assert MergeSpec(name="ties", method="ties", density=0.2).model_dump(mode="json") == {
        "name": "ties", "method": "ties", "weight": 1.0, "density": 0.2, "normalize": None, "int8_mask": False,
        "dtype": "float32"}
    assert MergeSpec.model_validate({"name": "t", "method": "ties", "density": 0.2, "lambda": 0.7}).model_dump(
        mode="json")["lambda"] == 0.7
