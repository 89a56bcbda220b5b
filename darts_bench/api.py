"""The abstractions every benchmark and model backend share (cf. ``lm_eval/api``).

* :class:`TextModel` — what a task may ask of a model: batched greedy/sampled generation with stop
  sequences (each continuation a :class:`Completion`: text + finish reason), and per-token
  log-likelihood of continuations.
* :class:`Task` — one benchmark: its examples, calibration prompts, evaluation and reference NLL.
* :func:`register_task` / :func:`get_task` — tasks are found by name; each lives in its own folder
  under ``tasks/`` (installed as ``darts_bench.tasks.<name>``) and registers itself on import; a
  folder with a ``task.yaml`` instead declares its task by ``kind`` (:data:`TASK_KINDS`, e.g.
  ``kind: lm_eval``: any lm-eval task by name).
* :class:`TaskConfig` — the base of each task's pydantic config section (``tasks.<name>``);
  :func:`available_tasks` / :func:`resolve_suite` — the registry is the only list of task names.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from darts_bench.registry import Registry


@dataclass(frozen=True)
class Example:
    """One benchmark item. ``prompt`` is the model input exactly as generated from (already
    formatted); ``reference`` is the reference answer whose NLL is reported; ``meta`` holds what the
    scorer needs (test code, gold number, instruction ...)."""

    id: str
    prompt: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScoreContinuation:
    """Log-likelihood of one continuation: ``nll`` summed over its tokens (nats), ``n_tokens``,
    ``greedy`` (every continuation token was the argmax), ``token_nll`` per token (nats)."""

    nll: float
    n_tokens: int
    greedy: bool
    token_nll: list[float] = field(default_factory=list)


#: why a generation ended: ``stop`` (an eos token or a stop sequence) or ``length`` (the token cap:
#: ``max_new_tokens``, or the engine's context window), as vLLM's and OpenAI's ``finish_reason``
FINISH_REASONS = ("stop", "length")


class Completion(str):
    """One generated continuation: the text itself (a ``str``, so every caller that reads text
    keeps working) plus how it ended.

    Attributes:
        finish_reason: ``"length"`` when generation hit the token cap (``max_new_tokens``, or the
            engine's context window) without an eos token or a stop sequence, else ``"stop"``.
        n_tokens: the generated token ids behind the text (``generate_ids``' row: eos and trailing
            padding excluded), counted before the text was cut at a stop sequence.

    String operations (slicing, ``strip``, ``+``) return plain ``str``: a completion's finish
    reason describes the generation, not a text derived from it. Pickles (Ray) and JSON-encodes
    (as its text) like a ``str``.

    Raises:
        ValueError: ``finish_reason`` not in :data:`FINISH_REASONS`, or a negative ``n_tokens``.
    """

    finish_reason: str
    n_tokens: int

    def __new__(cls, text: str, finish_reason: str = "stop", n_tokens: int = 0) -> "Completion":
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion: finish_reason {finish_reason!r} not one of {FINISH_REASONS}")
        if n_tokens < 0:
            raise ValueError(f"Completion: n_tokens must be >= 0, got {n_tokens}")
        obj = super().__new__(cls, text)
        obj.finish_reason, obj.n_tokens = finish_reason, int(n_tokens)
        return obj

    def __reduce__(self):
        return (Completion, (str(self), self.finish_reason, self.n_tokens))

    @property
    def truncated(self) -> bool:
        """Generation stopped at the token cap (``finish_reason == "length"``)."""
        return self.finish_reason == "length"


def truncated_rate(outputs: Sequence[Sequence[Any]] | Sequence[Any]) -> float | None:
    """Share of generated answers that hit the token cap (:attr:`Completion.truncated`): over every
    sample of ``outputs`` (``[example][sample]`` or one completion per example), in ``[0, 1]``.

    Returns None when some output carries no finish reason (a :class:`TextModel` that returns plain
    strings, e.g. a test stand-in or a user's model) or there are no outputs: unknown, not 0.
    """
    flat = [c for o in outputs for c in (o if isinstance(o, (list, tuple)) else [o])]
    if not flat or any(getattr(c, "finish_reason", None) not in FINISH_REASONS for c in flat):
        return None
    return sum(c.finish_reason == "length" for c in flat) / len(flat)


@runtime_checkable
class TextModel(Protocol):
    """A model as tasks see it. Implemented by :class:`darts_bench.evaluate.hf_model.HFTextModel`."""

    name: str

    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        stop: Sequence[str] = (),
        num_samples: int = 1,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> list[list[str]]:
        """Continuations, ``[len(prompts)][num_samples]`` strings, cut before the first stop
        sequence. ``temperature == 0`` is greedy (then ``num_samples`` must be 1).

        The built-in models return :class:`Completion` strings (with ``finish_reason`` and
        ``n_tokens``) and take a keyword ``top_p`` (nucleus sampling, Holtzman et al. 2020; default
        1.0: off), which tasks pass only when it is below 1, so a model without it still serves
        greedy and plain sampled protocols. Sampled generation is seeded per sample from
        (``seed``, the prompt, the sample's index) (:func:`darts_bench.evaluate.sampling.sample_seed`),
        so a prompt's samples do not depend on the other prompts of the call or the batch size."""
        ...

    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[ScoreContinuation]:
        """Per-pair log-likelihood of ``continuation`` given ``context``."""
        ...

    def format_chat(self, user_message: str) -> str:
        """``user_message`` wrapped in the model's chat template (generation prompt appended)."""
        ...


@dataclass
class TaskResult:
    """What a task returns for one model.

    ``metrics``: column name -> value (``None`` where not applicable, never NaN for a failure);
    ``per_example``: metric name -> one value per example, in example order (for bootstrap CIs);
    ``samples``: per-example records (prompt, output, score, reason) for inspection;
    ``meta``: protocol details for the manifest (few-shot count, judge, reference set ...);
    ``example_ids``: the ``Example.id`` of each per-example position (set by the pipeline from the
    examples it evaluated; paired intervals match two results by these ids);
    ``artifact_dir``: the evaluation artifact it was read from (``<work_dir>/eval/<row>-<task>-<key>``,
    set by the evaluate stage; None for a result made by hand).
    """

    metrics: dict[str, float | None]
    per_example: dict[str, list[float]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    example_ids: list[str] = field(default_factory=list)
    artifact_dir: str | None = None


@dataclass
class EvalContext:
    """Everything a task's ``evaluate`` may need besides the model: the task's config section,
    the data dir, a seed, a work dir for its own artifacts, and a lookup of other models
    (``get_model(row_name)``, e.g. the judge or an expert used as AlpacaEval reference).

    ``work_dir`` is scratch (deleted after the evaluation); ``out_dir`` is the evaluation
    artifact's folder, kept with ``result.json``: files a task writes there (its samples file,
    re-scorable with ``darts-bench score``) survive. :meth:`artifact_dir` is ``out_dir``, or
    ``work_dir`` when a task is called by hand without one."""

    config: Any
    data_dir: Path | None
    seed: int
    work_dir: Path
    get_model: Callable[[str], TextModel] | None = None
    get_outputs: Callable[[str], list[str]] | None = None
    out_dir: Path | None = None
    #: a folder kept across the run's evaluations, for artifacts several rows share (e.g. the AlpacaEval
    #: judge's known-answer check), each in a sub-folder keyed by a hash of its inputs (None: no cache)
    shared_dir: Path | None = None
    #: the cache identity of a model name ``get_model`` accepts (the evaluate stage's key of that row)
    model_key: Callable[[str], str] | None = None

    def artifact_dir(self) -> Path | None:
        return self.out_dir if self.out_dir is not None else self.work_dir


class TaskConfig(BaseModel):
    """Base of every task's config section ``tasks.<name>`` (frozen, unknown keys rejected).

    A task subclasses it with its own settings (generation length, protocol, sandbox limits ...)
    and names the subclass in :attr:`Task.config_model`; YAML and ``--set tasks.<name>.<key>=...``
    are validated against it with the key's dotted path in the error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="part of `--suite all`")
    limit: int | None = Field(None, ge=1, description="first N examples only (None: all)")
    # not in model_dump (so in no evaluation cache key: it changes what the report reads, not what an
    # evaluation holds); results.json records it as manifest.primary_metrics
    primary_metric: str | None = Field(
        None, exclude=True, description="the task's primary metric: one of its headline columns "
        "(Task.primary_metrics), read by the compact table, the DARTS vs Surgery comparison, the claims and the "
        "figures; the other headline columns are shown beside it. None: the first headline column")
    # not in model_dump either: the expert enters the keys of what it changes through its checkpoint's
    # content key (calibration, features, heads, corrected rows); results.json records it as
    # manifest.task_experts
    expert: str | None = Field(
        None, exclude=True, description="the pool expert (a name in pool.experts, or of the built pools: code, "
        "math, instruction) whose features the task's Surgery / DARTS heads are trained toward. Unset: the task's "
        "own default (Task.expert); set to null: no heads for this task")


class Task(ABC):
    """One benchmark. Subclasses set:

    * ``name`` (the registry key, ``tasks.<name>`` config section, column prefix),
    * ``expert``: the pool expert (built pools: ``code``, ``math`` or ``instruction``: ``config.EXPERT_NAMES``)
      whose features calibrate the Surgery / DARTS heads for this task, by default; a run's
      ``tasks.<name>.expert`` names another (e.g. MergeBench's ``coding``; :func:`get_task` sets it on the
      instance, so the class attribute stays the default and names the task's expert-training data
      for :meth:`training_prompts`); ``None``: the task is evaluated on
      every row but gets no heads (corrected rows are evaluated as their merge; the report says so),
    * ``version`` (bumped on any protocol change; recorded in results),
    * ``primary_metrics``: the headline columns, in ``TaskResult.metrics`` and the report,
    * ``config_model``: its :class:`TaskConfig` subclass.

    Report and planner hints (all optional): ``per_example_keys`` maps a metric column to its
    ``TaskResult.per_example`` key when that is not the column minus the ``<name>_`` prefix;
    ``metric_scale`` multiplies a metric's bootstrap CI (e.g. 100 for a percentage built from 0/1
    values); ``extra_columns`` are further contract columns after the headline ones (filled from
    ``metrics`` or :meth:`report_columns`); ``official_size`` is the example count with no limit and
    ``typical_tokens`` the typical prompt / reference lengths (``{"prompt", "reference"}`` tokens,
    optional ``"per_shot"``) for ``run --dry-run``; ``order`` sorts tasks in tables (then by name).
    """

    name: str
    expert: str | None
    version: str
    primary_metrics: tuple[str, ...] = ()
    config_model: ClassVar[type[TaskConfig]] = TaskConfig
    per_example_keys: ClassVar[dict[str, str]] = {}
    metric_scale: ClassVar[dict[str, float]] = {}
    extra_columns: ClassVar[tuple[str, ...]] = ()
    official_size: ClassVar[int | None] = None
    typical_tokens: ClassVar[dict[str, int]] = {"prompt": 100, "reference": 100}
    order: ClassVar[int] = 100
    #: share-of-examples columns (in ``metrics``) that say no example had a usable output when 1.0,
    #: each with the metric columns it qualifies: ``table.md`` marks those cells (e.g. HumanEval
    #: ``{"humaneval_empty_rate": ("humaneval_pass@1",)}``: every completion empty after extraction)
    unanswered_rates: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: folders of the data dir (shared/data's layout) the task cannot run without; checked before
    #: any work when a data dir is given (:func:`darts_bench.checks.check_data_dir`)
    data_folders: ClassVar[tuple[str, ...]] = ()
    #: ``score_samples(samples_path, config, data_dir) -> dict`` in a subclass makes
    #: ``darts-bench score <name> FILE`` work (offline scoring of outputs made elsewhere).
    score_samples: ClassVar[Callable[..., dict[str, Any]] | None] = None
    #: the named protocol (``tasks.<name>.protocol``) :meth:`examples` formats prompts with and
    #: :meth:`evaluate` scores under; the one route of a protocol into a task: :func:`get_task`
    #: sets it from the task's config section (``None``: the task has one protocol).
    protocol: str | None = None

    @abstractmethod
    def examples(self, data_dir: Path | None, model: TextModel | None, limit: int | None) -> list[Example]:
        """Benchmark examples in the official order, the first ``limit``. ``model`` (may be None)
        is used only for prompt formatting (chat template).

        Raises:
            FileNotFoundError / ValueError: missing, empty or malformed data, naming the file and line.
        """

    @abstractmethod
    def training_prompts(self, data_dir: Path | None, model: TextModel | None, n: int, seed: int) -> list[str]:
        """``n`` prompts from the task's expert-training data, formatted like :meth:`examples`
        prompts (the *inductive* calibration split)."""

    @abstractmethod
    def evaluate(self, model: TextModel, examples: list[Example], ctx: EvalContext) -> TaskResult:
        """Run the benchmark protocol on ``model``."""

    def check_protocol(self, examples: Sequence[Example]) -> str | None:
        """This task's :attr:`protocol`, once every example is known to be built under it
        (``Example.meta["protocol"]``, which :meth:`examples` records; an example without one
        counts as the class's default protocol). Call it at the top of :meth:`evaluate`.

        Raises:
            ValueError: an example built under another protocol (e.g. by a task instance whose
                ``protocol`` differs), naming the task, the examples' protocols and this one.
        """
        default = type(self).protocol
        built = {e.meta.get("protocol", default) for e in examples}
        if built - {self.protocol}:
            raise ValueError(f"{self.name}: examples were built under protocol(s) {sorted(built, key=str)} but "
                             f"this task's protocol (tasks.{self.name}.protocol) is {self.protocol!r}; build and "
                             "evaluate the examples with one task instance (darts_bench.api.get_task(name, config))")
        return self.protocol

    # ------------------------------------------------------------------ report / planner hooks
    def metric_columns(self) -> list[str]:
        """Metric columns with per-example values, for per-task CI tables and paired differences:
        the primary metrics and ``<name>_ref_nll``."""
        return [*self.primary_metrics, f"{self.name}_ref_nll"]

    def per_example_key(self, column: str) -> str:
        """The ``TaskResult.per_example`` key behind a metric column (``humaneval_pass@1`` ->
        ``pass@1`` unless ``per_example_keys`` says otherwise)."""
        if column in self.per_example_keys:
            return self.per_example_keys[column]
        prefix = f"{self.name}_"
        return column[len(prefix):] if column.startswith(prefix) else column

    def report_columns(self, result: TaskResult) -> dict[str, Any]:
        """Extra per-row report cells taken from a result beyond its ``metrics`` (e.g. from ``meta``)."""
        return {}

    def sample_fields(self, example: Example, sample: dict[str, Any]) -> dict[str, Any]:
        """What the results' samples file (:mod:`darts_bench.report.samples`, lm-eval's sample fields)
        and the report page show of one evaluated example, read from its ``TaskResult.samples``
        record ``sample``. Keys:

        * ``doc`` (dict, JSON-able): the dataset document, lm-eval's ``doc``;
        * ``target`` (str): the gold answer as text, lm-eval's ``target``;
        * ``prompt`` (str): the model input as generated from;
        * ``responses`` (list[str]): the raw model outputs, one per sample drawn (lm-eval's ``resps``);
        * ``extracted`` (list): what the scorer read from each response (None: nothing found), lm-eval's
          ``filtered_resps``;
        * ``verdict`` (list): per response, the score: True/False (pass/fail), a number (a judge's
          preference), or None where the task has no per-response verdict.

        Default (a task that overrides nothing): ``doc`` = ``example.meta`` (non-JSON values as text),
        ``target`` = ``example.reference``, ``prompt`` = ``example.prompt``, ``responses`` = the record's
        ``output``, ``response`` or ``completion`` (the first present; none: ``[]``), ``extracted`` =
        ``responses``, ``verdict`` = the record's ``passed`` (else None per response). The built-in
        tasks override it with their protocol's fields."""
        resp = next((sample[k] for k in ("output", "response", "completion") if k in sample), None)
        responses = [] if resp is None else (list(resp) if isinstance(resp, list) else [resp])
        passed = sample.get("passed")
        verdict = (list(passed) if isinstance(passed, list) else [passed]) if passed is not None else \
            [None] * len(responses)
        return {"doc": dict(example.meta), "target": example.reference, "prompt": example.prompt,
                "responses": responses, "extracted": list(responses), "verdict": verdict}

    def score_input(self, records: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The results' samples-file records of one row (:mod:`darts_bench.report.samples`) as the
        lines of a file :attr:`score_samples` reads, so ``darts-bench report --rescore`` can re-score a
        run with the current scorer without generating again. Default None: not re-scorable offline
        (e.g. a judge model is needed)."""
        return None

    def models_used(self, config: TaskConfig) -> list[str]:
        """Other models the protocol calls through ``EvalContext.get_model`` (row names or
        checkpoint dirs, e.g. a judge); their identity goes into the evaluation's cache key."""
        return []

    def plan(self, config: TaskConfig, n_examples: int) -> dict[str, Any]:
        """What the dry run (:mod:`darts_bench.plan`) must know of the protocol on ``n_examples``
        examples beyond the row's own generation (``typical_tokens``, ``max_new_tokens``,
        ``n_samples``) and reference NLL. The planner takes per-task costs only from here and the
        class attributes, never from a task's name; it checks the dict and raises ValueError
        naming the task for an unknown key or a malformed entry. Keys, all optional:

        * ``judge``: a model the protocol runs on every evaluated row besides the row's own, a dict
          with exactly ``label`` (str, shown as the annotator on the plan's ``protocols:`` line),
          ``model`` (str: the name the task passes to ``EvalContext.get_model``, a row name such
          as ``expert:instruction`` or a checkpoint dir, when the judge is loaded in the
          evaluating process, where it is held beside the row's model and costs its weights,
          load and forward time; None: it runs outside the process, e.g. an API annotator, and
          costs no local memory or time), ``prompt_tokens_per_row`` and ``new_tokens_per_row``
          (int >= 0: tokens the judge reads and generates for one row's ``n_examples``; counted
          as judge tokens either way), and optionally ``scored_tokens_per_row`` (int >= 0: tokens
          the judge scores teacher-forced, e.g. a forced choice between verdicts: a forward with
          the full-vocabulary logits on vLLM, a plain forward on HF) and ``scored_per_prompt``
          (int >= 1, default 1: how many of those scored sequences share one prompt, e.g. 2
          verdicts; ``evaluate.vllm.scoring: shared`` forwards such a prompt once) and
          ``shared_tokens_per_row`` (int >= 0: of one row's scored prompts, the tokens every other row's
          prompts for the same example start with too, e.g. the template, instruction and reference; with the
          judge's prefix cache, ``evaluate.prefix_cache_mib`` / ``evaluate.vllm.prefix_cache_mib``, forwarded
          once for the stage instead of once per row).
        * ``what`` / ``where`` (str): text appended to the evaluate stage's description / placement.

        Returns ``{}`` (the default) when the protocol costs nothing more."""
        return {}


_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task findable by ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"task {cls.name!r} registered twice ({_REGISTRY[cls.name]} and {cls})")
    _REGISTRY[cls.name] = cls
    return cls


TASKS_PACKAGE = "darts_bench_tasks"


def task_dirs() -> list[Path]:
    """Folders searched for benchmarks: the repository's ``tasks/`` and any extra folders listed in
    ``DARTS_BENCH_TASKS_PATH`` (``os.pathsep``-separated), so a new benchmark is a new folder."""
    dirs = [Path(__file__).resolve().parent.parent / "tasks"]
    extra = os.environ.get("DARTS_BENCH_TASKS_PATH", "")
    dirs += [Path(p) for p in extra.split(os.pathsep) if p]
    return [d for d in dirs if d.is_dir()]


#: Declarative task folders: a folder holding a ``task.yaml`` (and no ``__init__.py``) names its
#: ``kind``; the kind's loader ``(folder, spec dict, module) -> None`` defines and registers the task.
#: Kinds are registered by code task folders, which are all imported before any ``task.yaml``
#: folder: ``lm_eval`` (any lm-eval task by name) by ``tasks/lm_eval/``.
TASK_KINDS: Registry[Callable[..., None]] = Registry("task kind")
TASK_SPEC = "task.yaml"


def _is_task_folder(folder: Path) -> bool:
    return (folder / "__init__.py").is_file() or (folder / TASK_SPEC).is_file()


def _load_spec_folder(folder: Path, module: types.ModuleType) -> None:
    """Define the task of a declarative folder (``task.yaml`` with a ``kind``) inside ``module``.

    Raises:
        ValueError: ``task.yaml`` is not a YAML mapping, has no ``kind``, or names an unknown kind
            (each naming the file and the known kinds).
    """
    import yaml

    path = folder / TASK_SPEC
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"{path}: expected a mapping with a `kind` (one of {TASK_KINDS.names()}), "
                         f"got {type(spec).__name__}")
    if spec["kind"] not in TASK_KINDS:
        raise ValueError(f"{path}: unknown task kind {spec['kind']!r}; known kinds: {TASK_KINDS.names()}")
    TASK_KINDS.get(spec["kind"])(folder, spec, module)


def _import_task_folder(folder: Path) -> None:
    """Import ``folder/__init__.py`` as package ``darts_bench_tasks.<folder name>``; a folder with a
    ``task.yaml`` instead becomes a module of that name whose task its kind's loader defines."""
    if TASKS_PACKAGE not in sys.modules:
        parent = types.ModuleType(TASKS_PACKAGE)
        parent.__path__ = []  # namespace-like parent
        sys.modules[TASKS_PACKAGE] = parent
    name = f"{TASKS_PACKAGE}.{folder.name}"
    if name in sys.modules:
        old = getattr(sys.modules[name], "__file__", None)
        if old is None or Path(old).resolve().parent == folder.resolve():
            return
        # a folder of the same name from a task dir no longer searched: the one on the path now wins
        for n, cls in list(_REGISTRY.items()):
            if cls.__module__ == name or cls.__module__.startswith(name + "."):
                del _REGISTRY[n]
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
    if not (folder / "__init__.py").is_file():
        module = types.ModuleType(name)
        module.__file__ = str(folder / TASK_SPEC)
        sys.modules[name] = module
        try:
            _load_spec_folder(folder, module)
        except Exception:
            del sys.modules[name]
            raise
        return
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise


def _discover() -> None:
    """Import every task folder of :func:`task_dirs`: the code folders first (they may register a
    task kind, :data:`TASK_KINDS`), then the ``task.yaml`` folders."""
    seen: set[str] = set()  # a folder name found in two task dirs: the first dir wins
    spec_folders = []
    for d in task_dirs():
        for folder in sorted(d.iterdir()):
            if _is_task_folder(folder) and folder.name not in seen:
                seen.add(folder.name)
                if (folder / "__init__.py").is_file():
                    _import_task_folder(folder)
                else:
                    spec_folders.append(folder)
    for folder in spec_folders:
        _import_task_folder(folder)


def _visible(cls: type[Task], dirs: list[Path]) -> bool:
    """A task from a task folder counts only while its folder is on the search path (so a test
    that sets ``DARTS_BENCH_TASKS_PATH`` for a while does not leave its task in ``all``)."""
    mod = sys.modules.get(cls.__module__)
    if not cls.__module__.startswith(TASKS_PACKAGE + ".") or mod is None or not getattr(mod, "__file__", None):
        return True  # registered by code (a test, a plugin module): visible once registered
    folder = Path(mod.__file__).resolve().parent.parent
    return any(folder == d.resolve() for d in dirs)


def available_tasks() -> list[str]:
    """Names of the installed tasks: the folders of :func:`task_dirs` plus tasks registered by
    code, ordered by ``Task.order`` then name (the order of columns and tables)."""
    _discover()
    dirs = task_dirs()
    names = [n for n, cls in _REGISTRY.items() if _visible(cls, dirs)]
    return sorted(names, key=lambda n: (_REGISTRY[n].order, n))


def task_class(name: str) -> type[Task]:
    """The registered class of ``name`` (no instance).

    Raises:
        KeyError: no such task; the message lists the installed ones and names ``DARTS_BENCH_TASKS_PATH``.
    """
    if name not in available_tasks():
        raise KeyError(f"unknown task {name!r}; installed tasks: {available_tasks()} (a benchmark outside "
                       "tasks/ is found through a folder listed in DARTS_BENCH_TASKS_PATH)")
    return _REGISTRY[name]


def resolve_suite(suite: str, tasks_config: Any = None) -> list[str]:
    """Task names of a ``--suite`` value: ``all`` (every installed task that is enabled in
    ``tasks_config``), one task name, or a comma-separated list of names (kept in registry order;
    a listed task that is disabled is dropped).

    Raises:
        ValueError: an unknown name (listing the installed tasks) or no enabled task left.
    """
    known = available_tasks()
    if suite == "all":
        names = known
    else:
        wanted = [s.strip() for s in suite.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in known]
        if not wanted or unknown:
            raise ValueError(f"unknown suite {suite!r}: {unknown or 'empty'}; choose all, one of {known} or a "
                             "comma-separated list (benchmarks outside tasks/ are found through "
                             "DARTS_BENCH_TASKS_PATH)")
        names = [n for n in known if n in wanted]
    if tasks_config is not None:
        names = [n for n in names if getattr(tasks_config, n).enabled]
    if not names:
        raise ValueError(f"no enabled task in suite {suite!r}")
    return names


def get_task(name: str, config: TaskConfig | None = None) -> Task:
    """Instantiate the task registered as ``name``. With ``config`` (its ``tasks.<name>`` section)
    the instance's :attr:`Task.protocol` is ``config.protocol`` when the section has that field:
    the one place a run gives a task its protocol (its :meth:`Task.examples` and
    :meth:`Task.evaluate` both read ``task.protocol``, not the config); likewise its
    :attr:`Task.expert` is ``config.expert`` when set.

    Raises:
        KeyError: no such task (the message lists the installed ones).
        TypeError: ``config`` is not an instance of the task's ``config_model``.
    """
    cls = task_class(name)
    if config is not None and not isinstance(config, cls.config_model):
        raise TypeError(f"get_task({name!r}): config is a {type(config).__name__}, expected the task's "
                        f"config_model {cls.config_model.__name__} (the tasks.{name} section)")
    task = cls()
    protocol = getattr(config, "protocol", None)
    if protocol is not None:
        task.protocol = protocol
    # tasks.<name>.expert, when the section sets it: the pool expert this run's heads are trained toward
    # (``expert: null``: none, the task gets no heads)
    if config is not None and "expert" in getattr(config, "model_fields_set", ()):
        task.expert = getattr(config, "expert", None)
    return task
