"""bench/side_by_side_tp.py on the CPU: arguments, and the document it writes from its workers' records
(the GPU parts, the workers and the ceilings' measurement, are replaced by stand-ins that return fixed
numbers; the GPU run itself is the lead's)."""

import json
import math
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import side_by_side_tp as tp  # noqa: E402

CEILINGS = {"matmul_tflops": 791.8, "copy_gbps": 4224.5}


def _fake_worker(calls):
    """run_worker stand-in: ours native = 100 + h_q us, ours padded = 110 us, FlashMLA padded = 120 us."""

    def run_worker(label, pythonpath, cases, modes, cfg):
        calls.append((label, pythonpath, list(cases), list(modes), dict(cfg)))
        recs = []
        for b, s_q, h_q in cases:
            for mode in modes:
                us = {"native": 100.0 + h_q, "pad64": 110.0 if label == "ours" else 120.0}[mode]
                recs.append(dict(label=label, b=b, s_q=s_q, h_q=h_q, mode=mode, us=us, kernel="k"))
        return recs

    return run_worker


@pytest.fixture
def anchor_dir(tmp_path):
    d = tmp_path / "anchor"
    (d / "flash_mla").mkdir(parents=True)
    return str(d)


@pytest.fixture
def stubbed(monkeypatch):
    calls = []
    monkeypatch.setattr(tp, "run_worker", _fake_worker(calls))
    monkeypatch.setattr(tp, "gpu_and_ceilings", lambda: ("Stand-in GPU", dict(CEILINGS)))
    monkeypatch.setenv("FLASHMLA_GIT_REV", "abc1234")
    return calls


def test_v32_document_carries_the_runs_ceilings_and_ratios(tmp_path, anchor_dir, stubbed):
    path = tp.main([str(tmp_path / "out"), "--anchor", anchor_dir])
    assert os.path.basename(path).endswith("-sparse-decode-tp-vs-flashmla.json")
    with open(path) as f:
        doc = json.load(f)
    assert doc["ceilings"] == CEILINGS
    assert doc["ours"] == {"package": "flash_mla (this repository)", "git": "abc1234"}
    assert doc["gpu"] == "Stand-in GPU" and doc["config"]["format"] == "V3.2" and doc["config"]["d_qk"] == 576
    assert [(r["b"], r["s_q"], r["h_q"]) for r in doc["rows"]] == tp.ROWS
    for row in doc["rows"]:
        assert row["ratio"] == pytest.approx(120.0 / (100.0 + row["h_q"]))
        assert row["native_vs_own_padded"] == pytest.approx(110.0 / (100.0 + row["h_q"]))
    ratios = [120.0 / (100.0 + h) for _, _, h in tp.ROWS]
    assert doc["geomean_ratio"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)))
    assert doc["min_ratio"] == pytest.approx(min(ratios))  # h_q 32: 120 / 132 < 1
    assert doc["targets"]["ratio_ge_1_every_row"] is False
    assert doc["targets"]["native_never_slower_than_own_padded"] is False
    # ours runs native and padded on every case, FlashMLA the padded rows only, from the anchor's path
    (lo, po, co, mo, _), (la, pa, ca, ma, _) = stubbed
    assert (lo, po, mo) == ("ours", None, ["native", "pad64"]) and co == tp.ROWS
    assert (la, pa, ma) == ("anchor", anchor_dir, ["pad64"]) and ca == tp.ROWS


def test_model1_sweep(tmp_path, anchor_dir, stubbed):
    path = tp.main([str(tmp_path), "--anchor", anchor_dir, "--d-qk", "512", "--sweep"])
    assert os.path.basename(path).endswith("-sparse-decode-tp-model1-vs-flashmla.json")
    with open(path) as f:
        doc = json.load(f)
    assert doc["config"]["format"] == "MODEL1" and doc["config"]["d_qk"] == 512
    assert doc["ceilings"] == CEILINGS
    cases = tp.cases_of(True)
    # the sweep covers the five rows: they come first, once
    assert cases[:len(tp.ROWS)] == tp.ROWS and len(cases) == len(set(cases)) == 2 * len(tp.SWEEP_B) * len(tp.SWEEP_H)
    assert [(r["b"], r["s_q"], r["h_q"]) for r in doc["rows"]] == cases
    assert all(c[4]["d_qk"] == 512 for c in stubbed)
    # sweep rows have no FlashMLA column, the five rows do
    assert sum("ratio" in r for r in doc["rows"]) == len(tp.ROWS)


def test_cases_replace_the_rows_and_get_every_column(tmp_path, anchor_dir, stubbed):
    path = tp.main([str(tmp_path), "--anchor", anchor_dir, "--cases", "4,1,24", "4,1,32", "4,1,24"])
    with open(path) as f:
        doc = json.load(f)
    assert [(r["b"], r["s_q"], r["h_q"]) for r in doc["rows"]] == [(4, 1, 24), (4, 1, 32)]  # once each, in order
    (lo, _, co, mo, _), (la, _, ca, ma, _) = stubbed
    assert (lo, co, mo) == ("ours", [(4, 1, 24), (4, 1, 32)], ["native", "pad64"])
    assert (la, ca, ma) == ("anchor", [(4, 1, 24), (4, 1, 32)], ["pad64"])
    assert [r["ratio"] for r in doc["rows"]] == pytest.approx([120.0 / 124.0, 120.0 / 132.0])


def test_worker_errors_are_recorded_per_row(tmp_path, anchor_dir, monkeypatch):
    monkeypatch.setattr(tp, "gpu_and_ceilings", lambda: ("g", dict(CEILINGS)))

    def run_worker(label, pythonpath, cases, modes, cfg):
        return [dict(label=label, b=b, s_q=s_q, h_q=h_q, mode=m, **({"us": 50.0} if label == "ours" else
                                                                      {"error": "RuntimeError: Unsupported h_q"}))
                for b, s_q, h_q in cases for m in modes]

    monkeypatch.setattr(tp, "run_worker", run_worker)
    with open(tp.main([str(tmp_path), "--anchor", anchor_dir])) as f:
        doc = json.load(f)
    assert doc["geomean_ratio"] is None and doc["targets"]["ratio_ge_1_every_row"] is False
    assert all(r["errors"] == ["anchor pad64: RuntimeError: Unsupported h_q"] and "ratio" not in r
               for r in doc["rows"])


def test_ceilings_come_from_the_shared_helper(monkeypatch):
    """gpu_and_ceilings measures with common.measure_ceilings (through side_by_side_flashmla), no copy of it."""
    fake_common = types.SimpleNamespace(measure_ceilings=lambda: {"matmul_tflops": 1.5, "copy_gbps": 2.5})
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_name=lambda i: f"gpu{i}"))
    monkeypatch.setitem(sys.modules, "common", fake_common)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert tp.gpu_and_ceilings() == ("gpu0", {"matmul_tflops": 1.5, "copy_gbps": 2.5})


@pytest.mark.parametrize("argv, message", [
    ([], "OUT_DIR is required"),
    (["out", "--d-qk", "256"], "invalid choice"),
    (["out", "--cases", "4,1"], "expected B,S_Q,H_Q (three integers), got '4,1'"),
    (["out", "--cases", "4,1,x"], "expected B,S_Q,H_Q (three integers), got '4,1,x'"),
    (["out", "--cases", "4,1,65"], "1 <= h_q <= 64, got '4,1,65'"),
    (["out", "--cases", "0,1,8"], "b, s_q >= 1"),
    (["out", "--cases", "4,1,24", "--sweep"], "give --cases or --sweep, not both"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        tp.parse_args(argv)
    assert message in capsys.readouterr().err


def test_missing_anchor_is_named(tmp_path, stubbed):
    with pytest.raises(SystemExit, match="no FlashMLA anchor at"):
        tp.main([str(tmp_path), "--anchor", str(tmp_path / "nowhere")])


def test_call_span_counts_an_overlapping_dependent_once():
    """The combine launched as a programmatic dependent starts while the main kernel runs: the span of a
    call is main start -> last end, not the sum of the two durations."""
    pytest.importorskip("torch")
    import common  # bench/, on sys.path above

    def ev(name, start, end):
        return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start, end=end))

    events = [ev("combine", 12.0, 112.0), ev("main_kernel", 10.0, 100.0),   # call 1: span 102
              ev("main_kernel", 200.0, 290.0), ev("combine", 205.0, 300.0),  # call 2: span 100
              ev("flush_memset", 150.0, 160.0)]                              # not a named kernel
    assert common.call_span_us(events, ["main_kernel", "combine"]) == pytest.approx(101.0)
    assert common.call_span_us(events[1:2], ["main_kernel", "combine"]) == pytest.approx(90.0)
    assert math.isnan(common.call_span_us([], ["main_kernel", "combine"]))
