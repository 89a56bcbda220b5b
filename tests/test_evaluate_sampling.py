"""Generation on the HF backend: each completion's finish reason (``stop`` / ``length``, the
``Completion`` string), and seeded sampling (temperature, top_p, one seed per (seed, prompt, sample
index)): the same samples for any batch size, on a rerun, row by row and in one pass; the sampler's
draws against the distribution it samples from."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from darts_bench.api import Completion, truncated_rate
from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.evaluate.multi_head import HFMultiHeadModel
from darts_bench.evaluate.sampling import SeededSampler, sample_seed
from darts_bench.surgery.heads import build_head
from conftest import tiny_llama_and_tokenizer

PROMPTS = ["def add(a, b):", "Question: what is 2 + 3?\nAnswer:", "hi", "Write a long story about a dog",
           "the quick brown fox", "Question: how many legs has a dog?\nAnswer:", "def mul(x, y):\n    return"]
SAMPLED = dict(max_new_tokens=8, num_samples=3, temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_llama_and_tokenizer(PROMPTS)


def _view(rows):
    return [[(str(c), c.finish_reason, c.n_tokens) for c in r] for r in rows]


# --------------------------------------------------------------------------- Completion
def test_completion_is_a_string_with_its_finish_reason():
    c = Completion("x = 1", "length", 7)
    assert c == "x = 1" and isinstance(c, str) and c.truncated and c.n_tokens == 7
    assert type(c.strip()) is str and type(c[:2]) is str  # derived text carries no finish reason
    for back in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert (back, back.finish_reason, back.n_tokens, type(back)) == ("x = 1", "length", 7, Completion)
    import json

    assert json.dumps([c]) == '["x = 1"]'
    with pytest.raises(ValueError, match="finish_reason 'eos' not one of"):
        Completion("x", "eos")
    assert truncated_rate([[c, Completion("y", "stop", 1)], [Completion("z", "length", 2)]]) == pytest.approx(2 / 3)
    assert truncated_rate([Completion("y", "stop", 1)]) == 0.0
    assert truncated_rate([["plain", c]]) is None and truncated_rate([]) is None  # unknown, not 0


# --------------------------------------------------------------------------- finish reasons
def test_finish_reasons_length_stop_and_eos(model_and_tok):
    model, tok = model_and_tok
    tm = HFTextModel("m", model, tok, batch_size=3)
    ids = tm.generate_ids(PROMPTS, max_new_tokens=6)
    got = tm.generate(PROMPTS, max_new_tokens=6)
    for row, g in zip(ids, got):
        (c,) = g
        assert c.finish_reason == "length" and c.n_tokens == len(row[0])  # the random model never says eos
        assert c == tok.decode(row[0], skip_special_tokens=True)
    # a stop sequence in the text: cut there, finish reason stop
    text = str(got[0][0])
    stop = text[2:4]
    (s,), = tm.generate(PROMPTS[:1], max_new_tokens=6, stop=[stop])
    assert s.finish_reason == "stop" and s == text[:text.index(stop)]
    # an eos id: make the first greedy token of prompt 0 the eos; nothing is generated, stop
    first = ids[0][0][0]
    saved = copy.deepcopy(model.generation_config)
    try:
        model.generation_config.eos_token_id = first
        (e,), = tm.generate(PROMPTS[:1], max_new_tokens=6)
    finally:
        model.generation_config = saved
    assert (e, e.finish_reason, e.n_tokens) == ("", "stop", 0)


def test_one_pass_finish_reasons_equal_row_by_row(model_and_tok):
    model, tok = model_and_tok
    head = build_head("darts", 32, rank=4, max_len=16, overflow="clamp", seed=1)
    with torch.no_grad():
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=torch.Generator().manual_seed(3)))
    mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3), [None, head], name="m")
    text = str(HFTextModel("p", model, tok).generate(PROMPTS[:1], max_new_tokens=6)[0][0])
    stop = [text[3:5]]  # cuts some continuations (stop), leaves others at the cap (length)
    for kw in (dict(max_new_tokens=6, stop=stop), SAMPLED):
        got = mh.generate([(k, p) for k in (0, 1) for p in PROMPTS], **kw)
        for k, hd in enumerate([None, head]):
            row = HFTextModel("r", model, tok, head=hd, batch_size=3)
            assert _view(got[k * len(PROMPTS):(k + 1) * len(PROMPTS)]) == _view(row.generate(PROMPTS, **kw))
            row.close()
    reasons = {c.finish_reason for r in mh.generate([(0, p) for p in PROMPTS], max_new_tokens=6, stop=stop) for c in r}
    assert reasons == {"stop", "length"}


# --------------------------------------------------------------------------- seeded sampling
def test_samples_do_not_depend_on_batch_size_and_rerun_equal(model_and_tok):
    model, tok = model_and_tok
    one = HFTextModel("a", model, tok, batch_size=1).generate_ids(PROMPTS, **SAMPLED)
    four = HFTextModel("b", model, tok, batch_size=4).generate_ids(PROMPTS, **SAMPLED)
    assert one == four
    assert HFTextModel("c", model, tok, batch_size=4).generate_ids(PROMPTS, **SAMPLED) == four  # rerun
    # the other prompts of the call do not matter, nor the number of samples (sample j's seed is its own)
    alone = HFTextModel("d", model, tok, batch_size=4).generate_ids(PROMPTS[3:4], **{**SAMPLED, "num_samples": 2})
    assert alone == [four[3][:2]]
    assert len({tuple(s) for r in four for s in r}) > len(PROMPTS)  # samples of a prompt differ
    other = HFTextModel("e", model, tok, batch_size=4).generate_ids(PROMPTS, **{**SAMPLED, "seed": 6})
    assert other != four


def test_top_p_and_greedy_arguments(model_and_tok):
    model, tok = model_and_tok
    tm = HFTextModel("a", model, tok, batch_size=4)
    # top_p -> 0 keeps only the most likely token: sampling at any temperature is the greedy path
    assert tm.generate_ids(PROMPTS, max_new_tokens=6, temperature=1.5, top_p=1e-6, num_samples=2) == \
        [[g[0], g[0]] for g in tm.generate_ids(PROMPTS, max_new_tokens=6)]
    with pytest.raises(ValueError, match="top_p=0.9 needs sampling"):
        tm.generate(PROMPTS[:1], max_new_tokens=2, top_p=0.9)
    with pytest.raises(ValueError, match="greedy decoding"):
        tm.generate(PROMPTS[:1], max_new_tokens=2, num_samples=2)


def test_sample_seed_is_stable_and_distinct():
    s = sample_seed(5, "def f():", 0)
    assert s == sample_seed(5, "def f():", 0) and 0 <= s < 2 ** 63
    assert len({s, sample_seed(6, "def f():", 0), sample_seed(5, "def g():", 0), sample_seed(5, "def f():", 1),
                sample_seed(5, [1, 2, 3], 0)}) == 5
    assert sample_seed(5, [1, 2, 3], 0) == sample_seed(5, (1, 2, 3), 0)
    # pinned: BLAKE2b-64 of "5\x00def f():\x000", shifted right by 1
    import hashlib

    h = int.from_bytes(hashlib.blake2b(b"5\x00def f():\x000", digest_size=8).digest(), "little") >> 1
    assert s == h
    with pytest.raises(ValueError, match="sample index"):
        sample_seed(5, "x", -1)


def test_sampler_draws_follow_the_filtered_distribution():
    """20,000 draws (one sequence each, seeds 0..19999) from logits [2, 1, 0, -1, -3] at T = 0.5 and
    top_p = 0.9: the nucleus is tokens {0, 1} (softmax(logits / 0.5) = 0.8668, 0.1173, ...: 0.8668 < 0.9
    <= 0.9841), renormalised to 0.8808 / 0.1192; the frequencies are within 4 standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    p = torch.softmax(logits / 0.5, -1)[0]
    assert p[0] < 0.9 <= p[0] + p[1]
    want = (p[:2] / p[:2].sum()).numpy()
    n = 20000
    draws = []
    for s in range(n):
        out = SeededSampler([s], 0.5, 0.9)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
        (tok,) = (out[0] == 0).nonzero()[:, 0].tolist()
        assert torch.isinf(out[0]).sum() == 4
        draws.append(tok)
    freq = np.bincount(draws, minlength=5) / n
    assert freq[2:].sum() == 0  # outside the nucleus: never
    se = np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(freq[:2] - want) < 4 * se), (freq, want)
    with pytest.raises(ValueError, match="2 rows, but 1 seeds"):
        SeededSampler([0], 1.0)(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="top_p must be in"):
        SeededSampler([0], 1.0, top_p=0.0)
