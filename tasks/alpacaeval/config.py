"""``tasks.alpacaeval`` config section (:attr:`AlpacaEvalTask.config_model`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from darts_bench.api import TaskConfig


class JudgeConfig(BaseModel):
    """AlpacaEval judge. ``model``: ``expert:instruction``, ``base``, or a checkpoint dir."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "expert:instruction"
    annotator: str | None = Field(
        None, description="an alpaca_eval annotator config name or path (e.g. weighted_alpaca_eval_gpt4_turbo, "
        "chatgpt_fn) run by alpaca_eval itself instead of the local judge `model`")
    max_unparsed: float = Field(0.5, ge=0, le=1, description="flag the win rate when more than this share of "
                                "judge answers cannot be parsed")
    max_new_tokens: int = Field(8, ge=1)
    both_orders: bool = True
    min_consistency: float = Field(0.6, ge=0, le=1)


class AlpacaEvalConfig(TaskConfig):
    protocol: Literal["chat_template", "vicuna", "alpaca"] = Field(
        "chat_template", description="how the instruction is formatted (tasks/alpacaeval/README.md)")
    reference: str = Field("gpt4_turbo", description="gpt4_turbo | text_davinci_003 | model:<row name>")
    max_new_tokens: int = Field(128, ge=1)
    judge: JudgeConfig = JudgeConfig()
