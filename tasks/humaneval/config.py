"""``tasks.humaneval`` config section (:attr:`HumanEvalTask.config_model`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from darts_bench.api import TaskConfig

from .protocols import PROTOCOL_SAMPLING


class HumanEvalConfig(TaskConfig):
    """HumanEval: the prompt protocol, sampling and the sandbox limits of the completions."""

    protocol: Literal["codex", "instruct", "chat", "mergebench"] = Field(
        "codex", description="prompt + extraction protocol (tasks/humaneval/README.md); `stop` applies to codex only; "
        "mergebench also sets n_samples, temperature, top_p and k where they are not given")
    max_new_tokens: int = Field(128, ge=1, description="completion length cap, tokens")
    n_samples: int = Field(1, ge=1, description="samples per problem; 1 = greedy")
    k: list[int] = Field([1], description="the k of each pass@k reported (each <= n_samples)")
    temperature: float = Field(0.8, gt=0, description="sampling temperature (n_samples > 1)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (Holtzman et al. 2020), n_samples > 1; "
                         "1 = off")
    timeout_s: float = Field(5.0, gt=0, description="sandbox: wall-clock limit per program, seconds")
    memory_mb: int = Field(1024, ge=64, description="sandbox: address-space limit per program, MiB")
    workers: int = Field(2, ge=1, description="sandbox: programs run in parallel")
    stop: list[str] = Field(["\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#"],
        description="codex protocol: generation stops at any of these strings")

    @model_validator(mode="before")
    @classmethod
    def _protocol_sampling(cls, data: Any) -> Any:
        """Fill the protocol's source sampling (``protocols.PROTOCOL_SAMPLING``: ``mergebench``) into
        the keys the section does not give."""
        if isinstance(data, dict) and data.get("protocol") in PROTOCOL_SAMPLING:
            data = {**PROTOCOL_SAMPLING[data["protocol"]], **data}
        return data

    def sampling_departures(self) -> dict[str, dict[str, Any]]:
        """``{key: {"protocol": source value, "config": value}}`` where the section departs from its
        protocol's source sampling (``{}``: it follows it, or the protocol has none)."""
        want = PROTOCOL_SAMPLING.get(self.protocol, {})
        return {k: {"protocol": v, "config": getattr(self, k)} for k, v in want.items() if getattr(self, k) != v}

    @model_validator(mode="after")
    def _k(self) -> "HumanEvalConfig":
        if any(k > self.n_samples for k in self.k):
            raise ValueError(f"tasks.humaneval.k {self.k} exceeds n_samples {self.n_samples}")
        return self
