"""The evaluation protocol on record: per task, what ``table.md``'s header and the manifest show
(protocol name and version, exact template, stop sequences; for AlpacaEval the annotator, the
reference set and the alpaca_eval version), read from the tasks' ``TaskResult.meta``."""

from __future__ import annotations

from typing import Any

__all__ = ["protocol_summary", "protocol_header"]

_KEYS = ("protocol", "protocol_version", "protocol_source", "template", "stop", "example_prompt",
         "task_version", "num_fewshot", "apply_chat_template", "lm_eval_task",
         "judge", "judge_name", "judge_mode", "annotator", "annotators_config", "judge_both_orders",
         "reference", "reference_source", "reference_generator", "alpaca_eval_version", "win_rate_kind",
         "judge_check", "judge_passed")


def protocol_summary(meta_by_task: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{task: {key: value}}`` with the protocol keys present in each task's meta."""
    return {t: {k: m[k] for k in _KEYS if k in m} for t, m in meta_by_task.items()}


def protocol_header(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown lines naming each task's protocol (and AlpacaEval's annotator) for ``table.md``."""
    lines = []
    for t, s in summary.items():
        parts = [f"protocol `{s.get('protocol', '?')}`"
                 + (f" v{s['protocol_version']}" if s.get("protocol_version") else "")
                 + (f" (task v{s['task_version']})" if s.get("task_version") else "")]
        if s.get("num_fewshot"):
            parts.append(f"{s['num_fewshot']}-shot")
        if "stop" in s:
            parts.append(f"stop {s['stop']!r}")
        if "annotator" in s:
            parts.append(f"annotator `{s.get('annotator')}` (judge `{s.get('judge')}`"
                         + (f", {s['judge_name']}" if s.get("judge_name") else "") + ")")
            parts.append(f"reference `{s.get('reference')}` ({s.get('reference_generator')})")
            if s.get("alpaca_eval_version"):
                parts.append(f"alpaca_eval {s['alpaca_eval_version']}")
            chk = s.get("judge_check")
            if chk:  # issue 57: the judge's known-answer check (tasks/alpacaeval/judge_check.py)
                cons = chk.get("order_consistency")
                parts.append(f"judge check {'passed' if chk['passed'] else 'FAILED (win rate uninformative, left out of claims)'}:"
                             f" accuracy {chk['accuracy']:.2f} (pass mark {chk['min_accuracy']:.2f}), order consistency "
                             + ("n/a" if cons is None else f"{cons:.2f}") + f" on {chk['n_pairs']} pairs x 2 orders")
        lines.append(f"- **{t}**: " + ", ".join(parts))
    return "\n".join(lines) + "\n" if lines else ""
