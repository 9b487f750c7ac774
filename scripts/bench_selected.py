"""Selected-attention benchmark on one GPU: fmsa (KV-block-centric) vs qc (query-centric).

For every shape it first checks correctness, then times (at G >= 16 also fla-core's
parallel_nsa selected attention, when importable, as an outside reference point):
  * at --check-T (default 8K) each kernel against the chunked fp32 reference (o, dq, dk, dv);
  * at every benchmarked shape, fmsa against qc (o, dq, dk, dv), before timing them.
Timing: triton.testing.do_bench, median, forward and forward + backward.

Usage (repo root, on the GPU machine):
    PYTHONPATH=kernels:. python scripts/bench_selected.py --out OUTDIR [--Ts 8192,65536] [--Gs 4,5]
Writes OUTDIR/selected_h200.{json,md,png}.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch
import triton

from flash_msa import tuning
from flash_msa.selection.interface import IMPLS, choose_impl
from flash_msa.selection.naive import selected_attention_chunked
from flash_msa.utils.compare import rel_rms
from flash_msa.utils.varlen import default_cu_seqlens

IMPL_NAMES = ("fmsa", "qc")
FLA = None  # fla-core selected attention, set in main


def make_indices(T: int, HK: int, S: int, bs: int, device, gen) -> torch.Tensor:
    """Realistic selection for one sequence of T tokens: block 0 and the 2 local blocks forced,
    the rest random distinct earlier blocks; -1 where a query has fewer than S blocks. int32 [T, HK, S]."""
    nb = (T + bs - 1) // bs
    out = torch.empty(T, HK, S, dtype=torch.int32, device=device)
    chunk = max(1, (1 << 27) // (HK * nb))
    blk = torch.arange(nb, device=device)
    for c0 in range(0, T, chunk):  # bench setup only: bounded [chunk, HK, nb] scores
        t = torch.arange(c0, min(T, c0 + chunk), device=device)
        own = (t // bs)[:, None, None]
        score = torch.rand(len(t), HK, nb, device=device, generator=gen)
        forced = (blk == 0) | (blk == own) | (blk == own - 1)
        score = torch.where(forced, score + 2, score)
        score = torch.where(blk <= own, score, torch.full_like(score, -1.))
        val, idx = score.topk(min(S, nb), dim=-1)
        idx = torch.where(val >= 0, idx, torch.full_like(idx, -1)).int()
        if nb < S:
            idx = torch.cat([idx, idx.new_full((len(t), HK, S - nb), -1)], -1)
        out[c0:c0 + len(t)] = idx
    return out


def useful_flops(bi: torch.Tensor, G: int, D: int, bs: int) -> float:
    """Forward FLOPs of unmasked work: 4*D per (query head, unmasked key) for q.k and p.v."""
    T = bi.shape[0]
    t = torch.arange(T, device=bi.device)[:, None, None]
    b = bi.long()
    valid = (b >= 0) & (b <= t // bs)
    keys = torch.clamp(t - b * bs + 1, max=bs)
    return float((torch.where(valid, keys, 0).sum() * 4 * D * G).item())


def fla_selected():
    """fla-core's parallel_nsa selected attention (the query-centric NSA kernel of
    flash-linear-attention, G a power of two >= 16) as an outside reference point, or None."""
    try:
        from fla.ops.nsa.parallel import ParallelNSAFunction
    except Exception as e:  # not installed, or not importable on this Triton
        print(f"fla-core unavailable: {type(e).__name__}: {e}", flush=True)
        return None

    def fla(q, k, v, bi, bs, cu, scale):
        # [B, T, H, S] indices, -1 entries skipped by fla; block_counts = S for every query
        return ParallelNSAFunction.apply(q, k, v, bi, bi.shape[-1], bs, scale, None)
    return fla


def impl_fn(name):
    return FLA if name == "fla" else IMPLS[name].attention


def run_impl(name, q, k, v, bi, bs, cu, do, backward=True):
    q.grad = k.grad = v.grad = None
    o = impl_fn(name)(q, k, v, bi, bs, cu, q.shape[-1] ** -0.5)
    if not backward:
        return (o,)
    o.backward(do)
    return o, q.grad, k.grad, v.grad


def make_inputs(T, HK, G, D, S, bs, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    def rnd(*shape):  # random, never zero; made in bf16 so that 1M tokens need no fp32 temporaries
        x = torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16)
        return x.masked_fill_(x.abs() < 1e-3, 1e-3)
    q = rnd(1, T, HK * G, D).requires_grad_()
    k = rnd(1, T, HK, D).requires_grad_()
    v = rnd(1, T, HK, D).requires_grad_()
    do = rnd(1, T, HK * G, D)
    bi = make_indices(T, HK, S, bs, device, gen)[None]
    return q, k, v, do, bi


def check_reference(T, HK, G, D, S, bs, device, tol=2e-2):
    """Each kernel (bf16) vs the chunked reference in fp32 on the same bf16 inputs."""
    q, k, v, do, bi = make_inputs(T, HK, G, D, S, bs, device, seed=1)
    cu = default_cu_seqlens(1, T, device)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    o_ref = selected_attention_chunked(qf[0], kf[0], vf[0], bi[0], bs, cu, D ** -0.5)[None]
    o_ref.backward(do.float())
    refs = (o_ref, qf.grad, kf.grad, vf.grad)
    res = {}
    for name in IMPL_NAMES:
        outs = run_impl(name, q, k, v, bi, bs, cu, do)
        res[name] = {n: rel_rms(x, r) for n, x, r in zip(("o", "dq", "dk", "dv"), outs, refs)}
        ok = all(e <= tol for e in res[name].values())
        print(f"  check T={T} G={G} {name} vs reference: " + " ".join(f"{n}={e:.2e}" for n, e in res[name].items())
              + ("  OK" if ok else "  FAIL"), flush=True)
        res[name]["ok"] = ok
    return res


def peak_extra(fn, out_bytes):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base - out_bytes) / 2 ** 20


def bench_shape(T, G, D, S, bs, device, warmup, rep, skip_bwd_over):
    HK = 4 if G == 16 else 8
    q, k, v, do, bi = make_inputs(T, HK, G, D, S, bs, device)
    cu = default_cu_seqlens(1, T, device)
    flops = useful_flops(bi[0], G, D, bs)
    row = {"T": T, "G": G, "HQ": HK * G, "HK": HK, "D": D, "S": S, "block_size": bs,
           "fwd_tflop": flops / 1e12, "auto": choose_impl(q, k, S, bs)}
    with_bwd = T <= skip_bwd_over
    # correctness at the benchmarked shape: fmsa vs qc, before any timing
    outs = {n: [x.detach().clone() for x in run_impl(n, q, k, v, bi, bs, cu, do, backward=with_bwd)]
            for n in IMPL_NAMES}
    row["fmsa_vs_qc"] = {n: rel_rms(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), outs["fmsa"], outs["qc"])}
    row["check_ok"] = all(e <= 2e-2 for e in row["fmsa_vs_qc"].values())
    names = list(IMPL_NAMES)
    if FLA is not None and G >= 16 and G & (G - 1) == 0:
        try:
            fla_outs = [x.detach().clone() for x in run_impl("fla", q, k, v, bi, bs, cu, do, backward=with_bwd)]
            row["fla_vs_fmsa"] = {n: rel_rms(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), fla_outs, outs["fmsa"])}
            if all(e <= 2e-2 for e in row["fla_vs_fmsa"].values()):
                names.append("fla")
            else:
                print(f"T={T} G={G}: fla disagrees with fmsa, not timed: {row['fla_vs_fmsa']}", flush=True)
            del fla_outs
        except Exception as e:  # an outside kernel's failure is reported, not fatal
            row["fla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"T={T} G={G}: fla failed: {row['fla_error']}", flush=True)
    del outs
    if not row["check_ok"]:  # no timing for a shape whose results disagree
        return row
    o_bytes = q.numel() * q.element_size()
    kv_bytes = k.numel() * k.element_size()
    for name in names:
        fwd = lambda: impl_fn(name)(q, k, v, bi, bs, cu, D ** -0.5)
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = triton.testing.do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
            row[f"{name}_fwd_extra_mib"] = peak_extra(fwd, o_bytes)
        row[f"{name}_fwd_tflops"] = flops / row[f"{name}_fwd_ms"] / 1e9
        if with_bwd:
            def fb():
                impl_fn(name)(q, k, v, bi, bs, cu, D ** -0.5).backward(do)
            row[f"{name}_fwdbwd_ms"] = triton.testing.do_bench(
                fb, warmup=warmup, rep=rep, grad_to_none=[q, k, v], return_mode="median")
            row[f"{name}_fwdbwd_tflops"] = 3.5 * flops / row[f"{name}_fwdbwd_ms"] / 1e9
            q.grad = k.grad = v.grad = None
            row[f"{name}_fwdbwd_extra_mib"] = peak_extra(fb, 2 * o_bytes + 2 * kv_bytes)  # o, dq, dk, dv
            q.grad = k.grad = v.grad = None
    row["ratio_fwd"] = row["fmsa_fwd_ms"] / row["qc_fwd_ms"]
    if with_bwd:
        row["ratio_fwdbwd"] = row["fmsa_fwdbwd_ms"] / row["qc_fwdbwd_ms"]
    del q, k, v, do, bi
    torch.cuda.empty_cache()
    return row


def profile(T, G, D, S, bs, device):
    """Kernel time table of one fwd+bwd of each impl (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    HK = 4 if G == 16 else 8
    q, k, v, do, bi = make_inputs(T, HK, G, D, S, bs, device)
    cu = default_cu_seqlens(1, T, device)
    for name in IMPL_NAMES:
        for _ in range(2):
            run_impl(name, q, k, v, bi, bs, cu, do)
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            run_impl(name, q, k, v, bi, bs, cu, do)
            torch.cuda.synchronize()
        print(f"== {name} T={T} G={G} fwd+bwd", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)


def variants(T, G, D, S, bs, device):
    """fmsa forward and forward+backward under launch-setting variants (entries of fmsa's LAUNCH
    table, set by flash_msa.tuning.override; the key "call" holds keyword arguments of the call,
    such as the partition), each
    checked against the first variant's outputs (o, dq, dk, dv) before timing, with the peak
    memory it allocates on top of the inputs."""
    from flash_msa.selection import fmsa
    HK = 4 if G == 16 else 8
    q, k, v, do, bi = make_inputs(T, HK, G, D, S, bs, device)
    cu = default_cu_seqlens(1, T, device)
    # Timed before: groups of 4 row tiles of one key per forward program (shipped) against 2
    # tiles of any keys (selected_variants4_h200.log); the tile loop without a branch, pipelined
    # by Triton (selected_variants3_h200.log); partitions, segments and other launch settings
    # (selected_partitions_h200.log, selected_variants*_h200.log).
    # merge warps, L2 eviction hints (no gain) and the dq reduction's warps: selected_variants5_h200.log.
    # Prefetching the next tile's entry ids / q rows in the forward and 128-row forward tiles lost,
    # 3 backward stages won (selected_variants6_h200.log).
    # The forward's tile counts, register cap and merge warps: selected_variants4/5_h200.log. Backward
    # tiles of 64 rows on 8 warps compile without spills (255 registers, one program per SM; the
    # shipped 128-row tiles spill), or at 128 registers two programs per SM (kernel_resources.py).
    # The tiles past a key's causal rows without the mask, in their own (pipelined) loop, and
    # unsigned index arithmetic: 27% fewer instructions in the forward's loop, 23% in dk/dv's, no
    # faster (selected_variants8_h200.log; not bound by instructions).
    # The reductions on a second CUDA stream beside the next partition's main kernel, with double
    # partial buffers: about 1% faster for one more partition buffer of memory (selected_variants9_h200.log).
    # 64-row backward tiles (also with 128-tile segments, or a 128-register cap) lost: selected_variants7_h200.log.
    # The dk/dv loop's accumulating matmuls in the order of the math, or before the dq store, against
    # last (shipped): selected_variants10_h200.log (commit a8272cc's BWD_ACC_LAST).
    # Partition budgets (384 MiB then, now 768; 1536 MiB: one chunk per KV head at 64K) and 64-row
    # backward tiles on 4 warps (two programs per SM, with spills): selected_variants11_h200.log,
    # run at commit 37ca19b with 384 MiB shipped. The shipped settings are timed again last.
    # The forward's main kernel in Gluon with the next tile's gather in flight, and partial outputs in
    # CSR order, both no faster: selected_variants12_h200.log (commit 1d5a797's variants).
    # q and do gathered from a head-major copy, slower: selected_variants13_h200.log (commit 8d05cf2's).
    # The dk/dv kernel in Gluon (transposed scores, async wgmma, gathers in flight), slower:
    # selected_variants14_h200.log (commit 92e0c1c's).
    # The merge and the dq reduction loading SG slots' partials as one [SG, G, D] tile, no faster:
    # selected_variants15_h200.log (commit 659e607's variants; the merge runs near the DRAM copy ceiling).
    # The forward's partials and the backward's dq parts by TMA bulk copies in key order (FWD_TMA,
    # BWD_TMA, shipped on Hopper) against the row stores, and the TMA kernel's launch settings
    # (selected_variants16_h200.log; its runs predate TMA as the default).
    # Each query's near blocks (block 0, own - 1, own) by a dense kernel of their own, the forward's
    # schedule skipping them (FWD_NEAR, NEAR_*), no faster: selected_near_h200.log (commit d07b488's).
    tma = [{"fwd_tma": False}, {"fwd_tiles": 8}, {"fwd_tiles": 16}, {"fwd_tiles": 2}, {"fwd_maxnreg": 112},
           {"fwd_tma_stages": 2}, {"fwd_bm": 128, "fwd_warps": 8, "fwd_tiles": 2}]
    fwd_variants = [{}, *tma, {}]
    bwd_variants = [{}, {"fwd_tma": False, "bwd_tma": False}, {"fwd_tma": False}, {"bwd_tma": False}, {}]
    ref = None
    for kind, vs in (("fwd", fwd_variants), ("fwd+bwd", bwd_variants)):
        for var in vs:
            call = var.get("call", {})
            run = lambda: IMPLS["fmsa"].attention(q, k, v, bi, bs, cu, D ** -0.5, **call)
            fb_fn = lambda: run().backward(do)
            with tuning.override(fmsa={n: x for n, x in var.items() if n != "call"}):
                try:
                    o = run()
                    got = (o, *torch.autograd.grad(o, (q, k, v), do))
                    if ref is None:
                        ref = got
                    err = max(rel_rms(a, b) for a, b in zip(got, ref))
                    del o, got
                    if kind == "fwd":
                        with torch.no_grad():
                            mem = peak_extra(run, q.numel() * q.element_size())  # less the output
                            ms = triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")
                    else:
                        mem = peak_extra(fb_fn, 2 * q.numel() * q.element_size() + 2 * k.numel() * k.element_size())  # o, dq, dk, dv
                        q.grad = k.grad = v.grad = None
                        ms = triton.testing.do_bench(fb_fn, warmup=5, rep=20, grad_to_none=[q, k, v], return_mode="median")
                    print(f"variant T={T} G={G} {kind} {var or 'default'}: {ms:.2f} ms, peak extra {mem:.0f} MiB "
                          f"(max rel RMS vs first {err:.1e})", flush=True)
                except Exception as e:  # a variant that does not compile (shared memory) is reported, not fatal
                    print(f"variant T={T} G={G} {kind} {var or 'default'}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    # CSR build alone (part of the forward)
    from flash_msa.utils.csr import build_selection_csr, prepare_block_meta, tile_schedule
    meta = prepare_block_meta(cu, T, bs)
    Tc, heads = fmsa.default_partition(T, HK * G, HK, S, D, 2)
    ms = triton.testing.do_bench(lambda: build_selection_csr(bi[0], meta, Tc), warmup=5, rep=20, return_mode="median")
    csr = build_selection_csr(bi[0], meta, Tc)
    ms2 = triton.testing.do_bench(lambda: tile_schedule(csr, G, fmsa.LAUNCH["fwd_bm"]), warmup=5, rep=20, return_mode="median")
    ms3 = triton.testing.do_bench(lambda: prepare_block_meta(cu, T, bs), warmup=5, rep=20, return_mode="median")
    print(f"T={T} G={G}: build_selection_csr {ms:.2f} ms, tile_schedule {ms2:.2f} ms, prepare_block_meta {ms3:.2f} ms, "
          f"chunk {Tc}, KV heads per partition {heads}", flush=True)
    from flash_msa.utils import csr as csr_mod
    n_keys = csr.key_offsets.numel()  # keys and the invalid mark
    key = torch.randint(0, n_keys, (bi[0].numel(),), device=bi.device, dtype=torch.int32)
    short = n_keys <= csr_mod.SHORT_KEYS_BELOW  # build_selection_csr sorts these as int16
    for dt in (torch.int32, torch.int16) if short else (torch.int32,):
        kk = (key - (1 << 15)).to(dt) if dt == torch.int16 else key
        ms = triton.testing.do_bench(lambda: torch.sort(kk, stable=True), warmup=5, rep=20, return_mode="median")
        print(f"  stable sort of {key.numel()} {dt} keys < {n_keys}: {ms:.3f} ms", flush=True)


def partition_probe(T, G, D, S, bs, device, chunks):
    """Does a small partition keep the partials in L2? For each chunk size (one KV head per
    partition): fmsa forward and forward + backward timed by do_bench, the forward also replayed
    from a CUDA graph (no launch gaps), and the summed kernel times of one forward + backward by
    torch.profiler, per kernel name."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    HK = 4 if G == 16 else 8
    q, k, v, do, bi = make_inputs(T, HK, G, D, S, bs, device)
    cu = default_cu_seqlens(1, T, device)
    ref = None
    for chunk in chunks:
        run = lambda: IMPLS["fmsa"].attention(q, k, v, bi, bs, cu, D ** -0.5, chunk_size=chunk, heads=1)
        o = run()
        got = (o, *torch.autograd.grad(o, (q, k, v), do))
        ref = ref or got
        err = max(rel_rms(a, b) for a, b in zip(got, ref))
        del o, got
        with torch.no_grad():
            fwd = triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")
            graph = float("nan")
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run()
                graph = triton.testing.do_bench(g.replay, warmup=5, rep=20, return_mode="median")
                del g
            except Exception as e:  # capture needs no host sync in the forward; report, go on
                print(f"  chunk {chunk}: graph capture failed {type(e).__name__}: {str(e)[:200]}", flush=True)
        fb_fn = lambda: run().backward(do)
        fb = triton.testing.do_bench(fb_fn, warmup=5, rep=20, grad_to_none=[q, k, v], return_mode="median")
        q.grad = k.grad = v.grad = None  # else the profiled backward adds into them
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            fb_fn()
            torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        sums = collections.defaultdict(lambda: [0.0, 0])  # kernel name (template arguments cut) -> [ms, launches]
        for ev in prof.key_averages():
            entry = sums[ev.key.split("(")[0][:40]]
            entry[0] += (getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)) / 1e3
            entry[1] += ev.count
        top = sorted(sums.items(), key=lambda x: -x[1][0])[:8]
        print(f"partition T={T} G={G} chunk={chunk} heads=1: fwd {fwd:.2f} ms (graph {graph:.2f}), f+b {fb:.2f} ms, "
              f"max rel RMS vs first {err:.1e}; kernels ms (launches): "
              + ", ".join(f"{n} {t:.2f} ({c})" for n, (t, c) in top), flush=True)


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def write_markdown(rows, path, header):
    lines = [header, "",
             "| T | G | HQ/HK | fmsa fwd ms | qc fwd ms | fmsa fwd TFLOP/s | qc fwd TFLOP/s | fwd fmsa/qc "
             "| fmsa f+b ms | qc f+b ms | f+b fmsa/qc | fmsa extra MiB (f / f+b) | qc extra MiB (f / f+b) | auto | check |",
             "|---" * 15 + "|"]
    for r in rows:
        if not r["check_ok"]:
            lines.append(f"| {r['T'] // 1024}K | {r['G']} | {r['HQ']}/{r['HK']} |" + " - |" * 10 + f" {r['auto']} | FAIL |")
            continue
        lines.append(
            f"| {r['T'] // 1024}K | {r['G']} | {r['HQ']}/{r['HK']} | {fmt(r['fmsa_fwd_ms'])} | {fmt(r['qc_fwd_ms'])} "
            f"| {fmt(r['fmsa_fwd_tflops'], '.0f')} | {fmt(r['qc_fwd_tflops'], '.0f')} | {fmt(r['ratio_fwd'])} "
            f"| {fmt(r.get('fmsa_fwdbwd_ms'))} | {fmt(r.get('qc_fwdbwd_ms'))} | {fmt(r.get('ratio_fwdbwd'))} "
            f"| {fmt(r['fmsa_fwd_extra_mib'], '.0f')} / {fmt(r.get('fmsa_fwdbwd_extra_mib'), '.0f')} "
            f"| {fmt(r['qc_fwd_extra_mib'], '.0f')} / {fmt(r.get('qc_fwdbwd_extra_mib'), '.0f')} "
            f"| {r['auto']} | {'ok' if r['check_ok'] else 'FAIL'} |")
    fla_rows = [r for r in rows if r.get("fla_fwd_ms") is not None]
    if fla_rows:
        lines += ["", "fla-core `parallel_nsa` selected attention (query-centric, G >= 16 only), same inputs, "
                  "checked against fmsa before timing:", "",
                  "| T | G | HQ/HK | fla fwd ms | fla f+b ms | fmsa fwd ms | fmsa f+b ms | qc fwd ms | qc f+b ms |",
                  "|---" * 9 + "|"]
        for r in fla_rows:
            lines.append(f"| {r['T'] // 1024}K | {r['G']} | {r['HQ']}/{r['HK']} | {fmt(r['fla_fwd_ms'])} "
                         f"| {fmt(r.get('fla_fwdbwd_ms'))} | {fmt(r['fmsa_fwd_ms'])} | {fmt(r.get('fmsa_fwdbwd_ms'))} "
                         f"| {fmt(r['qc_fwd_ms'])} | {fmt(r.get('qc_fwdbwd_ms'))} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    Gs = sorted({r["G"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for G in Gs:
        rs = sorted((r for r in rows if r["G"] == G and r["check_ok"]), key=lambda r: r["T"])
        Ts = [r["T"] for r in rs]
        line, = axes[0].plot(Ts, [r["fmsa_fwd_ms"] for r in rs], "o-", label=f"fmsa G={G}")
        axes[0].plot(Ts, [r["qc_fwd_ms"] for r in rs], "x--", color=line.get_color(), label=f"qc G={G}")
        rb = [r for r in rs if r.get("ratio_fwdbwd") is not None]
        axes[1].plot([r["T"] for r in rs], [r["ratio_fwd"] for r in rs], "o-", color=line.get_color(), label=f"fwd G={G}")
        axes[1].plot([r["T"] for r in rb], [r["ratio_fwdbwd"] for r in rb], "x--", color=line.get_color(), label=f"f+b G={G}")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("forward ms (median)")
    axes[0].set_title("selected attention forward, H200 bf16, D=128, l'=64, n=16")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel("time fmsa / qc (< 1: fmsa faster)")
    axes[1].set_title("fmsa / qc")
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--Ts", default="8192,32768,65536,131072,262144,1048576")
    ap.add_argument("--Gs", default="1,2,4,5,8,16")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--S", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--check-T", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--skip-bwd-over", type=int, default=1 << 30, help="time only the forward above this T")
    ap.add_argument("--profile", default="", help="T,G: print a torch.profiler kernel table of fmsa and qc fwd+bwd, then exit")
    ap.add_argument("--variants", default="", help="T,G: time fmsa launch-setting variants, then exit")
    ap.add_argument("--partitions", default="", help="T,G,chunk,chunk,...: the L2 probe of partition sizes, then exit")
    ap.add_argument("--no-fla", action="store_true", help="skip fla-core's parallel_nsa at G >= 16")
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; stop starting new shapes after it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_selected.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    device = "cuda"
    t_start = time.time()
    Ts = [int(x) for x in args.Ts.split(",")]
    Gs = [int(x) for x in args.Gs.split(",")]
    D, S, bs = args.D, args.S, args.block_size
    global FLA
    FLA = fla_selected() if not args.no_fla else None
    dev = torch.cuda.get_device_name()
    print(f"{dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if args.profile:
        profile(*[int(x) for x in args.profile.split(",")], D, S, bs, device)
    if args.variants:
        for tg in args.variants.split(";"):
            variants(*[int(x) for x in tg.split(",")], D, S, bs, device)
    if args.partitions:
        T, G, *chunks = [int(x) for x in args.partitions.split(",")]
        partition_probe(T, G, D, S, bs, device, chunks)
    if args.profile or args.variants or args.partitions:
        return
    checks = {}
    for G in Gs:
        HK = 4 if G == 16 else 8
        checks[G] = check_reference(args.check_T, HK, G, D, S, bs, device)
    rows = []
    for T in Ts:
        for G in Gs:
            if time.time() - t_start > args.time_budget:
                print(f"time budget reached: skipping T={T} G={G}", flush=True)
                continue
            if not all(c["ok"] for c in checks[G].values()):  # no speed without correctness
                print(f"T={T} G={G}: not timed, a kernel failed the reference check at G={G}", flush=True)
                continue
            try:
                r = bench_shape(T, G, D, S, bs, device, args.warmup, args.rep, args.skip_bwd_over)
            except torch.OutOfMemoryError as e:  # the message names the allocation that failed
                print(f"T={T} G={G}: out of memory, skipped: {str(e)[:400]}", flush=True)
                torch.cuda.empty_cache()
                continue
            rows.append(r)
            if not r["check_ok"]:
                print(f"T={T} G={G}: fmsa and qc disagree, not timed: {r['fmsa_vs_qc']}", flush=True)
                continue
            print(f"T={T:>7} G={G:>2}: fmsa fwd {r['fmsa_fwd_ms']:8.2f} ms ({r['fmsa_fwd_tflops']:5.0f} TF/s) "
                  f"qc fwd {r['qc_fwd_ms']:8.2f} ms | f+b fmsa {fmt(r.get('fmsa_fwdbwd_ms')):>8} "
                  f"qc {fmt(r.get('qc_fwdbwd_ms')):>8} | ratio fwd {r['ratio_fwd']:.2f} "
                  f"f+b {fmt(r.get('ratio_fwdbwd'))} | extra MiB fmsa {r['fmsa_fwd_extra_mib']:.0f}/"
                  f"{fmt(r.get('fmsa_fwdbwd_extra_mib'), '.0f')} | auto {r['auto']} | "
                  f"check {'ok' if r['check_ok'] else 'FAIL ' + str(r['fmsa_vs_qc'])}", flush=True)
            with open(os.path.join(args.out, "selected_h200.json"), "w") as f:
                json.dump({"device": dev, "torch": torch.__version__, "triton": triton.__version__,
                           "args": vars(args), "reference_checks": checks, "rows": rows}, f, indent=1)
    header = (f"Selected attention on {dev} (torch {torch.__version__}, Triton {triton.__version__}), bf16, "
              f"D={D}, l'={bs}, n={S}, HK=8 (4 for G=16); median of triton.testing.do_bench. "
              "TFLOP/s count only unmasked q.k and p.v work (f+b: 3.5x the forward's). "
              "Extra MiB: peak allocation beyond inputs and outputs (index, buffers, autograd saves).")
    write_markdown(rows, os.path.join(args.out, "selected_h200.md"), header)
    plot(rows, os.path.join(args.out, "selected_h200.png"))
    print(f"done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
