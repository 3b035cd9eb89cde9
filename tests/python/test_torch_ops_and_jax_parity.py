"""The torch.ops.flash_mla and JAX custom-call ways in against the NumPy (TVM-FFI) one: the same error
class and message for bad input (eager and under jax.jit), outputs that never require grad, opcheck,
scheduler objects shared across frameworks, jax.vmap, and the edge cases that broke published MLA kernels (empty
requests, NaN / Inf in unused pages, scattered block tables with sentinels, s_q > 1 causal with rows that see no key,
small tensor-parallel head counts, invalid sparse indices) re-run through torch.ops and jax.jit, bit-compared with
the NumPy path. CPU only; tests skip cleanly without torch / jax /
jax_tvm_ffi (or without the op library).
"""

import warnings

import numpy as np
import pytest

import flash_mla
import oracle
from mla_test_utils import (BF16, check_lse, check_out, gen_dense_case, gen_prefill_case,
                            gen_sparse_decode_case)


# ----------------------------------------------------------------------------- helpers
def _torch():
    torch = pytest.importorskip("torch")
    from flash_mla import _torch_ops

    if not _torch_ops.available():
        pytest.skip(f"torch.ops.flash_mla unavailable: {_torch_ops.load_error()}")
    return torch


def _jax():
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    return jax


def T(x):
    """NumPy -> torch (CPU), keeping strides; None / scalars pass through."""
    torch = _torch()
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def J(x):
    if not isinstance(x, np.ndarray):
        return x
    jax = _jax()
    return jax.device_put(np.ascontiguousarray(x), jax.devices("cpu")[0])


def bits(x):
    x = np.asarray(x.detach() if hasattr(x, "detach") else x)
    if str(x.dtype) in ("bfloat16", "torch.bfloat16"):
        return x.view(np.uint16)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def tbits(t):
    """torch tensor -> NumPy bits."""
    torch = _torch()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return bits(t.numpy())


def dense(q, kc, bt, sl, **kw):
    sched, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, kw.pop("head_dim_v", 512), sched, **kw)


def sparse(q, k_cache, **kw):
    sched, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, kw.pop("head_dim_v", 512), sched, **kw)


def prefill(q, kv, indices, sm_scale, **kw):
    return flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, **kw)


def outcome(fn):
    """(class name, message) of the exception fn raises (fn must raise)."""
    with pytest.raises(Exception) as ei:
        r = fn()
        for x in r:  # let any deferred (async) error surface
            np.asarray(x)
    return type(ei.value).__name__, str(ei.value)


def _dense_np(rng, b=2):
    q = (rng.standard_normal((b, 1, 16, 576)) / 10).astype(BF16)
    kc = (rng.standard_normal((4 * b, 64, 1, 576)) / 10).astype(BF16)
    bt = np.arange(4 * b, dtype=np.int32).reshape(b, 4)
    sl = np.array([200, 100, 7, 0][:b], np.int32)
    return dict(q=q, kc=kc, bt=bt, sl=sl)


def _run_jit(fn, arrays, rest):
    jax = _jax()
    return jax.jit(lambda **kw: fn(**kw, **rest))(**{k: J(v) for k, v in arrays.items()})


# ----------------------------------------------------------------------------- 1. JAX error classes
# README: "Errors raised by the public functions are the same classes and messages on both
# paths"; with JAX arrays every shape/dtype error of the core came out as
# `jax.errors.JaxRuntimeError: INTERNAL: <message>` (a RuntimeError), eager and under jax.jit, and a few
# Python-side pre-checks of _jax.py had their own messages (b = 0, h_kv = 0, h_q % h_kv).

_DENSE_BAD = {
    "q float32": dict(q=lambda d: d["q"].astype(np.float32)),
    "q float16, cache bf16": dict(q=lambda d: d["q"].astype(np.float16)),
    "cache_seqlens bool": dict(sl=lambda d: d["sl"] > 0),
    "cache_seqlens uint32": dict(sl=lambda d: d["sl"].astype(np.uint32)),
    "cache_seqlens 2-D": dict(sl=lambda d: d["sl"][None]),
    "block_table wrong b": dict(bt=lambda d: d["bt"][:1]),
    "b = 0": dict(q=lambda d: d["q"][:0], bt=lambda d: d["bt"][:0], sl=lambda d: d["sl"][:0]),
    "s_q = 0": dict(q=lambda d: d["q"][:, :0]),
    "d_qk 100": dict(q=lambda d: d["q"][..., :100], kc=lambda d: d["kc"][..., :100]),
    "cache d 512 vs q 576": dict(kc=lambda d: d["kc"][..., :512]),
    "h_kv = 0": dict(kc=lambda d: d["kc"][:, :, :0]),
    "h_kv = 3": dict(kc=lambda d: np.repeat(d["kc"], 3, 2)),
    "page_block_size 0": dict(kc=lambda d: d["kc"][:, :0]),
    "softmax_scale nan": dict(softmax_scale=float("nan")),
    "head_dim_v 256": dict(head_dim_v=256),
}


def _dense_variant(rng, name):
    d = _dense_np(rng)
    kw = {}
    for k, f in _DENSE_BAD[name].items():
        if callable(f):
            d[k] = f(d)
        else:
            kw[k] = f
    return d, kw


@pytest.mark.parametrize("name", list(_DENSE_BAD))
def test_dense_errors_same_on_jax_eager_and_jit(rng, name):
    _jax()
    d, kw = _dense_variant(rng, name)
    want = outcome(lambda: dense(d["q"], d["kc"], d["bt"], d["sl"], **kw))
    assert want[0] in ("ValueError", "TypeError"), want
    assert outcome(lambda: dense(*(J(d[k]) for k in ("q", "kc", "bt", "sl")), **kw)) == want
    assert outcome(lambda: _run_jit(lambda q, kc, bt, sl: dense(q, kc, bt, sl, **kw), d, {})) == want


@pytest.mark.parametrize("name", ["q float32", "cache_seqlens bool", "cache_seqlens uint32", "h_kv = 3"])
def test_dense_errors_same_on_torch_ops(rng, name):
    """The same messages on torch.ops, dtype names included (the torch op library once said `UInt32`
    where TVM-FFI says `uint32`, and TVM-FFI `bool8` where torch says `bool`)."""
    _torch()
    d, kw = _dense_variant(rng, name)
    want = outcome(lambda: dense(d["q"], d["kc"], d["bt"], d["sl"], **kw))
    assert outcome(lambda: dense(*(T(d[k]) for k in ("q", "kc", "bt", "sl")), **kw)) == want


def _sparse_case(rng):
    return gen_sparse_decode_case(rng, b=2, s_q=1, h_q=16, d_qk=576, s_k=100, topk=64, pbs=64,
                                  have_topk_length=True, extra=dict(s_k=50, topk=32, pbs=32, have_topk_length=True),
                                  noncontig=False)


_SPARSE_BAD = {
    "indices 2-D": lambda kw: dict(indices=kw["indices"][0]),
    "topk 0": lambda kw: dict(indices=kw["indices"][..., :0]),
    "topk_length float32": lambda kw: dict(topk_length=kw["topk_length"].astype(np.float32)),
    "attn_sink float16": lambda kw: dict(attn_sink=kw["attn_sink"].astype(np.float16)),
    "attn_sink wrong h": lambda kw: dict(attn_sink=kw["attn_sink"][:3]),
    "k_cache bf16": lambda kw: dict(k_cache=kw["k_cache"].view(BF16)),
    "k_cache 600 bytes": lambda kw: dict(k_cache=kw["k_cache"][..., :600]),
    "extra cache without indices": lambda kw: dict(extra_indices_in_kvcache=None),
    "extra indices without cache": lambda kw: dict(extra_k_cache=None),
    "q float16": lambda kw: dict(q=kw["q"].astype(np.float16)),
    "q d_qk 512 with a V32 cache": lambda kw: dict(q=kw["q"][..., :512]),
}


@pytest.mark.parametrize("name", list(_SPARSE_BAD))
def test_sparse_decode_errors_same_on_jax_eager_and_jit(rng, name):
    _jax()
    c = _sparse_case(rng)
    kw = dict(q=c.q, k_cache=c.main.packed, **c.kwargs())
    kw.update(_SPARSE_BAD[name](kw))
    want = outcome(lambda: sparse(**kw))
    assert want[0] in ("ValueError", "TypeError"), want
    assert outcome(lambda: sparse(**{k: J(v) for k, v in kw.items()})) == want
    arrays = {k: v for k, v in kw.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in kw.items() if not isinstance(v, np.ndarray)}
    assert outcome(lambda: _run_jit(sparse, arrays, rest)) == want


def _prefill_case(rng):
    return gen_prefill_case(rng, s_q=3, s_kv=50, topk=64, h_q=16, d_qk=576, sink=True, have_topk_length=True,
                            noncontig=False)


_PREFILL_BAD = {
    "indices 2-D": lambda p: dict(indices=p.indices[:, 0]),
    "indices h_kv 2": lambda p: dict(indices=np.repeat(p.indices, 2, 1)),
    "kv float16": lambda p: dict(kv=p.kv.astype(np.float16)),
    "q 4-D": lambda p: dict(q=p.q[None]),
    "kv h_kv 2": lambda p: dict(kv=np.repeat(p.kv, 2, 1)),
    "d_v 256": lambda p: dict(d_v=256),
    "topk_length wrong s_q": lambda p: dict(topk_length=p.topk_length[:1]),
    "attn_sink int32": lambda p: dict(attn_sink=np.zeros(16, np.int32)),
    "sm_scale nan": lambda p: dict(sm_scale=float("nan")),
}


@pytest.mark.parametrize("name", list(_PREFILL_BAD))
def test_sparse_prefill_errors_same_on_jax_eager_and_jit(rng, name):
    _jax()
    p = _prefill_case(rng)
    kw = dict(q=p.q, kv=p.kv, indices=p.indices, sm_scale=p.sm_scale, attn_sink=p.attn_sink,
              topk_length=p.topk_length)
    kw.update(_PREFILL_BAD[name](p))
    want = outcome(lambda: prefill(**kw))
    assert want[0] in ("ValueError", "TypeError"), want
    assert outcome(lambda: prefill(**{k: J(v) for k, v in kw.items()})) == want
    arrays = {k: v for k, v in kw.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in kw.items() if not isinstance(v, np.ndarray)}
    assert outcome(lambda: _run_jit(prefill, arrays, rest)) == want


def test_jax_value_errors_eager_same_class_jit_names_class(rng):
    """Value errors (negative lengths, pages out of range) are found when the call runs.
    Eager they now raise the NumPy path's class and message (before: 'INTERNAL: ...' text, class varying);
    under jax.jit they can only surface as XLA's runtime error, whose message names the class."""
    jax = _jax()
    d = _dense_np(rng)
    d["sl"] = np.array([-1, 5], np.int32)
    want = outcome(lambda: dense(d["q"], d["kc"], d["bt"], d["sl"]))
    assert want == ("ValueError", "cache_seqlens[0] = -1 is negative")
    assert outcome(lambda: dense(*(J(d[k]) for k in ("q", "kc", "bt", "sl")))) == want
    cls, msg = outcome(lambda: _run_jit(lambda q, kc, bt, sl: dense(q, kc, bt, sl), d, {}))
    assert "[flash_mla:ValueError] cache_seqlens[0] = -1 is negative" in msg
    assert issubclass(getattr(jax.errors, cls, RuntimeError), RuntimeError)


# ----------------------------------------------------------------------------- 2. autograd
def test_torch_outputs_do_not_require_grad(rng):
    """With q.requires_grad, torch.ops outputs had requires_grad=True and a grad_fn; a
    backward through them only warned ('autograd kernel was not registered ... silently incorrect') and
    left q.grad None, i.e. silently no gradient. The TVM-FFI path (FLASHMLA_DISABLE_TORCH_OPS=1) returned
    non-differentiable outputs, as FlashMLA's ops do. Now the public functions agree on every path: outputs
    never require grad, also for a direct torch.ops.flash_mla call."""
    torch = _torch()
    d = _dense_np(rng)
    q = T(d["q"]).clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = dense(q, T(d["kc"]), T(d["bt"]), T(d["sl"]))
        assert not out.requires_grad and not lse.requires_grad
        direct = torch.ops.flash_mla.dense_decode_fwd(q, T(d["kc"]), 512, T(d["sl"]), T(d["bt"]), 0.1, False)
        assert not any(t.requires_grad for t in direct)
        p = _prefill_case(rng)
        res = prefill(T(p.q).clone().requires_grad_(), T(p.kv).clone().requires_grad_(), T(p.indices), 0.5,
                      attn_sink=T(p.attn_sink).clone().requires_grad_())
        assert not any(t.requires_grad for t in res)
        c = _sparse_case(rng)
        kw = {k: T(v) for k, v in c.kwargs().items()}
        kw["attn_sink"] = kw["attn_sink"].clone().requires_grad_()
        res = sparse(T(c.q).clone().requires_grad_(), T(c.main.packed), **kw)
        assert not any(t.requires_grad for t in res)
    ref = dense(*(T(d[k]) for k in ("q", "kc", "bt", "sl")))
    np.testing.assert_array_equal(tbits(out), tbits(ref[0]))


def test_torch_opcheck_with_requires_grad_and_strided_inputs(rng):
    torch = _torch()
    b = 3
    base = torch.randn(b, 2, 16, 1152, dtype=torch.bfloat16) / 10
    q = base[..., 100:676].clone().requires_grad_()
    kc = (torch.randn(12, 64, 1, 600, dtype=torch.bfloat16) / 10)[..., 10:586]
    bt = torch.arange(24, dtype=torch.int32).reshape(b * 2, 4)[::2]
    sl = torch.tensor([0, 130, 0], dtype=torch.int32)
    torch.library.opcheck(torch.ops.flash_mla.dense_decode_fwd.default, (q, kc, 512, sl, bt, 0.1, True))


# ----------------------------------------------------------------------------- 3. FlashMLASchedMeta across paths
def test_sched_meta_reused_from_numpy_to_torch(rng):
    """A FlashMLASchedMeta filled by a NumPy call and reused by a torch call (same shapes,
    same lengths: legal per spec §1.2) crashed with torch's 'Expected a value of type Optional[Tensor] ...
    found type ndarray' RuntimeError."""
    torch = _torch()
    d = _dense_np(rng)
    sched, _ = flash_mla.get_mla_metadata()
    a = flash_mla.flash_mla_with_kvcache(d["q"], d["kc"], d["bt"], d["sl"], 512, sched)
    b = flash_mla.flash_mla_with_kvcache(*(T(d[k]) for k in ("q", "kc", "bt", "sl")), 512, sched)
    assert isinstance(b[0], torch.Tensor)
    np.testing.assert_array_equal(tbits(b[0]), bits(a[0]))
    c = flash_mla.flash_mla_with_kvcache(d["q"], d["kc"], d["bt"], d["sl"], 512, sched)
    np.testing.assert_array_equal(bits(c[0]), bits(a[0]))
    with pytest.raises(flash_mla.SchedMetaMismatchError):
        flash_mla.flash_mla_with_kvcache(T(d["q"]), T(d["kc"]), T(d["bt"]), T(d["sl"] + 1), 512, sched)


def test_sched_meta_first_filled_by_jax_still_checks_cpu_lengths(rng):
    """A FlashMLASchedMeta first used by a JAX call (which cannot read lengths) never checked
    lengths again: reused on the CPU through NumPy with changed cache_seqlens it was silently accepted
    (README: 'for lengths on the CPU, a changed value raises SchedMetaMismatchError')."""
    _jax()
    d = _dense_np(rng)
    sched, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(*(J(d[k]) for k in ("q", "kc", "bt", "sl")), 512, sched)
    flash_mla.flash_mla_with_kvcache(d["q"], d["kc"], d["bt"], d["sl"], 512, sched)
    with pytest.raises(flash_mla.SchedMetaMismatchError):
        flash_mla.flash_mla_with_kvcache(d["q"], d["kc"], d["bt"], d["sl"] + 1, 512, sched)


# ----------------------------------------------------------------------------- 4. jax.vmap
def test_jax_vmap_dense_decode_and_prefill(rng):
    """jax.vmap of a call failed with JAX's generic 'vmap is only supported for the ffi_call
    primitive when vmap_method is ...' NotImplementedError. The calls are now mapped sequentially."""
    jax = _jax()
    d = _dense_np(rng)
    qs = np.stack([d["q"], (d["q"].astype(np.float32) * 2).astype(BF16), d["q"][:, :, ::-1]])
    lens = np.stack([d["sl"], d["sl"] // 2, d["sl"] * 0])
    kc, bt = J(d["kc"]), J(d["bt"])
    for f in (jax.vmap(lambda q, sl: dense(q, kc, bt, sl)), jax.jit(jax.vmap(lambda q, sl: dense(q, kc, bt, sl)))):
        out, lse = f(J(qs), J(lens))
        assert out.shape == (3, 2, 1, 16, 512) and lse.shape == (3, 2, 16, 1)
        for i in range(3):
            ref = dense(np.ascontiguousarray(qs[i]), d["kc"], d["bt"], lens[i])
            np.testing.assert_array_equal(bits(out[i]), bits(ref[0]))
            np.testing.assert_array_equal(bits(lse[i]), bits(ref[1]))
    p = _prefill_case(rng)
    qp = np.stack([p.q, p.q[:, ::-1]])
    res = jax.vmap(lambda q: prefill(q, J(p.kv), J(p.indices), 0.5))(J(qp))
    for i in range(2):
        ref = prefill(np.ascontiguousarray(qp[i]), p.kv, p.indices, 0.5)
        for a, r in zip(res, ref):
            np.testing.assert_array_equal(bits(a[i]), bits(r))


# ----------------------------------------------------------------------------- 5. edge cases via torch.ops / JAX jit
_DENSE_EDGE_CASES = {
    "all requests empty": dict(b=3, s_q=1, h_q=16, lens=[0, 0, 0]),
    "first and last empty, NaN/Inf pages, sentinel": dict(b=4, s_q=1, h_q=16, lens=[0, 70, 129, 0]),
    "s_q 4 causal, a row sees no key": dict(b=2, s_q=4, h_q=16, lens=[2, 100], causal=True),
    "h_q 8, h_q*s_q < 64": dict(b=2, s_q=2, h_q=8, lens=[65, 3]),
    "h_q 128": dict(b=1, s_q=1, h_q=128, lens=[190]),
}


@pytest.mark.parametrize("path", ["torch_ops", "jax_jit"])
@pytest.mark.parametrize("name", list(_DENSE_EDGE_CASES))
def test_dense_decode_edge_cases_through_torch_ops_and_jax_jit(rng, name, path):
    """Empty requests (out 0, lse +inf, no NaN), NaN / Inf in unused page slots and pages and a huge sentinel in
    unused block-table entries, s_q > 1 causal with a row that sees no key, small and large head counts: the same
    bits through torch.ops / jax.jit as through the NumPy path, which matches the oracle."""
    cfg = dict(_DENSE_EDGE_CASES[name])
    causal = cfg.pop("causal", False)
    c = gen_dense_case(rng, h_kv=1, d=576, s_k=100, causal=causal, poison="mixed", noncontig=True, **cfg)
    ref = dense(c.q, c.k_cache, c.block_table, c.cache_seqlens, causal=causal)
    if path == "torch_ops":
        _torch()
        got = dense(*(T(x) for x in (c.q, c.k_cache, c.block_table, c.cache_seqlens)), causal=causal)
        got = [tbits(t) for t in got]
    else:
        got = _run_jit(lambda q, kc, bt, sl: dense(q, kc, bt, sl, causal=causal),
                       dict(q=c.q, kc=c.k_cache, bt=c.block_table, sl=c.cache_seqlens), {})
        got = [bits(x) for x in got]
    np.testing.assert_array_equal(got[0], bits(ref[0]))
    np.testing.assert_array_equal(got[1], bits(ref[1]))
    o_ref, l_ref = oracle.dense_decode(c.q, c.k_cache, c.block_table, c.cache_seqlens, causal, None)
    check_out("out", ref[0], o_ref, BF16)
    check_lse("lse", ref[1], l_ref)
    empty = np.asarray(c.cache_seqlens) == 0
    assert np.all(np.asarray(ref[1])[empty] == np.inf) and not np.isnan(ref[0].astype(np.float32)).any()


@pytest.mark.parametrize("path", ["torch_ops", "jax_jit"])
def test_sparse_invalid_indices_through_torch_ops_and_jax_jit(rng, path):
    """Sparse indices: -1 entries, a whole row of -1, topk not a multiple of 64, topk_length < topk with
    garbage beyond it, empty requests; prefill with negative / >= s_kv indices."""
    c = gen_sparse_decode_case(rng, b=3, s_q=2, h_q=16, d_qk=512, s_k=90, topk=40, pbs=32, have_topk_length=True,
                               invalid_frac=0.3, zero=[False, True, False], noncontig=True,
                               extra=dict(s_k=40, topk=24, pbs=16, have_topk_length=True))
    c.main.indices[0, 1] = -1  # a whole row of -1 (the oracle reads the same array)
    kw = dict(q=c.q, k_cache=c.main.packed, **c.kwargs())
    p = gen_prefill_case(rng, s_q=4, s_kv=70, topk=100, h_q=16, d_qk=576, sink=True, have_topk_length=True,
                         invalid_frac=0.3, all_invalid_frac=0.3)
    pkw = dict(q=p.q, kv=p.kv, indices=p.indices, sm_scale=p.sm_scale, attn_sink=p.attn_sink,
               topk_length=p.topk_length)
    ref, pref = sparse(**kw), prefill(**pkw)
    if path == "torch_ops":
        _torch()
        got = [tbits(t) for t in sparse(**{k: T(v) for k, v in kw.items()})]
        pgot = [tbits(t) for t in prefill(**{k: T(v) for k, v in pkw.items()})]
    else:
        arrays = {k: v for k, v in kw.items() if isinstance(v, np.ndarray)}
        got = [bits(x) for x in _run_jit(sparse, arrays, {k: v for k, v in kw.items() if k not in arrays})]
        parrays = {k: v for k, v in pkw.items() if isinstance(v, np.ndarray)}
        pgot = [bits(x) for x in _run_jit(prefill, parrays, {"sm_scale": p.sm_scale})]
    for a, r in zip(got, ref):
        np.testing.assert_array_equal(a, bits(r))
    for a, r in zip(pgot, pref):
        np.testing.assert_array_equal(a, bits(r))
    o_ref, l_ref = c.reference()
    check_out("out", ref[0], o_ref, BF16)
    check_lse("lse", ref[1], l_ref)


# ----------------------------------------------------------------------------- 6. mixed frameworks with a JAX q
def test_jax_q_with_torch_cache(rng):
    """README: arguments that mix frameworks take the DLPack (TVM-FFI) path and results
    come back in q's framework. A concrete JAX q with torch k_cache / block_table / cache_seqlens was sent
    to the XLA custom call and failed inside JAX with an error about the torch value not being a JAX type
    (torch q with a JAX cache worked). Now a concrete mixed call takes the DLPack path; inside jax.jit a
    non-JAX tensor raises a TypeError naming the argument."""
    torch = _torch()
    jax = _jax()
    d = _dense_np(rng)
    ref = dense(d["q"], d["kc"], d["bt"], d["sl"])
    out, lse = dense(J(d["q"]), T(d["kc"]), T(d["bt"]), T(d["sl"]))
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    np.testing.assert_array_equal(bits(out), bits(ref[0]))
    np.testing.assert_array_equal(bits(lse), bits(ref[1]))
    p = _prefill_case(rng)
    pref = prefill(p.q, p.kv, p.indices, 0.5)
    pres = prefill(J(p.q), T(p.kv), J(p.indices), 0.5)
    for a, r in zip(pres, pref):
        assert isinstance(a, jax.Array)
        np.testing.assert_array_equal(bits(a), bits(r))
    kc, bt, sl = T(d["kc"]), T(d["bt"]), T(d["sl"])
    with pytest.raises(TypeError, match="^k_cache: expected a JAX or NumPy array inside a JAX transformation"):
        jax.jit(lambda q: dense(q, kc, bt, sl))(J(d["q"]))
    assert isinstance(torch.zeros(1), torch.Tensor)


# ----------------------------------------------------------------------------- 7. scalar arguments
@pytest.mark.parametrize("fw", ["numpy", "torch", "jax"])
def test_bad_scalar_arguments_name_the_argument(rng, fw):
    """head_dim_v=None / softmax_scale='x' / d_v=None raised bare `int() argument must be ...`
    / `could not convert string to float` errors that do not name the argument."""
    conv = {"numpy": lambda x: x, "torch": lambda x: (_torch(), T(x))[1], "jax": lambda x: (_jax(), J(x))[1]}[fw]
    d = {k: conv(v) for k, v in _dense_np(rng).items()}
    with pytest.raises(TypeError, match="^head_dim_v: expected an int, got NoneType"):
        dense(d["q"], d["kc"], d["bt"], d["sl"], head_dim_v=None)
    with pytest.raises(TypeError, match="^softmax_scale: expected a float, got str"):
        dense(d["q"], d["kc"], d["bt"], d["sl"], softmax_scale="x")
    p = _prefill_case(rng)
    with pytest.raises(TypeError, match="^d_v: expected an int, got NoneType"):
        prefill(conv(p.q), conv(p.kv), conv(p.indices), 0.5, d_v=None)


def test_jax_call_with_numpy_int64_lengths_is_rejected(rng):
    """With a JAX q, NumPy int64 block_table / cache_seqlens were silently narrowed to int32 by
    JAX (x64 off), where every other path raises TypeError (values >= 2^31 would wrap to other pages)."""
    jax = _jax()
    d = _dense_np(rng)
    bt64, sl64 = d["bt"].astype(np.int64), d["sl"].astype(np.int64)
    want = outcome(lambda: dense(d["q"], d["kc"], d["bt"], sl64))
    assert want == ("TypeError", "cache_seqlens: expected dtype int32, got int64")
    assert outcome(lambda: dense(J(d["q"]), J(d["kc"]), J(d["bt"]), sl64)) == want
    assert outcome(lambda: jax.jit(lambda q: dense(q, J(d["kc"]), bt64, J(d["sl"])))(J(d["q"])))[0] == "TypeError"
