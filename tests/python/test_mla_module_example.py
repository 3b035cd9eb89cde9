"""examples/mla_module.py on the CPU: a DeepSeek-V3-style MLA nn.Module, training prefill through
flash_attn_varlen_func (d_qk 192 / d_v 128, causal, backward) and absorbed decode through
flash_mla_with_kvcache (d_qk 576 / d_v 512, paged cache, one scheduler object per step shared by the
layers), checked against float64 torch: outputs, lse, gradients, decode vs recomputation over the
whole sequence; eager and under torch.compile. Skips without torch.
"""

import pytest

torch = pytest.importorskip("torch")

import flash_mla  # noqa: E402
from mla_test_utils import load_example  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--compile"], ["--prompt-lens", "16,17,1", "--page-size", "16"]],
                         ids=["eager", "compile", "page-edges"])
def test_example_cpu(extra, capsys):
    rc = load_example("mla_module.py").main(["--steps", "2"] + extra)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "MISMATCH" not in out


def test_example_detects_the_decode_default_scale(capsys, monkeypatch):
    """The check is sharp: the decode's default softmax_scale (576 ** -0.5) is not the model's (192 ** -0.5)."""
    ex = load_example("mla_module.py")
    right = flash_mla.flash_mla_with_kvcache

    def default_scale(*args, softmax_scale=None, **kwargs):
        return right(*args, **kwargs)

    monkeypatch.setattr(flash_mla, "flash_mla_with_kvcache", default_scale)
    rc = ex.main(["--steps", "1", "--layers", "1"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "decode step 0 layer 0 output" in out and "MISMATCH" in out


def test_varlen_max_seqlen_upper_bound_same_bits_and_one_compile():
    """README: max_seqlen_* may be any upper bound of the lengths (the same bits, forward and backward); a fixed
    bound keeps torch.compile to one graph over batches of other lengths (each distinct value is a guard)."""
    bf = torch.bfloat16

    def attn(q, k, v, cu, m):
        return flash_mla.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)[0]

    compiled = torch.compile(attn, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    frames = []
    for total in (20, 27, 33):
        cu = torch.tensor([0, total // 3, total], dtype=torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        q, k = (torch.randn(total, 4, 192, dtype=bf, requires_grad=True) for _ in range(2))
        v = torch.randn(total, 4, 128, dtype=bf, requires_grad=True)
        g = torch.randn(total, 4, 128, dtype=bf)
        exact = attn(q, k, v, cu, longest)
        grads = torch.autograd.grad(exact, (q, k, v), g)
        for fn in (attn, compiled):
            out = fn(q, k, v, cu, 64)
            assert torch.equal(out, exact)
            for a, b in zip(torch.autograd.grad(out, (q, k, v), g), grads):
                assert torch.equal(a, b)
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[0] == frames[-1], frames  # no recompilation for new lengths under the fixed bound
