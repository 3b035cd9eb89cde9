"""examples/tensor_parallel_attention.py on the CPU: 2 ranks under torchrun with gloo and
flash_mla's reference backend (a small DeepSeek-V3 layer: 8 heads, 4 per rank; the MLA head dims
are the real ones), dense and FP8 sparse, prefill chunks and decode steps, each checked against the
single-process run and float64 exact math; plus runs with a sharding bug planted, which must fail.

Needs torch (the main CI interpreter has none: these run in CI's torch venv, tools/torch-abi-ci.sh,
which runs the whole tests/python).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mla_test_utils import load_example

torch = pytest.importorskip("torch", reason="torch is not installed (CI runs this file in its torch venv)")
if not torch.distributed.is_available():  # pragma: no cover - torch builds without distributed
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensor_parallel_attention.py"
TIMEOUT_S = 240


def torchrun(script, args, cwd):
    """Runs `script args` under torchrun with 2 CPU ranks; loopback only, one thread per rank."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           *args]
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")


def test_two_ranks_gloo_match_single_process_and_exact_math(tmp_path):
    out_json = tmp_path / "tp2.json"
    p = torchrun(EXAMPLE, ["--device", "cpu", "--small", "--no-progress", "--json", str(out_json)], tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "PASS" in p.stdout and "MISMATCH" not in p.stdout, log
    assert "bit-exact" in p.stdout, log  # the example's FP8 quantizer agrees with flash_mla.quant
    doc = json.loads(out_json.read_text())
    assert doc["pass"] is True and doc["world_size"] == 2 and doc["backend"] == "gloo" and doc["device"] == "cpu"
    cfg = doc["config"]
    assert cfg["heads"] == 8 and cfg["heads_per_rank"] == 4
    lens, chunk, steps = cfg["prompt_lens"], cfg["prefill_chunk"], cfg["steps"]
    n_prefill = -(-max(lens) // chunk)
    assert set(doc["modes"]) == {"dense", "sparse"}
    for mode, res in doc["modes"].items():
        rows = res["steps"]
        assert [r["phase"] for r in rows] == ["prefill"] * n_prefill + ["decode"] * steps, mode
        # every prompt token is a query row exactly once; every decode step has one token per request
        assert sum(r["tokens"] for r in rows if r["phase"] == "prefill") == sum(lens), mode
        assert all(r["tokens"] == len(lens) and r["s_q"] == 1 for r in rows if r["phase"] == "decode"), mode
        assert rows[-1]["kv_len_max"] == max(lens) + steps, mode
        for r in rows:
            assert r["ok"], (mode, r)
            # CPU: the reference backend computes each head on its own, so the gathered per-head
            # outputs equal the single-process ones exactly; the layer outputs differ only by the
            # order of the float32 sum over ranks (all_reduce).
            assert r["lat_err_vs_tp1"] == 0.0, (mode, r)
            assert r["err_vs_tp1"] < 1e-5, (mode, r)
            # bf16 queries / cache (and FP8 for sparse) against float64 math without absorption
            assert 1e-5 < r["err_vs_exact"] < 1e-2, (mode, r)
            assert r["layer_ms"] > 0 and r["attn_ms"] > 0 and r["tp1_layer_ms"] > 0 and r["tokens_per_s"] > 0
        assert res["decode"]["speedup_vs_tp1"] > 0


# A plausible sharding bug: each rank multiplies its heads' values by the o_proj columns of the
# other rank's heads (a wrong offset in the row-parallel split). Planted by a wrapper script.
SABOTAGE = """
init = ex.AttentionShard.__init__

def columns_of(cfg, w, heads, dtype):
    other = ex.AttentionShard.__new__(ex.AttentionShard)
    init(other, cfg, w, heads, dtype)
    return other.o

def patched(self, cfg, w, heads, dtype):
    init(self, cfg, w, heads, dtype)
    if len(heads) < cfg.heads:
        start = (heads.start + len(heads)) % cfg.heads
        self.o = columns_of(cfg, w, range(start, start + len(heads)), dtype)

ex.AttentionShard.__init__ = patched
"""


def test_planted_sharding_bug_fails(tmp_path):
    """The checks are sharp: o_proj columns of the wrong heads must fail the run (the per-head
    latent outputs stay right, so this is caught by the layer-output checks)."""
    script = tmp_path / "sabotaged.py"
    script.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ex', {str(EXAMPLE)!r})\n"
        "ex = sys.modules['ex'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)\n"
        + SABOTAGE
        + "sys.exit(ex.main(sys.argv[1:]))\n")
    p = torchrun(script, ["--device", "cpu", "--small", "--no-progress", "--modes", "dense", "--steps", "1",
                          "--prompt-lens", "40,9"], tmp_path)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "MISMATCH" in p.stdout and "FAIL" in p.stdout, p.stdout + p.stderr
    decode = [line.split() for line in p.stdout.splitlines() if line.strip().startswith("decode 0")]
    assert decode and decode[0][-1] == "MISMATCH" and float(decode[0][-3]) == 0.0, p.stdout  # lat/TP1 exact


def test_quantizer_matches_flash_mla_quant():
    """The example's torch V32 quantizer against flash_mla.quant, bit for bit: zero rows (the 1e-4
    scale floor), magnitudes from 1e-6 to 1e4, values that land on e4m3 rounding ties."""
    import flash_mla.quant

    ex = load_example("tensor_parallel_attention.py")
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(96, 576, generator=g) * torch.logspace(-6, 4, 96)[:, None]
    rows[0] = 0
    rows[1, :128] = 448.0 * torch.exp2(-torch.arange(128, dtype=torch.float32))  # one tile over 128 binades
    rows[2] = torch.linspace(-1, 1, 576)
    rows[3, :128] = (1 + (2 * torch.arange(128) % 16 + 1) / 16) * torch.where(torch.arange(128) % 2 == 0, 1.0, -1.0)
    rows[3, 0] = 448.0  # scale 1: the others sit halfway between two e4m3 values (ties to even)
    ours = ex.quantize_v32_rows(rows.to(torch.bfloat16))
    lib = flash_mla.quant.quantize_k_cache(rows.to(torch.bfloat16).view(-1, 1, 1, 576), block_stride=656)
    assert ours.dtype == torch.uint8 and ours.shape == (96, 656)
    assert torch.equal(ours, lib.reshape(96, 656))
    back = flash_mla.quant.dequantize_k_cache(ours.view(96, 1, 1, 656))
    assert torch.equal(back[:, 0, 0, 512:], rows.to(torch.bfloat16)[:, 512:])  # RoPE dims are stored as bf16


def test_schedule_right_aligns_prompts():
    ex = load_example("tensor_parallel_attention.py")
    sched = ex.make_schedule([5, 11], steps=2, chunk=4, device="cpu")
    assert [(s.phase, s.index) for s in sched] == [("prefill", 0), ("prefill", 1), ("prefill", 2),
                                                    ("decode", 0), ("decode", 1)]
    assert sched[0].positions.tolist() == [[-7, -6, -5, -4], [-1, 0, 1, 2]]
    assert sched[2].positions.tolist() == [[1, 2, 3, 4], [7, 8, 9, 10]]
    assert sched[0].seqlens.tolist() == [0, 3] and sched[2].seqlens.tolist() == [5, 11]
    assert sched[0].valid.tolist() == [[False] * 4, [False, True, True, True]]
    assert sched[4].positions.tolist() == [[6], [12]] and sched[4].seqlens.tolist() == [7, 13]


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--small", "--heads", "6"], 4, "--heads 6: tensor parallelism splits the query heads evenly"),
        (["--small", "--prompt-lens", "8,0"], 1, "--prompt-lens: every prompt needs at least 1 token"),
        (["--small", "--prompt-lens", "8,x"], 1, "--prompt-lens: expected comma-separated integers"),
        (["--small", "--modes", "dense,paged"], 1, "--modes: expected a comma-separated subset of dense,sparse"),
        (["--small", "--steps", "-1"], 1, "--steps: must be >= 0"),
        (["--small", "--page-size", "0"], 1, "--page-size: must be >= 1"),
        (["--small", "--batch", "0"], 1, "--batch: must be >= 1"),
    ],
)
def test_bad_options_are_named(argv, world, message):
    ex = load_example("tensor_parallel_attention.py")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ex.check_args(ex.parse_args(argv), world)


def test_bad_options_exit_2_without_a_traceback(capsys, monkeypatch):
    ex = load_example("tensor_parallel_attention.py")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert ex.main(["--small", "--device", "cpu"]) == 2  # 8 heads over 3 ranks
    err = capsys.readouterr().err
    assert "--heads 8" in err and "multiple of the 3 ranks" in err and "Traceback" not in err
