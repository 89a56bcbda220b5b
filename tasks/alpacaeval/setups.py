"""AlpacaEval set-ups of the papers darts-bench is compared with, by name (``tasks.alpacaeval.setup``).

A set-up is the four choices a paper's AlpacaEval number rests on: the prompt (a formatting
protocol of :mod:`.protocols`, with its stop strings), the generation cap (tokens), the reference
outputs and alpaca_eval's annotator config. Each value is read from the paper's code:

* ``dare`` (DARE, Yu et al. 2024, "Language Models are Super Mario"; code ``yule-BUAA/MergeLM`` @6d49ad96):
  ``inference_llms_instruct_math_code.py`` ``test_alpaca_eval``: prompt
  ``generate_instruction_following_task_prompt(is_chat_model=True)`` (protocol ``vicuna``), greedy,
  ``SamplingParams(temperature=0.0, top_p=1, max_tokens=2048)``, no stop strings; README "Evaluation
  Process for AlpacaEval": ``alpaca_eval --annotators_config chatgpt_fn`` with the default reference of
  the alpaca_eval 1.0 of the time, ``text_davinci_003`` (alpaca_eval's ``constants.py`` keys the
  ``chatgpt_fn`` leaderboard on ``ALPACAEVAL_REFERENCE_OUTPUTS_1``, the text-davinci-003 outputs).
* ``della`` (DELLA-Merging, Deep et al. 2024; code ``declare-lab/della`` @8067515): ``generate.py``
  ``test_alpaca_eval``: for a model whose name contains ``7B`` the prompt
  ``generate_instruction_following_task_prompt(is_chat_model=False)`` = ``{instruction}\\n\\n### Response:\\n``
  (protocol ``della``), ``batch_response_gen_stop``: greedy, ``max_new_tokens=512``, stop strings
  ``["</s>", "USER:", "USER", "ASSISTANT:", "ASSISTANT"]``; README "Performing Evaluation / AlpacaEval":
  ``--annotators_config alpaca_eval_gpt4``. The README names no reference set; ``text_davinci_003`` is
  the one alpaca_eval pairs with ``alpaca_eval_gpt4`` (its 1.0 leaderboard,
  ``ALPACAEVAL_1_LEADERBOARD_PATHS``); with ``IS_ALPACA_EVAL_2`` (alpaca_eval's default since 0.5) the
  CLI would have used ``gpt4_turbo``: which one DELLA's numbers used is not recorded in its repository.
* ``alpaca_eval_2`` (AlpacaEval 2.0, Dubois et al. 2024, "Length-Controlled AlpacaEval"): alpaca_eval's
  defaults with ``IS_ALPACA_EVAL_2``: annotator ``weighted_alpaca_eval_gpt4_turbo`` (GPT-4 Turbo,
  logprob-weighted), reference ``gpt4_turbo`` (``gpt4_1106_preview`` outputs), metric
  ``get_length_controlled_winrate``. The prompt and cap are the model's own choice in AlpacaEval 2.0
  (its model configs); this set-up keeps darts-bench's ``chat_template`` and uses 2048 tokens, the most
  common ``max_new_tokens`` of alpaca_eval 0.6.6's ``models_configs`` (92 of its model configs).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SETUPS", "ANNOTATOR_MODEL_STATUS", "annotator_model_note"]

SETUPS: dict[str, dict[str, Any]] = {
    "dare": {"protocol": "vicuna", "max_new_tokens": 2048, "reference": "text_davinci_003", "annotator": "chatgpt_fn",
             "source": "yule-BUAA/MergeLM@6d49ad96 inference_llms_instruct_math_code.py test_alpaca_eval "
                       "(vicuna prompt, max_tokens=2048, greedy) + README (alpaca_eval --annotators_config "
                       "chatgpt_fn, alpaca_eval 1.0 reference text_davinci_003)"},
    "della": {"protocol": "della", "max_new_tokens": 512, "reference": "text_davinci_003",
              "annotator": "alpaca_eval_gpt4",
              "source": "declare-lab/della@8067515 generate.py test_alpaca_eval + batch_response_gen_stop (7B prompt, "
                        "stops, max_new_tokens=512, greedy) + README (--annotators_config alpaca_eval_gpt4; "
                        "reference not named: alpaca_eval 1.0's text_davinci_003, the pairing of alpaca_eval's "
                        "1.0 leaderboard)"},
    "alpaca_eval_2": {"protocol": "chat_template", "max_new_tokens": 2048, "reference": "gpt4_turbo",
                      "annotator": "weighted_alpaca_eval_gpt4_turbo",
                      "source": "tatsu-lab/alpaca_eval 0.6.6 defaults with IS_ALPACA_EVAL_2 (constants.py "
                                "ANNOTATOR_CONFIG_AE2, ALPACAEVAL_REFERENCE_OUTPUTS_2; main.py fn_metric "
                                "get_length_controlled_winrate)"},
}

#: The OpenAI model each annotator config of these set-ups names (``completions_kwargs.model_name`` in
#: alpaca_eval 0.6.6's ``evaluators_configs``), and its availability. Dates from OpenAI's deprecations
#: page as quoted in secondary copies read on 2026-12-02 (not checked against OpenAI's own API).
ANNOTATOR_MODEL_STATUS: dict[str, str] = {
    "text-davinci-003": "retired by OpenAI (shut down 2024-01-04); the text_davinci_003 annotator and the "
                        "reference outputs' generator cannot be rerun",
    "gpt-3.5-turbo-0301": "retired by OpenAI (deprecated 2023-06-13); alpaca_eval's `chatgpt` annotator names it",
    "gpt-3.5-turbo-16k-0613": "retired by OpenAI (gpt-3.5-turbo-0613 snapshots shut down 2024-09-13); "
                              "alpaca_eval's `chatgpt_fn` (DARE's annotator) names it, so chatgpt_fn calls fail at "
                              "OpenAI; point OPENAI_API_BASE at a server that serves that name, or the number is "
                              "not DARE's judge",
    "gpt-4": "an alias (gpt-4-0613 since 2023-06); listed for shutdown on 2026-10-23 in OpenAI's deprecations "
             "page; alpaca_eval's `alpaca_eval_gpt4` (AlpacaEval 1.0's and DELLA's annotator) names it",
    "gpt-4-1106-preview": "a preview snapshot listed for shutdown on 2026-10-23 in OpenAI's deprecations page; "
                          "alpaca_eval's `weighted_alpaca_eval_gpt4_turbo` (AlpacaEval 2.0's annotator) names it",
}


def annotator_model_note(model: str | None) -> str | None:
    """What is known of the annotator model's availability (:data:`ANNOTATOR_MODEL_STATUS`), ``None``
    when nothing is recorded for it."""
    return ANNOTATOR_MODEL_STATUS.get(model) if model else None
