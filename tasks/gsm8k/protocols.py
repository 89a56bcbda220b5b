"""Named GSM8K protocols (``tasks.gsm8k.protocol``), each an lm-eval task YAML in this folder.

* ``lm-eval`` (``gsm8k_local.yaml``): lm-eval's ``gsm8k.yaml`` on local files, ``Question: ...\\nAnswer:``,
  n-shot, strict ``#### N`` / flexible last number.
* ``alpaca-cot`` (``gsm8k_alpaca_cot.yaml``): WizardMath's zero-shot Alpaca prompt ending ``### Response:
  Let's think step by step.`` (``yule-BUAA/MergeLM`` ``get_math_task_prompt``; DELLA's lm-eval task
  ``gsm8k_cot_zeroshot_alpaca``); strict = MergeLM's own scoring (``extract_answer_number``: the number
  after the *last* ``The answer is: ``, rounded, compared as a number:
  :func:`darts_bench.scoring.extract.mergelm_answer_number`), with lm-eval's first-match filter
  ``The answer is: N`` kept as ``gsm8k_em_strict_lmeval``; flexible last number.
* ``gsm8k-cot-8shot`` (``gsm8k_cot_8shot.yaml``): lm-eval's own ``gsm8k_cot`` task
  (``lm_eval/tasks/gsm8k/gsm8k-cot.yaml`` of the installed lm-eval, ``include``d at run time: its 8
  exemplars, ``Q: ...\\nA:`` prompt, stops, first ``The answer is N`` strict-match and last-number
  flexible-extract), on local docs; MergeBench's GSM8K metric.
* ``chat-cot`` (``gsm8k_chat_cot.yaml``): :data:`CHAT_COT_INSTRUCTION` in the pool's chat template
  (rendered here, the same string for every row); strict = the *last* ``The answer is: N`` or
  ``#### N`` (GSM8K's own answer line, the format its math experts are trained on: issue 57, version 3)
  with the number pattern of lm-eval's chat variant ``gsm8k-cot-llama.yaml`` (``$`` allowed); flexible
  last number.

The prompt a model sees is lm-eval's ``doc_to_text`` of the YAML (zero-shot protocols: exactly
:meth:`GSM8KProtocol.prompt`); extraction and exact match are lm-eval's filters and metric, whose
regexes the pure functions here read from the same YAML (tests run lm-eval's own ``RegexFilter``),
except ``alpaca-cot``'s strict verdict, which is MergeLM's (:meth:`GSM8KProtocol.score_strict`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from darts_bench.scoring.extract import mergelm_answer_number, mergelm_is_correct, regex_extract

__all__ = ["GSM8KProtocol", "PROTOCOLS", "get_protocol", "CHAT_COT_INSTRUCTION", "ALPACA_COT_PROMPT", "INVALID",
           "LMEVAL_STRICT_COLUMN"]

HERE = Path(__file__).resolve().parent
INVALID = "[invalid]"  # lm-eval's RegexFilter fallback
#: The column holding lm-eval's ``strict-match`` (first ``The answer is: N``) exact match where the
#: protocol's own strict verdict is another source's (``alpaca-cot``: MergeLM's).
LMEVAL_STRICT_COLUMN = "gsm8k_em_strict_lmeval"

#: WizardMath / MergeLM ``get_math_task_prompt`` (verbatim).
ALPACA_COT_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                     "the request.\n\n### Instruction:\n{question}\n\n### Response: Let's think step by step.")

#: The user turn of ``chat-cot`` (``{question}``: the GSM8K question).
CHAT_COT_INSTRUCTION = ("{question}\n\nLet's think step by step. End your answer with a line "
                        "\"The answer is: <number>\".")


@dataclass(frozen=True)
class GSM8KProtocol:
    """One protocol: its lm-eval task YAML (``yaml_file``), how :meth:`prompt` renders a question, and
    whose strict verdict it reports (``strict_scoring``: ``"lm-eval"``, the YAML's ``strict-match``
    filter and exact match; ``"mergelm"``, MergeLM's ``extract_answer_number`` and numeric comparison)."""

    name: str
    version: str
    source: str
    yaml_file: str
    uses_chat_template: bool
    zero_shot_only: bool
    strict_scoring: str = "lm-eval"
    #: an lm-eval task YAML (path under the installed ``lm_eval/tasks``) that ``yaml_file`` overrides:
    #: the runtime YAML ``include``s it, so lm-eval's loader merges the two (local keys win)
    lm_eval_include: str | None = None
    #: the protocol's own few-shot count (the included task's ``num_fewshot``), ``None``: the config's
    fixed_fewshot: int | None = None
    text: str = field(init=False, repr=False)
    config: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        text = (HERE / self.yaml_file).read_text(encoding="utf-8")
        local = yaml.safe_load(text)
        config = local
        if self.lm_eval_include is not None:
            base_text = self.included_path().read_text(encoding="utf-8")
            # lm-eval's include rule (lm_eval/tasks/_yaml_loader.py load_yaml): included keys, then local keys win
            config = {**yaml.safe_load(base_text), **local}
            text = text + base_text
            if self.fixed_fewshot is not None and config.get("num_fewshot") != self.fixed_fewshot:
                raise ValueError(f"gsm8k protocol {self.name!r}: {self.included_path()} has num_fewshot "
                                 f"{config.get('num_fewshot')!r}, the protocol expects {self.fixed_fewshot}")
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "config", config)

    def included_path(self) -> Path:
        """The installed lm-eval task YAML this protocol includes (``lm_eval_include``).

        Raises:
            ValueError: the protocol includes none, or lm-eval is not installed / lacks the file.
        """
        if self.lm_eval_include is None:
            raise ValueError(f"gsm8k protocol {self.name!r} includes no lm-eval task YAML")
        spec = importlib.util.find_spec("lm_eval")
        if spec is None or spec.origin is None:
            raise ValueError(f"gsm8k protocol {self.name!r} needs the lm_eval package (lm-evaluation-harness)")
        path = Path(spec.origin).parent / "tasks" / self.lm_eval_include
        if not path.is_file():
            raise ValueError(f"gsm8k protocol {self.name!r}: the installed lm-eval has no {path}")
        return path

    # ------------------------------------------------------------------ YAML-derived facts
    @property
    def lm_eval_task(self) -> str:
        return self.config["task"]

    @property
    def sha256(self) -> str:
        """SHA-256 of the YAML text (with ``lm_eval_include``: ours followed by the included lm-eval file)."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def stop(self) -> list[str]:
        return list(self.config["generation_kwargs"]["until"])

    @property
    def template(self) -> str:
        """The exact prompt template: the YAML's ``doc_to_text`` (``chat-cot``: the user turn, wrapped
        in the pool's chat template)."""
        if self.uses_chat_template:
            return "format_chat(" + repr(CHAT_COT_INSTRUCTION) + ")"
        return self.config["doc_to_text"]

    def _filter(self, name: str) -> tuple[re.Pattern[str], int]:
        f = {x["name"]: x["filter"][0] for x in self.config["filter_list"]}[name]
        return re.compile(f["regex_pattern"]), int(f.get("group_select", 0))

    def extract_strict(self, text: str) -> str | None:
        """lm-eval's ``strict-match`` filter of this protocol (raw, commas kept); ``None`` = no answer."""
        pattern, group = self._filter("strict-match")
        return regex_extract(pattern, text, group)

    def extract_flexible(self, text: str) -> str | None:
        """lm-eval's ``flexible-extract`` filter (the last number-like token)."""
        pattern, group = self._filter("flexible-extract")
        return regex_extract(pattern, text, group)

    def normalize(self, text: str) -> str:
        em = self.config["metric_list"][0]
        for pat in em["regexes_to_ignore"]:
            text = re.sub(pat, "", text)
        return text.lower() if em.get("ignore_case", False) else text

    def is_correct(self, extracted: str | None, gold_answer: str) -> bool:
        """lm-eval's exact match of a :meth:`extract_strict` / :meth:`extract_flexible` result
        (``None``: lm-eval's ``[invalid]``) with ``gold_answer`` (the full solution or its number)."""
        return self.normalize(INVALID if extracted is None else extracted) == self.normalize(gold_answer)

    def score_strict(self, response: str, gold_answer: str) -> tuple[str | None, bool]:
        """``(answer, correct)``: the protocol's strict verdict on one response, as its source
        scores it. ``strict_scoring == "lm-eval"``: :meth:`extract_strict` (raw) and :meth:`is_correct`;
        ``"mergelm"``: :func:`~darts_bench.scoring.extract.mergelm_answer_number` (as a string, ``None``
        = MergeLM's invalid output) and :func:`~darts_bench.scoring.extract.mergelm_is_correct`.
        ``gold_answer``: a GSM8K solution (``... #### N``) or its number.

        Raises:
            ValueError: under ``mergelm``, a gold answer that is not an integer.
        """
        if self.strict_scoring == "mergelm":
            number = mergelm_answer_number(response)
            return (None if number is None else str(number)), mergelm_is_correct(number, gold_answer)
        extracted = self.extract_strict(response)
        return extracted, self.is_correct(extracted, gold_answer)

    # ------------------------------------------------------------------------------- prompt
    def prompt(self, question: str, formatter: Any | None) -> str:
        """The zero-shot model input for ``question`` (for ``lm-eval`` the 0-shot prompt; its
        few-shot context is built by lm-eval). Raises ``ValueError`` for ``chat-cot`` without a
        formatter."""
        if self.name == "lm-eval":
            return f"Question: {question}\nAnswer:"
        if self.name == "alpaca-cot":
            return ALPACA_COT_PROMPT.format(question=question)
        if self.name == "gsm8k-cot-8shot":
            return self.fewshot_prompt(question)
        if formatter is None:
            raise ValueError("gsm8k protocol 'chat-cot' needs the pool's chat template (a formatter)")
        return formatter.format_chat(CHAT_COT_INSTRUCTION.format(question=question))

    def fewshot_prompt(self, question: str) -> str:
        """The ``fixed_fewshot``-shot prompt of a protocol whose exemplars are its YAML's
        ``fewshot_config.samples`` (``sampler: first_n``): each exemplar's ``doc_to_text``, lm-eval's
        default target delimiter ``" "`` and its ``target``, joined by the default few-shot delimiter
        ``"\\n\\n"``, then the question's ``doc_to_text``. Tests check it equals lm-eval's own rendering
        (``Task.fewshot_context``).

        Raises:
            ValueError: the protocol has no fixed few-shot exemplars.
        """
        fs = self.config.get("fewshot_config") or {}
        if self.fixed_fewshot is None or fs.get("sampler") != "first_n" or not fs.get("samples"):
            raise ValueError(f"gsm8k protocol {self.name!r} has no fixed first_n few-shot exemplars")
        template = self.config["doc_to_text"]
        if template.count("{{question}}") != 1 or "{%" in template:
            raise ValueError(f"gsm8k protocol {self.name!r}: doc_to_text {template!r} is not a plain question template")
        shots = [template.replace("{{question}}", s["question"]) + " " + s["target"]
                 for s in fs["samples"][:self.fixed_fewshot]]
        return "\n\n".join(shots + [template.replace("{{question}}", question)])

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "source": self.source, "template": self.template,
                "stop": self.stop, "strict_scoring": self.strict_scoring, "lm_eval_task": self.lm_eval_task,
                "task_yaml": self.yaml_file, "task_yaml_sha256": self.sha256,
                **({"lm_eval_include": str(self.included_path())} if self.lm_eval_include else {})}


PROTOCOLS: dict[str, GSM8KProtocol] = {
    "lm-eval": GSM8KProtocol(
        name="lm-eval", version="1", yaml_file="gsm8k_local.yaml", uses_chat_template=False, zero_shot_only=False,
        source="EleutherAI/lm-evaluation-harness lm_eval/tasks/gsm8k/gsm8k.yaml (version 3.0)"),
    "alpaca-cot": GSM8KProtocol(
        name="alpaca-cot", version="2", yaml_file="gsm8k_alpaca_cot.yaml", uses_chat_template=False,
        zero_shot_only=True, strict_scoring="mergelm",
        source="yule-BUAA/MergeLM@6d49ad96 utils/evaluate_llms_utils.py get_math_task_prompt + "
               "extract_answer_number (strict) + inference_llms_instruct_math_code.py test_gsm8k stop tokens "
               "and comparison; gsm8k_em_strict_lmeval and flexible: filters of declare-lab/della "
               "lm_eval_task_config/gsm8k_cot_zeroshot_alpaca.yaml"),
    "gsm8k-cot-8shot": GSM8KProtocol(
        name="gsm8k-cot-8shot", version="1", yaml_file="gsm8k_cot_8shot.yaml", uses_chat_template=False,
        zero_shot_only=False, lm_eval_include="gsm8k/gsm8k-cot.yaml", fixed_fewshot=8,
        source="EleutherAI/lm-evaluation-harness lm_eval/tasks/gsm8k/gsm8k-cot.yaml (task gsm8k_cot, version "
               "3.0, from the installed lm_eval), included as is: exemplars, prompt, stops, filters, exact match; "
               "MergeBench's GSM8K metric"),
    "chat-cot": GSM8KProtocol(
        name="chat-cot", version="3", yaml_file="gsm8k_chat_cot.yaml", uses_chat_template=True, zero_shot_only=True,
        source="darts-bench prompt (zero-shot chain of thought in the pool's chat template); strict: last "
               "'The answer is: N' or '#### N' (GSM8K's training format) with the number pattern of EleutherAI/lm-evaluation-harness "
               "lm_eval/tasks/gsm8k/gsm8k-cot-llama.yaml (lm_eval 0.4.13)"),
}


def get_protocol(name: str) -> GSM8KProtocol:
    """Raises ``ValueError`` naming the known protocols."""
    if name not in PROTOCOLS:
        raise ValueError(f"unknown gsm8k protocol {name!r}; known: {sorted(PROTOCOLS)}")
    return PROTOCOLS[name]
