"""``tasks.gsm8k`` config section (:attr:`GSM8KTask.config_model`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from darts_bench.api import TaskConfig


class GSM8KConfig(TaskConfig):
    """GSM8K: the prompt and answer-extraction protocol (through lm-eval or a chat template)."""

    protocol: Literal["lm-eval", "alpaca-cot", "chat-cot", "gsm8k-cot-8shot"] = Field(
        "lm-eval", description="prompt + filters protocol (tasks/gsm8k/README.md); num_fewshot applies to "
        "lm-eval only (gsm8k-cot-8shot: its 8 exemplars), apply_chat_template to lm-eval and gsm8k-cot-8shot")
    num_fewshot: int = Field(0, ge=0, description="lm-eval protocol: few-shot examples before each question")
    apply_chat_template: bool = Field(False,
        description="lm-eval / gsm8k-cot-8shot: wrap the prompt in the model's chat template")
    max_new_tokens: int = Field(192, ge=1, description="answer length cap, tokens")
