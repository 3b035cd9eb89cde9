"""Data generation and case selection for the full sparse grids (spec §5.2 / §5.3).

Device-agnostic torch code following FlashMLA's ``tests/lib.py`` (``generate_testcase_for_decode``,
``generate_testcase``, ``_randperm_batch``, ``kernelkit.non_contiguousify``) as the spec
describes them. Each case is seeded with its grid position (python ``random`` for the varlen
lengths and scalar offsets, a ``torch.Generator`` on the target device for tensors).

Environment knobs (read by :func:`select_or_skip`):

* ``FLASHMLA_FULL_GRID=1`` — run the grids on the GPU (otherwise every grid case is skipped).
* ``FLASHMLA_GRID_DEVICE=cpu`` — dry run on the CPU: data, reference and comparison logic run
  on CPU tensors with flash_mla's C++ reference backend as the answer (tests/gpu/conftest.py
  then does not skip the grid files). Cases whose reference work exceeds
  ``FLASHMLA_GRID_CPU_MAX_GFLOP`` (default 40) are skipped.
* ``FLASHMLA_GRID_LIMIT=N`` — only the first N cases of each grid;
  ``FLASHMLA_GRID_SLICE=start:stop:step`` — a Python slice of each grid (applied after LIMIT).
  Both also apply on the GPU. On the CPU with neither set, LIMIT defaults to 20.
"""

from __future__ import annotations

import functools
import math
import os
import random
from typing import Optional

import pytest
import torch

import torch_reference as tr
from grid_cases import DecodeParam, PrefillParam

INT_MAX = 2147483647
DEVICE = os.environ.get("FLASHMLA_GRID_DEVICE", "cuda")
PREFILL_INVALID = [-2147483648, -123456, -1, None, 114514, 1919810, 2147480000, 2147483647]  # None -> s_kv


# ----------------------------------------------------------------------------- case selection
@functools.lru_cache(maxsize=None)
def _selection(n_cases: int) -> frozenset:
    idx = list(range(n_cases))
    limit = os.environ.get("FLASHMLA_GRID_LIMIT")
    if limit is None and DEVICE == "cpu" and not os.environ.get("FLASHMLA_GRID_SLICE"):
        limit = "20"
    if limit is not None:
        idx = idx[: int(limit)]
    sl = os.environ.get("FLASHMLA_GRID_SLICE")
    if sl:
        parts = [int(x) if x else None for x in sl.split(":")]
        idx = idx[slice(*parts)]
    return frozenset(idx)


def _selected(seed: int, n_cases: int) -> bool:
    return seed in _selection(n_cases)


def select_or_skip(seed: int, n_cases: int, gflop: float, gbytes: float, grid: str, runtime: str) -> str:
    """Skip the case unless enabled and selected; returns the device to run on.
    ``gflop`` / ``gbytes`` (rough reference work and input size) only gate the CPU dry run."""
    if DEVICE == "cpu":
        if not _selected(seed, n_cases):
            pytest.skip("CPU dry run: case not selected by FLASHMLA_GRID_LIMIT / FLASHMLA_GRID_SLICE")
        cap = float(os.environ.get("FLASHMLA_GRID_CPU_MAX_GFLOP", "40"))
        if gflop > cap:
            pytest.skip(f"CPU dry run: {gflop:.0f} GFLOP > FLASHMLA_GRID_CPU_MAX_GFLOP={cap:g}")
        if gbytes > 1.0:
            pytest.skip(f"CPU dry run: inputs of {gbytes:.1f} GB are too large for a CPU dry run")
        return "cpu"
    if DEVICE != "cuda":
        raise ValueError(f"FLASHMLA_GRID_DEVICE must be 'cuda' or 'cpu', got {DEVICE!r}")
    if os.environ.get("FLASHMLA_FULL_GRID") != "1":
        pytest.skip(f"full {grid} grid ({n_cases} cases, {runtime} on an H200): set FLASHMLA_FULL_GRID=1 to run")
    if not _selected(seed, n_cases):
        pytest.skip("not selected by FLASHMLA_GRID_LIMIT / FLASHMLA_GRID_SLICE")
    return "cuda"


def decode_gflop(p: DecodeParam) -> float:
    topk = p.topk + (p.extra_topk or 0)
    return 2 * p.b * p.s_q * p.h_q * topk * (p.d_qk + 512) / 1e9


def prefill_gflop(p: PrefillParam) -> float:
    return 2 * p.s_q * p.h_q * p.topk * (p.d_qk + 512) / 1e9 if p.check_correctness else 0.0


def decode_gbytes(p: DecodeParam) -> float:
    """Rough size of the bf16 caches generated (upper bound of the varlen lengths: 3 s_k)."""
    tokens = p.b * 3 * (p.s_kv + (p.extra_s_k or 0))
    return (tokens * p.d_qk * 2 + p.b * p.s_q * p.h_q * p.d_qk * 2) / 1e9


def prefill_gbytes(p: PrefillParam) -> float:
    return (p.s_q * p.h_q * (p.d_qk + 512) * 2 * 2 + p.s_kv * p.d_qk * 2) / 1e9


# ----------------------------------------------------------------------------- helpers
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def non_contiguousify(t: torch.Tensor) -> torch.Tensor:
    """kernelkit.non_contiguousify (§5.1): a slice of a buffer with last dim +128 and every other
    dim +1 (padding NaN for floats, INT_MAX for integers, so stray reads show up)."""
    big = [s + 1 for s in t.shape[:-1]] + [t.shape[-1] + 128]
    fill = float("nan") if t.dtype.is_floating_point else INT_MAX
    buf = torch.full(big, fill, dtype=t.dtype, device=t.device)
    view = buf[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view


def randn_bf16(shape, g: torch.Generator, device, mul: float, add: float, lo: float, hi: float,
               noncontig: bool = False) -> torch.Tensor:
    """``clamp(randn(shape) * mul + add, lo, hi)`` as bf16, generated in row chunks (bounded fp32
    memory); with ``noncontig`` written straight into a :func:`non_contiguousify` layout."""
    if noncontig:
        big = [s + 1 for s in shape[:-1]] + [shape[-1] + 128]
        out = torch.full(big, float("nan"), dtype=torch.bfloat16, device=device)[tuple(slice(0, s) for s in shape)]
    else:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    row = math.prod(shape[1:])
    step = max(1, (1 << 26) // max(1, row))
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        x = torch.randn((r1 - r0, row), generator=g, device=device)
        out[r0:r1] = (x * mul + add).clamp_(lo, hi).to(torch.bfloat16).view(r1 - r0, *shape[1:])
    return out


def randperm_batch(g: torch.Generator, perm_range: torch.Tensor, perm_size: int, fillers) -> torch.Tensor:
    """FlashMLA's ``_randperm_batch``: row i holds min(perm_size, perm_range[i]) distinct values of
    ``[0, perm_range[i])`` in random order, then padding drawn uniformly from ``fillers``
    (int64 list). ``perm_range`` (rows,) int64 on the target device; returns (rows, perm_size) int64."""
    device = perm_range.device
    rows = perm_range.numel()
    width = max(int(perm_range.max().item()) if rows else 0, perm_size)
    out = torch.empty(rows, perm_size, dtype=torch.int64, device=device)
    step = max(1, (1 << 25) // max(1, width))
    ar = torch.arange(width, device=device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        rnd = torch.rand(r1 - r0, width, generator=g, device=device)
        rnd.masked_fill_(ar[None, :] >= perm_range[r0:r1, None], -math.inf)
        out[r0:r1] = rnd.topk(perm_size, dim=-1, sorted=True).indices
    pad = out >= perm_range[:, None]
    fill = torch.tensor(fillers, dtype=torch.int64, device=device)
    pick = fill[torch.randint(0, len(fillers), out.shape, generator=g, device=device)]
    return torch.where(pad, pick, out)


def gen_sink(g: torch.Generator, h_q: int, device) -> torch.Tensor:
    """§5.2: randn(h_q) float32; a second randn > 0.5 -> +inf, < -0.5 -> -inf."""
    sink = torch.randn(h_q, generator=g, device=device)
    mask = torch.randn(h_q, generator=g, device=device)
    sink[mask > 0.5] = math.inf
    sink[mask < -0.5] = -math.inf
    return sink


# ----------------------------------------------------------------------------- sparse decode (§5.2)
class KVScope:
    """One packed FP8 cache with its indices (``tests/lib.py::KVScope``)."""

    def __init__(self, packed, indices, topk_length, cache_seqlens):
        self.packed, self.indices, self.topk_length, self.cache_seqlens = packed, indices, topk_length, cache_seqlens


def gen_kv_scope(rng: random.Random, g: torch.Generator, device, *, b: int, s_q: int, d_qk: int, s_k: int,
                 block_size: int, topk: int, is_varlen: bool, have_zero_seqlen: bool, all_invalid: bool,
                 have_topk_length: bool) -> KVScope:
    """``generate_one_k_scope`` (§5.2): lengths, block table, randn/10 cache, random indices,
    NaN poisoning of every token not referenced below topk_length (before quantization;
    -1 entries mark the *last* token as used, FlashMLA's Python-indexing quirk), quantization with
    FlashMLA's padded block strides, non-contiguous indices."""
    lens = [s_k] * b
    if is_varlen:
        lens = [int(max(rng.normalvariate(s_k, s_k / 2), s_q)) for _ in range(b)]
    if have_zero_seqlen:
        zero = (torch.randn(b, generator=g, device=device) > 0).tolist()
        lens = [0 if z else l for z, l in zip(zero, lens)]
    align = 4 * block_size
    max_pad = max(cdiv(max(lens), align), 1) * align
    n_blocks = b * max_pad // block_size
    block_table = torch.randperm(n_blocks, generator=g, device=device).view(b, -1)
    cache = randn_bf16((n_blocks, block_size, 1, d_qk), g, device, 0.1, 0.0, -1.0, 1.0)

    if all_invalid:
        abs_idx = torch.full((b, s_q, topk), -1, dtype=torch.int64, device=device)
    else:
        rng_t = torch.tensor(lens, dtype=torch.int64, device=device).repeat_interleave(s_q)
        abs_idx = randperm_batch(g, rng_t, topk, [-1]).view(b, s_q, topk)
    valid = abs_idx >= 0  # abs_indices2indices_in_kvcache (§3.2)
    t = abs_idx.clamp(min=0)
    phys = torch.gather(block_table[:, None, :].expand(b, s_q, -1), 2, t // block_size)
    indices = torch.where(valid, phys * block_size + t % block_size, torch.full_like(t, -1))

    topk_length = None
    masked = indices
    if have_topk_length:
        topk_length = torch.randint(0, topk + 1, (b,), generator=g, device=device, dtype=torch.int32)
        beyond = torch.arange(topk, device=device)[None, None, :] >= topk_length.long()[:, None, None]
        masked = indices.masked_fill(beyond, -1)
    unused = torch.ones(n_blocks * block_size, dtype=torch.bool, device=device)
    unused[masked.reshape(-1)] = False  # -1 wraps to the last token, as in FlashMLA's tests
    cache.view(-1, d_qk)[unused] = float("nan")
    packed = tr.quantize_k_cache(cache)
    del cache
    return KVScope(packed, non_contiguousify(indices.to(torch.int32)), topk_length,
                   torch.tensor(lens, dtype=torch.int32))


class DecodeCase:
    """``generate_testcase_for_decode`` (§5.2) for one :class:`DecodeParam`, on ``device``."""

    def __init__(self, p: DecodeParam, device):
        rng = random.Random(p.seed)
        g = torch.Generator(device=device).manual_seed(p.seed)
        q = torch.randn((p.b, p.s_q, p.h_q, p.d_qk), generator=g, device=device).clamp_(-1, 1).to(torch.bfloat16)
        self.q = non_contiguousify(q)
        self.sink = gen_sink(g, p.h_q, device) if p.enable_attn_sink else None
        common = dict(b=p.b, s_q=p.s_q, d_qk=p.d_qk, is_varlen=p.is_varlen, have_zero_seqlen=p.have_zero_seqlen_k,
                      all_invalid=p.is_all_indices_invalid)
        self.main = gen_kv_scope(rng, g, device, s_k=p.s_kv, block_size=p.block_size, topk=p.topk,
                                 have_topk_length=p.have_topk_length, **common)
        self.extra: Optional[KVScope] = None
        if p.extra_topk is not None:
            self.extra = gen_kv_scope(rng, g, device, s_k=p.extra_s_k, block_size=p.extra_block_size,
                                      topk=p.extra_topk, have_topk_length=p.have_extra_topk_length, **common)
        self.sm_scale = p.d_qk ** -0.55

    def kwargs(self) -> dict:
        kw = dict(softmax_scale=self.sm_scale, causal=False, is_fp8_kvcache=True, indices=self.main.indices,
                  attn_sink=self.sink, topk_length=self.main.topk_length)
        if self.extra is not None:
            kw.update(extra_k_cache=self.extra.packed, extra_indices_in_kvcache=self.extra.indices,
                      extra_topk_length=self.extra.topk_length)
        return kw

    def run_flash_mla(self):
        import flash_mla

        sched, _ = flash_mla.get_mla_metadata()  # fresh metadata per case (§5.2)
        return flash_mla.flash_mla_with_kvcache(self.q, self.main.packed, None, None, 512, sched, **self.kwargs())

    def reference(self):
        e = self.extra
        return tr.ref_sparse_decode(self.q, self.main.packed, self.main.indices, self.sm_scale, self.sink,
                                    self.main.topk_length, e and e.packed, e and e.indices, e and e.topk_length)


# ----------------------------------------------------------------------------- sparse prefill (§5.3)
class PrefillCase:
    """``generate_testcase`` (§5.3) for one :class:`PrefillParam`, on ``device``."""

    def __init__(self, p: PrefillParam, device):
        rng = random.Random(p.seed)
        g = torch.Generator(device=device).manual_seed(p.seed)
        off_q, off_kv = (rng.random() - 0.5) / 10, (rng.random() - 0.5) / 10  # one scalar offset per tensor
        self.q = randn_bf16((p.s_q, p.h_q, p.d_qk), g, device, 0.1, off_q, -10.0, 10.0, noncontig=True)
        self.kv = randn_bf16((p.s_kv, 1, p.d_qk), g, device, 0.1, off_kv, -10.0, 10.0, noncontig=True)
        invalid = [p.s_kv if v is None else v for v in PREFILL_INVALID]
        idx = randperm_batch(g, torch.full((p.s_q,), p.s_kv, dtype=torch.int64, device=device), p.topk, invalid)
        if p.is_all_indices_invalid:
            bad = torch.randn(p.s_q, generator=g, device=device) < -2
            idx[bad] = rng.choice(invalid)
        self.sink = gen_sink(g, p.h_q, device) if p.have_attn_sink else None
        self.topk_length = None
        if p.have_topk_length:
            self.topk_length = torch.randint(0, max(p.topk + 1, 64), (p.s_q,), generator=g, device=device,
                                             dtype=torch.int32).clamp_max(p.topk)
        self.indices = non_contiguousify(idx.to(torch.int32).view(p.s_q, 1, p.topk))
        self.sm_scale = 0.5

    def run_flash_mla(self):
        import flash_mla

        return flash_mla.flash_mla_sparse_fwd(self.q, self.kv, self.indices, sm_scale=self.sm_scale, d_v=512,
                                              attn_sink=self.sink, topk_length=self.topk_length)

    def reference(self):
        return tr.ref_sparse_prefill(self.q, self.kv, self.indices, self.sm_scale, self.sink, self.topk_length)
