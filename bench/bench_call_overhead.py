"""Host overhead per call of a tiny decode, by way in, and side by side with FlashMLA (issues 5 and 25).

Host time per call = wall time of N back-to-back calls / N, without synchronising
inside the loop (a tiny call launches 2-3 kernels, so N = 200 calls stay well within
the launch queue and the GPU never throttles the host). Reported per path, median of
7 rounds after warm-up:

* ``torch.ops``      — ``torch.ops.flash_mla.dense_decode_fwd`` called directly (stable-ABI op);
* ``api-torch``      — ``flash_mla.flash_mla_with_kvcache`` with torch tensors (Python wrapper + torch op, the
  default);
* ``api-torch-eager`` — the same through the eager TVM-FFI route (off by default; switched on for this row
  by ``flash_mla._torch_ops.set_eager_route(True)``, docs/host-path.md);
* ``eager-function`` — ``flash_mla._torch_ops.eager_dense_decode_fwd`` with the schedule given (what a reusing
  eager call runs below the Python layer: the TVM-FFI call and the two outputs converted to torch tensors);
* ``api-torch-tvm-ffi`` — the same call with torch tensors sent through TVM-FFI instead of torch.ops
  (what ``FLASHMLA_DISABLE_TORCH_OPS=1`` selects; the schedule is then recomputed by every call);
* ``tvm-ffi-torch``  — the TVM-FFI function ``dense_decode_fwd`` with torch tensors;
* ``tvm-ffi-cupy``   — the TVM-FFI function with CuPy arrays (bf16 reinterpreted once), when CuPy is present;
* ``api-cupy-fp16``  — the public API with CuPy float16 arrays (TVM-FFI + stream scope);
* ``jax-jit``        — a jitted JAX function calling the public API (XLA custom call), when JAX has a GPU.

Side by side (``--anchor-path``, issue 25 item 4): the public ``flash_mla_with_kvcache`` of both packages
-- ours and FlashMLA's, both importable as ``flash_mla`` -- in the same loop code, each in its own
process (``--worker``; FlashMLA's directory first on PYTHONPATH for the anchor), the two alternating
``--repeats`` times. Cases: small dense decodes and one sparse FP8 decode, torch tensors, one
FlashMLASchedMeta reused by every call (the layers of one decoding step). Per case and package: host
us per call (as above) and wall us per call (the N calls and the final synchronisation, i.e. what an
eager loop achieves when the GPU is slower than the host), each the minimum over the processes of the
median over rounds; ``ratio_host`` = ours / FlashMLA (issue 25's target: <= 0.8). ``--eager-route`` runs our
side with the eager TVM-FFI route switched on (``set_eager_route(True)``); each result records the route.

Writes bench/results/<date>-call-overhead.json (use --out) with the GPU name and the
ceilings measured in the same run.

Usage: python bench/bench_call_overhead.py [--out DIR] [--calls 200] [--rounds 7]
           [--anchor-path /tmp/anchor/flashmla] [--repeats 2] [--eager-route]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def host_and_wall_us(fn, sync, calls: int, rounds: int):
    """(host, wall) us per call, each the median over `rounds` of N back-to-back calls: host stops the
    clock when the last call returns, wall after synchronising the device."""
    for _ in range(min(20, calls)):
        fn()
    sync()
    host, wall = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


# Side-by-side cases: (name, params). Dense: bf16, d_qk 576, page 64, uniform lengths s_k. Sparse: FP8 V32
# cache (656 bytes a token), h_q 64, topk indices into a 4096-token cache.
SIDE_BY_SIDE = [
    ("dense b1 h16 s_k64", dict(kind="dense", b=1, s_q=1, h_q=16, s_k=64)),
    ("dense b1 h128 s_k2048", dict(kind="dense", b=1, s_q=1, h_q=128, s_k=2048)),
    ("dense b16 h16 s_k2048", dict(kind="dense", b=16, s_q=1, h_q=16, s_k=2048)),
    ("dense b128 s_q4 h16 s_k256", dict(kind="dense", b=128, s_q=4, h_q=16, s_k=256)),
    ("sparse-fp8 b1 h64 topk2048", dict(kind="sparse", b=1, s_q=1, h_q=64, topk=2048)),
]


def side_by_side_worker(calls: int, rounds: int, device: str = "cuda", eager_route: bool = False) -> int:
    """One package's side-by-side loop (whichever ``flash_mla`` this process imports); prints one
    ``RESULT <json>`` line. ``eager_route``: ours with the eager TVM-FFI route switched on. (``device="cpu"`` is a
    dry run of the plumbing on the reference backend.)"""
    import torch

    import flash_mla

    route = None
    if eager_route:
        from flash_mla import _torch_ops

        _torch_ops.set_eager_route(True)
        route = _torch_ops.eager_route_state()

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    d, pbs = 576, 64
    res = {"module": os.path.abspath(flash_mla.__file__), "version": getattr(flash_mla, "__version__", "?"),
           "eager_route": route, "cases": {}}
    for name, p in SIDE_BY_SIDE:
        b, s_q, h_q = p["b"], p["s_q"], p["h_q"]
        q = torch.randn(b, s_q, h_q, d, device=dev, generator=g).to(torch.bfloat16)
        sched = flash_mla.get_mla_metadata()[0]
        if p["kind"] == "dense":
            s_k = p["s_k"]
            blocks = (s_k + pbs - 1) // pbs
            k = (torch.randn(b * blocks, pbs, 1, d, device=dev, generator=g) / 4).to(torch.bfloat16)
            bt = torch.arange(b * blocks, dtype=torch.int32, device=dev).view(b, blocks)
            sl = torch.full((b,), s_k, dtype=torch.int32, device=dev)

            def fn(q=q, k=k, bt=bt, sl=sl, sched=sched):
                return flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, sched, None, d ** -0.5)
        else:
            s_kv, topk = 4096, p["topk"]
            k = torch.zeros(s_kv // pbs, pbs, 1, 656, dtype=torch.uint8, device=dev)  # zero scales: finite data
            idx = torch.randint(0, s_kv, (b, s_q, topk), dtype=torch.int32, device=dev, generator=g)

            def fn(q=q, k=k, idx=idx, sched=sched):
                return flash_mla.flash_mla_with_kvcache(q, k, None, None, 512, sched, None, d ** -0.5, False, True,
                                                        indices=idx)
        try:
            host, wall = host_and_wall_us(fn, sync, calls, rounds)
            res["cases"][name] = {"host_us_per_call": host, "wall_us_per_call": wall}
            ops = getattr(flash_mla, "_torch_ops", None)
            if ops is not None and hasattr(ops, "route"):  # ours: how many of 20 more calls took the full path
                real, full = ops.route, []
                ops.route = lambda *t: full.append(1) or real(*t)
                try:
                    for _ in range(20):
                        fn()
                finally:
                    ops.route = real
                sync()
                res["cases"][name]["full_path_calls_of_20"] = len(full)
        except Exception as e:  # noqa: BLE001 - a case this package does not run is reported, not fatal
            res["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
        del q, k, fn
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def run_worker(label: str, pythonpath, calls: int, rounds: int, device: str = "cuda",
               eager_route: bool = False) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # From outside the source tree, so that `import flash_mla` finds the installed package (or the anchor).
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(calls), "--rounds",
                        str(rounds), "--device", device] + (["--eager-route"] if eager_route else []), env=env,
                       cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"{label} worker failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def side_by_side(anchor_path: str, calls: int, rounds: int, repeats: int, device: str = "cuda",
                 eager_route: bool = False) -> list:
    """Both packages' workers, alternating `repeats` times; one case dict per side-by-side case."""
    anchor_path = os.path.abspath(anchor_path)
    runs = {"ours": [], "anchor": []}
    for _ in range(repeats):
        runs["ours"].append(run_worker("ours", None, calls, rounds, device, eager_route))
        runs["anchor"].append(run_worker("anchor", anchor_path, calls, rounds, device))
    if not runs["anchor"][0]["module"].startswith(anchor_path + os.sep):
        raise RuntimeError(f"the anchor worker imported {runs['anchor'][0]['module']}, not FlashMLA from {anchor_path}")
    if runs["ours"][0]["module"].startswith(anchor_path + os.sep):
        raise RuntimeError("our worker imported FlashMLA: is the anchor on PYTHONPATH already?")
    cases = []
    for name, params in SIDE_BY_SIDE:
        row = {"name": f"side-by-side {name}", "params": params, "ours_module": runs["ours"][0]["module"],
               "anchor_module": runs["anchor"][0]["module"], "ours_eager_route": runs["ours"][0].get("eager_route")}
        for pkg in ("ours", "anchor"):
            got = [r["cases"][name] for r in runs[pkg]]
            errors = [x["error"] for x in got if "error" in x]
            if errors:
                row[f"{pkg}_error"] = errors[0]
                continue
            row[f"{pkg}_host_us_per_call"] = min(x["host_us_per_call"] for x in got)
            row[f"{pkg}_wall_us_per_call"] = min(x["wall_us_per_call"] for x in got)
            if "full_path_calls_of_20" in got[0]:  # (ours: calls that missed the repeated-call fast path)
                row[f"{pkg}_full_path_calls_of_20"] = max(x["full_path_calls_of_20"] for x in got)
        if "ours_host_us_per_call" in row and "anchor_host_us_per_call" in row:
            row["ratio_host"] = row["ours_host_us_per_call"] / row["anchor_host_us_per_call"]
            row["ratio_wall"] = row["ours_wall_us_per_call"] / row["anchor_wall_us_per_call"]
            row["target_ratio"] = 0.8
            row["met"] = row["ratio_host"] <= 0.8
        cases.append(row)
        fmt = lambda pkg, k: (f"{row[f'{pkg}_{k}_us_per_call']:7.2f}" if f"{pkg}_{k}_us_per_call" in row  # noqa: E731
                              else "  error")
        print(f"{name:28s} host ours {fmt('ours', 'host')} FlashMLA {fmt('anchor', 'host')} us"
              f"  wall ours {fmt('ours', 'wall')} FlashMLA {fmt('anchor', 'wall')} us"
              + (f"  ratio host {row['ratio_host']:.2f} wall {row['ratio_wall']:.2f}" if "ratio_host" in row else "")
              + (f"  ours full path {row['ours_full_path_calls_of_20']}/20" if "ours_full_path_calls_of_20" in row else ""))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--anchor-path", help="directory from which `import flash_mla` loads FlashMLA (its built "
                    "source tree, e.g. /tmp/anchor/flashmla): adds the side-by-side cases")
    ap.add_argument("--repeats", type=int, default=2, help="side by side: processes per package, alternating")
    ap.add_argument("--eager-route", action="store_true", help="side by side: our package with the eager TVM-FFI "
                    "route switched on (flash_mla._torch_ops.set_eager_route; off by default)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one package's side-by-side loop
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the worker's ("cpu": dry run)
    args = ap.parse_args(argv)
    if args.worker:
        return side_by_side_worker(args.calls, args.rounds, args.device, args.eager_route)

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
            us = host_and_wall_us(fn, sync_fn, args.calls, args.rounds)[0]
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

    def add_api(name, note, schedule=None):
        # the public API on torch tensors, through whichever route is set now, with its own schedule object
        s = flash_mla.get_mla_metadata()[0] if schedule is None else schedule
        add(name, lambda: flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512, s, None, scale), note=note)

    add_api("api-torch", f"public API, torch tensors (eager route: {_torch_ops.eager_route_state()})", sched)
    try:
        _torch_ops.set_eager_route(True)
    except RuntimeError as e:  # (no CUDA kernels in this build, or a torch / tvm_ffi without what it needs)
        print(f"{'api-torch-eager':22s} skipped: {e}")
    else:
        try:
            add_api("api-torch-eager", "public API, torch tensors through the eager TVM-FFI route (off by default)")
        finally:
            _torch_ops.set_eager_route(False)
    tsm, splits = sched.tile_scheduler_metadata, sched.num_splits
    if tsm is not None and _torch_ops._ffi_dense_decode is not None:
        add("eager-function", lambda: _torch_ops.eager_dense_decode_fwd(q, k, 512, sl, bt, scale, False, tsm, splits),
            note="TVM-FFI call + outputs as torch tensors, schedule given")
    # torch tensors through TVM-FFI (what FLASHMLA_DISABLE_TORCH_OPS=1 does)
    with mock.patch.object(_torch_ops, "handles", lambda *a: False):
        add_api("api-torch-tvm-ffi", "public API, torch tensors through TVM-FFI (schedule recomputed every call)")
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

    if args.anchor_path:
        cases += side_by_side(args.anchor_path, args.calls, args.rounds, args.repeats, eager_route=args.eager_route)

    path = write_results("call-overhead", gpu, ceilings, cases, args.out)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
