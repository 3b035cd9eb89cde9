"""examples/deepseek_v3_attention.py on the Hopper GPU with DeepSeek-V3's real attention dims
(hidden 7168, 128 heads, q_lora 1536, kv_lora 512, qk 128+64, v 128, YaRN), bf16:
transformers' DeepseekV3Attention (eager) vs flash_mla's Hopper dense decode kernel.

tests/gpu/conftest.py skips this without a compute-capability-9.0 GPU and a CUDA build;
tests/python/test_deepseek_v3_example.py runs the shrunken model on the CPU.
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3_attention.py"


def load_example():
    spec = importlib.util.spec_from_file_location("deepseek_v3_attention_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "extra",
    [
        [],  # real dims, prompts 37/128/200, 4 decode steps, causal prefill tail of 4
        ["--prompt-lens", "1,63,64,65,1000,2049", "--steps", "2", "--tail", "1"],
        ["--rope", "default", "--no-interleave", "--steps", "2"],
    ],
    ids=["real-dims", "page-edges-long", "default-rope"],
)
def test_example_gpu_real_dims(extra, capsys):
    ex = load_example()
    rc = ex.main(["--device", "cuda"] + extra)
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert "device cuda" in out and "PASS" in out
