"""Run one representative case of each sm90 kernel family a few times, for Nsight Compute.

Meant to run under ncu on the GPU machine, e.g.
  ncu --clock-control none --kernel-name regex:'flash_fwd_splitkv_mla|sparse_attn_fwd' --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section WarpStateStats python3 tools/profile_ncu.py sparse-v32
Cases (argument): sparse-v32 (V3.2 b128: s_q 2, h_q 128, topk 2048), sparse-v32-b2 (the same at b 2), sparse-model1 (MODEL1 config 2,
b128), sparse-model1c3-b2 (MODEL1 config 3 at b 2: h_q 64, the plain wgmma kernel, one block per CTA), dense (b128, s_q 1, h_q 128, s_k 8192), dense-short (b128, s_q 1, h_q 128, varlen s_k ~256), prefill (s_q 4096, h_q 128, d_qk 576, topk 2048,
s_kv 8192). Each runs its op three times (the first two are warm-up, skip them with --launch-skip).
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import flash_mla  # noqa: E402


def run(case: str):
    if case.startswith("sparse"):
        import bench_sparse_decode as B
        cfg = (B.V32 if case.startswith("sparse-v32") else
               B.MODEL1["config3"][0] if case.startswith("sparse-model1c3") else B.MODEL1["config2"][0])
        gen = random.Random(0)
        torch.manual_seed(0)
        b, s_q = (2 if case.endswith("-b2") else 128), 2
        q = torch.randn(b, s_q, cfg["h_q"], cfg["d_qk"], device="cuda").clamp(-1, 1).to(torch.bfloat16)
        cache, indices, _ = B.make_scope(b, s_q, cfg["s_kv"], cfg["topk"], cfg["pbs"], cfg["d_qk"], gen)
        kw = dict(softmax_scale=cfg["d_qk"] ** -0.55, is_fp8_kvcache=True, indices=indices)
        if "extra_topk" in cfg:
            ecache, eidx, elen = B.make_scope(b, s_q, cfg["extra_s_kv"], cfg["extra_topk"], cfg["extra_pbs"],
                                              cfg["d_qk"], gen, with_len=cfg.get("extra_len", False))
            kw.update(extra_k_cache=ecache, extra_indices_in_kvcache=eidx, extra_topk_length=elen)
        sched, _ = flash_mla.get_mla_metadata()
        fn = lambda: flash_mla.flash_mla_with_kvcache(q, cache, None, None, 512, sched, **kw)  # noqa: E731
    elif case in ("dense", "dense-short"):
        import bench_dense_decode as D
        # dense: compute-bound anchor; dense-short: the whole-call anchor b128 h_q 128 s_k 256 (varlen)
        q, k, bt, lens_t, _ = (D.make_inputs(128, 1, 128, 8192, False) if case == "dense"
                               else D.make_inputs(128, 1, 128, 256, True))
        sched, splits = flash_mla.get_mla_metadata(lens_t, 128, 1)
        fn = lambda: flash_mla.flash_mla_with_kvcache(q, k, bt, lens_t, 512, sched, splits)  # noqa: E731
    elif case == "prefill":
        import bench_sparse_prefill as P
        q, kv, idx, sink = P.make_inputs(4096, 8192, 2048, 128, 576)
        fn = lambda: flash_mla.flash_mla_sparse_fwd(q, kv, idx, 576 ** -0.5, 512, attn_sink=sink)  # noqa: E731
    else:
        raise SystemExit(f"unknown case {case!r}: sparse-v32, sparse-v32-b2, sparse-model1, sparse-model1c3-b2, dense, "
                         "dense-short or prefill")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    print(case, "ok")


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "sparse-v32")
