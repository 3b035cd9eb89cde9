"""Bit-level fingerprint of the dense MHA prefill backward (flash_attn_varlen_func): for fixed inputs, prints a
SHA-256 of dq, dk and dv (and of out / lse) per configuration. A kernel variant that claims the same operations in
the same order as the tree (e.g. a build switch of src/sm90/prefill/dense/bwd.cu) must print the same lines as the
tree; tools/ab-families.sh runs this for every mha* variant and for main, so the A/B log holds both.

Configurations: varlen lengths with a ragged tail, h 8 / h_kv 8 and 8 / 2, d_qk 128 and 192, causal and not, bf16
and fp16 (the plain and the masked steps of both backward kernels, GQA sums, several key and query blocks).

Usage: python3 bench/dense_prefill_grad_hash.py [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys

import torch

import flash_mla

LENS = [700, 129, 1000]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the lines to this file")
    args = ap.parse_args()
    lines = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in (128, 192):
            for h, hk in ((8, 8), (8, 2)):
                for causal in (False, True):
                    gen = torch.Generator(device="cuda").manual_seed(1234 + d + h + hk + causal)
                    total = sum(LENS)
                    q = (torch.randn(total, h, d, device="cuda", generator=gen) / 4).to(dtype).requires_grad_(True)
                    k = (torch.randn(total, hk, d, device="cuda", generator=gen) / 4).to(dtype).requires_grad_(True)
                    v = (torch.randn(total, hk, 128, device="cuda", generator=gen) / 4).to(dtype).requires_grad_(True)
                    dout = (torch.randn(total, h, 128, device="cuda", generator=gen) / 4).to(dtype)
                    cu = torch.tensor([0] + list(itertools.accumulate(LENS)), dtype=torch.int32, device="cuda")
                    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu, cu, max(LENS), max(LENS), causal=causal)
                    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
                    name = f"{str(dtype).split('.')[-1]} d{d} h{h}/{hk} {'causal' if causal else 'full'}"
                    lines.append(f"{name:28s} out {digest(out)} lse {digest(lse)} dq {digest(dq)} dk {digest(dk)} "
                                 f"dv {digest(dv)}")
                    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
