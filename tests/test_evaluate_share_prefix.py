"""Scoring pairs that share a context with the context forwarded once (``HFTextModel(share_prefix=True)``,
``evaluate.vllm.scoring: shared``): :func:`~darts_bench.evaluate.hf_model.score_plan`'s groups and chunks,
values within 1e-6 relative of the full forward (plain and under Surgery / DARTS heads, positions past a
head's ``max_len``), fewer tokens through the transformer, the AlpacaEval judge's verdicts unchanged, the
one pass equal to row by row bitwise, and the vLLM text and multi-head models routing shared contexts to
the HF copy (a stand-in engine: no vllm needed)."""

from __future__ import annotations

import pytest

from conftest import StandInEngine, tiny_checkpoint_with_heads

from darts_bench.evaluate.engines.hf_scorer import HFScorer
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm, score_pairs, score_plan
from darts_bench.evaluate.multi_head import HFMultiHeadModel
from darts_bench.surgery.heads import load_head

JUDGE = ["Which output is better for the instruction 'name a pet'? (a) a dog (b) a stone. Answer:",
         "Which output is better for 'add 2 and 3'? (a) 5 (b) 6. Answer:"]
# two judge prompts with both verdicts, a reference-NLL pair, a context with three options, a repeat
CTX = [JUDGE[0], JUDGE[0], "def add(a, b):", JUDGE[1], JUDGE[1], "Pick x or y:", "Pick x or y:", "Pick x or y:",
       JUDGE[0]]
CONT = [" Output (a)", " Output (b)", " return a + b", " Output (a)", " Output (b)", " x", " y", " z", " Output (a)"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random Llama checkpoint and two non-trivial heads (Surgery; DARTS with a position bias
    of 8 positions, so the prompts' later positions clamp)."""
    return tiny_checkpoint_with_heads(tmp_path_factory.mktemp("share-prefix"), CTX + CONT, seed=20)


def _scores(model_dir, head_dir, share, ctx=CTX, cont=CONT, batch_size=4, by_length=True):
    model, tok = load_causal_lm(model_dir)
    tm = HFTextModel("m", model, tok, head=load_head(head_dir) if head_dir else None, batch_size=batch_size,
                     score_by_length=by_length, share_prefix=share)
    try:
        return tm.score(ctx, cont)
    finally:
        tm.close()


def test_score_plan_groups_the_pairs_that_share_a_context():
    """Groups: equal context tokens and at least two distinct sequences; the prefix runs into the shared
    continuation tokens up to the shortest sequence's length - 1; longest prefix first; groups packed
    up to ``batch_size`` sequences (a larger group alone); a repeat listed once; the rest in full chunks
    (a repeat of a full pair scored again, as without sharing)."""
    pairs = [([1, 2, 3, 9, 4], 2),     # 0: context 1 2 3, continuation 9 4
             ([1, 2, 3, 9, 5], 2),     # 1: same context, shares token 9 -> prefix 4
             ([7, 8], 1),              # 2: alone
             ([5, 5, 5, 5, 6], 1),     # 3: context 5 5 5 5, three options
             ([5, 5, 5, 5, 7], 1),     # 4
             ([5, 5, 5, 5, 8, 1], 2),  # 5: prefix capped at the shortest - 1 = 4
             ([1, 2, 3, 9, 4], 2),     # 6: a repeat of 0
             ([7, 8], 1),              # 7: a repeat of 2 (not grouped: one distinct sequence)
             ([6, 6, 6], 1)]           # 8: alone
    assert score_plan(pairs, 3, False, False) == [("full", [0, 1, 2]), ("full", [3, 4, 5]), ("full", [6, 7, 8])]
    assert score_plan(pairs, 4, True, True) == [("prefix", [(4, [0, 1])]), ("prefix", [(4, [3, 4, 5])]),
                                                ("full", [8, 2, 7])]
    assert score_plan(pairs, 5, False, True) == [("prefix", [(4, [0, 1]), (4, [3, 4, 5])]), ("full", [2, 7, 8])]
    assert score_plan(pairs, 2, False, True)[:2] == [("prefix", [(4, [0, 1])]), ("prefix", [(4, [3, 4, 5])])]
    assert score_plan([], 4, True, True) == []


def test_shared_prefix_scores_equal_the_full_forward_and_forward_fewer_tokens(ckpt):
    """Every pair's per-token NLL within 1e-6 relative of the full forward's, greedy flags and token
    counts equal, under the plain model and both heads; a repeated pair gets its first's score; the
    transformer sees each shared prefix once (counted at the embedding layer)."""
    model_dir, heads = ckpt
    for d in (None, *heads):
        full, shared = _scores(model_dir, d, False), _scores(model_dir, d, True)
        for a, b in zip(full, shared):
            assert (a.n_tokens, a.greedy) == (b.n_tokens, b.greedy)
            assert b.token_nll == pytest.approx(a.token_nll, rel=1e-6, abs=0), d
        assert shared[-1].token_nll == shared[0].token_nll
    # heads move the scores (the comparison above is not vacuous)
    assert _scores(model_dir, heads[1], True)[0].nll != _scores(model_dir, None, True)[0].nll

    model, tok = load_causal_lm(model_dir)
    pairs = score_pairs(tok, CTX, CONT, 1024)
    seen: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(int(a[0].numel())))
    try:
        HFTextModel("m", model, tok, batch_size=16, share_prefix=True).score(CTX[:2], CONT[:2])
    finally:
        hook.remove()
    (a, _), (b, _) = pairs[0], pairs[1]
    P = next(i for i in range(len(a)) if a[i] != b[i])
    assert P > len(tok(JUDGE[0])["input_ids"])  # the prefix runs into " Output ("
    assert seen == [P, 2 * (len(a) - P)]  # the prefix once, then each verdict's remaining tokens


def test_judge_verdicts_unchanged_with_a_shared_prefix(ckpt):
    """The AlpacaEval local judge (alpaca_eval's template, forced choice by likelihood) gives the same
    completions with ``share_prefix`` as with full forwards."""
    from darts_bench.api import get_task

    get_task("alpacaeval")  # the task folder, imported as the registry imports it (darts_bench_tasks.alpacaeval)
    from darts_bench_tasks.alpacaeval.judge import judge_completions

    model_dir, _ = ckpt
    model, tok = load_causal_lm(model_dir)
    prompts = [f"Instruction: {i}\nOutput (a): {a}\nOutput (b): {b}\nWhich is better?"
               for i, a, b in [("name a pet", "a dog", "a stone"), ("add 2 and 3", "5", "6"),
                               ("say hi", "hello there", "hi"), ("pick a colour", "blue", "the")]]
    got = {share: judge_completions(prompts, judge=HFTextModel("j", model, tok, batch_size=4, share_prefix=share),
                                    use_chat_template=False)["completions"] for share in (False, True)}
    assert got[True] == got[False] and set(got[True]) <= {"Output (a)", "Output (b)"}


def test_one_pass_with_shared_prefixes_equals_row_by_row_bitwise(ckpt):
    """``HFMultiHeadModel.score`` over a base with ``share_prefix``: each head's requests (interleaved)
    equal ``HFTextModel.score`` with that head and ``share_prefix``, bit for bit."""
    model_dir, heads = ckpt
    dirs = [None, *heads]
    want = {d: _scores(model_dir, d, True, batch_size=3) for d in dirs}
    model, tok = load_causal_lm(model_dir)
    base = HFTextModel("ties", model, tok, batch_size=3, score_by_length=True, share_prefix=True)
    mh = HFMultiHeadModel.from_head_dirs(base, dirs, name="ties")
    reqs = [(k, c, x) for c, x in zip(CTX, CONT) for k in (2, 0, 1)]
    for n, ((k, c, x), g) in enumerate(zip(reqs, mh.score(reqs))):
        w = want[dirs[k]][n // 3]
        assert (g.nll, g.token_nll, g.greedy) == (w.nll, w.token_nll, w.greedy), (k, c, x)


def test_shared_mode_sends_shared_contexts_to_the_copy(ckpt, monkeypatch):
    """``evaluate.vllm.scoring: shared``: a plain row's pairs whose context comes with two or more
    distinct continuations go to the HF copy (forwarding the context once); the others (a reference
    answer, one continuation per context, however many heads ask for it) to the engine
    (``_engine_score``, a stand-in answering with the plain model's full-forward scores); a headed row
    goes to the copy; the one pass equals row by row."""
    from darts_bench.evaluate.engines.vllm import VLLMMultiHeadModel, VLLMTextModel, shared_contexts

    model_dir, heads = ckpt
    _, tok = load_causal_lm(model_dir)
    assert shared_contexts(CTX, CONT) == {JUDGE[0], JUDGE[1], "Pick x or y:"}
    assert shared_contexts(["a", "a", "b"], [" x", " x", " y"]) == set()
    plain = {(c, x): s for c, x, s in zip(CTX, CONT, _scores(model_dir, None, False))}
    calls = []

    def engine_score(self, contexts, continuations, hs):
        calls.append(list(contexts))
        assert hs is None or all(h == -1 for h in hs)
        return [plain[(c, x)] for c, x in zip(contexts, continuations)]

    monkeypatch.setattr(VLLMTextModel, "_engine_score", engine_score)

    eng = StandInEngine(tok, HFScorer(model_dir, share_prefix=True), "shared")
    on_copy = [i for i, c in enumerate(CTX) if c != "def add(a, b):"]
    copy = _scores(model_dir, None, True, [CTX[i] for i in on_copy], [CONT[i] for i in on_copy], batch_size=4)
    row = VLLMTextModel("plain", eng, None, batch_size=4).score(CTX, CONT)
    assert calls == [["def add(a, b):"]]
    assert [row[i].token_nll for i in on_copy] == [s.token_nll for s in copy]
    assert row[2].token_nll == plain[(CTX[2], CONT[2])].token_nll
    headed = VLLMTextModel("darts", eng, heads[1], batch_size=4).score(CTX, CONT)
    assert [g.token_nll for g in headed] == [s.token_nll for s in _scores(model_dir, heads[1], True)]
    assert len(calls) == 1
    mh = VLLMMultiHeadModel("ties", eng, [None, heads[1]], batch_size=4)
    reqs = [(k, c, x) for c, x in zip(CTX, CONT) for k in (1, 0)]
    res = mh.score(reqs)
    assert calls[1:] == [["def add(a, b):"]]  # the plain slot's unshared pair, once, on the engine
    for n, ((k, _, _), g) in enumerate(zip(reqs, res)):
        w = (row if k == 0 else headed)[n // 2]
        assert g.token_nll == w.token_nll, (k, n)


def test_hf_backend_share_prefix_in_process_and_in_its_workers(ckpt, monkeypatch):
    """``evaluate.share_prefix`` on the hf backend: the evaluate role's cache key says so (the default's and the
    calibration role's stay empty); the backend's wrappers (plain, with a head), its one pass and the executor's
    workers (in process here; the Ray actors get the same ``ModelWorker`` kwargs) score exactly as
    ``HFTextModel(share_prefix=True)`` in the given order, through the plan's prefix chunks."""
    import darts_bench.evaluate.hf_model as hf_model
    import darts_bench.evaluate.multi_head as multi_head
    from darts_bench.config import Config
    from darts_bench.evaluate.engines import backend_key, open_models
    from darts_bench.executors.local import make_executor

    model_dir, heads = ckpt
    on = Config(evaluate={"share_prefix": True})
    assert backend_key(Config()) == {} and backend_key(on, "calibration") == {}
    assert backend_key(on) == {"share_prefix": True}
    want = {d: [s.token_nll for s in _scores(model_dir, d, True, by_length=False)] for d in (None, *heads)}
    kinds: list[str] = []
    plan = hf_model.score_plan
    for module in (hf_model, multi_head):  # the single-head and the one-pass score
        monkeypatch.setattr(module, "score_plan", lambda *a: [kinds.append(k) or (k, c) for k, c in plan(*a)])
    ex = make_executor(on)
    with open_models(on, ex, batch_size=4) as backend:
        for d in (None, heads[1]):
            m = backend.get("m", model_dir, d)
            assert [s.token_nll for s in m.score(CTX, CONT)] == want[d], d
            m.close()
        dirs = [None, *heads]
        mh = backend.multi_head_model("m", model_dir, dirs)
        reqs = [(k, c, x) for c, x in zip(CTX, CONT) for k in (1, 2, 0)]
        assert [g.token_nll for g in mh.score(reqs)] == [want[dirs[k]][n // 3] for n, (k, _, _) in enumerate(reqs)]
    assert ex.share_prefix and kinds.count("prefix") >= 3 * 2, kinds  # each of the 3 calls: its groups' chunks
    worker = ex.worker(str(model_dir))
    got = worker.run("score", {"contexts": CTX, "continuations": CONT, "head_dir": heads[0]})
    assert [s.token_nll for s in got] == [s.token_nll for s in _scores(model_dir, heads[0], True,
                                                                    batch_size=ex.batch_size, by_length=False)]
    ex.close()
