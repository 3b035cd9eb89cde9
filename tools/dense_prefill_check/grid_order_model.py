#!/usr/bin/env python3
"""A schedule model of the dense prefill's grids in both tile orders of dense_prefill.h's TileOrder, on the causal
benchmark shapes (b 2, s 4096 / 8192, h 128/128 and 32/4): the backward's two kernels (src/sm90/prefill/dense/bwd.cu)
and the persistent forward (fwd.cu).

Backward: the hardware hands a grid's CTAs out in linear index order, each to the first SM that frees up (a list
schedule); every kernel here holds one CTA per SM (shared memory). Forward: the persistent grid deals tile i to CTA
i % grid in even rounds of grid tiles and to grid - 1 - i % grid in odd ones (for_each_tile), a static deal. A tile's
time is modelled as its count of block pairs (64 x 128 or 128 x 64 queries x keys for the backward, 128 x 128 for the
forward: the unit of the GEMM loop) plus a fixed cost per tile (--overhead, in the same units). Printed per grid: its
tiles and waves, the makespan of each order over the ideal (all work spread evenly over the SMs), and what kByBlock
gains over kByHead. Non-causal grids have equal tiles, so only the causal ones are modelled.

Usage: python3 tools/dense_prefill_check/grid_order_model.py [--sms 132] [--overhead 0]"""
import argparse
import heapq

KV_BN, KV_BM = 128, 64  # dk / dv kernel: a CTA's key block, the query blocks it walks (bwd.cu kKvBN, kKvBM)
DQ_BM, DQ_BN = 128, 64  # dq kernel: a CTA's query block, the key blocks it walks (kDqBM, kDqBN)
FWD_BM, FWD_BN = 128, 128  # forward: a tile's query block, the key blocks it walks (kFwdBM, key block 128)


def makespan(works, sms, overhead):
    """Each CTA, in order, to the SM that frees up first; the time the last one ends."""
    free = [0.0] * sms
    for w in works:
        heapq.heapreplace(free, free[0] + w + overhead)
    return max(free)


def static_deal(works, sms, overhead):
    """The persistent forward's deal: round r of sms tiles, tile r * sms + c to CTA c (even r) or sms - 1 - c (odd r);
    the most loaded CTA's total."""
    load = [0.0] * sms
    for r0 in range(0, len(works), sms):
        for c in range(min(sms, len(works) - r0)):
            load[sms - 1 - c if (r0 // sms) % 2 else c] += works[r0 + c] + overhead
    return max(load)


def grids(s, h, hk, b=2):
    """(name, [(block, work)] in block order, heads, requests) of both kernels of one causal shape, s_q = s_k = s.
    Blocks are listed in the order each (head, request) hands them out (heaviest first, as the kernels do)."""
    group = h // hk
    kv = [(j, group * (s // KV_BM - (j * KV_BN) // KV_BM)) for j in range(s // KV_BN)]  # key block j
    dq = [(i, (s - i * DQ_BM) // DQ_BN) for i in range(s // DQ_BM)]  # reversed: the last query block first
    fwd = [(i, (s - i * FWD_BM) // FWD_BN) for i in range(s // FWD_BM)]  # the last query block first
    return [("dk/dv", kv, hk, b, makespan), ("dq", dq, h, b, makespan), ("fwd", fwd, h, b, static_deal)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=0.0)
    args = ap.parse_args()
    print(f"{'shape':<22}{'kernel':<7}{'tiles':>7}{'waves':>7}{'by head':>9}{'by block':>10}{'gain':>7}")
    for s in (4096, 8192):
        for h, hk in ((128, 128), (32, 4)):
            for name, blocks, heads, b, schedule in grids(s, h, hk):
                by_head = [w for _ in range(b) for _ in range(heads) for _, w in blocks]
                by_block = [w for _, w in blocks for _ in range(b) for _ in range(heads)]
                ideal = (sum(by_head) + args.overhead * len(by_head)) / args.sms
                mh, mb = schedule(by_head, args.sms, args.overhead), schedule(by_block, args.sms, args.overhead)
                print(f"{f's{s} h{h}/{hk} causal':<22}{name:<7}{len(by_head):>7}{len(by_head) / args.sms:>7.1f}"
                      f"{mh / ideal:>9.3f}{mb / ideal:>10.3f}{mh / mb:>7.3f}")


if __name__ == "__main__":
    main()
