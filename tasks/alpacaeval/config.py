"""``tasks.alpacaeval`` config section (:attr:`AlpacaEvalTask.config_model`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from darts_bench.api import TaskConfig


class JudgeConfig(BaseModel):
    """AlpacaEval judge. ``model``: ``expert:instruction``, ``base``, or a checkpoint dir."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "expert:instruction"
    max_new_tokens: int = Field(8, ge=1)
    both_orders: bool = True
    min_consistency: float = Field(0.6, ge=0, le=1)


class AlpacaEvalConfig(TaskConfig):
    reference: str = Field("gpt4_turbo", description="gpt4_turbo | text_davinci_003 | model:<row name>")
    max_new_tokens: int = Field(128, ge=1)
    judge: JudgeConfig = JudgeConfig()
