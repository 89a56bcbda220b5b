"""Free heap memory goes back to the OS after each model call (``darts_bench/evaluate/memory.py``).

Evaluation runs each row in its own thread; on glibc each thread's malloc arena kept its scoring peak
resident after the call (the smollm2-135m driver: +0.75-1.1 GiB per row thread over one AlpacaEval
pass). The first test shows that mechanism and its fix on real glibc memory, in a fresh process; the
second that every scoring and generation entry point of the HF models trims after its call.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
from conftest import tiny_llama_and_tokenizer
from darts_bench.evaluate import memory
from darts_bench.evaluate.hf_model import HFTextModel
from darts_bench.evaluate.multi_head import HFMultiHeadModel
from darts_bench.surgery.heads import build_head

GLIBC = platform.libc_ver()[0] == "glibc"

PROBE = textwrap.dedent("""
    import ctypes, json, threading
    from darts_bench.evaluate.memory import trim_heap

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def rss():  # MiB
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    out = {"start": rss()}

    def row():  # what a row thread's forward does to its arena: blocks below the mmap threshold, then freed
        blocks = [libc.malloc(64 * 1024) for _ in range(4000)]  # 250 MiB
        for p in blocks:
            ctypes.memset(p, 1, 64 * 1024)
        keep = libc.malloc(64)  # a live block after them: the arena's top cannot shrink
        for p in blocks:
            libc.free(p)
        out["freed"] = rss()
        out["trimmed_any"] = trim_heap()
        out["trimmed"] = rss()
        libc.free(keep)

    t = threading.Thread(target=row)
    t.start()
    t.join()
    print(json.dumps(out))
""")


@pytest.mark.skipif(not GLIBC, reason="malloc arenas and malloc_trim are glibc's")
def test_trim_heap_returns_a_row_threads_freed_arena_memory_to_the_os():
    import json

    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    r = json.loads(p.stdout)
    # 250 MiB freed in the thread's arena stay resident ...
    assert r["freed"] - r["start"] > 200, r
    # ... until the trim: back within a few MiB of where the process started
    assert r["trimmed_any"] is True
    assert r["freed"] - r["trimmed"] > 200, r
    assert r["trimmed"] - r["start"] < 20, r


def test_trim_heap_without_malloc_trim_does_nothing(monkeypatch):
    monkeypatch.setattr(memory, "_MALLOC_TRIM", False)  # the C library has none (musl, macOS)
    assert memory.trim_heap() is False


def test_heap_trimmed_trims_after_each_call_and_after_a_raise(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "trim_heap", lambda: calls.append(1) or True)

    @memory.heap_trimmed
    def ok(x):
        return x + 1

    @memory.heap_trimmed
    def bad():
        raise KeyError("boom")

    assert ok(1) == 2 and calls == [1]
    with pytest.raises(KeyError, match="boom"):
        bad()
    assert calls == [1, 1]


def test_hf_scoring_and_generation_trim_after_each_call_with_the_same_values(monkeypatch):
    """HFTextModel.score / generate_finished and HFMultiHeadModel.score / generate_finished trim once per
    call, and return what they return untrimmed (trimming only releases free memory)."""
    prompts = ["the quick brown fox", "a lazy dog jumps over the fox and"]
    model, tok = tiny_llama_and_tokenizer(prompts)
    tm = HFTextModel("plain", model, tok, batch_size=2)
    head = build_head("darts", 32, rank=4, max_len=16, seed=0)
    mh = HFMultiHeadModel(HFTextModel("base", model, tok, batch_size=2), [None, head], name="m")

    def run():
        return (tm.score(prompts, [" jumps", " over"]), tm.generate_finished(prompts, max_new_tokens=4),
                mh.score([(0, prompts[0], " jumps"), (1, prompts[1], " over")]),
                mh.generate_finished([(0, prompts[0]), (1, prompts[1])], max_new_tokens=4))

    monkeypatch.setattr(memory, "_MALLOC_TRIM", False)
    want = run()
    calls = []
    monkeypatch.setattr(memory, "trim_heap", lambda: calls.append(1) or True)
    got = run()
    assert len(calls) == 4  # one per call
    assert [[s.token_nll for s in x] for x in (got[0], got[2])] == [[s.token_nll for s in x] for x in (want[0], want[2])]
    assert got[1] == want[1] and got[3] == want[3]
