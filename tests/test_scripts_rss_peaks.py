"""scripts/rss_peaks.py: per-process RSS peaks of a sampled run and the driver's phase at each."""

from __future__ import annotations

import pytest

from conftest import load_script

# a driver (pid 10, parent 1 is not sampled), its vLLM engine core (11) and that core's worker (12)
RSS = """\
1000 10 1 1048576 /venv/bin/python3 /venv/bin/darts-bench run --config x
1000 11 10 524288 VLLM::EngineCore
1003 10 1 2097152 /venv/bin/python3 /venv/bin/darts-bench run --config x
1003 11 10 524288 VLLM::EngineCore
1003 12 11 3145728 /venv/bin/python3 -c from multiprocessing.spawn import spawn_main
1006 10 1 3145728 /venv/bin/python3 /venv/bin/darts-bench run --config x
1006 11 10 262144 VLLM::EngineCore
"""
STACKS = """\
@@ 999
Thread 1 (idle): "MainThread"
    wait (threading.py:1)
@@ 1002
Thread 7 (active): "eval-m-alpacaeval"
    forward (torch/nn/module.py:1)
    score (darts_bench/evaluate/hf_model.py:500)
    judge_completions (darts_bench_tasks/alpacaeval/judge.py:9)
@@ 1005
Thread 7 (idle): "eval-m-gsm8k"
    LLM.generate (vllm/entrypoints/llm.py:1)
    generate_ids (darts_bench/evaluate/engines/vllm.py:300)
"""


def test_peaks_name_each_process_its_peak_and_the_drivers_phase(tmp_path, capsys):
    rp = load_script("rss_peaks")
    (tmp_path / "rss.txt").write_text(RSS)
    (tmp_path / "stacks.txt").write_text(STACKS)
    per, tot = rp.peaks(rp.read_rss(tmp_path / "rss.txt"), rp.samples(STACKS), top=2)
    assert list(per["process"]) == ["driver (10)", "python3 -c from (12)", "VLLM::EngineCore (11)"]
    assert list(per["peak GiB"]) == [3.0, 3.0, 0.5]
    assert list(per["t"]) == [1006, 1003, 1000]  # the engine core's first sample of its peak
    # the driver's phase at a peak: the stack sample nearest before it
    assert list(per["phase"]) == ["generation", "judge", "between calls"]
    assert per["frame"][0] == "generate_ids (darts_bench/evaluate/engines/vllm.py:300)"
    assert per["frame"][1] == "score (darts_bench/evaluate/hf_model.py:500)"
    # the largest sums of RSS over the processes: 1003 (2 + 0.5 + 3 GiB), then 1006 (3 + 0.25)
    assert list(tot["t"]) == [1003, 1006] and list(tot["sum GiB"]) == [5.5, 3.25]
    assert tot["processes"][0] == "python3 -c from (12) 3.00, driver (10) 2.00, VLLM::EngineCore (11) 0.50"
    assert rp.main([str(tmp_path / "rss.txt"), "--stacks", str(tmp_path / "stacks.txt"), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "| driver (10) | 3.00 | 00:16:46 | generation |" in out
    assert "| 00:16:43 | 5.50 | python3 -c from (12) 3.00, driver (10) 2.00, VLLM::EngineCore (11) 0.50 | judge |" in out


def test_a_malformed_or_empty_sample_file_is_an_error_naming_the_line(tmp_path):
    rp = load_script("rss_peaks")
    (tmp_path / "bad.txt").write_text("1000 10 1 1024 python\n1003 10 1\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: expected"):
        rp.read_rss(tmp_path / "bad.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no samples"):
        rp.read_rss(tmp_path / "empty.txt")
