"""Generate the docs' configuration and CLI reference pages from the code.

    mkdocs build --strict              # runs this file through mkdocs-gen-files (mkdocs.yml `gen-files`)
    python scripts/gen_docs.py DIR     # writes DIR/configuration.md and DIR/cli.md (to read them without mkdocs)

The configuration page walks the pydantic models under :class:`darts_bench.config.Config` (every key with its
type, default and description, task sections included); a key without a description is an error, so the build
fails until the field has one. The CLI page walks the argparse parser of ``darts-bench``
(:func:`darts_bench.cli.build_parser`).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the checkout's package, not another install's
    sys.path.insert(0, str(REPO))


class MissingDescription(ValueError):
    """A configuration key has no description (add ``Field(..., description=...)`` in its model)."""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``Model``, ``Model | None``, ``list[Model]``, ``dict[str, Model]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    name = getattr(origin, "__name__", str(origin))
    return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name


def _default(field) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    text = repr(value)
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def config_fields(model: type[BaseModel], prefix: str = "") -> Iterator[dict[str, str]]:
    """One record per key of ``model`` and of the models nested in it (dotted keys; ``<name>`` for a dict key,
    ``[]`` for a list item), depth first in declaration order."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"  # the config's own key (merges[].lambda: the field is lambda_)
        yield {"key": key, "type": _type_name(field.annotation), "default": _default(field),
               "description": (field.description or "").strip()}
        for sub in _models_in(field.annotation):
            origin = typing.get_origin(field.annotation)
            inner = {list: "[].", dict: ".<name>."}.get(origin, ".")
            yield from config_fields(sub, key + inner)


def task_sections() -> list[tuple[str, type[BaseModel]]]:
    """Each installed task's section model (``tasks.<name>``), in registry order."""
    from darts_bench.api import available_tasks, task_class

    return [(n, task_class(n).config_model) for n in available_tasks()]


def all_config_fields() -> list[dict[str, str]]:
    """Every key of :class:`darts_bench.config.Config`, the task sections included (``tasks.<task>.*``)."""
    from darts_bench.config import Config

    recs = list(config_fields(Config))
    for name, model in task_sections():
        recs.append({"key": f"tasks.{name}", "type": model.__name__, "default": "(section)",
                     "description": (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")})
        recs.extend(config_fields(model, f"tasks.{name}."))
    return recs


def _cell(text: str, code: bool = False) -> str:
    """One markdown table cell: one line, pipes escaped, and outside code ``<`` / ``>`` as entities."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if code else text.replace("<", "&lt;").replace(">", "&gt;")


def config_reference() -> str:
    """The configuration reference page (markdown). Raises :class:`MissingDescription` naming every key
    without a description."""
    from darts_bench.config import Config

    recs = all_config_fields()
    missing = [r["key"] for r in recs if not r["description"]]
    if missing:
        raise MissingDescription(f"{len(missing)} config keys have no description: {', '.join(missing)}")
    lines = ["# Configuration reference", "",
             "Generated from the pydantic models of `darts_bench/config.py` (and each task's `config_model`) by "
             "`scripts/gen_docs.py`: every key, its type, default and description. A preset "
             "(`darts_bench/configs/<name>.yaml`) or your YAML sets any of them; `--set KEY=VALUE` overrides one by "
             "its dotted key, validated like the file. `<name>` stands for a dict key, `[]` for a list item.", ""]
    sections: dict[str, list[dict[str, str]]] = {"top level": []}
    tasks = dict(task_sections())
    for r in recs:
        parts = r["key"].split(".")
        top = parts[0].split("[")[0]
        if top == "tasks" and len(parts) >= 2 and parts[1] in tasks:
            top = f"tasks.{parts[1]}"
        elif len(parts) == 1 and not _models_in(Config.model_fields[top].annotation) and top != "tasks":
            top = "top level"
        sections.setdefault(top, []).append(r)
    for top, rows in sections.items():
        lines += ["", f"## {top}" if top == "top level" else f"## `{top}`", ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for r in rows:
            lines.append(f"| `{_cell(r['key'], code=True)}` | {_cell(r['type'])} | {_cell(r['default'], code=True)} "
                         f"| {_cell(r['description'])} |")
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | help |", "|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(a.option_strings) or a.dest
        if a.metavar and a.option_strings:
            name += f" {a.metavar}" if isinstance(a.metavar, str) else ""
        default = "" if a.default in (None, argparse.SUPPRESS, False) or a.required else f"`{a.default!r}`"
        rows.append(f"| `{_cell(name, code=True)}` | {_cell(default, code=True)} | {_cell(a.help or '')} |")
    return rows


def cli_reference() -> str:
    """The CLI reference page (markdown): each subcommand's usage and arguments."""
    from darts_bench.cli import build_parser

    ap = build_parser()
    lines = ["# CLI reference", "",
             "Generated from `darts_bench/cli.py`'s argparse parser by `scripts/gen_docs.py`; "
             "[Command line in depth](usage.md) explains the options with what was measured with them.", "",
             _cell(ap.description or ""), ""]
    for name, sub in _subcommands(ap).items():
        lines += [f"## `darts-bench {name}`", "", "```text", sub.format_usage().strip(), "```", ""]
        if sub.description:
            lines += [_cell(sub.description), ""]
        lines += _options_table(sub) + [""]
    return "\n".join(lines)


PAGES = {"configuration.md": config_reference, "cli.md": cli_reference}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="directory to write the generated pages into")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in PAGES.items():
        (args.out / name).write_text(make())
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "<run_path>":  # mkdocs-gen-files runs this file with runpy.run_path
    import mkdocs_gen_files

    for _name, _make in PAGES.items():
        with mkdocs_gen_files.open(_name, "w") as f:
            f.write(_make())
