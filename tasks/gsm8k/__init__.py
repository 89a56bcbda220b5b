"""GSM8K (math expert): exact match of the final number, strict (``#### N``) and flexible (last
number), scored by lm-eval through its public API on a local-file task (``gsm8k_local.yaml``).

See README.md in this folder for the protocol and the changelog.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import yaml

from darts_bench.api import Completion, EvalContext, Example, Task, TaskResult, TextModel, register_task
from darts_bench.data import DataError, read_jsonl, require_file, strip_calculator
from darts_bench.scoring import reference_nll_detail, regex_extract, write_samples
from darts_bench.scoring.failure import failure_columns

from .config import GSM8KConfig

from .protocols import LMEVAL_STRICT_COLUMN, PROTOCOLS, get_protocol

#: The task version a run under each protocol reports (results ``task_versions``, cache keys):
#: version 3 changed the strict scoring of ``alpaca-cot`` (MergeLM's) and ``chat-cot`` (last match,
#: ``$``); ``lm-eval`` runs score exactly as in version 2 and keep reporting 2 (README, changelog).
#: ``gsm8k-cot-8shot`` (lm-eval's ``gsm8k_cot``) is new in version 3.
#: Next versions (lm-eval 3, the others 4) add ``gsm8k_truncated_rate`` (answers that hit the token cap).
#: chat-cot 5: its strict filter also reads ``#### N`` (protocol version 3, issue 57).
#: Next (lm-eval 4, alpaca-cot 5, chat-cot 6, gsm8k-cot-8shot 5): the failure-mode columns (issue 57).
TASK_VERSIONS = {"lm-eval": "4", "alpaca-cot": "5", "chat-cot": "6", "gsm8k-cot-8shot": "5"}

TEMPLATE_PATH = Path(__file__).resolve().parent / "gsm8k_local.yaml"
TEMPLATE_TEXT = TEMPLATE_PATH.read_text(encoding="utf-8")
TEMPLATE_SHA256 = hashlib.sha256(TEMPLATE_TEXT.encode("utf-8")).hexdigest()
_TEMPLATE: dict[str, Any] = yaml.safe_load(TEMPLATE_TEXT)
LM_EVAL_TASK = _TEMPLATE["task"]

# The regexes lm-eval applies, read from the YAML so the pure functions below cannot drift from it.
_FILTERS = {f["name"]: f["filter"][0] for f in _TEMPLATE["filter_list"]}
STRICT_PATTERN = re.compile(_FILTERS["strict-match"]["regex_pattern"])
FLEXIBLE_PATTERN = re.compile(_FILTERS["flexible-extract"]["regex_pattern"])
_FLEXIBLE_GROUP = int(_FILTERS["flexible-extract"].get("group_select", 0))
_STRICT_GROUP = int(_FILTERS["strict-match"].get("group_select", 0))
_EM = _TEMPLATE["metric_list"][0]
REGEXES_TO_IGNORE: tuple[str, ...] = tuple(_EM["regexes_to_ignore"])
_IGNORE_CASE = bool(_EM.get("ignore_case", False))
INVALID = "[invalid]"  # lm-eval's RegexFilter fallback

PROMPT = "Question: {question}\nAnswer:"


# ------------------------------------------------------------------------------ pure scoring
def _regex_extract(pattern: re.Pattern[str], group_select: int, text: str) -> str | None:
    """What lm-eval's ``RegexFilter`` returns (``None`` for its ``[invalid]`` fallback):
    :func:`darts_bench.scoring.extract.regex_extract`."""
    return regex_extract(pattern, text, group_select)


def extract_strict(text: str) -> str | None:
    """The number after the first ``#### `` (lm-eval's ``strict-match`` filter), raw (commas kept)."""
    return _regex_extract(STRICT_PATTERN, _STRICT_GROUP, text)


def extract_flexible(text: str) -> str | None:
    """The last number-like token in ``text`` (lm-eval's ``flexible-extract`` filter), raw
    (``$``, commas and a trailing period kept: :func:`normalize_number` removes them)."""
    return _regex_extract(FLEXIBLE_PATTERN, _FLEXIBLE_GROUP, text)


def normalize_number(text: str) -> str:
    """lm-eval's exact-match normalisation for GSM8K: drop ``,`` and ``$``, everything up to
    ``#### ``, a trailing ``.``; lower-case. ``"$3,000."`` -> ``"3000"``; a gold answer -> its number."""
    for pat in REGEXES_TO_IGNORE:
        text = re.sub(pat, "", text)
    return text.lower() if _IGNORE_CASE else text


def is_correct(extracted: str | None, gold_answer: str) -> bool:
    """Exact match as lm-eval scores it (``gold_answer``: the full solution or just the number)."""
    return normalize_number(INVALID if extracted is None else extracted) == normalize_number(gold_answer)


def final_answer(answer: str) -> str:
    """The gold number string of a GSM8K solution (text after the last ``####``)."""
    return answer.split("####")[-1].strip()


def _load_split(data_dir: Path | None, split: str) -> list[dict[str, Any]]:
    """GSM8K records of ``split`` (``test``/``train``): ``<data_dir>/gsm8k/<split>.jsonl``, or the hub's
    ``openai/gsm8k`` (config ``main``) when no data dir is given.

    Raises:
        DataError: a missing or malformed file (naming file and line), or the hub is unreachable.
    """
    if data_dir is not None:
        return read_jsonl(require_file(data_dir, f"gsm8k/{split}.jsonl"), required=("question", "answer"))
    try:
        import datasets

        ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as e:  # offline, no cache ...
        raise DataError(f"no data dir given and the hub dataset openai/gsm8k ({split}) could not be loaded: "
                        f"{type(e).__name__}: {e}. Pass --data-dir or set DARTS_BENCH_DATA.") from None
    return [{"question": r["question"], "answer": r["answer"]} for r in ds]


def score_samples(samples_path: str | Path, data_dir: Path | None = None, protocol: str = "lm-eval") -> dict[str, Any]:
    """Score GSM8K responses made elsewhere (``darts-bench score gsm8k FILE``) with the strict and
    flexible verdicts of ``protocol`` (protocols.py: ``lm-eval`` ``#### N``; ``alpaca-cot``
    MergeLM's ``extract_answer_number`` and numeric comparison, plus lm-eval's first-match
    ``The answer is: N`` as ``gsm8k_em_strict_lmeval`` / ``em_strict_lmeval``; ``chat-cot`` the last
    ``The answer is: N``, ``$`` allowed; flexible: the last number, lm-eval's exact match).

    ``FILE`` is JSON lines with ``response`` and either ``doc_id`` (index into the test split) or
    ``question`` (its exact text).

    Raises:
        DataError: bad JSON or invalid UTF-8, a missing field, a non-string response, a doc_id that
            is not an integer in range, an unknown question, or a test question given twice
            (each naming the file and line).
    """
    path = Path(samples_path)
    proto = get_protocol(protocol)
    test = _load_split(data_dir, "test")
    by_q = {r["question"]: i for i, r in enumerate(test)}
    seen: set[int] = set()  # test indices with a response so far

    def check(r: dict[str, Any]) -> str | None:
        if not isinstance(r["response"], str):
            return f"response must be a string, got {type(r['response']).__name__}"
        if "doc_id" in r:
            i = r["doc_id"]
            if isinstance(i, bool) or not isinstance(i, int):
                return (f"doc_id {i!r} is a {type(i).__name__}; expected an integer index into the GSM8K "
                        f"test split (0..{len(test) - 1})")
            if not 0 <= i < len(test):
                return f"doc_id {i} is not in 0..{len(test) - 1}"
        elif "question" in r:
            if r["question"] not in by_q:
                return "question not found in the GSM8K test split"
            i = by_q[r["question"]]
        else:
            return "needs doc_id or question"
        if i in seen:
            return (f"test question {i} (doc_id {i}) already has a response on an earlier line; each question "
                    "may be scored once")
        seen.add(i)
        r["_index"] = i
        return None

    recs = read_jsonl(path, required=("response",), check=check)
    strict, flexible, ids, no_answer, strict_lmeval = [], [], [], [], []
    for r in recs:
        i = r.pop("_index")
        gold = test[i]["answer"]
        st, ok = proto.score_strict(r["response"], gold)
        strict.append(float(ok))
        strict_lmeval.append(float(proto.is_correct(proto.extract_strict(r["response"]), gold)))
        flexible.append(float(proto.is_correct(proto.extract_flexible(r["response"]), gold)))
        no_answer.append(float(st is None))
        ids.append(i)
    out = {"protocol": proto.name, "gsm8k_em_strict": sum(strict) / len(strict),
           "gsm8k_em_flexible": sum(flexible) / len(flexible), "gsm8k_no_answer_rate": sum(no_answer) / len(no_answer),
           "n_gsm8k": len(strict), "doc_ids": ids, "em_strict": strict, "em_flexible": flexible,
           "no_answer": no_answer}
    if proto.strict_scoring != "lm-eval":
        out[LMEVAL_STRICT_COLUMN] = sum(strict_lmeval) / len(strict_lmeval)
        out["em_strict_lmeval"] = strict_lmeval
    return out


@register_task
class GSM8KTask(Task):
    name = "gsm8k"
    expert = "math"
    primary_metrics = ("gsm8k_em_strict", "gsm8k_em_flexible")
    # no extractable answer under the strict filter; answers that hit max_new_tokens (None: no finish reasons)
    extra_columns = ("gsm8k_no_answer_rate", "gsm8k_truncated_rate", "gsm8k_extract_rate", "gsm8k_repeat_rate",
                     "gsm8k_len_tokens")
    unanswered_rates = {"gsm8k_no_answer_rate": ("gsm8k_em_strict",)}  # table.md marks em_strict at 1.0
    protocol = "lm-eval"  # tasks.gsm8k.protocol: get_task(name, config) sets it, examples() and evaluate() read it
    config_model = GSM8KConfig
    data_folders = ("gsm8k",)
    official_size = 1319  # test split
    typical_tokens = {"prompt": 70, "reference": 110, "per_shot": 180}
    order = 2

    @property
    def version(self) -> str:  # type: ignore[override]
        """The task version of :attr:`protocol` (:data:`TASK_VERSIONS`)."""
        return TASK_VERSIONS[self.protocol]

    def score_samples(self, samples_path: str | Path, config: GSM8KConfig | None = None,
                      data_dir: Path | None = None, protocol: str | None = None) -> dict[str, Any]:
        """``darts-bench score gsm8k FILE [--protocol P]``: :func:`score_samples` under ``protocol``
        (default ``lm-eval``, the samples format's own; the config has no other scoring knobs)."""
        return score_samples(samples_path, data_dir=data_dir, protocol=protocol or type(self).protocol)

    def sample_fields(self, example: Example, sample: dict[str, Any]) -> dict[str, Any]:
        """The samples-file view of one example (:meth:`Task.sample_fields`): lm-eval's ``doc``
        (``question``, ``answer``, and the rendered ``prompt`` under a chat-template protocol: the doc
        :meth:`write_lm_eval_task` gives lm-eval) and ``target`` (the full solution, as lm-eval's
        ``doc_to_target``), the prompt lm-eval sent, the response, the protocol's strict answer (None:
        no answer) and its verdict (True: exact match)."""
        doc = {"question": example.meta["question"], "answer": example.meta["answer"]}
        if get_protocol(self.protocol).uses_chat_template:
            doc["prompt"] = example.meta.get("prompt", example.prompt)
        return {"doc": doc, "target": example.meta["answer"], "prompt": sample["prompt"], "responses": [sample["response"]],
                "extracted": [sample["strict"]], "verdict": [bool(sample["em_strict"])]}

    def score_input(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Results samples as :func:`score_samples` lines: ``question`` (the doc's exact text, found in
        the test split) and the raw ``response`` (:meth:`Task.score_input`)."""
        return [{"question": r["doc"]["question"], "response": r["resps"][0][0]} for r in records]

    def examples(self, data_dir: Path | None, model: TextModel | None, limit: int | None) -> list[Example]:
        """Test questions in file order, the zero-shot prompt of ``self.protocol`` (protocols.py;
        ``lm-eval``: the raw lm-eval format, its chat template, when on, is applied by lm-eval at
        evaluation time; ``chat-cot``: rendered here with ``model``'s chat template, the pool's
        base formatter in a run, so every row gets the same prompt)."""
        proto = get_protocol(self.protocol)
        recs = _load_split(data_dir, "test")
        if limit is not None:
            recs = recs[:limit]
        out = []
        for i, r in enumerate(recs):
            prompt = proto.prompt(r["question"], model)
            out.append(Example(id=f"gsm8k/{i}", prompt=prompt, reference=" " + strip_calculator(r["answer"]),
                               meta={"gold": final_answer(r["answer"]), "question": r["question"],
                                     "answer": r["answer"], "protocol": proto.name, "prompt": prompt}))
        return out

    def training_prompts(self, data_dir: Path | None, model: TextModel | None, n: int, seed: int) -> list[str]:
        """``n`` train-split questions drawn with ``random.Random(seed)``, formatted as :meth:`examples`.

        Raises:
            ValueError: ``n`` larger than the train split.
        """
        recs = _load_split(data_dir, "train")
        if n > len(recs):
            raise ValueError(f"gsm8k: asked for {n} training prompts, the train split has {len(recs)}")
        idx = random.Random(seed).sample(range(len(recs)), n)
        proto = get_protocol(self.protocol)
        return [proto.prompt(recs[i]["question"], model) for i in idx]

    # ------------------------------------------------------------------------------ evaluate
    def write_lm_eval_task(self, examples: list[Example], out_dir: Path, *, data_dir: Path | None,
                           num_fewshot: int, max_new_tokens: int, protocol: str = "lm-eval") -> Path:
        """Write the runtime lm-eval task into ``out_dir``: the docs of ``examples`` (in order) as
        ``test.jsonl``, and ``darts_gsm8k.yaml`` = the template with absolute data paths, the
        few-shot split (``<data_dir>/gsm8k/train.jsonl``, or a copy of the hub's train split) when
        ``num_fewshot > 0``, and ``max_gen_toks``; ``protocol`` picks the template (docs also
        carry each example's rendered ``prompt``, which ``chat-cot`` uses as ``doc_to_text``).
        Returns the YAML path."""
        proto = get_protocol(protocol)
        out_dir.mkdir(parents=True, exist_ok=True)
        test_path = out_dir / "test.jsonl"
        with open(test_path, "w", encoding="utf-8") as f:
            for e in examples:
                if "question" not in e.meta or "answer" not in e.meta:
                    raise ValueError(f"gsm8k: example {e.id} lacks meta question/answer (not from GSM8KTask.examples)")
                doc = {"question": e.meta["question"], "answer": e.meta["answer"]}
                if proto.uses_chat_template:
                    doc["prompt"] = e.meta.get("prompt", e.prompt)
                f.write(json.dumps(doc) + "\n")
        files = {"test": str(test_path.resolve())}
        if proto.lm_eval_include is not None:
            # lm-eval's own task YAML, included as is (lm-eval's loader merges it); only the task
            # name, the data source and the token budget are ours
            cfg = {"include": str(proto.included_path()), **yaml.safe_load((Path(__file__).resolve().parent
                                                                            / proto.yaml_file).read_text("utf-8"))}
            cfg["dataset_kwargs"] = {"data_files": files}
            cfg["num_fewshot"] = num_fewshot
            cfg["generation_kwargs"] = {**proto.config["generation_kwargs"], "max_gen_toks": max_new_tokens}
            yaml_path = out_dir / f"{proto.lm_eval_task}.yaml"
            yaml_path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True), encoding="utf-8")
            return yaml_path
        cfg = json.loads(json.dumps(proto.config))  # deep copy
        if num_fewshot > 0:
            if data_dir is not None:
                train = require_file(data_dir, "gsm8k/train.jsonl").resolve()
            else:
                train = out_dir / "train.jsonl"
                with open(train, "w", encoding="utf-8") as f:
                    for r in _load_split(None, "train"):
                        f.write(json.dumps(r) + "\n")
            files["train"] = str(Path(train).resolve())
            cfg["training_split"] = "train"
            cfg["fewshot_split"] = "train"
        cfg["dataset_kwargs"]["data_files"] = files
        cfg["num_fewshot"] = num_fewshot
        cfg["generation_kwargs"]["max_gen_toks"] = max_new_tokens
        yaml_path = out_dir / f"{proto.lm_eval_task}.yaml"
        yaml_path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True), encoding="utf-8")
        return yaml_path

    def evaluate(self, model: TextModel, examples: list[Example], ctx: EvalContext) -> TaskResult:
        """lm-eval on exactly ``examples`` with the :class:`DartsBenchLM` adapter (greedy), set up as
        ``simple_evaluate`` with ``ctx.seed`` (:func:`~darts_bench.evaluate.lm_eval_adapter.evaluate_task`),
        plus the reference NLL, under ``self.protocol`` (:meth:`Task.check_protocol`: the examples must be
        built under it). ``ctx.config``: a ``GSM8KConfig`` (defaults if None) for the other settings."""
        from lm_eval.tasks import TaskManager

        from darts_bench.evaluate.lm_eval_adapter import DartsBenchLM, evaluate_task

        if not examples:
            raise ValueError("gsm8k.evaluate: no examples")
        cfg = ctx.config if ctx.config is not None else GSM8KConfig()
        proto = get_protocol(self.check_protocol(examples))
        if proto.zero_shot_only and (cfg.num_fewshot or cfg.apply_chat_template):
            raise ValueError(f"gsm8k protocol {proto.name!r} is zero-shot with its own prompt format: "
                             f"tasks.gsm8k.num_fewshot must be 0 and apply_chat_template false "
                             f"(got {cfg.num_fewshot}, {cfg.apply_chat_template})")
        if proto.fixed_fewshot is not None:
            if cfg.num_fewshot not in (0, proto.fixed_fewshot):
                raise ValueError(f"gsm8k protocol {proto.name!r} uses its source's {proto.fixed_fewshot} exemplars: "
                                 f"tasks.gsm8k.num_fewshot must be left at 0 or set to {proto.fixed_fewshot} "
                                 f"(got {cfg.num_fewshot})")
            cfg = cfg.model_copy(update={"num_fewshot": proto.fixed_fewshot})
        task_dir = Path(ctx.work_dir) / "lm_eval_gsm8k"
        self.write_lm_eval_task(examples, task_dir, data_dir=ctx.data_dir, num_fewshot=cfg.num_fewshot,
                                max_new_tokens=cfg.max_new_tokens, protocol=proto.name)
        lm = DartsBenchLM(model, max_gen_toks=cfg.max_new_tokens)
        tm = TaskManager(include_path=str(task_dir), include_defaults=False)
        # simple_evaluate's set-up without its environment report (evaluate_task): the same samples and metrics
        out = evaluate_task(lm, proto.lm_eval_task, tm, limit=len(examples), seed=ctx.seed,
                            apply_chat_template=cfg.apply_chat_template,
                            fewshot_as_multiturn=bool(cfg.apply_chat_template))
        # one lm-eval task per call: its requests' finish reasons by doc id
        res = self._to_result(model, examples, out, cfg, proto,
                              finish={doc: r for (_, doc), r in lm.finish_reasons.items()},
                              lengths={doc: t for (_, doc), t in lm.n_tokens.items()})
        # re-scorable with `darts-bench score gsm8k FILE` (doc_id = index in the test split)
        path = write_samples(ctx.artifact_dir(), self.name,
                             [{"doc_id": int(e.id.split("/")[-1]), "response": s["response"]}
                              for e, s in zip(examples, res.samples)])
        res.meta["samples_file"] = path.name if path else None
        return res

    def _to_result(self, model: TextModel, examples: list[Example], out: dict[str, Any], cfg: Any,
                   proto: Any = None, finish: dict[int, str | None] | None = None,
                   lengths: dict[int, int | None] | None = None) -> TaskResult:
        """lm-eval's output as a :class:`TaskResult`; ``finish``: doc id -> finish reason of its
        generation (``DartsBenchLM.finish_reasons``), for ``gsm8k_truncated_rate`` (None when a doc
        has none: the model returns plain strings); ``lengths``: doc id -> generated tokens
        (``DartsBenchLM.n_tokens``), for ``gsm8k_len_tokens``. ``gsm8k_extract_rate`` is the share of
        responses the protocol's strict filter reads an answer from (1 - ``gsm8k_no_answer_rate``)."""
        proto = proto if proto is not None else get_protocol("lm-eval")
        lm_task = proto.lm_eval_task
        by_filter: dict[str, dict[int, dict[str, Any]]] = {}
        for s in out["samples"][lm_task]:
            by_filter.setdefault(s["filter"], {})[int(s["doc_id"])] = s
        n = len(examples)
        for f in ("strict-match", "flexible-extract"):
            got = sorted(by_filter.get(f, {}))
            if got != list(range(n)):
                raise RuntimeError(f"lm-eval returned samples for docs {got[:10]}... under {f!r}, expected 0..{n - 1}")
        strict = [by_filter["strict-match"][i] for i in range(n)]
        flex = [by_filter["flexible-extract"][i] for i in range(n)]
        em_strict_lmeval = [float(s["exact_match"]) for s in strict]
        # the protocol's own strict verdict on the generated response (lm-eval's filter, or MergeLM's)
        own_scoring = proto.strict_scoring != "lm-eval"
        own = [proto.score_strict(s["resps"][0][0], e.meta["answer"]) for e, s in zip(examples, strict)] \
            if own_scoring else []
        em_strict = [float(ok) for _, ok in own] if own_scoring else em_strict_lmeval
        em_flex = [float(s["exact_match"]) for s in flex]
        ref = reference_nll_detail(model, examples)
        ref_nll, ref_nll_each = ref.overall, ref.per_example
        res = out["results"][lm_task]
        lmeval_strict = [None if s["filtered_resps"][0] == INVALID else s["filtered_resps"][0] for s in strict]
        strict_answer = [a for a, _ in own] if own_scoring else lmeval_strict
        no_answer = [float(a is None) for a in strict_answer]
        reasons = [(finish or {}).get(i) for i in range(n)]
        truncated = [float(r == "length") for r in reasons] if all(r in ("stop", "length") for r in reasons) else None
        samples = []
        for e, s, fl, a, ok in zip(examples, strict, flex, strict_answer, em_strict):
            response = s["resps"][0][0]
            sample = {
                "id": e.id, "question": e.meta["question"], "prompt": s["arguments"][0][0], "response": response,
                "strict": a,
                "flexible": None if fl["filtered_resps"][0] == INVALID else fl["filtered_resps"][0],
                "gold": e.meta["gold"], "em_strict": ok, "em_flexible": float(fl["exact_match"]),
                "finish_reason": reasons[len(samples)],
            }
            if proto.strict_scoring != "lm-eval":
                sample["strict_lmeval"], sample["em_strict_lmeval"] = s["filtered_resps"][0], float(s["exact_match"])
                sample["strict_lmeval"] = None if sample["strict_lmeval"] == INVALID else sample["strict_lmeval"]
            samples.append(sample)
        try:
            lm_eval_version = importlib_metadata.version("lm_eval")
        except importlib_metadata.PackageNotFoundError:
            lm_eval_version = None
        metrics = {"gsm8k_em_strict": float(res["exact_match,strict-match"]),
                   "gsm8k_em_flexible": float(res["exact_match,flexible-extract"]),
                   "gsm8k_no_answer_rate": sum(no_answer) / n,
                   "gsm8k_truncated_rate": None if truncated is None else sum(truncated) / n,
                   "gsm8k_ref_nll": ref_nll, "n_gsm8k": n}
        extra_per_example = {} if truncated is None else {"truncated": truncated}
        toks = [(lengths or {}).get(i) for i in range(n)]
        outs = [[Completion(s["resps"][0][0], reasons[i] if reasons[i] in ("stop", "length") else "stop", toks[i])
                 if isinstance(toks[i], int) else s["resps"][0][0]] for i, s in enumerate(strict)]
        fm, fper = failure_columns(self.name, outs, [1.0 - a for a in no_answer])
        metrics.update(fm)
        extra_per_example.update(fper)
        if proto.strict_scoring != "lm-eval":
            metrics["gsm8k_em_strict"] = sum(em_strict) / n
            metrics[LMEVAL_STRICT_COLUMN] = float(res["exact_match,strict-match"])
            extra_per_example["em_strict_lmeval"] = em_strict_lmeval
        return TaskResult(
            metrics=metrics,
            per_example={"em_strict": em_strict, "em_flexible": em_flex, "no_answer": no_answer, **extra_per_example,
                         "ref_nll": ref_nll_each,
                         # per-example NLL sums (nats) and token counts for the token-weighted CI
                         "ref_nll_sum": ref.nll_sum, "ref_nll_tokens": [float(t) for t in ref.n_tokens]},
            samples=samples,
            meta={"task_version": self.version, "lm_eval_task": lm_task,
                  "protocol": proto.name, "protocol_version": proto.version, "protocol_source": proto.source,
                  **({"strict_scoring": proto.strict_scoring} if proto.strict_scoring != "lm-eval" else {}),
                  "template": proto.template, "stop": proto.stop, "example_prompt": strict[0]["arguments"][0][0],
                  "num_fewshot": cfg.num_fewshot, "apply_chat_template": cfg.apply_chat_template,
                  "fewshot_as_multiturn": bool(cfg.apply_chat_template), "max_new_tokens": cfg.max_new_tokens,
                  "decoding": "greedy", "lm_eval_version": lm_eval_version,
                  "task_yaml_sha256": proto.sha256,
                  "docs_sha256": hashlib.sha256("".join(
                      json.dumps({"question": e.meta["question"], "answer": e.meta["answer"]}) + "\n"
                      for e in examples).encode("utf-8")).hexdigest()},
        )
