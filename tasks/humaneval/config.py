"""``tasks.humaneval`` config section (:attr:`HumanEvalTask.config_model`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from darts_bench.api import TaskConfig


class HumanEvalConfig(TaskConfig):
    protocol: Literal["codex", "instruct", "chat"] = Field(
        "codex", description="prompt + extraction protocol (tasks/humaneval/README.md); `stop` applies to codex only")
    max_new_tokens: int = Field(128, ge=1)
    n_samples: int = Field(1, ge=1, description="samples per problem; 1 = greedy")
    k: list[int] = [1]
    temperature: float = Field(0.8, gt=0)
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(1024, ge=64)
    workers: int = Field(2, ge=1)
    stop: list[str] = ["\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#"]

    @model_validator(mode="after")
    def _k(self) -> "HumanEvalConfig":
        if any(k > self.n_samples for k in self.k):
            raise ValueError(f"tasks.humaneval.k {self.k} exceeds n_samples {self.n_samples}")
        return self
