"""How an AlpacaEval instruction becomes the model input (``tasks.alpacaeval.protocol``).

* ``chat_template`` (default): the pool's chat template (``format_chat``: the tokenizer's template,
  else darts-bench's Alpaca ``### Instruction / ### Response`` format).
* ``vicuna``: MergeLM's ``generate_instruction_following_task_prompt(is_chat_model=True)``
  (``yule-BUAA/MergeLM`` ``utils/evaluate_llms_utils.py``), the Vicuna v1.1 system prompt with
  ``USER: {instruction} ASSISTANT:``, used by DARE for AlpacaEval.
* ``alpaca``: Stanford Alpaca's ``prompt_no_input`` (``tatsu-lab/stanford_alpaca`` ``train.py``
  ``PROMPT_DICT``).
* ``della``: DELLA's prompt for 7B models, ``{instruction}\n\n### Response:\n``
  (``declare-lab/della`` ``utils/evaluate_llms_utils.py``
  ``generate_instruction_following_task_prompt(is_chat_model=False)``, chosen in ``generate.py``
  ``test_alpaca_eval`` when the model name contains ``7B``), generated with DELLA's stop strings
  (:data:`DELLA_STOP`, ``generate.py`` ``batch_response_gen_stop``).

A protocol may carry stop strings (``stop``); generation is cut before the first one.

Every row of a run gets the same prompt (built once from the pool's base tokenizer).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROTOCOLS", "VICUNA_TEMPLATE", "ALPACA_TEMPLATE", "DELLA_TEMPLATE", "DELLA_STOP", "format_instruction",
           "protocol_meta", "protocol_stop"]

VICUNA_TEMPLATE = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the user's questions. USER: {instruction} ASSISTANT:")
ALPACA_TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:")

#: DELLA ``generate_instruction_following_task_prompt(is_chat_model=False)`` (verbatim).
DELLA_TEMPLATE = "{instruction}\n\n### Response:\n"
#: DELLA ``generate.py`` ``batch_response_gen_stop``: the stop sequences of lm-eval's ``stop_sequences_criteria``.
DELLA_STOP = ("</s>", "USER:", "USER", "ASSISTANT:", "ASSISTANT")

PROTOCOLS: dict[str, dict[str, str]] = {
    "chat_template": {"version": "1", "template": "format_chat({instruction})",
                      "source": "the pool's tokenizer chat template (darts-bench Alpaca format when it has none)"},
    "vicuna": {"version": "1", "template": VICUNA_TEMPLATE,
               "source": "yule-BUAA/MergeLM utils/evaluate_llms_utils.py generate_instruction_following_task_prompt"},
    "alpaca": {"version": "1", "template": ALPACA_TEMPLATE,
               "source": "tatsu-lab/stanford_alpaca train.py PROMPT_DICT['prompt_no_input']"},
    "della": {"version": "1", "template": DELLA_TEMPLATE,
              "source": "declare-lab/della@8067515 utils/evaluate_llms_utils.py generate_instruction_following_task_prompt"
                        "(is_chat_model=False) (7B models, generate.py test_alpaca_eval); stops: generate.py "
                        "batch_response_gen_stop"},
}
#: stop strings per protocol (none: the model's EOS only)
STOPS: dict[str, tuple[str, ...]] = {"della": DELLA_STOP}


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
    if protocol == "della":
        return DELLA_TEMPLATE.format(instruction=instruction)
    return formatter.format_chat(instruction) if formatter is not None else instruction


def protocol_stop(protocol: str) -> list[str]:
    """The stop strings generation under ``protocol`` is cut at (``[]``: none but the model's EOS)."""
    return list(STOPS.get(protocol, ()))


def protocol_meta(protocol: str) -> dict[str, Any]:
    p = PROTOCOLS[protocol]
    return {"protocol": protocol, "protocol_version": p["version"], "protocol_source": p["source"],
            "template": p["template"], "stop": protocol_stop(protocol)}
