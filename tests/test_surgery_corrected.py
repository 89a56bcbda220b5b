"""A head attached to an HF model: generate() unchanged, KV cache, batching and left padding."""

import pytest
import torch
from transformers import GenerationConfig

from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.surgery.corrected import attach_head, corrected
from darts_bench.surgery.heads import build_head
from conftest import tiny_llama_and_tokenizer

PROMPTS = ["def add(a, b):", "Question: what is 2 + 3?\nAnswer:", "hi", "Write a long story about a dog"]


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_llama_and_tokenizer(PROMPTS)


def _nontrivial_head(method="darts", d=32):
    head = build_head(method, d, rank=4, max_len=8, overflow="clamp", seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g))
        if head.pos_bias is not None:
            head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g) * 2)
    return head


def _gen(model, tok, prompts, use_cache=True, n=12):
    enc = tok(prompts, return_tensors="pt", padding=True)
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, use_cache=use_cache,
                           pad_token_id=tok.pad_token_id, eos_token_id=None)
    out = model.generate(**enc, generation_config=cfg)
    return out[:, enc["input_ids"].shape[1]:].tolist()


def test_head_changes_outputs(model_and_tok):
    model, tok = model_and_tok
    plain = _gen(model, tok, PROMPTS[:1])
    with corrected(model, _nontrivial_head()):
        corr = _gen(model, tok, PROMPTS[:1])
    assert plain != corr
    assert _gen(model, tok, PROMPTS[:1]) == plain  # detached again


def test_identity_head_changes_nothing(model_and_tok):
    model, tok = model_and_tok
    plain = _gen(model, tok, PROMPTS)
    with corrected(model, build_head("darts", 32, rank=4, seed=5)):
        assert _gen(model, tok, PROMPTS) == plain


@pytest.mark.parametrize("method", ["surgery", "darts"])
def test_cached_equals_uncached(model_and_tok, method):
    model, tok = model_and_tok
    with corrected(model, _nontrivial_head(method)):
        assert _gen(model, tok, PROMPTS, use_cache=True) == _gen(model, tok, PROMPTS, use_cache=False)


def test_batched_left_padded_equals_single(model_and_tok):
    model, tok = model_and_tok
    with corrected(model, _nontrivial_head("darts")):
        batched = _gen(model, tok, PROMPTS)
        singles = [_gen(model, tok, [p])[0] for p in PROMPTS]
    assert batched == singles


def test_positions_seen_by_head_are_absolute(model_and_tok):
    """With left padding the head sees positions 0.. for real tokens, then past_len + i while decoding."""
    model, tok = model_and_tok
    head = _nontrivial_head("darts")
    seen = []
    orig = head.forward

    def spy(h, positions=None):
        seen.append(positions.clone())
        return orig(h, positions)

    head.forward = spy
    att = attach_head(model, head)
    try:
        _gen(model, tok, ["hi", "Write a long story about a dog"], n=3)
    finally:
        att.remove()
    enc = tok(["hi", "Write a long story about a dog"], padding=True)
    n_short = sum(enc["attention_mask"][0])
    n_long = sum(enc["attention_mask"][1])
    prefill = seen[0]
    assert prefill[1].tolist() == list(range(n_long))
    assert prefill[0, -n_short:].tolist() == list(range(n_short))
    assert seen[1][:, -1].tolist() == [n_short, n_long]
    assert seen[2][:, -1].tolist() == [n_short + 1, n_long + 1]


def test_hf_text_model_with_head_matches_manual(model_and_tok):
    model, tok = model_and_tok
    head = _nontrivial_head("darts")
    tm = HFTextModel("m+darts", model, tok, head=head, batch_size=2)
    try:
        ids = tm.generate_ids(PROMPTS, max_new_tokens=6)
    finally:
        tm.close()
    with corrected(model, head):
        manual = [_gen(model, tok, [p], n=6)[0] for p in PROMPTS]
    eos = tok.eos_token_id
    manual = [m[: m.index(eos)] if eos in m else m for m in manual]
    assert [r[0] for r in ids] == manual
