"""Reference NLL: the judge-free, scale-free signal every task reports."""

from __future__ import annotations

from dataclasses import dataclass

from darts_bench.api import Example, TextModel


@dataclass(frozen=True)
class ReferenceNLL:
    """Reference NLL of a list of examples, in example order.

    ``overall``: total NLL / total reference tokens (nats/token, the reported value);
    ``per_example``: each example's mean token NLL (nats/token);
    ``nll_sum``: each example's summed NLL (nats); ``n_tokens``: each example's reference tokens.
    ``sum(nll_sum) / sum(n_tokens) == overall``: the ratio bootstrap of
    :func:`darts_bench.report.stats.ratio_ci` resamples (``nll_sum``, ``n_tokens``) pairs.
    """

    overall: float
    per_example: list[float]
    nll_sum: list[float]
    n_tokens: list[int]


def reference_nll_detail(model: TextModel, examples: list[Example]) -> ReferenceNLL:
    """Per-token NLL of each example's ``reference`` given its ``prompt`` (``model.score``), with the
    per-example sums and token counts a token-weighted interval needs.

    Raises:
        ValueError: no examples, or an example whose reference scored zero tokens.
    """
    if not examples:
        raise ValueError("reference_nll: no examples")
    scores = model.score([e.prompt for e in examples], [e.reference for e in examples])
    for e, s in zip(examples, scores):
        if s.n_tokens < 1:
            raise ValueError(f"reference_nll: example {e.id!r} has an empty reference (0 tokens)")
    total = sum(s.nll for s in scores)
    n = sum(s.n_tokens for s in scores)
    return ReferenceNLL(total / n, [s.nll / s.n_tokens for s in scores], [float(s.nll) for s in scores],
                        [int(s.n_tokens) for s in scores])


def reference_nll(model: TextModel, examples: list[Example]) -> tuple[float, list[float]]:
    """Mean per-token NLL (nats/token) of each example's ``reference`` given its ``prompt``.

    Returns:
        ``(overall, per_example)``: ``overall`` = total NLL / total reference tokens;
        ``per_example`` = each example's mean token NLL. Use :func:`reference_nll_detail` for the
        per-example sums and token counts (the token-weighted CI needs them).
    Raises:
        ValueError: no examples, or an example with an empty reference.
    """
    r = reference_nll_detail(model, examples)
    return r.overall, r.per_example
