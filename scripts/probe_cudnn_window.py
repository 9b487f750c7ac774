"""Probe: sliding-window attention of a uniform stream on cuDNN, against the Triton range kernels.

cuDNN's fused attention (through PyTorch) takes only a causal mask, no window. With query chunks
of C = w tokens, query t of chunk c sees keys [t - w + 1, t]: the causal triangle of its own chunk
(part A) and, of chunk c - 1, the keys after its own offset (part B, strictly upper triangular).
Reversing both the queries of chunk c (positions 0..C-2) and the keys of chunk c - 1 (positions
1..C-1) turns part B into a causal triangle of C - 1 positions. Both parts run as batched causal
attention (one call each), and their outputs merge by their lse. The backward runs both parts
with the merged output and lse.

Prints, per T: the check against the range kernel (relative RMS of o, dq, dk, dv), the times of
forward, backward and both for the two paths, and of the pieces (parts A and B alone, the flips).
Writes a JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from flash_msa.compression.dense_cmp import _cudnn_bwd, _cudnn_fwd
from flash_msa.utils.compare import rel_rms as rel
from flash_msa.window.window import range_attention_bwd, range_attention_fwd, window_ranges


def _fwd(q4, k4, v4, scale):
    """cuDNN causal attention (dense_cmp's call): o, lse [N, H, S], aux for _bwd."""
    o4, lse4, aux = _cudnn_fwd(q4, k4, v4, scale)
    return o4, lse4[..., 0], aux


def _bwd(do4, q4, k4, v4, o4, lse3, scale, aux):
    return _cudnn_bwd(do4, q4, k4, v4, o4, lse3.contiguous()[..., None], scale, aux)


def part_b_rows(x, B, L, C):
    """Queries of part B: chunks 1.., positions 0..C-2, reversed -> [B*(L/C-1), H, C-1, D] (a copy)."""
    H, D = x.shape[1:]
    return x.view(B, L // C, C, H, D)[:, 1:, :C - 1].flip(2).reshape(-1, C - 1, H, D).transpose(1, 2)


def part_b_keys(x, B, L, C):
    """Keys of part B: chunks ..-2, positions 1..C-1, reversed -> [B*(L/C-1), H, C-1, D] (a copy)."""
    H, D = x.shape[1:]
    return x.view(B, L // C, C, H, D)[:, :-1, 1:].flip(2).reshape(-1, C - 1, H, D).transpose(1, 2)


def chunks(x, C):
    T, H, D = x.shape
    return x.view(T // C, C, H, D).transpose(1, 2)


def cudnn_window_fwd(q, k, v, B, L, C, scale):
    T, HQ, D = q.shape
    oA, lseA, auxA = _fwd(chunks(q, C), chunks(k, C), chunks(v, C), scale)  # [N, HQ, C, D], [N, HQ, C]
    qB, kB, vB = part_b_rows(q, B, L, C), part_b_keys(k, B, L, C), part_b_keys(v, B, L, C)
    oB, lseB, auxB = _fwd(qB, kB, vB, scale)  # [N', HQ, C-1, D]
    o = oA.transpose(1, 2).reshape(T, HQ, D)
    lse = lseA.transpose(1, 2).reshape(T, HQ).clone()
    # merge part B into chunks 1.., positions 0..C-2 (this probe merges with torch ops)
    reg_o = o.view(B, L // C, C, HQ, D)[:, 1:, :C - 1]
    reg_l = lse.view(B, L // C, C, HQ)[:, 1:, :C - 1]
    ob = oB.flip(2).transpose(1, 2).reshape(reg_o.shape)
    lb = lseB.flip(2).transpose(1, 2).reshape(reg_l.shape)
    la = reg_l.clone()
    lm = torch.logaddexp(la, lb)
    reg_o.copy_((reg_o.float() * torch.exp(la - lm)[..., None] + ob.float() * torch.exp(lb - lm)[..., None]).to(o.dtype))
    reg_l.copy_(lm)
    return o, lse, (auxA, auxB, qB, kB, vB)


def cudnn_window_bwd(q, k, v, o, lse, do, B, L, C, scale, aux):
    auxA, auxB, qB, kB, vB = aux
    T, HQ, D = q.shape
    HK = k.shape[1]
    lse_c = lse.view(T // C, C, HQ).transpose(1, 2)
    dqA, dkA, dvA = _bwd(chunks(do, C), chunks(q, C), chunks(k, C), chunks(v, C), chunks(o, C), lse_c, scale, auxA)
    doB, oB = part_b_rows(do, B, L, C), part_b_rows(o, B, L, C)
    lseB = lse.view(B, L // C, C, HQ)[:, 1:, :C - 1].flip(2).reshape(-1, C - 1, HQ).transpose(1, 2)
    dqB, dkB, dvB = _bwd(doB, qB, kB, vB, oB, lseB, scale, auxB)
    dq = dqA.transpose(1, 2).reshape(T, HQ, D)
    dk = dkA.transpose(1, 2).reshape(T, HK, D)
    dv = dvA.transpose(1, 2).reshape(T, HK, D)
    dq.view(B, L // C, C, HQ, D)[:, 1:, :C - 1] += dqB.transpose(1, 2).reshape(B, L // C - 1, C - 1, HQ, D).flip(2)
    dk.view(B, L // C, C, HK, D)[:, :-1, 1:] += dkB.transpose(1, 2).reshape(B, L // C - 1, C - 1, HK, D).flip(2)
    dv.view(B, L // C, C, HK, D)[:, :-1, 1:] += dvB.transpose(1, 2).reshape(B, L // C - 1, C - 1, HK, D).flip(2)
    return dq, dk, dv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--Ts", default="65536,262144")
    ap.add_argument("--check-T", type=int, default=8192)
    ap.add_argument("--w", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dev = torch.device("cuda")
    HQ, HK, D, C = 32, 8, 128, a.w
    scale = D ** -0.5
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "HQ": HQ, "HK": HK, "D": D, "w": a.w, "rows": []}
    for T in [a.check_T] + [int(x) for x in a.Ts.split(",")]:
        torch.manual_seed(0)
        B, L = 1, T
        q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, HK, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(T, HK, D, device=dev, dtype=torch.bfloat16)
        do = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
        wr = window_ranges(cu, T, a.w)
        tri_f = lambda: range_attention_fwd(q, k, v, wr[0], wr[1], scale, "window")
        o_t, lse_t = tri_f()
        delta = (o_t.float() * do.float()).sum(-1)
        tri_b = lambda: range_attention_bwd(q, k, v, None, lse_t, do, None, *wr, scale, "window", delta=delta)
        cud_f = lambda: cudnn_window_fwd(q, k, v, B, L, C, scale)
        o_c, lse_c, aux = cud_f()
        cud_b = lambda: cudnn_window_bwd(q, k, v, o_c, lse_c, do, B, L, C, scale, aux)
        g_t, g_c = tri_b(), cud_b()
        row = {"T": T, "o": rel(o_c, o_t), "lse": rel(lse_c, lse_t), "dq": rel(g_c[0], g_t[0]),
               "dk": rel(g_c[1], g_t[1]), "dv": rel(g_c[2], g_t[2])}
        if T != a.check_T:
            bench = lambda f: triton.testing.do_bench(f, warmup=5, rep=30, return_mode="median")
            row.update(triton_fwd=bench(tri_f), triton_bwd=bench(tri_b), cudnn_fwd=bench(cud_f), cudnn_bwd=bench(cud_b))
            qA, kA, vA = chunks(q, C), chunks(k, C), chunks(v, C)
            row["cudnn_partA_fwd"] = bench(lambda: _fwd(qA, kA, vA, scale))
            qB, kB, vB = aux[2:]
            row["cudnn_partB_fwd"] = bench(lambda: _fwd(qB, kB, vB, scale))
            row["flip_q"] = bench(lambda: part_b_rows(q, B, L, C))
            oA, lA, axA = _fwd(qA, kA, vA, scale)
            row["cudnn_partA_bwd"] = bench(lambda: _bwd(chunks(do, C), qA, kA, vA, oA, lA, scale, axA))
            row["triton_fb"] = row["triton_fwd"] + row["triton_bwd"]
            row["cudnn_fb"] = row["cudnn_fwd"] + row["cudnn_bwd"]
        print(json.dumps({x: (round(y, 4) if isinstance(y, float) else y) for x, y in row.items()}), flush=True)
        res["rows"].append(row)
        del q, k, v, do, o_t, o_c, g_t, g_c, aux
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "window_cudnn_probe_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
