"""flash_mla — DeepSeek Multi-head Latent Attention kernels with FlashMLA's API.

A program written for deepseek-ai/FlashMLA runs unchanged. Tensors of any DLPack
framework are accepted; CPU tensors use the reference backend, CUDA tensors on a
Hopper GPU the sm90 kernels. See README.md for the architecture.
"""

try:  # the installed distribution's version (pyproject.toml), one source of truth
    from importlib.metadata import PackageNotFoundError as _NotFound, version as _version

    __version__ = _version("flash_mla")
except _NotFound:  # pragma: no cover - running from a source tree without installing
    __version__ = "0.0.0+source"

from .flash_mla_interface import (
    FlashMLASchedMeta,
    SchedMetaMismatchError,
    flash_attn_varlen_backward,
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


def __getattr__(name):
    """``flash_mla.cuda`` on first access: FlashMLA's package imports its native module with
    ``import flash_mla``, so programs call ``flash_mla.cuda.<fn>`` without importing it themselves;
    here the module needs PyTorch (which flash_mla itself does not), so it loads lazily. Without
    torch / torch.ops.flash_mla the access raises AttributeError naming what is missing."""
    if name == "cuda":
        import importlib

        try:
            return importlib.import_module(".cuda", __name__)
        except ImportError as e:
            raise AttributeError(f"module 'flash_mla' has no attribute 'cuda': {e}") from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
