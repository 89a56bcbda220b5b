"""The SVD merges TSV-M, Iso-C, Iso-CTS and the post-merge Singular Value Calibration (SVC).

All four work on task vectors ``tau_k = theta_k - theta_base`` of the pool's experts, one 2-D weight
matrix at a time (an SVD each); every other tensor (norm weights, biases: the 1-D ones) gets the
experts' mean task vector, as FusionBench does. Embeddings and an untied ``lm_head`` are 2-D and are
merged like any matrix (FusionBench's rule: every 2-D tensor not in ``exclude_keys``, which is
empty by default); a tied ``lm_head`` is the input embedding (the checkpoint stores it once), so it is
merged once, as the embedding, and stays tied. The tensors are read from the checkpoints' safetensors
(one tensor at a time per model), computed in fp32 (half-precision inputs are cast up, as
FusionBench's TSV-M does: no half-precision SVD), and the merge is written in ``spec.dtype``.

* ``tsv_m``: Gargiulo et al., CVPR 2025, "Task Singular Vectors: Reducing Task Interference in Model
  Merging" (arXiv 2412.00081). Per matrix: each task vector's SVD ``U_k S_k V_k^T``, truncated to its
  top ``floor(r / K)`` singular triplets (r = min(m, n), K experts); the kept ``U``'s and ``V``'s are
  concatenated and whitened (replaced by their polar factors, ``P Q^T`` of their own SVDs) so the
  tasks' subspaces are orthogonal, and ``tau = U_perp diag(S) V_perp^T``. ``weight``: one number scales
  the merged task vector (FusionBench's float ``alpha``), a mapping each expert's task vector first
  (its list ``alpha``).
* ``iso_c``: Marczak et al., ICML 2025, "No Task Left Behind: Isotropic Model Merging with Common and
  Task-Specific Subspaces" (arXiv 2502.04959), Iso-C: ``sum_k tau_k = U S V^T``, every singular value
  replaced by their mean (an isotropic spectrum), ``tau = U (mean S) V^T``; ``weight`` scales it.
* ``iso_cts``: the same paper's Iso-CTS: the top ``common_space_fraction`` of the sum's singular
  directions are the common subspace; each task vector's residual outside it gives its top
  ``(r - common) / K`` directions; the stacked directions are whitened and given one isotropic
  singular value (the mean of the stacked ones).
* SVC (``svc_alpha`` on a merge): "When Shared Knowledge Hurts: Spectral Over-Accumulation in Model
  Merging" (arXiv 2602.05536), Algorithm 1: per matrix, ``tau_merge = U S V^T``; for each singular
  direction r and expert k the projection coefficient ``s_rk = <u_r^T tau_merge, u_r^T tau_k> /
  ||u_r^T tau_k||^2`` (Eq. 8); ``S_r`` is multiplied by ``K / sum_k max(alpha, s_rk)`` (a shared
  direction that several task vectors each fill is over-counted by the merge and shrunk). SVC needs
  no data: the base, the experts and the merge only. It runs on top of any merge but the data merges.

Code read: FusionBench 0.2.33 (MIT licence), ``fusion_bench/method/task_singular_vector/TSVM.py`` and
``utils/TSVM_utils.py`` (``compute_and_sum_svd_mem_reduction``), ``isotropic_merging/iso.py`` and
``iso_utils.py`` (``iso_c``, ``iso_cts``), ``singular_value_calibration/svc.py`` and ``utils.py``
(``subspace_consistency_spectral_calibration_accelerated``, its default: fp64). The functions here
are those computations step for step (same operations in the same order and dtype), so
``tests/test_merge_svd.py`` finds them bit-identical to FusionBench's on a tiny decoder pool.

Why not call FusionBench at run time: its algorithms take a ``BaseModelPool`` of loaded
``nn.Module`` s (every expert whole in memory) and its utilities print a line per tensor; importing
``fusion_bench`` pulls lightning, hydra-core, omegaconf, tensorboard and h5py into the run's
dependencies for about 150 lines of tensor code. It is the test-only reference instead (the ``dev``
extra), as for RegMean (:mod:`darts_bench.merge.regmean`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("darts_bench")
#: the file beside the merged weights with the merge's method, settings, sources and timings
SUMMARY = "svd_merge.json"
PAPERS = {
    "tsv_m": "Gargiulo et al., CVPR 2025, Task Singular Vectors: Reducing Task Interference in Model Merging "
             "(arXiv 2412.00081)",
    "iso_c": "Marczak et al., ICML 2025, No Task Left Behind: Isotropic Model Merging with Common and "
             "Task-Specific Subspaces (arXiv 2502.04959), Iso-C",
    "iso_cts": "Marczak et al., ICML 2025, No Task Left Behind: Isotropic Model Merging with Common and "
               "Task-Specific Subspaces (arXiv 2502.04959), Iso-CTS",
    "svc": "When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging (arXiv 2602.05536), "
           "Singular Value Calibration",
}
#: Iso-CTS's common-subspace share when the spec leaves it unset (FusionBench's iso_cts.yaml)
ISO_CTS_COMMON_SPACE_FRACTION = 0.8


# ------------------------------------------------------------------------------ one matrix each
def tsv_m_matrix(tvs: list[torch.Tensor]) -> torch.Tensor:
    """TSV-M of one weight matrix: ``tvs`` K task vectors [m, n] (fp32/fp64) -> merged task vector [m, n].

    Each ``tau_k = U_k S_k V_k^T`` keeps its top ``int(r / K)`` triplets (r = min(m, n)); the kept
    columns fill ``U`` [m, r], ``S`` [r], ``V^T`` [r, n] (task k at ``k*int(r/K):(k+1)*int(r/K)``, the
    rest zero); ``U`` and ``V^T`` are replaced by their polar factors and ``tau = U_p diag(S) V^T_p``
    (FusionBench ``compute_and_sum_svd_mem_reduction``)."""
    sv_reduction = 1 / len(tvs)
    for i, vec in enumerate(tvs):
        u, s, vh = torch.linalg.svd(vec, full_matrices=False)
        if i == 0:
            sum_u, sum_s, sum_vh = torch.zeros_like(u), torch.zeros_like(s), torch.zeros_like(vh)
        k = int(s.shape[0] * sv_reduction)  # triplets kept per task
        sum_u[:, i * k:(i + 1) * k] = u[:, :k]
        sum_s[i * k:(i + 1) * k] = s[:k]
        sum_vh[i * k:(i + 1) * k, :] = vh[:k, :]
    u_u, _, vh_u = torch.linalg.svd(sum_u, full_matrices=False)  # polar factor of U: u_u @ vh_u
    u_vh, _, vh_vh = torch.linalg.svd(sum_vh, full_matrices=False)
    return torch.linalg.multi_dot((u_u, vh_u, torch.diag(sum_s), u_vh, vh_vh))


def iso_c_matrix(tvs: list[torch.Tensor]) -> torch.Tensor:
    """Iso-C of one weight matrix: ``tvs`` K task vectors [m, n] -> ``U diag(mean S) V^T`` [m, n] of
    their sum (FusionBench ``iso_c``: the sum computed as mean times K)."""
    k = len(tvs)
    merged = sum(tvs) / k
    merged *= k
    u, s, v = torch.linalg.svd(merged, full_matrices=False)
    return torch.linalg.multi_dot((u, torch.diag(torch.ones_like(s) * s.mean()), v))


def iso_cts_matrix(tvs: list[torch.Tensor], common_space_fraction: float) -> torch.Tensor:
    """Iso-CTS of one weight matrix: ``tvs`` K task vectors [m, n] -> merged task vector [m, n].

    r = min(m, n); the common subspace is the top ``c`` left/right singular vectors of ``sum_k tau_k``,
    ``c = r - round((r - int(r * common_space_fraction)) / K) * K``; each task adds the top
    ``(r - c) / K`` singular vectors of ``tau_k - U_c U_c^T tau_k``; the stacked ``U`` [m, r] and
    ``V^T`` [r, n] are replaced by their polar factors and every singular value by their mean
    (FusionBench ``iso_cts``)."""
    K = len(tvs)
    shape = tvs[0].shape
    r = min(shape)
    combined = sum(tvs)
    common = int(r * common_space_fraction)
    common = r - round((r - common) / K) * K
    u, s, v = torch.linalg.svd(combined, full_matrices=False)
    cu, cs, cv = u[:, :common], s[:common], v[:common, :]
    per_task = int((r - common) / K)
    for i, w in enumerate(tvs):
        w_ts = w - cu @ cu.T @ w  # the part of tau_k outside the common column space
        u_ts, s_ts, v_ts = torch.linalg.svd(w_ts, full_matrices=False)
        if i == 0:
            all_u, all_s, all_v = torch.zeros_like(u_ts), torch.zeros_like(s_ts), torch.zeros_like(v_ts)
        all_u[:, i * per_task:(i + 1) * per_task] = u_ts[:, :per_task]
        all_s[i * per_task:(i + 1) * per_task] = s_ts[:per_task]
        all_v[i * per_task:(i + 1) * per_task, :] = v_ts[:per_task, :]
    lo, hi = K * per_task, K * per_task + common
    all_u[:, lo:hi], all_s[lo:hi], all_v[lo:hi, :] = cu, cs, cv
    uu, _, vu = torch.linalg.svd(all_u, full_matrices=False)
    uv, _, vv = torch.linalg.svd(all_v, full_matrices=False)
    all_u, all_v = uu @ vu, uv @ vv
    all_s = torch.ones_like(all_s) * all_s.mean()
    return torch.linalg.multi_dot((all_u, torch.diag(all_s), all_v))


def svc_matrix(base: torch.Tensor, experts: list[torch.Tensor], merged: torch.Tensor, alpha: float) -> torch.Tensor:
    """SVC of one weight matrix (arXiv 2602.05536, Algorithm 1; FusionBench's vectorised form, fp64).

    Args:
        base: the base's weight [m, n]; experts: K expert weights [m, n]; merged: the merge's [m, n].
        alpha: the floor of each projection coefficient (larger: shrinks less; FusionBench 0.1 to 0.2).
    Returns:
        the calibrated merged weight [m, n] in ``merged``'s dtype.
    Raises:
        ValueError: the shapes differ."""
    if any(t.shape != base.shape for t in (*experts, merged)):
        raise ValueError(f"SVC: shapes differ: base {tuple(base.shape)}, experts "
                         f"{[tuple(t.shape) for t in experts]}, merge {tuple(merged.shape)}")
    dtype = merged.dtype
    b = base.to(torch.float64)
    deltas = torch.stack([t.to(torch.float64) - b for t in experts], dim=0)  # [K, m, n]
    dm = merged.to(torch.float64) - b  # [m, n]
    u, s, vh = torch.linalg.svd(dm, full_matrices=False)
    u_sel = u.transpose(0, 1).contiguous()  # [R, m]
    merged_resp = u_sel @ dm  # [R, n]: a_r^merge (Eq. 4)
    task_resp = torch.einsum("rm,kmn->rkn", u_sel, deltas)  # [R, K, n]: a_r^k
    denom = (task_resp * task_resp).sum(dim=-1).clamp_min(1e-12)  # [R, K]
    coef = torch.einsum("rn,rkn->rk", merged_resp, task_resp) / denom  # s_rk (Eq. 8)
    coef = torch.nan_to_num(coef, nan=alpha, neginf=alpha)
    gamma = deltas.shape[0] / torch.maximum(coef, torch.as_tensor(alpha, dtype=coef.dtype)).sum(dim=1)  # [R]
    out = (u * (gamma.to(s.dtype) * s).unsqueeze(0)) @ vh + b
    return out.to(dtype)


# ------------------------------------------------------------------------------ whole checkpoints
class _Reader:
    """A checkpoint dir's safetensors tensors by name (one file or a sharded index), read one at a time."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        path = Path(path)
        idx = path / "model.safetensors.index.json"
        if idx.is_file():
            files = json.loads(idx.read_text())["weight_map"]
        else:
            files = {}
            for f in sorted(path.glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    files.update({k: f.name for k in st.keys()})
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights")
        self.path, self.files = path, files

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path / self.files[key]), "pt") as st:
            return st.get_tensor(key)


def _readers(base_dir: Path, experts: dict[str, Path]) -> tuple[_Reader, dict[str, _Reader]]:
    """Readers of the base and experts, checked to hold the same tensor names.

    Raises:
        ValueError: an expert's tensor names differ from the base's."""
    base = _Reader(base_dir)
    exp = {e: _Reader(p) for e, p in experts.items()}
    for e, r in exp.items():
        if set(r.keys()) != set(base.keys()):
            diff = sorted(set(r.keys()) ^ set(base.keys()))[:5]
            raise ValueError(f"SVD merge: expert {e} ({r.path}) and the base ({base.path}) hold different tensors "
                             f"(e.g. {diff}); the SVD merges need experts of the base's architecture")
    return base, exp


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def merge_state_dict(method: str, base: dict[str, torch.Tensor] | _Reader, experts: list,
                     weight: float | list[float] = 1.0, common_space_fraction: float | None = None
                     ) -> dict[str, torch.Tensor]:
    """The merged state dict of ``method`` (``tsv_m`` | ``iso_c`` | ``iso_cts``): ``theta_base + tau``.

    Args:
        base: the base's tensors (a state dict or a :class:`_Reader`); experts: K of the same.
        weight: one number: the merged task vector's scale (applied after the merge); a list of K: each
            expert's task vector's scale (applied before).
        common_space_fraction: ``iso_cts`` only (None: :data:`ISO_CTS_COMMON_SPACE_FRACTION`).
    Returns:
        name -> merged tensor (fp32, or the inputs' fp64), every tensor of ``base``.
    Raises:
        ValueError: an unknown method, a weight list of another length than the experts, or shapes
            that differ between the base and an expert."""
    if method not in ("tsv_m", "iso_c", "iso_cts"):
        raise ValueError(f"unknown SVD merge {method!r}: tsv_m, iso_c or iso_cts")
    per_expert = isinstance(weight, (list, tuple))
    if per_expert and len(weight) != len(experts):
        raise ValueError(f"SVD merge: {len(weight)} weights for {len(experts)} experts")
    frac = ISO_CTS_COMMON_SPACE_FRACTION if common_space_fraction is None else common_space_fraction
    get = (lambda sd, k: sd.get(k) if isinstance(sd, _Reader) else sd[k])
    out = {}
    for key in (base.keys() if isinstance(base, _Reader) else list(base)):
        b = _f32(get(base, key))
        tvs = []
        for i, e in enumerate(experts):
            t = _f32(get(e, key))
            if t.shape != b.shape:
                raise ValueError(f"SVD merge: {key} is {tuple(t.shape)} in expert {i} but {tuple(b.shape)} in the "
                                 "base (pool.vocab_alignment=base with appended tokens is not supported)")
            tv = t - b
            tvs.append(tv * weight[i] if per_expert else tv)
        if b.dim() == 2:
            tau = (tsv_m_matrix(tvs) if method == "tsv_m" else iso_c_matrix(tvs) if method == "iso_c"
                   else iso_cts_matrix(tvs, frac))
        elif method == "tsv_m" or method == "iso_cts":  # FusionBench's running mean
            tau = tvs[0].clone()
            for i, v in enumerate(tvs[1:], start=1):
                tau += (v - tau) / (i + 1)
        else:  # iso_c: sum / K
            tau = sum(tvs) / len(tvs)
        if not per_expert:
            tau = tau * weight
        out[key] = tau + b
    return out


def calibrate_state_dict(base, experts: list, merged, alpha: float) -> dict[str, torch.Tensor]:
    """SVC of a merged state dict: every 2-D tensor through :func:`svc_matrix`, the others unchanged.

    Args:
        base / experts / merged: state dicts or :class:`_Reader` s with the same tensor names.
        alpha: SVC's alpha (> 0).
    Returns:
        name -> calibrated tensor (``merged``'s dtypes)."""
    get = (lambda sd, k: sd.get(k) if isinstance(sd, _Reader) else sd[k])
    out = {}
    for key in (merged.keys() if isinstance(merged, _Reader) else list(merged)):
        m = get(merged, key)
        out[key] = svc_matrix(get(base, key), [get(e, key) for e in experts], m, alpha) if m.dim() == 2 else m
    return out


def _save(sd: dict[str, torch.Tensor], base_dir: Path, out: Path, dtype: str) -> None:
    """Write ``sd`` over the base's architecture as a HF checkpoint in ``out`` (:func:`~darts_bench.merge.data.save_merged`).

    Raises:
        ValueError: ``sd`` lacks a tensor of the base model other than a tied ``lm_head``, or has one it lacks."""
    from darts_bench.merge.data import load_model, save_merged

    model = load_model(base_dir, "cpu")
    missing, unexpected = model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=False)
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False):
        tied = {n for n, p in model.named_parameters(remove_duplicate=False)
                if p is model.get_input_embeddings().weight} - set(sd)
    if set(missing) - tied or unexpected:
        raise ValueError(f"SVD merge: the merged tensors do not fit the base model: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    save_merged(model, base_dir, out, dtype)


def build_svd_merge(spec, base_dir: Path, experts: dict[str, Path], out: Path, pre_merged: Path | None = None) -> dict:
    """Build ``spec`` into ``out``: an SVD merge (``spec.method`` in tsv_m / iso_c / iso_cts) of ``experts``
    over ``base_dir``, or (``pre_merged``: the dir of the merge ``spec.method`` already built, e.g. by
    mergekit) that merge; then SVC when ``spec.svc_alpha`` is set. Writes :data:`SUMMARY` beside the weights
    and returns it (method, sources, settings, 2-D matrices merged / calibrated, seconds).

    Raises:
        ValueError: neither an SVD method nor ``pre_merged``; shapes or tensor names differ between the models."""
    base, exp = _readers(base_dir, experts)
    names = list(experts)
    summary: dict = {"method": spec.method, "experts": names}
    t0 = time.perf_counter()
    if pre_merged is None:
        if spec.method not in PAPERS:
            raise ValueError(f"merge {spec.name!r}: {spec.method} is not an SVD merge; pass the merge built by mergekit")
        w = spec.weight
        weight = [w[e] for e in names] if isinstance(w, dict) else w
        sd = merge_state_dict(spec.method, base, [exp[e] for e in names], weight, spec.common_space_fraction)
        summary.update({"paper": PAPERS[spec.method], "weight": w,
                        "matrices": sum(1 for v in sd.values() if v.dim() == 2), "merge_seconds": 0.0})
        if spec.method == "iso_cts":
            summary["common_space_fraction"] = (ISO_CTS_COMMON_SPACE_FRACTION if spec.common_space_fraction is None
                                                else spec.common_space_fraction)
        summary["merge_seconds"] = round(time.perf_counter() - t0, 3)
        merged = sd
    else:
        merged = _Reader(pre_merged)
    if spec.svc_alpha is not None:
        t1 = time.perf_counter()
        merged = calibrate_state_dict(base, [exp[e] for e in names], merged, spec.svc_alpha)
        summary["svc"] = {"paper": PAPERS["svc"], "alpha": spec.svc_alpha,
                          "matrices": sum(1 for v in merged.values() if v.dim() == 2),
                          "seconds": round(time.perf_counter() - t1, 3)}
    elif isinstance(merged, _Reader):
        merged = {k: merged.get(k) for k in merged.keys()}
    _save(merged, base_dir, out, spec.dtype)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    log.info("%s %s: %s", spec.method, spec.name, json.dumps(summary))
    return summary
