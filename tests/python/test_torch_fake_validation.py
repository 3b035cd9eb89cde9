"""torch.ops.flash_mla under torch.compile: errors of a compiled dense prefill call name the arguments as an eager
call does (cu_seqlens_qo / max_seqlen_qo, FlashMLA's public names). Skips without torch or without the op library.
"""

import os

import pytest

torch = pytest.importorskip("torch")

import flash_mla  # noqa: E402
from flash_mla import _torch_ops  # noqa: E402

if not _torch_ops.available():
    if os.environ.get("FLASHMLA_REQUIRE_TORCH_OPS", "") not in ("", "0"):
        raise RuntimeError(f"torch.ops.flash_mla is required but unavailable: {_torch_ops.load_error()}")
    pytest.skip(f"torch.ops.flash_mla unavailable: {_torch_ops.load_error()}", allow_module_level=True)

BF16, I32 = torch.bfloat16, torch.int32


def test_compiled_dense_prefill_errors_name_the_public_arguments():
    """A value error of a compiled call surfaces from the op when the graph runs (a RuntimeError carrying the class):
    it names cu_seqlens_qo / max_seqlen_qo as the eager call does, not cu_seqlens_q / max_seqlen_q."""
    torch._dynamo.reset()
    qc = torch.zeros(9, 2, 128, dtype=BF16)
    cu = torch.tensor([0, 9, 8], dtype=I32)
    msg = "cu_seqlens_qo: request 0 has 9 tokens, more than max_seqlen_qo = 5"
    with pytest.raises(ValueError, match=rf"^{msg}$"):
        flash_mla.flash_attn_varlen_func(qc, qc, qc, cu, cu, 5, 5)
    f = torch.compile(lambda q, cq: flash_mla.flash_attn_varlen_func(q, q, q, cq, cq, 5, 5)[0], fullgraph=True,
                      backend="eager")
    with pytest.raises(RuntimeError, match=rf"\[flash_mla:ValueError\] {msg}$"):
        f(qc, cu)
    # The op's own arguments carry the same names.
    schema = str(torch.ops.flash_mla.dense_prefill_fwd.default._schema)
    for name in ("cu_seqlens_qo", "cu_seqlens_kv", "max_seqlen_qo", "max_seqlen_kv"):
        assert f" {name}" in schema, schema
