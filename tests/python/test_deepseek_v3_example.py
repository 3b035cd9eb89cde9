"""examples/deepseek_v3_attention.py on the CPU: transformers' DeepseekV3Attention (eager) vs a
decode through flash_mla's reference backend (absorbed weights, paged latent cache).

Shrunken model (16 heads, hidden 1024; the MLA head dims are the real ones: kv_lora 512,
qk 128+64, v 128). Skips without torch or transformers.
"""

import pytest
from mla_test_utils import load_example

pytest.importorskip("torch")
pytest.importorskip("transformers")

SMALL = ["--device", "cpu", "--heads", "16", "--hidden", "1024", "--steps", "3"]


@pytest.mark.parametrize(
    "extra",
    [
        [],  # float32 module, YaRN rope (mscale in the softmax scale), interleaved rope
        ["--dtype", "bfloat16"],  # bf16 module, as on the GPU
        ["--rope", "default", "--no-interleave"],  # rotate_half rope, plain 192^-0.5 scale
        ["--prompt-lens", "5,64,65,130", "--tail", "5"],  # page-boundary lengths
    ],
    ids=["fp32-yarn", "bf16-yarn", "fp32-default-rope", "page-edges"],
)
def test_example_cpu(extra, capsys):
    ex = load_example("deepseek_v3_attention.py")
    rc = ex.main(SMALL + extra)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "MISMATCH" not in out


def test_example_detects_wrong_rope_layout(capsys):
    """The check is sharp: RoPE in the wrong layout on the client side must fail."""
    ex = load_example("deepseek_v3_attention.py")
    right = ex.rope
    ex.rope = lambda x, cos, sin, interleave: right(x, cos, sin, not interleave)
    rc = ex.main(SMALL + ["--steps", "1", "--tail", "0"])
    assert rc == 1
    assert "MISMATCH" in capsys.readouterr().out
