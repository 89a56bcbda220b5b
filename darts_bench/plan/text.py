"""The plan as plain text (``darts-bench run --dry-run``): a header, one table row per stage, the
details under it, the totals and the notes."""

from __future__ import annotations

from typing import Any

from darts_bench.plan.stages import STAGE_ORDER
from darts_bench.plan.units import dur, gb, num


def _tokens(s: dict[str, Any]) -> int | None:
    keys = ("train_tokens", "head_train_tokens", "generation_tokens", "feature_forward_tokens", "nll_tokens", "judge_tokens")
    vals = [s[k] for k in keys if s.get(k)]
    return sum(vals) if vals else None


def _loads_how(plan: dict[str, Any]) -> str:
    if plan["stages"]["evaluate"].get("vllm_engine"):
        return (" (vLLM engine starts: one per model dir in row order, the judge's kept alive"
                + (", each a group of Ray actors)" if plan["executor"] == "ray" else ")"))
    return " (one per model dir)" if plan["executor"] != "ray" else " (Ray: one actor group per model dir)"


def format_plan(plan: dict[str, Any]) -> str:
    """The plan of :func:`darts_bench.plan.make_plan` as text (sizes in decimal units, see
    :mod:`darts_bench.plan.units`)."""
    m = plan["model"]
    lines = [f"darts-bench plan: config {plan['config']}, suite {plan['suite']}, limit {plan['limit']}, "
             f"device {plan['device']}, executor {plan['executor']}",
             f"model: {num(m['params'])} params, {m['dtype']}, {gb(m['weights_bytes'])} per model "
             f"(architecture: {m['source']})",
             "tasks: " + ", ".join(f"{t} {ti['n_examples']}/{ti['of']}" for t, ti in plan["tasks"].items())
             + f"; {plan['rows']} evaluated rows",
             "protocols: " + ", ".join(f"{t} {ti.get('protocol')}" + (f" (annotator {ti['annotator']})"
                                                                      if ti.get("annotator") else "")
                                       for t, ti in plan["tasks"].items()), ""]
    header = ("stage", "memory (peak)", "GPU/actor", "disk", "tokens", "time (wall)", "device-h", "where")
    rows = [(name, gb(s.get("memory_bytes")),
             gb(s.get("gpu_bytes")) + ("" if s.get("gpu_fits", True) else " (!)"), gb(s.get("disk_bytes")),
             num(_tokens(s)), dur(s.get("wall_seconds")),
             f"{s['device_hours']:.2f}" if s.get("device_hours") is not None else "-", s["where"])
            for name, s in ((n, plan["stages"][n]) for n in STAGE_ORDER)]
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(7)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines.append(fmt.format(*header))
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 5)
    lines += [fmt.format(*r) for r in rows]
    lines.append("")
    for name in STAGE_ORDER:
        s = plan["stages"][name]
        lines.append(f"[{name}] {s['what']}")
        if s.get("memory_note"):
            lines.append(f"    memory: {s['memory_note']}")
        if name == "collect":
            for k, c in s["calibration"].items():
                held = f" ({c['held_out']} held out)" if "held_out" in c and not k.endswith("/reference") else ""
                lines.append(f"    {k}: {c['sequences']} sequences{held}, ~{num(c['tokens'])} tokens, "
                             f"features {gb(c['disk_bytes_per_merge'])} per merge (expert + merged, "
                             f"{plan['model']['dtype']})")
        if name == "train" and s["head_params"]:
            lines.append("    head params: " + ", ".join(
                f"{k} {num(v)} ({100 * s['params_overhead'].get(k, 0):.3f}% of the model)" for k, v in s["head_params"].items()))
    t = plan["totals"]
    lines += ["", f"forward tokens: {num(t['forward_tokens'])} in all (calibration generation "
              f"{num(t['calibration_generation_tokens'])}, feature forwards {num(t['feature_forward_tokens'])}, "
              f"evaluation generation {num(t['evaluation_generation_tokens'])}, reference NLL "
              f"{num(t['evaluation_nll_tokens'])}, judge {num(t['judge_tokens'])}); "
              f"pool training tokens {num(t['train_tokens'])}; disk {gb(t['disk_bytes'])}"]
    if t.get("device_hours") is not None:
        lines.append(f"time: {t['device_hours']:.1f} {t['device_hours_unit']}, ~{dur(t['wall_seconds'])} wall "
                     f"(throughput: {plan.get('throughput')}); evaluate loads {plan['stages']['evaluate'].get('model_loads')} "
                     f"checkpoints{_loads_how(plan)}"
                     f", collect {plan['stages']['collect'].get('model_loads')}")
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)
