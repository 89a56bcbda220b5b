"""AlpacaEval with one of alpaca_eval's own annotators, by config name (``tasks.alpacaeval.judge.annotator``).

Any folder of ``alpaca_eval/evaluators_configs`` (e.g. ``weighted_alpaca_eval_gpt4_turbo``,
``alpaca_eval_gpt4``, ``chatgpt_fn``, ``alpaca_eval_vllm_llama3_70b_fn``) or a path to a
``configs.yaml`` runs through ``alpaca_eval.annotators.PairwiseAnnotator`` exactly as alpaca_eval
configures it (its prompt, decoder, parser, output-order randomisation), with the reference as
``output_1`` and the model as ``output_2`` (alpaca_eval's convention), no cache.

:func:`check_annotator` runs before any generation: it resolves the config and fails with a
message naming the environment variable to set when the annotator's decoder needs an API key (or a
server: ``OPENAI_API_BASE`` points the OpenAI decoder at an OpenAI-compatible server such as
``vllm serve``) that is not there. alpaca_eval reads these variables when it is imported, so set
them before starting darts-bench.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

import yaml

__all__ = ["resolve_annotator", "check_annotator", "annotate_named", "DECODER_ENV"]

#: alpaca_eval decoder -> (env vars of which one must be set, what to tell the user)
DECODER_ENV: dict[str, tuple[tuple[str, ...], str]] = {
    "openai_completions": (("OPENAI_API_KEY", "OPENAI_API_KEYS", "OPENAI_CLIENT_CONFIG_PATH"),
                           "set OPENAI_API_KEY (and OPENAI_API_BASE=http://host:port/v1 for an OpenAI-compatible "
                           "server such as `vllm serve`), or OPENAI_CLIENT_CONFIG_PATH to an alpaca_eval client config"),
    "anthropic_completions": (("ANTHROPIC_API_KEY",), "set ANTHROPIC_API_KEY"),
    "google_completions": (("GOOGLE_API_KEY",), "set GOOGLE_API_KEY"),
    "cohere_completions": (("COHERE_API_KEY",), "set COHERE_API_KEY"),
    "huggingface_api_completions": (("HUGGINGFACEHUB_API_TOKEN",), "set HUGGINGFACEHUB_API_TOKEN"),
    "replicate_completions": (("REPLICATE_API_TOKEN",), "set REPLICATE_API_TOKEN"),
    "jina_chat_completions": (("JINA_CHAT_API_KEY",), "set JINA_CHAT_API_KEY"),
}
_LOCAL = {"vllm_local_completions": "vllm", "huggingface_local_completions": "transformers"}


def _configs_dir() -> Path:
    from alpaca_eval import constants

    return Path(constants.EVALUATORS_CONFIG_DIR)


def resolve_annotator(name: str) -> tuple[Path, str, dict[str, Any]]:
    """``(configs.yaml, annotator name, its config)`` of an alpaca_eval annotator config name or path.

    Raises:
        ValueError: no such config (the message lists a few known names), or not exactly one annotator.
    """
    p = Path(name)
    path = (p / "configs.yaml" if p.is_dir() else p) if (p.suffix in (".yaml", ".yml") or p.is_dir()) \
        else _configs_dir() / name / "configs.yaml"
    if not path.is_file():
        known = sorted(d.name for d in _configs_dir().iterdir() if (d / "configs.yaml").is_file())
        raise ValueError(f"tasks.alpacaeval.judge.annotator {name!r}: no alpaca_eval annotator config {path}; "
                         f"known names include {known[:12]} ... ({len(known)} in alpaca_eval)")
    configs = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(configs, dict) or len(configs) != 1:
        raise ValueError(f"{path}: expected exactly one annotator, got {list(configs or {})}")
    (ann, cfg), = configs.items()
    return path, ann, cfg


def check_annotator(name: str) -> dict[str, Any]:
    """Resolve ``name`` and check that its decoder can run here, before anything is generated.

    Returns:
        meta for the results: annotator name, config path and sha256, decoder, judge model name.
    Raises:
        ValueError: unknown config; a missing API key / server variable (named in the message); a
            local decoder whose package or model dir is missing.
    """
    path, ann, cfg = resolve_annotator(name)
    decoder = cfg.get("fn_completions", "openai_completions")
    model = (cfg.get("completions_kwargs") or {}).get("model_name")
    if decoder in DECODER_ENV:
        names, how = DECODER_ENV[decoder]
        have = [v for v in names if os.environ.get(v)]
        if decoder == "openai_completions" and have == ["OPENAI_CLIENT_CONFIG_PATH"] and \
                not Path(os.environ["OPENAI_CLIENT_CONFIG_PATH"]).is_file():
            have = []
        if not have:
            raise ValueError(f"AlpacaEval annotator {name!r} ({decoder}, model {model!r}) needs credentials: {how}. "
                             f"None of {list(names)} is set; nothing was generated.")
    elif decoder in _LOCAL:
        pkg = _LOCAL[decoder]
        if importlib.util.find_spec(pkg) is None:
            raise ValueError(f"AlpacaEval annotator {name!r} uses {decoder}, which needs the Python package {pkg!r}")
        if isinstance(model, str) and model.startswith("/") and not Path(model).exists():
            raise ValueError(f"AlpacaEval annotator {name!r}: completions_kwargs.model_name {model!r} does not exist; "
                             f"copy {path.parent} and point model_name at your judge model")
    return {"annotator": ann, "annotator_config": str(path),
            "annotator_config_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "annotator_decoder": decoder, "annotator_model": model}


def annotate_named(name: str, pairs: Sequence[tuple[str, str, str]], *, seed: int = 0) -> list[tuple[float | None, Any]]:
    """Preferences of alpaca_eval's annotator ``name`` on ``(instruction, output_1, output_2)`` pairs.

    Returns:
        per pair, in order: ``(preference, raw completion)``; ``preference`` in [1, 2] (1 = output_1
        wins; weighted annotators give values in between), 0 or 1.5 for a draw, ``None`` when
        alpaca_eval could not parse the annotator's answer.
    """
    if not pairs:
        return []
    import pandas as pd

    from .judge import _import_alpaca_eval

    PairwiseAnnotator, _ = _import_alpaca_eval()
    path, _, _ = resolve_annotator(name)
    root = logging.getLogger()
    level = root.level
    try:
        annotator = PairwiseAnnotator(annotators_config=str(path), caching_path=None, seed=seed)
        df = pd.DataFrame([{"instruction": i, "output_1": a, "output_2": b} for i, a, b in pairs])
        annotated = annotator.annotate_pairs(df)
    finally:
        root.setLevel(level)
    by_key = {(r["instruction"], r["output_1"], r["output_2"]): r for r in annotated}
    out: list[tuple[float | None, Any]] = []
    for key in pairs:
        row = by_key.get(tuple(key), {})
        pref = row.get("preference")
        try:
            ok = pref is not None and not math.isnan(float(pref)) and (float(pref) == 0.0 or 1.0 <= float(pref) <= 2.0)
        except (TypeError, ValueError):
            ok = False
        out.append((float(pref) if ok else None, row.get("preference_raw_completion")))
    return out
