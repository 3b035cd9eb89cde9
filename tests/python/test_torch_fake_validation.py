"""The fake (meta) kernels of torch.ops.flash_mla validate their inputs as the CPU kernels do.

Everything the core can check without data (dtypes, ranks, shapes, head dims, h_q % h_kv, cu_seqlens dtype / rank /
length) raises the same exception class and message on the meta device, under FakeTensorMode and while
torch.compile traces as on the CPU; and errors of a compiled dense prefill call name the arguments as an eager call
does (cu_seqlens_qo / max_seqlen_qo, FlashMLA's public names). Skips without torch or without the op library.
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


def _error(fn):
    """(class, message) of what fn() raises; fails if it raises nothing."""
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def _on(device, tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def _cu(*lengths):
    """Valid int32 cumulative lengths (the CPU reads them after the shape checks)."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)


def _prefill(total_q=8, total_k=6, h_q=4, h_kv=2, d_qk=128, d_v=128, dtype=BF16):
    q = torch.zeros(total_q, h_q, d_qk, dtype=dtype)
    k = torch.zeros(total_k, h_kv, d_qk, dtype=dtype)
    v = torch.zeros(total_k, h_kv, d_v, dtype=dtype)
    return [q, k, v, _cu(total_q // 2, total_q - total_q // 2), _cu(total_k // 2, total_k - total_k // 2), 8, 8]


def _bad_prefill_args():
    """flash_attn_varlen_func arguments (q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv) that the
    core rejects from shapes and dtypes alone."""
    cases = {}
    cases["float32 q, d_qk 64, h_q % h_kv"] = [torch.zeros(8, 3, 64), torch.zeros(8, 2, 64), torch.zeros(8, 2, 64),
                                               _cu(4, 4), _cu(4, 4), 5, 5]
    cases["d_qk 64"] = _prefill(d_qk=64)
    cases["d_v 64"] = _prefill(d_v=64)
    cases["h_q % h_kv"] = _prefill(h_q=3)
    a = _prefill()
    a[1] = a[1].half()
    cases["k dtype"] = a
    a = _prefill()
    a[2] = a[2][:5]
    cases["v rows"] = a
    a = _prefill()
    a[0] = a[0][:, 0]
    cases["2-D q"] = a
    a = _prefill()
    a[3] = a[3].long()
    cases["int64 cu_seqlens_qo"] = a
    a = _prefill()
    a[4] = a[4].view(1, 3)
    cases["2-D cu_seqlens_kv"] = a
    a = _prefill()
    a[3] = torch.zeros(1, dtype=I32)
    cases["cu_seqlens_qo of one entry"] = a
    a = _prefill()
    a[4] = _cu(2, 2, 2)
    cases["cu_seqlens_kv longer than cu_seqlens_qo"] = a
    a = _prefill()
    a[5] = -1
    cases["negative max_seqlen_qo"] = a
    return cases


BAD_PREFILL = _bad_prefill_args()


@pytest.mark.parametrize("case", list(BAD_PREFILL))
def test_dense_prefill_meta_raises_what_the_cpu_raises(case):
    args = BAD_PREFILL[case]
    cpu = _error(lambda: flash_mla.flash_attn_varlen_func(*args))
    assert cpu[0] in (ValueError, TypeError), cpu
    assert _error(lambda: flash_mla.flash_attn_varlen_func(*_on("meta", args))) == cpu


@pytest.mark.parametrize("case", [c for c in BAD_PREFILL if c != "2-D q"])  # (the op's outputs need a 3-D q)
def test_dense_prefill_op_fake_kernel_raises_what_the_cpu_kernel_raises(case):
    """The raw op: the CPU kernel's "[flash_mla:<Class>] message" RuntimeError is that class and message in the
    fake kernel (a Python kernel raises the class itself), under FakeTensorMode as on the meta device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = BAD_PREFILL[case] + [0.125, False]
    op = torch.ops.flash_mla.dense_prefill_fwd.default
    with pytest.raises(RuntimeError) as info:
        op(*args)
    cpu = _torch_ops.mapped_error(info.value)
    want = (type(cpu), str(cpu))
    assert _error(lambda: op(*_on("meta", args))) == want
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        assert _error(lambda: op(*fake)) == want


def test_dense_prefill_meta_error_of_the_issue():
    """The reproducer: float32 q with d_qk 64 and h_q % h_kv != 0 on the meta device returned a (8, 3, 64) float32
    output; it raises the CPU's TypeError."""
    q = torch.empty(8, 3, 64, dtype=torch.float32, device="meta")
    k = torch.empty(8, 2, 64, dtype=torch.float32, device="meta")
    cu = torch.empty(3, dtype=I32, device="meta")
    with pytest.raises(TypeError, match=r"^q: expected dtype bfloat16 or float16, got float32$"):
        flash_mla.flash_attn_varlen_func(q, k, k, cu, cu, 5, 5)


def test_dense_prefill_packed_variants_and_backward_meta_raise_what_the_cpu_raises():
    qkv = torch.zeros(8, 3, 2 * 128 + 128, dtype=BF16)  # (k / v of 2 heads below: h_q % h_kv)
    cu = _cu(4, 4)
    for call in (lambda t, c: flash_mla.flash_attn_varlen_qkvpacked_func(t[:, :, 64:], c, 4, 64),  # d_v 192
                 lambda t, c: flash_mla.flash_attn_varlen_qkvpacked_func(t, c.long(), 4, 128),
                 lambda t, c: flash_mla.flash_attn_varlen_kvpacked_func(t[:, :, :128], t[:, :2, 128:], c, c, 4, 4,
                                                                         128),
                 lambda t, c: flash_mla.flash_attn_varlen_kvpacked_func(t[:, :, :128], t[:, :, 128:], c, c[:2], 4, 4,
                                                                         128)):
        cpu = _error(lambda: call(qkv, cu))
        assert cpu[0] in (ValueError, TypeError) and ("kv" in cpu[1] or "cu_seqlens" in cpu[1]), cpu
        assert _error(lambda: call(qkv.to("meta"), cu.to("meta"))) == cpu
    q, k, v, cu_q, cu_k, mq, mk = _prefill()
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    for dout in (torch.zeros(8, 4, 64, dtype=BF16), torch.zeros(8, 4, 128, dtype=torch.float16)):
        args = [dout, q, k, v, out, lse, cu_q, cu_k, mq, mk]
        cpu = _error(lambda: flash_mla.flash_attn_varlen_backward(*args))
        assert cpu[0] in (ValueError, TypeError) and cpu[1].startswith("dout: "), cpu
        assert _error(lambda: flash_mla.flash_attn_varlen_backward(*_on("meta", args))) == cpu


def test_dense_prefill_compile_rejects_bad_shapes_while_tracing():
    """torch.compile(fullgraph=True): the fake kernel raises the core's error while Dynamo traces (its class wraps
    it), before anything runs; a valid call still compiles and runs."""
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, cq, ck: flash_mla.flash_attn_varlen_func(q, k, v, cq, ck, 8, 8)[0],
                      fullgraph=True, backend="eager")
    q, k, v, cu_q, cu_k, _, _ = _prefill(h_q=3)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match=r"h_q % h_kv != 0: q has h_q = 3 heads, k has "
                                                                      r"h_kv = 2"):
        f(q, k, v, cu_q, cu_k)
    q, k, v, cu_q, cu_k, _, _ = _prefill()
    assert f(q, k, v, cu_q, cu_k).shape == (8, 4, 128)


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


# ----------------------------------------------------------------------------- decode and sparse prefill
def _dense_decode(b=2, s_q=1, h_q=16, h_kv=1, d=576, dtype=BF16):
    q = torch.zeros(b, s_q, h_q, d, dtype=dtype)
    k_cache = torch.zeros(4, 64, h_kv, d, dtype=dtype)
    return [q, k_cache, torch.arange(4, dtype=I32).view(2, 2)[:b], torch.tensor([70, 5][:b], dtype=I32)]


def _bad_dense_decode_args():
    cases = {"float32 q": _dense_decode(dtype=torch.float32), "d_qk 128": _dense_decode(d=128),
             "h_q % h_kv": _dense_decode(h_q=3, h_kv=2)}
    a = _dense_decode()
    a[1] = a[1].half()
    cases["k_cache dtype"] = a
    a = _dense_decode()
    a[2] = a[2].long()
    cases["int64 block_table"] = a
    a = _dense_decode()
    a[3] = a[3][:1]
    cases["cache_seqlens of one entry"] = a
    return cases


BAD_DENSE_DECODE = _bad_dense_decode_args()


@pytest.mark.parametrize("case", list(BAD_DENSE_DECODE))
def test_dense_decode_meta_raises_what_the_cpu_raises(case):
    q, k_cache, block_table, cache_seqlens = BAD_DENSE_DECODE[case]

    def call(device):
        t = _on(device, (q, k_cache, block_table, cache_seqlens))
        return flash_mla.flash_mla_with_kvcache(t[0], t[1], t[2], t[3], 512, flash_mla.get_mla_metadata()[0])

    cpu = _error(lambda: call("cpu"))
    assert cpu[0] in (ValueError, TypeError), cpu
    assert _error(lambda: call("meta")) == cpu
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.flash_mla.dense_decode_fwd.default
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, k_cache, cache_seqlens, block_table)]
        assert _error(lambda: op(fake[0], fake[1], 512, fake[2], fake[3], 0.1, False)) == cpu


def test_sparse_decode_and_sparse_prefill_meta_raise_what_the_cpu_raises():
    q = torch.zeros(2, 1, 64, 576, dtype=BF16)
    k_cache = torch.zeros(4, 64, 1, 656, dtype=torch.uint8)
    indices = torch.zeros(2, 1, 64, dtype=I32)
    for bad in ({"indices": indices.long()}, {"k_cache": k_cache[..., :584]}, {"q": q[..., :128]},
                {"indices": indices[:1]}, {"topk_length": torch.zeros(3, dtype=I32)},
                {"attn_sink": torch.zeros(64, dtype=BF16)}):
        args = {"q": q, "k_cache": k_cache, "indices": indices, **bad}

        def call(device):
            t = {n: v.to(device) for n, v in args.items()}
            return flash_mla.flash_mla_with_kvcache(t.pop("q"), t.pop("k_cache"), None, None, 512,
                                                    flash_mla.get_mla_metadata()[0], softmax_scale=0.1,
                                                    is_fp8_kvcache=True, **t)

        cpu = _error(lambda: call("cpu"))
        assert cpu[0] in (ValueError, TypeError), (bad, cpu)
        assert _error(lambda: call("meta")) == cpu, bad
    q = torch.zeros(4, 16, 576, dtype=BF16)
    kv = torch.zeros(32, 1, 576, dtype=BF16)
    indices = torch.zeros(4, 1, 64, dtype=I32)
    for bad in ({"q": q[..., :128]}, {"kv": kv.half()}, {"indices": indices[:, :, :0]}, {"kv": kv.expand(32, 2, 576)},
                {"topk_length": torch.zeros(5, dtype=I32)}):
        args = {"q": q, "kv": kv, "indices": indices, **bad}

        def call(device):
            t = {n: v.to(device) for n, v in args.items()}
            return flash_mla.flash_mla_sparse_fwd(t.pop("q"), t.pop("kv"), t.pop("indices"), 0.1, **t)

        cpu = _error(lambda: call("cpu"))
        assert cpu[0] in (ValueError, TypeError), (bad, cpu)
        assert _error(lambda: call("meta")) == cpu, bad


def _attention_f64(q, k, v, cu_q, cu_k, scale):
    """Non-causal varlen attention in float64 (GQA: query head h reads KV head h // (h_q / h_kv))."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        for h in range(q.shape[1]):
            s = q[q0:q1, h].double() @ k[k0:k1, h // group].double().T * scale
            out[q0:q1, h] = torch.softmax(s, -1) @ v[k0:k1, h // group].double()
    return out


def test_valid_meta_and_symbolic_calls_still_trace():
    """Valid inputs pass the fake kernels' checks: on the meta device the outputs have the CPU call's shapes, strides
    and dtypes; with every size symbolic (torch.compile dynamic=True: the checks read the example sizes without
    guards, so the graph is not specialised) the compiled call gives the eager call's values, which match a float64
    reference on fresh random inputs."""
    gen = torch.Generator().manual_seed(20261205)
    q, k, v, cu_q, cu_k, mq, mk = _prefill()
    q, k, v = (torch.randn(t.shape, generator=gen).to(BF16) for t in (q, k, v))
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    out_m, lse_m = flash_mla.flash_attn_varlen_func(*_on("meta", (q, k, v, cu_q, cu_k)), mq, mk)
    for real, fake in ((out, out_m), (lse, lse_m)):
        assert fake.device.type == "meta"
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    ref = _attention_f64(q, k, v, cu_q, cu_k, q.shape[-1] ** -0.5)
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)[0],
                      fullgraph=True, backend="eager", dynamic=True)
    assert torch.equal(f(q, k, v), out)


# ----------------------------------------------------------------------------- packed variants under torch.compile
def _bad_packed_calls():
    """(function, arguments) of the packed variants that the eager call rejects from shapes, strides and dtypes."""
    qkvf, kvf = flash_mla.flash_attn_varlen_qkvpacked_func, flash_mla.flash_attn_varlen_kvpacked_func
    q = torch.zeros(8, 4, 128, dtype=BF16)
    kv = torch.zeros(6, 2, 256, dtype=BF16)
    return {
        "qkv float32": (qkvf, [torch.zeros(8, 4, 384), _cu(4, 4), 4, 128]),
        "qkv d_v 64": (qkvf, [torch.zeros(8, 4, 320, dtype=BF16), _cu(4, 4), 4, 128]),
        "qkv last dim strided": (qkvf, [torch.zeros(8, 4, 384, 2, dtype=BF16)[..., 0], _cu(4, 4), 4, 128]),
        "qkv int64 cu_seqlens": (qkvf, [torch.zeros(8, 4, 384, dtype=BF16), _cu(4, 4).long(), 4, 128]),
        "kv float16": (kvf, [q, kv.half(), _cu(4, 4), _cu(3, 3), 4, 3, 128]),
        "kv h_q % h_kv": (kvf, [q[:, :3], kv, _cu(4, 4), _cu(3, 3), 4, 3, 128]),
        "kv last dim strided": (kvf, [q, torch.zeros(6, 2, 256, 2, dtype=BF16)[..., 0], _cu(4, 4), _cu(3, 3), 4, 3,
                                      128]),
        "kv 2-D cu_seqlens_kv": (kvf, [q, kv, _cu(4, 4), _cu(3, 3).view(1, 3), 4, 3, 128]),
    }


BAD_PACKED = _bad_packed_calls()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("case", list(BAD_PACKED))
def test_compiled_packed_variants_raise_the_eager_error(case, backend):
    """A compiled packed variant raised Dynamo's TorchRuntimeError naming flash_attn_varlen_func's q / k / v and
    cu_seqlens_qo (the fake kernel's error, not renamed while tracing), or at run time "[flash_mla:ValueError] q: the
    last dimension ...": it raises the eager call's class and message (qkv, kv, cu_seqlens); with fullgraph=True
    Dynamo's error carries that exception."""
    fn, args = BAD_PACKED[case]
    eager = _error(lambda: fn(*args))
    assert eager[0] in (ValueError, TypeError) and ("kv" in eager[1] or "cu_seqlens" in eager[1]), eager
    torch._dynamo.reset()
    assert _error(lambda: torch.compile(lambda *a: fn(*a), backend=backend)(*args)) == eager
    torch._dynamo.reset()
    cls, msg = _error(lambda: torch.compile(lambda *a: fn(*a), backend=backend, fullgraph=True)(*args))
    assert issubclass(cls, torch._dynamo.exc.TorchDynamoException), (cls, msg)
    assert f"{eager[0].__name__}({eager[1]!r})" in msg, msg


def test_meta_last_dim_strided_raises_what_the_cpu_raises():
    """The fake kernel checks the contiguous last dim of q, k and v as the core does (no data needed)."""
    q, k, v, cu_q, cu_k, mq, mk = _prefill()
    v = torch.zeros(6, 2, 128, 2, dtype=BF16)[..., 0]
    args = [q, k, v, cu_q, cu_k, mq, mk]
    cpu = _error(lambda: flash_mla.flash_attn_varlen_func(*args))
    assert cpu == (ValueError, "v: the last dimension must be contiguous (stride 1), got stride 2")
    meta = _on("meta", args)
    meta[2] = torch.empty_strided(v.shape, v.stride(), dtype=BF16, device="meta")  # (.to() would make it contiguous)
    assert _error(lambda: flash_mla.flash_attn_varlen_func(*meta)) == cpu


def test_meta_backward_strided_dout_raises_what_the_cpu_raises():
    """The backward's fake kernel checks the contiguous last dim of q, k, v, out and dout as the core does."""
    q, k, v, cu_q, cu_k, mq, mk = _prefill()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=BF16)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32).t()  # (total_q, h_q), FlashMLA's strides
    dout = torch.zeros(*out.shape, 2, dtype=BF16)[..., 0]  # last-dim stride 2
    args = [dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, q.shape[-1] ** -0.5, False]
    cpu = _error(lambda: _torch_ops.dense_prefill_bwd(*args))
    assert cpu == (ValueError, "dout: the last dimension must be contiguous (stride 1), got stride 2")
    meta = _on("meta", args)
    meta[0] = torch.empty_strided(dout.shape, dout.stride(), dtype=BF16, device="meta")
    meta[5] = torch.empty_strided(lse.shape, lse.stride(), dtype=torch.float32, device="meta")
    assert _error(lambda: _torch_ops.dense_prefill_bwd(*meta)) == cpu


# ----------------------------------------------------------------------------- bad scalars under fullgraph=True
def _bad_scalar_calls():
    """(function, arguments) whose eager call raises a TypeError naming a scalar argument, one per operator."""
    q, k, v, cu_q, cu_k, mq, mk = _prefill()
    varlen = flash_mla.flash_attn_varlen_func
    dq, kc, bt, lens = _dense_decode()

    def decode(q, kc, bt, lens, softmax_scale=None, causal=False):
        return flash_mla.flash_mla_with_kvcache(q, kc, bt, lens, 512, flash_mla.get_mla_metadata()[0],
                                                softmax_scale=softmax_scale, causal=causal)

    sq = torch.zeros(4, 16, 576, dtype=BF16)
    kv = torch.zeros(32, 1, 576, dtype=BF16)
    idx = torch.zeros(4, 1, 8, dtype=I32)
    return {
        "varlen softmax_scale str": (varlen, [q, k, v, cu_q, cu_k, mq, mk, 0.0, "x"]),
        "varlen causal str": (varlen, [q, k, v, cu_q, cu_k, mq, mk, 0.0, None, "no"]),
        "decode softmax_scale str": (decode, [dq, kc, bt, lens, "x"]),
        "decode causal bytes": (decode, [dq, kc, bt, lens, None, b"no"]),
        "sparse prefill sm_scale str": (flash_mla.flash_mla_sparse_fwd, [sq, kv, idx, "a"]),
    }


BAD_SCALARS = _bad_scalar_calls()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("case", list(BAD_SCALARS))
def test_compiled_fullgraph_bad_scalar_raises_the_eager_error(case, dynamic):
    """A scalar argument of a wrong type under torch.compile(fullgraph=True): Dynamo's error carries the eager call's
    TypeError naming the argument. The check for traced JAX values read ``type(value).__module__.startswith("jax")``,
    which Dynamo cannot trace: the error was "Unsupported method call ... startswith", naming no argument."""
    fn, args = BAD_SCALARS[case]
    eager = _error(lambda: fn(*args))
    assert eager[0] is TypeError, eager
    torch._dynamo.reset()
    assert _error(lambda: torch.compile(lambda *a: fn(*a), backend="eager", dynamic=dynamic)(*args)) == eager
    torch._dynamo.reset()
    cls, msg = _error(lambda: torch.compile(lambda *a: fn(*a), backend="eager", dynamic=dynamic, fullgraph=True)(*args))
    assert issubclass(cls, torch._dynamo.exc.TorchDynamoException), (cls, msg)
    assert f"TypeError({eager[1]!r})" in msg, msg


def _bad_dynamic_calls():
    """(function, arguments) rejected in Python from a size or an int argument given as a float."""
    q, k, v, cu_q, cu_k, mq, mk = _prefill()
    varlen = flash_mla.flash_attn_varlen_func
    dq, kc, bt, lens = _dense_decode()

    def decode(q, kc, bt, lens, head_dim_v=512):
        return flash_mla.flash_mla_with_kvcache(q, kc, bt, lens, head_dim_v, flash_mla.get_mla_metadata()[0])

    return {
        "varlen 2-D q": (varlen, [q[:, 0], k, v, cu_q, cu_k, mq, mk]),
        "varlen max_seqlen_qo float": (varlen, [q, k, v, cu_q, cu_k, 8.0, mk]),
        "qkvpacked 2-D qkv": (flash_mla.flash_attn_varlen_qkvpacked_func, [torch.zeros(8, 384, dtype=BF16), cu_q, 8,
                                                                           128]),
        "decode 3-D q": (decode, [dq[0], kc, bt, lens]),
        "decode head_dim_v float": (decode, [dq, kc, bt, lens, 512.0]),
    }


BAD_DYNAMIC = _bad_dynamic_calls()


@pytest.mark.parametrize("case", list(BAD_DYNAMIC))
def test_compiled_dynamic_fullgraph_errors_read_as_eager(case):
    """torch.compile(dynamic=True, fullgraph=True): sizes and float scalars are symbolic while Dynamo traces. A wrong
    rank read "got shape (s60, s94)" (the symbols, not the sizes given), and an int argument given as a float
    (max_seqlen_qo=8.0) failed with Dynamo's "Unsupported hasattr call" (hasattr of the SymFloat), naming no
    argument; both now carry the eager call's error."""
    fn, args = BAD_DYNAMIC[case]
    eager = _error(lambda: fn(*args))
    assert eager[0] in (ValueError, TypeError), eager
    torch._dynamo.reset()
    cls, msg = _error(lambda: torch.compile(lambda *a: fn(*a), backend="eager", dynamic=True, fullgraph=True)(*args))
    assert issubclass(cls, torch._dynamo.exc.TorchDynamoException), (cls, msg)
    assert f"{eager[0].__name__}({eager[1]!r})" in msg, msg
    torch._dynamo.reset()
    assert _error(lambda: torch.compile(lambda *a: fn(*a), backend="eager", dynamic=True)(*args)) == eager


def _scale_calls():
    """One call of each operator as a function of its softmax scale."""
    gen = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(shape, generator=gen).to(BF16)

    q, cu = rnd(8, 2, 128), _cu(3, 5)
    dq, kc = rnd(2, 1, 16, 576), rnd(4, 64, 1, 576)
    bt, lens = torch.arange(4, dtype=I32).view(2, 2), torch.tensor([70, 3], dtype=I32)
    sq, kv, idx = rnd(4, 16, 576), rnd(32, 1, 576), torch.randint(0, 32, (4, 1, 8), dtype=I32, generator=gen)
    return {
        "dense prefill": lambda s: flash_mla.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, softmax_scale=s)[0],
        "dense decode": lambda s: flash_mla.flash_mla_with_kvcache(dq, kc, bt, lens, 512, flash_mla.get_mla_metadata()[0],
                                                                   softmax_scale=s)[0],
        "sparse prefill": lambda s: flash_mla.flash_mla_sparse_fwd(sq, kv, idx, s)[0],
    }


SCALE_CALLS = _scale_calls()


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("case", list(SCALE_CALLS))
def test_compiled_fullgraph_takes_a_changing_scale(case, dynamic):
    """torch.compile(fullgraph=True) of a function taking the scale as an argument: Dynamo makes a float argument
    symbolic (dynamic=True, or after the first recompilation with the default dynamic=None), and the scale's
    finiteness check, math.isfinite, failed on it ("torch.* op returned non-Tensor") from the second scale on.
    Every scale now gives the eager result; a non-finite one still raises naming the argument."""
    fn = SCALE_CALLS[case]
    torch._dynamo.reset()
    f = torch.compile(fn, backend="eager", dynamic=dynamic, fullgraph=True)
    for s in (0.5, 0.25, 0.1):
        assert torch.equal(f(s), fn(s)), s
    name = "sm_scale" if case == "sparse prefill" else "softmax_scale"
    assert _error(lambda: fn(float("inf"))) == (ValueError, f"{name}: must be finite, got inf")
    assert f"{name}: must be finite, got inf" in _error(lambda: f(float("inf")))[1]


def test_int_argument_given_a_numpy_float_names_its_type():
    """The float check of _int_arg that runs before _array_shape (for Dynamo's SymFloat) takes Python floats only:
    a NumPy float keeps its own type name and repr in the message."""
    import numpy as np

    from flash_mla.flash_mla_interface import _int_arg

    for value, text in ((5.0, "float 5.0"), (np.float64(5.0), f"float64 {np.float64(5.0)!r}"),
                        (np.float32(5.0), f"float32 {np.float32(5.0)!r}")):
        with pytest.raises(TypeError) as info:
            _int_arg("max_seqlen_qo", value)
        assert str(info.value) == f"max_seqlen_qo: expected an int, got {text}"
