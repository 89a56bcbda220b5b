"""Reference NLL: the judge-free, scale-free signal every task reports."""

from __future__ import annotations

from darts_bench.api import Example, TextModel


def reference_nll(model: TextModel, examples: list[Example]) -> tuple[float, list[float]]:
    """Mean per-token NLL (nats/token) of each example's ``reference`` given its ``prompt``.

    Returns:
        ``(overall, per_example)``: ``overall`` = total NLL / total reference tokens;
        ``per_example`` = each example's mean token NLL (for bootstrap CIs).
    Raises:
        ValueError: no examples, or an example with an empty reference.
    """
    if not examples:
        raise ValueError("reference_nll: no examples")
    scores = model.score([e.prompt for e in examples], [e.reference for e in examples])
    total = sum(s.nll for s in scores)
    n = sum(s.n_tokens for s in scores)
    return total / n, [s.nll / s.n_tokens for s in scores]
