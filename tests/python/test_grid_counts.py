"""The full-grid GPU suites enumerate exactly FlashMLA's case counts (spec §5.2: 4748 =
3680 + 1036 + 32; §5.3: 617 = 120 + 448 + 36 + 13). Pure Python: runs without torch or a GPU."""

import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
import grid_cases as gc  # noqa: E402


def test_decode_grid_counts():
    cases = gc.decode_cases()
    assert len(cases) == gc.N_DECODE == 4748
    assert collections.Counter(c.kind for c in cases) == {"correctness": 3680, "corner": 1036, "performance": 32}
    assert [c.seed for c in cases] == list(range(4748))
    assert len({c.id for c in cases}) == 4748
    by_group = collections.Counter((c.kind, c.d_qk, c.extra_topk is not None) for c in cases if c.kind != "performance")
    assert by_group == {("correctness", 576, False): 128, ("correctness", 512, False): 224,
                        ("correctness", 512, True): 3328, ("corner", 576, False): 112,
                        ("corner", 512, False): 196, ("corner", 512, True): 728}
    corr = [c for c in cases if c.kind == "correctness"]
    assert all(c.enable_attn_sink and c.num_runs == 0 for c in corr)
    assert all(c.s_q == 3 for c in cases if c.kind == "corner")
    perf = [c for c in cases if c.kind == "performance"]
    assert all(c.s_q == 2 and c.is_varlen and c.enable_attn_sink and c.num_runs == 10 for c in perf)
    assert sum(c.topk == 16384 for c in perf) == 4


def test_prefill_grid_counts():
    cases = gc.prefill_cases()
    assert len(cases) == gc.N_PREFILL == 617
    assert collections.Counter(c.kind for c in cases) == {"correctness": 120, "feature": 448, "corner": 36,
                                                          "performance": 13}
    assert [c.seed for c in cases] == list(range(617))
    assert sum(not c.check_correctness for c in cases) == 4
    assert all(c.s_q == 70000 for c in cases if not c.check_correctness)
    assert sum(c.is_all_indices_invalid for c in cases) == 16
