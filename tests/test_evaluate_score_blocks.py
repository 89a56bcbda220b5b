"""``continuation_scores`` in blocks of positions: the logits of a chunk are never held whole
(``[positions, vocab]`` float32 was the smollm2-135m driver's 15 GiB peak), and the scores are the
bits of the one-block computation."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_checkpoint_with_heads
from darts_bench.evaluate import hf_model
from darts_bench.evaluate.hf_model import HFTextModel, continuation_scores, load_causal_lm, position_blocks
from darts_bench.surgery.heads import load_head


def test_position_blocks_exact_bounds():
    assert position_blocks(0, 1024) == []
    assert position_blocks(5, 1024) == [(0, 5)]
    assert position_blocks(1024, 1024) == [(0, 1024)]
    assert position_blocks(1025, 1024) == [(0, 512), (512, 1025)]  # balanced: no block of one row
    assert position_blocks(2049, 1024) == [(0, 683), (683, 1366), (1366, 2049)]
    assert position_blocks(7, 2) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    with pytest.raises(ValueError, match="block must be >= 1 position, got 0"):
        position_blocks(3, 0)


class CountingHead(torch.nn.Module):
    """A ``lm_head`` that records how many positions each call gets."""

    def __init__(self, lin):
        super().__init__()
        self.lin, self.rows = lin, []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.lin(x)


@pytest.mark.parametrize("softcap", [None, 30.0])
@torch.no_grad()
def test_continuation_scores_in_blocks_equal_one_block(softcap):
    g = torch.Generator().manual_seed(0)
    d, vocab, seq = 64, 512, 900
    h = torch.randn(3, seq, d, generator=g)
    input_ids = torch.randint(0, vocab, (3, seq), generator=g)
    lin = torch.nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(vocab, d, generator=g) / 4)
    n_cont, ends = [800, 700, 600], [900, 850, 700]
    one = continuation_scores(h, input_ids, n_cont, lin, softcap, ends=ends, block=10**9)
    head = CountingHead(lin)
    got = continuation_scores(h, input_ids, n_cont, head, softcap, ends=ends, block=1024)
    assert head.rows == [700, 700, 700]  # 2,100 positions in 3 blocks, never more than 1,024 at once
    assert [s.token_nll for s in got] == [s.token_nll for s in one]  # bitwise, every token
    assert [(s.nll, s.n_tokens, s.greedy) for s in got] == [(s.nll, s.n_tokens, s.greedy) for s in one]
    # the NLL of one token by hand: -log_softmax(lm_head(h[row, t]))[next token]
    logits = lin(h[1, 850 - 700 - 1])
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    want = -torch.log_softmax(logits.float(), -1)[input_ids[1, 850 - 700]]
    assert got[1].token_nll[0] == pytest.approx(float(want), rel=1e-6)
    assert continuation_scores(h, input_ids, [0, 0, 0], lin) == continuation_scores(h, input_ids, [0, 0, 0], lin,
                                                                                     block=1)


def test_hf_scores_in_small_blocks_equal_one_block(tmp_path, monkeypatch):
    """The user's path: ``HFTextModel.score`` with a DARTS head over pairs whose continuations
    together exceed the block, the block read at call time."""
    texts = ["def add(a, b):", " return a + b", "Q: 2 + 3 =", " 5", "The quick brown fox", " jumps over the lazy dog",
             "Hello", " there, how are you doing on this fine day"]
    model_dir, heads = tiny_checkpoint_with_heads(tmp_path, texts, seed=3)
    contexts, conts = texts[0::2] * 6, texts[1::2] * 6

    def scores():
        model, tok = load_causal_lm(model_dir)
        tm = HFTextModel("m", model, tok, head=load_head(heads[1]), batch_size=24)
        try:
            return tm.score(contexts, conts)
        finally:
            tm.close()

    one = scores()
    calls = []
    real = hf_model.position_blocks
    monkeypatch.setattr(hf_model, "position_blocks", lambda n, block=None: calls.append(n) or real(n, block))
    monkeypatch.setattr(hf_model, "SCORE_BLOCK_POSITIONS", 64)
    got = scores()
    assert max(calls) > 64  # the chunk's positions were split, in blocks of 64 or fewer (32 or more)
    assert [s.token_nll for s in got] == [s.token_nll for s in one]
    assert [(s.nll, s.greedy) for s in got] == [(s.nll, s.greedy) for s in one]
