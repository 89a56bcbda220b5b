"""One-pass evaluation: several heads on one HF model (per-sequence head hook, batched greedy
generation, teacher-forced scores from one forward) and the evaluate stage's one-pass path equal to
row by row on the micro pool."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.evaluate.multi_head import HFMultiHeadModel
from darts_bench.pool.tiny import train_tokenizer
from darts_bench.surgery.corrected import MultiHeadAttachment, attach_head
from darts_bench.surgery.heads import build_head, positions_from_mask

PROMPTS = ["def add(a, b):", "Question: what is 2 + 3?\nAnswer:", "hi", "Write a long story about a dog",
           "the quick brown fox", "Question: how many legs has a dog?\nAnswer:", "def mul(x, y):\n    return"]


@pytest.fixture(scope="module")
def model_and_tok():
    tok = train_tokenizer(PROMPTS * 30 + ["the quick brown fox jumps over the lazy dog"] * 30, 300)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tok.padding_side = "left"
    return model, tok


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


def test_multi_head_generate_batches_heads_in_one_call(model_and_tok, heads):
    """7 prompts x 4 slots at batch_size 3: the chunks of equal padded length are stacked, so there
    are fewer generate calls than the row-by-row path's 4 x 3; equal (head, chunk) pairs (two
    slots with the same head) are generated once."""
    model, tok = model_and_tok
    calls = []
    orig = model.generate

    def counting(*a, **k):
        calls.append(k["input_ids"].shape[0])
        return orig(*a, **k)

    model.generate = counting
    try:
        mh = HFMultiHeadModel(HFTextModel("plain", model, tok, batch_size=3), [None, heads[0], heads[0], None],
                              name="m")
        mh.generate_ids([(k, p) for k in range(4) for p in PROMPTS], max_new_tokens=4)
    finally:
        del model.generate
    assert sum(calls) == 2 * len(PROMPTS)  # two distinct heads (None, heads[0]) x 7 prompts
    assert len(calls) <= 3  # chunks [3, 3, 1] of each head, stacked by padded length


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
    """score: NLLs within 1e-6 relative of each row's HFTextModel.score, and the transformer body
    runs once per chunk of distinct pairs (3 chunks of 3, 3, 1), not once per head."""
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
            assert g.n_tokens == w.n_tokens and g.greedy == w.greedy
            assert g.nll == pytest.approx(w.nll, rel=1e-6)
            assert g.token_nll == pytest.approx(w.token_nll, rel=1e-6, abs=1e-9)
    assert got[0].nll != got[len(ctx)].nll  # the heads change the scores


def test_multi_head_rejects_a_bad_slot(model_and_tok, heads):
    model, tok = model_and_tok
    mh = HFMultiHeadModel(HFTextModel("plain", model, tok), [heads[0]], name="m")
    with pytest.raises(ValueError, match="head index 3 out of range"):
        mh.generate([(3, "hi")], max_new_tokens=2)
    with pytest.raises(ValueError, match="head index 1 out of range"):
        mh.score([(1, "hi", " there")])
