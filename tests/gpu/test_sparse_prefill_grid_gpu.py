"""The FULL FlashMLA sparse-prefill grid (spec §5.3): 617 cases = 120 correctness + 448 feature
(incl. FlashMLA's duplicated cases) + 36 corner + 13 performance, with FlashMLA's loops, parameters
and data generation (tests/gpu/grid_cases.py, tests/gpu/grid_data.py: q / kv randn/10 + offset,
distinct random indices with the invalid list as padding when topk > s_kv, all-invalid rows,
sinks with +-inf, topk_length = randint(0, max(topk+1, 64)).clamp_max(topk), non-contiguous
q / kv / indices, sm_scale 0.5).

Each case: generate on the GPU, run flash_mla on CUDA tensors, compare with the float32 torch
reference on the GPU using the §5.1 tolerances (out.float(): abs 8e-4 / rel 3.01/128 / cos 7e-6;
max_logits and lse: abs 1e-6 / rel 2.01/65536 / cos 1e-7) and exact +-inf / NaN positions. The
s_q = 70000 cases (check_correctness=False upstream) only run and are checked for shape, dtype,
no NaN and the empty-row conventions. Performance cases: correctness only (no timing).

Skipped unless FLASHMLA_FULL_GRID=1 (see grid_data.py for FLASHMLA_GRID_LIMIT / _SLICE and the
CPU dry run FLASHMLA_GRID_DEVICE=cpu, which uses flash_mla's CPU backend as the answer).
"""

import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid_data as gd  # noqa: E402
import torch_reference as tr  # noqa: E402
from grid_cases import N_PREFILL, prefill_cases  # noqa: E402

CASES = prefill_cases()
assert len(CASES) == N_PREFILL


@pytest.mark.parametrize("p", CASES, ids=[c.id for c in CASES])
def test_sparse_prefill_grid(p):
    device = gd.select_or_skip(p.seed, len(CASES), gd.prefill_gflop(p), gd.prefill_gbytes(p), "§5.3 sparse-prefill", "~3-6 min")
    assert torch.get_float32_matmul_precision() == "highest", "the reference needs full fp32 matmuls"
    with torch.inference_mode():
        case = gd.PrefillCase(p, device)
        out, ml, lse = case.run_flash_mla()
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.device.type == ml.device.type == lse.device.type == device
        assert out.dtype == torch.bfloat16 and ml.dtype == torch.float32 and lse.dtype == torch.float32
        assert out.shape == (p.s_q, p.h_q, 512) and ml.shape == (p.s_q, p.h_q) and lse.shape == (p.s_q, p.h_q)
        if p.check_correctness:
            tr.compare_prefill(out, ml, lse, *case.reference())
        else:  # run-only case: no NaN, empty rows consistent (§2.4)
            assert not out.isnan().any() and not ml.isnan().any() and not lse.isnan().any()
            empty = lse == math.inf
            assert torch.equal(empty, ml == -math.inf) and bool((out[empty] == 0).all())
    del case, out, ml, lse
    if device == "cuda" and p.s_q >= 1024:
        torch.cuda.empty_cache()
