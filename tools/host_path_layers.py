"""Where the host time of an eager decode call goes, layer by layer (issue 25, item 4; run by
tools/profile-host-path.sh on the GPU machine).

Subcommands (each prints a table and, with --json, writes it):

``layers``          this package (``import flash_mla``), per side-by-side case of bench/bench_call_overhead.py,
                    each way in with the schedule reused as the public API reuses it:
                      api            flash_mla.flash_mla_with_kvcache (public API, FlashMLASchedMeta reused)
                      api-gc-off     the same with Python's garbage collector off
                      api-full-path  the same without the fast path (no record made: what a call that does not
                                     repeat the previous one with its FlashMLASchedMeta costs, less the record)
                      python-layer   the public API with the native call replaced by a stub returning outputs
                                     made once (Python alone, on real CUDA tensors: torch.cuda queries included;
                                     on the eager route the TVM-FFI function is stubbed, its array's elements
                                     still converted to torch tensors)
                      eager function _torch_ops.eager_<op> with the schedule given (TVM-FFI call + conversions:
                                     what a reusing eager call runs below the Python layer), and route()
                      call-wrapper   flash_mla._torch_ops.<op> and <op>_scheduled (error mapping + OpOverload +
                                     dispatcher + op)
                      opoverload     torch.ops.flash_mla.<op>_scheduled.default(...) (what a reusing call runs:
                                     OpOverload + dispatcher + op) and <op>.default with the schedule given (4 outputs)
                      op-packet      torch.ops.flash_mla.<op>(...) (the OpOverloadPacket's overload resolution too)
                      opoverload-schedule   opoverload computing the schedule (what ``torch.ops`` times in
                                     bench_call_overhead: 3 launches, 5 non-empty allocations)
                      tvm-ffi        the TVM-FFI function with the same torch tensors (no torch dispatcher;
                                     TVM-FFI allocates through torch's allocator)
                    and torch baselines: torch.empty of out's shape, torch.ops.aten.empty_strided.default,
                    five torch.empty in a row, torch.ops.aten.alias.default (a dispatcher round trip that
                    allocates nothing).
                    Per row: host us per call (N calls back to back, no synchronisation: the clock stops when
                    the last call returns), host us with N/10 calls (a launch queue that throttles the host
                    would show up as host(N) > host(N/10)), and synchronised us (a sync after every call).
                    The b1 case's api row is timed once more at the end ("process age": the side-by-side
                    worker's b1 rows came out slower than its later ones).
``anchor-layers``   FlashMLA (run with its source tree first on PYTHONPATH): api, python-layer (flash_mla.cuda
                    stubbed) and cuda-direct (flash_mla.cuda.<op>, pybind11) for the same cases.
``loop``            the public API of one case in a loop for --seconds; with --pyspy / --perf-data, py-spy
                    (--native) or perf attached to the loop only (after imports and warm-up).
``pyspy-summary``   top frames of a ``py-spy record -f raw`` file: by self samples and by inclusive samples.

``--eager-route`` (layers, loop): this package with the eager TVM-FFI route of torch decode calls switched on
(``flash_mla._torch_ops.set_eager_route(True)``; off by default), so that its rows measure that route.

Usage: python tools/host_path_layers.py layers [--json PATH] [--calls 200] [--rounds 7] [--eager-route]
       PYTHONPATH=/tmp/anchor/flashmla python tools/host_path_layers.py anchor-layers [--json PATH]
       python tools/host_path_layers.py loop [--case "dense b1 h16 s_k64"] [--seconds 6] [--eager-route]
                                             [--pyspy /tmp/pyspy/bin/py-spy --raw OUT.raw | --perf-data OUT.data]
       python tools/host_path_layers.py pyspy-summary RAW [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bench_call_overhead import SIDE_BY_SIDE as CASES  # noqa: E402  (the side-by-side cases, one list)


def timings(fn, sync, calls: int, rounds: int) -> dict:
    """host_us (median over rounds of N back-to-back calls), host_us_short (N // 10 calls), sync_us (a
    synchronisation after every call), rounds_host_us (every round's host figure, in order)."""
    for _ in range(20):
        fn()
    sync()
    host = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        host.append((t1 - t0) / calls * 1e6)
    short_n = max(calls // 10, 5)
    short = []
    for _ in range(rounds * 2):
        t0 = time.perf_counter()
        for _ in range(short_n):
            fn()
        t1 = time.perf_counter()
        sync()
        short.append((t1 - t0) / short_n * 1e6)
    synced = []
    for _ in range(rounds):
        n = max(calls // 4, 5)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
            sync()
        synced.append((time.perf_counter() - t0) / n * 1e6)
    return {"host_us": statistics.median(host), "host_us_short": statistics.median(short),
            "sync_us": statistics.median(synced), "rounds_host_us": [round(x, 2) for x in host]}


def api_rows(rows, name, c, sync, args) -> None:
    """The public-API rows of one case: as called, and with the garbage collector off."""
    try_row(rows, f"{name} | api", c["api"], sync, args.calls, args.rounds)
    gc.disable()
    try:
        try_row(rows, f"{name} | api-gc-off", c["api"], sync, args.calls, args.rounds)
    finally:
        gc.enable()


def stubbed_layer_row(rows, name, c, sync, args, owner, attr: str, outputs: dict) -> None:
    """The public API with `owner.attr` (the native ops it calls) replaced by a stub whose functions return
    the fixed `outputs` (name -> result): the Python layer alone."""
    stub = type("_Stub", (), {})()
    for op, result in outputs.items():
        setattr(stub, op, lambda *a, _r=result: _r)
    real = getattr(owner, attr)
    setattr(owner, attr, stub)
    forget_reuse(c)  # (our fast path holds the op it calls: made again from the stub, and again after)
    try:
        try_row(rows, f"{name} | python-layer (op stubbed)", c["api"], sync, args.calls, args.rounds)
    finally:
        setattr(owner, attr, real)
        forget_reuse(c)


def forget_reuse(c) -> None:
    """Drop what our FlashMLASchedMeta holds for the fast path of a repeated call (``_reuse``: the op it calls
    among others), so that the next call takes the full path and records again (FlashMLA's has none)."""
    if hasattr(c["sched"], "_reuse"):
        c["sched"]._reuse = None


def make_case(torch, flash_mla, params: dict, g):
    """Tensors of one case and the public-API call (FlashMLASchedMeta reused); both packages' API."""
    dev = g.device
    d, pbs = 576, 64
    b, s_q, h_q = params["b"], params["s_q"], params["h_q"]
    q = torch.randn(b, s_q, h_q, d, device=dev, generator=g).to(torch.bfloat16)
    sched = flash_mla.get_mla_metadata()[0]
    scale = d ** -0.5
    c = {"q": q, "sched": sched, "scale": scale, "kind": params["kind"]}
    if params["kind"] == "dense":
        s_k = params["s_k"]
        blocks = (s_k + pbs - 1) // pbs
        c["k"] = (torch.randn(b * blocks, pbs, 1, d, device=dev, generator=g) / 4).to(torch.bfloat16)
        c["bt"] = torch.arange(b * blocks, dtype=torch.int32, device=dev).view(b, blocks)
        c["sl"] = torch.full((b,), s_k, dtype=torch.int32, device=dev)
        c["api"] = lambda: flash_mla.flash_mla_with_kvcache(q, c["k"], c["bt"], c["sl"], 512, sched, None, scale)
        # The op's arguments (ours and FlashMLA's extension take the same order), metadata appended later.
        c["op_args"] = (q, c["k"], 512, c["sl"], c["bt"], scale, False)
    else:
        s_kv = 4096
        c["k"] = torch.zeros(s_kv // pbs, pbs, 1, 656, dtype=torch.uint8, device=dev)
        c["idx"] = torch.randint(0, s_kv, (b, s_q, params["topk"]), dtype=torch.int32, device=dev, generator=g)
        c["api"] = lambda: flash_mla.flash_mla_with_kvcache(q, c["k"], None, None, 512, sched, None, scale, False,
                                                            True, indices=c["idx"])
    c["api"]()  # computes the schedule
    tsm, splits = sched.tile_scheduler_metadata, sched.num_splits
    if params["kind"] == "dense":
        c["op_args_meta"] = c["op_args"] + (tsm, splits)
        c["op_args_nometa"] = c["op_args"] + (None, None)
    else:
        c["op_args_meta"] = (q, c["k"], c["idx"], None, None, tsm, splits, None, None, None, 512, scale)
        c["op_args_nometa"] = (q, c["k"], c["idx"], None, None, None, None, None, None, None, 512, scale)
    return c


def route_args(c) -> tuple:
    """The tensors flash_mla_with_kvcache hands _torch_ops.route for this case (q first)."""
    if c["kind"] == "dense":
        return (c["q"], c["k"], c["bt"], c["sl"]) + (None,) * 6
    return (c["q"], c["k"], None, None, c["idx"]) + (None,) * 5


# Where to write the results after every row (--json), so that a run cut short keeps what it measured.
_SAVE: dict = {"path": None, "res": None}


def save() -> None:
    if _SAVE["path"] and _SAVE["res"] is not None:
        with open(_SAVE["path"], "w") as f:
            json.dump(_SAVE["res"], f, indent=1)


def report(rows: list, name: str, r: dict) -> None:
    rows.append(dict(name=name, **r))
    save()
    print(f"{name:50s} host {r['host_us']:8.2f}  host(N/10) {r['host_us_short']:8.2f}  synchronised "
          f"{r['sync_us']:8.2f} us/call", flush=True)


def try_row(rows, name, fn, sync, calls, rounds) -> None:
    try:
        report(rows, name, timings(fn, sync, calls, rounds))
    except Exception as e:  # noqa: BLE001 - one way in missing is reported, not fatal
        print(f"{name:50s} skipped: {type(e).__name__}: {e}", flush=True)
        rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
        save()


def gpu_info(torch, device: str) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count)
    else:
        info.update(gpu="none (a dry run on the CPU reference backend)")
    return info


def sync_of(torch, device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def cmd_layers(args) -> dict:
    import torch

    import flash_mla
    from flash_mla import _ffi, _torch_ops

    assert _torch_ops.available(), _torch_ops.load_error()
    if args.eager_route:
        _torch_ops.set_eager_route(True)
    sync = sync_of(torch, args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    rows: list = []
    res = {"package": os.path.abspath(flash_mla.__file__), **gpu_info(torch, args.device),
           "eager_route": _torch_ops.eager_route_state(), "rows": rows}
    _SAVE["res"] = res
    print(f"flash_mla from {res['package']} on {res['gpu']}, torch {res['torch']}", flush=True)
    ops = torch.ops.flash_mla
    first_api = None
    for name, params in CASES[:args.cases]:
        c = make_case(torch, flash_mla, params, g)
        opname = "dense_decode_fwd" if c["kind"] == "dense" else "sparse_decode_fwd"
        overload = getattr(ops, opname).default
        packet = getattr(ops, opname)
        wrapper = getattr(_torch_ops, opname)
        scheduled = getattr(ops, opname + "_scheduled", None)  # what a reusing public call runs
        a_meta, a_none = c["op_args_meta"], c["op_args_nometa"]
        api_rows(rows, name, c, sync, args)
        if hasattr(c["sched"], "_reuse"):  # the same call without the fast path (no record made)
            interface = sys.modules["flash_mla.flash_mla_interface"]
            real_record = interface._reuse_record
            interface._reuse_record = lambda *a: None
            forget_reuse(c)
            try:
                try_row(rows, f"{name} | api-full-path", c["api"], sync, args.calls, args.rounds)
            finally:
                interface._reuse_record = real_record
        if first_api is None:
            first_api = (name, c)
        # Python alone: the native call replaced by a stub returning fixed outputs. On the eager route (plain CUDA
        # tensors) that is the TVM-FFI function (returning the array of a real call; its elements are still
        # converted to torch tensors), on the torch.ops route the OpOverloads that _torch_ops calls (the
        # *_scheduled one is what a reusing call runs).
        route = _torch_ops.route(*route_args(c))
        print(f"{name}: route {'EAGER (TVM-FFI)' if route == _torch_ops.EAGER else 'torch.ops'} "
              f"({_torch_ops.eager_route_state()})", flush=True)
        if route == _torch_ops.EAGER:
            ffi_attr = "_ffi_dense_decode" if c["kind"] == "dense" else "_ffi_sparse_decode"
            fixed_arr = getattr(_ffi.lib, opname)(*a_meta)
            sync()
            real_ffi = getattr(_torch_ops, ffi_attr)
            setattr(_torch_ops, ffi_attr, lambda *a: fixed_arr)
            try:
                try_row(rows, f"{name} | python-layer (op stubbed)", c["api"], sync, args.calls, args.rounds)
            finally:
                setattr(_torch_ops, ffi_attr, real_ffi)
            eager_fn = getattr(_torch_ops, "eager_" + opname)
            try_row(rows, f"{name} | eager function (_torch_ops.eager_{opname}, schedule given)",
                    lambda: eager_fn(*a_meta), sync, args.calls, args.rounds)
            try_row(rows, f"{name} | route() + intercepted()", lambda: _torch_ops.route(*route_args(c)), sync,
                    args.calls, args.rounds)
        else:
            fixed = overload(*a_meta)
            sync()
            stubbed_layer_row(rows, name, c, sync, args, _torch_ops, "_ops",
                              {opname: fixed, opname + "_scheduled": fixed[:2]})
        try_row(rows, f"{name} | call-wrapper (_torch_ops.{opname})", lambda: wrapper(*a_meta), sync, args.calls,
                args.rounds)
        if scheduled is not None:
            sched_wrapper = getattr(_torch_ops, opname + "_scheduled")
            try_row(rows, f"{name} | call-wrapper (_torch_ops.{opname}_scheduled)", lambda: sched_wrapper(*a_meta),
                    sync, args.calls, args.rounds)
            try_row(rows, f"{name} | opoverload {opname}_scheduled", lambda: scheduled.default(*a_meta), sync,
                    args.calls, args.rounds)
        try_row(rows, f"{name} | opoverload (schedule given, 4 outputs)", lambda: overload(*a_meta), sync, args.calls,
                args.rounds)
        try_row(rows, f"{name} | op-packet", lambda: packet(*a_meta), sync, args.calls, args.rounds)
        try_row(rows, f"{name} | opoverload-schedule", lambda: overload(*a_none), sync, args.calls, args.rounds)
        ffi_fn = getattr(_ffi.lib, opname)
        try_row(rows, f"{name} | tvm-ffi (torch tensors, schedule given)", lambda: ffi_fn(*a_meta), sync, args.calls,
                args.rounds)
        try_row(rows, f"{name} | tvm-ffi (torch tensors, schedule computed)", lambda: ffi_fn(*a_none), sync,
                args.calls, args.rounds)
        if c["kind"] == "dense":
            q = c["q"]
            b, s_q, h_q = q.shape[0], q.shape[1], q.shape[2]
            shape = (b, s_q, h_q, 512)
            strides = (s_q * h_q * 512, h_q * 512, 512, 1)
            empty_strided = torch.ops.aten.empty_strided.default
            alias = torch.ops.aten.alias.default
            dev = q.device
            bf16 = torch.bfloat16
            try_row(rows, f"{name} | baseline torch.empty(out)", lambda: torch.empty(shape, dtype=bf16, device=dev),
                    sync, args.calls, args.rounds)
            try_row(rows, f"{name} | baseline aten.empty_strided.default(out)",
                    lambda: empty_strided(shape, strides, dtype=bf16, device=dev), sync, args.calls, args.rounds)

            def five():
                torch.empty(shape, dtype=bf16, device=dev)
                torch.empty((b, h_q, s_q), dtype=torch.float32, device=dev)
                torch.empty((0, 8), dtype=torch.int32, device=dev)
                torch.empty((0,), dtype=torch.int32, device=dev)
                torch.empty((1 << 20,), dtype=torch.uint8, device=dev)

            try_row(rows, f"{name} | baseline 5x torch.empty", five, sync, args.calls, args.rounds)
            try_row(rows, f"{name} | baseline aten.alias.default(q)", lambda: alias(q), sync, args.calls, args.rounds)
        del c
    if first_api is not None:  # process age: the first case again, last
        name, c = first_api
        try_row(rows, f"{name} | api (again, at the end of the process)", c["api"], sync, args.calls, args.rounds)
    return res


def cmd_anchor_layers(args) -> dict:
    import torch

    import flash_mla
    import flash_mla.cuda as fcuda  # FlashMLA's pybind11 extension

    sync = sync_of(torch, args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    rows: list = []
    res = {"package": os.path.abspath(flash_mla.__file__), **gpu_info(torch, args.device), "rows": rows}
    _SAVE["res"] = res
    print(f"FlashMLA from {res['package']} on {res['gpu']}", flush=True)
    interface = sys.modules.get("flash_mla.flash_mla_interface")
    first_api = None
    for name, params in CASES[:args.cases]:
        c = make_case(torch, flash_mla, params, g)
        opname = "dense_decode_fwd" if c["kind"] == "dense" else "sparse_decode_fwd"
        direct = getattr(fcuda, opname)
        a_meta = c["op_args_meta"]
        api_rows(rows, name, c, sync, args)
        if first_api is None:
            first_api = (name, c)
        if interface is not None and hasattr(interface, "flash_mla_cuda"):
            fixed = direct(*a_meta)
            sync()
            stubbed_layer_row(rows, name, c, sync, args, interface, "flash_mla_cuda", {opname: fixed})
        try_row(rows, f"{name} | cuda-direct (flash_mla.cuda.{opname})", lambda: direct(*a_meta), sync, args.calls,
                args.rounds)
        del c
    if first_api is not None:
        name, c = first_api
        try_row(rows, f"{name} | api (again, at the end of the process)", c["api"], sync, args.calls, args.rounds)
    return res


def _sampled_loop(fn, sync, seconds: float):
    """The loop that py-spy / perf sample (pyspy-summary keeps the stacks inside this function)."""
    n = 0
    t_end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < t_end:
        for _ in range(200):
            fn()
        sync()
        n += 200
    return n, time.perf_counter() - t0


def _allow_any_tracer() -> None:
    """Lets a profiler that is not this process's ancestor attach (Yama ptrace_scope 1): PR_SET_PTRACER_ANY."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except Exception as e:  # noqa: BLE001 - not Linux / no prctl: the profiler may still be allowed
        print(f"prctl(PR_SET_PTRACER_ANY) failed: {e}", flush=True)


def cmd_loop(args) -> dict:
    """The public API of one case in a loop for --seconds after the imports and a warm-up; with --pyspy /
    --perf-data the profiler is started on this process only then (so the imports are not sampled)."""
    import subprocess

    import torch

    import flash_mla

    if args.eager_route:
        from flash_mla import _torch_ops

        _torch_ops.set_eager_route(True)
    params = dict(CASES)[args.case]
    c = make_case(torch, flash_mla, params, torch.Generator(device=args.device).manual_seed(0))
    sync = sync_of(torch, args.device)
    for _ in range(200):  # warm-up outside the sampled function
        c["api"]()
    sync()
    prof = None
    dur = max(int(args.seconds) - 1, 1)
    if args.pyspy:
        _allow_any_tracer()
        prof = subprocess.Popen([args.pyspy, "record", "--native", "-r", str(args.rate), "-d", str(dur), "-f", "raw",
                                 "-o", args.raw, "--pid", str(os.getpid())])
    elif args.perf_data:
        _allow_any_tracer()
        prof = subprocess.Popen(["perf", "record", "-g", "-F", "4999", "-o", args.perf_data, "-p", str(os.getpid()),
                                 "--", "sleep", str(dur)])
    if prof is not None:
        time.sleep(0.5)  # the profiler attaches
    n, dt = _sampled_loop(c["api"], sync, args.seconds)
    print(f"loop {args.case}: {n} calls, {dt / n * 1e6:.2f} us/call (wall{', sampled' if prof else ''})", flush=True)
    rc = None
    if prof is not None:
        try:
            rc = prof.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prof.send_signal(2)  # SIGINT: py-spy / perf stop and still write what they sampled
            try:
                rc = prof.wait(timeout=10)
            except subprocess.TimeoutExpired:
                prof.kill()
        print(f"profiler exit status {rc}", flush=True)
    return {"case": args.case, "calls": n, "us_per_call": dt / n * 1e6, "profiler_rc": rc}


def _frame_library(frame: str) -> str:
    """The library of a py-spy frame "name (where)": a shared object's name, or "[python]" for Python code."""
    where = frame[frame.rfind("(") + 1:].rstrip(")") if frame.endswith(")") else ""
    if ".py:" in where or where.startswith("<frozen") or where.endswith(".py"):
        return "[python]"
    lib = where.split(":")[0].strip()
    return lib or "[unknown]"


def cmd_pyspy_summary(args) -> dict:
    """py-spy's raw format: one line per distinct stack, frames joined by ';' (outermost first), a space,
    the sample count. Only stacks inside `--within` (default: the loop of ``loop``, not the imports)."""
    self_c, incl_c, lib_c = collections.Counter(), collections.Counter(), collections.Counter()
    total = skipped = 0
    with open(args.raw, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or " " not in line:
                continue
            stack, _, cnt = line.rpartition(" ")
            try:
                n = int(cnt)
            except ValueError:
                continue
            frames = [fr.strip() for fr in stack.split(";") if fr.strip()]
            if not frames:
                continue
            if args.within and not any(fr.startswith(args.within) for fr in frames):
                skipped += n
                continue
            total += n
            self_c[frames[-1]] += n
            lib_c[_frame_library(frames[-1])] += n
            for fr in set(frames):
                incl_c[fr] += n

    def rows(counter, k):
        return [(fr, n, round(100.0 * n / max(total, 1), 2)) for fr, n in counter.most_common(k)]

    out = {"total_samples": total, "samples_outside": skipped, "within": args.within,
           "self_by_library": rows(lib_c, 30), "self": rows(self_c, args.top), "inclusive": rows(incl_c, args.top * 2)}
    print(f"samples {total} inside {args.within or 'everything'} ({skipped} outside: imports, set-up)")
    for title, key in (("self samples by library (leaf frame's shared object)", "self_by_library"),
                       ("self (leaf frames)", "self"), ("inclusive", "inclusive")):
        print(f"--- {title}")
        for fr, n, pct in out[key]:
            print(f"{pct:6.2f}%  {n:7d}  {fr[:160]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("layers", "anchor-layers"):
        s = sub.add_parser(name)
        s.add_argument("--calls", type=int, default=200)
        s.add_argument("--rounds", type=int, default=7)
        s.add_argument("--json")
        s.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": a dry run of the plumbing
        s.add_argument("--cases", type=int, default=len(CASES), help="the first N cases only")
    sub.choices["layers"].add_argument("--eager-route", action="store_true",
                                       help="switch the eager TVM-FFI route on (set_eager_route) before measuring")
    s = sub.add_parser("loop")
    s.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    s.add_argument("--pyspy", help="py-spy executable: record this process's loop (--native) into --raw")
    s.add_argument("--raw", default="pyspy.raw")
    s.add_argument("--rate", type=int, default=2000)
    s.add_argument("--perf-data", help="perf record -g this process's loop into this file")
    s.add_argument("--case", default=CASES[0][0])
    s.add_argument("--seconds", type=float, default=6.0)
    s.add_argument("--eager-route", action="store_true", help="ours: switch the eager TVM-FFI route on first")
    s.add_argument("--json")
    s = sub.add_parser("pyspy-summary")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=40)
    s.add_argument("--within", default="_sampled_loop", help="only stacks with a frame starting with this ('' = all)")
    s.add_argument("--json")
    args = ap.parse_args(argv)
    _SAVE["path"] = args.json
    fn = {"layers": cmd_layers, "anchor-layers": cmd_anchor_layers, "loop": cmd_loop,
          "pyspy-summary": cmd_pyspy_summary}[args.cmd]
    res = fn(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
