"""flash_mla inside jax.jit (XLA custom calls through jax-tvm-ffi; python/flash_mla/_jax.py).

On JAX's CPU device the custom calls run the reference backend, so a jitted call must give
bit-for-bit the values of the eager NumPy call, and agree with the float64 oracle. The GPU
version of these checks is tests/gpu/test_frameworks_gpu.py.
"""

import numpy as np
import pytest

import flash_mla
import oracle
from mla_test_utils import (BF16, LSE_TOL, assert_same, bits, check_allclose, check_lse, check_out, gen_dense_case,
                            gen_prefill_case, gen_sparse_decode_case, to_jax_cpu)

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")
jnp = jax.numpy
to_jax = to_jax_cpu


def test_dense_decode_under_jit_matches_eager_and_oracle(rng):
    c = gen_dense_case(rng, b=3, s_q=2, h_q=16, h_kv=2, d=576, s_k=150, varlen=True, zero=[False, True, False],
                       causal=True, softmax_scale=0.3)
    eager = flash_mla.flash_mla_with_kvcache(c.q, c.k_cache, c.block_table, c.cache_seqlens, 512,
                                             flash_mla.get_mla_metadata()[0], None, 0.3, True)
    traces = []

    @jax.jit
    def step(q, k_cache, block_table, cache_seqlens):
        traces.append(1)
        sched, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, sched, None, 0.3, True)

    out, lse = step(to_jax(c.q), to_jax(c.k_cache), to_jax(c.block_table), to_jax(c.cache_seqlens))
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16 and out.shape == (3, 2, 16, 512)
    assert lse.dtype == jnp.float32 and lse.shape == (3, 16, 2)
    assert_same(eager, [out, lse])
    ref_out, ref_lse = oracle.dense_decode(c.q, c.k_cache, c.block_table, c.cache_seqlens, True, 0.3)
    check_out("out", np.asarray(out), ref_out, BF16)
    check_lse("lse", np.asarray(lse), ref_lse)

    # New length values reuse the compiled function (no retrace) and the schedule follows them.
    seqlens2 = (c.cache_seqlens // 2 + (c.cache_seqlens > 0)).astype(np.int32)  # same pages, new lengths
    out2, lse2 = step(to_jax(c.q), to_jax(c.k_cache), to_jax(c.block_table), to_jax(seqlens2))
    assert len(traces) == 1
    eager2 = flash_mla.flash_mla_with_kvcache(c.q, c.k_cache, c.block_table, seqlens2, 512,
                                              flash_mla.get_mla_metadata()[0], None, 0.3, True)
    assert_same(eager2, [out2, lse2])
    assert not np.array_equal(bits(out2), bits(out))


def test_sparse_decode_under_jit_all_optionals(rng):
    c = gen_sparse_decode_case(rng, b=2, s_q=2, h_q=16, d_qk=576, s_k=150, topk=64, pbs=64, have_topk_length=True,
                               extra=dict(s_k=90, topk=64, pbs=32, have_topk_length=True), noncontig=False)
    kw = c.kwargs()
    assert kw.get("extra_k_cache") is not None and kw.get("attn_sink") is not None
    eager = flash_mla.flash_mla_with_kvcache(c.q, c.main.packed, None, None, 512, flash_mla.get_mla_metadata()[0],
                                             **kw)
    names = [k for k, v in kw.items() if isinstance(v, np.ndarray)]
    flags = {k: v for k, v in kw.items() if not isinstance(v, np.ndarray)}

    @jax.jit
    def step(q, packed, *arrays):
        return flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512, flash_mla.get_mla_metadata()[0],
                                                **dict(zip(names, arrays)), **flags)

    out, lse = step(to_jax(c.q), to_jax(c.main.packed), *[to_jax(kw[n]) for n in names])
    assert_same(eager, [out, lse])
    ref_out, ref_lse = c.reference()
    check_out("out", np.asarray(out), ref_out, BF16)
    check_lse("lse", np.asarray(lse), ref_lse)


def test_sparse_prefill_under_jit(rng):
    c = gen_prefill_case(rng, s_q=5, s_kv=300, topk=128, h_q=16, d_qk=512, sink=True, have_topk_length=True)
    eager = flash_mla.flash_mla_sparse_fwd(c.q, c.kv, c.indices, c.sm_scale, attn_sink=c.attn_sink,
                                           topk_length=c.topk_length)
    step = jax.jit(lambda q, kv, idx, sink, tl: flash_mla.flash_mla_sparse_fwd(q, kv, idx, c.sm_scale,
                                                                               attn_sink=sink, topk_length=tl))
    res = step(*(to_jax(x) for x in (c.q, c.kv, c.indices, c.attn_sink, c.topk_length)))
    assert isinstance(res, list) and len(res) == 3 and all(isinstance(r, jax.Array) for r in res)
    assert_same(eager, res)
    ref_out, ref_max, ref_lse = c.reference()
    check_out("out", np.asarray(res[0]), ref_out, BF16)
    check_allclose("max_logits", np.asarray(res[1]), ref_max, dtype=np.float32, **LSE_TOL)
    check_allclose("lse", np.asarray(res[2]), ref_lse, dtype=np.float32, **LSE_TOL)


def test_jit_errors_name_the_argument(rng):
    c = gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=64)
    bad_seqlens = np.array([10, 9999], np.int32)  # needs more pages than block_table has
    step = jax.jit(lambda *a: flash_mla.flash_mla_with_kvcache(*a, 512, flash_mla.get_mla_metadata()[0]))
    with pytest.raises(Exception, match="block_table too short for cache_seqlens"):
        jax.block_until_ready(step(to_jax(c.q), to_jax(c.k_cache), to_jax(c.block_table), to_jax(bad_seqlens)))
    # Shape errors are raised at trace time, as the usual Python exceptions.
    with pytest.raises(ValueError, match="head_dim_v"):
        jax.jit(lambda q, k, bt, sl: flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 256,
                                                                      flash_mla.get_mla_metadata()[0]))(
            to_jax(c.q), to_jax(c.k_cache), to_jax(c.block_table), to_jax(c.cache_seqlens))


@pytest.mark.parametrize("good_first", [False, True], ids=["bad-first", "good-first"])
def test_jit_value_error_is_one_class(rng, good_first):
    """A value error of a running jitted call is jax.errors.JaxRuntimeError with the
    [flash_mla:ValueError] prefix, whatever ran before (JAX >= 0.7.2's C++ fast path would make it a
    builtin ValueError after a good first call: python/flash_mla/_jax.py), on every operator."""
    c = gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=64)
    p = gen_prefill_case(rng, s_q=3, s_kv=80, topk=16, h_q=16, d_qk=512, noncontig=False)
    s = gen_sparse_decode_case(rng, b=2, s_q=1, h_q=16, d_qk=576, s_k=100, topk=32, pbs=64, noncontig=False,
                               sink=False)
    dense = jax.jit(lambda q, k, bt, sl: flash_mla.flash_mla_with_kvcache(q, k, bt, sl, 512,
                                                                          flash_mla.get_mla_metadata()[0]))
    prefill = jax.jit(lambda q, kv, idx, tl: flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.5, topk_length=tl))
    sparse = jax.jit(lambda q, k, idx: flash_mla.flash_mla_with_kvcache(
        q, k, None, None, 512, flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True, indices=idx))
    bad_idx = np.array(s.main.indices)
    bad_idx[1, 0, 0] = 10 ** 9  # past the cache
    calls = [  # (jitted function, good arguments, bad arguments, message)
        (dense, (c.q, c.k_cache, c.block_table, c.cache_seqlens), (c.q, c.k_cache, c.block_table,
                                                                   np.array([10, 9999], np.int32)),
         "block_table too short for cache_seqlens"),
        (prefill, (p.q, p.kv, p.indices, np.full(3, 16, np.int32)), (p.q, p.kv, p.indices, np.full(3, -1, np.int32)),
         "topk_length"),
        (sparse, (s.q, s.main.packed, s.main.indices), (s.q, s.main.packed, bad_idx), "indices"),
    ]
    for fn, good, bad, msg in calls:
        if good_first:
            jax.block_until_ready(fn(*map(to_jax, good)))
        for _ in range(2):
            with pytest.raises(jax.errors.JaxRuntimeError, match=rf"\[flash_mla:ValueError\] .*{msg}"):
                jax.block_until_ready(fn(*map(to_jax, bad)))


@pytest.mark.parametrize("arg", ["max_seqlen_qo", "softmax_scale", "causal", "head_dim_v", "sm_scale"])
def test_traced_scalar_arguments_say_to_make_them_static(rng, arg):
    """Scalar arguments are static (they shape the call or are attributes of the custom call): a traced one
    (jax.jit of a function taking it as an argument) is a TypeError naming it and saying how to pass it, not
    "expected an int, got DynamicJaxprTracer" or JAX's TracerBoolConversionError, which names no argument."""
    q = to_jax(np.zeros((4, 2, 128), BF16))
    cu = to_jax(np.array([0, 4], np.int32))
    c = gen_dense_case(rng, b=1, s_q=1, h_q=16, h_kv=1, d=576, s_k=64)
    p = gen_prefill_case(rng, s_q=2, s_kv=40, topk=16, h_q=16, d_qk=512, noncontig=False)
    calls = {
        "max_seqlen_qo": (lambda x: flash_mla.flash_attn_varlen_func(q, q, q, cu, cu, x, 4), 4),
        "softmax_scale": (lambda x: flash_mla.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, softmax_scale=x), 0.5),
        "causal": (lambda x: flash_mla.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=x), True),
        "head_dim_v": (lambda x: flash_mla.flash_mla_with_kvcache(to_jax(c.q), to_jax(c.k_cache), to_jax(c.block_table),
                                                                  to_jax(c.cache_seqlens), x,
                                                                  flash_mla.get_mla_metadata()[0]), 512),
        "sm_scale": (lambda x: flash_mla.flash_mla_sparse_fwd(to_jax(p.q), to_jax(p.kv), to_jax(p.indices), x), 0.5),
    }
    fn, value = calls[arg]
    jax.block_until_ready(jax.jit(fn, static_argnums=0)(value))  # static: fine
    with pytest.raises(TypeError, match=rf"^{arg}: expected a Python (int|float|bool), got a traced JAX value .*"
                                        r"static_argnums"):
        jax.jit(fn)(value)


_SHARDED_EAGER = r'''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
import flash_mla
from mla_test_utils import gen_dense_case
c = gen_dense_case(np.random.default_rng(0), b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=100, poison="nan")
q = jax.device_put(jnp.asarray(c.q), NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x")))
assert len(q.devices()) == 2
out, lse = flash_mla.flash_mla_with_kvcache(q, jnp.asarray(c.k_cache), jnp.asarray(c.block_table),
                                            jnp.asarray(c.cache_seqlens), 512, flash_mla.get_mla_metadata()[0], None,
                                            softmax_scale=c.softmax_scale)
ref = flash_mla.flash_mla_with_kvcache(np.asarray(c.q), c.k_cache, c.block_table, c.cache_seqlens, 512,
                                       flash_mla.get_mla_metadata()[0], None, softmax_scale=c.softmax_scale)
np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(ref[0]).view(np.uint16))
np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref[1]))
print("sharded ok")
'''


def test_eager_call_with_a_sharded_jax_array():
    """A q sharded over two host devices (no single DLPack device) works eagerly, equal to NumPy's call.
    In a subprocess: the host device count must be set before JAX starts."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _SHARDED_EAGER, here], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sharded ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
