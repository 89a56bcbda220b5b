"""The llama2-7b path's properties on small inputs (issue "Paper scale, rehearsed"): hub ids resolved
from an offline cache, sharded untied lm_head, left padding in bf16, the DARTS table length, the
reference-answer positions, generation stripping. Each test here failed on dcca732."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from darts_bench.config import load_config
from darts_bench.evaluate.hf_model import HFTextModel, left_pad
from darts_bench.executors.worker import hidden_state_features
from darts_bench.pool.checkpoint import lm_head_weight, read_tensor
from darts_bench.pool.hub import HubResolutionError, resolve_model
from darts_bench.pool.rehearsal import REPO_IDS, convert_checkpoint, layout_hub_cache

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def random_llama(tmp_path_factory) -> Path:
    """A random untied float32 Llama (hidden 64, 2 layers, vocab 300) with a BPE tokenizer: the
    input of the conversions below (no data needed)."""
    from test_ray_executor import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("rand") / "model", hidden=64, layers=2, vocab=300, seed=3)


@pytest.fixture(scope="module")
def sharded_bf16(random_llama, tmp_path_factory) -> Path:
    """``random_llama`` re-saved as the 7B hub checkpoints are: bf16, several shards + index, the
    embedding in the first shard and lm_head in a later one, max_position_embeddings 4096."""
    return convert_checkpoint(random_llama, tmp_path_factory.mktemp("sharded") / "m", max_shard_size="60KB")


@pytest.fixture
def hub_cache(sharded_bf16, tmp_path, monkeypatch) -> tuple[Path, str]:
    """``sharded_bf16`` laid out in a fresh hub cache as org/model; HF_HUB_OFFLINE=1, HF_HOME set."""
    home = tmp_path / "hf"
    _, rev = layout_hub_cache(sharded_bf16, home / "hub", "org/model")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home, rev


# ------------------------------------------------------------------- 2. sharded lm_head
def test_sharded_untied_lm_head_is_read_from_its_shard(sharded_bf16, random_llama):
    index = json.loads((sharded_bf16 / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3
    assert index["model.embed_tokens.weight"] < index["lm_head.weight"]  # the layout that fooled the scan
    from darts_bench.stages.train import lm_head_weight as from_pipeline  # what the train stage calls

    want = read_tensor(random_llama, "lm_head.weight").to(torch.bfloat16).float()
    emb = read_tensor(sharded_bf16, "model.embed_tokens.weight").float()
    for W in (from_pipeline(sharded_bf16), lm_head_weight(sharded_bf16)):
        assert W.dtype == torch.float32 and W.shape == want.shape
        assert torch.equal(W, want) and not torch.equal(W, emb)


def test_tied_checkpoint_reads_the_embedding_and_untied_without_lm_head_fails(random_llama, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    shutil.copytree(random_llama, tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(tied / "model.safetensors"))
    sd.pop("lm_head.weight")
    save_file(sd, str(tied / "model.safetensors"))
    assert torch.equal(lm_head_weight(tied), sd["model.embed_tokens.weight"].float())
    cfg["tie_word_embeddings"] = False  # untied but no lm_head: an error, never the embedding
    (tied / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match="lm_head.weight"):
        lm_head_weight(tied)


# ---------------------------------------------------------------------- 1. hub ids
def test_hub_id_resolves_offline_to_the_cached_snapshot(hub_cache, sharded_bf16):
    home, rev = hub_cache
    path, got = resolve_model("org/model")
    assert got == rev and path == home / "hub" / "models--org--model" / "snapshots" / rev
    assert (path / "model.safetensors.index.json").is_file()
    assert torch.equal(lm_head_weight(path), lm_head_weight(sharded_bf16))
    assert resolve_model(f"org/model@{rev}") == (path, rev)  # a pinned commit
    local, none = resolve_model(sharded_bf16)  # a local dir stays a local dir
    assert local == sharded_bf16.resolve() and none is None


def test_hub_id_not_cached_offline_fails_naming_id_and_cache(hub_cache):
    home, _ = hub_cache
    with pytest.raises(HubResolutionError, match=r"'org/other'.*HF_HUB_OFFLINE=1") as e:
        resolve_model("org/other")
    assert str(home / "hub") in str(e.value) and "HF_HOME" in str(e.value)
    with pytest.raises(HubResolutionError, match="revision v2"):
        resolve_model("org/model@v2")
    with pytest.raises(HubResolutionError, match="neither an existing checkpoint dir nor a hub id"):
        resolve_model("not a/valid//id")


def test_build_pool_resolves_hub_ids_once_and_records_revisions(hub_cache, sharded_bf16, tmp_path):
    """The pool stage of an hf pool given hub ids (failed on dcca732 with 'missing config.json in
    checkpoint dir org/model'): local snapshot paths downstream, revisions in the report."""
    from darts_bench.pool.build import build_pool

    home, rev = hub_cache
    pad = convert_checkpoint(sharded_bf16, tmp_path / "pad", append_pad=True, max_shard_size="60KB")
    _, rev_pad = layout_hub_cache(pad, home / "hub", "org/model-pad")
    cfg = load_config("tiny", [
        "pool.kind=hf", "pool.base=org/model", "pool.experts.code=org/model",
        "pool.experts.math=org/model-pad", f"pool.experts.instruction=org/model@{rev}",
        "pool.vocab_alignment=base"])
    pool = build_pool(cfg, tmp_path / "work")
    snap = home / "hub" / "models--org--model" / "snapshots"
    assert pool.base == snap / rev and pool.experts["instruction"] == snap / rev
    assert pool.experts["math"] == home / "hub" / "models--org--model-pad" / "snapshots" / rev_pad
    assert pool.report["sources"]["math"] == {"id": "org/model-pad", "path": str(pool.experts["math"]),
                                              "revision": rev_pad}
    assert lm_head_weight(pool.experts["math"]).shape[0] == lm_head_weight(pool.base).shape[0] + 1


# ------------------------------------------------------------- 3. left padding, bf16
def _long_and_short(n_long: int = 900, n_short: int = 21) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(2, 290, (n_long,), generator=g).tolist(),
            torch.randint(2, 290, (n_short,), generator=g).tolist())


def _bf16(path: Path, attn: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation=attn).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_bf16_features_of_a_short_sequence_batched_with_a_long_one_equal_it_alone(sharded_bf16):
    """With eager attention (batch-invariant kernels) the short sequence's bf16 features are bitwise
    those of the sequence alone; on dcca732 (no position_ids) they were 0.3% (relative) away here.
    torch's CPU sdpa kernel is not batch-invariant in bf16 even with right positions (its blocking
    depends on the key length): there the fix leaves rounding-level differences only."""
    long, short = _long_and_short()
    model, tok = _bf16(sharded_bf16, "eager")
    both = hidden_state_features(model, [long, short], tok.pad_token_id, batch_size=2)
    alone = hidden_state_features(model, [short], tok.pad_token_id, batch_size=1)
    sel = both["seq_index"] == 1
    assert torch.equal(both["h"][sel], alone["h"])  # bitwise
    assert torch.equal(both["entropy"][sel], alone["entropy"])
    assert torch.equal(both["positions"][sel], torch.arange(len(short)))
    # the unfixed call (no position_ids) on the same batch is far from bitwise
    ids, mask = left_pad([long, short], tok.pad_token_id)
    with torch.no_grad():
        shifted = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[1, -len(short):]
    assert _rel(shifted, alone["h"]) > 1e-3
    # default (sdpa) attention: within bf16 rounding of the sequence alone, 4x closer than unfixed
    model, tok = _bf16(sharded_bf16, "sdpa")
    both = hidden_state_features(model, [long, short], tok.pad_token_id, batch_size=2)
    alone = hidden_state_features(model, [short], tok.pad_token_id, batch_size=1)
    assert _rel(both["h"][both["seq_index"] == 1], alone["h"]) < 0.25 * _rel(shifted, alone["h"])


def test_bf16_score_of_a_short_pair_batched_with_a_long_one_equals_it_alone(sharded_bf16):
    long, short = _long_and_short()
    model, tok = _bf16(sharded_bf16, "eager")
    ctx_long, ctx_short = tok.decode(long), tok.decode(short)
    together = HFTextModel("m", model, tok, batch_size=2).score([ctx_long, ctx_short], [" a b c", " d e"])
    alone = HFTextModel("m", model, tok, batch_size=1).score([ctx_short], [" d e"])
    assert together[1].token_nll == alone[0].token_nll and together[1].nll == alone[0].nll


# -------------------------------------------------------------- 4. DARTS table length
def test_darts_table_covers_the_longest_sequence_and_planner_warns_when_set_shorter():
    from darts_bench.plan import make_plan
    from darts_bench.positions import required_max_len, sequence_lengths

    cfg = load_config("llama2-7b")
    tasks = ["humaneval", "gsm8k", "alpacaeval"]
    lens = sequence_lengths(cfg, tasks, 4096)
    # 1024 prompt + 256 new; prompt + reference 2 x 1024; evaluation 1024 + MergeLM's 2048 new (HumanEval, AlpacaEval)
    assert lens == {"calibration": 1280, "reference": 2048, "evaluation": 3072}
    assert required_max_len(cfg, tasks, 4096) == 3072
    plan = make_plan(cfg)
    assert not any("max_len" in n for n in plan["notes"])
    assert plan["stages"]["train"]["head_params"]["darts"] == 2 * 16 * 4096 + 3072 * 4096
    short = make_plan(load_config("llama2-7b", ["surgery.max_len=512"]))
    warn = [n for n in short["notes"] if "max_len" in n]
    assert warn and "surgery.max_len 512" in warn[0] and "row 511" in warn[0] and "calibration up to 1280" in warn[0]
    # a model with 512 positions caps evaluated prompts at 512
    assert sequence_lengths(load_config("tiny"), tasks, 512)["evaluation"] == 512 + 96  # tiny.yaml: 96 new at most


@pytest.mark.micro
def test_pipeline_trains_darts_heads_with_the_derived_table(micro_pipeline, caplog):
    from darts_bench.positions import required_max_len

    scfg = micro_pipeline.surgery_config()
    max_pos = json.loads((micro_pipeline.pool().base / "config.json").read_text())["max_position_embeddings"]
    assert micro_pipeline.cfg.surgery.max_len is None
    assert scfg.max_len == required_max_len(micro_pipeline.cfg, ["humaneval", "gsm8k", "alpacaeval"], max_pos)
    cal = micro_pipeline.cfg.calibration
    assert scfg.max_len >= cal.max_prompt_tokens + cal.max_new_tokens


# ------------------------------------------------------- 5. reference answer positions
def test_reference_signals_use_the_positions_that_predict_answer_tokens():
    from darts_bench.surgery.data import answer_prediction_mask

    # two sequences: prompt 3 + answer 2 (len 5), prompt 2 + answer 3 (len 5)
    meta = {"prompt_len": [3, 2], "sequences": [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]}
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
    seq_index = torch.tensor([0] * 5 + [1] * 5)
    got = answer_prediction_mask(positions, seq_index, meta)
    # h at position t predicts token t + 1: answer tokens 3, 4 <- positions 2, 3; tokens 2, 3, 4 <- 1, 2, 3
    assert got.tolist() == [False, False, True, True, False, False, True, True, True, False]
    assert int(got.sum()) == 5  # one prediction per answer token


# --------------------------------------------------------- 5. generation: trailing padding
def test_strip_generated_keeps_an_ordinary_pad_token_inside_the_text():
    from darts_bench.evaluate.hf_model import strip_generated

    assert strip_generated([5, 9, 7, 9, 9], eos_ids={2}, pad_id=9) == [5, 9, 7]
    assert strip_generated([5, 9, 7, 2, 9, 9], eos_ids={2}, pad_id=9) == [5, 9, 7]
    assert strip_generated([5, 2, 2], eos_ids={2}, pad_id=2) == [5]


def test_generation_does_not_stop_at_a_generated_pad_token(random_llama):
    """A model whose pad token is an ordinary token it generates: the text continues past it."""
    from darts_bench.evaluate.hf_model import load_causal_lm

    model, tok = load_causal_lm(random_llama)
    ref = HFTextModel("m", model, tok, batch_size=1).generate_ids(["def add(a, b):"], max_new_tokens=12)[0][0]
    assert len(ref) == 12
    tok.pad_token = tok.convert_ids_to_tokens(ref[2])  # the third generated token is now "padding"
    model.generation_config.pad_token_id = ref[2]
    got = HFTextModel("m", model, tok, batch_size=1).generate_ids(["def add(a, b):"], max_new_tokens=12)[0][0]
    want = list(ref)
    while want[-1] == ref[2]:  # only trailing copies of the pad id are stripped
        want.pop()
    assert got == want and ref[2] in got


def test_deepspeed_floor_excludes_the_zero3_gather_race():
    text = (REPO / "pyproject.toml").read_text()
    assert '"deepspeed>=0.19.8,<0.20"' in text


def test_rehearsal_config_names_the_rehearsal_hub_ids():
    cfg = load_config("llama2-7b-rehearsal")
    paper = load_config("llama2-7b")
    assert cfg.pool.base == REPO_IDS["base"] and cfg.pool.experts == {k: REPO_IDS[k] for k in cfg.pool.experts}
    for attr in ("kind", "dtype", "vocab_alignment"):
        assert getattr(cfg.pool, attr) == getattr(paper.pool, attr)
    assert cfg.executor == paper.executor == "ray" and cfg.deepspeed.enabled and paper.deepspeed.enabled
    assert cfg.deepspeed.launcher == paper.deepspeed.launcher
    assert cfg.calibration.max_prompt_tokens == paper.calibration.max_prompt_tokens == 1024
