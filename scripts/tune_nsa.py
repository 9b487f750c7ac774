"""Launch-setting sweep of the NSA kernels other than selected attention, on one GPU.

Times, side by side in one run, candidate tiles of
  * range attention (kernels/flash_msa/window/window.py) as compressed attention ("cmp": the
    packed compressed rows, long ranges) and as the sliding window ("window", w=512): the
    forward, and the backward (delta + dq + dk/dv) with one kernel's tiles changed at a time; the
    window also as the whole op runs it with fmsa ("window_local": with selected attention's two
    local blocks);
  * compression phi (kernels/flash_msa/compression/compress.py): rows per program of its
    forward, dx and dW kernels, forward + backward with the MLP;
  * the fused top-n selection (kernels/flash_msa/compression/topk.py): tokens per program,
    sort network (ours or tl.sort), warps and stages, and the kernel's variant flags.
Every candidate is checked against the shipped settings first (outputs within 2e-2 relative
RMS in bf16, top-n rows identical but for near-ties); the shipped settings are the first row
of each group. Timing: triton.testing.do_bench, median.

Usage (repo root, on the GPU machine):
    PYTHONPATH=kernels:. python scripts/tune_nsa.py --out OUTDIR [--Ts 65536,262144]
Writes OUTDIR/tune_h200.{json,md}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import triton

from flash_msa import tuning
from flash_msa.utils.compare import rel_rms


class _Candidate:
    """The launch settings of the candidate being timed: one flash_msa.tuning.override, replaced by
    each ``set`` and ended by ``clear`` (the shipped tables apply again)."""

    def __init__(self):
        self._stack = contextlib.ExitStack()

    def set(self, **ops):
        self._stack.close()
        self._stack.enter_context(tuning.override(**ops))

    def clear(self):
        self._stack.close()


CURRENT = _Candidate()

MODELS = {"llama3_8b": (32, 8, 128), "qwen3_14b": (40, 8, 128)}
L, STRIDE, SLC, TOPK, WINDOW = 32, 16, 64, 16, 512
DEVICE = "cuda"


def cfg(bm, bn, w, s, **sched):
    return (bm, bn, dict(num_warps=w, num_stages=s, **sched))


RANGE_CANDIDATES = {
    "fwd": [cfg(128, 64, 8, 2), cfg(128, 64, 8, 3), cfg(128, 64, 4, 3), cfg(128, 128, 8, 2), cfg(64, 64, 4, 3),
            cfg(128, 32, 4, 3), cfg(64, 128, 4, 2), cfg(64, 32, 4, 3), cfg(128, 32, 8, 3)],
    "dq": [cfg(64, 64, 4, 2), cfg(64, 64, 4, 3), cfg(128, 64, 8, 2), cfg(128, 32, 8, 2), cfg(64, 32, 4, 3),
           cfg(128, 64, 8, 3), cfg(128, 128, 8, 2)],
    # Tiles were swept in tune_h200*.md / tune_h200_dkdv2.log; the schedule (rows up or down,
    # programs head- or tile-major; window.DKDV_DESC) in tune_h200_dkdv_schedule.md, after which
    # the head-major order was removed. DESC=0 / DESC=1: the other row order than the kind's.
    "dkdv": [cfg(64, 64, 4, 2), cfg(64, 64, 4, 2, DESC=False), cfg(64, 64, 4, 2, DESC=True), cfg(128, 64, 8, 2),
             cfg(64, 64, 4, 3), cfg(64, 32, 4, 2), cfg(64, 64, 8, 2)],
}


def topk_cfg(bt, warps, stages, maxnreg, **keys):
    return dict(BT=bt, tl_sort=True, **keys,
                opts=dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg))


TOPK_CANDIDATES = [None,  # the shipped settings; tiles, sort networks and register caps were swept in
                   # tune_h200_topk_sort.md and tune_h200_topk_maxnreg.md, the overlap fold and the
                   # tile order in tune_h200_topk_fold.md and tune_h200_dkdv_schedule.md, the
                   # interior chunks in tune_h200_topk_interior.md, int32 keys in tune_h200_topk_key32.md and
                   # tune_h200_topk_key32_launch.md, the permuted score columns in tune_h200_topk_perm2.md,
                   # the hybrid network and the constant-weight fold in tune_h200_topk_hybrid.md.
                   # the interior chunks two at a time ("pair") in tune_h200_topk_pair.md (other caps and
                   # stages there too). Against one at a time, each timed twice:
                   topk_cfg(64, 4, 2, 168, key32=True, hybrid=True, pair=False),
                   topk_cfg(64, 4, 2, 168, key32=True, hybrid=True, pair=True),
                   topk_cfg(64, 4, 2, 168, key32=True, hybrid=True, pair=False)]


def rnd(gen, *shape):  # random bf16, never zero
    x = torch.randn(*shape, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    return x.masked_fill_(x.abs() < 1e-3, 1e-3)


def bench(fn, args):
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def sweep_range(kind, q, kk, vv, do, ranges, scale, args, emit, local=None):
    """``local`` = (mid, qmid): the window as the whole op runs it with fmsa (flash_msa/fused.py), its
    kernels also computing selected attention's two local blocks (o_loc / lse_loc forward, their
    softmax's gradients backward), with delta given and dq added to (op name ``window_local``)."""
    from flash_msa.selection.fmsa import attention_delta
    from flash_msa.window import window as w
    lo, hi, qlo, qhi = ranges
    op = kind if local is None else f"{kind}_local"
    CURRENT.clear()

    def fwd():
        if local is None:
            return w.range_attention_fwd(q, kk, vv, lo, hi, scale, kind)
        o_loc, lse_loc = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        o, lse = w.range_attention_fwd(q, kk, vv, lo, hi, scale, kind, local=(local[0], o_loc, lse_loc))
        return o, lse, o_loc, lse_loc

    f0 = fwd()
    o0, lse0 = f0[:2]
    if local is None:
        def bwd(check=True):
            return w.range_attention_bwd(q, kk, vv, o0, lse0, do, None, lo, hi, qlo, qhi, scale, kind)
    else:
        delta, delta2 = attention_delta(o0, do), attention_delta(f0[2], do)
        dq0 = torch.randn_like(q)  # the other branches' dq, which the window adds to
        dq_run = torch.empty_like(q)  # what the timed calls add to (their sums are never read)

        def bwd(check=True):
            # checked calls add to a fresh copy of dq0; timed ones to dq_run, with no copy in the timing
            return w.range_attention_bwd(q, kk, vv, None, lse0, do, None, lo, hi, qlo, qhi, scale, kind, delta=delta,
                                         dq=dq0.clone() if check else dq_run, local=(local[0], local[1], f0[3], delta2))
    ref = (f0, bwd())
    for kernel, cands in RANGE_CANDIDATES.items():
        if kernel not in args.range_kernels.split(","):
            continue
        for cand in cands:
            CURRENT.set(range_attention={kernel: cand})
            name = f"BM={cand[0]} BN={cand[1]} warps={cand[2]['num_warps']} stages={cand[2]['num_stages']}"
            name += "".join(f" {n}={int(v)}" for n, v in cand[2].items() if n.isupper())
            try:
                if kernel == "fwd":
                    err = max(rel_rms(a, b) for a, b in zip(fwd(), ref[0]) if a.dtype != torch.float32)
                    fn = fwd
                else:
                    err = max(rel_rms(g, r) for g, r in zip(bwd(), ref[1]))
                    fn = lambda: bwd(check=False)
                ms = bench(fn, args) if err <= 2e-2 else None
                emit(dict(op=f"{op}_{kernel}", config=name, ms=ms, err=err))
            except Exception as e:  # a candidate that does not compile (shared memory) is reported, not fatal
                emit(dict(op=f"{op}_{kernel}", config=name, ms=None, err=None, error=f"{type(e).__name__}: {str(e)[:160]}"))
    CURRENT.clear()


def sweep_topk(q, k_cmp, lse, cu, cu_cmp, scale, args, emit):
    from flash_msa.compression import topk
    CURRENT.clear()
    ref = topk.select_blocks(q, k_cmp, lse, cu, cu_cmp, L, STRIDE, SLC, TOPK, scale)
    for cand in TOPK_CANDIDATES:
        CURRENT.set(topk=dict(cand or {}))
        name = "shipped" if cand is None else (f"BT={cand['BT']} "
                                               f"warps={cand['opts']['num_warps']} stages={cand['opts']['num_stages']}"
                                               + (" tl_sort" if cand.get("tl_sort") else " own-sort")
                                               + (f" maxnreg={cand['opts']['maxnreg']}" if "maxnreg" in cand["opts"] else "")
                                               + (f" interior={int(cand['interior'])}" if "interior" in cand else "")
                                               + ((" key32" if cand["key32"] else " key64") if "key32" in cand else "")
                                               + "".join(f" {o}={int(cand[o])}" for o in ("perm", "kv", "hybrid", "fold",
                                                                                           "pair") if o in cand))
        try:
            idx = topk.select_blocks(q, k_cmp, lse, cu, cu_cmp, L, STRIDE, SLC, TOPK, scale)
            same = (idx == ref).all(-1).float().mean().item()
            fn = lambda: topk.select_blocks(q, k_cmp, lse, cu, cu_cmp, L, STRIDE, SLC, TOPK, scale)
            # rows may differ only at near-ties (fp32 sums in another order): demand 99.9% identical
            emit(dict(op="topk", config=name, ms=bench(fn, args) if same >= 0.999 else None, rows_identical=same))
        except Exception as e:
            emit(dict(op="topk", config=name, ms=None, error=f"{type(e).__name__}: {str(e)[:160]}"))
    CURRENT.clear()


COMPRESS_CANDIDATES = [None,  # the shipped settings; entries of the compress table (flash_msa.tuning)
                       dict(fwd=(64, dict(num_warps=8, num_stages=2))),
                       dict(prep=(32, dict(num_warps=4, num_stages=1))),
                       dict(dx=(64, dict(num_warps=8, num_stages=2))),
                       dict(dx=(64, dict(num_warps=4, num_stages=1))),
                       dict(dw=(32, dict(num_warps=4, num_stages=2))),
                       dict(dw_max_splits=1),  # dW / dproj in one pass over the rows (before the splits)
                       dict(dw_max_splits=8),
                       dict(dw_max_splits=8, dw=(32, dict(num_warps=4, num_stages=2))),
                       dict(dw=(64, dict(num_warps=8, num_stages=3))),
                       dict(dw_split_rows=2048),
                       dict(dw_split_rows=512, dw_max_splits=8)]


def sweep_compress(k, wk, pos, proj, cu, args, emit):
    """phi with its MLP, forward + backward of one of K/V under the Triton kernels' tiles and
    settings (the PyTorch form they replaced was timed here at commit 755b1ad, from a script since
    removed: tune_h200_compress.log). ``err``: the largest relative RMS error of the output and the
    four gradients against the fp32 reference."""
    from flash_msa import reference
    from flash_msa.compression import compress
    leaves = [x.detach().requires_grad_() for x in (k, wk, pos, proj)]
    dout = torch.randn(k.shape[0] // STRIDE, *k.shape[1:], device=k.device, dtype=k.dtype)

    def run(fn, xs):
        out, _ = fn(xs[0], xs[1], xs[2], cu, L, STRIDE, proj=xs[3])
        return (out, *torch.autograd.grad(out, xs, dout.to(out.dtype)))
    ref = run(reference.compress_kv, [x.detach().float().requires_grad_() for x in leaves])

    def label(c):
        return " ".join(f"{n}={v}" if n.startswith("dw_") else f"{n}:BC={v[0]} w{v[1]['num_warps']} s{v[1]['num_stages']}"
                        for n, v in c.items())
    fn = compress.compress_kv
    for cand in COMPRESS_CANDIDATES:
        name = "shipped" if cand is None else label(cand)
        cand = cand or {}
        CURRENT.set(compress=cand)
        try:
            got = run(fn, leaves)
            err = max(rel_rms(a.float(), b) for a, b in zip(got, ref))
            emit(dict(op="compress", config=name, ms=bench(lambda: run(fn, leaves), args), err=err))
        except Exception as e:
            emit(dict(op="compress", config=name, ms=None, err=None, error=f"{type(e).__name__}: {str(e)[:160]}"))
    CURRENT.clear()


def profile_compress(k, wk, pos, proj, cu):
    """Kernel table of one compress_kv forward + backward (phi with its MLP), to see where it goes."""
    from torch.profiler import ProfilerActivity, profile
    from flash_msa.compression.compress import compress_kv
    leaves = [x.detach().requires_grad_() for x in (k, wk, pos, proj)]

    def step():
        out, _ = compress_kv(leaves[0], leaves[1], leaves[2], cu, L, STRIDE, proj=leaves[3])
        out.backward(torch.ones_like(out))
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70), flush=True)


def write_markdown(rows, path, header):
    lines = [header, ""]
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["T"], r["op"]), []).append(r)
    lines += ["| model | T | op | shipped ms | best ms | best config | all (config: ms) |", "|---" * 7 + "|"]
    for (model, T, op), rs in groups.items():
        timed = [r for r in rs if r.get("ms") is not None]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        allc = "; ".join(f"{r['config']}: {r['ms']:.2f}" if r.get("ms") is not None else f"{r['config']}: -" for r in rs)
        lines.append(f"| {model} | {T // 1024}K | {op} | {rs[0]['ms'] if rs[0].get('ms') is None else format(rs[0]['ms'], '.2f')} "
                     f"| {'-' if best is None else format(best['ms'], '.2f')} | {'-' if best is None else best['config']} | {allc} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--Ts", default="65536,262144")
    ap.add_argument("--models", default="llama3_8b,qwen3_14b")
    ap.add_argument("--ops", default="cmp,window,topk,compress",
                    help="any of cmp, window, window_local (the window with fmsa's local blocks, as in the whole op), topk, compress")
    ap.add_argument("--range-kernels", default="fwd,dq,dkdv", help="range-attention kernels to sweep")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=50)
    args = ap.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("tune_nsa.py needs a CUDA GPU")
    from flash_msa.compression.compress import compress_kv
    from flash_msa.compression.compressed_attention import compressed_attention, compressed_ranges
    from flash_msa.window.window import local_ranges, window_ranges

    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    rows, t0 = [], time.time()
    ops = args.ops.split(",")
    for model in args.models.split(","):
        HQ, HK, D = MODELS[model]
        for T in (int(x) for x in args.Ts.split(",")):
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            q, k, v, do = rnd(gen, T, HQ, D), rnd(gen, T, HK, D), rnd(gen, T, HK, D), rnd(gen, T, HQ, D)
            cu = torch.tensor([0, T], dtype=torch.int32, device=DEVICE)
            scale = D ** -0.5
            # compressed keys/values of phi at initialisation (block mean) plus a learned part
            w_mean = (torch.eye(D, device=DEVICE) / L).repeat(L, 1).expand(HK, -1, -1)
            wk = (w_mean + 0.02 / L * torch.randn(HK, L * D, D, device=DEVICE, generator=gen)).to(torch.bfloat16)
            pos = 0.1 * rnd(gen, HK, L, D)
            k_cmp, cu_cmp = compress_kv(k, wk, pos, cu, L, STRIDE)
            v_cmp, _ = compress_kv(v, wk, pos, cu, L, STRIDE)

            def emit(r):
                r.update(model=model, T=T)
                rows.append(r)
                print(f"{model} T={T} {r['op']:<12} {r['config']:<36} "
                      + (f"{r['ms']:8.2f} ms" if r.get("ms") is not None else "       -   ")
                      + (f" err {r['err']:.1e}" if r.get("err") is not None else "")
                      + (f" identical {r['rows_identical']:.4f}" if "rows_identical" in r else "")
                      + (f" {r['error']}" if "error" in r else ""), flush=True)
                with open(os.path.join(args.out, "tune_h200.json"), "w") as f:
                    json.dump({"device": dev, "torch": torch.__version__, "triton": triton.__version__,
                               "args": vars(args), "rows": rows}, f, indent=1)

            if "cmp" in ops:
                sweep_range("cmp", q, k_cmp, v_cmp, do,
                            compressed_ranges(cu, cu_cmp, T, k_cmp.shape[0], L, STRIDE), scale, args, emit)
            if "window" in ops:
                sweep_range("window", q, k, v, do, window_ranges(cu, T, WINDOW), scale, args, emit)
            if "window_local" in ops:
                sweep_range("window", q, k, v, do, window_ranges(cu, T, WINDOW), scale, args, emit,
                            local=local_ranges(cu, T, SLC))
            if "compress" in ops:
                proj = 0.02 * rnd(gen, HK, D, D)
                sweep_compress(k, wk, pos, proj, cu, args, emit)
                profile_compress(k, wk, pos, proj, cu)
            if "topk" in ops:
                _, lse = compressed_attention(q, k_cmp, v_cmp, cu, cu_cmp, L, STRIDE, scale)
                sweep_topk(q, k_cmp, lse, cu, cu_cmp, scale, args, emit)
            del q, k, v, do, k_cmp, v_cmp
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    header = (f"# NSA kernel launch sweep on {dev} (torch {torch.__version__}, Triton {triton.__version__})\n\n"
              f"bf16, D=128, l={L}, d={STRIDE}, l'={SLC}, n={TOPK}, w={WINDOW}; one sequence of T tokens. Median ms of "
              "triton.testing.do_bench. `*_fwd`: forward; `*_dq`, `*_dkdv`: the whole backward with that kernel's "
              "tiles changed. The first config of each op is the one shipped when the sweep ran. "
              "Command: `PYTHONPATH=kernels:. python3 scripts/tune_nsa.py --out $OUT`.")
    write_markdown(rows, os.path.join(args.out, "tune_h200.md"), header)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
