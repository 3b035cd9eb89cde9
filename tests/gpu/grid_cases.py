"""The full FlashMLA sparse test grids as plain parameter lists (no torch needed).

* :func:`decode_cases` — spec §5.2, ``tests/test_flash_mla_sparse_decoding.py::gen_testcase``:
  3680 correctness + 1036 corner + 32 performance = 4748 cases, in FlashMLA's order
  (all correctness cases, then all corner cases, then the performance cases).
* :func:`prefill_cases` — spec §5.3, ``tests/test_flash_mla_sparse_prefill.py``:
  120 correctness + 448 feature + 36 corner + 13 performance = 617 cases.

Each case's ``seed`` is its position in its grid (FlashMLA's ``kk.Counter``: 0, 1, 2, ... in
case order). ``kind`` is "correctness" / "corner" / "performance" (prefill also "feature").
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

N_DECODE = 4748
N_PREFILL = 617


@dataclasses.dataclass(frozen=True)
class DecodeParam:
    """FlashMLA's ``lib.RawTestParamForDecode`` (spec §5.2) plus ``kind`` and ``seed``."""

    b: int
    h_q: int
    s_q: int
    s_kv: int
    is_varlen: bool
    topk: int
    is_all_indices_invalid: bool = False
    have_zero_seqlen_k: bool = False
    have_topk_length: bool = False
    enable_attn_sink: bool = True
    extra_s_k: Optional[int] = None
    extra_topk: Optional[int] = None
    block_size: int = 64
    extra_block_size: Optional[int] = None
    have_extra_topk_length: bool = False
    d_qk: int = 576
    check_correctness: bool = True
    num_runs: int = 10
    kind: str = ""
    seed: int = -1

    @property
    def id(self) -> str:
        s = (f"{self.seed:04d}-{self.kind[:4]}-d{self.d_qk}-h{self.h_q}-b{self.b}-sq{self.s_q}"
             f"-k{self.s_kv}_{self.topk}_{self.block_size}")
        if self.extra_topk is not None:
            s += f"-x{self.extra_s_k}_{self.extra_topk}_{self.extra_block_size}"
        flags = [("V", self.is_varlen), ("L", self.have_topk_length), ("E", self.have_extra_topk_length),
                 ("I", self.is_all_indices_invalid), ("Z", self.have_zero_seqlen_k), ("S", self.enable_attn_sink)]
        return s + "-" + "".join(c for c, on in flags if on)


@dataclasses.dataclass(frozen=True)
class PrefillParam:
    """FlashMLA's ``lib.TestParam`` for sparse prefill (spec §5.3) plus ``kind`` and ``seed``."""

    s_q: int
    s_kv: int
    topk: int
    h_q: int = 128
    d_qk: int = 512
    check_correctness: bool = True
    is_all_indices_invalid: bool = False
    num_runs: int = 10
    have_attn_sink: bool = False
    have_topk_length: bool = False
    kind: str = ""
    seed: int = -1

    @property
    def id(self) -> str:
        flags = [("S", self.have_attn_sink), ("L", self.have_topk_length), ("I", self.is_all_indices_invalid),
                 ("N", not self.check_correctness)]
        return (f"{self.seed:03d}-{self.kind[:4]}-d{self.d_qk}-h{self.h_q}-sq{self.s_q}-skv{self.s_kv}-topk{self.topk}"
                + ("-" + "".join(c for c, on in flags if on) if any(on for _, on in flags) else ""))


DECODE_TRIPLES = [(512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 2), (1024, 576, 61), (2046, 2048, 2),
                  (2046, 2048, 64), (2046, 2048, 576)]
DECODE_CORNER_TRIPLES = [(512, 64, 61), (650, 576, 53)]


def decode_cases() -> List[DecodeParam]:
    """Spec §5.2, loop for loop."""
    correctness, corner = [], []
    for d_qk in [576, 512]:
        for have_extra_k in ([False, True] if d_qk == 512 else [False]):
            for have_extra_topk_len in ([False, True] if have_extra_k else [False]):
                for have_topk_len in ([False, True] if d_qk == 512 else [False]):
                    for h_q in [64, 128]:
                        def varlens(b):
                            return [True, False] if (b == 74 and not have_topk_len and not have_extra_topk_len) \
                                else [True]

                        common = dict(have_topk_length=have_topk_len, have_extra_topk_length=have_extra_topk_len,
                                      d_qk=d_qk, check_correctness=True, num_runs=0)
                        for s_k, topk, bs in DECODE_TRIPLES:
                            for e_s_k, e_topk, e_bs in (DECODE_TRIPLES if have_extra_k else [(None, None, None)]):
                                for b in [4, 74, 321]:
                                    for s_q in [1, 3]:
                                        for is_varlen in varlens(b):
                                            correctness.append(DecodeParam(
                                                b, h_q, s_q, s_k, is_varlen, topk, enable_attn_sink=True,
                                                extra_s_k=e_s_k, extra_topk=e_topk, block_size=bs,
                                                extra_block_size=e_bs, kind="correctness", **common))
                        for s_k, topk, bs in DECODE_CORNER_TRIPLES:
                            for e_s_k, e_topk, e_bs in (DECODE_CORNER_TRIPLES if have_extra_k else [(None,) * 3]):
                                for b in [4, 74, 321]:
                                    for s_q in [3]:
                                        for is_varlen in varlens(b):
                                            for inv in [True, False]:
                                                for zero in [True, False]:
                                                    for sink in [True, False]:
                                                        if not (inv or zero or sink):
                                                            continue
                                                        corner.append(DecodeParam(
                                                            b, h_q, s_q, s_k, is_varlen, topk,
                                                            is_all_indices_invalid=inv, have_zero_seqlen_k=zero,
                                                            enable_attn_sink=sink, extra_s_k=e_s_k, extra_topk=e_topk,
                                                            block_size=bs, extra_block_size=e_bs, kind="corner",
                                                            **common))
    perf_bases = [
        (dict(h_q=128, s_kv=32768, topk=2048, d_qk=576), [2, 64, 74, 128]),  # V3.2
        (dict(h_q=64, s_kv=16384, topk=128, d_qk=512, extra_s_k=16384, extra_topk=512, block_size=256,
              extra_block_size=64), [2, 64, 74, 128, 148, 256]),  # MODEL1 CONFIG1
        (dict(h_q=128, s_kv=16384, topk=128, d_qk=512, extra_s_k=16384, extra_topk=1024, block_size=256,
              extra_block_size=64), [2, 64, 74, 128, 148, 256]),  # CONFIG2
        (dict(h_q=64, s_kv=16384, topk=128, d_qk=512, extra_s_k=16384, extra_topk=1024, block_size=256,
              extra_block_size=2, have_extra_topk_length=True), [2, 64, 74, 128, 148, 256]),  # CONFIG3
        (dict(h_q=128, s_kv=16384, topk=128, d_qk=512, extra_s_k=16384, extra_topk=1024, block_size=256,
              extra_block_size=2, have_extra_topk_length=True), [2, 64, 74, 128, 148, 256]),  # CONFIG4
    ]
    perf = [DecodeParam(b=b, s_q=2, is_varlen=True, kind="performance", **base) for base, bs in perf_bases for b in bs]
    perf += [DecodeParam(b=148, h_q=h_q, s_q=2, s_kv=32768, is_varlen=True, topk=16384, d_qk=d_qk,
                         kind="performance") for h_q in [64, 128] for d_qk in [512, 576]]  # peak
    cases = correctness + corner + perf
    return [dataclasses.replace(c, seed=i) for i, c in enumerate(cases)]


PREFILL_SHAPES = [(128, 128), (256, 256), (512, 512), (592, 128), (1840, 256), (1592, 384), (1521, 512), (95, 128),
                  (153, 256), (114, 384)]
PREFILL_FEATURE_SHAPES = [(592, 128), (1840, 256), (1592, 384), (1521, 512), (95, 128), (153, 256), (114, 384)]


def prefill_cases() -> List[PrefillParam]:
    """Spec §5.3, loop for loop."""
    cases = []
    for d_qk in [512, 576]:
        for h_q in [128, 64]:
            for s_kv, topk in PREFILL_SHAPES:
                for s_q in [1, 62, 213]:
                    cases.append(PrefillParam(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, num_runs=0, kind="correctness"))
    for d_qk in [512, 576]:
        for h_q in [128, 64]:
            for s_kv, topk in PREFILL_FEATURE_SHAPES:
                for s_q in [62, 213]:
                    for _have_sink_lse in [False, True]:  # unused upstream: every case appears twice
                        for sink in [False, True]:
                            for tl in [False, True]:
                                cases.append(PrefillParam(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, num_runs=0,
                                                          have_attn_sink=sink, have_topk_length=tl, kind="feature"))
    corner = dict(have_attn_sink=True, have_topk_length=True, num_runs=0, kind="corner")
    for d_qk in [512, 576]:
        for h_q in [128, 64]:
            for s_q, s_kv, topk in [(1, 128, 128), (1, 256, 256), (1234, 4321, 4096), (4096, 2048, 2048)]:
                cases.append(PrefillParam(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, is_all_indices_invalid=True, **corner))
            for s_kv, topk in [(32, 2048), (64, 8192)]:
                for s_q in [1, 1024]:
                    cases.append(PrefillParam(s_q, s_kv, topk, h_q=h_q, d_qk=d_qk, **corner))
            cases.append(PrefillParam(70000, 256, 256, h_q=h_q, d_qk=d_qk, check_correctness=False, **corner))
    perf = dict(have_attn_sink=True, num_runs=10, kind="performance")
    for s_kv in [8192, 32768, 65536, 98304, 131072]:
        cases.append(PrefillParam(4096, s_kv, 2048, h_q=128, d_qk=576, **perf))  # V3.2
    for h_q, topk in [(64, 512), (128, 1024)]:  # MODEL1 CONFIG1, CONFIG2
        for s_kv in [8192, 32768, 49152, 65536]:
            cases.append(PrefillParam(4096, s_kv, topk, h_q=h_q, d_qk=512, **perf))
    return [dataclasses.replace(c, seed=i) for i, c in enumerate(cases)]
