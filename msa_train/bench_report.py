"""The end-to-end report, the longest-sequence finder and the planner check (``python -m msa_train.bench ...``).

    python -m msa_train.bench report --out benchmarks/results/e2e [--max-minutes 9] [--only llama3_8b]
    python -m msa_train.bench longest --recipe llama3_8b_64k --attention full,fmsa --out runs/longest
    python -m msa_train.bench plan-check --out runs/plan_check

``report`` runs a grid of points (model shape, attention, seq_len, depth, memory options), each a
fresh ``msa-train`` process with a timeout (``bench.run_point``). Points accumulate in
``<out>/points.jsonl``: a rerun skips the points already there, and ``--max-minutes`` stops starting
new points once that much time has passed, so the grid splits into device calls of a few minutes.
Where a model at full depth did not run (it does not fit, or it was not in the grid), its step time is
fitted per layer from the depths that ran (``fit_per_layer``: least squares ``t = a + b * layers``,
with the residual) and labelled as a fit. ``latest.{json,md,png}`` are written after every point; ``--max-minutes 0`` runs none and rewrites
them from ``points.jsonl`` (on a machine without a GPU, labelled with the GPU the points ran on).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

# Model shapes of the report (configs/model/*.yaml) and the depths measured for a per-layer fit.
SHAPES = {"llama3_8b": 32, "qwen3_14b": 40, "qwen25_32b": 64}
FIT_DEPTHS = (4, 8, 16)
ARMS = ("full", "nsa", "fmsa")
# Memory options of the "same options" comparison: what the full arm needs to fit at 128K on one H200.
SAME_OPTIONS = ("parallel=zero2", "parallel.activation_checkpointing=true", "parallel.tile_tokens=32768",
                "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed")
# Each arm at its fastest options that fit: the first of these, fastest first, that the planner says
# fits the GPU at the model's full depth (the same options then run at every depth of its fit).
FAST_CANDIDATES = (
    ("parallel=zero2", "parallel.activation_checkpointing=false"),
    ("parallel=zero2", "parallel.activation_checkpointing=false", "parallel.offload_optimizer=true",
     "parallel.optimizer=deepspeed"),
    ("parallel=zero2", "parallel.activation_checkpointing=true", "parallel.offload_optimizer=true",
     "parallel.optimizer=deepspeed"),
    SAME_OPTIONS,
    (*SAME_OPTIONS, "parallel.offload_activations=true"),
)


# Host memory the report keeps free beyond the planner's prediction when it picks a point's host share
# of the optimizer state: the 128K fmsa point at 32 layers with 85% on the host, predicted to need
# 124.1 GiB where about 124.3 was available, was killed by the host's out-of-memory killer on the H200
# machine; with 80% (117.4 predicted) it ran.
REPORT_HOST_MARGIN_GB = 4.0

# The host share of the optimizer state a `fastest` point keeps above the smallest the planner fits on
# the GPU: two of the ladder's steps, about 12 GiB for an 8B model (8.5% of a 139 GiB H200).
FASTEST_SHARE_MARGIN = 0.1


def fastest_options(point: "Point", fits: Callable[[List[str]], bool]) -> Tuple[str, ...]:
    """The first of FAST_CANDIDATES for which ``fits(overrides at full depth)`` holds (else the last);
    a point whose host cannot hold them then takes a share of the optimizer state on the GPU
    (:func:`host_share_options`), chosen at its own depth."""
    full = SHAPES.get(point.model, point.layers)
    base = [f"model={point.model}", f"model.hf_config.num_hidden_layers={full}", f"attention={point.attention}",
            f"train.seq_len={point.seq_len}"]
    for cand in FAST_CANDIDATES:
        if fits([*base, *cand]):
            return cand
    return FAST_CANDIDATES[-1]


def _plan(overrides: Sequence[str], recipe: str = "llama3_8b_64k", host_limit_gb: Optional[float] = None):
    """The planner's plan of ``overrides`` on ``recipe`` and the generated data, on this machine's GPU."""
    from msa_train.cli import compose
    from msa_train.parallel.planner import plan_of_config

    return plan_of_config(compose([f"recipe={recipe}", "data=generated", *overrides]), world_size=1,
                          host_limit_gb=host_limit_gb)  # one process, as every point here runs


def _arm_rank(attention: str) -> int:
    """full, nsa, fmsa (ARMS' order) in tables; any other attention after them."""
    return ARMS.index(attention) if attention in ARMS else len(ARMS)


def planner_verdict(overrides: List[str], host_gb: Optional[float] = None) -> Optional[str]:
    """None where the planner predicts that ``overrides`` (on recipe llama3_8b_64k) fit this machine's
    GPU and ``host_gb`` of host memory (default: what is available now), else why not."""
    from msa_train.parallel.planner import host_available_gb

    plan = _plan(overrides, host_limit_gb=host_available_gb() if host_gb is None else host_gb)
    if plan.fits:
        return None
    return (f"predicted not to fit: {plan.peak_gb:.1f} of {plan.gpu_gb:.0f} GiB per GPU, "
            f"{plan.host_need_gb:.1f} of {plan.host_limit_gb:.0f} GiB of host memory")


def planner_fits(overrides: List[str]) -> bool:
    """Whether the planner predicts that ``overrides`` fit this machine's GPU. The host is left out:
    the fastest options are chosen at full depth, which a report fits from shallower runs where the
    host cannot hold the full model's offloaded state (each run is still checked by planner_verdict)."""
    return _plan(overrides).fits


@dataclasses.dataclass(frozen=True)
class Point:
    model: str
    attention: str
    seq_len: int
    layers: int
    options: str  # "same" | "fastest"

    @property
    def key(self) -> str:
        return f"{self.model}/{self.attention}/{self.seq_len}/{self.layers}/{self.options}"


def grid(models: Sequence[str], seq_lens: Sequence[int], depths: Optional[Sequence[int]] = None,
         options: Sequence[str] = ("same", "fastest"), arms: Sequence[str] = ARMS) -> List[Point]:
    """Every point of the report: each model at full depth and at the fit depths, each of ``arms`` in
    their order, the given options (outermost, so that a report split over device calls finishes one
    comparison first)."""
    if not arms or any(a not in ARMS for a in arms):
        raise ValueError(f"arms: expected some of {', '.join(ARMS)}, got {', '.join(arms) or 'none'}")
    points = []
    for opts in options:
        if opts not in ("same", "fastest"):
            raise ValueError(f"options: expected 'same' or 'fastest', got {opts!r}")
        for model in models:
            full = SHAPES.get(model, max(depths or FIT_DEPTHS))
            layer_list = sorted({*(depths or FIT_DEPTHS), *([full] if model == "llama3_8b" or depths else [])})
            for T in seq_lens:
                for L in layer_list:
                    points.extend(Point(model, a, T, L, opts) for a in arms)
    return points


def fit_per_layer(layers: Sequence[int], seconds: Sequence[float]) -> Dict[str, float]:
    """Least-squares ``seconds = fixed + per_layer * layers`` over >= 2 depths; the residual is the RMS
    of the misfit relative to the mean step time (0 for two depths, which a line always fits)."""
    n = len(layers)
    if n < 2 or len(set(layers)) < 2:
        raise ValueError(f"fit_per_layer needs >= 2 distinct depths, got {list(layers)}")
    mx, my = sum(layers) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in layers)
    b = sum((x - mx) * (y - my) for x, y in zip(layers, seconds)) / sxx
    a = my - b * mx
    rms = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(layers, seconds)) / n)
    return {"fixed_s": a, "per_layer_s": b, "relative_residual": rms / my if my else 0.0, "depths": list(layers)}


def sparse_attention_flops_per_token(seq_len: int, heads: int, head_dim: int, cmp_block: int = 32,
                                     cmp_stride: int = 16, slc_block: int = 64, slc_topk: int = 16,
                                     window: int = 512, kv_heads: Optional[int] = None) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token and layer that NSA's branches do,
    averaged over a causal sequence of ``seq_len`` (one document):

    * compressed attention: QK^T and PV over the visible compressed tokens, about t / d at position t,
      mean T / (2d): 2 matmuls x 2 FLOPs x HQ*D x T / (2d);
    * selected attention: n blocks of l' keys (fewer near the start; counted full): 4 x HQ*D x n*l';
    * sliding window: min(t, w) keys, mean about w for T >> w: 4 x HQ*D x w;
    * compression phi (a per-head linear map of l keys of D to one of D, for keys and values):
      2 x 2 x l*D*D per compressed token and KV head, one compressed token per d tokens.
    The gates and the selection's top-k are elementwise (not counted, as dense MFU counts no softmax).
    """
    kv_heads = kv_heads or heads
    mean_window = min(window, seq_len / 2)
    attn = 4 * heads * head_dim * (seq_len / (2 * cmp_stride) + min(slc_topk * slc_block, seq_len / 2) + mean_window)
    phi = 4 * kv_heads * cmp_block * head_dim * head_dim / cmp_stride
    return 3 * (attn + phi)


def mfu(tokens_per_s: float, n_matmul: int, layers: int, heads: int, head_dim: int, seq_len: int,
        attention: str, peak_tflops: float, **nsa_sizes) -> Dict[str, float]:
    """MFU two ways: ``dense_equivalent`` counts dense causal attention whatever ran (so arms compare
    at equal work); ``actual`` counts the FLOPs the run's attention really did (NSA's branches)."""
    from msa_train.metrics import model_flops_per_token

    dense = model_flops_per_token(n_matmul, layers, heads * head_dim, seq_len / 2)
    actual = dense
    if attention != "full":
        actual = 6.0 * n_matmul + layers * sparse_attention_flops_per_token(seq_len, heads, head_dim, **nsa_sizes)
    peak = peak_tflops * 1e12
    return {"dense_equivalent": dense * tokens_per_s / peak, "actual": actual * tokens_per_s / peak}


# ----------------------------------------------------------------------- results file
def load_points(path: Path) -> Dict[str, Dict]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["key"]: r for r in rows}


def predicted_seconds(point: Point, done: Dict[str, Dict], steps: int) -> Optional[float]:
    """The seconds ``point`` would take, from the per-layer fit of the same model, attention, length
    and options at the depths already measured: ``steps`` steps and one more for the profiled step's
    overhead, plus the slowest startup and the longest rest of a process (imports, exit) recorded
    there; None without two depths to fit."""
    same = [r for r in done.values() if r.get("ok") and r.get("step_s") and (r["model"], r["attention"], r["seq_len"],
            r["options"]) == (point.model, point.attention, point.seq_len, point.options)]
    depths = {r["layers"]: r for r in same}
    if len(depths) < 2:
        return None
    fit = fit_per_layer(sorted(depths), [depths[L]["step_s"] for L in sorted(depths)])
    seconds = [r.get("seconds") or {} for r in same]
    startup = max((s.get("startup") or 0.0) for s in seconds)
    # the process's time outside its startup and training loop (imports, saving, exit): 18-26 s a point
    rest = max(((s.get("process") or 0.0) - (s.get("startup") or 0.0) - (s.get("training_loop") or 0.0)
                for s in seconds if s.get("process")), default=0.0)
    return (steps + 1) * (fit["fixed_s"] + fit["per_layer_s"] * point.layers) + startup + rest


def run_grid(points: Iterable[Point], results: Path, run: Callable[[Point], Dict],
             max_seconds: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
             timeout: Optional[float] = None, steps: int = 5) -> Dict[str, Dict]:
    """Run the points not yet in ``results`` (one JSON line each, appended as it finishes), until
    ``max_seconds`` have passed; returns all points recorded. A point the planner skipped is tried
    again (the host memory available, which the skip weighed, changes between runs). A point that
    shallower depths predict to outlast ``timeout`` (:func:`predicted_seconds`; full attention at
    256K and 32 layers, about 20 minutes) is recorded as skipped, not run: its row is then a fit."""
    results.parent.mkdir(parents=True, exist_ok=True)
    done = load_points(results)
    t0 = clock()
    for point in points:
        if point.key in done and not done[point.key].get("skipped"):
            continue
        if max_seconds is not None and clock() - t0 >= max_seconds:
            break
        eta = predicted_seconds(point, done, steps) if timeout else None
        if eta is not None and eta > timeout:
            why = f"predicted to take {eta:,.0f} s (fitted from the depths measured), more than --timeout {timeout:.0f}"
            row = {"key": point.key, **dataclasses.asdict(point), "ok": False, "skipped": True, "error": why}
        else:
            row = {"key": point.key, **dataclasses.asdict(point), **run(point)}
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done[point.key] = row
    return done


def summarise_rows(rows: Dict[str, Dict], shapes: Dict[str, Dict]) -> List[Dict]:
    """One row per (model, attention, seq_len, options) at full depth: measured where it ran there,
    else fitted per layer from the depths that ran (labelled). Adds speedups over full and nsa."""
    groups: Dict[Tuple, List[Dict]] = {}
    for r in rows.values():
        groups.setdefault((r["model"], r["attention"], r["seq_len"], r["options"]), []).append(r)
    out = []
    for (model, att, T, opts), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][3], kv[0][2],
                                                                                 _arm_rank(kv[0][1]))):
        full_depth = shapes.get(model, {}).get("layers", SHAPES.get(model))
        ok = {r["layers"]: r for r in rs if r.get("ok") and r.get("step_s")}
        row = {"model": model, "attention": att, "seq_len": T, "options": opts, "layers": full_depth}
        if full_depth in ok:
            r = ok[full_depth]
            row |= {"source": "measured", "step_s": r["step_s"], "peak_memory_gb": r.get("peak_memory_gb"),
                    "phase_s": r.get("phase_s"), "breakdown": r.get("breakdown"), "dense_kernel": r.get("dense_kernel"),
                    "impl": r.get("impl")}
        elif len(ok) >= 2:
            fit = fit_per_layer(sorted(ok), [ok[L]["step_s"] for L in sorted(ok)])
            deepest = ok[max(ok)]
            row |= {"source": f"fit over {len(ok)} depths {sorted(ok)}", "fit": fit,
                    "step_s": fit["fixed_s"] + fit["per_layer_s"] * full_depth, "peak_memory_gb": None,
                    "phase_s": deepest.get("phase_s"), "breakdown": deepest.get("breakdown"),
                    "dense_kernel": deepest.get("dense_kernel"),
                    "impl": deepest.get("impl")}
        elif ok:
            row |= {"source": f"measured at one depth {sorted(ok)} only: no fit", "step_s": None}
        else:
            failed = [r.get("error") for r in rs if not r.get("ok")]
            row |= {"source": "not run" if not failed else f"failed: {failed[-1]}", "step_s": None}
        row["tokens_per_s"] = T / row["step_s"] if row.get("step_s") else None
        shape = shapes.get(model)
        if row["tokens_per_s"] and shape and shape.get("peak_tflops"):
            row["mfu"] = mfu(row["tokens_per_s"], shape["n_matmul"], full_depth, shape["heads"], shape["head_dim"], T,
                             att, shape["peak_tflops"])
        out.append(row)
    by = {(r["model"], r["attention"], r["seq_len"], r["options"]): r for r in out}
    for r in out:
        for base in ("full", "nsa"):
            b = by.get((r["model"], base, r["seq_len"], r["options"]), {}).get("tokens_per_s")
            r[f"speedup_over_{base}"] = r["tokens_per_s"] / b if (b and r["tokens_per_s"]) else None
    return out


# The report's phases, from the profiled step's device time by kind (msa_train.metrics.kernel_kind):
# shares of that step's kernel time. What is left is the rest of the layers (their matmuls, norms,
# RoPE, SwiGLU, copies) and the LM head's matmul, which cuBLAS runs like the layers'.
BREAKDOWN = {"attention": ("dense attention (cuDNN / flash SDPA)", "flash_msa (Triton)"),
             "loss": ("cross-entropy rows (Triton)",), "optimizer": ("optimizer (AdamW)",),
             "communication": ("collectives (NCCL)",)}


def breakdown(profile: Optional[Dict]) -> Optional[Dict[str, float]]:
    """Shares of a profiled step's kernel time (``train.profile_step``'s summary): attention, the
    rest of the layers, loss, optimizer, communication; None without device kernels (a CPU run)."""
    kinds = (profile or {}).get("kinds_ms") or {}
    total = sum(kinds.values())
    if not total:
        return None
    out = {name: sum(kinds.get(k, 0.0) for k in ks) / total for name, ks in BREAKDOWN.items()}
    return {"attention": out["attention"], "rest_of_layers": 1.0 - sum(out.values()),
            **{k: out[k] for k in ("loss", "optimizer", "communication")}}


COLUMNS = ("model", "options", "seq_len", "attention", "source", "tokens_per_s", "step_s", "speedup_over_full",
           "speedup_over_nsa", "peak_memory_gb", "dense_kernel", "mfu_dense_equivalent", "mfu_actual",
           "forward_backward_s", "optimizer_s", "attention_share", "rest_of_layers_share", "loss_share",
           "optimizer_share", "communication_share")


def _cells(r: Dict) -> List[str]:
    def fmt(v, f="{:.3g}"):
        return "-" if v is None else (f.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))

    m, ph, br = r.get("mfu") or {}, r.get("phase_s") or {}, r.get("breakdown") or {}
    return [r["model"], r["options"], f"{r['seq_len']:,}", r["attention"], r["source"],
            fmt(r.get("tokens_per_s"), "{:,.0f}"), fmt(r.get("step_s")), fmt(r.get("speedup_over_full"), "{:.2f}x"),
            fmt(r.get("speedup_over_nsa"), "{:.2f}x"), fmt(r.get("peak_memory_gb"), "{:.1f}"),
            fmt(r.get("dense_kernel") if r["attention"] == "full" else r.get("impl")),
            fmt(m.get("dense_equivalent"), "{:.1%}"), fmt(m.get("actual"), "{:.1%}"),
            *(fmt(ph.get(k)) for k in ("forward_backward", "optimizer")),
            *(fmt(br.get(k), "{:.0%}") for k in ("attention", "rest_of_layers", "loss", "optimizer", "communication"))]


def write_report(rows: List[Dict], out: Path, meta: Dict) -> None:
    """latest.json (rows + meta), latest.md (one table, every column) and latest.png (tokens/s, speedup)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# End-to-end training at full model depth on {meta.get('device')}", "",
             "tokens/s per GPU; `source` says whether a row was measured at full depth or fitted per layer "
             "(`t = fixed + per_layer x layers`, least squares over the depths that ran, residual in latest.json). "
             "Options: `same` = the same memory options for every arm, `fastest` = each arm at its fastest "
             "options that fit. Phases in seconds per step (`train.phase_times`: forward + backward, and the "
             "optimizer step; from the deepest measured run for fitted rows). Shares: of the kernel time of one "
             "profiled step (`train.profile_step`, left out of the timing): attention, the rest of the layers (and "
             "the LM head's matmul), the loss's kernels, the optimizer's, communication. MFU: dense-equivalent FLOPs, and the FLOPs the attention really did.", "",
             "| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    recorded = meta.get("measured") or []
    measured = [r for r in recorded if r.get("ok") and r.get("step_s")]
    if measured:
        lines += ["", "Every measured point (the fits' inputs): seconds per step, tokens/s, and speedup over "
                  "`attention=full` at the same model, options, length and depth:", "",
                  "| model | options | seq_len | layers | attention | step_s | tokens_per_s | speedup_over_full | peak_memory_gb |",
                  "|---|---|---|---|---|---|---|---|---|"]
        at = {(r["model"], r["options"], r["seq_len"], r["layers"], r["attention"]): r for r in measured}
        for r in sorted(measured, key=lambda r: (r["model"], r["options"], r["seq_len"], r["layers"],
                                                 _arm_rank(r["attention"]))):
            base = at.get((r["model"], r["options"], r["seq_len"], r["layers"], "full"))
            speedup = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
            peak = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") else "-"
            lines.append(f"| {r['model']} | {r['options']} | {r['seq_len']:,} | {r['layers']} | {r['attention']} | "
                         f"{r['step_s']:.3g} | {r['seq_len'] / r['step_s']:,.0f} | {speedup} | {peak} |")
    failed = [r for r in recorded if not r.get("ok")]
    if failed:
        lines += ["", "Points that did not run (a prediction) or failed:", "",
                  *(f"- `{r['key']}`: {r.get('error')}" for r in failed)]
    (out / "latest.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (model, att, opts) in sorted({(r["model"], r["attention"], r["options"]) for r in rows}):
        pts = sorted((r["seq_len"], r) for r in rows if (r["model"], r["attention"], r["options"]) == (model, att, opts)
                     and r.get("tokens_per_s"))
        if not pts:
            continue
        label = f"{model} {att} ({opts})"
        ax1.plot([T for T, _ in pts], [r["tokens_per_s"] for _, r in pts], marker="o", label=label)
        sp = [(T, r["speedup_over_full"]) for T, r in pts if r.get("speedup_over_full") and att != "full"]
        if sp:
            ax2.plot(*zip(*sp), marker="o", label=label)
    for ax, title in ((ax1, "tokens/s"), (ax2, "speedup over full")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "latest.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------- running a point
def host_share_options(point: Point, opts: Sequence[str],
                       verdict: Callable[[List[str]], Optional[str]]) -> Tuple[str, ...]:
    """``opts``, or, where they put the whole optimizer state on a host too small for it (``verdict``:
    :func:`planner_verdict`), the same under ZeRO-3 with a host share of it that fits
    (``parallel.offload_ratio``: DeepSpeed steps the rest on the GPU), so that a model whose optimizer
    state outgrows the host (Llama-3-8B's 32 layers on a 125 GiB host) still trains at full depth.

    ``same``: the largest host share that fits every arm, so the three arms run the same options and
    the GPU keeps the most room. ``fastest``: the arm's fastest share, the smallest on the host (the
    32-layer points' host step, cpu_adam and the copies, took 4.4-4.9 s for 6.4-6.6e9 parameters on
    the H200 machine's 16 cores, about a third of fmsa's step), kept ``FASTEST_SHARE_MARGIN`` above
    the smallest the planner fits on the GPU, whose peak has measured up to 3.3% under the real one
    (8.5% before it counted DeepSpeed's reduce bucket).
    Without a share that fits, ``opts`` (which the verdict then skips)."""
    if "parallel.offload_optimizer=true" not in opts:
        return tuple(opts)
    arms = ARMS if point.options == "same" else (point.attention,)

    def fit_all(cand):
        return all(verdict([f"model={point.model}", f"model.hf_config.num_hidden_layers={point.layers}",
                            *cand, f"attention={a}", f"train.seq_len={point.seq_len}"]) is None for a in arms)

    if fit_all(opts):
        return tuple(opts)
    from msa_train.parallel.planner import PARTIAL_OFFLOAD_RATIOS

    zero3 = ("parallel=zero3", *(o for o in opts if not o.startswith("parallel=")))

    def cand(r):
        return (*zero3, f"parallel.offload_ratio={r}")

    fitting = [r for r in PARTIAL_OFFLOAD_RATIOS if fit_all(cand(r))]  # an interval: host above, GPU below
    if not fitting:
        return tuple(opts)
    if point.options == "same":
        return cand(max(fitting))
    return cand(min(max(fitting), round(min(fitting) + FASTEST_SHARE_MARGIN, 2)))


def point_overrides(point: Point, fits: Callable[[List[str]], bool] = planner_fits,
                    verdict: Optional[Callable[[List[str]], Optional[str]]] = None) -> List[str]:
    """The overrides of a point: its model and depth, and its options (``verdict``: with a host share
    of the optimizer state where the host cannot hold it all, :func:`host_share_options`)."""
    opts = SAME_OPTIONS if point.options == "same" else fastest_options(point, fits)
    if verdict is not None:
        opts = host_share_options(point, opts, verdict)
    return [f"model={point.model}", f"model.hf_config.num_hidden_layers={point.layers}", "train.phase_times=true",
            *opts]


def profiled_step(steps: int) -> str:
    """The override that profiles a point's last step (:func:`breakdown`); the timing leaves it out."""
    return f"train.profile_step={steps}"


def measure_point(point: Point, steps: int, warmup: int, timeout: int, workdir: Path, device: str,
                  verdict: Callable[[List[str]], Optional[str]] = planner_verdict) -> Dict:
    """One point as a fresh process (bench.run_point); its step time, peak memory, phases and kernels.
    A point the planner predicts not to fit this machine (``verdict``) is recorded as failed, with the
    prediction, and not run: a full-depth point that needs more host memory than there is would only
    be killed minutes later."""
    from msa_train import bench_points as bench

    overrides = point_overrides(point, verdict=verdict)
    why = verdict([*overrides, f"attention={point.attention}", f"train.seq_len={point.seq_len}"])
    if why:
        return {"ok": False, "error": why, "skipped": True, "device": device, "overrides": overrides}
    p = bench.run_point("llama3_8b_64k", point.attention, point.seq_len, steps, [*overrides, profiled_step(steps)],
                        workdir, timeout)
    tps = bench.summarise(p, warmup)
    phases = bench.phase_means(p, warmup) or {}
    ran = bench.what_ran(point.attention, device)
    row = {"ok": p["ok"], "error": p.get("error"), "peak_memory_gb": p.get("peak_memory_gb"),
           "step_s": point.seq_len / tps if tps else None, "impl": ran["impl"], "device": device,
           "overrides": overrides}
    summary = p.get("summary") or {}
    row["seconds"] = {"process": p.get("process_s"), "startup": round(sum((summary.get("startup_s") or {}).values()), 2),
                      "training_loop": summary.get("wall_time_s")}  # where a point's device time goes
    if point.attention == "full":
        row["dense_kernel"] = ran["impl"]
    if phases:  # the layers, attention and the loss together (train.phase_times times no finer)
        row["phase_s"] = {"forward_backward": phases["forward_s"] + phases["backward_s"], "optimizer": phases["step_s"]}
    row["breakdown"] = breakdown(p.get("profile"))  # finer: by kernel kind, from the profiled step
    return row


def _shapes(models: Sequence[str], peak_tflops: Optional[float]) -> Dict[str, Dict]:
    from msa_train.cli import compose
    from msa_train.models import count_parameters
    from msa_train.parallel.planner import ModelShape

    out = {}
    for model in models:
        cfg = compose([f"model={model}", "data=generated", "attention=full"])
        shape = ModelShape.from_config(cfg.model, cfg.attention)
        out[model] = {"layers": shape.layers, "heads": shape.heads, "head_dim": shape.head_dim,
                      "n_matmul": count_parameters(cfg.model, cfg.attention)[1], "peak_tflops": peak_tflops}
    return out


def seed_points(out: Path, device: str, steps: int, warmup: int) -> str:
    """Without ``<out>/points.jsonl``, start it from ``<out>/latest.json``'s recorded points (the
    committed report, copied there), where they ran on this GPU (any, on a machine without one, which
    only summarises) with the same steps and warmup: all but those the planner skipped or that
    failed, which are tried again (a failure may have been the machine's, or options since changed).
    Returns what it did."""
    points, latest = out / "points.jsonl", out / "latest.json"
    if points.exists() or not latest.exists():
        return "report: " + ("continuing " + str(points) if points.exists() else "no earlier points")
    meta = json.loads(latest.read_text()).get("meta", {})
    if (meta.get("steps"), meta.get("warmup")) != (steps, warmup) or device not in ("cpu", meta.get("device")):
        return (f"report: not starting from {latest}: its points ran on {meta.get('device')} with --steps "
                f"{meta.get('steps')} --warmup {meta.get('warmup')}, this is {device} with {steps} and {warmup}")
    kept = [r for r in meta.get("measured", []) if r.get("ok")]
    points.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return f"report: starting from {len(kept)} points of {latest} (the planner's skips and the failures are tried again)"


def report(argv: Sequence[str]) -> List[Dict]:
    p = argparse.ArgumentParser(prog="python -m msa_train.bench report", description="the end-to-end report")
    p.add_argument("--out", default="runs/bench/e2e", help="folder of latest.* and points.jsonl")
    p.add_argument("--models", default="llama3_8b,qwen3_14b,qwen25_32b")
    p.add_argument("--seq-lens", default="65536,131072,262144")
    p.add_argument("--depths", default=None, help="comma-separated depths (default 4,8,16 and Llama3-8B's 32)")
    p.add_argument("--options", default="same,fastest", help="which comparisons, comma-separated: same, fastest")
    p.add_argument("--arms", default=",".join(ARMS),
                   help="which attentions to run, in this order (a report split over device calls; the table "
                        "compares whatever points.jsonl holds)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=540, help="seconds per point")
    p.add_argument("--max-minutes", type=float, default=None, help="start no point after this many minutes")
    args = p.parse_args(list(argv))
    import torch

    from msa_train.metrics import peak_tflops_of

    out = Path(args.out)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(seed_points(out, device, args.steps, args.warmup))
    if device == "cpu":  # summarising points measured elsewhere (--max-minutes 0): label them as measured
        measured = {r.get("device") for r in load_points(out / "points.jsonl").values()} - {None, "cpu"}
        device = measured.pop() if len(measured) == 1 else device
    peak = peak_tflops_of(device)
    models = args.models.split(",")
    depths = [int(x) for x in args.depths.split(",")] if args.depths else None
    points = grid(models, [int(x) for x in args.seq_lens.split(",")], depths, args.options.split(","),
                  args.arms.split(","))
    work = out / "runs"
    from msa_train.parallel.planner import host_available_gb

    # the host memory every verdict of this run weighs, read once before any point runs: the arms of a
    # point then get the same host share of the optimizer state (host_share_options), less a margin
    host_gb = host_available_gb() - REPORT_HOST_MARGIN_GB
    rows = run_grid(points, out / "points.jsonl",
                    lambda pt: measure_point(pt, args.steps, args.warmup, args.timeout, work, device,
                                             verdict=functools.partial(planner_verdict, host_gb=host_gb)),
                    None if args.max_minutes is None else args.max_minutes * 60, timeout=args.timeout, steps=args.steps)
    table = summarise_rows(rows, _shapes(models, peak))
    write_report(table, out, {"device": device, "points": len(rows), "grid": len(points),
                              "steps": args.steps, "warmup": args.warmup,
                              # the host memory the planner's skips weighed (none when only summarising)
                              "host_available_gb": round(host_gb, 1) if torch.cuda.is_available() else None,
                              "measured": sorted(rows.values(), key=lambda r: r["key"])})
    print((out / "latest.md").read_text())
    return table


# ----------------------------------------------------------------------- longest sequence
def longest(fits: Callable[[int], bool], start: int, multiple: int, ceiling: int = 1 << 24,
            refine: Optional[int] = None) -> Tuple[int, List[int]]:
    """The longest ``seq_len`` (a multiple of ``multiple``) for which ``fits`` holds, assuming it holds
    below some threshold and not above: from ``start`` (the planner's estimate, rounded to a power of
    two), double or halve to bracket it between powers of two, then bisect in steps of ``multiple``,
    at most ``refine`` times (None: down to ``multiple``; 3 finds it within an eighth of the power of
    two below it, where each trial at a model's full depth takes minutes).
    Returns (the length, the lengths tried in order); 0 when not even ``multiple`` fits."""
    tried: List[int] = []

    def ok(T):
        tried.append(T)
        return fits(T)

    T = max(multiple, 1 << max(0, round(math.log2(max(1, start)))))
    if ok(T):
        lo, hi = T, None
        while hi is None:
            if lo * 2 > ceiling:
                return lo, tried
            if ok(lo * 2):
                lo *= 2
            else:
                hi = lo * 2
    else:
        hi, lo = T, None
        while lo is None:
            if hi // 2 < multiple:
                return (multiple if ok(multiple) else 0), tried
            if ok(hi // 2):
                lo = hi // 2
            else:
                hi //= 2
    steps = 0
    while hi - lo > multiple:  # bisect between lo (fits) and hi (does not), in steps of `multiple`
        mid = (lo + hi) // 2 // multiple * multiple
        if mid in (lo, hi) or (refine is not None and steps >= refine):
            break
        steps += 1
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


class _Undecided(Exception):
    """A finder trial that timed out: it says nothing about whether that length fits."""

    def __init__(self, seq_len: int, error: str):
        super().__init__(error)
        self.seq_len, self.error = seq_len, error


def longest_cmd(argv: Sequence[str]) -> Dict:
    p = argparse.ArgumentParser(prog="python -m msa_train.bench longest", description="the longest trainable seq_len")
    p.add_argument("--recipe", default="llama3_8b_64k")
    p.add_argument("--attention", default="full,fmsa")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--out", default="runs/bench/longest")
    p.add_argument("--refine", type=int, default=3,
                   help="bisection trials after bracketing between powers of two (3: within an eighth; -1: to the "
                        "attention's length multiple)")
    args, extra = p.parse_known_args(list(argv))
    extra = [x for x in extra if x != "--"]
    import torch

    from msa_train import bench_points as bench
    from msa_train.cli import compose
    from msa_train.parallel.planner import host_available_gb, plan_of_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    table = {}
    for att in args.attention.split(","):
        cfg = compose([f"recipe={args.recipe}", f"attention={att}", "data=generated", *extra])
        multiple = math.lcm(cfg.attention.slc_block if att != "full" else 1, cfg.parallel.sp_degree, 64)
        host = host_available_gb()

        def plan_at(T):
            return plan_of_config(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=T)),
                                  world_size=1, host_limit_gb=host)  # one process, as run_point starts

        shortest = plan_at(multiple)
        if shortest.host_need_gb > host:  # no length fits: the model state alone is too big for the host
            table[att] = {"longest": 0, "planner_start": 0, "tried": [], "device": device,
                          "reason": f"predicted not to fit at any length: {shortest.host_need_gb:.1f} GiB of host "
                                    f"memory needed, {host:.0f} available"}
            text = _write_longest(out, table)
            continue
        start = cfg.train.seq_len
        while True:  # the planner's longest power of two that fits, as the search's start
            if start * 2 > (1 << 24) or not plan_at(start * 2).fits:
                break
            start *= 2
        runs: Dict[int, bool] = {}

        def fits(T):
            point = bench.run_point(args.recipe, att, T, args.steps, extra, out / "runs", args.timeout)
            if not point["ok"] and str(point.get("error", "")).startswith("timeout"):
                raise _Undecided(T, point["error"])  # too slow to tell, not too big: the search stops
            runs[T] = point["ok"]
            return point["ok"]

        try:
            best, tried = longest(fits, start, multiple, refine=None if args.refine < 0 else args.refine)
            table[att] = {"longest": best, "planner_start": start, "tried": tried, "device": device,
                          "not_fitting": min([T for T, ok in runs.items() if not ok], default=None)}
        except _Undecided as stop:
            tried = [*runs, stop.seq_len]
            table[att] = {"longest": max([T for T, ok in runs.items() if ok], default=0), "planner_start": start,
                          "tried": tried, "device": device,
                          "reason": f"stopped: the trial at {stop.seq_len:,} ended on a {stop.error} (a longer "
                                    "--timeout decides it); longest is the longest that ran"}
        text = _write_longest(out, table)
    print(text)
    return table


def _write_longest(out: Path, table: Dict) -> str:
    """latest.json and latest.md of the finder, after each attention (a call cut short keeps those done)."""
    (out / "latest.json").write_text(json.dumps(table, indent=2))
    lines = ["| attention | longest seq_len | shortest that did not | planner's start | trials | note |",
             "|---|---|---|---|---|---|"]
    for a, r in table.items():
        above = f"{r['not_fitting']:,}" if r.get("not_fitting") else "-"
        lines.append(f"| {a} | {r['longest']:,} | {above} | {r['planner_start']:,} | {len(r['tried'])} | "
                     f"{r.get('reason', '')} |")
    (out / "latest.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


# ----------------------------------------------------------------------- planner check
# Configurations the planner is validated on: (overrides, label); Llama3-8B shape on one GPU.
PLAN_CHECK = (
    (["model.hf_config.num_hidden_layers=4", "train.seq_len=65536", "attention=full"], "4 layers 64K full"),
    (["model.hf_config.num_hidden_layers=4", "train.seq_len=65536", "attention=fmsa"], "4 layers 64K fmsa"),
    (["model.hf_config.num_hidden_layers=8", "train.seq_len=131072", "attention=fmsa",
      "parallel.tile_tokens=32768"], "8 layers 128K fmsa tiled"),
    (["model.hf_config.num_hidden_layers=16", "train.seq_len=65536", "attention=full",
      "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed"], "16 layers 64K full, optimizer offload"),
    (["model.hf_config.num_hidden_layers=4", "train.seq_len=262144", "attention=fmsa", "parallel.tile_tokens=32768",
      "parallel.offload_activations=true"], "4 layers 256K fmsa tiled, activations offload"),
    (["train.seq_len=65536", "attention=fmsa", "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed",
      "parallel.tile_tokens=32768"], "32 layers 64K fmsa, optimizer offload"),
)


def _predicted_gb(overrides: Sequence[str], recipe: str = "llama3_8b_64k") -> Dict[str, float]:
    """The planner's allocated peak (what ``torch.cuda.max_memory_allocated`` measures) and host need."""
    plan = _plan(overrides, recipe)
    return {"predicted_gb": plan.allocated_gb, "predicted_host_gb": plan.host_gb * plan.ranks_per_host}


def _short_override(override: str) -> str:
    """``parallel.offload_ratio=0.8`` -> ``offload_ratio=0.8``: the setting's last name and its value."""
    key, eq, value = override.partition("=")
    return f"{key.split('.')[-1]}{eq}{value}"


def bench_rows(path: Path) -> List[Dict]:
    """Plan-check rows from a bench result JSON (``python -m msa_train.bench``: its recipe, extra
    overrides and each point's measured peak, or the end-to-end report's latest.json: each measured
    point's overrides and peak), so the peaks other benchmarks measured check the planner too;
    ``source`` names the file."""
    d = json.loads(Path(path).read_text())
    if "measured" in d.get("meta", {}):  # the end-to-end report's latest.json: its measured points
        return [{"key": f"{pt['layers']} layers {pt['seq_len'] // 1024}K {pt['attention']} (e2e report, {pt['options']})",
                 "overrides": [*pt["overrides"], f"train.seq_len={pt['seq_len']}", f"attention={pt['attention']}"],
                 "recipe": "llama3_8b_64k", "measured_gb": pt["peak_memory_gb"], "error": None,
                 "source": str(path), "device": pt.get("device")}
                for pt in d["meta"]["measured"] if pt.get("ok") and pt.get("peak_memory_gb")]
    rows = []
    for pt in d["points"]:
        if not pt.get("peak_memory_gb"):
            continue
        overrides = [*d.get("extra_overrides", []), f"train.seq_len={pt['seq_len']}", f"attention={pt['attention']}"]
        extra = " ".join(_short_override(o) for o in d.get("extra_overrides", [])
                         if not o.startswith(("train.phase_times=", "train.profile_step=")))
        rows.append({"key": f"{d['recipe']} {pt['attention']} {pt['seq_len'] // 1024}K {extra}".strip(),
                     "overrides": overrides, "recipe": d["recipe"], "measured_gb": pt["peak_memory_gb"],
                     "error": None, "source": str(path), "device": d.get("device")})
    return rows


def plan_check(argv: Sequence[str]) -> List[Dict]:
    p = argparse.ArgumentParser(prog="python -m msa_train.bench plan-check",
                                description="the memory planner against measured peaks")
    p.add_argument("--out", default="runs/bench/plan_check")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--add-bench", action="append", default=[], metavar="JSON",
                   help="also check the peaks measured by a bench result file (python -m msa_train.bench ...)")
    p.add_argument("--repredict", action="store_true",
                   help="no GPU: keep the measured peaks of <out>/latest.json and points.jsonl and predict them again with "
                        "the current planner (after a change to it)")
    args = p.parse_args(list(argv))
    from msa_train import bench_points as bench

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the last table (latest.json, what the maintainers commit), then the points measured since
    rows = {r["key"]: r for r in json.loads((out / "latest.json").read_text())} if (out / "latest.json").is_file() else {}
    rows |= load_points(out / "points.jsonl")
    for path in args.add_bench:
        for row in bench_rows(Path(path)):
            rows.setdefault(row["key"], row)
    if not args.repredict:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        for overrides, label in PLAN_CHECK:
            if label in rows:
                continue
            att = next(o.split("=")[1] for o in overrides if o.startswith("attention="))
            T = int(next(o.split("=")[1] for o in overrides if o.startswith("train.seq_len=")))
            rest = [o for o in overrides if not o.startswith(("attention=", "train.seq_len="))]
            point = bench.run_point("llama3_8b_64k", att, T, args.steps, rest, out / "runs", args.timeout)
            rows[label] = {"key": label, "overrides": list(overrides), "recipe": "llama3_8b_64k",
                           "measured_gb": point.get("peak_memory_gb"), "error": point.get("error"),
                           "source": "plan-check", "device": device}
            with (out / "points.jsonl").open("a") as f:  # each measured point kept as it comes
                f.write(json.dumps(rows[label]) + "\n")
    for row in rows.values():  # every row predicted by the current planner
        row |= _predicted_gb(row["overrides"], row.get("recipe", "llama3_8b_64k"))
        m = row["measured_gb"]
        row["relative_error"] = (row["predicted_gb"] - m) / m if m else None
    table = list(rows.values())
    lines = ["Peak device memory per GPU: the planner's allocated peak (`allocated_gb`, without its "
             "context margin) against `torch.cuda.max_memory_allocated` of each run (2 steps for plan-check's own, 4 for the e2e report's)." , "",
             "| configuration | measured on | predicted GiB | measured GiB | error |", "|---|---|---|---|---|"]
    for r in table:
        where = r.get("device") or "-"
        if r["measured_gb"]:
            lines.append(f"| {r['key']} | {where} | {r['predicted_gb']:.1f} | {r['measured_gb']:.1f} | "
                         f"{r['relative_error']:+.1%} |")
        else:
            lines.append(f"| {r['key']} | {where} | {r['predicted_gb']:.1f} (host {r['predicted_host_gb']:.0f}) | "
                         f"- | {r['error']} |")
    measured = [r for r in table if r["relative_error"] is not None]
    within = sum(1 for r in measured if abs(r["relative_error"]) <= args.tolerance)
    lines += ["", f"{within} of {len(measured)} measured configurations within {args.tolerance:.0%}"]
    (out / "latest.md").write_text("\n".join(lines) + "\n")
    (out / "latest.json").write_text(json.dumps(table, indent=2))
    print("\n".join(lines))
    return table


def main(argv: Sequence[str]):
    command, rest = argv[0], list(argv[1:])
    return {"report": report, "longest": longest_cmd, "plan-check": plan_check}[command](rest)
