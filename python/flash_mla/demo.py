"""The main job: one DeepSeek decode/prefill step of each MLA operator, checked.

``python -m flash_mla demo`` runs, on the best backend present (the Hopper
kernels when a compute-capability-9.0 GPU, PyTorch and a CUDA build are there;
the CPU reference backend otherwise):

1. a DeepSeek-V3 dense decode step (h_q 128, d_qk 576, d_v 512, page 64, a
   batch with varied context lengths, one of them empty);
2. a DeepSeek-V3.2 sparse FP8 decode step (V32 format, topk 2048, attn_sink);
3. a sparse prefill (d_qk 576, h_q 128, topk 512 — 2048 on the GPU —, invalid indices).

Each result is checked: GPU results against the CPU reference backend, CPU
results against an independent float64 NumPy computation. A table gives
backend, shape, time, TFLOP/s and GB/s. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, List

import ml_dtypes
import numpy as np

import flash_mla
from flash_mla import quant

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass
class Result:
    op: str
    backend: str
    shape: str
    time_ms: float
    flops: float
    nbytes: float
    max_err: float
    ok: bool
    reference: str  # what max_err is measured against


# ---------------------------------------------------------------- float64 oracles
def _softmax_rows(s: np.ndarray):
    m = s.max(-1, keepdims=True)
    finite = np.isfinite(m)
    m = np.where(finite, m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    lse = np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + m, np.inf)
    return np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0), lse[..., 0]


def oracle_dense(q, k_cache, block_table, lens, scale, causal):
    b, s_q, h_q, _ = q.shape
    pbs, h_kv = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros((b, s_q, h_q, 512))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        pages = [block_table[i, j] for j in range((n + pbs - 1) // pbs)]
        kv = np.concatenate([k_cache[p] for p in pages]).astype(np.float64)[:n]  # (n, h_kv, d)
        for g in range(h_kv):
            heads = slice(g * (h_q // h_kv), (g + 1) * (h_q // h_kv))
            s = np.einsum("rhd,td->rht", q[i, :, heads].astype(np.float64), kv[:, g]) * scale
            if causal and s_q > 1:
                for r in range(s_q):
                    s[r, :, max(n - s_q + r + 1, 0):] = -np.inf
            p, l = _softmax_rows(s)
            out[i, :, heads] = p @ kv[:, g, :512]
            lse[i, heads] = l.T
    return out, lse


def decode_v32(packed: np.ndarray) -> np.ndarray:
    """(num_blocks, pbs, 1, 656) bytes -> float64 (num_blocks, pbs, 576) (spec §3.3)."""
    raw = np.ascontiguousarray(packed[:, :, 0, :])
    fp8 = raw[..., :512].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = raw[..., 512:528].copy().view(np.float32)
    nope = (fp8.reshape(*fp8.shape[:2], 4, 128) * scales[..., None]).reshape(*fp8.shape[:2], 512)
    nope = nope.astype(BF16).astype(np.float64)
    rope = raw[..., 528:656].copy().view(BF16).astype(np.float64)
    return np.concatenate([nope, rope], -1)


def oracle_sparse_decode(q, k_deq, indices, scale, sink):
    b, s_q, h_q, _ = q.shape
    flat = k_deq.reshape(-1, k_deq.shape[-1])
    out = np.zeros((b, s_q, h_q, 512))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        for r in range(s_q):
            idx = indices[i, r]
            idx = idx[idx != -1]
            if idx.size == 0:
                continue
            kv = flat[idx]
            s = q[i, r].astype(np.float64) @ kv.T * scale
            p, l = _softmax_rows(s)
            o = p @ kv[:, :512]
            o = o / (1.0 + np.exp(sink[:, None].astype(np.float64) - l[:, None]))
            out[i, r], lse[i, :, r] = o, l
    return out, lse


def oracle_sparse_prefill(q, kv, indices, scale):
    s_q, h_q, _ = q.shape
    s_kv = kv.shape[0]
    out = np.zeros((s_q, h_q, 512))
    lse = np.full((s_q, h_q), np.inf)
    for s in range(s_q):
        idx = indices[s, 0]
        idx = idx[(idx >= 0) & (idx < s_kv)]
        if idx.size == 0:
            continue
        k = kv[idx, 0].astype(np.float64)
        p, l = _softmax_rows(q[s].astype(np.float64) @ k.T * scale)
        out[s], lse[s] = p @ k[:, :512], l
    return out, lse


TOLERANCE = 2e-2  # "ok": max rel err below this (bf16 outputs round at ~4e-3 relative)
ORACLE = "float64 NumPy"
CPU_REFERENCE = "CPU reference backend"


def _err(a, r) -> float:
    """max |a - r| / (|r| + 0.01) over the finite reference values; inf when a has NaN or its +-inf
    positions differ from r's."""
    a = np.asarray(a, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    if not np.array_equal(np.isinf(a), np.isinf(r)) or np.isnan(a).any():
        return float("inf")
    fin = np.isfinite(r)
    return float(np.max(np.abs(a[fin] - r[fin]) / (np.abs(r[fin]) + 1e-2), initial=0.0))


# ---------------------------------------------------------------- backends
class Backend:
    """Creates inputs, runs and times calls, and fetches results as NumPy."""

    name = "reference (cpu)"

    def tensor(self, x: np.ndarray):
        return x

    def numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def timed(self, fn: Callable, reps: int) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3


class TorchCudaBackend(Backend):
    def __init__(self):
        import torch

        self.torch = torch
        self.name = f"sm90 ({torch.cuda.get_device_name()})"

    def tensor(self, x: np.ndarray):
        t = self.torch
        x = np.ascontiguousarray(x)
        if x.dtype == BF16:
            return t.from_numpy(x.view(np.int16).copy()).view(t.bfloat16).cuda()
        return t.from_numpy(np.ascontiguousarray(x)).cuda()

    def numpy(self, x) -> np.ndarray:
        if x.dtype == self.torch.bfloat16:
            return x.cpu().view(self.torch.int16).numpy().view(BF16)
        return x.cpu().numpy()

    def timed(self, fn: Callable, reps: int) -> float:
        t = self.torch
        fn()
        t.cuda.synchronize()
        start = [t.cuda.Event(enable_timing=True) for _ in range(reps)]
        end = [t.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            start[i].record()
            fn()
            end[i].record()
        t.cuda.synchronize()
        return float(np.median([s.elapsed_time(e) for s, e in zip(start, end)]))


def pick_backend(choice: str) -> Backend:
    if choice in ("auto", "cuda"):
        try:
            import torch

            if flash_mla.has_cuda_backend() and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
                return TorchCudaBackend()
        except ImportError:
            pass
        if choice == "cuda":
            raise SystemExit("--backend cuda: needs PyTorch, a CUDA build of flash_mla and a compute-capability-9.0 GPU")
    return Backend()


def _reference_name(be: Backend) -> str:
    """What a step's results are checked against on this backend."""
    return CPU_REFERENCE if isinstance(be, TorchCudaBackend) else ORACLE


# ---------------------------------------------------------------- the three steps
def dense_step(be: Backend, rng, big: bool, quick: bool) -> Result:
    b = 64 if big else (2 if quick else 4)
    mean = 4096 if big else (256 if quick else 1024)
    h_q, d, pbs = 128, 576, 64
    lens = np.maximum(rng.normal(mean, mean / 2, b), 1).astype(np.int32)
    lens[1 % b] = 0  # an empty request in the batch
    max_pages = int((lens.max() + pbs - 1) // pbs)
    nb = b * max_pages
    q = (rng.standard_normal((b, 1, h_q, d)) / 10).clip(-1, 1).astype(BF16)
    k = (rng.standard_normal((nb, pbs, 1, d)) / 10).clip(-1, 1).astype(BF16)
    bt = rng.permutation(nb).astype(np.int32).reshape(b, max_pages)
    for i in range(b):  # poison what no request may read
        used = (int(lens[i]) + pbs - 1) // pbs
        k[bt[i, used:]] = np.nan
        if lens[i] % pbs:
            k[bt[i, used - 1], lens[i] % pbs:] = np.nan
        bt[i, used:] = 2147480000
    scale = d ** -0.5
    qt, kt, btt, lt = be.tensor(q), be.tensor(k), be.tensor(bt), be.tensor(lens)
    meta, _ = flash_mla.get_mla_metadata()
    run = lambda: flash_mla.flash_mla_with_kvcache(qt, kt, btt, lt, 512, meta, softmax_scale=scale, causal=True)
    out, lse = run()
    ms = be.timed(run, 20 if big else 3)
    if isinstance(be, TorchCudaBackend):  # check against the CPU reference backend
        ref_out, ref_lse = flash_mla.flash_mla_with_kvcache(q, k, bt, lens, 512, flash_mla.get_mla_metadata()[0],
                                                            softmax_scale=scale, causal=True)
    else:
        ref_out, ref_lse = oracle_dense(q, k, bt, lens, scale, True)
    err = max(_err(be.numpy(out).astype(np.float64), np.asarray(ref_out, np.float64)), _err(be.numpy(lse), ref_lse))
    total = float(lens.sum())
    return Result("dense decode (V3)", be.name, f"b={b} h_q={h_q} s_q=1 mean s_k={lens.mean():.0f} page={pbs}", ms,
                  2 * h_q * total * (576 + 512), total * 576 * 2 + b * h_q * (576 + 512) * 2, err, err < TOLERANCE,
                  _reference_name(be))


def sparse_decode_step(be: Backend, rng, big: bool, quick: bool) -> Result:
    b, s_q, h_q, topk, pbs = (16 if big else (1 if quick else 2)), 1, 128, 2048, 64
    s_kv = 8192 if big else (2560 if quick else 4096)
    nb = b * s_kv // pbs
    kv = (rng.standard_normal((nb, pbs, 1, 576)) / 10).clip(-1, 1).astype(BF16)
    indices = np.full((b, s_q, topk), -1, np.int32)
    for i in range(b):
        idx = rng.choice(s_kv, size=min(topk, s_kv), replace=False) + i * s_kv
        indices[i, 0, : idx.size] = idx
        indices[i, 0, -7:] = -1  # a few invalid slots
    used = np.zeros(nb * pbs, bool)
    used[indices[indices >= 0]] = True
    kv.reshape(-1, 576)[~used] = np.nan  # unused tokens are NaN before quantization
    packed = quant.quantize_k_cache(kv)
    sink = rng.standard_normal(h_q).astype(np.float32)
    q = (rng.standard_normal((b, s_q, h_q, 576)) / 10).clip(-1, 1).astype(BF16)
    scale = 576 ** -0.55
    qt, pt, it, st = be.tensor(q), be.tensor(packed), be.tensor(indices), be.tensor(sink)
    meta, _ = flash_mla.get_mla_metadata()
    run = lambda: flash_mla.flash_mla_with_kvcache(qt, pt, None, None, 512, meta, softmax_scale=scale,
                                                   is_fp8_kvcache=True, indices=it, attn_sink=st)
    out, lse = run()
    ms = be.timed(run, 20 if big else 3)
    if isinstance(be, TorchCudaBackend):  # check against the CPU reference backend
        ref_out, ref_lse = flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512, flash_mla.get_mla_metadata()[0],
                                                            softmax_scale=scale, is_fp8_kvcache=True, indices=indices,
                                                            attn_sink=sink)
    else:
        ref_out, ref_lse = oracle_sparse_decode(q, decode_v32(packed), indices, scale, sink)
    err = max(_err(be.numpy(out).astype(np.float64), np.asarray(ref_out, np.float64)), _err(be.numpy(lse), ref_lse))
    n = float((indices != -1).sum())
    return Result("sparse FP8 decode (V3.2)", be.name, f"b={b} h_q={h_q} s_q={s_q} topk={topk} V32 page={pbs}",
                  ms, 2 * h_q * n * (576 + 512), n * 656 + b * s_q * h_q * (576 + 512) * 2, err, err < TOLERANCE,
                  _reference_name(be))


def sparse_prefill_step(be: Backend, rng, big: bool, quick: bool) -> Result:
    s_q, h_q, d = (64 if big else (8 if quick else 16)), 128, 576
    topk, s_kv = (2048, 8192) if big else (512, 4096)
    q = (rng.standard_normal((s_q, h_q, d)) / 10).astype(BF16)
    kv = (rng.standard_normal((s_kv, 1, d)) / 10).astype(BF16)
    indices = np.stack([rng.choice(s_kv, topk, replace=False) for _ in range(s_q)]).astype(np.int32)[:, None, :]
    indices[0, 0, :5] = [-1, s_kv, 2147483647, -2147483648, 114514]  # invalid slots
    scale = d ** -0.5
    qt, kvt, it = be.tensor(q), be.tensor(kv), be.tensor(indices)
    run = lambda: flash_mla.flash_mla_sparse_fwd(qt, kvt, it, sm_scale=scale)  # noqa: E731
    out, max_logits, lse = run()
    ms = be.timed(run, 20 if big else 3)
    if isinstance(be, TorchCudaBackend):  # check against the CPU reference backend
        ref_out, _, ref_lse = flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale=scale)
    else:
        ref_out, ref_lse = oracle_sparse_prefill(q, kv, indices, scale)
    err = max(_err(be.numpy(out).astype(np.float64), np.asarray(ref_out, np.float64)),
              _err(be.numpy(lse), np.asarray(ref_lse, np.float64)))
    n = float(((indices >= 0) & (indices < s_kv)).sum())
    return Result("sparse prefill", be.name, f"s_q={s_q} h_q={h_q} topk={topk} s_kv={s_kv} d_qk={d}", ms,
                  2 * h_q * n * (576 + 512), n * d * 2 + s_q * h_q * (576 + 512) * 2, err, err < TOLERANCE,
                  _reference_name(be))


def _seed(text: str) -> int:
    """--seed: a non-negative integer (what NumPy's default_rng takes), else a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flash_mla demo", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--quick", action="store_true", help="smallest sizes (a few seconds on a CPU)")
    ap.add_argument("--seed", type=_seed, default=0, help="non-negative integer seed of the random inputs")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    be = pick_backend(args.backend)
    rng = np.random.default_rng(args.seed)
    big = isinstance(be, TorchCudaBackend)
    steps = [
        ("dense decode", lambda: dense_step(be, rng, big, args.quick)),
        ("sparse FP8 decode", lambda: sparse_decode_step(be, rng, big, args.quick)),
        ("sparse prefill", lambda: sparse_prefill_step(be, rng, big, args.quick)),
    ]
    results: List[Result] = []
    console = Console() if sys.stdout.isatty() else Console(width=180)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"MLA steps on {be.name}", total=len(steps))
        for label, step in steps:
            progress.update(task, description=f"{label} on {be.name}")
            results.append(step())
            progress.advance(task)
    table = Table(title=f"flash_mla {flash_mla.__version__}: one step of each MLA operator",
                  caption=f"max rel err: max |x - ref| / (|ref| + 0.01) over out and lse, ref as 'checked against' "
                          f"(NaN / misplaced inf: inf). ok: max rel err < {TOLERANCE:g}")
    for col in ("op", "backend", "shape", "time (ms)", "TFLOP/s", "GB/s", "checked against", "max rel err", "check"):
        table.add_column(col)
    for r in results:
        table.add_row(r.op, r.backend, r.shape, f"{r.time_ms:.3f}", f"{r.flops / r.time_ms / 1e9:.3f}",
                      f"{r.nbytes / r.time_ms / 1e6:.2f}", r.reference, f"{r.max_err:.2e}",
                      "ok" if r.ok else "FAILED")
    console.print(table)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
