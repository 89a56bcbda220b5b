"""How an AlpacaEval instruction becomes the model input (``tasks.alpacaeval.protocol``).

* ``chat_template`` (default): the pool's chat template (``format_chat``: the tokenizer's template,
  else darts-bench's Alpaca ``### Instruction / ### Response`` format).
* ``vicuna``: MergeLM's ``generate_instruction_following_task_prompt(is_chat_model=True)``
  (``yule-BUAA/MergeLM`` ``utils/evaluate_llms_utils.py``), the Vicuna v1.1 system prompt with
  ``USER: {instruction} ASSISTANT:``, used by DARE for AlpacaEval.
* ``alpaca``: Stanford Alpaca's ``prompt_no_input`` (``tatsu-lab/stanford_alpaca`` ``train.py``
  ``PROMPT_DICT``).

Every row of a run gets the same prompt (built once from the pool's base tokenizer).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROTOCOLS", "VICUNA_TEMPLATE", "ALPACA_TEMPLATE", "format_instruction", "protocol_meta"]

VICUNA_TEMPLATE = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the user's questions. USER: {instruction} ASSISTANT:")
ALPACA_TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:")

PROTOCOLS: dict[str, dict[str, str]] = {
    "chat_template": {"version": "1", "template": "format_chat({instruction})",
                      "source": "the pool's tokenizer chat template (darts-bench Alpaca format when it has none)"},
    "vicuna": {"version": "1", "template": VICUNA_TEMPLATE,
               "source": "yule-BUAA/MergeLM utils/evaluate_llms_utils.py generate_instruction_following_task_prompt"},
    "alpaca": {"version": "1", "template": ALPACA_TEMPLATE,
               "source": "tatsu-lab/stanford_alpaca train.py PROMPT_DICT['prompt_no_input']"},
}


def format_instruction(protocol: str, instruction: str, formatter: Any | None) -> str:
    """The model input for one instruction. ``formatter``: anything with ``format_chat``; with
    ``chat_template`` and no formatter the bare instruction (as before protocols existed).

    Raises:
        ValueError: unknown protocol.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown alpacaeval protocol {protocol!r}; known: {sorted(PROTOCOLS)}")
    if protocol == "vicuna":
        return VICUNA_TEMPLATE.format(instruction=instruction)
    if protocol == "alpaca":
        return ALPACA_TEMPLATE.format(instruction=instruction)
    return formatter.format_chat(instruction) if formatter is not None else instruction


def protocol_meta(protocol: str) -> dict[str, str]:
    p = PROTOCOLS[protocol]
    return {"protocol": protocol, "protocol_version": p["version"], "protocol_source": p["source"],
            "template": p["template"]}
