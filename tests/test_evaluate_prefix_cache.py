"""Shared contexts' KV blocks kept across score calls (``PrefixBlockCache``; ``evaluate.prefix_cache_mib``,
``evaluate.vllm.prefix_cache_mib``): scores within 1e-6 relative of the full forward, bitwise independent of
what the cache holds (cold, warm, a budget that evicts, another call order), the blocks of a context forwarded
once across calls (counted at the embedding layer), the judge's verdicts unchanged, the backends' keys and
scorers carrying it, and models with sliding-window layers left on the plain path."""

from __future__ import annotations

import pytest

from conftest import tiny_checkpoint_with_heads

from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm
from darts_bench.evaluate.prefix_cache import PrefixBlockCache, blocks_supported
from darts_bench.surgery.heads import load_head

TEMPLATE = ("Select the output (a) or (b) that best matches the given instruction. Answer Output (a) or "
            "Output (b).\n\nInstruction: {i}\n\nOutput (a): {a}\n\nOutput (b): {b}\n\nWhich is best?")
INSTR = [("name a pet", "a dog is a good pet for most families"), ("add 2 and 3", "2 plus 3 is 5, the sum")]
# the rows' outputs: each row's judge prompts share the template, the instruction and (reference first) the
# reference with every other row's
OUTPUTS = [["a stone", "6"], ["a cat is fine", "five"], ["a dog", "5"]]


def judge_call(row: list[str]) -> tuple[list[str], list[str]]:
    """One row's judge call: each instruction in both orders, each prompt with both verdicts."""
    prompts = [TEMPLATE.format(i=i, a=r, b=o) for (i, r), o in zip(INSTR, row)]
    prompts += [TEMPLATE.format(i=i, a=o, b=r) for (i, r), o in zip(INSTR, row)]
    return [p for p in prompts for _ in (0, 1)], [x for _ in prompts for x in (" Output (a)", " Output (b)")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    texts = [TEMPLATE] + [t for pair in INSTR for t in pair] + [o for row in OUTPUTS for o in row] + [" Output (a)"]
    return tiny_checkpoint_with_heads(tmp_path_factory.mktemp("prefix-cache"), texts, seed=31)


def _model(ckpt, cache=None, share=True, head=None):
    model, tok = load_causal_lm(ckpt[0])
    return HFTextModel("judge", model, tok, head=load_head(head) if head else None, batch_size=3,
                       score_by_length=True, share_prefix=share, prefix_cache=cache)


def _nll(scores):
    return [s.token_nll for s in scores]


def test_blocks_equal_the_full_forward_and_do_not_depend_on_the_cache(ckpt):
    """Every row's judge scores within 1e-6 relative of the full forward (greedy flags and token counts equal);
    bitwise the same from a cold cache, a warm one, a 1-block budget that evicts all the time and the rows in
    another order; the cache found blocks (the comparison covers reuse)."""
    calls = [judge_call(row) for row in OUTPUTS]
    full = [_nll(_model(ckpt, share=False).score(*c)) for c in calls]
    cold = [_nll(_model(ckpt, PrefixBlockCache(1 << 30, block=4)).score(*c)) for c in calls]  # a cache per call
    warm_cache = PrefixBlockCache(1 << 30, block=4)
    warm_model = _model(ckpt, warm_cache)
    warm = [_nll(warm_model.score(*c)) for c in calls]
    tiny_cache = PrefixBlockCache(1, block=4)  # keeps one block
    tiny_model = _model(ckpt, tiny_cache)
    tiny = [_nll(tiny_model.score(*c)) for c in calls]
    back_model = _model(ckpt, PrefixBlockCache(1 << 30, block=4))
    back = [_nll(back_model.score(*c)) for c in reversed(calls)][::-1]
    capped_model = _model(ckpt, PrefixBlockCache(1 << 30, block=4, max_batch_tokens=8))  # one block per forward
    capped = [_nll(capped_model.score(*c)) for c in calls]
    assert warm == cold == tiny == back == capped
    for f, w in zip(full, warm):
        for a, b in zip(f, w):
            assert b == pytest.approx(a, rel=1e-6, abs=0)
    assert warm_cache.hits > 0 and warm_cache.misses > 0 and len(tiny_cache._blocks) == 1
    # blocks change the chunking: not the share_prefix path's bits (the key names the block size)
    plain_shared = [_nll(_model(ckpt).score(*c)) for c in calls]
    assert plain_shared != warm


def test_a_context_seen_before_forwards_only_its_own_tokens(ckpt):
    """The second row's call forwards the whole blocks the first row's computed not again: at the embedding
    layer it sees only its pairs' remaining tokens and the blocks that hold its own output."""
    cache = PrefixBlockCache(1 << 30, block=4)
    tm = _model(ckpt, cache)
    seen: list[int] = []
    hook = tm.model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(int(a[0].numel())))
    try:
        tm.score(*judge_call(OUTPUTS[0]))
        first, misses = sum(seen), cache.misses
        seen.clear()
        tm.score(*judge_call(OUTPUTS[0]))
    finally:
        hook.remove()
    assert cache.misses == misses and cache.hits >= misses  # every block found the second time
    assert sum(seen) == first - cache.forwarded  # only the tokens after the whole blocks


def test_judge_verdicts_unchanged_with_blocks(ckpt):
    """The AlpacaEval local judge's completions with the block cache equal the full forward's."""
    from darts_bench.api import get_task

    get_task("alpacaeval")
    from darts_bench_tasks.alpacaeval.judge import judge_completions

    prompts = [TEMPLATE.format(i=i, a=r, b=o) for row in OUTPUTS for (i, r), o in zip(INSTR, row)]
    got = {}
    for cache in (None, PrefixBlockCache(1 << 30, block=4)):
        got[cache is None] = judge_completions(prompts, judge=_model(ckpt, cache, share=cache is not None),
                                               use_chat_template=False)["completions"]
    assert got[True] == got[False]


def test_a_head_or_a_sliding_window_keeps_the_plain_path(ckpt):
    """With a correction head the cache is not used (a head changes the final hidden states); a config with a
    sliding window is not supported."""
    cache = PrefixBlockCache(1 << 30, block=4)
    c = judge_call(OUTPUTS[0])
    with_head = _nll(_model(ckpt, cache, head=ckpt[1][1]).score(*c))
    assert cache.hits == cache.misses == 0
    assert with_head == _nll(_model(ckpt, None, head=ckpt[1][1]).score(*c))
    model, _ = load_causal_lm(ckpt[0])
    assert blocks_supported(model)
    model.config.sliding_window = 16
    assert not blocks_supported(model)
    model.config.use_sliding_window = False  # Qwen2-style: the window only when switched on
    assert blocks_supported(model)
    for bad in ({"max_bytes": 0}, {"max_bytes": 1, "max_batch_tokens": 0}):
        with pytest.raises(ValueError, match="max_bytes, block"):
            PrefixBlockCache(**bad)
    assert PrefixBlockCache.from_mib(0) is None and PrefixBlockCache.from_mib(2).max_bytes == 2 << 20


def test_keys_and_backends_carry_the_cache(ckpt, monkeypatch, caplog):
    """The evaluate keys name the block size where the cache acts (hf: with share_prefix; vllm: with scoring:
    shared), never the budget, and stay as they were without it; the hf backend's wrappers share one cache per
    loaded model and its workers get one; the vLLM engine's HF copy keeps one across calls and logs it when
    closed."""
    import logging

    import darts_bench.evaluate.prefix_cache as prefix_cache
    from darts_bench.config import Config
    from darts_bench.evaluate.engines import backend_key, open_models
    from darts_bench.evaluate.engines.hf_scorer import HFScorer
    from darts_bench.evaluate.engines.vllm import VLLMBackend
    from darts_bench.executors.local import make_executor

    on = Config(evaluate={"share_prefix": True, "prefix_cache_mib": 64})
    assert backend_key(on) == {"share_prefix": True, "prefix_blocks": 64}
    assert backend_key(on, "calibration") == {} and backend_key(Config(evaluate={"prefix_cache_mib": 64})) == {}
    assert backend_key(Config(evaluate={"share_prefix": True})) == {"share_prefix": True}

    def vkey(**v):
        return VLLMBackend.cache_key(Config(evaluate={"backend": "vllm", "vllm": v}))["vllm"]

    assert vkey(scoring="shared", prefix_cache_mib=512) == vkey(scoring="shared", prefix_cache_mib=8)
    assert vkey(scoring="shared", prefix_cache_mib=512)["prefix_blocks"] == 64
    assert vkey(scoring="shared") == {k: v for k, v in vkey(scoring="shared", prefix_cache_mib=8).items()
                                      if k != "prefix_blocks"}
    assert "prefix_blocks" not in vkey(scoring="heads", prefix_cache_mib=8) and "prefix_cache_mib" not in vkey()
    assert "prefix_blocks" not in VLLMBackend.cache_key(
        Config(evaluate={"backend": "vllm", "vllm": {"scoring": "shared", "prefix_cache_mib": 8}}), "calibration")["vllm"]

    monkeypatch.setattr(prefix_cache, "PREFIX_BLOCK_TOKENS", 4)  # the tiny prompts hold whole blocks
    calls = [judge_call(row) for row in OUTPUTS]
    want = [_nll(_model(ckpt, PrefixBlockCache(1 << 30, block=4)).score(*c)) for c in calls]
    ex = make_executor(on)
    with open_models(on, ex, batch_size=3) as backend:
        got = []
        for c in calls:
            m = backend.get("judge", ckpt[0])
            got.append(_nll(m.score(*c)))
            m.close()
        caches = {id(w.prefix_cache) for w in backend._open[str(ckpt[0])]}
        assert len(caches) == 1 and backend._base[str(ckpt[0])].prefix_cache.hits > 0
        with caplog.at_level(logging.INFO, logger="darts_bench"):
            backend.close()
    assert got == want and "prefix cache of" in caplog.text
    assert ex.worker(str(ckpt[0])).text_model.prefix_cache.block == 4

    scorer = HFScorer(ckpt[0], share_prefix=True, prefix_cache_mib=1)
    assert [_nll(scorer.score(*c, batch_size=3)) for c in calls] == want
    assert scorer.prefix_cache.hits > 0 and scorer.prefix_cache.max_bytes == 1 << 20
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="darts_bench"):
        scorer.close()
    assert scorer.prefix_cache is None and "prefix cache of the HF copy" in caplog.text
    assert HFScorer(ckpt[0], share_prefix=False, prefix_cache_mib=1).prefix_cache_mib == 0


def test_bfloat16_blocks_do_not_depend_on_the_cache(ckpt):
    """A bfloat16 judge (a user's half-precision checkpoint): cold, warm, evicting and one-block-per-forward caches
    give bitwise equal scores, within 1e-3 relative of the full forward (bfloat16 rounding)."""
    import torch

    model, tok = load_causal_lm(ckpt[0], dtype=torch.bfloat16)
    calls = [judge_call(row) for row in OUTPUTS]

    def run(cache, order=calls):
        tm = HFTextModel("judge", model, tok, batch_size=3, score_by_length=True, share_prefix=True, prefix_cache=cache)
        return [_nll(tm.score(*c)) for c in order]

    warm = run(PrefixBlockCache(1 << 30, block=4))
    assert warm == [run(PrefixBlockCache(1 << 30, block=4), [c])[0] for c in calls]
    assert warm == run(PrefixBlockCache(1, block=4)) == run(PrefixBlockCache(1 << 30, block=4, max_batch_tokens=4))
    full = [_nll(HFTextModel("judge", model, tok, batch_size=3, score_by_length=True).score(*c)) for c in calls]
    for f, w in zip(full, warm):
        for a, b in zip(f, w):
            assert b == pytest.approx(a, rel=1e-3, abs=0)
