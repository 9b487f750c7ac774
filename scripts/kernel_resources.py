"""Registers, spills, shared memory and instruction counts of the main Triton kernels, compiled
for the H200 (sm_90) on any machine, no GPU needed.

Triton compiles ahead of time for a named target; this script does that for the shapes we
benchmark (Llama3-8B G=4 and Qwen3-14B G=5, D=128) with the shipped launch settings, with
pointer arguments marked 16-byte aligned as Triton's launcher marks them on the device, and
reads the resource usage back with the cuobjdump that Triton's wheel carries. Under the device's
Triton (3.6) it reproduces what Nsight Compute read there (benchmarks/results/ncu/nsa_64k/):
fmsa_fwd_kernel 156 registers and 49152 B of shared memory at G=4, fmsa_bwd_dkdv_kernel 255 and
198144 B, select_blocks_kernel 168 and 77952 B (the kernels and settings of that profile).
Occupancy follows: 65536 registers per SM.

Usage (repo root; the Triton version decides the code, so put the device's first on the path):
    pip install --no-deps --target /tmp/tr36 triton==3.6.0
    PYTHONPATH=/tmp/tr36:kernels python scripts/kernel_resources.py [--kernels fmsa_fwd,topk]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
REGS_PER_SM, SMEM_PER_SM, MAX_WARPS_PER_SM = 65536, 228 * 1024, 64


def compile_sm90(fn, signature: dict, constexprs: dict, aligned=(), **options):
    """Compile ``fn`` for sm_90: signature {arg: "*bf16" | "i32" | ...}, constexprs {arg: value}.

    Like the launcher on the device, pointers are marked 16-byte aligned; so are the integer
    arguments named in ``aligned`` (the launcher marks an int divisible by 16 when its value is).
    """
    sig = dict(signature)
    sig.update({n: "constexpr" for n in constexprs})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or n in aligned}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=SM90, options=options)


def resources(compiled, num_warps: int) -> dict:
    """Registers, stack, local-memory (spill) instructions, shared memory, SASS counts, occupancy."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
    shared = compiled.metadata.shared
    blocks = min(REGS_PER_SM // max(1, regs * 32 * num_warps), SMEM_PER_SM // max(1, shared + 1024),
                 MAX_WARPS_PER_SM // num_warps)
    count = lambda pat: len(re.findall(pat, sass, re.M))
    return dict(regs=regs, stack=stack, spill_ops=count(r"\b(?:LDL|STL)\b"), shared=shared,
                sass=count(r"^\s+/\*[0-9a-f]{4,}\*/"), hgmma=count(r"\bHGMMA\b"), lds_sts=count(r"\b(?:LDS|STS)\b"),
                shfl=count(r"\bSHFL\b"), layout_converts=compiled.asm["ttgir"].count("ttg.convert_layout"),
                blocks_per_sm=blocks, warps_per_sm=blocks * num_warps)


def cases():
    """(name, kernel, signature, constexprs, 16-divisible ints, launch options) for the shipped
    settings at T = 64K (T, Tk and the first token of a chunk are multiples of 16 there)."""
    from flash_msa import gates
    from flash_msa.compression import compress, topk
    from flash_msa.selection import fmsa
    from flash_msa.selection import qc
    from flash_msa.window import window as w
    B, F, I = "*bf16", "*fp32", "*i32"
    out = []
    # compression phi (per KV head, the same for every group size), with its MLP: l=32, d=16
    tiles = compress._tiles(torch.device("cuda"))
    L64, U8 = "*i64", "*u8"
    for kern, fn, sig, const in (
            ("fwd", compress.compress_fwd_kernel,
             dict(x=B, w=B, bias=F, mpos=F, proj=B, out=B, hid=F, first_key=L64, valid=U8, Tc="i32"),
             dict(H=8, D=128, BLOCK=32, BC=tiles["fwd"][0], MLP=True, PREC=None)),
            ("dx", compress.compress_bwd_dx_kernel,
             dict(dh=B, do=B, w=B, dx=B, slot_tok=L64, slot_row=I, Ns="i32", T="i32"),
             dict(H=8, D=128, BLOCK=32, STRIDE=16, BC=tiles["dx"][0], MLP=True, PREC=None)),
            ("prep", compress.compress_bwd_prep_kernel,
             dict(do=B, hid=F, proj=B, valid=U8, dh=B, Tc="i32"), dict(H=8, D=128, BC=tiles["prep"][0], PREC=None)),
            *(("dproj" if proj else "dw", compress.compress_bwd_dw_kernel,
               dict(x=B, dh=B, do=B, hid=F, dw=F, dproj=F, first_key=L64, valid=U8, Tc="i32", rows_per_split="i32"),
               dict(H=8, D=128, BLOCK=32, BC=tiles["dw"][0], PREC=None, PROJ=proj)) for proj in (False, True))):
        out.append((f"compress_{kern}", fn, sig, const, (), tiles["dw" if kern == "dproj" else kern][1]))
    # the gated combination's forward and the whole op's backward of it (flash_msa/fused.py)
    BD, BR, opts = gates._launch(128, torch.device("cuda"))
    for name, fn, sig in (
            ("gate_combine_fwd", gates.gate_combine_fwd_kernel, dict(a=B, b=B, c=B, g=F, o=B, N="i32")),
            ("gate_bwd_branch", gates.gate_bwd_branch_kernel,
             dict(a=B, b=B, c=B, g=F, do=B, lse_a=F, lse_b=F, lse_c=F, dg=F, delta=F, lse_g=F, N="i32"))):
        out.append((name, fn, sig, dict(D=128, BD=BD, BR=BR), (), opts))
    for G in (4, 5):
        HQ = 8 * G
        _, HKG = fmsa.default_partition(65536, HQ, 8, 16, 128, 2)
        cfg = fmsa.launch_settings()
        for tma in (False, True):  # partials by TMA bulk copies in key order (FWD_TMA), or row stores
            po = f"tensordesc<bf16[{cfg['fwd_bm']}, 128]>" if tma else B
            sig = dict(q=B, k=B, v=B, po=po, plse=F, pidx=I, key_rows="*i64", entry_ids=I, key_offsets=I, tile_key=I, tile_first=I,
                       block_start=I, block_end=I, k_lo="i32", c0="i32", hk0="i32", NB="i32", scale2="fp32")
            out.append((f"fmsa_fwd{' tma' if tma else ''} G={G}", fmsa.fmsa_fwd_kernel, sig,
                        dict(HQ=HQ, HK=8, G=G, S=16, D=128, BS=64, BM=cfg["fwd_bm"], NT=cfg["fwd_tiles"], HKG=HKG,
                             TMA=tma),
                        ("c0",),
                        dict(num_warps=cfg["fwd_warps"], num_stages=fmsa._fwd_stages(cfg, tma, 64, 128),
                             **({"maxnreg": cfg["fwd_maxnreg"]} if cfg["fwd_maxnreg"] else {}))))
        sig = dict(po=B, plse=F, pidx=I, o=B, lse=F, block_indices=I, tok_start=I, c0="i64", hk0="i32", T="i32")
        for local, tma in ((0, False), (2, False), (0, True)):  # local: the whole op's (fused.py)
            out.append((f"fmsa_merge{' local' if local else ''}{' tma' if tma else ''} G={G}", fmsa.fmsa_merge_kernel,
                        sig, dict(HQ=HQ, HK=8, G=G, S=16, D=128, BS=64, BG=fmsa._reduce_rows(G), BSS=16, HKG=HKG,
                                  LOCAL=local, TMA=tma), ("T",), dict(num_warps=fmsa._merge_warps(cfg, G))))
        BM = fmsa._bwd_tile_rows(cfg, 128, 64)
        for tma in (False, True):  # dq parts by TMA bulk copies in key order (BWD_TMA), or row stores
            dqp = f"tensordesc<bf16[{BM}, 128]>" if tma else B
            sig = dict(q=B, k=B, v=B, do=B, lse=F, delta=F, dk=F, dv=F, dkp=F, dvp=F, dqp=dqp, pidx=I, key_rows="*i64",
                       entry_ids=I, key_offsets=I, seg_key=I, seg_first=I, slot_first=I, block_start=I, block_end=I,
                       k_lo="i32", c0="i32", hk0="i32", NB="i32", scale2="fp32", scale="fp32")
            out.append((f"fmsa_bwd_dkdv{' tma' if tma else ''} G={G}", fmsa.fmsa_bwd_dkdv_kernel, sig,
                        dict(HQ=HQ, HK=8, G=G, S=16, D=128, BS=64, BM=BM, SEG=cfg["seg_tiles"] * BM, WRITE_DQ=True,
                             HKG=HKG, TMA=tma), ("c0",), dict(num_warps=cfg["bwd_warps"], num_stages=cfg["bwd_stages"])))
        sig = dict(q=B, k=B, v=B, o=B, lse=F, block_indices=I, tok_start=I, scale2="fp32")
        qc_opts = dict(num_warps=4, num_stages=qc._stages(64, 128))
        out.append((f"qc_fwd G={G}", qc.qc_fwd_kernel, sig,
                    dict(HQ=HQ, HK=8, G=G, S=16, D=128, BS=64, BG=qc._group_rows(G)), (), qc_opts))
        sig = dict(q=B, k=B, v=B, do=B, lse=F, delta=F, dq=B, block_indices=I, tok_start=I, scale2="fp32", scale="fp32")
        out.append((f"qc_bwd_dq G={G}", qc.qc_bwd_dq_kernel, sig,
                    dict(HQ=HQ, HK=8, G=G, S=16, D=128, BS=64, BG=qc._group_rows(G), ACC=False), (), qc_opts))
        sig = dict(q=B, k=B, lse=F, cu=I, cu_cmp=I, tile_seq=I, tile_t0=I, out=I, scale2="fp32")
        cfg = topk._launch(torch.device("cuda"))
        shipped = cfg.get("tl_sort", False)
        key32 = cfg.get("key32", True)
        # the shipped sort network and keys, the other network, the other key width (int32 / int64)
        hybrid = cfg.get("hybrid", False)
        # and the interior chunks one or two at a time ("pair")
        pair = cfg.get("pair", False)
        for tl_sort, k32, hyb, pr in ((shipped, key32, hybrid, pair), (not shipped, key32, False, pair),
                                      (shipped, not key32, False, pair), (shipped, key32, not hybrid, pair),
                                      (shipped, key32, hybrid, not pair)):
            perm, kv, hyb, fold4 = topk.layout_flags(dict(cfg, key32=k32, hybrid=hyb), 16, 4)
            name = (f"select_blocks{' tl_sort' if tl_sort else ' own-sort'}{'' if k32 == key32 else ' key32' if k32 else ' key64'}"
                    f"{'' if hyb == hybrid else ' hybrid' if hyb else ' no-hybrid'}"
                    f"{'' if pr == pair else ' pair' if pr else ' no-pair'}")
            out.append((f"{name} G={G}", topk.select_blocks_kernel,
                        sig, dict(HQ=HQ, HK=8, G=G, D=128, BD=128, BLOCK=32, STRIDE=16, SLC=64, TOPK=16, NB=16,
                                  LOG_NB=4, BT=cfg["BT"], BC=64,
                                  TL_SORT=tl_sort, INTERIOR=cfg.get("interior", True), KEY32=k32,
                                  PERM=perm, KV=kv, LOG_BT=cfg["BT"].bit_length() - 1, HYBRID=hyb, FOLD4=fold4,
                                  PAIR=topk.pair_flag(dict(cfg, pair=pr))),
                        (), cfg["opts"]))
        for kind in ("cmp", "window"):
            for kern, fn, extra in (("fwd", w.range_attn_fwd_kernel, dict(o=B, lse=F, o_loc=B, lse_loc=F)),
                                    ("dq", w.range_attn_bwd_dq_kernel, dict(do=B, lse=F, delta=F, dq=B, lse2=F, delta2=F)),
                                    ("dkdv", w.range_attn_bwd_dkdv_kernel,
                                     dict(do=B, lse=F, delta=F, dk=B, dv=B, lse2=F, delta2=F))):
                names = fn.arg_names[:fn.arg_names.index("HQ")]
                types = dict(q=B, k=B, v=B, lo=I, hi=I, qlo=I, qhi=I, mid=I, qmid=I, scale2="fp32", scale="fp32",
                             T="i32", Tk="i32", **extra)
                # the whole op's window also computes fmsa's local blocks (LOCAL, flash_msa/fused.py)
                for local in ((False, True) if kind == "window" else (False,)):
                    bm, bn, opts = w._tiles(128, torch.device("cuda"), kind, local)[kern]
                    const = {n: v for n, v in opts.items() if n.isupper()}  # dk/dv's row order
                    if kern == "dq":  # the whole op (flash_msa/fused.py): the window adds to compressed attention's dq
                        const["ACC"] = kind == "window"
                    opts = {n: v for n, v in opts.items() if not n.isupper()}
                    out.append((f"range_{kern} {kind}{' local' if local else ''} G={G}", fn,
                                {n: types[n] for n in names},
                                dict(HQ=HQ, HK=8, G=G, D=128, BD=128, BM=bm, BN=bn, LOCAL=local, **const),
                                ("T", "Tk"),
                                opts))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="", help="comma-separated name prefixes (default: all)")
    args = ap.parse_args()
    keep = [k for k in args.kernels.split(",") if k]
    print(f"Triton {triton.__version__}, target sm_90")
    cols = ("regs", "stack", "spill_ops", "shared", "blocks_per_sm", "warps_per_sm", "sass", "hgmma", "lds_sts",
            "shfl", "layout_converts")
    print("| kernel | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, fn, sig, const, aligned, opts in cases():
        if keep and not any(name.startswith(k) for k in keep):
            continue
        r = resources(compile_sm90(fn, sig, const, aligned, **opts), opts.get("num_warps", 4))
        print(f"| {name} | " + " | ".join(str(r[c]) for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
