"""Sparse FP8 MLA decode benchmark on an H200 vs the FlashMLA anchors (shared/anchors-h200.md).

Usage: python bench/bench_sparse_decode.py [--out bench/results] [--quick]

Cases: FlashMLA's sparse-decode perf cases (spec §5.2; s_q=2, varlen, sink on):
V3.2 (h_q 128, topk 2048, page 64, b 2/64/74/128), MODEL1 configs 1-4 (b 2..256), the
peak cases (b=148, topk 16384), plus tensor-parallel head counts h_q 8/16/32 (no anchor).
FLOP / byte formulas of spec §5.2 (tests/lib.py::count_flop_and_mem_vol_for_decode).
Time = split-KV kernel + combine kernel durations (summed, from the profiler), the
metadata being reused as across layers; the kernel-only rate is reported too. The caches
are filled with random valid FP8 bytes and power-of-two scales directly on the GPU
(values do not affect the speed; the GPU tests check correctness).
Each case records the main kernel the library runs for it (field "kernel": mma_sync, mma_small_heads or
wgmma_producer; the choice is a function of h_q, see default_kernel). Kernel variants are compared
between builds (tools/ab-variants.sh builds each variant and runs this script once per build).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import flash_mla  # noqa: E402

KERNEL = "flash_fwd_splitkv_mla_fp8_sparse_kernel"
COMBINE = "flash_fwd_mla_combine_kernel"


def default_kernel(b, s_q, h_q):
    """Main kernel the library runs for the shape (sparse_decode_main_kernel() in
    src/sm90/decode/sparse_fp8/sparse_decode.cu; the benchmark's caches are 16-byte aligned)."""
    if h_q > 32:
        return "wgmma_producer"
    if h_q > 16:
        return "wgmma_producer" if b * s_q >= 8 else "mma_sync"
    return "wgmma_producer" if b * s_q >= 32 else "mma_small_heads"


BS = [2, 64, 74, 128, 148, 256]

# name -> (params, anchors per b)
V32 = dict(h_q=128, d_qk=576, s_kv=32768, topk=2048, pbs=64)
V32_ANCHORS = {2: 112, 64: 393, 74: 375, 128: 400}
MODEL1 = {
    "config1": (dict(h_q=64, d_qk=512, s_kv=16384, topk=128, pbs=256, extra_s_kv=16384, extra_topk=512,
                     extra_pbs=64), [22.6, 218.7, 175.5, 233.9, 208.7, 246.5]),
    "config2": (dict(h_q=128, d_qk=512, s_kv=16384, topk=128, pbs=256, extra_s_kv=16384, extra_topk=1024,
                     extra_pbs=64), [70.9, 368.2, 335.1, 378.3, 358.6, 384.8]),
    "config3": (dict(h_q=64, d_qk=512, s_kv=16384, topk=128, pbs=256, extra_s_kv=16384, extra_topk=1024,
                     extra_pbs=2, extra_len=True), [14.7, 148.3, 170.3, 182.8, 179.9, 217.1]),
    "config4": (dict(h_q=128, d_qk=512, s_kv=16384, topk=128, pbs=256, extra_s_kv=16384, extra_topk=1024,
                     extra_pbs=2, extra_len=True), [34.4, 245.7, 245.3, 289.3, 289.3, 324.9]),
}
PEAK = {(64, 512): 312.5, (64, 576): 363.5, (128, 512): 474.0, (128, 576): 446.2}


def make_cache(n_blocks, pbs, d_qk, device="cuda"):
    """Packed FP8 cache with FlashMLA's padded block strides, random valid bytes."""
    bpt = 656 if d_qk == 576 else 584
    stride = (pbs + 1) * 656 if d_qk == 576 else -(-pbs * 584 // 576) * 576
    buf = torch.empty(n_blocks * stride, dtype=torch.uint8, device=device)
    blocks = buf.view(n_blocks, stride)
    # e4m3 payload: any byte except the NaN codes 0x7F / 0xFF
    rnd = torch.randint(0, 254, (n_blocks, stride), dtype=torch.int16, device=device)
    rnd = rnd + (rnd >= 127).to(torch.int16)
    blocks.copy_(rnd.to(torch.uint8))
    del rnd
    rope = (torch.randn(n_blocks, pbs, 64, device=device) / 10).to(torch.bfloat16).view(torch.uint8)
    if d_qk == 576:
        tok = blocks[:, : pbs * 656].view(n_blocks, pbs, 656)
        tok[:, :, 512:528] = torch.tensor([2.0 ** -7] * 4, dtype=torch.float32, device=device).view(torch.uint8)
        tok[:, :, 528:656] = rope.view(n_blocks, pbs, 128)
    else:
        data = blocks[:, : pbs * 576].view(n_blocks, pbs, 576)
        data[:, :, 448:576] = rope.view(n_blocks, pbs, 128)
        blocks[:, pbs * 576: pbs * 584] = 120  # e8m0 scales 2^-7 (pad byte too)
    return buf.as_strided((n_blocks, pbs, 1, bpt), (stride, bpt, bpt, 1))


def make_scope(b, s_q, s_kv, topk, pbs, d_qk, gen, with_len=False):
    """Varlen lengths, per-request random pages, topk distinct tokens per (request, row)."""
    lens = [max(int(gen.normalvariate(s_kv, s_kv / 2)), s_q) for _ in range(b)]
    max_pad = max(-(-max(lens) // (4 * pbs)), 1) * 4 * pbs
    nb = b * max_pad // pbs
    cache = make_cache(nb, pbs, d_qk)
    bt = torch.randperm(nb, device="cuda").view(b, -1)
    lens_t = torch.tensor(lens, device="cuda")
    idx = torch.empty(b, s_q, topk, dtype=torch.int64, device="cuda")
    for i in range(b):  # topk smallest of random keys over [0, len): distinct tokens in random order
        r = torch.rand(s_q, max_pad, device="cuda")
        r[:, lens[i]:] = 2.0
        sel = r.topk(topk, dim=-1, largest=False).indices if topk <= max_pad else None
        if sel is None:
            sel = torch.full((s_q, topk), max_pad, device="cuda")
        idx[i] = sel
    valid = idx < lens_t[:, None, None]
    t = torch.where(valid, idx, torch.zeros_like(idx))
    phys = torch.gather(bt[:, None, :].expand(b, s_q, -1), 2, t // pbs) * pbs + t % pbs
    indices = torch.where(valid, phys, torch.full_like(phys, -1)).to(torch.int32)
    length = torch.randint(0, topk + 1, (b,), dtype=torch.int32, device="cuda") if with_len else None
    return cache, indices, length


def counts(b, s_q, h_q, d_qk, scopes):
    """FLOP and bytes of spec §5.2 (count_flop_and_mem_vol_for_decode)."""
    attended, retrieved = 0, 0
    for indices, length in scopes:
        topk = indices.shape[-1]
        if length is None:
            attended += b * s_q * topk
            masked = indices
        else:
            attended += int(length.sum().item()) * s_q
            beyond = torch.arange(topk, device="cuda")[None, None, :] >= length[:, None, None]
            masked = torch.where(beyond, torch.full_like(indices, -1), indices)
        retrieved += int(torch.unique(masked).numel())
    kv_bytes = 656 if d_qk == 576 else 576
    flop = 2 * h_q * attended * (d_qk + 512)
    nbytes = 2 * b * s_q * h_q * d_qk + retrieved * kv_bytes + 2 * b * s_q * h_q * 512
    return flop, nbytes


def bench_case(name, cfg, b, anchor, ceil, s_q=2, seed=0):
    gen = random.Random(seed)
    torch.manual_seed(seed)
    h_q, d_qk = cfg["h_q"], cfg["d_qk"]
    q = torch.randn(b, s_q, h_q, d_qk, device="cuda").clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h_q, device="cuda")
    cache, indices, _ = make_scope(b, s_q, cfg["s_kv"], cfg["topk"], cfg["pbs"], d_qk, gen)
    kw = dict(softmax_scale=d_qk ** -0.55, is_fp8_kvcache=True, indices=indices, attn_sink=sink)
    scopes = [(indices, None)]
    if "extra_topk" in cfg:
        ecache, eidx, elen = make_scope(b, s_q, cfg["extra_s_kv"], cfg["extra_topk"], cfg["extra_pbs"], d_qk, gen,
                                        with_len=cfg.get("extra_len", False))
        kw.update(extra_k_cache=ecache, extra_indices_in_kvcache=eidx, extra_topk_length=elen)
        scopes.append((eidx, elen))
    flop, nbytes = counts(b, s_q, h_q, d_qk, scopes)
    sched, _ = flash_mla.get_mla_metadata()
    fn = lambda: flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, sched, **kw)  # noqa: E731
    t = common.kernel_times_us(fn, [KERNEL, COMBINE], reps=10)
    kt = t[KERNEL]
    ct = t[COMBINE] if not math.isnan(t[COMBINE]) else 0.0
    tt = t["span"]  # main start to combine end: the PDL combine overlaps the main kernel (common.kernel_times_us)
    case = {
        "name": name,
        "params": {"b": b, "s_q": s_q, **cfg},
        "kernel_us": kt, "combine_us": ct, "time_us": tt, "call_time_us": t["call"],
        "tflops": flop / tt / 1e6, "tflops_kernel_only": flop / kt / 1e6, "gbps": nbytes / tt / 1e3,
        "frac_matmul_ceiling": flop / tt / 1e6 / ceil["matmul_tflops"],
        "frac_copy_ceiling": nbytes / tt / 1e3 / ceil["copy_gbps"],
        "anchor_tflops": anchor,
        "ratio_to_anchor": None if anchor is None else flop / tt / 1e6 / anchor,
        "ratio_kernel_only": None if anchor is None else flop / kt / 1e6 / anchor,
        "kernel": default_kernel(b, s_q, h_q),
    }
    del cache, kw
    torch.cuda.empty_cache()
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    ceil = common.measure_ceilings()
    print(f"{gpu}: ceilings {ceil}", flush=True)
    cases = []

    def add(*a, **kw):
        c = bench_case(*a, ceil=ceil, **kw)
        r = c["ratio_to_anchor"]
        print(f"{c['name']:26s} kernel {c['kernel_us']:8.1f} us combine {c['combine_us']:6.1f} us "
              f"{c['tflops']:6.1f} TFLOP/s (kernel only {c['tflops_kernel_only']:6.1f}) {c['gbps']:6.0f} GB/s "
              f"anchor {c['anchor_tflops'] or '-'}  ratio {'-' if r is None else f'{r:.3f}'}", flush=True)
        cases.append(c)

    for b, a in V32_ANCHORS.items():
        add(f"v32 b{b}", V32, b, a)
    for cname, (cfg, anchors) in MODEL1.items():
        for b, a in zip(BS, anchors):
            if args.quick and b not in (2, 128):
                continue
            add(f"model1 {cname} b{b}", cfg, b, a)
    for (h_q, d_qk), a in PEAK.items():
        cfg = dict(h_q=h_q, d_qk=d_qk, s_kv=32768, topk=16384, pbs=64)
        add(f"peak h{h_q} d{d_qk}", cfg, 148, a)
    for h_q in (8, 16, 32):
        add(f"tp v32 h{h_q} b128", dict(V32, h_q=h_q), 128, None)
        add(f"tp model1-c1 h{h_q} b128", dict(MODEL1["config1"][0], h_q=h_q), 128, None)

    path = common.write_results("sparse-decode", gpu, ceil, cases, args.out)
    common.plot_ratios(cases, f"sparse FP8 decode vs FlashMLA ({gpu}), kernel+combine", path.replace(".json", ".png"))
    rs = [c["ratio_to_anchor"] for c in cases if c["ratio_to_anchor"]]
    rk = [c["ratio_kernel_only"] for c in cases if c["ratio_kernel_only"]]
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    print(f"wrote {path}; geomean ratio {gm(rs):.3f} (kernel only {gm(rk):.3f}) over {len(rs)} anchor cases")

if __name__ == "__main__":
    main()
