"""The protocol header of table.md and the manifest's ``protocols`` (darts_bench/report/protocols.py)."""

from darts_bench.report.protocols import protocol_header, protocol_summary
from darts_bench.report.tables import contract_columns


def test_summary_and_header_name_protocol_and_annotator():
    meta = {"humaneval": {"protocol": "chat", "protocol_version": "1", "task_version": "2", "stop": [],
                          "template": "format_chat(...)", "status_counts": {"passed": 3}},
            "gsm8k": {"protocol": "alpaca-cot", "protocol_version": "1", "task_version": "2",
                      "stop": ["Instruction:"], "num_fewshot": 0},
            "alpacaeval": {"protocol": "vicuna", "protocol_version": "1", "task_version": "2",
                           "judge": "alpaca_eval:chatgpt_fn", "judge_name": "gpt-3.5-turbo-16k-0613",
                           "annotator": "chatgpt_fn", "reference": "gpt4_turbo",
                           "reference_generator": "gpt4_1106_preview", "alpaca_eval_version": "0.6.6"}}
    s = protocol_summary(meta)
    assert "status_counts" not in s["humaneval"] and s["humaneval"]["template"] == "format_chat(...)"
    head = protocol_header(s)
    assert "- **humaneval**: protocol `chat` v1 (task v2), stop []" in head
    assert "- **gsm8k**: protocol `alpaca-cot` v1 (task v2), stop ['Instruction:']" in head
    assert ("- **alpacaeval**: protocol `vicuna` v1 (task v2), annotator `chatgpt_fn` (judge "
            "`alpaca_eval:chatgpt_fn`, gpt-3.5-turbo-16k-0613), reference `gpt4_turbo` (gpt4_1106_preview), "
            "alpaca_eval 0.6.6") in head


def test_mismatch_columns_follow_the_headline():
    cols = contract_columns(["humaneval", "gsm8k", "alpacaeval"])
    assert cols.index("humaneval_empty_rate") == cols.index("humaneval_pass@1") + 1
    assert cols.index("gsm8k_no_answer_rate") == cols.index("gsm8k_em_flexible") + 1
    assert cols.index("alpacaeval_unparsed") == cols.index("alpacaeval_win_rate") + 1


def test_presets_and_dry_run_name_the_protocols():
    import io

    from darts_bench.config import load_config
    from darts_bench.plan import print_plan

    buf = io.StringIO()
    plan = print_plan(load_config("llama2-7b"), file=buf)
    assert "protocols: humaneval instruct, gsm8k alpaca-cot, alpacaeval vicuna" in buf.getvalue()
    assert plan["tasks"]["gsm8k"]["protocol"] == "alpaca-cot"
    smol = load_config("smollm2-135m").tasks
    assert (smol.humaneval.protocol, smol.gsm8k.protocol, smol.alpacaeval.protocol) == ("chat", "chat-cot", "chat_template")
    tiny = load_config("tiny").tasks
    assert (tiny.humaneval.protocol, tiny.gsm8k.protocol, tiny.alpacaeval.protocol) == ("chat", "lm-eval", "chat_template")


def test_unknown_protocol_is_a_config_error():
    import pytest

    from darts_bench.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="tasks.humaneval.protocol"):
        load_config("tiny", ["tasks.humaneval.protocol=wizard"])
    with pytest.raises(ConfigError, match="tasks.alpacaeval.judge.max_unparsed"):
        load_config("tiny", ["tasks.alpacaeval.judge.max_unparsed=2"])
