"""Nothing stale, nothing mixed: cache keys cover the checkpoints' content and every setting that
changes the numbers (dtype, device, batch sizes, DeepSpeed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from darts_bench.artifacts import file_sha256
from darts_bench.collect.features import calibration_key, merged_key
from darts_bench.config import EXPERT_NAMES, load_config
from darts_bench.evaluate.engines import backend_key, open_models
from darts_bench.executors.worker import hidden_state_features
from darts_bench.pipeline import Pipeline
from darts_bench.rows import Row
from darts_bench.stages.evaluate import evaluate_one
from darts_bench.pool import hashing
from darts_bench.pool.hashing import HashMemo, checkpoint_fingerprint, hub_revision

from conftest import micro_config_file

pytestmark = [pytest.mark.micro]  # tests/README.md: markers

STAGE_DIRS = ("merges", "calibration", "features", "heads", "eval")


def _calib_key(cfg, task, split: str) -> str:
    """The calibration key of one prompt ``"p"`` of expert key ``"k"`` with ``cfg``'s calibration backend."""
    return calibration_key(cfg, task, split, ["p"], "k", engine_key=backend_key(cfg, "calibration"))


def artifacts(work: Path) -> dict[str, set[str]]:
    """Artifact dir names per stage (temp and partial dirs excluded)."""
    return {s: {p.name for p in (work / s).iterdir() if not p.name.startswith(".") and "partial" not in p.name}
            if (work / s).is_dir() else set() for s in STAGE_DIRS}


@pytest.fixture(scope="module")
def hf_pool_dir(micro_pipeline, tmp_path_factory) -> Path:
    """The micro pool's checkpoints copied to plain dirs: a bring-your-own (``hf``) pool."""
    pool = micro_pipeline.pool()
    root = tmp_path_factory.mktemp("byo")
    for name in ("base", *EXPERT_NAMES):
        shutil.copytree(pool.path(name), root / name)
    return root


def hf_config(tmp: Path, pool_dir: Path, *overrides: str):
    """A gsm8k-only micro run over the hf pool at ``pool_dir``: one merge, one split, one method."""
    p = micro_config_file(
        tmp, pool={"kind": "hf", "base": str(pool_dir / "base"),
                   "experts": {e: str(pool_dir / e) for e in EXPERT_NAMES}},
        merges=[{"name": "ties", "method": "ties", "density": 0.5, "normalize": True}])
    return load_config(str(p), ["calibration.splits=[transductive]", "surgery.methods=[surgery]",
                                "surgery.epochs=5", "tasks.gsm8k.limit=2", *overrides])


def no_model_work(pipe: Pipeline, monkeypatch) -> None:
    import darts_bench.evaluate.engines.hf as hf

    def boom(*a, **k):
        raise AssertionError("model work although every artifact is cached")

    monkeypatch.setattr(pipe.executor, "map", boom)
    monkeypatch.setattr(hf, "load_text_model", boom)  # the HF backend's in-process loads


def test_overwritten_expert_weights_rebuild_what_depends_on_them(hf_pool_dir, tmp_path, monkeypatch):
    """Retraining an expert and saving it at the same path (same size, new bytes) rebuilds its
    merges, features, heads and evaluations and nothing else; an untouched pool reuses everything
    without re-hashing; the results manifest names the weights that made the table."""
    work = tmp_path / "work"
    first = Pipeline(hf_config(tmp_path, hf_pool_dir), suite="gsm8k")
    res1 = first.evaluate()
    before = artifacts(work)
    assert all(before[s] for s in STAGE_DIRS), before
    assert (work / "pool" / hashing.MEMO_NAME).is_file()
    first.close()

    # untouched pool: every artifact reused, no model work, no checkpoint file read for hashing
    reads: list[str] = []
    real_sha = hashing.file_sha256
    monkeypatch.setattr(hashing, "file_sha256", lambda p: reads.append(str(p)) or real_sha(p))
    again = Pipeline(hf_config(tmp_path, hf_pool_dir), suite="gsm8k")
    no_model_work(again, monkeypatch)
    res2 = again.evaluate()
    assert reads == []
    assert artifacts(work) == before
    assert {r: v["gsm8k"].metrics for r, v in res2.items()} == {r: v["gsm8k"].metrics for r, v in res1.items()}
    monkeypatch.undo()

    # overwrite math's weights in place with other weights of the same size (the code expert's)
    target = hf_pool_dir / "math" / "model.safetensors"
    new_bytes = (hf_pool_dir / "code" / "model.safetensors").read_bytes()
    assert len(new_bytes) == target.stat().st_size and new_bytes != target.read_bytes()
    target.write_bytes(new_bytes)
    reads.clear()
    monkeypatch.setattr(hashing, "file_sha256", lambda p: reads.append(str(p)) or real_sha(p))
    third = Pipeline(hf_config(tmp_path, hf_pool_dir), suite="gsm8k")
    res3 = third.evaluate()
    third.close()
    assert reads == [str(target.resolve())], "only the rewritten file is re-hashed"
    after = artifacts(work)
    new = {s: after[s] - before[s] for s in STAGE_DIRS}
    assert len(new["merges"]) == 1 and len(new["heads"]) == 1
    assert {n.split("-")[0] for n in new["calibration"]} == {"gsm8k"}  # the math expert's calibration sets
    assert len(new["calibration"]) == 2 and len(new["features"]) == 2  # transductive + reference
    rebuilt_rows = {n.rsplit("-gsm8k-", 1)[0] for n in new["eval"]}
    assert rebuilt_rows == {"expert_math", "ties", "ties+surgery"}  # base, code, instruction reused
    nll = {r: v["gsm8k"].metrics["gsm8k_ref_nll"] for r, v in res1.items()}
    nll3 = {r: v["gsm8k"].metrics["gsm8k_ref_nll"] for r, v in res3.items()}
    assert nll3["expert:math"] != nll["expert:math"]  # the new weights are served ...
    assert nll3["expert:math"] == nll["expert:code"]  # ... and they are the code expert's
    assert nll3["base"] == nll["base"] and nll3["ties"] != nll["ties"]
    # the manifest says which weights made it
    weights = third.pool().report["weights"]
    assert weights["math"]["files"]["model.safetensors"] == file_sha256(target)
    assert weights["math"]["key"] == weights["code"]["key"]
    assert weights["base"]["files"]["config.json"] == file_sha256(hf_pool_dir / "base" / "config.json")


def test_hash_memo_rehashes_on_size_or_mtime_change(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"a" * 100)
    (d / "config.json").write_text("{}")
    (d / "README.md").write_text("docs are not part of the fingerprint")
    memo_path = tmp_path / "memo.json"
    first = HashMemo(memo_path)
    fp1 = checkpoint_fingerprint(d, first)
    assert sorted(fp1["files"]) == ["config.json", "model.safetensors"] and fp1["bytes"] == 102
    first.save()
    memo = HashMemo(memo_path)  # a later run: read from the memo file
    assert checkpoint_fingerprint(d, memo)["key"] == fp1["key"] and memo.hashed == []
    (d / "README.md").write_text("edited docs")
    assert checkpoint_fingerprint(d, memo)["key"] == fp1["key"]
    st = (d / "model.safetensors").stat()
    (d / "model.safetensors").write_bytes(b"b" * 100)  # same size, new content, new mtime
    fp2 = checkpoint_fingerprint(d, memo)
    assert memo.hashed == [str((d / "model.safetensors").resolve())]
    assert fp2["key"] != fp1["key"]
    assert fp2["files"]["model.safetensors"] == file_sha256(d / "model.safetensors")
    assert (d / "model.safetensors").stat().st_mtime_ns != st.st_mtime_ns


def test_hub_snapshot_revision_is_part_of_the_fingerprint(tmp_path):
    """A hub snapshot dir (``models--org--name/snapshots/<commit>``) records its commit."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--org--name" / "snapshots" / rev
    snap.mkdir(parents=True)
    blob = tmp_path / "hub" / "models--org--name" / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_bytes(b"w" * 10)
    (snap / "model.safetensors").symlink_to(blob)
    fp = checkpoint_fingerprint(snap, HashMemo(None))
    assert hub_revision(snap) == rev and fp["revision"] == rev
    assert fp["files"]["model.safetensors"] == file_sha256(blob)
    assert hub_revision(tmp_path) is None


def test_pool_dtype_rebuilds_an_hf_pool(hf_pool_dir, tmp_path):
    """``pool.dtype`` (the dtype models are loaded in) is in the hf pool key, so merges, features
    and evaluations under bfloat16 never reuse float32 ones."""
    f32 = Pipeline(hf_config(tmp_path, hf_pool_dir), suite="gsm8k")
    bf16 = Pipeline(hf_config(tmp_path, hf_pool_dir, "pool.dtype=bfloat16"), suite="gsm8k")
    p32, p16 = f32.pool(), bf16.pool()
    assert p32.key != p16.key
    assert all(p32.model_key(n) != p16.model_key(n) for n in ("base", *EXPERT_NAMES))
    assert f32.merge()["ties"] != bf16.merge()["ties"]


def test_tasks_batch_size_keys_evaluations_but_not_samples(micro_pipeline, micro_cfg_path):
    """``tasks.batch_size`` is in the evaluation key (left padding and batched kernels can change
    generations numerically), so batch 1 and 4 give two artifacts; the samples they hold are the
    same, since each sample is seeded per (seed, prompt, sample index), not per batch
    (:mod:`darts_bench.evaluate.sampling`)."""
    over = ["tasks.humaneval.n_samples=4", "tasks.humaneval.limit=2", "tasks.humaneval.max_new_tokens=8"]
    out = {}
    for bs in (4, 1):
        pipe = Pipeline(load_config(str(micro_cfg_path), [*over, f"tasks.batch_size={bs}"]), suite="humaneval")
        pool = pipe.pool()
        row = Row("base", model_dir=pool.base, model_key=pool.model_key("base"))
        task, examples = pipe.tasks()["humaneval"]
        with open_models(pipe.cfg, pipe.executor) as models:  # what the evaluate stage opens
            res = evaluate_one(pipe.cfg, row, task, examples, {"base": row}, {}, models, pipe.work_dir)
        out[bs] = (pipe.eval_key(row, task, examples), [c for s in res.samples for c in s["completions"]])
        pipe.close()
    assert out[4][0] != out[1][0]
    assert len(out[4][1]) == len(out[1][1]) == 8
    assert out[4][1] == out[1][1], "samples changed with the batch size: they must be seeded per prompt and sample"
    assert len(set(out[4][1])) > 1   # sampled, not 8 copies of one greedy completion


def test_calibration_batch_size_changes_features_and_their_keys(micro_pipeline, micro_cfg_path):
    """Left-padded batches give different hidden states from unpadded ones (not bitwise equal),
    so ``calibration.batch_size`` is in the feature keys."""
    from darts_bench.evaluate.hf_model import load_causal_lm

    model, tok = load_causal_lm(str(micro_pipeline.pool().base), dtype=torch.float32, device="cpu")
    seqs = [tok("def add(a, b):\n    return a + b")["input_ids"], tok("x = 1")["input_ids"]]
    one = hidden_state_features(model, seqs, tok.pad_token_id or 0, batch_size=1)
    two = hidden_state_features(model, seqs, tok.pad_token_id or 0, batch_size=2)
    assert not torch.equal(one["h"], two["h"])
    c4, c2 = (load_config(str(micro_cfg_path), [f"calibration.batch_size={b}"]) for b in (4, 2))
    task = micro_pipeline.tasks()["gsm8k"][0]
    assert _calib_key(c4, task, "transductive") != _calib_key(c2, task, "transductive")
    assert merged_key(c4, "m", "c") != merged_key(c2, "m", "c")


def test_device_is_in_feature_and_evaluation_keys(micro_pipeline, micro_cfg_path):
    """Keys for ``device: cuda`` differ from ``cpu`` ones (computed here without a GPU)."""
    cpu, cuda = (load_config(str(micro_cfg_path), [f"device={d}"]) for d in ("cpu", "cuda"))
    task, examples = micro_pipeline.tasks()["gsm8k"]
    assert _calib_key(cpu, task, "inductive") != _calib_key(cuda, task, "inductive")
    assert merged_key(cpu, "m", "c") != merged_key(cuda, "m", "c")
    row = Row("base", model_dir=Path("x"), model_key="k")
    assert Pipeline(cpu).eval_key(row, task, examples) != Pipeline(cuda).eval_key(row, task, examples)
    assert Pipeline(cpu).eval_key(row, task, examples) == Pipeline(load_config(str(micro_cfg_path))).eval_key(
        row, task, examples)


def test_torch_threads_change_no_feature_and_stay_out_of_the_keys(micro_pipeline, micro_cfg_path):
    """``torch_threads`` is not in the keys because it does not change the numbers: features of
    the same batches with 1 and 2 intra-op threads are bitwise equal (checked here on the micro
    model; the Ray executor's actors use other thread counts and give the local features too,
    tests/test_ray_executor.py)."""
    from darts_bench.evaluate.hf_model import load_causal_lm

    model, tok = load_causal_lm(str(micro_pipeline.pool().base), dtype=torch.float32, device="cpu")
    seqs = [tok("def add(a, b):\n    return a + b" * 4)["input_ids"], tok("x = 1")["input_ids"]]
    before = torch.get_num_threads()
    try:
        feats = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            feats[n] = hidden_state_features(model, seqs, tok.pad_token_id or 0, batch_size=2)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(feats[1][k], feats[2][k]) for k in feats[1])
    c1, c2 = (load_config(str(micro_cfg_path), [f"torch_threads={n}"]) for n in (1, 2))
    task = micro_pipeline.tasks()["gsm8k"][0]
    assert _calib_key(c1, task, "transductive") == _calib_key(c2, task, "transductive")


def test_sharded_bf16_checkpoint_fingerprint_covers_index_and_every_shard(micro_pipeline, tmp_path):
    """A sharded bf16 checkpoint (``save_pretrained`` with a small ``max_shard_size``): the index
    and each shard are hashed; retraining the tensors of one shard changes the key and re-reads
    only that shard."""
    from safetensors.torch import load_file, save_file

    from darts_bench.evaluate.hf_model import load_causal_lm

    model, tok = load_causal_lm(str(micro_pipeline.pool().base), dtype=torch.bfloat16, device="cpu")
    ck = tmp_path / "sharded"
    model.save_pretrained(ck, max_shard_size="100KB")
    tok.save_pretrained(ck)
    shards = sorted(ck.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (ck / "model.safetensors.index.json").is_file()
    memo = HashMemo(tmp_path / "memo.json")
    fp = checkpoint_fingerprint(ck, memo)
    assert {s.name for s in shards} | {"model.safetensors.index.json", "config.json"} <= set(fp["files"])
    memo.save()
    t = load_file(str(shards[-1]))
    save_file({k: v + 1 for k, v in t.items()}, str(shards[-1]), metadata={"format": "pt"})
    memo = HashMemo(tmp_path / "memo.json")
    fp2 = checkpoint_fingerprint(ck, memo)
    assert memo.hashed == [str(shards[-1].resolve())] and fp2["key"] != fp["key"]
    assert {k: v for k, v in fp2["files"].items() if k != shards[-1].name} == \
        {k: v for k, v in fp["files"].items() if k != shards[-1].name}


def test_merged_features_skip_the_entropy_no_variant_reads(micro_pipeline, micro_cfg_path, tmp_path):
    """A merged model's next-token entropy is read only under ``surgery.entropy_source: merged`` (the section or a
    sweep combination): otherwise the merged features have no ``entropy`` column (the ``lm_head`` and softmax of
    every token skipped) and their own key; with it, the column is there under the key it always had. The hidden
    states are bitwise the same either way (what the heads and diagnostics read under ``expert`` / ``kl``), and
    reading the merged entropy from features without it is a clear ``KeyError``."""
    from darts_bench.artifacts import stable_hash
    from darts_bench.collect.features import merged_entropy_needed, numerics_key
    from darts_bench.collect.store import ShardedFeatures
    from darts_bench.surgery.data import load_split

    sets = [f"work_dir={tmp_path / 'work'}"]
    plain = load_config(str(micro_cfg_path), sets)
    merged = load_config(str(micro_cfg_path), [*sets, "surgery.entropy_source=merged"])
    swept = load_config(str(micro_cfg_path), [*sets, "sweep.surgery.entropy_source=[expert,merged]"])
    assert not merged_entropy_needed(plain) and merged_entropy_needed(merged) and merged_entropy_needed(swept)
    assert merged_key(merged, "m", "c") == stable_hash({"merge": "m", "calib": "c", "numerics": numerics_key(merged)})
    assert merged_key(plain, "m", "c") != merged_key(merged, "m", "c")
    shutil.copytree(Path(micro_pipeline.cfg.work_dir) / "pool", tmp_path / "work" / "pool")
    feats = {}
    for name, cfg in (("plain", plain), ("merged", merged)):
        pipe = Pipeline(cfg)
        try:
            feats[name] = pipe.collect()["features"]
        finally:
            pipe.close()
    assert feats["plain"].keys() == feats["merged"].keys()
    for k, fs in feats["plain"].items():
        other = feats["merged"][k]
        assert fs.key != other.key and fs.root != other.root
        a, b = ShardedFeatures(fs.root), ShardedFeatures(other.root)
        assert not a.has("entropy") and b.has("entropy") and ShardedFeatures(fs.calib.root).has("entropy")
        assert torch.equal(a.read_h(), b.read_h()) and torch.equal(a.column("positions"), b.column("positions"))
    fs = feats["plain"][next(iter(feats["plain"]))]
    load_split(ShardedFeatures(fs.calib.root), ShardedFeatures(fs.root), [0], "expert")  # no entropy needed
    with pytest.raises(KeyError, match="no 'entropy' column.*entropy_source: merged"):
        load_split(ShardedFeatures(fs.calib.root), ShardedFeatures(fs.root), [0], "merged")
