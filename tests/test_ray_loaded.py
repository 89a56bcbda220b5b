"""Evaluation on Ray: one actor group per model dir (heads swapped per call), kept across the
tasks and rows of the model and pinned for the judge; the table equals the local executor's.

Also the plumbing of vLLM engines on Ray actors (``evaluate.backend: vllm`` and
``calibration.backend: vllm``, ``executor: ray``) with a stand-in engine class (the HF model, loaded once per actor) injected through
``open_models(cfg, executor, engine_cls=...)`` (the vLLM backend's option), so it runs without vllm; the real engine on an actor is in
``tests/test_ray_vllm.py`` (vLLM venv).

All on the run's shared local Ray instance (``ray_instance``: loopback, 2 CPUs, private temp dir).
The file name sorts after ``test_ray_executor.py``, whose first test needs Ray not yet started.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from test_ray_executor import BATCH, PROMPTS, build_tiny_checkpoint, make_cfg  # noqa: E402

from darts_bench.config import EvaluateConfig  # noqa: E402
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm  # noqa: E402
from darts_bench.executors.ray_executor import RayExecutor, RayVLLMTextModel  # noqa: E402
from darts_bench.surgery.heads import build_head, load_head, save_head  # noqa: E402

pytestmark = [pytest.mark.ray]  # tests/README.md: markers


def _head(d: int, seed: int, out: Path, method: str = "darts") -> Path:
    """A head that changes the model's outputs (random up-projection and position table)."""
    head = build_head(method, d, rank=4, max_len=8, overflow="clamp", seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g) * 2)
        if head.pos_bias is not None:
            head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g) * 2)
    save_head(head, out)
    return out


def _reference(ckpt: Path, head_dir: Path | None, **kw):
    model, tok = load_causal_lm(ckpt)
    tm = HFTextModel("ref", model, tok, head=load_head(head_dir) if head_dir else None, batch_size=BATCH)
    try:
        return tm.generate_ids(PROMPTS, max_new_tokens=6, **kw)
    finally:
        tm.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-eval")
    a, b = build_tiny_checkpoint(tmp / "a", seed=0), build_tiny_checkpoint(tmp / "b", seed=1)
    return {"a": a, "b": b, "h1": _head(32, 1, tmp / "h1"), "h2": _head(32, 2, tmp / "h2", "surgery")}


# ------------------------------------------------------------------ HF actors: heads per call
def test_proxies_with_different_heads_share_one_group(models, ray_instance):
    """Proxies of one model with no head, head 1 and head 2, open at once and called interleaved,
    give the in-process outputs of each head; the model's actors start once (the head is swapped
    on the loaded model per call), and closing the last proxy releases them."""
    a, h1, h2 = models["a"], models["h1"], models["h2"]
    want = {h: _reference(a, h) for h in (None, h1, h2)}
    assert len({str(v) for v in want.values()}) == 3  # the heads change the outputs
    ex = RayExecutor(make_cfg(num_actors=2, num_cpus_per_actor=0.5))
    try:
        tms = {h: ex.text_model(str(h), str(a), str(h) if h else None, batch_size=BATCH) for h in (None, h1, h2)}
        for h in (h1, None, h2, h1, None):
            assert tms[h].generate_ids(PROMPTS, max_new_tokens=6) == want[h], h
        assert ex.actor_starts == {str(a): 2} and len(ex._groups) == 1
        for tm in tms.values():
            tm.close()
        assert not ex._groups
    finally:
        ex.close()


def _spy_ops(ex: RayExecutor) -> list[tuple[str, int]]:
    """Record ``(op, number of payloads)`` of every call the executor sends to an actor group."""
    calls: list[tuple[str, int]] = []
    run = ex._run_shards

    def spy(g, op, payloads, todo, on_result, desc):
        calls.append((op, len(payloads)))
        return run(g, op, payloads, todo, on_result, desc)

    ex._run_shards = spy
    return calls


def test_multi_head_on_the_actors_equals_each_heads_outputs_in_one_op_per_chunk(models, ray_instance):
    """``evaluate.one_pass`` in the Ray layout, HF actors: the backend's multi-head model serves
    interleaved requests of slots plain / head 1 / head 2 / head 1 again with the greedy ids,
    completions and teacher-forced scores of the in-process model with each head (scores bitwise);
    the 28 requests travel as 2 payloads (the 7 prompts' chunks of 4 = shard 3 rounded up to the
    batch of 2, every slot's chunk ``k`` together), not 2 per head; the plain model's prompt states
    come from the actors, equal to the local model's; the group starts once."""
    from darts_bench.evaluate.engines import open_models
    from darts_bench.executors.ray_executor import RayHFMultiHeadModel

    a, h1, h2 = models["a"], models["h1"], models["h2"]
    slots = [None, h1, h2, h1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the actors (torch_threads 1): a mean over tokens reduces per thread count
    refs = {}  # each head on its own copy (a head's hook acts on every forward of its model)
    for h in (None, h1, h2):
        model, tok = load_causal_lm(a)
        refs[h] = HFTextModel("ref", model, tok, head=load_head(h) if h else None, batch_size=BATCH)
    conts = [" 42", " b", " fox", " i", " Waves", " 72", " y"]
    ex = RayExecutor(make_cfg(num_actors=2, num_cpus_per_actor=0.5))
    calls = _spy_ops(ex)
    cache = open_models(ex.cfg, ex, batch_size=BATCH)
    try:
        mh = cache.multi_head_model("a", a, slots)
        assert isinstance(mh, RayHFMultiHeadModel)
        reqs = [(k, p) for p in PROMPTS for k in range(len(slots))]  # interleaved slots
        got = mh.generate_ids(reqs, max_new_tokens=6)
        want = {h: refs[h].generate_ids(PROMPTS, max_new_tokens=6) for h in refs}
        assert len({str(v) for v in want.values()}) == 3  # the heads change the outputs
        assert got == [want[slots[k]][PROMPTS.index(p)] for k, p in reqs]
        assert calls == [("multi_generate_ids", 2)]
        texts = mh.generate([(2, p) for p in PROMPTS] + [(None, p) for p in PROMPTS], max_new_tokens=6)
        assert texts == refs[h2].generate(PROMPTS, max_new_tokens=6) + refs[None].generate(PROMPTS, max_new_tokens=6)
        sreqs = [(k, p, c) for p, c in zip(PROMPTS, conts) for k in (1, None, 2)]
        scores = mh.score(sreqs)
        for k, h in ((None, None), (1, h1), (2, h2)):
            want_s = refs[h].score(PROMPTS, conts)
            mine = [s for (kk, _, _), s in zip(sreqs, scores) if kk == k]
            assert [(s.token_nll, s.n_tokens, s.greedy) for s in mine] == [
                (w.token_nll, w.n_tokens, w.greedy) for w in want_s], h
        assert calls[-1] == ("multi_score", 2)
        assert torch.equal(mh.prompt_states(PROMPTS), refs[None].prompt_states(PROMPTS))
        with pytest.raises(ValueError, match="out of range"):
            mh.generate_ids([(4, "x")], max_new_tokens=2)
        mh.close()
        assert dict(ex.actor_starts) == {str(a): 2}
    finally:
        torch.set_num_threads(threads)
        cache.close()
        ex.close()


def test_share_prefix_reaches_the_actors(models, ray_instance):
    """``evaluate.share_prefix`` on Ray: the HF actors' workers are built with it, and a proxy's scores of pairs
    that share their context (two continuations per prompt, with a head) equal, bit for bit, an in-process
    ``HFTextModel(share_prefix=True)``'s scores of the same shards (3 prompts rounded up to the batch of 2: 4
    pairs, each prompt's two in one shard)."""
    a, h1 = models["a"], models["h1"]
    cfg = make_cfg(num_actors=1, num_cpus_per_actor=0.5)
    cfg = cfg.model_copy(update={"evaluate": EvaluateConfig(share_prefix=True)})
    ctx = [p for p in PROMPTS for _ in range(2)]
    conts = [c for _ in PROMPTS for c in (" the answer is 42", " the answer is 7")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the actors
    model, tok = load_causal_lm(a)
    ref = HFTextModel("ref", model, tok, head=load_head(h1), batch_size=BATCH, share_prefix=True)
    want = [s for i in range(0, len(ctx), 4) for s in ref.score(ctx[i:i + 4], conts[i:i + 4])]
    ex = RayExecutor(cfg)
    try:
        assert ex._hf_spec(ex._key(str(a), BATCH), "a")["kwargs"]["share_prefix"] is True
        tm = ex.text_model("a", str(a), str(h1), batch_size=BATCH)
        got = tm.score(ctx, conts)
        assert [(s.token_nll, s.n_tokens, s.greedy) for s in got] == [(w.token_nll, w.n_tokens, w.greedy) for w in want]
        tm.close()
    finally:
        torch.set_num_threads(threads)
        ex.close()


# -------------------------------------------------------------- the evaluate stage on Ray
@pytest.mark.micro
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_evaluate_loads_each_model_dir_once_and_gives_the_local_table(micro_pipeline, micro_cfg_path,
                                                                          ray_instance, tmp_path):
    """GSM8K + AlpacaEval (judge: expert:instruction) on the micro pool's 14 rows: the Ray executor
    starts ``num_actors`` actors per model dir (base, 3 experts, 2 merges: the judge's group is
    pinned, corrected rows share their merge's group), where dbd6029 started one group per (row,
    task) and one per judged row (56 groups); the table rows equal the local executor's cell for
    cell, samples included."""
    from darts_bench.config import RayConfig, load_config
    from darts_bench.pipeline import Pipeline
    from darts_bench.report.tables import build_rows

    suite = "gsm8k,alpacaeval"
    micro_pipeline.train()  # upstream artifacts (shared work dir), built in-process
    out = {}
    for ex in ("local", "ray"):
        cfg = load_config(str(micro_cfg_path))
        if ex == "ray":  # ray.shard_size is in the calibration key: left at its default
            cfg = cfg.model_copy(update={"executor": "ray", "ray": RayConfig(num_actors=2, num_cpus_per_actor=0.5)})
        pipe = Pipeline(cfg, suite=suite)
        try:
            pipe.train()  # cached: no model work
            pipe.work_dir = tmp_path / ex  # every evaluation artifact built anew
            if ex == "ray":
                pipe.executor.actor_starts.clear()
            res = pipe.evaluate()
            rows = pipe.rows()
            if ex == "ray":
                dirs = {str(r.model_dir) for r in rows}
                assert len(rows) == 14 and len(dirs) == 6
                assert dict(pipe.executor.actor_starts) == {d: 2 for d in dirs}, pipe.executor.actor_starts
                assert not pipe.executor._groups  # all released at the end of the stage
            out[ex] = (build_rows(pipe.record()), {r: {t: v.samples for t, v in d.items()} for r, d in res.items()})
        finally:
            pipe.close()
    assert out["ray"][0] == out["local"][0]
    assert out["ray"][1] == out["local"][1]


# ------------------------------------------------------------ vLLM engines on Ray actors
def hf_engine_cls():
    """A stand-in for ``VLLMEngine`` with its constructor and ``text_model`` / ``shutdown``: the HF
    model loaded once (a ModelWorker), the head swapped per text model; ``shutdown`` leaves a marker
    file next to the checkpoint. Made in a function so that Ray ships the class by value."""
    from darts_bench.executors.worker import ModelWorker

    class HFEngine:
        def __init__(self, model_dir, vcfg, dtype="float32", seed=0):
            self.model_dir = Path(model_dir)
            self.worker = ModelWorker(str(model_dir), batch_size=BATCH, torch_threads=1, dtype=dtype)

        def text_model(self, name, head_dir=None, batch_size=8):
            self.worker.set_head(head_dir)
            return self.worker.text_model

        def multi_head_model(self, name, head_dirs, batch_size=8):
            self.worker.set_head(None)
            return self.worker.multi_head_model(head_dirs)

        def shutdown(self):
            d = self.model_dir.parent / f"shutdowns-{self.model_dir.name}"
            d.mkdir(exist_ok=True)
            (d / str(os.getpid())).write_text("")

    return HFEngine


def test_vllm_engine_actors_kept_per_model_dir(models, ray_instance):
    """Rows of model a (plain, head 1, head 2) with the judge b pinned between them, then the rows
    of b: one engine actor group per model dir (2 actors each, prompts split between them), every
    output equal to the in-process HF model with the row's head, each engine shut down before its
    actor is killed."""
    from darts_bench.evaluate.engines import open_models

    a, b, h1, h2 = models["a"], models["b"], models["h1"], models["h2"]
    cfg = make_cfg(num_actors=2, num_cpus_per_actor=0.5).model_copy(update={"evaluate": EvaluateConfig(backend="vllm")})
    ex = RayExecutor(cfg)
    cache = open_models(cfg, ex, batch_size=BATCH, engine_cls=hf_engine_cls())
    try:
        calls = [(a, None, False), (a, h1, False), (b, None, True), (a, h2, False), (b, None, True),
                 (b, None, False), (b, h1, False), (b, None, True)]
        for model, head, pin in calls:
            tm = cache.get("row", model, head, pin=pin)
            try:
                assert isinstance(tm, RayVLLMTextModel)
                assert [len(range(s, e)) for s, e in tm._spans(len(PROMPTS))] == [4, 3]  # one chunk per actor
                assert tm.generate_ids(PROMPTS, max_new_tokens=6) == _reference(model, head), (model, head)
            finally:
                tm.close()
        assert dict(ex.actor_starts) == {str(a): 2, str(b): 2} and cache.loads == 2
    finally:
        cache.close()
        assert not ex._groups
        ex.close()
    for m in (a, b):
        assert len(list((m.parent / f"shutdowns-{m.name}").iterdir())) == 2  # each engine shut down


def test_vllm_multi_head_on_engine_actors_splits_every_head_over_the_actors(models, ray_instance):
    """``evaluate.one_pass`` with engine actors: each slot's prompts are split into one contiguous
    chunk per actor (4 and 3), chunk ``k`` of every slot in one payload to actor ``k`` (2 payloads
    for 21 requests), and every request gets its head's in-process output."""
    from darts_bench.evaluate.engines import open_models
    from darts_bench.executors.ray_executor import RayHFMultiHeadModel, RayMultiHeadModel

    a, h1, h2 = models["a"], models["h1"], models["h2"]
    slots = [h2, None, h1]
    cfg = make_cfg(num_actors=2, num_cpus_per_actor=0.5).model_copy(update={"evaluate": EvaluateConfig(backend="vllm")})
    ex = RayExecutor(cfg)
    calls = _spy_ops(ex)
    cache = open_models(cfg, ex, batch_size=BATCH, engine_cls=hf_engine_cls())
    try:
        mh = cache.multi_head_model("a", a, slots)
        assert isinstance(mh, RayMultiHeadModel) and not isinstance(mh, RayHFMultiHeadModel)
        assert not hasattr(mh, "prompt_states")  # routed rows read the plain model locally
        reqs = [(k, p) for k in (1, 0, 2) for p in PROMPTS]
        got = mh.generate_ids(reqs, max_new_tokens=6)
        want = {h: _reference(a, h) for h in (None, h1, h2)}
        assert got == [want[slots[k]][PROMPTS.index(p)] for k, p in reqs]
        assert calls == [("multi_generate_ids", 2)]
        mh.close()
        assert dict(ex.actor_starts) == {str(a): 2}
    finally:
        cache.close()
        ex.close()


def test_vllm_calibration_continuations_on_engine_actors(models, ray_instance):
    """``calibration.backend: vllm`` on Ray: an expert's continuations are split over its 2 engine
    actors, the group is held for the expert's next call and released for the next expert and at
    close (each engine shut down); ids equal the in-process HF model's (the stand-in engine's)."""
    from darts_bench.config import CalibrationConfig
    from darts_bench.evaluate.engines import open_models

    a, b = models["a"], models["b"]
    cfg = make_cfg(num_actors=2, num_cpus_per_actor=0.5)
    cfg = cfg.model_copy(update={"calibration": CalibrationConfig(batch_size=BATCH, backend="vllm")})
    ids, want = {}, {}
    for m in (a, b):
        model, tok = load_causal_lm(m)
        ids[m] = [tok(p)["input_ids"] for p in PROMPTS]
        want[m] = [s[0] for s in HFTextModel("ref", model, tok, batch_size=BATCH).generate_ids(ids[m], max_new_tokens=6)]
    marks = {m: m.parent / f"shutdowns-{m.name}" for m in (a, b)}
    before = {m: set(d.iterdir()) if d.is_dir() else set() for m, d in marks.items()}
    ex = RayExecutor(cfg)
    try:
        with open_models(cfg, ex, role="calibration", batch_size=BATCH, engine_cls=hf_engine_cls()) as backend:
            assert backend.continuations("expert", a, ids[a], 6) == want[a]  # chunks of 4 and 3
            (g,) = ex._groups.values()
            assert g.key[:2] == ("engine", str(a)) and len(g.actors) == 2
            assert backend.continuations("expert", a, ids[a][:4], 6) == want[a][:4]  # the held group
            assert backend.continuations("expert", b, ids[b], 6) == want[b]  # a's group released first
            assert [k[1] for k in ex._groups] == [str(b)]
        assert not ex._groups
        assert dict(ex.actor_starts) == {str(a): 2, str(b): 2}
    finally:
        ex.close()
    for m, d in marks.items():
        assert len(set(d.iterdir()) - before[m]) == 2  # each actor's engine shut down


def test_tensor_parallel_needs_the_gpus_of_an_actor():
    from darts_bench.evaluate.engines.vllm import check_ray_vllm

    cfg = make_cfg(num_gpus_per_actor=1).model_copy(update={
        "executor": "ray", "evaluate": EvaluateConfig(backend="vllm", vllm={"tensor_parallel_size": 2})})
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs ray.num_gpus_per_actor >= 2"):
        check_ray_vllm(cfg)
    check_ray_vllm(cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"num_gpus_per_actor": 2})}))
