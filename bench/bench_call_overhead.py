"""Host overhead per call of a tiny decode, by way in (issue 5, item 6).

Host time per call = wall time of N back-to-back calls / N, without synchronising
inside the loop (a tiny call launches 2-3 kernels, so N = 200 calls stay well within
the launch queue and the GPU never throttles the host). Reported per path, median of
7 rounds after warm-up:

* ``torch.ops``      — ``torch.ops.flash_mla.dense_decode_fwd`` called directly (stable-ABI op);
* ``api-torch``      — ``flash_mla.flash_mla_with_kvcache`` with torch tensors (Python wrapper + torch op);
* ``tvm-ffi-torch``  — the TVM-FFI function ``dense_decode_fwd`` with torch tensors;
* ``tvm-ffi-cupy``   — the TVM-FFI function with CuPy arrays (bf16 reinterpreted once), when CuPy is present;
* ``api-cupy-fp16``  — the public API with CuPy float16 arrays (TVM-FFI + stream scope);
* ``jax-jit``        — a jitted JAX function calling the public API (XLA custom call), when JAX has a GPU.

Target (issue 5): under 10 µs of host overhead per call. Writes
bench/results/<date>-call-overhead.json (use --out) with the GPU name and the
ceilings measured in the same run.

Usage: python bench/bench_call_overhead.py [--out DIR] [--calls 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def host_us(fn, sync, calls: int, rounds: int) -> float:
    for _ in range(20):
        fn()
    sync()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        per.append((t1 - t0) / calls * 1e6)
    return statistics.median(per)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)

    import torch

    import flash_mla
    from flash_mla import _ffi
    from common import measure_ceilings, write_results

    if not torch.cuda.is_available():
        print("no CUDA GPU: the call-overhead benchmark needs one", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    ceilings = measure_ceilings()
    # Tiny decode: b=1, s_q=1, h_q=16, one 64-token page.
    b, s_q, h_q, d, s_k = 1, 1, 16, 576, 64
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, s_q, h_q, d, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 64, 1, d, device=dev, generator=g).to(torch.bfloat16)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=dev)
    sl = torch.tensor([s_k], dtype=torch.int32, device=dev)
    scale = d ** -0.5
    sync = torch.cuda.synchronize
    cases = []

    def add(name, fn, sync_fn=sync, note=""):
        try:
            us = host_us(fn, sync_fn, args.calls, args.rounds)
        except Exception as e:  # a path that is not available in this build/environment
            print(f"{name:22s} skipped: {type(e).__name__}: {e}")
            return
        print(f"{name:22s} {us:8.2f} us/call host")
        cases.append({"name": name, "params": {"b": b, "s_q": s_q, "h_q": h_q, "d_qk": d, "s_k": s_k},
                      "host_us_per_call": us, "target_us": 10.0, "met": us < 10.0, "note": note})

    sched = flash_mla.get_mla_metadata()[0]
    from flash_mla import _torch_ops

    _torch_ops.load()
    ops = getattr(torch.ops, "flash_mla", None)
    if ops is not None and hasattr(ops, "dense_decode_fwd"):
        add("torch.ops", lambda: ops.dense_decode_fwd(q, k, 512, sl, bt, scale, False, None, None))
    add("api-torch", lambda: flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, sched, None, scale))
    add("tvm-ffi-torch", lambda: _ffi.lib.dense_decode_fwd(q, k, 512, sl, bt, scale, False, None, None))

    try:
        import cupy as cp

        qc, kc, btc, slc = (cp.from_dlpack(x) for x in (q.view(torch.int16), k.view(torch.int16), bt, sl))
        # CuPy has no bfloat16: reinterpret the bits through TVM-FFI (as a CuPy bf16 user would have to).
        qf = _ffi.lib.reinterpret_dtype(_ffi.to_ffi(qc), 4, 16)
        kf = _ffi.lib.reinterpret_dtype(_ffi.to_ffi(kc), 4, 16)
        add("tvm-ffi-cupy", lambda: _ffi.lib.dense_decode_fwd(qf, kf, 512, _ffi.to_ffi(slc), _ffi.to_ffi(btc), scale,
                                                               False, None, None),
            lambda: cp.cuda.Device().synchronize(), note="TVM-FFI tensors prepared once; cudaMalloc'd outputs")
        qh = cp.asarray(cp.random.standard_normal((b, s_q, h_q, d)), dtype=cp.float16)
        kh = cp.asarray(cp.random.standard_normal((2, 64, 1, d)) * 0.1, dtype=cp.float16)
        add("api-cupy-fp16", lambda: flash_mla.flash_mla_with_kvcache(qh, kh, btc, slc, 512,
                                                                       flash_mla.get_mla_metadata()[0], None, scale),
            lambda: cp.cuda.Device().synchronize(), note="public API, CuPy float16 arrays")
    except ImportError:
        print("cupy not installed: skipped")

    try:
        import jax

        gpus = jax.devices("gpu")
        put = lambda x: jax.device_put(np.asarray(x), gpus[0])  # noqa: E731
        qj = put(q.float().cpu().numpy()).astype(jax.numpy.bfloat16)
        kj = put(k.float().cpu().numpy()).astype(jax.numpy.bfloat16)
        btj, slj = put(bt.cpu().numpy()), put(sl.cpu().numpy())
        step = jax.jit(lambda a, bb, c, dd: flash_mla.flash_mla_with_kvcache(a, bb, c, dd, 512,
                                                                             flash_mla.get_mla_metadata()[0])[0])
        last = {}

        def jfn():
            last["o"] = step(qj, kj, btj, slj)

        add("jax-jit", jfn, lambda: jax.block_until_ready(last.get("o")), note="jitted function, XLA dispatch")
    except Exception as e:
        print(f"jax GPU path skipped: {type(e).__name__}: {e}")

    path = write_results("call-overhead", gpu, ceilings, cases, args.out)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
