"""``evaluate.vllm.scoring: hf``: the vLLM backend's teacher-forced scores from an HF copy of the
engine's checkpoint (:class:`~darts_bench.evaluate.engines.hf_scorer.HFScorer`): ``HFTextModel.score``
with its pairs chunked longest first, bitwise (within 1e-6 relative of the hf backend's given-order
chunks), with every head of a merge from one forward equal to row by row bitwise; and the vLLM text and multi-head
models routing their ``score`` to it (a stand-in engine: no vllm needed). The real engine with the
scorer is in ``tests/test_evaluate_vllm_parity.py`` (vLLM venv)."""

from __future__ import annotations

import pytest

from conftest import StandInEngine, tiny_checkpoint_with_heads

from darts_bench.evaluate.engines.hf_scorer import HFScorer
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm
from darts_bench.surgery.heads import load_head

PROMPTS = ["def add(a, b):", "Question: what is 2 + 3?\nAnswer:", "hi", "Write a long story about a dog",
           "the quick brown fox"]
CONTS = [" return a + b", " 5", " there", " The dog ran.", " jumps over the lazy dog"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random Llama saved as a checkpoint dir, and two non-trivial heads saved beside it."""
    return tiny_checkpoint_with_heads(tmp_path_factory.mktemp("scorer"), PROMPTS + CONTS, seed=10)


def _reference(model_dir, head_dir, batch_size=2, by_length=True):
    """An HFTextModel over its own load of the checkpoint, head attached, pairs chunked longest first
    (``by_length=False``: in the given order, the hf backend's)."""
    model, tok = load_causal_lm(model_dir)
    tm = HFTextModel("ref", model, tok, head=load_head(head_dir) if head_dir else None, batch_size=batch_size,
                     score_by_length=by_length)
    try:
        return tm.score(PROMPTS, CONTS)
    finally:
        tm.close()


def test_scores_equal_the_hf_backend_bitwise_one_forward_for_every_head(ckpt):
    """Row by row and every head at once give HFTextModel's NLLs (longest-first chunks) bit for bit,
    and the hf backend's given-order chunks within 1e-6 relative per token; the heads really change
    the scores; the head is detached after each call; the checkpoint is loaded once."""
    model_dir, heads = ckpt
    dirs = [None, *heads]
    want = {d: _reference(model_dir, d) for d in dirs}
    assert len({tuple(s.nll for s in v) for v in want.values()}) == 3  # the heads differ
    for d in dirs:
        for a, b in zip(want[d], _reference(model_dir, d, by_length=False)):
            assert (a.greedy, a.n_tokens) == (b.greedy, b.n_tokens)
            assert a.token_nll == pytest.approx(b.token_nll, rel=1e-6, abs=0)
    sc = HFScorer(model_dir)
    for d in dirs:
        got = sc.score(PROMPTS, CONTS, d, batch_size=2)
        assert [(g.nll, g.token_nll, g.greedy, g.n_tokens) for g in got] == \
            [(w.nll, w.token_nll, w.greedy, w.n_tokens) for w in want[d]], d
    # the plain model after a head: no hook left behind
    assert [g.nll for g in sc.score(PROMPTS, CONTS, None, batch_size=2)] == [w.nll for w in want[None]]
    reqs = [(k, c, x) for c, x in zip(PROMPTS, CONTS) for k in (2, 0, 1)]  # heads interleaved
    got = sc.score_requests(reqs, dirs, batch_size=2)
    for (k, c, _), g in zip(reqs, got):
        w = want[dirs[k]][PROMPTS.index(c)]
        assert (g.nll, g.token_nll, g.greedy) == (w.nll, w.token_nll, w.greedy), (k, c)
    assert sc.score_requests([], dirs) == []
    assert sc.loads == 1
    with pytest.raises(ValueError, match="head index 3 out of range"):
        sc.score_requests([(3, "hi", " there")], dirs)
    sc.close()
    assert sc.score(PROMPTS[:1], CONTS[:1])[0].nll == want[None][0].nll and sc.loads == 2


def test_vllm_models_route_score_to_the_scorer(ckpt):
    """``VLLMTextModel.score`` (its own head, or per-request heads) and ``VLLMMultiHeadModel.score``
    go to the engine's scorer with the row's batch size and length limit, never to the engine
    (a stand-in engine without ``llm``: a call to vLLM would fail)."""
    from darts_bench.evaluate.engines.vllm import VLLMMultiHeadModel, VLLMTextModel

    model_dir, heads = ckpt
    _, tok = load_causal_lm(model_dir)

    eng = StandInEngine(tok, HFScorer(model_dir), "hf")
    eng.head_dirs = ["", heads[0], heads[1]]  # as VLLMEngine.set_heads stores them ("" = plain)
    want = {d: _reference(model_dir, d, batch_size=3) for d in (None, *heads)}
    got = VLLMTextModel("row", eng, heads[1], batch_size=3).score(PROMPTS, CONTS)
    assert [g.token_nll for g in got] == [w.token_nll for w in want[heads[1]]]
    per = VLLMTextModel("row", eng, None, batch_size=3).score(PROMPTS, CONTS, heads=[-1, 0, 1, 2, 1])
    assert [g.nll for g in per] == [want[None][0].nll, want[None][1].nll, want[heads[0]][2].nll,
                                    want[heads[1]][3].nll, want[heads[0]][4].nll]
    mh = VLLMMultiHeadModel("ties", eng, [None, *heads], batch_size=3)
    reqs = [(k, c, x) for c, x in zip(PROMPTS, CONTS) for k in range(3)]
    for (k, c, _), g in zip(reqs, mh.score(reqs)):
        assert g.token_nll == want[[None, *heads][k]][PROMPTS.index(c)].token_nll
    # the length limit travels: a 4-token window scores at most 3 continuation tokens
    short = VLLMTextModel("row", eng, None, batch_size=3, max_length=4).score(PROMPTS[-1:], CONTS[-1:])
    assert short[0].n_tokens == 3
    assert eng.scorer.loads == 1


def test_score_order_is_longest_first_and_stable():
    """``score_order``: the given order, or longest first with ties in the given order (so a row's
    pairs and a one pass's distinct pairs, first requested in the same order, get the same chunks)."""
    from darts_bench.evaluate.hf_model import score_order

    pairs = [([1] * 3, 1), ([1] * 5, 1), ([1] * 3, 2), ([1] * 7, 2), ([1] * 5, 3)]
    assert score_order(pairs, False) == [0, 1, 2, 3, 4]
    assert score_order(pairs, True) == [3, 1, 4, 0, 2]


def test_heads_mode_scores_headed_requests_on_the_copy_and_the_rest_on_the_engine(ckpt, monkeypatch):
    """``evaluate.vllm.scoring: heads``: a row with a head and the head slots of a one pass go to the
    HF scorer; the plain row and the plain slot go to the engine (``_engine_score``, here a stand-in
    that records its calls and answers with the plain model's HF scores); results keep the request
    order, and the one pass equals row by row."""
    from darts_bench.evaluate.engines.vllm import VLLMMultiHeadModel, VLLMTextModel

    model_dir, heads = ckpt
    _, tok = load_causal_lm(model_dir)
    plain = {(c, x): s for c, x, s in zip(PROMPTS, CONTS, _reference(model_dir, None, batch_size=3))}
    calls = []

    def engine_score(self, contexts, continuations, hs):
        calls.append((self.head_dir, None if hs is None else list(hs), len(contexts)))
        assert hs is None or all(h == -1 for h in hs)  # only plain requests reach the engine
        return [plain[(c, x)] for c, x in zip(contexts, continuations)]

    monkeypatch.setattr(VLLMTextModel, "_engine_score", engine_score)

    eng = StandInEngine(tok, HFScorer(model_dir), "heads")
    want = {d: _reference(model_dir, d, batch_size=3) for d in heads}
    assert [g.nll for g in VLLMTextModel("plain", eng, None, batch_size=3).score(PROMPTS, CONTS)] == \
        [plain[p].nll for p in zip(PROMPTS, CONTS)]
    assert calls == [(None, None, 5)]
    got = VLLMTextModel("row", eng, heads[0], batch_size=3).score(PROMPTS, CONTS)
    assert [g.token_nll for g in got] == [w.token_nll for w in want[heads[0]]] and len(calls) == 1
    mh = VLLMMultiHeadModel("ties", eng, [heads[1], None, heads[0]], batch_size=3)
    reqs = [(k, c, x) for c, x in zip(PROMPTS, CONTS) for k in (1, 0, 2)]
    res = mh.score(reqs)
    assert calls[1:] == [(None, [-1] * 5, 5)]  # the plain slot's five requests, once, on the engine
    for (k, c, x), g in zip(reqs, res):
        w = plain[(c, x)] if k == 1 else want[heads[1] if k == 0 else heads[0]][PROMPTS.index(c)]
        assert g.token_nll == w.token_nll, (k, c)


@pytest.mark.parametrize("mode", ["heads", "shared"])
def test_a_merges_plain_row_scores_on_the_copy(ckpt, monkeypatch, mode):
    """``scoring: heads`` / ``shared`` on a merge's checkpoint (the engine's ``merge_dirs``, from the evaluate
    stage): the plain row's scores come from the HF copy too, row by row and as the one pass's plain slot, bitwise
    the copy's plain scores, so both paths agree; nothing reaches the engine. The base's and experts' engines
    (not among the merges) keep their plain scores on the engine."""
    from darts_bench.evaluate.engines.vllm import VLLMMultiHeadModel, VLLMTextModel, scoring_mode

    model_dir, heads = ckpt
    _, tok = load_causal_lm(model_dir)
    calls = []

    def engine_score(self, contexts, continuations, hs):
        calls.append(len(contexts))
        return [None] * len(contexts)

    monkeypatch.setattr(VLLMTextModel, "_engine_score", engine_score)
    eng = StandInEngine(tok, HFScorer(model_dir, share_prefix=mode == "shared"), mode)
    eng.model_dir, eng.merge_dirs = str(model_dir), frozenset({str(model_dir)})
    want = {d: _reference(model_dir, d, batch_size=3) for d in (None, *heads)}
    got = VLLMTextModel("ties", eng, None, batch_size=3).score(PROMPTS, CONTS)
    assert [g.token_nll for g in got] == [w.token_nll for w in want[None]] and calls == []
    mh = VLLMMultiHeadModel("ties", eng, [heads[1], None, heads[0]], batch_size=3)
    reqs = [(k, c, x) for c, x in zip(PROMPTS, CONTS) for k in (1, 0, 2)]
    for (k, c, _), g in zip(reqs, mh.score(reqs)):
        assert g.token_nll == want[[heads[1], None, heads[0]][k]][PROMPTS.index(c)].token_nll, (k, c)
    assert calls == []
    base = StandInEngine(tok, HFScorer(model_dir, share_prefix=mode == "shared"), mode)
    base.model_dir, base.merge_dirs = "pool/base", frozenset({str(model_dir)})
    assert VLLMTextModel("base", base, None, batch_size=3).score(PROMPTS, CONTS) == [None] * 5 and calls == [5]
    assert [scoring_mode(s, "m", {"m"}) for s in ("engine", "hf", "heads", "shared")] == ["engine", "hf", "hf", "hf"]
    assert scoring_mode("shared", "b", {"m"}) == "shared" and scoring_mode("heads", "b", ()) == "heads"
