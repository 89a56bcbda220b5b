"""GSM8K through lm-eval: extraction helpers agree with lm-eval's filters, the local-file task
scores a stand-in model exactly, and a real (tiny, in-memory) HF Llama generates through the
``darts-bench`` lm-eval backend. No hub access."""

from __future__ import annotations

import math
import sys

import pytest
from conftest import DATA_DIR as DATA  # $DARTS_BENCH_DATA, else ../shared/data

from darts_bench.api import EvalContext, ScoreContinuation, get_task
from darts_bench.config import GSM8KConfig
from darts_bench.data import DataError

needs_data = pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").is_file(), reason="shared GSM8K data not present")

gsm8k = get_task("gsm8k")
mod = sys.modules[type(gsm8k).__module__]  # the task folder, imported by the registry


# ------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize("text, strict, flexible, norm_strict, norm_flexible", [
    ("The answer is 42.\n#### 42", "42", "42", "42", "42"),
    ("so 3,000 dollars", None, "3,000", None, "3000"),
    ("It costs $1,234.50 in total.", None, "$1,234.50", None, "1234.50"),
    ("Profit: $70,000.", None, "$70,000.", None, "70000"),
    ("She lost 5 then 7.\n#### -12", "-12", "-12", "-12", "-12"),
    ("#### 2.5\nthat is 2.5 hours", "2.5", "2.5", "2.5", "2.5"),
    ("#### 540 meters in 3 days", "540", "3", "540", "3"),
    ("no numbers here", None, None, None, None),
    ("", None, None, None, None),
])
def test_extraction_fixed_strings(text, strict, flexible, norm_strict, norm_flexible):
    assert mod.extract_strict(text) == strict
    assert mod.extract_flexible(text) == flexible
    assert (None if strict is None else mod.normalize_number(strict)) == norm_strict
    assert (None if flexible is None else mod.normalize_number(flexible)) == norm_flexible


def test_normalize_gold_and_is_correct():
    gold = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 1,018"
    assert mod.normalize_number(gold) == "1018"
    assert mod.is_correct("$1,018.", gold) and mod.is_correct("1018", "1018")
    assert not mod.is_correct(None, gold) and not mod.is_correct("1019", gold)
    assert mod.final_answer(gold) == "1,018"
    assert mod.strip_calculator(gold) == "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n#### 1,018"


def test_extraction_agrees_with_lm_eval_filters():
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    responses = ["The answer is 42.\n#### 42", "so 3,000 dollars", "It costs $1,234.50 in total.",
                 "#### -7.5 and then 8", "#### 1,000,000", "x = -3, y = 4.", "none", "", "12 apples, 3 pears",
                 "Total: $5.\n#### $5", "####42", "#### .5"]
    strict = RegexFilter(regex_pattern=r"#### (\-?[0-9\.\,]+)")  # lm-eval's gsm8k.yaml
    flexible = RegexFilter(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
    got_strict = [r[0] for r in strict.apply([[r] for r in responses], [{}] * len(responses))]
    got_flex = [r[0] for r in flexible.apply([[r] for r in responses], [{}] * len(responses))]
    assert [mod.extract_strict(r) or "[invalid]" for r in responses] == got_strict
    assert [mod.extract_flexible(r) or "[invalid]" for r in responses] == got_flex
    em = mod._EM
    for pred in got_strict + got_flex:
        for gold in ("#### 42", "x\n#### 3,000", "#### 1234.50", "#### -7.5", "#### 5"):
            want = exact_match_hf_evaluate([pred], [gold], regexes_to_ignore=em["regexes_to_ignore"],
                                           ignore_case=em["ignore_case"],
                                           ignore_punctuation=em["ignore_punctuation"])["exact_match"]
            assert mod.is_correct(None if pred == "[invalid]" else pred, gold) == bool(want), (pred, gold)


# ------------------------------------------------------------------------------------ data
@needs_data
def test_examples_and_training_prompts():
    ex = gsm8k.examples(DATA, None, 5)
    assert [e.id for e in ex] == [f"gsm8k/{i}" for i in range(5)]
    assert [e.meta["gold"] for e in ex] == ["18", "3", "70000", "540", "20"]
    assert ex[0].prompt.startswith("Question: Janet") and ex[0].prompt.endswith("\nAnswer:")
    assert ex[0].reference.startswith(" Janet sells") and "<<" not in ex[0].reference
    assert len(gsm8k.examples(DATA, None, None)) == 1319
    a = gsm8k.training_prompts(DATA, None, 4, seed=1)
    assert a == gsm8k.training_prompts(DATA, None, 4, seed=1) != gsm8k.training_prompts(DATA, None, 4, seed=2)
    assert all(p.startswith("Question: ") and p.endswith("\nAnswer:") for p in a)


def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="gsm8k/test.jsonl"):
        gsm8k.examples(tmp_path, None, 1)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(DataError, match=r"test.jsonl:2"):
        gsm8k.examples(tmp_path, None, 1)
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match="missing field"):
        gsm8k.examples(tmp_path, None, 1)


# ------------------------------------------------------------------- lm-eval, stand-in model
RESPONSES = {  # first 5 test questions (gold 18, 3, 70000, 540, 20)
    "Janet": "She makes 9 * 2 = 18 dollars.\n#### 18",                   # strict ok, flexible ok
    "A robe": "It takes 2 + 2 = 4 bolts.\n#### 4",                        # both wrong
    "Josh": "So he made a profit of $70,000.",                             # strict none, flexible ok
    "James": "#### 540 meters in 3 days",                                  # strict ok, flexible "3" wrong
    "Every day, Wendi": "The total is 20 cups\n\nQuestion: what next? 99",  # cut at "\n\n": flexible ok
}


class StandIn:
    """A TextModel answering each question with a fixed string (ignores ``stop``: the adapter cuts)."""

    name = "stand-in"

    def __init__(self):
        self.calls = []

    def generate(self, prompts, *, max_new_tokens, stop=(), num_samples=1, temperature=0.0, seed=0):
        self.calls.append({"prompts": list(prompts), "max_new_tokens": max_new_tokens, "stop": list(stop)})
        out = []
        for p in prompts:
            last_q = p.rsplit("Question: ", 1)[1]
            out.append([next(r for k, r in RESPONSES.items() if last_q.startswith(k))])
        return out

    def score(self, contexts, continuations):
        return [ScoreContinuation(nll=0.5 * len(c), n_tokens=len(c), greedy=False) for c in continuations]

    def format_chat(self, user_message):
        return f"<user>{user_message}</user>\n"


def _ctx(tmp_path, **cfg):
    return EvalContext(config=GSM8KConfig(**cfg), data_dir=DATA, seed=1234, work_dir=tmp_path)


class CappedStandIn(StandIn):
    """StandIn returning Completions; the answer to "Josh" (doc 2) ran to the token cap."""

    def generate(self, prompts, **kw):
        from darts_bench.api import Completion

        return [[Completion(r, "length" if r.startswith("So he") else "stop", 5) for r in row]
                for row in super().generate(prompts, **kw)]


@needs_data
def test_truncated_rate_through_lm_eval(tmp_path):
    """The finish reasons cross lm-eval (DartsBenchLM.finish_reasons by doc id) into
    gsm8k_truncated_rate, per example and per sample; the verdicts are the plain stand-in's."""
    model = CappedStandIn()
    ex = gsm8k.examples(DATA, model, 5)
    res = gsm8k.evaluate(model, ex, _ctx(tmp_path / "a", max_new_tokens=77))
    assert res.metrics["gsm8k_truncated_rate"] == pytest.approx(0.2)
    assert res.per_example["truncated"] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert [s["finish_reason"] for s in res.samples] == ["stop", "stop", "length", "stop", "stop"]
    assert res.per_example["em_strict"] == [1.0, 0.0, 0.0, 1.0, 0.0]
    plain = gsm8k.evaluate(StandIn(), ex, _ctx(tmp_path / "b", max_new_tokens=77))
    assert plain.metrics["gsm8k_truncated_rate"] is None and "truncated" not in plain.per_example


@needs_data
def test_lm_eval_end_to_end_stand_in(tmp_path):
    model = StandIn()
    ex = gsm8k.examples(DATA, model, 5)
    res = gsm8k.evaluate(model, ex, _ctx(tmp_path, max_new_tokens=77))
    assert res.metrics["gsm8k_em_strict"] == pytest.approx(2 / 5)
    assert res.metrics["gsm8k_em_flexible"] == pytest.approx(3 / 5)
    assert res.metrics["n_gsm8k"] == 5
    assert res.per_example["em_strict"] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert res.per_example["em_flexible"] == [1.0, 0.0, 1.0, 0.0, 1.0]
    # reference NLL: 0.5 per "token" (character) in the stand-in
    assert res.metrics["gsm8k_ref_nll"] == pytest.approx(0.5) and res.per_example["ref_nll"] == [0.5] * 5
    assert [s["strict"] for s in res.samples] == ["18", "4", None, "540", None]
    assert [s["flexible"] for s in res.samples] == ["18", "4", "$70,000.", "3", "20"]
    assert res.samples[4]["response"] == "The total is 20 cups"
    assert [s["gold"] for s in res.samples] == ["18", "3", "70000", "540", "20"]
    # the pure functions agree with what lm-eval's filters produced on the same responses
    for s in res.samples:
        assert mod.extract_strict(s["response"]) == s["strict"]
        assert mod.extract_flexible(s["response"]) == s["flexible"]
        assert float(mod.is_correct(s["flexible"], s["gold"])) == s["em_flexible"]
    (call,) = model.calls
    assert call["max_new_tokens"] == 77 and call["stop"] == ["Question:", "</s>", "<|im_end|>", "\n\n"]
    assert sorted(call["prompts"]) == sorted(e.prompt for e in ex)  # 0-shot lm-eval prompt == examples()
    assert res.meta["num_fewshot"] == 0 and res.meta["apply_chat_template"] is False
    assert res.meta["lm_eval_version"] and len(res.meta["task_yaml_sha256"]) == 64


@needs_data
def test_lm_eval_fewshot_and_chat_stand_in(tmp_path):
    model = StandIn()
    ex = gsm8k.examples(DATA, model, 2)
    res = gsm8k.evaluate(model, ex, _ctx(tmp_path, num_fewshot=2, apply_chat_template=True))
    assert res.per_example["em_strict"] == [1.0, 0.0]
    prompt = res.samples[0]["prompt"]
    # few-shot turns from train.jsonl as a multi-turn chat rendered with the model's format_chat
    assert prompt.startswith("<user>Question: ") and prompt.count("<user>") == 3
    assert prompt.endswith("<user>Question: " + ex[0].meta["question"] + "\nAnswer:</user>\n")
    assert res.meta["num_fewshot"] == 2 and res.meta["apply_chat_template"] is True


def test_adapter_order_grouping_and_greedy_only():
    from lm_eval.api.instance import Instance

    from darts_bench.evaluate.lm_eval_adapter import DartsBenchLM

    class Echo(StandIn):
        def generate(self, prompts, *, max_new_tokens, stop=(), **kw):
            self.calls.append((len(prompts), max_new_tokens, tuple(stop)))
            return [[f"{p}|{max_new_tokens}|STOP tail"] for p in prompts]

    m = Echo()
    lm = DartsBenchLM(m)
    reqs = [Instance("generate_until", {}, (f"p{i}", {"until": ["STOP"] if i % 2 else "|", "max_gen_toks": 5 + i % 2}), i)
            for i in range(5)]
    assert lm.generate_until(reqs) == ["p0", "p1|6|", "p2", "p3|6|", "p4"]
    assert sorted(m.calls) == [(2, 6, ("STOP",)), (3, 5, ("|",))]
    with pytest.raises(ValueError, match="greedy only"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"until": [], "do_sample": True}), 0)])
    with pytest.raises(ValueError, match="greedy only"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"until": [], "temperature": 0.7}), 0)])
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"num_beams": 4}), 0)])
    ll = lm.loglikelihood([Instance("loglikelihood", {}, ("ctx ", "ab"), 0),
                           Instance("loglikelihood", {}, ("ctx", ""), 1)])
    assert ll == [(-1.5, False), (0.0, True)]  # trailing space moved into the continuation
    assert lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("abcd",), 0)]) == [-2.0]
    assert lm.chat_template(True) == "<user>{{content}}</user>\n" and lm.chat_template(False) is None
    assert lm.tokenizer_name == "darts-bench:stand-in"
    with pytest.raises(ValueError, match="exactly one"):
        DartsBenchLM()


# ------------------------------------------------------------------ lm-eval, real tiny Llama
def _tiny_hf():
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [e.prompt + e.reference for e in gsm8k.examples(DATA, None, 30)]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


@needs_data
def test_lm_eval_tiny_hf_llama(tmp_path):
    from lm_eval.api.instance import Instance

    from darts_bench.evaluate.hf_model import HFTextModel
    from darts_bench.evaluate.lm_eval_adapter import DartsBenchLM

    hf, tok = _tiny_hf()
    model = HFTextModel("tiny", hf, tok, batch_size=4)
    ex = gsm8k.examples(DATA, model, 3)
    res = gsm8k.evaluate(model, ex, _ctx(tmp_path, max_new_tokens=6, num_fewshot=1, apply_chat_template=True))
    assert res.metrics["n_gsm8k"] == 3
    assert all(0.0 <= res.metrics[k] <= 1.0 for k in ("gsm8k_em_strict", "gsm8k_em_flexible"))
    assert math.isfinite(res.metrics["gsm8k_ref_nll"]) and res.metrics["gsm8k_ref_nll"] > 0
    assert len(res.per_example["em_flexible"]) == 3 and all(isinstance(s["response"], str) for s in res.samples)
    prompt = res.samples[0]["prompt"]
    assert prompt.startswith("<s><|user|>\nQuestion: ") and prompt.endswith("<|assistant|>\n")
    assert prompt.count("<|user|>") == 2  # one few-shot turn + the question

    # scoring hooks agree with the wrapped model's own scores
    lm = DartsBenchLM(model)
    (s,) = model.score(["Question: 2+2?\nAnswer:"], [" 4"])
    ((lp, greedy),) = lm.loglikelihood([Instance("loglikelihood", {}, ("Question: 2+2?\nAnswer: ", "4"), 0)])
    assert lp == pytest.approx(-s.nll, rel=1e-5) and greedy == s.greedy
    (r,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("Janet sells eggs",), 0)])
    (full,) = model.score([""], ["Janet sells eggs"])  # BOS-only context: the tokenizer adds <s>
    assert r == pytest.approx(-full.nll, rel=1e-5) and r < 0
    # a chat-templated context starting with "<s>" is not given a second BOS
    assert lm._strip_duplicate_bos("<s><|user|>\nhi") == "<|user|>\nhi"

    # found by name in lm-eval's registry, loading a checkpoint dir
    from lm_eval.api.registry import get_model

    hf.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    by_name = get_model("darts-bench").create_from_arg_string(f"pretrained={tmp_path / 'ckpt'}",
                                                              {"batch_size": 2, "device": "cpu"})
    req = Instance("generate_until", {}, ("Question: 2+2?\nAnswer:", {"until": ["\n"], "max_gen_toks": 4}), 0)
    assert by_name.generate_until([req]) == lm.generate_until([req])


@needs_data
def test_score_cli_on_external_samples(tmp_path, capsys):
    from darts_bench.cli import main

    import json as _json

    recs = [_json.loads(l) for l in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()[:3]]
    gold = [r["answer"].split("####")[-1].strip() for r in recs]
    lines = [{"doc_id": 0, "response": f"so\n#### {gold[0]}"},
             {"question": recs[1]["question"], "response": f"the answer is {gold[1]}"},
             {"doc_id": 2, "response": "#### 123456789"}]
    f = tmp_path / "s.jsonl"
    f.write_text("\n".join(_json.dumps(l) for l in lines) + "\n")
    assert main(["score", "gsm8k", str(f), "--data-dir", str(DATA), "--out", str(tmp_path / "m.json")]) == 0
    m = _json.loads((tmp_path / "m.json").read_text())
    assert m["gsm8k_em_strict"] == pytest.approx(1 / 3) and m["gsm8k_em_flexible"] == pytest.approx(2 / 3)
    f.write_text('{"doc_id": 99999, "response": "x"}\n')
    assert main(["score", "gsm8k", str(f), "--data-dir", str(DATA)]) == 2


@needs_data
def test_score_bad_ids_and_encoding_name_the_line(tmp_path):
    """A duplicate doc_id (or the same question twice), a string doc_id and invalid UTF-8 each fail
    naming the file and line (issue 30), instead of counting twice or citing a byte offset."""
    import json as _json

    gsm8k_score = mod.score_samples

    q1 = _json.loads((DATA / "gsm8k" / "test.jsonl").read_text().splitlines()[1])["question"]
    f = tmp_path / "s.jsonl"
    cases = [
        ('{"doc_id": 0, "response": "#### 1"}\n\n{"doc_id": 0, "response": "#### 2"}\n', ":3: ", "already has a response"),
        ('{"doc_id": 1, "response": "#### 1"}\n' + _json.dumps({"question": q1, "response": "x"}) + "\n",
         ":2: ", "test question 1"),
        ('{"doc_id": 0, "response": "#### 1"}\n{"doc_id": "0", "response": "#### 1"}\n', ":2: ",
         "doc_id '0' is a str; expected an integer index"),
        ('{"doc_id": true, "response": "#### 1"}\n', ":1: ", "is a bool"),
        ('{"doc_id": 0, "response": 7}\n', ":1: ", "response must be a string"),
    ]
    for text, where, what in cases:
        f.write_text(text)
        with pytest.raises(DataError) as e:
            gsm8k_score(f, data_dir=DATA)
        assert f"{f}{where}" in str(e.value) and what in str(e.value), (text, str(e.value))
    f.write_bytes(b'{"doc_id": 0, "response": "#### 1"}\n{"doc_id": 1, "response": "caf\xe9 #### 2"}\n')
    with pytest.raises(DataError, match=r":2: not valid UTF-8 \(byte 0xe9 at column 31\)"):
        gsm8k_score(f, data_dir=DATA)


@needs_data
@pytest.mark.parametrize("chat", [False, True])
def test_evaluate_task_is_simple_evaluates_set_up(tmp_path, chat):
    """``evaluate_task`` (lm_eval.evaluate after simple_evaluate's set-up, without its environment report) gives
    simple_evaluate's samples and metrics, few-shot exemplars included (drawn with the seed: another seed draws
    others, so the few-shot seed is what makes them equal)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from darts_bench.evaluate.lm_eval_adapter import DartsBenchLM, evaluate_task

    ex = gsm8k.examples(DATA, StandIn(), 4)
    task_dir = tmp_path / "task"
    gsm8k.write_lm_eval_task(ex, task_dir, data_dir=DATA, num_fewshot=3, max_new_tokens=40)
    name = mod.get_protocol("lm-eval").lm_eval_task

    def ours(seed):
        return evaluate_task(DartsBenchLM(StandIn(), max_gen_toks=40), name,
                             TaskManager(include_path=str(task_dir), include_defaults=False), limit=4, seed=seed,
                             apply_chat_template=chat, fewshot_as_multiturn=chat)

    ref = lm_eval.simple_evaluate(
        model=DartsBenchLM(StandIn(), max_gen_toks=40), tasks=[name],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), num_fewshot=3, limit=4,
        apply_chat_template=chat, fewshot_as_multiturn=chat, log_samples=True, bootstrap_iters=0,
        random_seed=7, numpy_random_seed=7, torch_random_seed=7, fewshot_random_seed=7)
    got = ours(7)
    assert got["samples"] == ref["samples"] and len(got["samples"][name]) == 8  # 4 docs x 2 filters
    assert got["results"] == ref["results"]
    prompts = [s["arguments"][0][0] for s in got["samples"][name]]
    assert all(p.count("Question: ") == 4 for p in prompts)  # three exemplars and the question
    assert [s["arguments"][0][0] for s in ours(8)["samples"][name]] != prompts
    assert "pretty_env_info" not in got and "pretty_env_info" in ref  # the environment report is what is left out
