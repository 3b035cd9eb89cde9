"""Per-call cost of flash_mla's Python layer, with the native op replaced by a stub (no GPU needed).

What is timed is everything the public function does in Python before and after the native call:
argument checks, dtype / shape handling, routing (torch.ops / TVM-FFI / XLA), the scheduler object's
bookkeeping, conversions and the results. The native call itself is a stub that returns outputs made
once beforehand:

* torch route: the ``_op`` of each ``torch.ops.flash_mla.<op>.default`` (the C++ entry behind the
  OpOverload that ``flash_mla._torch_ops.call`` calls), so the OpOverload's own Python ``__call__`` is
  still counted but torch's dispatcher and the C++ op are not;
* TVM-FFI route (NumPy here): ``flash_mla._ffi.lib`` by a proxy whose op functions return TVM-FFI
  tensors made once.

The eager route of CUDA decode calls (TVM-FFI instead of torch.ops, docs/host-path.md) is emulated on CPU
tensors (group ``torch eager-emulated``, :class:`EagerEmulation`): the route forced, the TVM-FFI function stubbed.

Two devices for torch: ``cpu`` tensors take the CPU branch (lengths copied to the host and compared
when a FlashMLASchedMeta is reused), ``meta`` tensors the accelerator branch (the schedule key from
the length tensors' identity and version; a CUDA tensor would also query torch.cuda for the current
device and stream capture, about 0.5 us that this does not see). Shapes are a tiny decode (b 1, s_q 1,
h_q 16, one 64-token page) and a tiny prefill. The FlashMLASchedMeta is reused across calls (the layers
of one decoding step), as in a model.

``--anchor-path DIR`` times FlashMLA's Python layer the same way, in a second process with DIR first on
sys.path (both packages import as ``flash_mla``): its native module ``flash_mla.cuda`` is replaced by a
stub module before FlashMLA's package imports it (so FlashMLA need not be built), on the meta tensors
(FlashMLA's dense prefill allocates its outputs and a 32 MB workspace in Python, which on cpu tensors
would be timed as host mallocs).

``--real`` times the same calls with the real CPU op and the op called directly (dominated by the
reference attention and its threads: a check of the stub, not a measure of the layer).

Usage: python bench/bench_python_layer.py [--calls 2000] [--rounds 15] [--json PATH] [--profile NAME]
                                          [--anchor-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types


def per_call_us(fn, calls: int, rounds: int):
    """(min, median) over `rounds` of the mean time of `calls` back-to-back calls, in us of this thread's
    CPU time (the calls run on this thread only; CPU time leaves out the time other processes of a
    shared machine hold the core). The minimum is the figure to compare."""
    for _ in range(min(calls, 500)):
        fn()
    per = []
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(calls):
            fn()
        per.append((time.thread_time_ns() - t0) / calls / 1e3)
    return min(per), statistics.median(per)


def torch_cases(torch, flash_mla, device: str, stub: bool, anchor_cuda=None):
    """(name, fn) pairs of the public entry points on torch tensors of `device`; with `stub`, every
    op's C++ entry returns outputs made here (with `anchor_cuda`, FlashMLA's stub ``flash_mla.cuda``
    module, that module's functions)."""
    dev = torch.device(device)
    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    b, s_q, h_q, d = 1, 1, 16, 576
    q = torch.zeros(b, s_q, h_q, d, dtype=bf16, device=dev)
    k = torch.zeros(2, 64, 1, d, dtype=bf16, device=dev)
    bt = torch.tensor([[0, 1]], dtype=i32).to(dev)
    sl = torch.tensor([100], dtype=i32).to(dev)
    # sparse FP8 decode (V32 layout: 656 bytes per token)
    h_s, topk = 64, 64
    qs = torch.zeros(b, s_q, h_s, d, dtype=bf16, device=dev)
    ks = torch.zeros(2, 64, 1, 656, dtype=torch.uint8, device=dev)
    idx = torch.zeros(b, s_q, topk, dtype=i32, device=dev)
    # sparse prefill
    s_p, s_kv = 4, 128
    qp = torch.zeros(s_p, h_s, d, dtype=bf16, device=dev)
    kvp = torch.zeros(s_kv, 1, d, dtype=bf16, device=dev)
    idxp = torch.zeros(s_p, 1, topk, dtype=i32, device=dev)
    # dense MHA prefill (varlen)
    tq, hq, dq, dv = 8, 4, 128, 128
    qv = torch.zeros(tq, hq, dq, dtype=bf16, device=dev)
    kv_ = torch.zeros(tq, hq, dq, dtype=bf16, device=dev)
    vv = torch.zeros(tq, hq, dv, dtype=bf16, device=dev)
    cu = torch.tensor([0, 4, 8], dtype=i32).to(dev)

    if stub:
        def outs(*shapes_dtypes):
            return tuple(torch.empty(s, dtype=t, device=dev) for s, t in shapes_dtypes)

        dense_new = outs(((b, s_q, h_q, 512), bf16), ((b, h_q, s_q), f32), ((8, 8), i32), ((b + 1,), i32))
        dense_reuse = dense_new[:2] + outs(((0, 8), i32), ((0,), i32))
        sparse_new = outs(((b, s_q, h_s, 512), bf16), ((b, h_s, s_q), f32), ((8, 8), i32), ((b + 1,), i32))
        sparse_reuse = sparse_new[:2] + dense_reuse[2:]
        prefill = outs(((s_p, h_s, 512), bf16), ((s_p, h_s), f32), ((s_p, h_s), f32))
        varlen = (torch.empty(tq, hq, dv, dtype=bf16, device=dev),
                  torch.empty_strided((tq, hq), (1, tq), dtype=f32, device=dev))
        stubs = {  # (both packages' ops take the metadata at the same positions)
            "dense_decode_fwd": lambda *a: dense_new if a[7] is None else dense_reuse,
            "sparse_decode_fwd": lambda *a: sparse_new if a[5] is None else sparse_reuse,
            "sparse_prefill_fwd": lambda *a: prefill,
            "dense_prefill_fwd": (lambda *a: None) if anchor_cuda is not None else (lambda *a: varlen),
        }
        if anchor_cuda is None:  # ours: a call that reuses the schedule runs these ((out, lse) only)
            stubs["dense_decode_fwd_scheduled"] = lambda *a: dense_new[:2]
            stubs["sparse_decode_fwd_scheduled"] = lambda *a: sparse_new[:2]
        for name, fn in stubs.items():
            if anchor_cuda is not None:  # FlashMLA writes the dense prefill's outputs into its arguments
                setattr(anchor_cuda, name, fn)
            else:
                getattr(torch.ops.flash_mla, name).default._op = fn

    sd, ss = flash_mla.get_mla_metadata()[0], flash_mla.get_mla_metadata()[0]
    fwk = flash_mla.flash_mla_with_kvcache
    cases = [
        ("flash_mla_with_kvcache dense", lambda: fwk(q, k, bt, sl, 512, sd, None, None)),
        ("flash_mla_with_kvcache sparse fp8",
         lambda: fwk(qs, ks, None, None, 512, ss, None, None, False, True, indices=idx)),
        ("get_mla_metadata", lambda: flash_mla.get_mla_metadata()),
        ("flash_mla_sparse_fwd", lambda: flash_mla.flash_mla_sparse_fwd(qp, kvp, idxp, 0.1)),
        ("flash_attn_varlen_func", lambda: flash_mla.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 4, 4)),
    ]
    if not stub:
        ops = torch.ops.flash_mla
        cases.append(("torch.ops dense_decode_fwd (direct)",
                      lambda: ops.dense_decode_fwd.default(q, k, 512, sl, bt, d ** -0.5, False, None, None)))
    return cases


class EagerEmulation:
    """Context in which flash_mla_with_kvcache on meta torch tensors takes the eager route of CUDA tensors
    (docs/host-path.md) with the TVM-FFI function stubbed: ``_torch_ops.route`` answers EAGER wherever the real
    one answers torch (its cost included, less the interception checks that only CUDA calls reach, ~0.3 us
    here), and the TVM-FFI decode functions return the array of one real call on CPU tensors made with the
    schedule given (so the two elements a reusing call takes are still converted to torch tensors). What the
    Python layer of an eager CUDA call costs, on a machine without a GPU."""

    def __init__(self, torch, flash_mla):
        from flash_mla import _torch_ops

        self.ops = _torch_ops
        self.saved = None
        self.torch, self.flash_mla = torch, flash_mla

    def cases(self):
        torch, flash_mla, ops = self.torch, self.flash_mla, self.ops
        bf16, i32 = torch.bfloat16, torch.int32
        b, s_q, h_q, d = 1, 1, 16, 576
        q = torch.zeros(b, s_q, h_q, d, dtype=bf16)
        k = torch.zeros(2, 64, 1, d, dtype=bf16)
        bt = torch.tensor([[0, 1]], dtype=i32)
        sl = torch.tensor([100], dtype=i32)
        h_s, topk = 64, 64
        qs = torch.zeros(b, s_q, h_s, d, dtype=bf16)
        ks = torch.zeros(2, 64, 1, 656, dtype=torch.uint8)
        idx = torch.zeros(b, s_q, topk, dtype=i32)
        scale = d ** -0.5
        # (the TVM-FFI functions, not the ops: torch_cases() stubs those)
        first = ops._ffi_dense_decode(q, k, 512, sl, bt, scale, False, None, None)
        tsm, ns = ops._ffi_item(first, 2), ops._ffi_item(first, 3)
        self.dense_arr = ops._ffi_dense_decode(q, k, 512, sl, bt, scale, False, tsm, ns)
        first = ops._ffi_sparse_decode(qs, ks, idx, None, None, None, None, None, None, None, 512, scale)
        tsm, ns = ops._ffi_item(first, 2), ops._ffi_item(first, 3)
        self.sparse_arr = ops._ffi_sparse_decode(qs, ks, idx, None, None, tsm, ns, None, None, None, 512, scale)
        sd, ss = flash_mla.get_mla_metadata()[0], flash_mla.get_mla_metadata()[0]
        fwk = flash_mla.flash_mla_with_kvcache
        # The calls on meta tensors (the CPU branch copies the lengths to the host, which a CUDA call never does;
        # meta tensors take the device branch, schedule key and fast path included, as CUDA ones do).
        q, k, bt, sl, qs, ks, idx = (t.to("meta") for t in (q, k, bt, sl, qs, ks, idx))
        return [
            ("flash_mla_with_kvcache dense", lambda: fwk(q, k, bt, sl, 512, sd, None, None)),
            ("flash_mla_with_kvcache sparse fp8",
             lambda: fwk(qs, ks, None, None, 512, ss, None, None, False, True, indices=idx)),
        ]

    def __enter__(self):
        ops = self.ops
        self.saved = (ops.route, ops._ffi_dense_decode, ops._ffi_sparse_decode)
        real_route, eager = ops.route, ops.EAGER
        ops.route = lambda *t: eager if real_route(*t) else 0
        ops._ffi_dense_decode = lambda *a: self.dense_arr
        ops._ffi_sparse_decode = lambda *a: self.sparse_arr
        return self

    def __exit__(self, *exc):
        self.ops.route, self.ops._ffi_dense_decode, self.ops._ffi_sparse_decode = self.saved


def numpy_cases(np, flash_mla, stub: bool):
    """The dense decode through TVM-FFI with NumPy arrays (the route of CuPy, Paddle and NumPy)."""
    import ml_dtypes
    import tvm_ffi

    from flash_mla import _ffi

    bf16 = np.dtype(ml_dtypes.bfloat16)
    b, s_q, h_q, d = 1, 1, 16, 576
    q = np.zeros((b, s_q, h_q, d), bf16)
    k = np.zeros((2, 64, 1, d), bf16)
    bt = np.array([[0, 1]], np.int32)
    sl = np.array([100], np.int32)
    if stub:
        real = _ffi.lib

        def ffi(a):
            return tvm_ffi.from_dlpack(a)

        new = (ffi(np.zeros((b, s_q, h_q, 512), np.float32)), ffi(np.zeros((b, h_q, s_q), np.float32)),
               ffi(np.zeros((8, 8), np.int32)), ffi(np.zeros((b + 1,), np.int32)))

        class Lib:
            def __getattr__(self, name):
                return getattr(real, name)

            @staticmethod
            def dense_decode_fwd(*a):
                return new

        _ffi.lib = Lib()
    sched = flash_mla.get_mla_metadata()[0]
    return [("flash_mla_with_kvcache dense", lambda: flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, sched))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--real", action="store_true", help="real CPU op instead of the stub (torch, cpu only)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--profile", help="cProfile one case (its name as printed) and print the top functions")
    ap.add_argument("--anchor-path", help="FlashMLA's source tree (the directory holding its flash_mla package): "
                    "its Python layer side by side")
    ap.add_argument("--as-anchor", help=argparse.SUPPRESS)  # the FlashMLA process: its source tree
    args = ap.parse_args(argv)

    if args.as_anchor:
        return anchor_process(args)

    import numpy as np
    import torch

    import flash_mla
    from flash_mla import _torch_ops

    if not _torch_ops.available():
        print(f"torch.ops.flash_mla unavailable: {_torch_ops.load_error()}", file=sys.stderr)
        return 2
    groups = [("torch cpu", torch_cases(torch, flash_mla, "cpu", not args.real))]
    if not args.real:
        groups.append(("torch meta", torch_cases(torch, flash_mla, "meta", True)))
        groups.append(("numpy tvm-ffi", numpy_cases(np, flash_mla, True)))
    results = run_groups(groups, args)
    if not args.real:
        emulation = EagerEmulation(torch, flash_mla)
        eager_cases = emulation.cases()  # (made before the stubs go in: one real call each)
        with emulation:
            results += run_groups([("torch eager-emulated", eager_cases)], args)
    doc = {"python": sys.version.split()[0], "torch": torch.__version__, "stub": not args.real,
           "calls": args.calls, "rounds": args.rounds, "results": results}
    if args.anchor_path and not args.real:
        # FlashMLA's process and our meta group again, alternating twice: the minimum of each side.
        ours_meta = [r for r in results if r["route"] == "torch meta"]
        anchor = []
        for i in range(2):
            anchor.append(run_anchor(args))
            if i == 0:
                ours_meta += run_groups([g for g in groups if g[0] == "torch meta"], args, quiet=True)
        best = lambda rows: {r["entry"]: min(x["us_per_call_min"] for x in rows if x["entry"] == r["entry"])  # noqa: E731
                             for r in rows}
        ours, theirs = best(ours_meta), best([r for a in anchor for r in a["results"]])
        eager = best([r for r in results if r["route"] == "torch eager-emulated"])
        doc["side_by_side"] = {"anchor_module": anchor[0]["module"], "route": "torch meta",
                               "entries": [{"entry": e, "ours_us": ours[e], "flashmla_us": theirs[e],
                                            "ratio": ours[e] / theirs[e],
                                            **({"ours_eager_emulated_us": eager[e]} if e in eager else {})}
                                           for e in theirs if e in ours]}
        print("\nPython layer side by side (torch meta, stubbed op; min us per call, two runs each; 'eager': ours on"
              " the emulated eager route, one run):")
        for r in doc["side_by_side"]["entries"]:
            print(f"  {r['entry']:40s} ours {r['ours_us']:7.2f}  FlashMLA {r['flashmla_us']:7.2f}  "
                  f"ratio {r['ratio']:.2f}"
                  + (f"  eager {r['ours_eager_emulated_us']:7.2f}" if "ours_eager_emulated_us" in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def run_groups(groups, args, quiet: bool = False) -> list:
    results = []
    for group, cases in groups:
        for name, fn in cases:
            label = f"{group} | {name}"
            if args.profile and args.profile in label:
                import cProfile
                import pstats

                for _ in range(200):
                    fn()
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(args.calls):
                    fn()
                pr.disable()
                print(f"== {label}")
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)
                continue
            best, med = per_call_us(fn, args.calls, args.rounds)
            results.append({"route": group, "entry": name, "us_per_call_min": round(best, 3),
                            "us_per_call_median": round(med, 3)})
            if not quiet:
                print(f"{label:60s} {best:8.2f} us/call (median {med:.2f})")
    return results


def run_anchor(args) -> dict:
    """FlashMLA's Python layer in a process of its own; returns its results."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--as-anchor", os.path.abspath(args.anchor_path),
                          "--calls", str(args.calls), "--rounds", str(args.rounds)],
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"FlashMLA process failed (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def anchor_process(args) -> int:
    """FlashMLA's package from args.as_anchor with a stub native module; prints ``RESULT <json>``."""
    sys.path.insert(0, args.as_anchor)
    import torch

    cuda = types.ModuleType("flash_mla.cuda")  # found in sys.modules before FlashMLA's own flash_mla/cuda*.so
    sys.modules["flash_mla.cuda"] = cuda
    import flash_mla

    where = os.path.abspath(flash_mla.__file__)
    if not where.startswith(os.path.abspath(args.as_anchor) + os.sep):
        raise RuntimeError(f"imported {where}, not FlashMLA from {args.as_anchor}")
    results = run_groups([("torch meta", torch_cases(torch, flash_mla, "meta", True, anchor_cuda=cuda))], args)
    print("RESULT " + json.dumps({"module": where, "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
