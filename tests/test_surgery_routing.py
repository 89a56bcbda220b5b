"""Task-agnostic rows (darts_bench/surgery/routing.py, evaluate/routed.py, rows.py, stages/train.py):
routers against scikit-learn and by hand, the chunk rule, row names and keys; on the micro pool the
router's held-out accuracy (held-out prompts disjoint from its training prompts, recomputed), routed
outputs equal the single-head rows' (bitwise, HF), one-pass == row by row for routed and shared
rows, the shared head's training set is the union of the tasks' (counts), and the routed row's
behaviour signals use the routed head per held-out sequence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from darts_bench.surgery.routing import Router, chunk_plan, fit_router, pick, prompt_features, routing_accuracy


def _blobs(seed=0, n=12, d=5):
    rng = np.random.default_rng(seed)
    return {t: rng.normal(loc=3.0 * i, scale=1.5, size=(n, d)) for i, t in enumerate(("code", "math", "chat"))}


@pytest.mark.parametrize("kind", ["centroid", "probe"])
def test_router_predict_equals_sklearn_and_survives_save_load(kind, tmp_path):
    X = _blobs()
    router, est = fit_router(X, kind, C=0.5)
    Q = np.random.default_rng(1).normal(loc=3.0, scale=3.0, size=(40, 5))
    ours = router.predict(Q)
    theirs = [router.classes[i] for i in est.predict(Q)]
    assert ours == theirs
    assert len(set(ours)) == 3  # the queries are spread over all three classes: not a trivial comparison
    router.save(tmp_path / "router.json")
    again = Router.load(tmp_path / "router.json")
    assert again.predict(Q) == ours and again.classes == ["code", "math", "chat"] and again.kind == kind


def test_centroid_router_by_hand():
    X = {"a": np.array([[0.0, 0.0], [2.0, 0.0]]), "b": np.array([[10.0, 10.0], [12.0, 10.0]])}
    router, _ = fit_router(X, "centroid")
    np.testing.assert_array_equal(router.params["centroids"], [[1.0, 0.0], [11.0, 10.0]])
    # (5, 4): squared distances 16 + 16 = 32 to a, 36 + 36 = 72 to b; (7, 6): 72 vs 32
    assert router.predict(np.array([[5.0, 4.0], [7.0, 6.0]])) == ["a", "b"]
    np.testing.assert_array_equal(router.decision(np.array([[5.0, 4.0]])), [[-32.0, -72.0]])


def test_two_class_probe_keeps_both_logits():
    X = {"a": np.array([[0.0], [0.5], [1.0]]), "b": np.array([[3.0], [3.5], [4.0]])}
    router, est = fit_router(X, "probe")
    assert router.params["coef"].shape == (2, 1)
    Q = np.array([[0.2], [3.8], [2.1], [1.9]])
    assert router.predict(Q) == [router.classes[i] for i in est.predict(Q)]


def test_router_errors():
    with pytest.raises(ValueError, match="at least two tasks"):
        fit_router({"a": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="'b' has no training prompts"):
        fit_router({"a": np.zeros((3, 2)), "b": np.zeros((0, 2))})
    with pytest.raises(ValueError, match="unknown router"):
        fit_router(_blobs(), "knn")


def test_prompt_features_mean_over_prompt_positions_only():
    # two sequences: prompt lengths 2 and 1; tokens in sequence order
    h = np.array([[1.0, 0.0], [3.0, 2.0], [100.0, 100.0], [5.0, 5.0], [-7.0, 7.0]])
    positions = np.array([0, 1, 2, 0, 1])
    seq_index = np.array([0, 0, 0, 1, 1])
    F = prompt_features(h, positions, seq_index, [2, 1], 2)
    np.testing.assert_array_equal(F, [[2.0, 1.0], [5.0, 5.0]])  # continuation tokens (100, -7) left out
    with pytest.raises(ValueError, match="no prompt token"):
        prompt_features(h, positions, seq_index, [2, 0], 2)


def test_chunk_plan_runs_whole_chunks_and_pick_restores_order():
    choices = ["a", "a", "b", "a", "a", "a", "b"]  # chunks of 2: [a a] [b a] [a a] [b]
    plan = chunk_plan(choices, 2)
    assert plan == {"a": [0, 1, 2, 3, 4, 5], "b": [2, 3, 6]}
    outs = {t: [f"{t}{j}" for j in idx] for t, idx in plan.items()}
    assert pick(choices, plan, outs) == ["a0", "a1", "b2", "a3", "a4", "a5", "b6"]
    assert chunk_plan(choices, 2, whole=True) == {"a": list(range(7)), "b": list(range(7))}
    assert routing_accuracy(["a", "b", "a", "a"], "a") == 0.75 and routing_accuracy([], "a") is None


def test_rows_names_default_and_keys():
    from darts_bench.config import Config
    from darts_bench.rows import row_meta, row_names, row_specs

    base = Config()
    cfg = base.model_copy(update={"surgery": base.surgery.model_copy(update={"task_agnostic": ["shared", "routed"]})})
    names = row_names(cfg)
    m = base.merges[0].name
    assert row_names(base) == [n for n in names if "@routed" not in n and "@shared" not in n]  # default unchanged
    i = names.index(f"{m}+darts")
    assert names[i + 1:i + 5] == [f"{m}+surgery@routed", f"{m}+darts@routed", f"{m}+surgery@shared", f"{m}+darts@shared"]
    spec = {s.model: s for s in row_specs(cfg)}[f"{m}+darts@routed"]
    assert (spec.correction, spec.method, spec.routing, spec.head_key) == ("darts@routed", "darts", "routed",
                                                                          ("darts", "transductive", "", base.seed))
    meta = row_meta(cfg, row_specs(cfg))
    assert meta[f"{m}+darts@shared"]["routing"] == "shared" and "routing" not in meta[f"{m}+darts"]


def test_task_agnostic_leaves_head_keys_and_cannot_be_swept():
    from darts_bench.config import Config
    from darts_bench.stages.train import head_key

    base = Config()
    on = base.surgery.model_copy(update={"task_agnostic": ["routed", "shared"],
                                         "routing": base.surgery.routing.model_copy(update={"router": "probe"})})
    assert head_key(base, "f", "r", base.surgery) == head_key(base, "f", "r", on)
    with pytest.raises(ValueError, match="task-agnostic rows are already rows of every variant"):
        Config.model_validate({"sweep": {"surgery": {"task_agnostic": [["routed"]]}}})
    with pytest.raises(ValueError, match="repeated"):
        Config.model_validate({"surgery": {"task_agnostic": ["routed", "routed"]}})



# ------------------------------------------------------------------------------------------ micro
@pytest.fixture(scope="module")
def agnostic_pipeline(micro_pipeline):
    """The micro pipeline with ``surgery.task_agnostic: [routed, shared]`` on the same work dir (pool,
    merges, features and the oracle heads are reused: their keys do not hold task_agnostic)."""
    from darts_bench.pipeline import Pipeline

    cfg = micro_pipeline.cfg
    cfg = cfg.model_copy(update={"surgery": cfg.surgery.model_copy(update={"task_agnostic": ["routed", "shared"]})})
    pipe = Pipeline(cfg)
    pipe.train()
    yield pipe
    pipe.close()


@pytest.mark.micro
def test_micro_router_accuracy_is_on_held_out_prompts_only(agnostic_pipeline):
    from darts_bench.stages.train import calibration_prompt_features
    from darts_bench.evidence import held_out_count

    pipe = agnostic_pipeline
    tr = pipe.train()
    feats = pipe.collect()["features"]
    assert sorted(tr["routers"]) == sorted((m, s, pipe.cfg.seed) for m in ("ties", "task_arithmetic")
                                           for s in pipe.cfg.calibration.splits)
    for (m, split, seed), rdir in tr["routers"].items():
        info = json.loads((rdir / "routing.json").read_text())
        router = Router.load(rdir / "router.json")
        X_train = {}
        for t, d in info["tasks"].items():
            fs = feats[(m, t, split)]
            n = len(fs.calib.meta["sequences"])
            tr_seq, va_seq = d["train_sequences"], d["held_out_sequences"]
            assert not set(tr_seq) & set(va_seq) and sorted(tr_seq + va_seq) == list(range(n))
            # the same split as the task's heads (their diagnostics record it)
            diag = tr["runs"][(m, t, split, "", seed)]
            assert (diag["train_sequences"], diag["held_out_sequences"]) == (tr_seq, va_seq)
            assert len(va_seq) == held_out_count(n, pipe.cfg.calibration.held_out_fraction) >= 1
            F = calibration_prompt_features(fs)
            X_train[t] = F[tr_seq]
            routed = router.predict(F[va_seq])
            assert routed == d["held_out_routed"]
            assert d["held_out_acc"] == np.mean([r == t for r in routed])
        # the router is a function of the training prompts alone: refitting on them gives it back
        again, _ = fit_router(X_train, pipe.cfg.surgery.routing.router, pipe.cfg.surgery.routing.C)
        assert again.classes == router.classes
        np.testing.assert_allclose(again.params["centroids"], router.params["centroids"], rtol=0, atol=1e-12)
    accs = [d["held_out_acc"] for r in tr["routers"].values()
            for d in json.loads((r / "routing.json").read_text())["tasks"].values()]
    assert np.mean(accs) > 1 / 3  # better than chance (three tasks) on the micro pool


@pytest.mark.micro
def test_micro_shared_head_trains_on_the_union(agnostic_pipeline):
    from darts_bench.rows import SHARED_TASK
    from darts_bench.surgery.heads import load_head

    pipe = agnostic_pipeline
    tr = pipe.train()
    shared = {k: v for k, v in tr["run_heads"].items() if k[1] == SHARED_TASK}
    assert len(shared) == 2 * 2 * 2  # merges x splits x methods
    for (m, _, method, split, tag, seed), hdir in shared.items():
        diag = json.loads((hdir.parent / "diagnostics.json").read_text())
        per = diag["tasks"]
        assert sorted(per) == sorted(pipe.task_names)
        for t, d in per.items():
            own = tr["runs"][(m, t, split, tag, seed)]
            assert d["train_sequences"] == own["train_sequences"] and d["n_train_tokens"] == own["n_train_tokens"]
        assert diag["n_train_tokens"] == sum(d["n_train_tokens"] for d in per.values())
        assert load_head(hdir).cfg.method == method
    bound = {r.model: r for r in pipe.all_rows()}
    r = bound["ties+darts@shared"]
    assert set(r.heads) == set(pipe.task_names) and len(set(r.heads.values())) == 1
    assert r.heads["gsm8k"] == shared[("ties", SHARED_TASK, "darts", "transductive", "", pipe.cfg.seed)]


@pytest.mark.micro
def test_micro_routed_outputs_are_the_routed_heads_outputs(agnostic_pipeline):
    """Prompts of all three tasks through ``ties+darts@routed`` (row-by-row model): each prompt's
    completion and reference NLL equal, bitwise, those of the single-head row of the task it is routed
    to, on the full prompt list (the oracle row's for prompts routed to the oracle task)."""
    from darts_bench.evaluate.engines import open_models
    from darts_bench.stages.evaluate import row_model

    pipe = agnostic_pipeline
    rows = {r.model: r for r in pipe.all_rows()}
    routed = rows["ties+darts@routed"]
    feats = pipe.collect()["features"]
    prompts = [p for t in pipe.task_names for p in feats[("ties", t, "transductive")].calib.meta["prompts"][:6]]
    conts = [p[-20:] for p in prompts]  # any continuation: the NLL is read under each head
    with open_models(pipe.cfg, pipe.executor) as models:
        tm = row_model(routed, "gsm8k", models, pipe.cfg)
        try:
            outs = tm.generate(prompts, max_new_tokens=8)
            scores = tm.score(prompts, conts)
            choices = tm.routing.route(prompts)
        finally:
            tm.close()
        # a backend model without prompt states (Ray proxy, vLLM): a local plain copy gives the same states
        from darts_bench.evaluate.routed import prompt_state_source

        plain = models.get("ties", routed.model_dir, None)
        assert (prompt_state_source(object(), routed.model_dir, pipe.cfg)(prompts) == plain.prompt_states(prompts)).all()
        plain.close()
        single, single_sc = {}, {}
        for t, hd in routed.heads.items():
            m = models.get(f"ties+darts/{t}", routed.model_dir, hd)
            single[t], single_sc[t] = m.generate(prompts, max_new_tokens=8), m.score(prompts, conts)
            m.close()
    assert rows["ties+darts"].heads == routed.heads  # the oracle row's heads
    oracle = "gsm8k"
    to_oracle = [j for j, c in enumerate(choices) if c == oracle]
    to_other = [j for j, c in enumerate(choices) if c != oracle]
    assert to_oracle and to_other
    for j, c in enumerate(choices):
        assert outs[j] == single[c][j], j
        assert scores[j].nll == single_sc[c][j].nll and scores[j].n_tokens == single_sc[c][j].n_tokens, j
    # the heads differ (so the equalities above say which head ran)
    assert any(single_sc[a][j].nll != single_sc[b][j].nll for j in range(len(prompts))
               for a in single_sc for b in single_sc if a != b)


@pytest.mark.micro
def test_micro_one_pass_equals_row_by_row_for_task_agnostic_rows(agnostic_pipeline, tmp_path, monkeypatch):
    """Rows of merge ``ties`` with the routed and shared rows, every task: identical completions and
    metrics (routing accuracy and reference NLL included, bitwise) on both evaluation paths; a routed
    row whose prompts all went to the oracle head equals the oracle row. In one pass the two routed rows'
    prompt states are computed once per distinct call (they make the same calls in turn), not once per row."""
    import darts_bench.evaluate.routed as routed_mod
    from darts_bench.stages.evaluate import evaluate

    calls: list[tuple[str, ...]] = []
    source = routed_mod.prompt_state_source

    def counted(model, model_dir, cfg):
        fn = source(model, model_dir, cfg)

        def states(texts):
            calls.append(tuple(texts))
            return fn(texts)
        return states

    monkeypatch.setattr(routed_mod, "prompt_state_source", counted)

    pipe = agnostic_pipeline
    all_rows, tasks = pipe.all_rows(), pipe.tasks()
    rows = [r for r in all_rows if r.merge == "ties" and r.calibration in ("", "transductive")
            and "[" not in r.model]
    assert [r.model for r in rows] == ["ties", "ties+surgery", "ties+darts", "ties+surgery@routed", "ties+darts@routed",
                                       "ties+surgery@shared", "ties+darts@shared"]
    out = {}
    for one_pass in (False, True):
        cfg = pipe.cfg.model_copy(update={"evaluate": pipe.cfg.evaluate.model_copy(update={"one_pass": one_pass})})
        calls.clear()
        out[one_pass] = evaluate(cfg, rows, all_rows, tasks, pipe.executor, tmp_path / f"work-{one_pass}")
        if one_pass:
            assert calls and len(calls) == len(set(calls))  # each distinct call's states once, for both routed rows
    for r in rows:
        for t in tasks:
            a, b = out[False][r.model][t], out[True][r.model][t]
            assert [s.get("output") for s in a.samples] == [s.get("output") for s in b.samples], (r.model, t)
            assert b.metrics == a.metrics, (r.model, t)
    for t in tasks:
        for method in ("surgery", "darts"):
            res, orc = out[True][f"ties+{method}@routed"][t], out[True][f"ties+{method}"][t]
            assert res.metrics[f"{t}_n_routed"] >= len(tasks[t][1])
            assert res.meta["routing"]["classes"] == list(pipe.task_names)
            if res.metrics[f"{t}_routing_acc"] == 1.0:
                same = {k: v for k, v in res.metrics.items() if "routing" not in k and "n_routed" not in k}
                assert same == orc.metrics
            sh = out[True][f"ties+{method}@shared"][t]
            assert sh.metrics[f"{t}_ref_nll"] != orc.metrics[f"{t}_ref_nll"]  # another head


@pytest.mark.micro
def test_micro_routed_behaviour_uses_the_routed_head_per_sequence(agnostic_pipeline):
    """The routed row's held-out diagnostics: sequences routed to the task itself carry the oracle
    head's per-sequence sums; the others another head's (they differ); the shared row's come from one
    head for every task."""
    pipe = agnostic_pipeline
    tr = pipe.train()
    n_same = n_other = 0
    for (m, t, split, tag, seed), d in tr["agnostic_runs"].items():
        own = tr["runs"][(m, t, split, tag, seed)]["per_sequence"]["all"]
        info = json.loads((tr["routers"][(m, split, seed)] / "routing.json").read_text())["tasks"][t]
        routed = dict(zip(info["held_out_sequences"], info["held_out_routed"]))
        got = d["routed"]["per_sequence"]["all"]
        assert got["sequence"] == own["sequence"] == sorted(routed)
        for method in pipe.cfg.surgery.methods:
            for i, s in enumerate(got["sequence"]):
                a, b = got[method]["kl_sum"][i], own[method]["kl_sum"][i]
                if routed[s] == t:
                    assert a == pytest.approx(b, rel=1e-5), (m, t, split, s)
                    n_same += 1
                else:
                    assert a != pytest.approx(b, rel=1e-5), (m, t, split, s)
                    n_other += 1
        assert d["shared"]["none"]["kl_expert"] == tr["runs"][(m, t, split, tag, seed)]["none"]["kl_expert"]
    assert n_same and n_other


@pytest.mark.micro
def test_micro_one_diagnostics_pass_per_stream_writes_the_per_artifact_bytes(agnostic_pipeline, monkeypatch):
    """Each (merge, task, split)'s held-out and reference tokens get one diagnostics pass for every row whose
    artifact is missing (here the methods' heads and the task-agnostic rows), and every file of every artifact
    is byte-equal to what a pass per artifact writes: rebuilding only the task-agnostic artifacts (a pass of
    their own, the methods' heads read back from disk) gives the same bytes, whether the plain merge's row and
    the KL floor of each stream are computed again (``known_streams`` emptied) or reused from the pass that
    built the methods' heads in the same process (``known_streams``), the reference answers' also across the
    splits of a (merge, task)."""
    import shutil
    from pathlib import Path

    from darts_bench.pipeline import Pipeline
    from darts_bench.stages import train as train_stage
    from darts_bench.surgery.diagnostics import Diagnostics

    heads_dir = Path(agnostic_pipeline.cfg.work_dir) / "heads"
    mine = lambda: sorted(p for p in heads_dir.glob("ties-*") if not p.name.startswith("ties-shared-"))  # noqa: E731
    counts: list[tuple[int, int]] = []
    per_token = Diagnostics.per_token

    def counting(self, *a, **k):  # every pass over a stream (Diagnostics.many's and the reference answers')
        out = per_token(self, *a, **k)
        counts.append((self.plain_computations, self.floor_computations))
        return out

    monkeypatch.setattr(Diagnostics, "per_token", counting)

    def rebuild(which: str, max_known: int, clear: bool = True) -> dict[str, bytes]:
        for p in mine():
            if which == "all" or "-agnostic-" in p.name:
                shutil.rmtree(p)
        if clear:
            train_stage._known_streams.clear()
        monkeypatch.setattr(train_stage, "KNOWN_STREAMS_MAX", max_known)
        counts.clear()
        pipe = Pipeline(agnostic_pipeline.cfg)
        try:
            pipe.train()
        finally:
            pipe.close()
        return {str(f.relative_to(heads_dir)): f.read_bytes() for p in mine() for f in sorted(p.rglob("*"))
                if f.is_file()}

    default = train_stage.KNOWN_STREAMS_MAX
    one_pass = rebuild("all", 0)
    # one pass per stream (held-out, reference) x 3 tasks x 2 splits, for the heads and the task-agnostic rows
    assert len(counts) == 2 * 3 * 2 and all(c == (1, 1) for c in counts)
    assert len({k.split("/")[0] for k in one_pass}) == 2 * 3 * 2  # heads and agnostic artifacts of 3 tasks x 2 splits
    assert sum(k.endswith("diagnostics.json") for k in one_pass) == 2 * 3 * 2 and any("darts/" in k for k in one_pass)
    assert rebuild("agnostic", 0) == one_pass  # their own pass, plain row and floor computed again
    assert len(counts) == 12 and all(c == (1, 1) for c in counts)
    assert rebuild("all", default) == one_pass
    # a task's reference-answer stream is reused by its second split when both splits' prompts share the same
    # template (what the stream leaves out); on the micro pool some tasks' do, some not
    from darts_bench.surgery.data import shared_template

    calib = agnostic_pipeline.collect()["calibration"]
    tasks = list(dict.fromkeys(t for t, split in calib if split != "reference"))
    same = [shared_template(calib[(t, "transductive")].meta) == shared_template(calib[(t, "inductive")].meta)
            for t in tasks]
    # passes per (merge, task, split): the reference answers first (diagnose_seeds), then the held-out tokens
    assert counts == [c for eq in same for c in [(1, 1), (1, 1), (0, 0) if eq else (1, 1), (1, 1)]]
    assert rebuild("agnostic", default, clear=False) == one_pass  # plain row and floor of the pass above
    assert counts == [(0, 0)] * 12
    # splits whose prompts share one template (the smollm2 preset's GSM8K and AlpacaEval sets; here every template
    # made empty) read one reference-answer stream per (merge, task): the second split's pass reuses the first's
    # plain row and floor (passes: reference, then held-out, per split), and writes the bytes of a pass without
    import darts_bench.surgery.data as data_mod

    real = data_mod.shared_template
    monkeypatch.setattr(data_mod, "shared_template", lambda meta: {})
    alone = rebuild("all", 0)
    assert alone != one_pass and rebuild("all", default) == alone
    assert counts == [(1, 1), (1, 1), (0, 0), (1, 1)] * 3
    monkeypatch.setattr(data_mod, "shared_template", real)
    assert rebuild("all", default) == one_pass  # the module's artifacts as they were
