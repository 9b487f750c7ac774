"""Whole-NSA benchmark on one GPU: Triton NSA (forward + backward) against dense causal SDPA.

For each model shape (Llama3-8B: HQ 32 / HK 8, Qwen3-14B: HQ 40 / HK 8, the quality study's 170M model: HQ 8 / HK 2; D 128) it
  1. checks correctness first, at --check-T (default 8K, the full head shape): the Triton NSA
     (bf16) against flash_msa.reference.nsa_attention (fp32 on the same bf16 inputs): o and every
     gradient, and the top-k sets of the Triton selection against the reference selection.
     The fp32 reference is too slow and too large at 64K+, so the check runs at a mid size;
  2. for every T: whole NSA forward and forward + backward, a per-branch breakdown (compress,
     compressed attention, top-k, selected, window, gates; each timed alone, fwd + bwd except
     top-k which has no backward), peak memory, and dense causal SDPA with the cuDNN and the
     flash backends (fwd + bwd).
NSA defaults: l=32, d=16, l'=64, n=16, w=512. Inputs: random bf16, never zero.
Timing: triton.testing.do_bench (median) up to --do-bench-max-t; above it (where one call takes
seconds) the median of --reps CUDA-event-timed calls after one warm-up call.

Usage (repo root, on the GPU machine):
    PYTHONPATH=kernels:. python scripts/bench_nsa.py --out OUTDIR [--Ts 8192,...] [--models llama3_8b,qwen3_14b]
    python scripts/bench_nsa.py --plot-only OUTDIR/nsa_h200.json   # re-render the PNG and table
Writes OUTDIR/nsa_h200.{json,md,png}; results are written after every measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

MODELS = {"llama3_8b": (32, 8, 128), "qwen3_14b": (40, 8, 128),
          "quality_170m": (8, 2, 128)}  # recipes/quality_170m.yaml: the quality study's model (docs/quality.md)
SIZES = dict(cmp_block=32, cmp_stride=16, slc_block=64, slc_topk=16, window=512)
BRANCH_NAMES = ("compress", "cmp_attn", "topk", "selected", "window", "gates")


def rel_rms(x, ref):
    from flash_msa.utils.compare import rel_rms as chunked  # lazy: --plot-only needs no torch
    return chunked(x, ref)


def make_inputs(T, HQ, HK, D, device, seed=0):
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    l = SIZES["cmp_block"]

    def rnd(*shape, s=1.0, dtype=torch.bfloat16):  # random, never zero
        x = torch.randn(*shape, device=device, generator=gen) * s
        return torch.where(x.abs() < 1e-3 * s, torch.full_like(x, 1e-3 * s), x).to(dtype)

    q, k, v = rnd(1, T, HQ, D), rnd(1, T, HK, D), rnd(1, T, HK, D)
    gates = torch.sigmoid(rnd(1, T, HQ, 3, dtype=torch.float32))
    mean = (torch.eye(D, device=device) / l).repeat(l, 1).expand(HK, -1, -1)
    kw, vw = ((mean + rnd(HK, l * D, D, s=0.02 / l, dtype=torch.float32)).to(torch.bfloat16) for _ in range(2))
    kp, vp = rnd(HK, l, D, s=0.1), rnd(HK, l, D, s=0.1)
    kj, vj = rnd(HK, D, D, s=0.02), rnd(HK, D, D, s=0.02)  # phi's second layer (the model's real config)
    leaves = [x.requires_grad_() for x in (q, k, v, gates, kw, kp, vw, vp, kj, vj)]
    do = rnd(1, T, HQ, D)
    return leaves, do


def call_nsa(fn, leaves, **kw):
    """fn(q, k, v, gates, kw, kp, vw, vp, k_cmp_proj=kj, v_cmp_proj=vj, ...) for either nsa_attention."""
    return fn(*leaves[:8], k_cmp_proj=leaves[8], v_cmp_proj=leaves[9], **kw)


def timer(fn, T, args):
    import torch
    import triton
    if T <= args.do_bench_max_t:
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def peak_mib(fn):
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def check(HQ, HK, D, T, device):
    """Triton NSA (bf16) vs the fp32 reference on the same inputs; top-k sets vs the reference selection."""
    import torch
    from flash_msa import nsa_attention, reference, tuning
    from flash_msa.compression.interface import TRITON_BRANCHES as TB
    leaves, do = make_inputs(T, HQ, HK, D, device, seed=1)
    o = call_nsa(nsa_attention, leaves, **SIZES, impl="auto")
    grads = torch.autograd.grad(o, leaves, do)
    # The kernels' own selection (the branch calls nsa_attention makes, recomputed: deterministic)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    with torch.no_grad():
        q0, k0, v0 = (x[0].detach() for x in leaves[:3])
        kc_t, cc = TB.compress(k0, leaves[4], leaves[5], cu, 32, 16, proj=leaves[8])
        vc_t, _ = TB.compress(v0, leaves[6], leaves[7], cu, 32, 16, proj=leaves[9])
        _, lse_t = TB.compressed_attention(q0, kc_t, vc_t, cu, cc, 32, 16, D ** -0.5)
        idx_t = TB.select_blocks(q0, kc_t, lse_t, cu, cc, 32, 16, 64, 16, D ** -0.5)[None]
    names = ("o", "dq", "dk", "dv", "dgates", "dk_cmp_weight", "dk_cmp_pos", "dv_cmp_weight", "dv_cmp_pos",
             "dk_cmp_proj", "dv_cmp_proj")
    # Gate: the fp32 reference on the same bf16 inputs and the kernels' selected blocks
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    o_ref = call_nsa(reference.nsa_attention, ref_leaves, **SIZES, block_indices=idx_t)
    refs = torch.autograd.grad(o_ref, ref_leaves, do.float())
    res = {n: rel_rms(x, r) for n, x, r in zip(names, (o, *grads), (o_ref, *refs))}
    # the same op with compressed attention on cuDNN (compression/dense_cmp.py; "auto" takes it
    # from MIN_GROUPS compressed rows, more than this check size has), against the same reference
    from flash_msa.compression import dense_cmp
    cudnn_names = []
    if dense_cmp.cudnn_supported(leaves[0]):
        with tuning.override(dense_cmp=dict(backend="cudnn")):
            o_c = call_nsa(nsa_attention, leaves, **SIZES, impl="auto")
            grads_c = torch.autograd.grad(o_c, leaves, do)
        cudnn_names = [f"cudnn_cmp_{n}" for n in names]
        res.update({n: rel_rms(x, r) for n, x, r in zip(cudnn_names, (o_c, *grads_c), (o_ref, *refs))})
        cudnn_names.remove("cudnn_cmp_dk_cmp_pos")
    # Reported, not gated: the reference making its own fp32 selection. On random inputs the
    # compressed attention is nearly uniform, so block scores nearly tie and rounding flips some.
    ref_leaves = [x.detach().float() for x in leaves]
    o_own, idx_ref = call_nsa(reference.nsa_attention, ref_leaves, **SIZES, return_indices=True)
    res["o_with_reference_selection"] = rel_rms(o, o_own)
    res["rows_selected_differently"] = 1 - (idx_t.sort(-1).values == idx_ref.sort(-1).values).all(-1).float().mean().item()
    # top-k: Triton selection vs reference selection from the same (reference) lse
    q, k = leaves[0][0].detach(), leaves[1][0].detach()
    kc, cc = reference.compress_kv(k, leaves[4].detach(), leaves[5].detach(), cu, 32, 16, proj=leaves[8].detach())
    _, lse = reference.compressed_attention(q, kc, kc, cu, cc, 32, 16, D ** -0.5)
    a = TB.select_blocks(q, kc, lse, cu, cc, 32, 16, 64, 16, D ** -0.5)
    b = reference.select_blocks(q, kc, lse, cu, cc, 32, 16, 64, 16, D ** -0.5)
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    res["topk_rows_identical"] = same.float().mean().item()
    # forward error of each branch alone (bf16 kernel vs fp32 reference on the same bf16 inputs)
    from flash_msa.selection.interface import selected_attention
    v = leaves[2][0].detach()
    kcb = kc.to(torch.bfloat16)
    vcb = TB.compress(v, leaves[6].detach(), leaves[7].detach(), cu, 32, 16, proj=leaves[9].detach())[0]
    res["fwd_k_cmp"] = rel_rms(TB.compress(k, leaves[4].detach(), leaves[5].detach(), cu, 32, 16,
                                           proj=leaves[8].detach())[0], kc)
    res["fwd_o_cmp"] = rel_rms(TB.compressed_attention(q, kcb, vcb, cu, cc, 32, 16, D ** -0.5)[0],
                               reference.compressed_attention(q.float(), kcb.float(), vcb.float(), cu, cc, 32, 16, D ** -0.5)[0])
    res["fwd_o_swa"] = rel_rms(TB.window_attention(q, k, v, cu, 512, D ** -0.5),
                               reference.window_attention(q.float(), k.float(), v.float(), cu, 512, D ** -0.5))
    res["fwd_o_slc"] = rel_rms(selected_attention(q[None], k[None], v[None], b[None], block_size=64, impl="auto")[0],
                               reference.selected_attention(q.float(), k.float(), v.float(), b, 64, cu, D ** -0.5))
    # dk_cmp_pos is reported, not gated: its mean-path part cancels exactly in exact arithmetic
    # (a constant shift of every compressed key), so in bf16 it is dominated by that rounding.
    gated = [n for n in (*names, "fwd_k_cmp", "fwd_o_cmp", "fwd_o_swa", "fwd_o_slc") if n != "dk_cmp_pos"] + cudnn_names
    res["ok"] = all(res[n] <= 2e-2 for n in gated) and res["topk_rows_identical"] > 0.99
    return res


def parse_settings(text):
    """"op.name=v,op.name2=v;..." -> variants, each {op: {name: value}} for flash_msa.tuning.override;
    values are Python literals (0/1, numbers, True/False, tuples and dicts: commas inside brackets
    do not separate items)."""
    import ast
    out = []
    for var in filter(None, text.split(";")):
        spec = {}
        items, depth, cur = [], 0, ""
        for ch in var:
            depth += (ch in "([{") - (ch in ")]}")
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
            else:
                cur += ch
        items.append(cur)
        for item in filter(None, items):
            path, sep, val = item.partition("=")
            if not sep or "." not in path:
                raise ValueError(f"--compare-settings: expected op.name=value, got {item!r}")
            op, name = path.split(".", 1)
            spec.setdefault(op, {})[name] = ast.literal_eval(val)
        out.append(spec)
    return out


def settings_label(spec):
    return " ".join(f"{op}.{n}={v}" for op, values in spec.items() for n, v in values.items())


def bench_model(name, T, args, device, row):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flash_msa import nsa_attention, tuning
    from flash_msa.compression import dense_cmp
    from flash_msa.compression.interface import TRITON_BRANCHES as TB
    from flash_msa.selection.interface import choose_impl, selected_attention
    HQ, HK, D = MODELS[name]
    scale = D ** -0.5
    leaves, do = make_inputs(T, HQ, HK, D, device)
    q, k, v, gates, kw, kp, vw, vp, kj, vj = leaves
    row["selected_impl"] = choose_impl(q, k, SIZES["slc_topk"], SIZES["slc_block"])
    dense = dense_cmp.dense_layout(q[0], (1, T), SIZES["cmp_block"], SIZES["cmp_stride"])
    row["cmp_backend"] = "triton" if dense is None else "cudnn"

    def fwd():
        return call_nsa(nsa_attention, leaves, **SIZES, impl="auto")

    def fwd_bwd():
        return torch.autograd.grad(fwd(), leaves, do)

    def time_op(prefix):
        """Forward, forward + backward and peak memory of the op as now set up, into row[prefix_*]."""
        with torch.no_grad():
            row[f"{prefix}_fwd_ms"] = timer(fwd, T, args)
        row[f"{prefix}_fwd_bwd_ms"] = timer(fwd_bwd, T, args)
        row[f"{prefix}_peak_mib"] = peak_mib(fwd_bwd)
        save(args)

    def outputs():
        return [fwd().detach(), *fwd_bwd()]

    def max_rel_rms(ref):
        """Largest relative RMS of the op's output and gradients, as now set up, against ``ref``."""
        return max(rel_rms(a, b) for a, b in zip(outputs(), ref))

    o = fwd()
    row["nsa_finite"] = bool(torch.isfinite(o).all().item())
    del o
    time_op("nsa")
    if args.compare_composed:
        # the same op through one autograd Function per branch and the gates (flash_msa/fused.py
        # replaces them), timed side by side in this run
        with tuning.override(fused=dict(single_function=False)):
            time_op("composed")

    if args.compare_local:
        # fmsa's local blocks in the window kernel (flash_msa/fused.py) off, side by side; the
        # outputs and gradients of the two must agree
        from flash_msa import fused as fused_mod
        on = tuning.settings("fused", fused_mod.SETTINGS)["local_in_window"]
        row["local_in_window"] = fused_mod.local_in_window(row["selected_impl"], SIZES["slc_block"],
                                                           SIZES["slc_topk"], SIZES["window"])
        ref = outputs()
        with tuning.override(fused=dict(local_in_window=not on)):
            row["local_toggle_max_rel_rms"] = max_rel_rms(ref)
            del ref
            time_op("local_toggled")

    if args.compare_settings:
        # launch-setting / code-path variants (flash_msa.tuning.override), each timed side by side with the
        # shipped settings, whose outputs and gradients it must match; the shipped settings are
        # timed once more after the variants (prefix "shipped_again") to show the order's effect
        # (all checks first, so that the reference outputs are freed before any timing)
        ref = outputs()
        ok = []
        for i, spec in enumerate(args.settings_variants):
            row[f"var{i}_spec"] = settings_label(spec)
            try:
                with tuning.override(**spec):
                    row[f"var{i}_max_rel_rms"] = max_rel_rms(ref)
                ok.append(i)
            except Exception as e:  # e.g. out of memory or a launch setting that does not compile
                row[f"var{i}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        del ref
        for i in ok:
            try:
                with tuning.override(**args.settings_variants[i]):
                    time_op(f"var{i}")
            except Exception as e:
                row[f"var{i}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        time_op("shipped_again")

    if args.compare_cmp:
        # the other compressed-attention backend (Triton range kernels / cuDNN), side by side
        other = "cudnn" if row["cmp_backend"] == "triton" else "triton"
        if other == "triton" or dense_cmp.cudnn_supported(q[0]):
            with tuning.override(dense_cmp=dict(backend=other)):
                time_op(f"{other}_cmp")

    if T <= args.breakdown_max_t:
        qf, kf, vf = q[0], k[0], v[0]
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        with torch.no_grad():
            kc, cc = TB.compress(kf, kw, kp, cu, 32, 16, proj=kj)
            vc, _ = TB.compress(vf, vw, vp, cu, 32, 16, proj=vj)
        kc, vc = kc.requires_grad_(), vc.requires_grad_()
        with torch.no_grad():
            _, lse = TB.compressed_attention(qf, kc, vc, cu, cc, 32, 16, scale)
            idx = TB.select_blocks(qf, kc, lse, cu, cc, 32, 16, 64, 16, scale)
        do0 = do[0]
        dc = torch.randn_like(kc)
        o3 = [torch.randn(T, HQ, D, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        g = gates[0]

        def b_compress():
            a, _ = TB.compress(kf, kw, kp, cu, 32, 16, proj=kj)
            b, _ = TB.compress(vf, vw, vp, cu, 32, 16, proj=vj)
            return torch.autograd.grad((a, b), (k, v, kw, kp, vw, vp, kj, vj), (dc, dc))

        def b_cmp():
            if dense is not None:  # the backend the whole op ran: cuDNN's grouped form, forward and backward
                with torch.no_grad():  # as inside the op's autograd Function
                    oc, lc, aux = dense_cmp.dense_cmp_forward(qf, kc, vc, dense, 32, 16, scale)
                    return dense_cmp.dense_cmp_backward(qf, kc, vc, oc, lc, do0, dense, 32, 16, scale, aux)
            oc, _ = TB.compressed_attention(qf, kc, vc, cu, cc, 32, 16, scale)
            return torch.autograd.grad(oc, (q, kc, vc), do0)

        def b_topk():
            return TB.select_blocks(qf.detach(), kc.detach(), lse, cu, cc, 32, 16, 64, 16, scale)

        def b_selected():
            os_ = selected_attention(q, k, v, idx[None], block_size=64, cu_seqlens=None, scale=scale, impl="auto")
            return torch.autograd.grad(os_, (q, k, v), do)

        def b_window():
            ow = TB.window_attention(qf, kf, vf, cu, 512, scale)
            return torch.autograd.grad(ow, (q, k, v), do0)

        def b_gates():
            og = TB.combine(g, *o3, torch.bfloat16)
            return torch.autograd.grad(og, (g, *o3), do0)

        for bname, fn in zip(BRANCH_NAMES, (b_compress, b_cmp, b_topk, b_selected, b_window, b_gates)):
            row[f"{bname}_ms"] = timer(fn, T, args)
        row["branch_sum_ms"] = sum(row[f"{b}_ms"] for b in BRANCH_NAMES)
        del kc, vc, lse, idx, o3, dc
        save(args)
    del leaves, q, k, v, gates, kw, kp, vw, vp

    for label in ("cudnn", "flash"):
        if row.get(f"{label}_fwd_bwd_ms"):  # taken from --dense-from
            row[f"speedup_vs_{label}"] = row[f"{label}_fwd_bwd_ms"] / row["nsa_fwd_bwd_ms"]
    # dense causal SDPA, [B, H, T, D] views of the [B, T, H, D] tensors
    for backend, label, max_t in ((SDPBackend.CUDNN_ATTENTION, "cudnn", args.dense_max_t),
                                  (SDPBackend.FLASH_ATTENTION, "flash", args.flash_max_t)):
        if T > max_t or row.get(f"{label}_fwd_bwd_ms"):
            continue
        try:
            gen = torch.Generator(device=device).manual_seed(2)
            qd = torch.randn(1, T, HQ, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
            kd = torch.randn(1, T, HK, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
            vd = torch.randn(1, T, HK, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
            dod = torch.randn(1, T, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)

            def dense(gqa):
                qq, kk, vv = (x.transpose(1, 2) for x in (qd, kd, vd))
                if not gqa:  # backend without native GQA: repeat the KV heads
                    kk, vv = (x.repeat_interleave(HQ // HK, dim=1) for x in (kk, vv))
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa).transpose(1, 2)

            gqa = True
            try:
                dense(True)
            except RuntimeError:
                gqa = False
                dense(False)
            row[f"{label}_gqa_native"] = gqa
            with torch.no_grad():
                row[f"{label}_fwd_ms"] = timer(lambda: dense(gqa), T, args)
            row[f"{label}_fwd_bwd_ms"] = timer(lambda: torch.autograd.grad(dense(gqa), (qd, kd, vd), dod), T, args)
            row[f"{label}_peak_mib"] = peak_mib(lambda: torch.autograd.grad(dense(gqa), (qd, kd, vd), dod))
            row[f"speedup_vs_{label}"] = row[f"{label}_fwd_bwd_ms"] / row["nsa_fwd_bwd_ms"]
            del qd, kd, vd, dod
        except Exception as e:  # noqa: BLE001 - record and go on (OOM at the largest T, missing backend)
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"  {label}: {row[f'{label}_error']}", flush=True)
        torch.cuda.empty_cache()
        save(args)


RESULTS = {"rows": [], "checks": {}, "meta": {}}


def save(args):
    with open(os.path.join(args.out, "nsa_h200.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    write_markdown(RESULTS, os.path.join(args.out, "nsa_h200.md"))


def _f(x, nd=1):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write_markdown(res, path):
    meta = res.get("meta", {})
    lines = [f"# Whole NSA vs dense causal attention ({meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
             f"triton {meta.get('triton', '?')}, bf16, fwd+bwd)", "",
             "NSA defaults l=32, d=16, l'=64, n=16, w=512; dense = SDPA causal. Times in ms (median). "
             "Speedup = dense fwd+bwd / NSA fwd+bwd. Peak = extra memory of one fwd+bwd (MiB).", "",
             "| model | T | NSA fwd | NSA f+b | cuDNN f+b | flash f+b | x cuDNN | x flash | NSA peak | cuDNN peak "
             "| compress | cmp attn | top-k | selected | window | gates | sum | selected impl | cmp |",
             "|" + "---|" * 19]
    for r in res["rows"]:
        lines.append("| " + " | ".join([
            r["model"], str(r["T"]), _f(r.get("nsa_fwd_ms")), _f(r.get("nsa_fwd_bwd_ms")),
            _f(r.get("cudnn_fwd_bwd_ms")), _f(r.get("flash_fwd_bwd_ms")),
            _f(r.get("speedup_vs_cudnn"), 2), _f(r.get("speedup_vs_flash"), 2),
            _f(r.get("nsa_peak_mib"), 0), _f(r.get("cudnn_peak_mib"), 0),
            *[_f(r.get(f"{b}_ms")) for b in BRANCH_NAMES], _f(r.get("branch_sum_ms")), str(r.get("selected_impl", "-")),
            str(r.get("cmp_backend", "-"))]) + " |")
    composed = [r for r in res["rows"] if r.get("composed_fwd_bwd_ms")]
    if composed:
        lines += ["", "The same op composed of one autograd Function per branch and the gates (`--compare-composed`, "
                  "same run), against the shipped single Function (flash_msa/fused.py):", "",
                  "| model | T | composed fwd | composed f+b | shipped f+b | composed peak | shipped peak |",
                  "|---|---|---|---|---|---|---|"]
        for r in composed:
            lines.append("| " + " | ".join([r["model"], str(r["T"]), _f(r.get("composed_fwd_ms")),
                                             _f(r.get("composed_fwd_bwd_ms")), _f(r.get("nsa_fwd_bwd_ms")),
                                             _f(r.get("composed_peak_mib"), 0), _f(r.get("nsa_peak_mib"), 0)]) + " |")
    local_rows = [r for r in res["rows"] if r.get("local_toggled_fwd_bwd_ms")]
    if local_rows:
        lines += ["", "fmsa's local blocks in the window kernel (flash_msa/fused.py) on and off (`--compare-local`, "
                  "same run; `shipped` says which one the rows above ran); max relative RMS between the two runs' "
                  "output and gradients:", "",
                  "| model | T | shipped | on fwd | on f+b | off fwd | off f+b | on peak | off peak | max rel RMS |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in local_rows:
            on = r.get("local_in_window")
            mine = (r.get("nsa_fwd_ms"), r.get("nsa_fwd_bwd_ms"), r.get("nsa_peak_mib"))
            theirs = (r.get("local_toggled_fwd_ms"), r.get("local_toggled_fwd_bwd_ms"), r.get("local_toggled_peak_mib"))
            a, b = (mine, theirs) if on else (theirs, mine)
            lines.append("| " + " | ".join([r["model"], str(r["T"]), "on" if on else "off", _f(a[0]), _f(a[1]),
                                             _f(b[0]), _f(b[1]), _f(a[2], 0), _f(b[2], 0),
                                             f"{r.get('local_toggle_max_rel_rms', float('nan')):.1e}"]) + " |")
    var_rows = [r for r in res["rows"] if r.get("var0_spec")]
    if var_rows:
        lines += ["", "Variants of launch settings against the shipped ones (`--compare-settings`, same run: the "
                  "shipped settings first, then each variant, then the shipped settings again); max relative RMS of "
                  "the variant's output and gradients against the shipped ones:", "",
                  "| model | T | settings | fwd | f+b | peak | max rel RMS |", "|---|---|---|---|---|---|---|"]
        for r in var_rows:
            runs = [("shipped", "nsa", None)]
            i = 0
            while r.get(f"var{i}_spec"):  # a variant that failed has an error (listed below) and no times
                runs.append((r[f"var{i}_spec"], f"var{i}", r.get(f"var{i}_max_rel_rms")))
                i += 1
            runs.append(("shipped, again", "shipped_again", None))
            for label, pre, err in runs:
                lines.append("| " + " | ".join([r["model"], str(r["T"]), f"`{label}`", _f(r.get(f"{pre}_fwd_ms")),
                                                 _f(r.get(f"{pre}_fwd_bwd_ms")), _f(r.get(f"{pre}_peak_mib"), 0),
                                                 "-" if err is None else f"{err:.1e}"]) + " |")
    cmp_rows = [r for r in res["rows"] if r.get("triton_cmp_fwd_bwd_ms") or r.get("cudnn_cmp_fwd_bwd_ms")]
    if cmp_rows:
        lines += ["", "Compressed attention on the Triton range kernels against cuDNN's dense grouped form "
                  "(compression/dense_cmp.py; `--compare-cmp`, same run; the shipped backend is `cmp`):", "",
                  "| model | T | cmp | Triton fwd | Triton f+b | cuDNN fwd | cuDNN f+b | Triton peak | cuDNN peak |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in cmp_rows:
            got = {b: (r.get(f"{b}_cmp_fwd_ms"), r.get(f"{b}_cmp_fwd_bwd_ms"), r.get(f"{b}_cmp_peak_mib"))
                   for b in ("triton", "cudnn")}
            got[r.get("cmp_backend", "triton")] = (r.get("nsa_fwd_ms"), r.get("nsa_fwd_bwd_ms"), r.get("nsa_peak_mib"))
            t, c = got["triton"], got["cudnn"]
            lines.append("| " + " | ".join([r["model"], str(r["T"]), str(r.get("cmp_backend", "-")), _f(t[0]), _f(t[1]),
                                             _f(c[0]), _f(c[1]), _f(t[2], 0), _f(c[2], 0)]) + " |")
    lines += ["", "Correctness (at the check size, vs the fp32 reference; relative RMS, top-k rows identical):", ""]
    for m, c in res.get("checks", {}).items():
        lines.append(f"- {m}: " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()))
    errs = [(r["model"], r["T"], k, v) for r in res["rows"] for k, v in r.items() if k.endswith("error")]
    if errs:
        lines += ["", "Errors / skipped:", ""] + [f"- {m} T={t} {k}: {v}" for m, t, k, v in errs]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for m in sorted({r["model"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["model"] == m]
        for key, style in (("nsa_fwd_bwd_ms", "-o"), ("cudnn_fwd_bwd_ms", "--s"), ("flash_fwd_bwd_ms", ":^")):
            pts = [(r["T"], r[key]) for r in rows if r.get(key)]
            if pts:
                axes[0].plot(*zip(*pts), style, label=f"{m} {key.replace('_fwd_bwd_ms', '')}")
        pts = [(r["T"], r["speedup_vs_cudnn"]) for r in rows if r.get("speedup_vs_cudnn")]
        if pts:
            axes[1].plot(*zip(*pts), "-o", label=f"{m} vs cuDNN")
    axes[0].set(xscale="log", yscale="log", xlabel="T", ylabel="fwd+bwd ms", title="NSA vs dense causal (H200, bf16)")
    axes[1].set(xscale="log", xlabel="T", ylabel="speedup (dense / NSA)", title="NSA speedup over cuDNN dense")
    for y in (5, 10):
        axes[1].axhline(y, color="gray", lw=0.5)
    rows = [r for r in res["rows"] if r.get("branch_sum_ms") and r["model"] == "llama3_8b"]
    bottom = [0.0] * len(rows)
    labels = [f"{r['T'] // 1024}K" for r in rows]
    for b in BRANCH_NAMES:
        vals = [r[f"{b}_ms"] for r in rows]
        axes[2].bar(labels, vals, bottom=bottom, label=b)
        bottom = [x + y for x, y in zip(bottom, vals)]
    axes[2].set(yscale="log" if rows and max(bottom) / max(min(bottom), 1e-9) > 50 else "linear",
                xlabel="T", ylabel="ms", title="Llama3-8B NSA fwd+bwd by branch")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


DENSE_ARMS = ("varlen_flash2", "varlen_cudnn", "sdpa_cudnn_per_document")


def cudnn_varlen(query, key, value, cu, max_len: int):
    """cuDNN's fused attention with document offsets, ``aten._cudnn_attention_forward`` / ``_backward``
    (torch's varlen_attn keeps this path switched off): [1, HQ, T, D] x [1, HK, T, D] -> [1, T, HQ, D],
    causal within each document, KV heads repeated. Kept here, not in the trainer: on torch 2.11 with
    cuDNN 9.19 its forward and dv are right and its dq and dk are not (off by 4x to 1e26 relative RMS,
    varying from call to call; cuDNN without offsets, one document, is right), so --packed-dense
    checks it again on each torch."""
    import torch

    class CudnnVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale):
            r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True,
                                                        False, scale=scale)
            ctx.save_for_backward(q, k, v, r[0], r[1], r[6], r[7])
            ctx.scale = scale
            return r[0]

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, out, lse, seed, offset = ctx.saved_tensors
            grads = torch.ops.aten._cudnn_attention_backward(grad_out.contiguous(), q, k, v, out, lse, seed, offset,
                                                              None, cu, cu, max_len, max_len, 0.0, True,
                                                              scale=ctx.scale)
            return (*grads, None)

    group = query.shape[1] // key.shape[1]
    q, k, v = (x[0].transpose(0, 1).repeat_interleave(g, dim=1).contiguous()
               for x, g in ((query, 1), (key, group), (value, group)))  # [T, H, D]
    return CudnnVarlen.apply(q, k, v, query.shape[-1] ** -0.5).unsqueeze(0)


def packed_dense(args):
    """--packed-dense: the dense kernels ``attention=full`` could run on a packed row (several documents
    in one sequence, causal within each), Llama3-8B's heads: torch's varlen_attn (FlashAttention-2),
    cuDNN's fused attention with document offsets (:func:`cudnn_varlen`), and one
    cuDNN SDPA per document (host offsets: the bound a per-document loop reaches). Each arm is checked
    first (bf16, o and every gradient against fp32 SDPA per document, at 8K in four documents), then
    forward and forward + backward timed (do_bench median) per T and document split. Writes
    OUT/packed_dense.{json,md}."""
    import random

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from msa_train.models import attention as A

    HQ, HK, D = MODELS["llama3_8b"]
    dev = os.environ.get("BENCH_DEVICE", "cuda")

    def per_document(q, k, v, bounds, backend=SDPBackend.CUDNN_ATTENTION, dtype=None):
        outs = []
        with sdpa_kernel([backend]):
            for a, b in zip(bounds[:-1], bounds[1:]):
                x = [t[:, :, a:b] if dtype is None else t[:, :, a:b].to(dtype) for t in (q, k, v)]
                outs.append(A._sdpa_causal(*x, D ** -0.5))
        return torch.cat(outs, 2).transpose(1, 2)

    arms = {"varlen_flash2": lambda q, k, v, cu, mx, b: A._varlen_flash(q, k, v, None, cu, mx),
            "varlen_cudnn": lambda q, k, v, cu, mx, b: cudnn_varlen(q, k, v, cu, mx),
            "sdpa_cudnn_per_document": lambda q, k, v, cu, mx, b: per_document(q, k, v, b)}

    def inputs(lengths, seed):
        T = sum(lengths)
        g = torch.Generator(device=dev).manual_seed(seed)

        def rnd(*shape):  # random, never zero
            x = torch.randn(*shape, device=dev, generator=g)
            return torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x).to(torch.bfloat16)
        q, k, v = (rnd(1, h, T, D).requires_grad_() for h in (HQ, HK, HK))
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        return q, k, v, rnd(1, T, HQ, D), cu, max(lengths), bounds

    res = {"meta": dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else dev, torch=torch.__version__,
                        heads=[HQ, HK, D], timing=f"do_bench median (warmup {args.warmup}, rep {args.rep} ms)"),
           "check": {}, "rows": []}
    path = os.path.join(args.out, "packed_dense")

    def save():
        json.dump(res, open(path + ".json", "w"), indent=1)
        lines = [f"# Dense attention over packed rows, {res['meta']['gpu']}", "",
                 f"Llama3-8B heads ({HQ} query / {HK} KV, D {D}), bf16, causal within each document; "
                 f"{res['meta']['timing']}. Check: relative RMS against fp32 SDPA per document (8K, four documents).",
                 "", "| arm | o | dq | dk | dv | ok |", "|---|---|---|---|---|---|"]
        for arm, c in res["check"].items():
            lines.append(f"| {arm} | " + " | ".join(f"{c[x]:.2e}" if x in c else "-" for x in ("o", "dq", "dk", "dv"))
                         + f" | {c.get('ok', c.get('error', '-'))} |")
        lines += ["", "| T | documents | " + " | ".join(f"{a} fwd / fwd+bwd ms" for a in DENSE_ARMS) + " |",
                  "|---|---|" + "---|" * len(DENSE_ARMS)]
        def cell(r, a):
            if a + "_fwdbwd_ms" in r:
                return f"{r[a + '_fwd_ms']:.1f} / {r[a + '_fwdbwd_ms']:.1f}"
            return r.get(a + "_error", "-")[:60]
        for r in res["rows"]:
            lines.append(f"| {r['T']:,} | {r['split']} | " + " | ".join(cell(r, a) for a in DENSE_ARMS) + " |")
        open(path + ".md", "w").write("\n".join(lines) + "\n")

    q, k, v, do, cu, mx, bounds = inputs([1000, 3000, 192, 4000], seed=1)
    ref = per_document(q, k, v, bounds, backend=SDPBackend.MATH, dtype=torch.float32)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.float())
    for arm, fn in arms.items():
        try:
            o = fn(q, k, v, cu, mx, bounds)
            grads = torch.autograd.grad(o, (q, k, v), do)
            c = {"o": rel_rms(o.float(), ref)}
            c.update({n: rel_rms(g.float(), r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
            c["ok"] = all(x < 1e-2 for x in c.values())
        except Exception as e:  # noqa: BLE001 - an arm this torch lacks is reported, not fatal
            c = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        res["check"][arm] = c
        print(f"check {arm}: {c}", flush=True)
    save()
    t_start = time.time()
    for T in [int(t) for t in args.Ts.split(",")]:
        rng = random.Random(T)
        mixed, left = [], T
        while left > 0:  # lengths log-uniform from 1K to T/4, as packed documents of a real corpus vary
            mixed.append(min(left, int(2 ** rng.uniform(10, math.log2(T // 4)))))
            left -= mixed[-1]
        for split, lengths in (("1", [T]), ("4 equal", [T // 4] * 4), ("16 equal", [T // 16] * 16),
                               (f"{len(mixed)} mixed", mixed)):
            if time.time() - t_start > args.budget_s:
                print(f"budget reached: skipping T={T} {split}", flush=True)
                continue
            row = {"T": T, "split": split, "lengths": lengths}
            res["rows"].append(row)
            q, k, v, do, cu, mx, bounds = inputs(lengths, seed=0)
            for arm, fn in arms.items():
                if not res["check"][arm].get("ok"):
                    row[arm + "_error"] = "not timed: check failed"
                    continue
                try:
                    with torch.no_grad():
                        row[arm + "_fwd_ms"] = triton.testing.do_bench(
                            lambda: fn(q, k, v, cu, mx, bounds), warmup=args.warmup, rep=args.rep, return_mode="median")
                    row[arm + "_fwdbwd_ms"] = triton.testing.do_bench(
                        lambda: fn(q, k, v, cu, mx, bounds).backward(do), warmup=args.warmup, rep=args.rep,
                        grad_to_none=[q, k, v], return_mode="median")
                except Exception as e:  # noqa: BLE001
                    row[arm + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            del q, k, v, do
            torch.cuda.empty_cache()
            save()
            print(json.dumps({k_: (round(v_, 2) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                              if k_ != "lengths"}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--Ts", default="8192,16384,32768,65536,131072,262144,524288,1048576")
    p.add_argument("--models", default="llama3_8b,qwen3_14b")
    p.add_argument("--qwen-Ts", default="65536,262144", help="T values for every model other than llama3_8b (qwen3_14b, quality_170m); --Ts is llama3_8b's")
    p.add_argument("--check-T", type=int, default=8192)
    p.add_argument("--dense-max-t", type=int, default=262144)
    p.add_argument("--flash-max-t", type=int, default=131072)
    p.add_argument("--breakdown-max-t", type=int, default=262144)
    p.add_argument("--do-bench-max-t", type=int, default=65536)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new T after this many seconds")
    p.add_argument("--plot-only", default=None)
    p.add_argument("--compare-composed", action="store_true",
                   help="also time the whole op as one autograd Function per branch (before flash_msa/fused.py)")
    p.add_argument("--compare-local", action="store_true",
                   help="also time the whole op with fmsa's local blocks in the window kernel toggled (flash_msa/fused.py)")
    p.add_argument("--compare-cmp", action="store_true",
                   help="also time the whole op with compressed attention on the other backend (Triton / cuDNN)")
    p.add_argument("--compare-settings", default="",
                   help="variants of flash_msa.tuning settings timed against the shipped ones in the same run, "
                        "e.g. 'fmsa.seg_tiles=32;fmsa.bwd_stages=2,fmsa.seg_tiles=32' (docs/nsa_kernels.md)")
    p.add_argument("--dense-from", default=None,
                   help="take the dense SDPA rows from an earlier nsa_h200.json (same machine kind) instead of re-timing them")
    p.add_argument("--packed-dense", action="store_true",
                   help="instead: the dense kernels attention=full could run on packed rows (packed_dense.{json,md})")
    args = p.parse_args()
    if args.packed_dense:
        os.makedirs(args.out, exist_ok=True)
        return packed_dense(args)
    if args.plot_only:
        res = json.load(open(args.plot_only))
        d = os.path.dirname(os.path.abspath(args.plot_only))
        write_markdown(res, os.path.join(d, "nsa_h200.md"))
        plot(res, os.path.join(d, "nsa_h200.png"))
        return
    import torch
    import triton
    from flash_msa import tuning
    from flash_msa.utils.validation import trusted_inputs
    # parsed and checked once, before any timing (a bad spec fails here, not after the first row)
    args.settings_variants = parse_settings(args.compare_settings)
    for spec in args.settings_variants:
        with tuning.override(**spec):  # unknown ops or settings raise here
            pass
    os.makedirs(args.out, exist_ok=True)
    device = os.environ.get("BENCH_DEVICE", "cuda")
    RESULTS["meta"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           sizes=SIZES, timing=f"do_bench median (warmup {args.warmup}, rep {args.rep} ms) for "
                           f"T <= {args.do_bench_max_t}, else median of {args.reps} event-timed calls")
    t_start = time.time()
    models = args.models.split(",")
    with trusted_inputs():
        for m in models:
            HQ, HK, D = MODELS[m]
            try:
                RESULTS["checks"][m] = check(HQ, HK, D, args.check_T, device)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                RESULTS["checks"][m] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"check {m} T={args.check_T}: {RESULTS['checks'][m]}", flush=True)
            torch.cuda.empty_cache()
            save(args)
        for m in models:
            Ts = [int(t) for t in (args.Ts if m == "llama3_8b" else args.qwen_Ts).split(",")]
            for T in Ts:
                if time.time() - t_start > args.budget_s:
                    print(f"budget reached: skipping {m} T={T}", flush=True)
                    continue
                row = {"model": m, "T": T}
                RESULTS["rows"].append(row)
                if not RESULTS["checks"][m].get("ok"):  # no speed without correctness
                    row["error"] = "not timed: the correctness check failed"
                    print(f"{m} T={T}: not timed, the correctness check failed", flush=True)
                    continue
                if args.dense_from:
                    prev = [r for r in json.load(open(args.dense_from))["rows"] if r["model"] == m and r["T"] == T]
                    for key, val in (prev[0].items() if prev else ()):
                        if key.startswith(("cudnn_", "flash_")):
                            row[key] = val
                    row["dense_from"] = os.path.basename(args.dense_from)
                t0 = time.time()
                try:
                    bench_model(m, T, args, device, row)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.empty_cache()
                save(args)
                print(f"{m} T={T} ({time.time() - t0:.0f} s): " + json.dumps(
                    {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    plot(RESULTS, os.path.join(args.out, "nsa_h200.png"))
    print(f"done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
