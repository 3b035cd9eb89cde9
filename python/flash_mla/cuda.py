"""``flash_mla.cuda`` — FlashMLA's native-module entry points (spec §1.1), for programs that call them.

FlashMLA's Python wrappers call a pybind11 module ``flash_mla.cuda`` with five functions; some
programs call those directly. Here they are the ``torch.ops.flash_mla`` ops (the stable-ABI op
library, ``flash_mla/_torch_ops.py``), with FlashMLA's argument order and return values:

* ``dense_decode_fwd(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
  tile_scheduler_metadata, num_splits) -> [out, lse, tile_scheduler_metadata, num_splits]``
* ``sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
  extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale)
  -> [out, lse, tile_scheduler_metadata, num_splits]``
* ``sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length) -> [out, max_logits, lse]``
* ``dense_prefill_fwd(workspace, q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, mask_mode_code, softmax_scale,
  max_seqlen_q, max_seqlen_kv, is_varlen) -> None`` and ``dense_prefill_bwd(workspace, dout, q, k, v, out, lse,
  cu_seqlens_q, cu_seqlens_kv, dq, dk, dv, mask_mode_code, softmax_scale, max_seqlen_q, max_seqlen_kv, is_varlen)
  -> None``: write into the given tensors, as FlashMLA's; ``mask_mode_code`` 1 = causal, 0 = none;
  ``workspace`` is not used (the ops allocate what they need; FlashMLA's callers size it for its
  own kernels). GQA works in the backward too. The destinations get the results' shapes and dtypes, and
  must not overlap each other or themselves (the same tensor as dk and dv, an expanded / stride-0 lse:
  ValueError naming them, nothing written); disjoint views of one buffer, as FlashMLA's kvpacked
  gradient ``dk = dkv[:, 0]``, ``dv = dkv[:, 1]``, are fine.

Shapes, dtypes and conventions are those of :func:`flash_mla.flash_mla_with_kvcache` and
:func:`flash_mla.flash_mla_sparse_fwd`; ``tile_scheduler_metadata`` / ``num_splits`` may be None
(computed and returned) or the tensors a previous call returned (then returned again, as FlashMLA's
wrapper stores whatever comes back). Tensors must be torch tensors
(CPU: the reference backend; CUDA: the sm90 kernels). Bad input raises the same TypeError /
ValueError (naming the argument) as the public functions. Importing this module without torch or
without the op library raises ImportError.
"""

from __future__ import annotations

from typing import Any, List

from . import _torch_ops
from .flash_mla_interface import (_bool_arg, _check_destinations, _dense_prefill_args, _float_arg, _int_arg,
                                  call_naming_seqlens)

if not _torch_ops.available():
    raise ImportError(f"flash_mla.cuda needs PyTorch and torch.ops.flash_mla: {_torch_ops.load_error()}")


def _with_metadata(res: Any, tile_scheduler_metadata: Any, num_splits: Any) -> List[Any]:
    """[out, lse, tile_scheduler_metadata, num_splits]: given metadata is handed back, as FlashMLA does (its
    wrapper stores what comes back); the ops never return it (no aliasing): the *_scheduled ops return
    (out, lse) only, the others the schedule they computed."""
    res = list(res)
    if len(res) == 2:
        return res + [tile_scheduler_metadata, num_splits]
    if tile_scheduler_metadata is not None:
        res[2] = tile_scheduler_metadata
    if num_splits is not None:
        res[3] = num_splits
    return res


def _require_torch(**tensors: Any) -> None:
    import torch

    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _optional_torch(**tensors: Any) -> None:
    """TypeError naming the first optional tensor argument that is neither None nor a torch.Tensor (the op's
    dispatcher would raise a RuntimeError for it)."""
    import torch

    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")


def dense_decode_fwd(q: Any, k_cache: Any, head_dim_v: int, cache_seqlens: Any, block_table: Any,
                     softmax_scale: float, causal: bool, tile_scheduler_metadata: Any = None,
                     num_splits: Any = None) -> List[Any]:
    """Dense MLA decode (FlashMLA's ``flash_mla.cuda.dense_decode_fwd``); see the module docstring."""
    _require_torch(q=q, k_cache=k_cache, cache_seqlens=cache_seqlens, block_table=block_table)
    _optional_torch(tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits)
    op = (_torch_ops.dense_decode_fwd_scheduled if tile_scheduler_metadata is not None and num_splits is not None
          else _torch_ops.dense_decode_fwd)
    res = op(q, k_cache, _int_arg("head_dim_v", head_dim_v), cache_seqlens, block_table,
             _float_arg("softmax_scale", softmax_scale), _bool_arg("causal", causal), tile_scheduler_metadata,
             num_splits)
    return _with_metadata(res, tile_scheduler_metadata, num_splits)


def sparse_decode_fwd(q: Any, k_cache: Any, indices: Any, topk_length: Any, attn_sink: Any,
                      tile_scheduler_metadata: Any, num_splits: Any, extra_k_cache: Any,
                      extra_indices_in_kvcache: Any, extra_topk_length: Any, head_dim_v: int,
                      softmax_scale: float) -> List[Any]:
    """Sparse FP8 MLA decode (FlashMLA's ``flash_mla.cuda.sparse_decode_fwd``); see the module docstring."""
    _require_torch(q=q, k_cache=k_cache, indices=indices)
    _optional_torch(topk_length=topk_length, attn_sink=attn_sink, tile_scheduler_metadata=tile_scheduler_metadata,
                    num_splits=num_splits, extra_k_cache=extra_k_cache,
                    extra_indices_in_kvcache=extra_indices_in_kvcache, extra_topk_length=extra_topk_length)
    op = (_torch_ops.sparse_decode_fwd_scheduled if tile_scheduler_metadata is not None and num_splits is not None
          else _torch_ops.sparse_decode_fwd)
    res = op(q, k_cache, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits, extra_k_cache,
             extra_indices_in_kvcache, extra_topk_length, _int_arg("head_dim_v", head_dim_v),
             _float_arg("softmax_scale", softmax_scale))
    return _with_metadata(res, tile_scheduler_metadata, num_splits)


def sparse_prefill_fwd(q: Any, kv: Any, indices: Any, sm_scale: float, d_v: int = 512, attn_sink: Any = None,
                       topk_length: Any = None) -> List[Any]:
    """Sparse MLA prefill (FlashMLA's ``flash_mla.cuda.sparse_prefill_fwd``); see the module docstring."""
    _require_torch(q=q, kv=kv, indices=indices)
    _optional_torch(attn_sink=attn_sink, topk_length=topk_length)
    return list(_torch_ops.sparse_prefill_fwd(q, kv, indices, _float_arg("sm_scale", sm_scale), _int_arg("d_v", d_v),
                                              attn_sink, topk_length))


# The names of the packed-sequence arguments here (FlashMLA's extension's): errors name them so.
_SEQLEN_NAMES = ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")


def _mask_mode(mask_mode_code: Any) -> bool:
    code = _int_arg("mask_mode_code", mask_mode_code)
    if code not in (0, 1):
        raise ValueError(f"mask_mode_code: expected 0 (no mask) or 1 (causal), got {code}")
    return code == 1


def dense_prefill_fwd(workspace: Any, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any, out: Any,
                      lse: Any, mask_mode_code: int, softmax_scale: float, max_seqlen_q: int, max_seqlen_kv: int,
                      is_varlen: bool) -> None:
    """Dense MHA prefill forward into ``out`` ``(total_q, h_q, d_v)`` and ``lse`` ``(total_q, h_q)`` float32
    (FlashMLA's ``flash_mla.cuda.dense_prefill_fwd``); see the module docstring."""
    call_naming_seqlens(_SEQLEN_NAMES, _dense_prefill_fwd, workspace, q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse,
                        mask_mode_code, softmax_scale, max_seqlen_q, max_seqlen_kv, is_varlen)


def _dense_prefill_fwd(workspace, q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, mask_mode_code, softmax_scale,
                       max_seqlen_q, max_seqlen_kv, is_varlen):
    _require_torch(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, out=out, lse=lse)
    cu_q, cu_k, max_q, max_k, scale, causal = _dense_prefill_args(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
        _float_arg("softmax_scale", softmax_scale), _mask_mode(mask_mode_code), _bool_arg("is_varlen", is_varlen))
    o, l = _torch_ops.dense_prefill_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
    _check_destinations(("out", "lse"), (out, lse), (o, l))  # (all checked before any is written)
    out.copy_(o)
    lse.copy_(l)


def dense_prefill_bwd(workspace: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_seqlens_q: Any,
                      cu_seqlens_kv: Any, dq: Any, dk: Any, dv: Any, mask_mode_code: int, softmax_scale: float,
                      max_seqlen_q: int, max_seqlen_kv: int, is_varlen: bool) -> None:
    """Dense MHA prefill backward into ``dq``, ``dk``, ``dv`` (FlashMLA's ``flash_mla.cuda.dense_prefill_bwd``);
    see the module docstring."""
    call_naming_seqlens(_SEQLEN_NAMES, _dense_prefill_bwd, workspace, dout, q, k, v, out, lse, cu_seqlens_q,
                        cu_seqlens_kv, dq, dk, dv, mask_mode_code, softmax_scale, max_seqlen_q, max_seqlen_kv, is_varlen)


def _dense_prefill_bwd(workspace, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, dq, dk, dv, mask_mode_code,
                       softmax_scale, max_seqlen_q, max_seqlen_kv, is_varlen):
    _require_torch(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_kv=cu_seqlens_kv, dq=dq, dk=dk, dv=dv)
    cu_q, cu_k, max_q, max_k, scale, causal = _dense_prefill_args(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
        _float_arg("softmax_scale", softmax_scale), _mask_mode(mask_mode_code), _bool_arg("is_varlen", is_varlen))
    grads = _torch_ops.dense_prefill_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal)
    _check_destinations(("dq", "dk", "dv"), (dq, dk, dv), grads)  # (all checked before any is written)
    for dst, src in zip((dq, dk, dv), grads):
        dst.copy_(src)
