"""One-pass evaluation: several heads on one HF model (per-sequence head hook, batched greedy
generation, teacher-forced scores from one forward) and the evaluate stage's one-pass path equal to
row by row on the micro pool, the Qwen2-shaped tiny pool and the 7B-shaped rehearsal pool."""

from __future__ import annotations

import contextlib

import pytest
import torch

from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.evaluate.multi_head import HFMultiHeadModel
from darts_bench.surgery.corrected import MultiHeadAttachment, attach_head
from darts_bench.surgery.heads import build_head, positions_from_mask
from conftest import tiny_llama_and_tokenizer

PROMPTS = ["def add(a, b):", "Question: what is 2 + 3?\nAnswer:", "hi", "Write a long story about a dog",
           "the quick brown fox", "Question: how many legs has a dog?\nAnswer:", "def mul(x, y):\n    return"]


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_llama_and_tokenizer(PROMPTS)


def _head(method: str, seed: int, d: int = 32):
    head = build_head(method, d, rank=4, max_len=16, overflow="clamp", seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g))
        if head.pos_bias is not None:
            head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g))
    return head


@pytest.fixture(scope="module")
def heads():
    return [_head("surgery", 1), _head("darts", 2), _head("darts", 3)]


def test_per_sequence_hook_equals_single_head_runs(model_and_tok, heads):
    """A batch whose rows carry heads [0, 1, None] gives each row the final hidden state and logits
    of a single-head run over the same rows (left-padded, positions from the mask)."""
    model, tok = model_and_tok
    enc = tok(PROMPTS[:3] * 3, return_tensors="pt", padding=True)
    pos = positions_from_mask(enc["attention_mask"])
    with torch.no_grad():
        att = MultiHeadAttachment(model, heads[:2])
        att.rows = [0, 0, 0, 1, 1, 1, None, None, None]
        multi = model(**enc, position_ids=pos).logits
        att.remove()
        singles = []
        for k, sl in ((0, slice(0, 3)), (1, slice(3, 6))):
            a = attach_head(model, heads[k])
            singles.append(model(input_ids=enc["input_ids"][sl], attention_mask=enc["attention_mask"][sl],
                                 position_ids=pos[sl]).logits)
            a.remove()
        singles.append(model(input_ids=enc["input_ids"][6:], attention_mask=enc["attention_mask"][6:],
                             position_ids=pos[6:]).logits)
    for k, sl in enumerate((slice(0, 3), slice(3, 6), slice(6, 9))):
        torch.testing.assert_close(multi[sl], singles[k], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(multi[0:3], multi[3:6])  # the heads really differ


def test_hook_rejects_a_wrong_rows_length(model_and_tok, heads):
    model, tok = model_and_tok
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    att = MultiHeadAttachment(model, heads)
    att.rows = [0]
    try:
        with pytest.raises(ValueError, match="1 entries for a batch of 2"):
            model(**enc)
    finally:
        att.remove()


def _row_by_row(model, tok, head, bs=3):
    tm = HFTextModel("row", model, tok, head=head, batch_size=bs)
    return tm


@pytest.mark.parametrize("stop", [(), ("\n",)])
def test_multi_head_greedy_equals_row_by_row(model_and_tok, heads, stop):
    """Every (head, prompt) of 4 slots [None, surgery, darts, darts] in one pass: token ids equal each
    row's own HFTextModel.generate_ids (chunks of batch_size, same left padding)."""
    model, tok = model_and_tok
    slots = [None, *heads]
    base = HFTextModel("plain", model, tok, batch_size=3)
    mh = HFMultiHeadModel(base, slots, name="m")
    reqs = [(k, p) for k in range(len(slots)) for p in PROMPTS]
    got = mh.generate_ids(reqs, max_new_tokens=10, stop=stop)
    texts = mh.generate(reqs, max_new_tokens=10, stop=stop)
    n_diff = 0
    for k, hd in enumerate(slots):
        tm = _row_by_row(model, tok, hd)
        want = tm.generate_ids(PROMPTS, max_new_tokens=10, stop=stop)
        want_txt = tm.generate(PROMPTS, max_new_tokens=10, stop=stop)
        tm.close()
        assert got[k * len(PROMPTS):(k + 1) * len(PROMPTS)] == want
        assert texts[k * len(PROMPTS):(k + 1) * len(PROMPTS)] == want_txt
        n_diff += want != got[:len(PROMPTS)]
    assert n_diff == 3  # every head changes the greedy continuations


@contextlib.contextmanager
def _counting_generate(model):
    """Record the number of sequences of every ``model.generate`` call made inside the block."""
    calls: list[int] = []
    orig = model.generate

    def counting(*a, **k):
        calls.append(k["input_ids"].shape[0])
        return orig(*a, **k)

    model.generate = counting
    try:
        yield calls
    finally:
        del model.generate


def test_multi_head_generate_batches_heads_in_one_call(model_and_tok, heads):
    """7 prompts x 4 slots at batch_size 3: the chunks of equal padded length are stacked, so there
    are fewer generate calls than the row-by-row path's 4 x 3; equal (head, chunk) pairs (two
    slots with the same head) are generated once."""
    model, tok = model_and_tok
    with _counting_generate(model) as calls:
        mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3), [None, heads[0], heads[0], None],
                              name="m")
        mh.generate_ids([(k, p) for k in range(4) for p in PROMPTS], max_new_tokens=4)
    assert sum(calls) == 2 * len(PROMPTS)  # two distinct heads (None, heads[0]) x 7 prompts
    assert len(calls) <= 3  # chunks [3, 3, 1] of each head, stacked by padded length


@pytest.mark.parametrize("max_batch", [1, 4, 6])
def test_multi_head_max_batch_caps_each_generate_and_keeps_outputs(model_and_tok, heads, max_batch):
    """``evaluate.one_pass_max_batch``: 7 prompts x 3 distinct heads at batch_size 3 (chunks 3, 3, 1
    per head) stacked into calls of at most ``max_batch`` sequences (a chunk is never split: cap 1
    still sends chunks of 3), ids equal to the uncapped model's."""
    model, tok = model_and_tok
    slots = [None, heads[0], heads[1]]
    reqs = [(k, p) for k in range(3) for p in PROMPTS]
    want = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3), slots, name="m").generate_ids(
        reqs, max_new_tokens=4)
    with _counting_generate(model) as calls:
        mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3), slots, name="m", max_batch=max_batch)
        got = mh.generate_ids(reqs, max_new_tokens=4)
    assert got == want
    assert sum(calls) == 3 * len(PROMPTS)
    assert all(c <= max(3, max_batch) for c in calls)  # a call holds whole chunks up to the cap
    assert len(calls) >= -(-sum(calls) // max(3, max_batch))


def test_multi_head_sampling_equals_row_by_row(model_and_tok, heads):
    model, tok = model_and_tok
    mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3), [heads[1], None], name="m")
    kw = dict(max_new_tokens=6, num_samples=2, temperature=0.8, seed=5)
    got = mh.generate_ids([(0, p) for p in PROMPTS[:4]] + [(1, p) for p in PROMPTS[:4]], **kw)
    for k, hd in enumerate([heads[1], None]):
        tm = _row_by_row(model, tok, hd)
        assert got[4 * k:4 * (k + 1)] == tm.generate_ids(PROMPTS[:4], **kw)
        tm.close()


def test_multi_head_score_one_forward_per_chunk(model_and_tok, heads):
    """score: NLLs equal to each row's HFTextModel.score (bitwise), and the transformer body runs
    once per chunk of distinct pairs (3 chunks of 3, 3, 1), not once per head."""
    model, tok = model_and_tok
    slots = [None, *heads]
    ctx = PROMPTS
    cont = [" yes", " 5", " there", " once upon a time", " jumps", " four", " x * y"]
    forwards = []
    hd = model.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3), slots, name="m")
        got = mh.score([(k, c, x) for k in range(len(slots)) for c, x in zip(ctx, cont)])
    finally:
        hd.remove()
    assert len(forwards) == 3
    for k, h in enumerate(slots):
        tm = _row_by_row(model, tok, h)
        want = tm.score(ctx, cont)
        tm.close()
        for g, w in zip(got[k * len(ctx):(k + 1) * len(ctx)], want):
            assert g == w  # bitwise: the same body forward, head on the whole chunk, lm_head where needed
    assert got[0].nll != got[len(ctx)].nll  # the heads change the scores


def test_factored_head_scores_within_1e6_of_head_then_lm_head(model_and_tok, heads, monkeypatch):
    """A rank-4 head on the 32-wide model is scored in factored form (the plain logits, once per block
    for every head, minus ``(W U) relu(D h)``, plus ``(W b)[p]``): NLLs within 1e-6 relative of the head
    applied to the hidden states before ``lm_head`` (the path with the factored form off), greedy
    flags and token counts equal, the plain row bitwise equal; the same through the prefix-sharing chunks
    (``share_prefix``: positions of the prefix and suffix forwards). A head of rank ``d / 4`` (8) does not
    pay and is scored as before, bitwise."""
    import darts_bench.evaluate.hf_model as hf_model
    import darts_bench.evaluate.multi_head as multi_head

    model, tok = model_and_tok
    assert all(hf_model.factored_head_logits(model, h) for h in heads)
    wide8 = build_head("surgery", 32, rank=8, seed=5)
    with torch.no_grad():
        wide8.up.weight.copy_(torch.randn(wide8.up.weight.shape, generator=torch.Generator().manual_seed(6)))
    assert not hf_model.factored_head_logits(model, wide8)
    slots = [None, *heads, wide8]
    ctx = PROMPTS + [PROMPTS[1]] * 2
    cont = [" yes", " 5", " there", " once upon a time", " jumps", " four", " x * y", " 7", " 5 apples"]
    req = [(k, c, x) for k in range(len(slots)) for c, x in zip(ctx, cont)]

    def both(share):
        got = {}
        for factored in (True, False):
            with monkeypatch.context() as m:
                if not factored:
                    m.setattr(hf_model, "factored_head_logits", lambda *a: False)
                    m.setattr(multi_head, "factored_head_logits", lambda *a: False)
                mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3, share_prefix=share), slots)
                one = mh.score(req)
                rows = []
                for h in slots:
                    tm = HFTextModel("r", model, tok, head=h, batch_size=3, share_prefix=share)
                    rows += tm.score(ctx, cont)
                    tm.close()
                assert one == rows  # one pass = row by row, bitwise, either way
                got[factored] = one
        return got

    for share in (False, True):
        got = both(share)
        n = len(ctx)
        for k in range(len(slots)):
            for f, u in zip(got[True][k * n:(k + 1) * n], got[False][k * n:(k + 1) * n]):
                assert (f.n_tokens, f.greedy) == (u.n_tokens, u.greedy)
                if k in (0, len(slots) - 1):  # the plain merge and the head that does not pay: unchanged
                    assert f == u
                else:
                    assert abs(f.nll - u.nll) <= 1e-6 * abs(u.nll)
                    assert f.token_nll == pytest.approx(u.token_nll, rel=1e-5, abs=1e-6)
        assert sum(f != u for f, u in zip(got[True][n:4 * n], got[False][n:4 * n])) > 0  # rounding differs somewhere


def test_multi_head_rejects_a_bad_slot(model_and_tok, heads):
    model, tok = model_and_tok
    mh = HFMultiHeadModel(HFTextModel("plain", model, tok), [heads[0]], name="m")
    with pytest.raises(ValueError, match="head index 3 out of range"):
        mh.generate([(3, "hi")], max_new_tokens=2)
    with pytest.raises(ValueError, match="head index 1 out of range"):
        mh.score([(1, "hi", " there")])


# --------------------------------------------------------------------------- the stage's one-pass path
class _FakeMultiHead:
    """Records every multi-head call; generate answers '<slot>:<prompt>', score nll = slot + len(context)."""

    def __init__(self, log, head_dirs):
        self.log, self.head_dirs, self.tokenizer = log, head_dirs, None

    def format_chat(self, m):
        return f"<{m}>"

    def generate(self, requests, **kw):
        self.log.append(("generate", [r[0] for r in requests], kw["max_new_tokens"]))
        return [[f"{self.head_dirs[k]}:{p}"] for k, p in requests]

    def score(self, requests):
        from darts_bench.api import ScoreContinuation

        self.log.append(("score", [r[0] for r in requests], None))
        return [ScoreContinuation(nll=float(k + len(c)), n_tokens=1, greedy=False) for k, c, _ in requests]

    def close(self):
        self.log.append(("close", [], None))


class _FakeModels:
    def __init__(self):
        self.log, self.opened = [], []

    def multi_head_model(self, name, model_dir, head_dirs):
        self.opened.append((name, str(model_dir), list(head_dirs)))
        return _FakeMultiHead(self.log, head_dirs)


def _echo_task(fail_row=None):
    from darts_bench.api import Task, TaskResult

    class Echo(Task):
        name, expert, version = "gsm8k", "math", "t"  # a config section that exists

        def examples(self, data_dir, model, limit):
            return []

        def training_prompts(self, data_dir, model, n, seed):
            return []

        def evaluate(self, model, examples, ctx):
            short = model.generate([e.prompt for e in examples], max_new_tokens=3)
            if model.name == fail_row:
                raise ZeroDivisionError("boom")
            long = model.generate([model.format_chat(e.prompt) for e in examples], max_new_tokens=7)
            nll = model.score([e.prompt for e in examples], [e.reference for e in examples])
            return TaskResult(metrics={"gsm8k_em_strict": sum(s.nll for s in nll)},
                              samples=[{"output": s[0] + "|" + g[0]} for s, g in zip(short, long)])

    return Echo()


def _group(tmp_path):
    from darts_bench.rows import Row

    d = tmp_path / "ties"
    return [Row("ties", merge="ties", model_dir=d, model_key="k"),
            Row("ties+surgery", merge="ties", correction="surgery", model_dir=d, model_key="k1",
                heads={"gsm8k": tmp_path / "h1"}),
            Row("ties+darts", merge="ties", correction="darts", model_dir=d, model_key="k2",
                heads={"gsm8k": tmp_path / "h2"})]


def test_group_calls_are_gathered_into_one_multi_head_call_each(tmp_path):
    """Three rows of a merge: each of their generate / score calls is served by one multi-head call
    holding every row's requests (slots = row order, head dirs = the rows' heads); results are
    each row's own and cached; a second run loads nothing."""
    from darts_bench.api import Example
    from darts_bench.config import Config
    from darts_bench.stages.evaluate import evaluate_group

    cfg = Config()
    group = _group(tmp_path)
    by_name = {r.model: r for r in group}
    ex = [Example("a", "p1", "r1"), Example("b", "p22", "r2")]
    models = _FakeModels()
    res = evaluate_group(cfg, group, _echo_task(), ex, by_name, {}, models, tmp_path / "work")
    assert models.opened == [("ties", str(tmp_path / "ties"), [None, tmp_path / "h1", tmp_path / "h2"])]
    assert models.log == [("generate", [0, 0, 1, 1, 2, 2], 3), ("generate", [0, 0, 1, 1, 2, 2], 7),
                          ("score", [0, 0, 1, 1, 2, 2], None), ("close", [], None)]
    assert [r.samples[0]["output"] for r in res] == [
        f"{h}:p1|{h}:<p1>" for h in (None, tmp_path / "h1", tmp_path / "h2")]
    assert [r.metrics["gsm8k_em_strict"] for r in res] == [0 + 2 + 0 + 3, 1 + 2 + 1 + 3, 2 + 2 + 2 + 3]
    again = _FakeModels()
    res2 = evaluate_group(cfg, group, _echo_task(), ex, by_name, {}, again, tmp_path / "work")
    assert again.opened == [] and [r.metrics for r in res2] == [r.metrics for r in res]


def test_group_row_failure_names_row_and_task_and_others_finish(tmp_path):
    from darts_bench.api import Example
    from darts_bench.config import Config
    from darts_bench.stages.evaluate import evaluate_group

    group = _group(tmp_path)
    ex = [Example("a", "p1", "r1")]
    models = _FakeModels()
    with pytest.raises(ZeroDivisionError, match="boom") as ei:
        evaluate_group(Config(), group, _echo_task(fail_row="ties+surgery"), ex, {r.model: r for r in group}, {},
                       models, tmp_path / "work")
    assert any("'ties+surgery'" in n and "'gsm8k'" in n for n in ei.value.__notes__)
    # the failed row left the later calls to the other two rows, which finished and were cached
    assert models.log[1] == ("generate", [0, 2], 7) and models.log[2] == ("score", [0, 2], None)
    assert len(list((tmp_path / "work" / "eval").glob("ties*-gsm8k-*"))) == 2


def test_row_view_attributes_are_the_shared_models_and_a_missing_one_is_named(tmp_path):
    """A row's view reads tokenizer / max_length / device from the group's multi-head model; one the
    model lacks is an AttributeError naming the row, the model and the attribute (a task's
    ``getattr(model, "device", "cpu")`` then falls back as it would on the model itself)."""
    from darts_bench.stages.evaluate import RowView, _Gather

    shared = _FakeMultiHead([], [None])
    shared.max_length, shared.name = 77, "ties"
    view = RowView("ties+darts", 0, _Gather(1, lambda: shared))
    assert view.tokenizer is None and view.max_length == 77
    with pytest.raises(AttributeError, match=r"row 'ties\+darts': the group's multi-head model "
                                             r"\(_FakeMultiHead 'ties'\) has no attribute 'device'"):
        view.device
    assert getattr(view, "device", "cpu") == "cpu"
    shared.device = "cuda:1"
    assert view.device == "cuda:1"


#: teacher-forced signals (computed from logits, not from generated text): equal within 1e-6 relative
SIGNALS = ("_ref_nll", "_kl_", "_agree_top1", "_gap_closed", "_rep_l1", "_pos_slope", "_entropy_contrast")


def _one_pass_vs_row_by_row(pipe, rows, tmp_path) -> dict:
    """Evaluate ``rows`` on every task of ``pipe`` both ways (``evaluate.one_pass`` false, then true)
    and check: identical completions, task metrics equal, teacher-forced signals (:data:`SIGNALS`)
    within 1e-6 relative. Returns the one-pass results ``{row: {task: TaskResult}}``."""
    from darts_bench.stages.evaluate import evaluate

    all_rows, tasks = pipe.all_rows(), pipe.tasks()
    out = {}
    for one_pass in (False, True):
        cfg = pipe.cfg.model_copy(update={"evaluate": pipe.cfg.evaluate.model_copy(update={"one_pass": one_pass})})
        out[one_pass] = evaluate(cfg, rows, all_rows, tasks, pipe.executor, tmp_path / f"work-{one_pass}")
    n = 0
    for r in rows:
        for t in tasks:
            a, b = out[False][r.model][t], out[True][r.model][t]
            assert [s.get("output") for s in a.samples] == [s.get("output") for s in b.samples], (r.model, t)
            assert b.metrics.keys() == a.metrics.keys(), (r.model, t)
            for k, v in a.metrics.items():
                if isinstance(v, float) and any(x in k for x in SIGNALS):
                    assert b.metrics[k] == pytest.approx(v, rel=1e-6, nan_ok=True), (r.model, t, k)
                else:
                    assert b.metrics[k] == v, (r.model, t, k)
            # finish reasons reach every built-in (generative) task on both paths (one pass == row by row)
            assert t not in ("humaneval", "gsm8k", "alpacaeval") or b.metrics[f"{t}_truncated_rate"] is not None and \
                b.per_example["truncated"] == a.per_example["truncated"], (r.model, t)
            n += 1
    assert n == len(rows) * len(tasks)
    # the corrected rows really differ from their merge (the heads act in the one-pass path)
    for r in rows:
        if r.heads:
            assert all(out[True][r.model][t].metrics[f"{t}_ref_nll"] != out[True][r.merge][t].metrics[f"{t}_ref_nll"]
                       for t in r.heads), r.model
    return out[True]


@pytest.mark.micro
def test_micro_one_pass_equals_row_by_row(micro_pipeline, tmp_path):
    """On the micro pool, the rows of merge ``ties`` (plain, Surgery and DARTS on both calibration
    splits) and ``base`` on every task: one-pass and row-by-row give identical completions and
    task metrics (``<task>_truncated_rate`` included); the reference NLLs and the other teacher-forced
    signals are bitwise equal here."""
    pipe = micro_pipeline
    rows = [r for r in pipe.all_rows() if r.model == "base" or r.merge == "ties"]
    assert len(rows) == 6 and sum(bool(r.heads) for r in rows) == 4
    _one_pass_vs_row_by_row(pipe, rows, tmp_path)


@pytest.mark.micro
@pytest.mark.timeout(1200)
def test_qwen2_pool_one_pass_equals_row_by_row(data_dir, tmp_path):
    """The tiny pool in its Qwen2 shape (``tiny.architecture: qwen2``: q/k/v biases, tied input and
    output embeddings, grouped-query attention; micro-sized, ``conftest.QWEN2_MICRO_TINY``), a pipeline
    of its own through head training (one merge, one calibration split): ``base``, the merge and its
    Surgery and DARTS rows agree on both paths, every task."""
    from darts_bench.config import load_config
    from darts_bench.pipeline import Pipeline
    from conftest import QWEN2_MICRO_TINY, micro_config_file

    cfg = load_config(str(micro_config_file(tmp_path, pool={"tiny": QWEN2_MICRO_TINY},
                                            merges=[{"name": "ties", "method": "ties", "density": 0.5,
                                                     "normalize": True}])),
                      ["calibration.splits=[transductive]"])
    pipe = Pipeline(cfg)
    try:
        rows = [r for r in pipe.all_rows() if r.model == "base" or r.merge == "ties"]
        assert sum(bool(r.heads) for r in rows) >= 2, [r.model for r in rows]
        from transformers import AutoConfig

        mc = AutoConfig.from_pretrained(str(pipe.merge()["ties"]))
        assert mc.architectures == ["Qwen2ForCausalLM"] and mc.tie_word_embeddings
        assert mc.num_key_value_heads < mc.num_attention_heads
        _one_pass_vs_row_by_row(pipe, rows, tmp_path)
    finally:
        pipe.close()


@pytest.mark.micro
@pytest.mark.timeout(1500)
def test_rehearsal_pool_one_pass_equals_row_by_row(rehearsal_hub, data_dir, tmp_path):
    """The 7B-shaped rehearsal pool (``llama2-7b-rehearsal``: hub ids from an HF cache, sharded
    checkpoints with an untied lm_head, an expert that appends [PAD], a bf16 DARE-TIES merge, 5-shot
    GSM8K prompts past 1,024 tokens), run in-process (local executor, no DeepSpeed) and loaded in
    float32: ``base``, ``dare_ties`` and its Surgery and DARTS rows agree on both paths, every task."""
    from darts_bench.config import load_config
    from darts_bench.pipeline import Pipeline

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(rehearsal_hub))
    mp.delenv("HF_HUB_CACHE", raising=False)
    mp.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config("llama2-7b-rehearsal", [
        f"work_dir={tmp_path / 'work'}", f"out_dir={tmp_path / 'results'}", f"data_dir={data_dir}",
        "executor=local", "deepspeed.enabled=false", "pool.dtype=float32", "calibration.n_prompts=2",
        "tasks.gsm8k.limit=2", "tasks.humaneval.limit=2", "tasks.alpacaeval.limit=2"])
    pipe = Pipeline(cfg)
    try:
        rows = [r for r in pipe.all_rows() if r.model == "base" or r.merge == "dare_ties"]
        assert [r.model for r in rows if r.heads] == ["dare_ties+surgery", "dare_ties+darts"]
        out = _one_pass_vs_row_by_row(pipe, rows, tmp_path)
        tok = pipe.loaded_tasks().tokenizer
        assert min(len(tok(s["prompt"])["input_ids"]) for s in out["dare_ties+darts"]["gsm8k"].samples) > 1024
    finally:
        pipe.close()
        mp.undo()


def test_one_pass_is_not_in_the_eval_key(tmp_path):
    """Both paths give the same completions (tests above), so a result cached by one serves the other."""
    from darts_bench.api import Example
    from darts_bench.config import Config
    from darts_bench.stages.evaluate import eval_key

    row, ex = _group(tmp_path)[1], [Example("a", "p", "r")]
    on = Config()
    off = on.model_copy(update={"evaluate": on.evaluate.model_copy(update={"one_pass": False})})
    assert on.evaluate.one_pass and not off.evaluate.one_pass
    assert eval_key(on, row, _echo_task(), ex) == eval_key(off, row, _echo_task(), ex)


@pytest.mark.parametrize("backend,device,pool_dtype,vllm_dtype,exact", [
    ("hf", "cpu", "float32", "auto", True), ("hf", "cuda", "float32", "auto", True),
    ("vllm", "cpu", "float32", "auto", True), ("vllm", "cpu", "bfloat16", "float32", True),
    ("hf", "cpu", "float32", "bfloat16", True),  # vLLM's dtype is not the HF engine's
    ("hf", "cpu", "bfloat16", "auto", False), ("hf", "cuda", "float16", "auto", False),
    ("vllm", "cpu", "bfloat16", "auto", False), ("vllm", "cpu", "float32", "bfloat16", False),
    ("vllm", "cuda", "float32", "auto", False)])
def test_one_pass_in_the_eval_key_where_it_is_not_exact(tmp_path, monkeypatch, backend, device, pool_dtype, vllm_dtype,
                                                        exact):
    """Where the one pass is exact (a float32 engine, not vLLM on a GPU) the key is the same for both paths and
    the same as before the rule; elsewhere (a 16-bit engine: an H200 gave 194/224 greedy completions equal in
    bfloat16, results/device/eval-heads-h200; vLLM on a GPU, unmeasured) it names the path, both of them (so a
    row-by-row run is not served a one-pass result cached before the rule), and the HF one pass's batch cap."""
    from darts_bench.api import Example
    from darts_bench.config import Config
    from darts_bench.stages.evaluate import engine_dtype, eval_key, one_pass_exact, one_pass_numerics

    import darts_bench.stages.evaluate as ev

    monkeypatch.setattr(ev, "_vllm_platform_is_cpu", lambda: True)  # a CPU build of vLLM (or none)
    row, ex = _group(tmp_path)[1], [Example("a", "p", "r")]
    base = Config()

    def cfg(one_pass: bool, max_batch=None):
        return base.model_copy(update={
            "device": device, "pool": base.pool.model_copy(update={"dtype": pool_dtype}),
            "evaluate": base.evaluate.model_copy(update={
                "backend": backend, "one_pass": one_pass, "one_pass_max_batch": max_batch,
                "vllm": base.evaluate.vllm.model_copy(update={"dtype": vllm_dtype})})})

    on, off = cfg(True), cfg(False)
    assert engine_dtype(on) == (vllm_dtype if backend == "vllm" and vllm_dtype != "auto" else pool_dtype)
    assert one_pass_exact(on) is exact
    key = lambda c: eval_key(c, row, _echo_task(), ex)  # noqa: E731
    if exact:
        assert one_pass_numerics(on) == one_pass_numerics(off) == {}
        assert key(on) == key(off) == key(cfg(True, 4))  # {}: the hash input of before the rule
    else:
        assert one_pass_numerics(off) == {"one_pass": False}
        assert one_pass_numerics(on)["one_pass"] is True
        assert key(on) != key(off)
        assert (key(on) != key(cfg(True, 4))) is (backend == "hf")


def test_vllm_on_a_gpu_is_not_exact_whatever_device_says(tmp_path, monkeypatch):
    """A float32 vLLM backend with ``device: cpu`` is exact only where its engines run on the CPU: a GPU build of
    vLLM here, or Ray actors that reserve GPUs, make the key name the path (the HF backend stays exact)."""
    import darts_bench.stages.evaluate as ev
    from darts_bench.config import Config

    base = Config()
    vllm = base.model_copy(update={"evaluate": base.evaluate.model_copy(update={"backend": "vllm"})})
    monkeypatch.setattr(ev, "_vllm_platform_is_cpu", lambda: True)
    assert ev.one_pass_exact(vllm) and ev.one_pass_exact(base)
    on_ray_gpus = vllm.model_copy(update={"executor": "ray",
                                          "ray": vllm.ray.model_copy(update={"num_gpus_per_actor": 1})})
    assert not ev.one_pass_exact(on_ray_gpus)
    monkeypatch.setattr(ev, "_vllm_platform_is_cpu", lambda: False)  # a CUDA build of vLLM
    assert not ev.one_pass_exact(vllm) and ev.one_pass_numerics(vllm) == {"one_pass": True}
    assert ev.one_pass_exact(base)  # HF: cfg.device decides where it runs, and float32 is exact there
