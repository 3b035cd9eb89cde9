"""Shared helpers of the flash_mla Python tests: comparator, data generators, layouts.

(Kept in a uniquely named module rather than in conftest.py so that test modules can
import it unambiguously even when another test directory has its own conftest.py;
conftest.py re-exports everything and adds the fixtures.)

Data follow FlashMLA's tests (spec §5.2-§5.4): fresh seeded random inputs, unused KV
tokens and pages NaN/Inf-poisoned, block tables randomly permuted with the sentinel
2147480000 past each request's last page, padded (non-contiguous) inputs.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
import pytest

import oracle
from oracle import BF16, FP16

SENTINEL = 2147480000
INT_MAX = 2147483647
INT_MIN = -2147483648
PREFILL_INVALID = [INT_MIN, -123456, -1, None, 114514, 1919810, 2147480000, INT_MAX]  # None -> s_kv

# Tolerances for the reference backend (float32 accumulation, one rounding of out to
# bf16/fp16) against the float64 oracle: one RNE rounding is at most half an ulp, i.e.
# <= 2^-8 (bf16) / 2^-10 (fp16) relative to the value; the abs term covers float32
# accumulation error on values near zero. (A GPU backend, which also rounds P to bf16
# before the PV product, needs looser bounds: kernelkit uses abs 8e-4 / rel 2.01/128.)
OUT_TOL = {"bf16": dict(abs_tol=2e-5, rel_tol=5e-3, cos_diff_tol=1e-5),
           "fp16": dict(abs_tol=5e-6, rel_tol=2e-3, cos_diff_tol=1e-6)}
LSE_TOL = dict(abs_tol=1e-5, rel_tol=1e-5, cos_diff_tol=1e-10)


def load_example(filename: str):
    """examples/<filename> imported as a module (the examples are scripts, not a package); registered in
    sys.modules under its own name, where dataclasses look their module up."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / filename
    spec = importlib.util.spec_from_file_location(f"{path.stem}_example", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def seed_of(text: str) -> int:
    return zlib.crc32(text.encode())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- comparator


def _float_dtype_name(x: np.ndarray) -> str:
    return {BF16: "bf16", FP16: "fp16"}.get(np.asarray(x).dtype, str(np.asarray(x).dtype))


def check_allclose(name: str, ans: Any, ref: np.ndarray, *, dtype=None, abs_tol: float, rel_tol: float,
                   cos_diff_tol: float) -> None:
    """FlashMLA's kernelkit ``check_is_allclose`` (spec §5.1) against a float64 oracle.

    1. equal shape, and ``ans.dtype == dtype`` when given;
    2. the positions of +inf, -inf and NaN must be identical in ``ans`` and ``ref``
       (then those positions are zeroed);
    3. every element: ``|a - r| <= abs_tol + rel_tol * |r|``;
    4. ``cos_diff = 1 - 2 sum(a r) / sum(a^2 + r^2)`` (float64) ``<= cos_diff_tol``.
    """
    a_arr = np.asarray(ans)
    assert a_arr.shape == ref.shape, f"{name}: shape {a_arr.shape} != expected {ref.shape}"
    if dtype is not None:
        assert a_arr.dtype == np.dtype(dtype), f"{name}: dtype {a_arr.dtype} != expected {np.dtype(dtype)}"
    a = a_arr.astype(np.float64)
    r = np.asarray(ref, dtype=np.float64).copy()
    for label, fa, fr in (("+inf", a == np.inf, r == np.inf), ("-inf", a == -np.inf, r == -np.inf),
                          ("nan", np.isnan(a), np.isnan(r))):
        if not np.array_equal(fa, fr):
            bad = np.argwhere(fa != fr)
            raise AssertionError(f"{name}: positions of {label} differ: {len(bad)} mismatches, first at "
                                 f"{tuple(bad[0])} (ans={a[tuple(bad[0])]}, ref={r[tuple(bad[0])]})")
    special = ~np.isfinite(r)
    a[special] = 0.0
    r[special] = 0.0
    err = np.abs(a - r)
    bound = abs_tol + rel_tol * np.abs(r)
    if not np.all(err <= bound):
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{name}: {int(np.sum(err > bound))} of {err.size} elements out of tolerance; worst at "
                             f"{tuple(int(i) for i in worst)}: ans={a[worst]!r} ref={r[worst]!r} "
                             f"|diff|={err[worst]:.3g} > {bound[worst]:.3g}")
    denom = np.sum(a * a + r * r)
    cos_diff = 0.0 if np.sum(r * r) < 1e-12 else 1.0 - 2.0 * np.sum(a * r) / denom
    assert abs(cos_diff) <= cos_diff_tol, f"{name}: cos_diff {cos_diff:.3g} > {cos_diff_tol:.3g}"


def check_out(name, ans, ref, dtype):
    check_allclose(name, ans, ref, dtype=dtype, **OUT_TOL["fp16" if np.dtype(dtype) == FP16 else "bf16"])


def check_lse(name, ans, ref):
    check_allclose(name, ans, ref, dtype=np.float32, **LSE_TOL)


# ----------------------------------------------------------------------------- bitwise comparison / JAX placement


def bits(x) -> np.ndarray:
    """The raw bits of a 1-, 2- or 4-byte array (NumPy, ml_dtypes or any np.asarray-able array)."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_same(a_list, b_list) -> None:
    """Bit-for-bit equality of two lists of results (two paths running the same backend)."""
    for a, b in zip(a_list, b_list):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.fixture
def count_torch_calls(monkeypatch):
    """Records the calls of the public functions that reach torch.ops.flash_mla: each OpOverload's C function
    (``_op``, which ``OpOverload.__call__`` calls and the fast paths call directly) wrapped by a spy recording the
    overload's name, once per outer call (a tensor subclass's ``__torch_function__`` calls the op again from
    inside). Import it into a test module to use it there."""
    from flash_mla import _torch_ops

    calls = []
    if not _torch_ops.available():
        return calls
    ops = _torch_ops._ops
    depth = [0]
    for name in vars(ops):
        overload = getattr(ops, name)
        real, label = overload._op, str(overload)

        def spy(*args, _real=real, _label=label, **kwargs):
            if depth[0] == 0:
                calls.append(_label)
            depth[0] += 1
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(overload, "_op", spy)
    return calls


def to_jax_cpu(x):
    """A JAX array on JAX's CPU device (the reference backend), even where JAX has a GPU."""
    import jax

    return jax.device_put(np.asarray(x), jax.devices("cpu")[0])


# ----------------------------------------------------------------------------- layouts


def non_contiguousify(x: np.ndarray, rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """FlashMLA's ``non_contiguousify`` (spec §5.1): a view of ``x`` copied into a larger
    buffer whose last dim is +128 and every other dim +1, so only the last dim is
    contiguous. The padding holds NaN (floats) or INT_MAX (ints) to expose stray reads."""
    x = np.asarray(x)
    big = tuple(s + 1 for s in x.shape[:-1]) + (x.shape[-1] + 128,)
    if x.dtype.kind == "f" or x.dtype == BF16:
        buf = np.full(big, np.nan, dtype=np.float32).astype(x.dtype)
    elif x.dtype.kind in "iu":
        buf = np.full(big, np.iinfo(x.dtype).max, dtype=x.dtype)
    else:
        buf = np.zeros(big, dtype=x.dtype)
    view = buf[tuple(slice(0, s) for s in x.shape)]
    view[...] = x
    assert view.strides[-1] == x.dtype.itemsize
    return view


def randn_bf16(rng, shape, scale=1.0, clip=1.0, dtype=BF16) -> np.ndarray:
    return np.clip(rng.standard_normal(shape) * scale, -clip, clip).astype(np.float32).astype(dtype)


def gen_sink(rng, h_q: int) -> np.ndarray:
    """Spec §5.2: randn, and where a second randn > 0.5 -> +inf, < -0.5 -> -inf."""
    sink = rng.standard_normal(h_q).astype(np.float32)
    u = rng.standard_normal(h_q)
    sink[u > 0.5] = np.inf
    sink[u < -0.5] = -np.inf
    return sink


def gen_lengths(rng, b: int, s_k: int, varlen: bool, min_len: int, zero=None) -> np.ndarray:
    """Spec §5.4: ``max(normalvariate(s_k, s_k/2), min_len)`` if varlen; ``zero``: a boolean
    mask (or 'random': where randn > 0) of requests forced to length 0."""
    if varlen:
        lens = np.maximum(rng.normal(s_k, s_k / 2, b).astype(np.int64), min_len)
    else:
        lens = np.full(b, s_k, np.int64)
    if zero is not None:
        mask = rng.standard_normal(b) > 0 if isinstance(zero, str) else np.asarray(zero, bool)
        lens[mask] = 0
    return lens.astype(np.int32)


# ----------------------------------------------------------------------------- dense decode data


@dataclass
class DenseCase:
    q: np.ndarray
    k_cache: np.ndarray
    block_table: np.ndarray
    cache_seqlens: np.ndarray
    softmax_scale: Optional[float]
    causal: bool


def gen_dense_case(rng, *, b, s_q, h_q, h_kv, d, s_k, pbs=64, dtype=BF16, varlen=False, zero=None, causal=False,
                   softmax_scale=None, poison="nan", spare_pages=2, noncontig=False, lens=None) -> DenseCase:
    """Paged dense decode inputs (spec §5.4). ``poison``: value written into every unused
    token of every page ('nan', 'inf', '-inf' or 'mixed')."""
    if lens is None:
        lens = gen_lengths(rng, b, s_k, varlen, s_q, zero)
    lens = np.asarray(lens, np.int32)
    max_pages = max(cdiv(int(lens.max()), pbs), 1) + 1  # +1: a sentinel column even for the longest request
    n_pages = b * max_pages + spare_pages
    perm = rng.permutation(n_pages).astype(np.int32)
    block_table = perm[: b * max_pages].reshape(b, max_pages).copy()
    q = randn_bf16(rng, (b, s_q, h_q, d), scale=1.0, clip=3.0, dtype=dtype)
    k = randn_bf16(rng, (n_pages, pbs, h_kv, d), scale=0.1, clip=1.0, dtype=dtype)
    used = np.zeros((n_pages, pbs), bool)
    for i in range(b):
        n = int(lens[i])
        pages = cdiv(n, pbs)
        for j in range(pages):
            used[block_table[i, j], : min(pbs, n - j * pbs)] = True
        block_table[i, pages:] = SENTINEL
    poison_vals = {"nan": [np.nan], "inf": [np.inf], "-inf": [-np.inf], "mixed": [np.nan, np.inf, -np.inf]}[poison]
    unused = np.argwhere(~used)
    if len(unused):
        vals = rng.choice(np.array(poison_vals, np.float32), size=len(unused)).astype(dtype)
        k[unused[:, 0], unused[:, 1]] = vals[:, None, None]
    if noncontig:
        q = non_contiguousify(q)
        k = non_contiguousify(k)
        block_table = non_contiguousify(block_table)
    return DenseCase(q, k, block_table, lens, softmax_scale, causal)


# ----------------------------------------------------------------------------- sparse decode data


@dataclass
class KVScope:
    """One FP8 cache with its indices (spec §5.2 'KV scope')."""
    packed: np.ndarray  # uint8 (num_blocks, pbs, 1, bpt), padded block stride
    dequant: np.ndarray  # float64 (num_blocks * pbs, d_qk), NaN for poisoned tokens
    indices: np.ndarray  # int32 (b, s_q, topk) passed to flash_mla (garbage past topk_length)
    topk_length: Optional[np.ndarray]
    lens: np.ndarray
    block_table: np.ndarray


def gen_kv_scope(rng, *, b, s_q, s_k, topk, pbs, d_qk, varlen=True, zero=None, all_invalid=False,
                 have_topk_length=False, topk_length=None, invalid_frac=0.0, noncontig=True) -> KVScope:
    lens = gen_lengths(rng, b, s_k, varlen, s_q, zero)
    max_pad = max(cdiv(int(lens.max()), 4 * pbs), 1) * 4 * pbs
    n_blocks = b * max_pad // pbs
    block_table = rng.permutation(n_blocks).astype(np.int64).reshape(b, -1)
    kv = randn_bf16(rng, (n_blocks, pbs, 1, d_qk), scale=0.1, clip=1.0)

    abs_idx = np.full((b, s_q, topk), -1, np.int64)
    for i in range(b):
        n = int(lens[i])
        for r in range(s_q):
            k = min(topk, n)
            row = np.full(topk, -1, np.int64)
            row[:k] = rng.choice(n, size=k, replace=False)
            if invalid_frac:
                row[rng.random(topk) < invalid_frac] = -1
            abs_idx[i, r] = rng.permutation(row)  # -1s scattered through the row
    if all_invalid:
        abs_idx[:] = -1
    valid = abs_idx >= 0
    t = np.where(valid, abs_idx, 0)
    flat = np.take_along_axis(block_table[:, None, :].repeat(s_q, 1), t // pbs, axis=2) * pbs + t % pbs
    indices = np.where(valid, flat, -1)

    if topk_length is None and have_topk_length:
        topk_length = rng.integers(0, topk + 1, b)
    if topk_length is not None:
        topk_length = np.asarray(topk_length, np.int32)
        beyond = np.broadcast_to(np.arange(topk)[None, None, :] >= topk_length[:, None, None], indices.shape)
        masked = np.where(beyond, -1, indices)
    else:
        beyond = np.zeros(indices.shape, bool)
        masked = indices

    # Poison (before quantization, like FlashMLA): every token not referenced by a valid slot.
    referenced = np.zeros(n_blocks * pbs, bool)
    referenced[masked[masked >= 0]] = True
    kv_flat = kv.reshape(n_blocks * pbs, d_qk)
    kv_flat[~referenced] = np.float32(np.nan).astype(BF16)

    # Garbage beyond topk_length: must never be read (spec §2.3).
    if beyond.any():
        poisoned = np.flatnonzero(~referenced)
        choices = [INT_MAX, SENTINEL, -1, -2, -123456, n_blocks * pbs]
        if len(poisoned):
            choices += [int(rng.choice(poisoned))] * 3
        garbage = rng.choice(np.array(choices, np.int64), size=int(beyond.sum()))
        indices = indices.copy()
        indices[beyond] = garbage

    packed = oracle.quantize_cache(kv, fill=rng, pad_byte=None)
    dequant = oracle.dequantize_cache(packed, d_qk)
    indices = indices.astype(np.int32)
    if noncontig:
        indices = non_contiguousify(indices)
    return KVScope(packed, dequant, indices, topk_length, lens, block_table)


@dataclass
class SparseDecodeCase:
    q: np.ndarray
    main: KVScope
    extra: Optional[KVScope]
    attn_sink: Optional[np.ndarray]
    softmax_scale: float

    def kwargs(self) -> Dict[str, Any]:
        kw = dict(indices=self.main.indices, topk_length=self.main.topk_length, attn_sink=self.attn_sink,
                  softmax_scale=self.softmax_scale, is_fp8_kvcache=True)
        if self.extra is not None:
            kw.update(extra_k_cache=self.extra.packed, extra_indices_in_kvcache=self.extra.indices,
                      extra_topk_length=self.extra.topk_length)
        return kw

    def reference(self):
        e = self.extra
        return oracle.sparse_decode(self.q, self.main.dequant, self.main.indices, self.softmax_scale,
                                    self.main.topk_length, self.attn_sink,
                                    None if e is None else e.dequant, None if e is None else e.indices,
                                    None if e is None else e.topk_length)


def gen_sparse_decode_case(rng, *, b, s_q, h_q, d_qk, s_k, topk, pbs, sink=True, extra=None, noncontig=True,
                           **scope_kw) -> SparseDecodeCase:
    """Spec §5.2. ``extra``: None or a dict of gen_kv_scope arguments (s_k, topk, pbs, ...)."""
    q = randn_bf16(rng, (b, s_q, h_q, d_qk), scale=1.0, clip=1.0)
    main = gen_kv_scope(rng, b=b, s_q=s_q, s_k=s_k, topk=topk, pbs=pbs, d_qk=d_qk, noncontig=noncontig, **scope_kw)
    ex = None
    if extra is not None:
        ex = gen_kv_scope(rng, b=b, s_q=s_q, d_qk=d_qk, noncontig=noncontig, **extra)
    return SparseDecodeCase(non_contiguousify(q) if noncontig else q, main, ex,
                            gen_sink(rng, h_q) if sink else None, d_qk**-0.55)


# ----------------------------------------------------------------------------- sparse prefill data


@dataclass
class PrefillCase:
    q: np.ndarray
    kv: np.ndarray
    indices: np.ndarray
    sm_scale: float
    attn_sink: Optional[np.ndarray] = None
    topk_length: Optional[np.ndarray] = None

    def reference(self):
        return oracle.sparse_prefill(self.q, self.kv, self.indices, self.sm_scale, self.attn_sink, self.topk_length)


def gen_prefill_case(rng, *, s_q, s_kv, topk, h_q, d_qk, sink=False, have_topk_length=False,
                     invalid_frac=0.0, all_invalid_frac=0.0, noncontig=True, sm_scale=0.5) -> PrefillCase:
    """Spec §5.3: q/kv = randn/10 + (U(0,1) - 0.5)/10 clamped to +-10; each row picks
    ``topk`` distinct tokens (surplus slots past s_kv get invalid values from the list
    [INT_MIN, -123456, -1, s_kv, 114514, 1919810, 2147480000, INT_MAX])."""
    def tensor(shape):
        return np.clip(rng.standard_normal(shape) / 10 + (rng.random() - 0.5) / 10, -10, 10).astype(
            np.float32).astype(BF16)

    q = tensor((s_q, h_q, d_qk))
    kv = tensor((s_kv, 1, d_qk))
    invalid = np.array([s_kv if v is None else v for v in PREFILL_INVALID], np.int64)
    idx = np.empty((s_q, 1, topk), np.int64)
    for s in range(s_q):
        k = min(topk, s_kv)
        row = np.concatenate([rng.choice(s_kv, size=k, replace=False), rng.choice(invalid, size=topk - k)])
        if invalid_frac:
            m = rng.random(topk) < invalid_frac
            row[m] = rng.choice(invalid, size=int(m.sum()))
        idx[s, 0] = rng.permutation(row)
    if all_invalid_frac:
        rows = rng.random(s_q) < all_invalid_frac
        rows[0] = True
        idx[rows] = rng.choice(invalid)
    idx = idx.astype(np.int32)
    topk_length = None
    if have_topk_length:
        topk_length = np.minimum(rng.integers(0, max(topk + 1, 64), s_q), topk).astype(np.int32)
    if noncontig:
        q, kv, idx = non_contiguousify(q), non_contiguousify(kv), non_contiguousify(idx)
    return PrefillCase(q, kv, idx, sm_scale, gen_sink(rng, h_q) if sink else None, topk_length)
