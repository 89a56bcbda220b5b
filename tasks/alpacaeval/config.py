"""``tasks.alpacaeval`` config section (:attr:`AlpacaEvalTask.config_model`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from darts_bench.api import TaskConfig

from .setups import SETUPS


#: the pool expert AlpacaEval's heads (and by default its judge) take (``AlpacaEvalTask.expert``)
DEFAULT_EXPERT = "instruction"


class JudgeConfig(BaseModel):
    """AlpacaEval judge. ``model``: a row name (``expert:<name>``, ``base``, a merge ...) or a checkpoint
    dir; unset: the expert the task names (``tasks.alpacaeval.expert``, default ``instruction``:
    ``expert:instruction``; ``base`` when the task has no expert)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None, description="the local judge: a row name (expert:<name>, base, a merge) or a checkpoint dir; unset: "
        "expert:<the task's expert> (tasks.alpacaeval.expert, default instruction), base when it has none")

    annotator: str | None = Field(
        None, description="an alpaca_eval annotator config name or path (e.g. weighted_alpaca_eval_gpt4_turbo, "
        "chatgpt_fn) run by alpaca_eval itself instead of the local judge `model`")
    max_unparsed: float = Field(0.5, ge=0, le=1, description="flag the win rate when more than this share of "
                                "judge answers cannot be parsed")
    max_new_tokens: int = Field(8, ge=1, description="judge answer length cap, tokens")
    both_orders: bool = Field(True,
        description="judge each pair in both orders (model output first and second) and count the consistent verdicts")
    min_consistency: float = Field(0.6, ge=0, le=1,
        description="flag the win rate as uninformative_judge when fewer than this share of pairs get the same "
        "verdict in both orders")
    check_pairs: int = Field(16, ge=0, description="known-answer pairs (a reference against a damaged copy of "
                             "itself, judged in both orders) a local judge must score before its win rate counts "
                             "(tasks/alpacaeval/judge_check.py); 0: no check")
    check_min_accuracy: float = Field(0.75, ge=0, le=1, description="the check's pass mark: the share of its "
                                      "verdicts that prefer the intact reference (a position-only judge scores 0.5)")


class AlpacaEvalConfig(TaskConfig):
    """AlpacaEval: the instruction format, the reference outputs and the judge."""

    setup: Literal["dare", "della", "alpaca_eval_2"] | None = Field(
        None, description="a paper's AlpacaEval set-up by name (tasks/alpacaeval/README.md, setups.py): fills "
        "protocol, reference, max_new_tokens and judge.annotator where they are not given; a value given "
        "explicitly wins and is recorded as a departure from the set-up")
    protocol: Literal["chat_template", "vicuna", "alpaca", "della"] = Field(
        "chat_template", description="how the instruction is formatted (tasks/alpacaeval/README.md)")
    reference: str = Field("gpt4_turbo", description="gpt4_turbo | text_davinci_003 | model:<row name>")
    max_new_tokens: int = Field(128, ge=1, description="output length cap, tokens")
    judge: JudgeConfig = Field(JudgeConfig(), description="the judge that compares each output with the reference")

    @model_validator(mode="before")
    @classmethod
    def _default_judge(cls, data: Any) -> Any:
        """An unset ``judge.model`` is the row of the section's expert (``expert:<expert>``; the task's
        :data:`DEFAULT_EXPERT` when ``expert`` is not given; ``base`` for ``expert: null``), so a pool with
        other expert names needs no judge setting and the default dumps (and keys) as ``expert:instruction``."""
        if not isinstance(data, dict):
            return data
        judge = data.get("judge", {})
        if isinstance(judge, BaseModel):
            judge = judge.model_dump(exclude_unset=True)
        if not isinstance(judge, dict) or judge.get("model") is not None:
            return data
        expert = data.get("expert", DEFAULT_EXPERT)
        return {**data, "judge": {**judge, "model": f"expert:{expert}" if expert else "base"}}

    @model_validator(mode="before")
    @classmethod
    def _apply_setup(cls, data: Any) -> Any:
        """Fill the named set-up's values into the keys the section does not give (nested
        ``judge.annotator`` too). Raises ``ValueError`` for an unknown set-up name (via the Literal)."""
        if not isinstance(data, dict) or data.get("setup") not in SETUPS:
            return data
        s = SETUPS[data["setup"]]
        out = dict(data)
        for key in ("protocol", "reference", "max_new_tokens"):
            out.setdefault(key, s[key])
        judge = out.get("judge", {})
        if isinstance(judge, BaseModel):
            judge = judge.model_dump(exclude_unset=True)
        if isinstance(judge, dict):
            out["judge"] = {"annotator": s["annotator"], **judge}
        return out

    def setup_departures(self) -> dict[str, dict[str, Any]]:
        """``{field: {"setup": value, "config": value}}`` for each value of :attr:`setup` this section
        does not follow (given explicitly); ``{}`` when it follows it or names no set-up."""
        if self.setup is None:
            return {}
        s = SETUPS[self.setup]
        have = {"protocol": self.protocol, "reference": self.reference, "max_new_tokens": self.max_new_tokens,
                "judge.annotator": self.judge.annotator}
        want = {"protocol": s["protocol"], "reference": s["reference"], "max_new_tokens": s["max_new_tokens"],
                "judge.annotator": s["annotator"]}
        return {k: {"setup": want[k], "config": have[k]} for k in want if have[k] != want[k]}
