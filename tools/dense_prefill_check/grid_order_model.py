#!/usr/bin/env python3
"""A list-schedule model of the dense prefill backward's two grids (src/sm90/prefill/dense/bwd.cu) in both CTA
orders of dense_prefill.h's BwdGridOrder, on the 16 benchmark shapes (b 2, s 4096 / 8192, h 128/128 and 32/4).

The hardware hands a grid's CTAs out in linear index order, each to the first SM that frees up; every kernel here
holds one CTA per SM (shared memory). A CTA's time is modelled as its count of block pairs (64 x 128 or 128 x 64
queries x keys, the unit of its GEMM loop) plus a fixed cost per CTA (--overhead, in the same units). Printed per grid:
its CTAs and waves, the makespan of each order over the ideal (all work spread evenly over the SMs), and what
kByBlock gains over kByHead. Non-causal grids have equal CTAs, so only the causal ones are modelled.

Usage: python3 tools/dense_prefill_check/grid_order_model.py [--sms 132] [--overhead 0]"""
import argparse
import heapq

KV_BN, KV_BM = 128, 64  # dk / dv kernel: a CTA's key block, the query blocks it walks (bwd.cu kKvBN, kKvBM)
DQ_BM, DQ_BN = 128, 64  # dq kernel: a CTA's query block, the key blocks it walks (kDqBM, kDqBN)


def makespan(works, sms, overhead):
    """Each CTA, in order, to the SM that frees up first; the time the last one ends."""
    free = [0.0] * sms
    for w in works:
        heapq.heapreplace(free, free[0] + w + overhead)
    return max(free)


def grids(s, h, hk, b=2):
    """(name, [(block, work)] in block order, heads, requests) of both kernels of one causal shape, s_q = s_k = s.
    Blocks are listed in the order each (head, request) hands them out (heaviest first, as the kernels do)."""
    group = h // hk
    kv = [(j, group * (s // KV_BM - (j * KV_BN) // KV_BM)) for j in range(s // KV_BN)]  # key block j
    dq = [(i, (s - i * DQ_BM) // DQ_BN) for i in range(s // DQ_BM)]  # reversed: the last query block first
    return [("dk/dv", kv, hk, b), ("dq", dq, h, b)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=0.0)
    args = ap.parse_args()
    print(f"{'shape':<22}{'kernel':<7}{'CTAs':>7}{'waves':>7}{'by head':>9}{'by block':>10}{'gain':>7}")
    for s in (4096, 8192):
        for h, hk in ((128, 128), (32, 4)):
            for name, blocks, heads, b in grids(s, h, hk):
                by_head = [w for _ in range(b) for _ in range(heads) for _, w in blocks]
                by_block = [w for _, w in blocks for _ in range(b) for _ in range(heads)]
                ideal = (sum(by_head) + args.overhead * len(by_head)) / args.sms
                mh, mb = makespan(by_head, args.sms, args.overhead), makespan(by_block, args.sms, args.overhead)
                print(f"{f's{s} h{h}/{hk} causal':<22}{name:<7}{len(by_head):>7}{len(by_head) / args.sms:>7.1f}"
                      f"{mh / ideal:>9.3f}{mb / ideal:>10.3f}{mh / mb:>7.3f}")


if __name__ == "__main__":
    main()
