"""AlpacaEval (instruction following): win rate against a reference through ``alpaca_eval`` with a
local pairwise judge, every pair judged in both orders. See ``README.md`` in this folder.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from darts_bench.api import EvalContext, Example, Task, TaskResult, TextModel, register_task, truncated_rate
from darts_bench.scoring.failure import failure_columns
from darts_bench.data import DataError, alpaca_text, load_expert_records, read_json_list, require_file
from darts_bench.evaluate.nll import reference_nll_detail

from .config import DEFAULT_EXPERT, AlpacaEvalConfig, JudgeConfig  # noqa: F401 - public: tasks.alpacaeval config section
from .annotators import annotate_named, check_annotator
from .judge_check import run_judge_check
from .judge import (ANNOTATOR_DIR, alpaca_eval_version, judge_consistency, judge_pairs, load_annotator_config,
                    win_rate)
from .protocols import PROTOCOLS, format_instruction, protocol_meta, protocol_stop
from .setups import SETUPS, annotator_model_note

# The evaluation set and the reference (baseline) outputs, in the data dir (shared/data layout).
EVAL_SET = "gpt4_turbo"
REFERENCE_FILES = {
    "gpt4_turbo": "alpaca_eval/gpt4_1106_preview_model_outputs.json",  # AlpacaEval 2.0 baseline
    "text_davinci_003": "alpaca_eval/text_davinci_003_model_outputs.json",  # AlpacaEval 1.0 baseline
}
# Without a data dir: the same sets on the hub (datasets config, file in the dataset repo).
HUB_REPO = "tatsu-lab/alpaca_eval"
HUB_SETS = {
    "gpt4_turbo": ("alpaca_eval_gpt4_baseline", "alpaca_eval_gpt4_baseline.json"),
    "text_davinci_003": ("alpaca_eval", "alpaca_eval.json"),
}
FIELDS = ("instruction", "output", "dataset", "generator")
OFFICIAL_SIZE = 805
FLAG_UNINFORMATIVE = "uninformative_judge"
#: The win rate's flag when the local judge failed its known-answer check (judge_check.py): the
#: ``alpacaeval_win_rate`` cell is then empty (not a number), the judge's own number kept in
#: ``alpacaeval_win_rate_unchecked``, and ``alpacaeval_judge_passed`` is False (claims leave it out).
FLAG_FAILED_CHECK = "uninformative"
FLAG_UNPARSED = "unparsed_verdicts"


def _validate(records: list[Any], source: str) -> list[dict[str, Any]]:
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise DataError(f"{source}: record {i}: expected an object")
        missing = [k for k in FIELDS if k not in rec]
        if missing:
            raise DataError(f"{source}: record {i}: missing field(s) {missing}")
        if not isinstance(rec["instruction"], str) or not rec["instruction"].strip():
            raise DataError(f"{source}: record {i}: 'instruction' must be a non-empty string")
        if not isinstance(rec["output"], str):
            raise DataError(f"{source}: record {i}: 'output' must be a string")
    if not records:
        raise DataError(f"{source}: no records")
    return records


def _load_hub(which: str) -> tuple[list[dict[str, Any]], str]:
    config, filename = HUB_SETS[which]
    try:
        import datasets

        ds = datasets.load_dataset(HUB_REPO, config, split="eval")
        return _validate([dict(r) for r in ds], f"hub {HUB_REPO}/{config}"), f"hub:{HUB_REPO}/{config}"
    except DataError:
        raise
    except Exception as e1:  # noqa: BLE001 - script datasets are unsupported by recent `datasets`; try the file
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(HUB_REPO, filename, repo_type="dataset")
            return _validate(read_json_list(Path(path), FIELDS), path), f"hub:{HUB_REPO}/{filename}"
        except DataError:
            raise
        except Exception as e2:  # noqa: BLE001
            raise DataError(f"no data dir given (--data-dir / DARTS_BENCH_DATA) and the hub copy of AlpacaEval "
                            f"({HUB_REPO}, {config}) could not be loaded: {type(e1).__name__}: {e1}; "
                            f"{type(e2).__name__}: {e2}") from None


def load_reference_set(data_dir: Path | None, which: str) -> tuple[list[dict[str, Any]], str]:
    """Records (instruction, output, dataset, generator) of a reference set, and where they came from.

    ``which``: ``gpt4_turbo`` (AlpacaEval 2.0 baseline, also the evaluation set) or
    ``text_davinci_003`` (1.0 baseline). From ``data_dir`` when given, else the hub.

    Raises:
        DataError: missing or malformed file (naming it and the record), or no hub access.
        ValueError: unknown ``which``.
    """
    if which not in REFERENCE_FILES:
        raise ValueError(f"unknown AlpacaEval reference set {which!r}; known: {sorted(REFERENCE_FILES)}")
    if data_dir is None:
        return _load_hub(which)
    path = require_file(data_dir, REFERENCE_FILES[which])
    return _validate(read_json_list(path, FIELDS), str(path)), str(path)


def check_alignment(examples: list[Example], ref_records: list[dict[str, Any]], source: str) -> None:
    """Check that a reference set holds the evaluation set's instructions one to one: the same number
    of records as the evaluation set, and at each example's index the same instruction text.

    Raises:
        ValueError: naming the reference source and the first mismatching index.
    """
    set_size = examples[0].meta.get("set_size") if examples else None
    if set_size is not None and len(ref_records) != set_size:
        raise ValueError(f"AlpacaEval reference set {source} has {len(ref_records)} records but the evaluation set "
                         f"has {set_size}: the two must hold the same instructions in the same order")
    for k, e in enumerate(examples):
        i = e.meta.get("index", k)
        if i >= len(ref_records):
            raise ValueError(f"AlpacaEval reference set {source} has only {len(ref_records)} records; "
                             f"first mismatch at index {i} (example {e.id})")
        ref_instr = ref_records[i]["instruction"]
        if ref_instr != e.meta["instruction"]:
            raise ValueError(f"AlpacaEval reference set {source} does not match the evaluation set: first mismatch "
                             f"at index {i} (example {e.id}): evaluation {e.meta['instruction'][:80]!r} vs "
                             f"reference {ref_instr[:80]!r}")


@register_task
class AlpacaEvalTask(Task):
    """AlpacaEval 805 instructions; win rate against ``tasks.alpacaeval.reference`` judged locally."""

    name = "alpacaeval"
    expert = DEFAULT_EXPERT
    # 4: alpacaeval_truncated_rate (outputs that hit max_new_tokens) in what an evaluation holds;
    # 5: the failure-mode columns (extract, repeat, length; issue 57)
    version = "5"
    protocol = "chat_template"  # tasks.alpacaeval.protocol: get_task(name, config) sets it, examples() and evaluate() read it
    primary_metrics = ("alpacaeval_win_rate",)
    config_model = AlpacaEvalConfig
    per_example_keys = {"alpacaeval_win_rate": "win"}
    metric_scale = {"alpacaeval_win_rate": 100.0}  # per-example wins are 0 / 0.5 / 1, the win rate in %
    extra_columns = ("alpacaeval_unparsed", "alpacaeval_win_rate_kind", "alpacaeval_judge_consistency", "alpacaeval_win_rate_flag",
                     "alpacaeval_truncated_rate", "alpacaeval_extract_rate", "alpacaeval_repeat_rate",
                     "alpacaeval_len_tokens", "alpacaeval_judge_passed", "alpacaeval_judge_check_accuracy",
                     "alpacaeval_judge_check_consistency", "alpacaeval_win_rate_unchecked")
    data_folders = ("alpaca_eval",)
    official_size = OFFICIAL_SIZE
    typical_tokens = {"prompt": 50, "reference": 350}
    # judge instructions around the two outputs: local_judge/basic_prompt.txt is 272 SmolLM2 tokens, the chat
    # template around it ~30
    judge_template_tokens = 300
    verdict_tokens = 4  # "Output (a)" (SmolLM2: Output / ( / a / ))
    order = 3
    annotators_config: Path = ANNOTATOR_DIR  # the alpaca_eval annotator config folder of the local judge

    def report_columns(self, result: TaskResult) -> dict[str, Any]:
        return {"alpacaeval_win_rate_kind": result.meta.get("win_rate_kind")}

    def judge_model(self, config: AlpacaEvalConfig) -> str:
        """The local judge's row name or checkpoint dir: ``judge.model`` when given, else the row of the
        expert this task names (:attr:`expert`, set from ``tasks.alpacaeval.expert``: ``expert:<name>``),
        ``base`` for a task without an expert."""
        if config.judge.model:
            return config.judge.model
        return f"expert:{self.expert}" if self.expert else "base"

    def models_used(self, config: AlpacaEvalConfig) -> list[str]:
        return [self.judge_model(config)]

    def sample_fields(self, example: Example, sample: dict[str, Any]) -> dict[str, Any]:
        """The samples-file view of one instruction (:meth:`Task.sample_fields`): ``doc`` =
        ``instruction``, ``dataset`` and the reference output it was judged against (``target``), the
        model's output (no extraction: ``extracted`` is the output) and the verdict: the debiased
        preference for the model (1 win, 0.5 draw, 0 loss; alpaca_eval's preference minus 1)."""
        return {"doc": {"instruction": sample["instruction"], "dataset": sample.get("dataset"),
                        "reference_output": sample["reference_output"]},
                "target": sample["reference_output"], "prompt": example.prompt, "responses": [sample["output"]],
                "extracted": [sample["output"]], "verdict": [sample["win"]]}

    def plan(self, config: AlpacaEvalConfig, n_examples: int) -> dict[str, Any]:
        """One judge call per example and order (both orders with ``judge.both_orders``; a named
        ``judge.annotator`` judges in alpaca_eval's single pass, outside this process). A call
        reads the judge template (:attr:`judge_template_tokens`), the instruction, the model's
        output (``max_new_tokens``) and the reference output. The local judge in ``score`` mode (the
        annotator config's default) scores both verdicts (:attr:`verdict_tokens` each) after the whole
        prompt, two teacher-forced sequences per call (``scored_tokens_per_row``) that share the prompt
        (``scored_per_prompt``: 2), and every row's prompt for an example starts with the template, the
        instruction and, in the order with the reference first, the reference (``shared_tokens_per_row``: the
        judge's prefix cache forwards them once); in ``generate`` mode,
        and a named annotator, it reads the prompt and writes ``judge.max_new_tokens``."""
        j = config.judge
        named = j.annotator
        calls = n_examples * (2 if j.both_orders and named is None else 1)
        reads = (self.judge_template_tokens + self.typical_tokens["prompt"] + config.max_new_tokens
                 + self.typical_tokens["reference"])
        mode = (load_annotator_config(self.annotators_config)[2].get("completions_kwargs") or {}).get("mode", "score")
        if named is None and mode == "score":
            head = self.judge_template_tokens + self.typical_tokens["prompt"]
            shared = n_examples * (2 * head + self.typical_tokens["reference"] if j.both_orders
                                   else head + self.typical_tokens["reference"])
            tokens = {"prompt_tokens_per_row": 0, "new_tokens_per_row": 0,
                      "scored_tokens_per_row": calls * 2 * (reads + self.verdict_tokens), "scored_per_prompt": 2,
                      "shared_tokens_per_row": shared}
        else:
            tokens = {"prompt_tokens_per_row": calls * reads, "new_tokens_per_row": calls * j.max_new_tokens}
        judge = self.judge_model(config)
        return {"judge": {"label": named or f"local judge {judge}", "model": None if named else judge,
                          **tokens},
                "what": f"AlpacaEval judge {judge}" if named is None else
                        f"AlpacaEval annotator {named} (alpaca_eval, outside this process)"}

    # ------------------------------------------------------------------------------ data
    def examples(self, data_dir: Path | None, model: TextModel | None, limit: int | None) -> list[Example]:
        records, _ = load_reference_set(data_dir, EVAL_SET)
        chosen = records if limit is None else records[:limit]
        return [Example(id=f"alpaca_eval/{i}",
                        prompt=format_instruction(self.protocol, r["instruction"], model),
                        reference=r["output"],
                        meta={"instruction": r["instruction"], "dataset": r["dataset"], "index": i,
                              "set_size": len(records), "protocol": self.protocol})
                for i, r in enumerate(chosen)]

    def preflight(self, cfg: Any) -> None:
        """Checks that need no model, run by the runner before anything is generated: a named
        alpaca_eval annotator must resolve and have its API key / server variable set.

        Raises:
            ValueError: naming the annotator and the environment variable to set.
        """
        if cfg is not None and getattr(cfg.judge, "annotator", None):
            check_annotator(cfg.judge.annotator)

    def training_prompts(self, data_dir: Path | None, model: TextModel | None, n: int, seed: int) -> list[str]:
        # the class's expert names the training set; tasks.<name>.expert may pick another pool expert
        records = load_expert_records(data_dir, type(self).expert)
        picked = random.Random(seed).sample(records, min(n, len(records)))
        texts = [alpaca_text(r) for r in picked]
        return [model.format_chat(t) for t in texts] if model is not None else texts

    # ----------------------------------------------------------------------- references
    def reference_outputs(self, examples: list[Example], reference: str, ctx: EvalContext
                          ) -> tuple[list[str], dict[str, Any]]:
        """The reference output per example, checked one to one against the examples.

        ``reference``: ``gpt4_turbo`` | ``text_davinci_003`` | ``model:<row name>`` (that row's
        outputs on the same examples, from ``ctx.get_outputs``).

        Raises:
            ValueError: unknown reference, no ``ctx.get_outputs`` for a model reference, or a
                reference set that does not match the examples (count, order or text).
        """
        if reference.startswith("model:"):
            row = reference[len("model:"):]
            if not row:
                raise ValueError("tasks.alpacaeval.reference 'model:' needs a row name, e.g. model:expert:instruction")
            if ctx.get_outputs is None:
                raise ValueError(f"reference {reference!r} needs the runner's get_outputs (outputs of row {row!r})")
            outs = list(ctx.get_outputs(row))
            if len(outs) != len(examples):
                raise ValueError(f"AlpacaEval reference {reference!r} has {len(outs)} outputs for {len(examples)} "
                                 f"examples: they must be that row's outputs on the same examples, in order")
            bad = next((k for k, o in enumerate(outs) if not isinstance(o, str)), None)
            if bad is not None:
                raise ValueError(f"AlpacaEval reference {reference!r}: output {bad} is not a string")
            return outs, {"reference_source": f"row:{row}", "reference_generator": row}
        if reference not in REFERENCE_FILES:
            raise ValueError(f"unknown tasks.alpacaeval.reference {reference!r}; use one of "
                             f"{sorted(REFERENCE_FILES)} or model:<row name>")
        records, source = load_reference_set(ctx.data_dir, reference)
        check_alignment(examples, records, source)
        picked = [records[e.meta.get("index", k)] for k, e in enumerate(examples)]
        return [r["output"] for r in picked], {"reference_source": source,
                                               "reference_generator": picked[0]["generator"]}

    # ------------------------------------------------------------------------ evaluate
    def evaluate(self, model: TextModel, examples: list[Example], ctx: EvalContext) -> TaskResult:
        cfg = ctx.config
        jcfg = cfg.judge
        if not examples:
            raise ValueError("alpacaeval: no examples")
        n = len(examples)
        protocol = self.check_protocol(examples)
        instructions = [e.meta["instruction"] for e in examples]
        # 1. references and the judge first: a misaligned set or a missing key fails before any generation
        refs, ref_meta = self.reference_outputs(examples, cfg.reference, ctx)
        named = getattr(jcfg, "annotator", None)
        named_meta = check_annotator(named) if named else None
        cfg_path, annotator_name, ann_cfg = load_annotator_config(self.annotators_config)
        if named is None and ctx.get_model is None:
            raise ValueError("alpacaeval needs ctx.get_model to load the judge "
                             f"(tasks.alpacaeval.judge.model={self.judge_model(cfg)!r})")

        # 1b. a local judge scores the known-answer set first (issue 57; cached, shared by the run's rows)
        check = None
        check_note = None
        if named is None and jcfg.check_pairs > 0:
            if n < 2:
                check_note = "fewer than 2 references: no known-answer check"
            else:
                has_key = getattr(ctx, "model_key", None) is not None
                check = run_judge_check(
                    None if has_key else ctx.get_model(self.judge_model(cfg)), instructions, refs,
                    load_judge=lambda: ctx.get_model(self.judge_model(cfg)), n_pairs=jcfg.check_pairs,
                    min_accuracy=jcfg.check_min_accuracy, seed=ctx.seed, max_new_tokens=jcfg.max_new_tokens,
                    annotators_config=cfg_path, cache_root=getattr(ctx, "shared_dir", None),
                    judge_key=ctx.model_key(self.judge_model(cfg)) if getattr(ctx, "model_key", None) else None)

        # 2. the model's outputs (greedy)
        stop = protocol_stop(protocol)
        gens = model.generate([e.prompt for e in examples], max_new_tokens=cfg.max_new_tokens, stop=stop,
                              temperature=0.0)
        outputs = [g[0].strip() for g in gens]

        # 3. judge: reference as output_1 / model as output_2 ("ab"), and swapped ("ba")
        both_orders = jcfg.both_orders and named is None  # a named annotator: alpaca_eval's own single pass
        judge = ctx.get_model(self.judge_model(cfg)) if named is None else None
        pairs = [(i, r, o) for i, r, o in zip(instructions, refs, outputs)]
        if both_orders:
            pairs += [(i, o, r) for i, r, o in zip(instructions, refs, outputs)]
        if named is None:
            judged = judge_pairs(judge, pairs, max_new_tokens=jcfg.max_new_tokens,
                                 annotators_config=cfg_path, seed=ctx.seed)
        else:
            judged = annotate_named(named, pairs, seed=ctx.seed)
        v_ab, raw_ab = [v for v, _ in judged[:n]], [c for _, c in judged[:n]]
        if both_orders:
            v_ba, raw_ba = [v for v, _ in judged[n:]], [c for _, c in judged[n:]]
            _, prefs = judge_consistency(v_ab, v_ba)
            # identical outputs get a draw from alpaca_eval without asking the judge: not a test of it
            asked = [k for k in range(n) if refs[k] != outputs[k]]
            consistency, _ = judge_consistency([v_ab[k] for k in asked], [v_ba[k] for k in asked])
        else:
            v_ba, raw_ba = [None] * n, [None] * n
            # alpaca_eval's 0 is a draw; a missing verdict stays missing (dropped from the win rate)
            prefs = [None if v is None else 1.5 if v == 0.0 else v for v in v_ab]
            asked = [k for k in range(n) if refs[k] != outputs[k]]
            consistency = None
        n_no_verdict = sum(v is None for v in v_ab) + (sum(v is None for v in v_ba) if both_orders else 0)
        # unparsable answers among the pairs the judge was actually asked about (identical outputs are not)
        n_asked = len(asked) * (2 if both_orders else 1)
        unparsed_share = n_no_verdict / n_asked if n_asked else 0.0

        n_dropped = sum(p is None for p in prefs)  # pairs without a verdict: out of the win rate, as in alpaca_eval
        wr = win_rate(prefs) or {}  # {} when no pair has a verdict: no win rate (None), flagged below
        wr_second = win_rate(v_ab)  # model as output_2 only
        wr_first = win_rate([3.0 - v for v in v_ba if v is not None]) if both_orders else None
        flag = FLAG_UNINFORMATIVE if consistency is not None and consistency < jcfg.min_consistency else None
        if unparsed_share > getattr(jcfg, "max_unparsed", 0.5):
            flag = FLAG_UNPARSED  # most verdicts are draws by default, not by judgement

        # 4. length-controlled win rate (alpaca_eval's function) wherever its inputs are available
        lc, lc_se, lc_note = None, None, length_controlled_unavailable(cfg.reference, examples, prefs)
        if lc_note is None:
            try:
                lc, lc_se = length_controlled_win_rate(
                    instructions, refs, outputs, prefs, [e.meta["index"] for e in examples],
                    model_name=getattr(model, "name", "model"),
                    annotator=annotator_name if named is None else named_meta["annotator"])
            except Exception as e:  # noqa: BLE001 - the GLM fit or the hub download failed: say so
                lc_note = f"alpaca_eval's get_length_controlled_winrate failed: {type(e).__name__}: {str(e)[:300]}"
        kind = "length_controlled" if lc is not None else "raw"

        # 5. reference NLL with the chosen reference outputs (empty references are skipped)
        ex_ref = [replace(e, reference=r) for e, r in zip(examples, refs)]
        scored = [k for k, e in enumerate(ex_ref) if e.reference.strip()]
        ref_nll, per_nll = None, [math.nan] * n
        # per-example NLL sums (nats) and token counts for the token-weighted CI; NaN where skipped
        nll_sum, nll_tokens = [math.nan] * n, [math.nan] * n
        if scored:
            ref = reference_nll_detail(model, [ex_ref[k] for k in scored])
            ref_nll = ref.overall
            for k, v, s, t in zip(scored, ref.per_example, ref.nll_sum, ref.n_tokens):
                per_nll[k], nll_sum[k], nll_tokens[k] = v, s, float(t)

        wins = [math.nan if p is None else p - 1.0 for p in prefs]
        samples = [{"id": e.id, "instruction": instructions[k], "dataset": e.meta.get("dataset"),
                    "output": outputs[k], "reference_output": refs[k],
                    "verdict_model_second": v_ab[k], "verdict_model_first": v_ba[k],
                    "judge_completion_model_second": raw_ab[k], "judge_completion_model_first": raw_ba[k],
                    "preference": prefs[k], "win": wins[k],
                    "finish_reason": getattr(gens[k][0], "finish_reason", None)}
                   for k, e in enumerate(examples)]
        template = cfg_path.parent.parent / ann_cfg["prompt_template"]
        judge_passed = None if check is None else bool(check["passed"])
        headline = lc if lc is not None else wr.get("win_rate")
        if judge_passed is False and flag != FLAG_UNPARSED:  # unparsable verdicts keep their more specific flag
            flag = FLAG_FAILED_CHECK
        metrics: dict[str, Any] = {
            # a judge that failed its known-answer check gives no win rate (None, flagged "uninformative")
            "alpacaeval_win_rate": None if judge_passed is False else headline,
            "alpacaeval_win_rate_unchecked": headline if judge_passed is False else None,
            "alpacaeval_judge_passed": judge_passed,
            "alpacaeval_judge_check_accuracy": None if check is None else check["accuracy"],
            "alpacaeval_judge_check_consistency": None if check is None else check["order_consistency"],
            "alpacaeval_win_rate_raw": wr.get("win_rate"),
            "alpacaeval_judge_consistency": consistency,
            "alpacaeval_win_rate_flag": flag,
            "alpacaeval_unparsed": n_no_verdict,
            "alpacaeval_n_scored": n - n_dropped,
            "alpacaeval_ref_nll": ref_nll,
            "alpacaeval_truncated_rate": truncated_rate(gens),  # None: the model gives no finish reasons
            "n_alpacaeval": n,
        }
        meta = {
            "win_rate_kind": kind,
            "length_controlled_note": lc_note,  # why there is no length-controlled win rate (None: there is)
            "length_controlled_win_rate": lc, "length_controlled_standard_error": lc_se,
            "length_controlled_n_of_official": n if lc is not None else None,
            "setup": cfg.setup, "setup_source": SETUPS[cfg.setup]["source"] if cfg.setup else None,
            "setup_departures": cfg.setup_departures(),
            "reference": cfg.reference, **ref_meta,
            **protocol_meta(protocol), "example_prompt": examples[0].prompt,
            "judge": self.judge_model(cfg) if named is None else f"alpaca_eval:{named}",
            "judge_name": getattr(judge, "name", None) if named is None else named_meta["annotator_model"],
            "judge_model_note": None if named is None else annotator_model_note(named_meta["annotator_model"]),
            "judge_mode": (ann_cfg.get("completions_kwargs") or {}).get("mode", "score") if named is None
            else named_meta["annotator_decoder"],
            "judge_both_orders": both_orders, "judge_max_new_tokens": jcfg.max_new_tokens,
            "n_unparsed": n_no_verdict, "unparsed_share": unparsed_share, "max_unparsed": getattr(jcfg, "max_unparsed", 0.5),
            "judge_consistency": consistency, "min_consistency": jcfg.min_consistency, "judge_flag": flag,
            "judge_check": check, "judge_check_note": check_note, "judge_passed": judge_passed,
            "annotator": annotator_name if named is None else named_meta["annotator"],
            "annotators_config": str(cfg_path) if named is None else named_meta["annotator_config"],
            "prompt_template_sha256": hashlib.sha256(template.read_bytes()).hexdigest() if named is None
            else named_meta["annotator_config_sha256"],
            "alpaca_eval_version": alpaca_eval_version(),
            "n_judged_pairs": len(asked), "n_identical_outputs": n - len(asked), "n_no_verdict": n_no_verdict,
            "n_dropped_no_verdict": n_dropped, "n_scored": n - n_dropped,
            "win_rate_standard_error": wr.get("standard_error"),
            "n_wins": wr.get("n_wins"), "n_wins_reference": wr.get("n_wins_base"), "n_draws": wr.get("n_draws"),
            "win_rate_model_second": wr_second["win_rate"] if wr_second else None,
            "win_rate_model_first": wr_first["win_rate"] if wr_first else None,
            "max_new_tokens": cfg.max_new_tokens,
            "ref_nll_n_skipped_empty": n - len(scored),
            "comparable_to_leaderboard": False,
        }
        per_example = {"win": wins, "ref_nll": per_nll, "ref_nll_sum": nll_sum, "ref_nll_tokens": nll_tokens}
        if judge_passed is False:  # no interval either: the wins are kept apart, unread by the report
            per_example["win"], per_example["win_unchecked"] = [math.nan] * n, wins
        if metrics["alpacaeval_truncated_rate"] is not None:
            per_example["truncated"] = [float(g[0].truncated) for g in gens]
        # issue 57: extract = a non-empty reply; loops and length from the raw generations
        fm, fper = failure_columns(self.name, gens, [float(bool(o)) for o in outputs])
        metrics.update(fm)
        per_example.update(fper)
        return TaskResult(metrics=metrics, per_example=per_example, samples=samples, meta=meta)


LC_BASELINE = "gpt4_1106_preview"  # the generator of the gpt4_turbo reference; df_gamed.csv's baseline
LC_HUB_REPO, LC_HUB_FILE = "tatsu-lab/alpaca_eval", "df_gamed.csv"  # what alpaca_eval's GLM downloads


def _df_gamed_reachable() -> str | None:
    """``None`` when alpaca_eval's ``hf_hub_download`` of ``df_gamed.csv`` can succeed (the file is in the
    hub cache alpaca_eval uses, or the hub may be asked), else why not."""
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import try_to_load_from_cache

    from .judge import _import_alpaca_eval

    _import_alpaca_eval()
    from alpaca_eval import constants as ae_constants

    cached = try_to_load_from_cache(LC_HUB_REPO, LC_HUB_FILE, cache_dir=ae_constants.DEFAULT_CACHE_DIR,
                                    repo_type="dataset")
    if isinstance(cached, str):
        return None
    if hub_constants.HF_HUB_OFFLINE:
        return (f"{LC_HUB_FILE} (dataset {LC_HUB_REPO} on the Hugging Face hub, the GLM's instruction difficulties "
                f"and gamed baselines) is not in the hub cache and HF_HUB_OFFLINE is set; fetch it once with "
                f"`huggingface-cli download {LC_HUB_REPO} {LC_HUB_FILE} --repo-type dataset`")
    return None


def length_controlled_unavailable(reference: str, examples: list[Example], prefs: list[float | None]) -> str | None:
    """Why alpaca_eval's length-controlled win rate cannot be computed for this run, or ``None`` when
    its inputs are all there: the ``gpt4_turbo`` reference (``df_gamed.csv`` holds annotations
    against ``gpt4_1106_preview``, the baseline its GLM regularises towards), every example at its
    index of the official 805 (the GLM's instruction difficulty is looked up by that index), at least
    one preference, and ``df_gamed.csv`` reachable (:func:`_df_gamed_reachable`)."""
    if reference != "gpt4_turbo":
        return (f"reference {reference!r}: alpaca_eval's length-controlled GLM is fitted against the gpt4_turbo "
                f"reference ({LC_BASELINE}) only")
    idx = [e.meta.get("index") for e in examples]
    if any(not isinstance(i, int) or not 0 <= i < OFFICIAL_SIZE for i in idx) or \
            any(e.meta.get("set_size") != OFFICIAL_SIZE for e in examples[:1]):
        return "examples are not indexed into the official 805-instruction set (instruction difficulty unknown)"
    if all(p is None for p in prefs):
        return "no pair has a verdict"
    return _df_gamed_reachable()


def length_controlled_win_rate(instructions: list[str], refs: list[str], outputs: list[str],
                               prefs: list[float | None], indices: list[int], *, model_name: str,
                               annotator: str) -> tuple[float, float]:
    """alpaca_eval's ``metrics.get_length_controlled_winrate`` (GLM ``length_controlled_v1``) on the
    run's annotations, the frame alpaca_eval's ``evaluate`` hands it: one row per example with
    ``instruction``, ``output_1`` (reference), ``output_2`` (model), ``preference`` (1..2, 0 / 1.5 a
    draw, NaN for a pair without a verdict, which the GLM leaves out of its fit and alpaca_eval still
    averages over), ``generator_1`` = ``gpt4_1106_preview``, ``generator_2``, ``annotator``, indexed by
    the example's position in the official 805 (alpaca_eval's GLM reads that index for the instruction
    difficulty). Weights are not saved.

    Returns:
        ``(length-controlled win rate, its standard error)``, in percent.
    Raises:
        ValueError: lengths differ, or alpaca_eval returns NaN. Whatever alpaca_eval raises (offline:
        the ``df_gamed.csv`` download).
    """
    import pandas as pd

    from .judge import _import_alpaca_eval

    if not len(instructions) == len(refs) == len(outputs) == len(prefs) == len(indices):
        raise ValueError("length_controlled_win_rate: instructions, refs, outputs, prefs and indices differ in length")
    _, metrics = _import_alpaca_eval()
    df = pd.DataFrame({"instruction": instructions, "output_1": refs, "output_2": outputs,
                       "preference": [math.nan if p is None else float(p) for p in prefs],
                       "generator_1": LC_BASELINE, "generator_2": model_name, "annotator": annotator},
                      index=pd.Index(indices))
    out = metrics.get_length_controlled_winrate(df, save_weights_dir=None, is_add_glm_preference_inplace=False)
    value = float(out["length_controlled_winrate"])
    if math.isnan(value):
        raise ValueError("alpaca_eval's length-controlled win rate is NaN")
    return value, float(out["lc_standard_error"])


__all__ = ["AlpacaEvalTask", "judge_consistency", "judge_pairs", "load_reference_set", "check_alignment",
           "win_rate", "REFERENCE_FILES", "length_controlled_win_rate", "length_controlled_unavailable", "SETUPS"]
