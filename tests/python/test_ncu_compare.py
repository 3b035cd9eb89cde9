"""tools/ncu_compare.py: reading an ncu details CSV and the side-by-side Markdown (no GPU needed)."""

import csv
import gzip
import importlib.util
import io
import os

import pytest

_ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
_spec = importlib.util.spec_from_file_location("ncu_compare", os.path.join(_ROOT, "tools", "ncu_compare.py"))
ncu_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_compare)

_EXPORT = os.path.join(_ROOT, "bench", "results", "2026-12-04-ncu-dense-prefill-s8192-h128-d128-causal.csv.gz")
_NVTX = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
_HEADER = ["ID", "Kernel Name", _NVTX, "Block Size", "Grid Size", "Section Name", "Metric Name", "Metric Unit",
           "Metric Value", "Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type",
           "Estimated Speedup"]


def _write(path, rows, gz=False):
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(_HEADER)
    w.writerows(rows)
    data = buf.getvalue().encode()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(data)


def _row(kid, name, nvtx, sec, met="", unit="", val="", rule="", desc=""):
    return [kid, name, nvtx, "(384, 1, 1)", "(132, 1, 1)", sec, met, unit, val, rule, "OPT" if rule else "", desc,
            "", ""]


_A = "void ns::kern_a<float, 128>(Params)"
_B = "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FwdSm90<int>>>(T1)"
_NV_A = '123  "<default domain>:fwd_a:none:none:none:none:none:none" '
_ROWS = [
    _row("0", _A, _NV_A, "GPU Speed Of Light Throughput", "Duration", "ms", "1.50"),
    _row("0", _A, _NV_A, "GPU Speed Of Light Throughput", "Elapsed Cycles", "cycle", "2,000,000"),
    _row("0", _A, _NV_A, "ComputeWorkloadAnalysis", rule="HighPipeUtilization",
         desc="Tensor is the highest-utilized pipeline (50.0%) based on elapsed cycles in the workload. More."),
    _row("1", _B, "", "GPU Speed Of Light Throughput", "Duration", "us", "900.00"),
    _row("1", _B, "", "GPU Speed Of Light Throughput", "Elapsed Cycles", "cycle", "1,000,000"),
]


@pytest.mark.parametrize("gz", [False, True])
def test_reads_plain_and_gzip_and_puts_differing_units_in_cells(tmp_path, gz):
    path = str(tmp_path / ("x.csv.gz" if gz else "x.csv"))
    _write(path, _ROWS, gz)
    ks = ncu_compare.read_kernels(path)
    assert [(k.id, k.short, k.nvtx) for k in ks] == [("0", "kern_a", "fwd_a"), ("1", "device_kernel<FwdSm90>", "")]
    md = ncu_compare.render(ks, full_rules=False)
    assert "| GPU Speed Of Light Throughput / Duration [unit per cell] | 1.50 ms | 900.00 us |" in md
    assert "| GPU Speed Of Light Throughput / Elapsed Cycles [cycle] | 2,000,000 | 1,000,000 |" in md
    assert "Tensor 50.0 | - |" in md
    assert "Tensor 1.00 M | - |" in md  # derived: 50 % of 2,000,000 cycles
    assert "Warp State Statistics / Warp Cycles Per Issued Instruction" in md.split("not in this export")[1]


def test_id_ranges_and_bad_ids():
    assert ncu_compare.parse_ids("0,2-4") == {"0", "2", "3", "4"}
    with pytest.raises(SystemExit, match="--ids"):
        ncu_compare.parse_ids("2-x")


def test_not_an_export(tmp_path):
    p = tmp_path / "n.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not an ncu"):
        ncu_compare.read_kernels(str(p))


@pytest.mark.skipif(not os.path.exists(_EXPORT), reason="the committed export is absent")
def test_committed_export_figures():
    ks = {k.id: k for k in ncu_compare.read_kernels(_EXPORT)}
    assert ks["0"].short == "dense_prefill_fwd_kernel" and ks["0"].nvtx == "ours_fwd"
    assert ks["6"].short == "device_kernel<FlashAttnFwdSm90>" and ks["6"].nvtx == "fa3_fwd"
    assert ks["0"].value("GPU Speed Of Light Throughput", "Elapsed Cycles") == 14190512
    assert ks["6"].value("Launch Statistics", "Grid Size") == 132
    rows = ncu_compare.pipe_rows([ks["0"], ks["6"]])
    assert rows[0][1:] == ["Tensor 58.6", "Tensor 86.5"]
