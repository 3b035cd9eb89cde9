"""flash_mla — DeepSeek Multi-head Latent Attention kernels with FlashMLA's API.

A program written for deepseek-ai/FlashMLA runs unchanged. Tensors of any DLPack
framework are accepted; CPU tensors use the reference backend, CUDA tensors on a
Hopper GPU the sm90 kernels. See README.md for the architecture.
"""

__version__ = "1.0.0"

from .flash_mla_interface import (
    FlashMLASchedMeta,
    SchedMetaMismatchError,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_metadata,
)
from ._ffi import has_cuda_backend, reference_num_threads
from . import quant

__all__ = [
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_mla_sparse_fwd",
]
