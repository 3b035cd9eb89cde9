"""The FULL FlashMLA sparse-decode grid (spec §5.2): 4748 cases = 3680 correctness + 1036 corner
+ 32 performance, with FlashMLA's loops, parameters and data generation (tests/gpu/grid_cases.py,
tests/gpu/grid_data.py: q randn clamped and non-contiguous, sinks with +-inf, varlen / zero
lengths, random indices with -1 padding, topk_length, extra cache with its own page size, NaN
poisoning of every unreferenced token before FP8 quantization, padded block strides).

Each case: generate on the GPU, run flash_mla on CUDA tensors (fresh get_mla_metadata), compare
with the float32 torch reference (tests/gpu/torch_reference.py, computed on the GPU) using the
§5.1 tolerances: out abs 1e-3 / rel 2.01/128 / cos 5e-6, lse abs 1e-6 / rel 8.01/65536 / cos 1e-7,
exact +-inf / NaN positions. Performance cases are checked for correctness only (no timing).

Skipped unless FLASHMLA_FULL_GRID=1 (see grid_data.py for FLASHMLA_GRID_LIMIT / _SLICE and the
CPU dry run FLASHMLA_GRID_DEVICE=cpu, which uses flash_mla's CPU backend as the answer).
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid_data as gd  # noqa: E402
import torch_reference as tr  # noqa: E402
from grid_cases import N_DECODE, decode_cases  # noqa: E402

CASES = decode_cases()
assert len(CASES) == N_DECODE


@pytest.mark.parametrize("p", CASES, ids=[c.id for c in CASES])
def test_sparse_decode_grid(p):
    device = gd.select_or_skip(p.seed, len(CASES), gd.decode_gflop(p), gd.decode_gbytes(p), "§5.2 sparse-decode", "~15-25 min")
    assert torch.get_float32_matmul_precision() == "highest", "the reference needs full fp32 matmuls"
    with torch.inference_mode():
        case = gd.DecodeCase(p, device)
        out, lse = case.run_flash_mla()
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.device.type == device and lse.device.type == device
        assert out.shape == (p.b, p.s_q, p.h_q, 512) and lse.shape == (p.b, p.h_q, p.s_q)
        ref_out, ref_lse = case.reference()
        tr.compare_decode(out, lse, ref_out, ref_lse)
        if p.is_all_indices_invalid:  # §2.3: no valid slot -> out 0, lse +inf
            assert bool((out == 0).all()) and bool((lse == float("inf")).all())
    del case, out, lse, ref_out, ref_lse
    if device == "cuda" and p.kind == "performance":
        torch.cuda.empty_cache()
