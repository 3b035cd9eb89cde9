"""bench/targets.py: the issues' speed targets evaluated on benchmark cases (standard library only)."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import targets  # noqa: E402


def _case(name, ratio=None, **kw):
    c = {"name": name, "params": kw.pop("params", {}), "ratio_to_anchor": ratio}
    c.update(kw)
    return c


def _by_target(block, prefix):
    return next(t for t in block["targets"] if t["target"].startswith(prefix))


def test_prefill_geomean_and_worst_case():
    cases = [_case("a", 1.2), _case("b", 0.9), _case("c", None)]
    block = targets.summarize("sparse-prefill", cases)
    g = _by_target(block, "geomean")
    assert g["value"] == pytest.approx(math.sqrt(1.2 * 0.9), abs=1e-4) and g["cases"] == 2
    assert g["met"] is (math.sqrt(1.2 * 0.9) >= 1.05)
    worst = _by_target(block, "every")
    assert worst["worst_case"] == "b" and worst["cases_below"] == 1 and not worst["met"]
    assert block["all_met"] is False and block["why_not"]
    assert block["why_not_summary"] == targets.WHY_NOT["sparse-prefill"] and block["why_not_summary"]


def test_all_met_when_every_case_is_fast():
    block = targets.summarize("sparse-prefill", [_case("a", 1.1), _case("b", 1.06)])
    assert block["all_met"] is True and block["why_not"] is None and block["why_not_summary"] is None


def test_sparse_decode_evaluates_kernel_only_and_with_combine():
    cases = [_case("x", 0.9, ratio_kernel_only=1.3), _case("y", 1.0, ratio_kernel_only=1.2)]
    block = targets.summarize("sparse-decode", cases)
    kernel_only = [t for t in block["targets"] if "kernel only" in t["target"]]
    with_combine = [t for t in block["targets"] if "combine" in t["target"]]
    assert len(kernel_only) == 2 and len(with_combine) == 2
    assert all(t["met"] for t in kernel_only)  # geomean 1.249 >= 1.15, min 1.2
    assert not all(t["met"] for t in with_combine)


def test_dense_memory_and_tensor_parallel_targets():
    mem = [_case("memory hq16 sk8192", 1.0, frac_copy_ceiling=0.95, time_us=300.0),
           _case("memory hq64 sk8192", 1.0, frac_copy_ceiling=0.90, time_us=320.0)]
    tp = [_case("tp hq8 sq1 sk8192", time_us=330.0, params={"s_q": 1, "h_q": 8, "h_kv": 1}),
          _case("tp hq32 sq4 sk8192", time_us=640.0, params={"s_q": 4, "h_q": 32, "h_kv": 1})]
    block = targets.summarize("dense-decode", mem + tp)
    m = _by_target(block, "memory-bound")
    assert m["worst_case"] == "memory hq64 sk8192" and not m["met"]
    t = _by_target(block, "tensor-parallel")
    assert t["worst_case"] == "tp hq32 sq4 sk8192" and t["value"] == pytest.approx(2.0) and not t["met"]
    assert t["value_rows_le_64"] == pytest.approx(330.0 / 320.0, abs=1e-4)


def test_cli_adds_targets_block(tmp_path):
    path = tmp_path / "2026-01-01-sparse-prefill.json"
    path.write_text(json.dumps({"gpu": "x", "cases": [_case("a", 1.2)]}))
    assert targets.main(["targets.py", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["targets"]["all_met"] is True
    assert targets.main(["targets.py", str(tmp_path / "other.json")]) == 2


# The JSON fields the three kernel issues name for bench/results/<date>-<family>.json.
_ISSUE_FIELDS = ("name", "params", "time_us", "call_time_us", "tflops", "gbps", "anchor_tflops", "ratio_to_anchor")


@pytest.mark.parametrize("family", ["dense-decode", "sparse-decode", "sparse-prefill"])
def test_results_of_record_carry_the_issue_fields(family):
    results = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")
    files = sorted(f for f in os.listdir(results) if f.endswith(f"-{family}.json") and f[:4].isdigit())
    assert files, f"no bench/results/<date>-{family}.json"
    d = json.load(open(os.path.join(results, files[-1])))
    assert d["gpu"] and d["date"] and {"matmul_tflops", "copy_gbps"} <= set(d["ceilings"])
    assert d["cases"] and "targets" in d
    for c in d["cases"]:
        missing = [k for k in _ISSUE_FIELDS if k not in c]
        assert not missing, f"{files[-1]} case {c.get('name')}: missing {missing}"
        assert c["time_us"] > 0 and c["tflops"] > 0
