"""ctypes loader of the standalone sm90 dense MHA prefill library (shim.cpp + src/sm90/prefill/dense/),
used by check.py and bench/bench_dense_prefill.py when the flash_mla package is not built. Tensors are
torch CUDA tensors; outputs are allocated here and poisoned with NaN before the call."""
import ctypes

import torch


def _meta(t):
    return list(t.shape) + list(t.stride())


class DensePrefillLib:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        P = ctypes.c_void_p
        self.lib.dense_prefill_check_fwd.argtypes = [ctypes.POINTER(P), ctypes.POINTER(ctypes.c_int64), ctypes.c_float,
                                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, P, ctypes.c_int,
                                                     ctypes.c_char_p, ctypes.c_int]
        self.lib.dense_prefill_check_bwd.argtypes = [ctypes.POINTER(P), ctypes.POINTER(ctypes.c_int64), ctypes.c_float,
                                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, P, ctypes.c_int,
                                                     ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_int]
        self._ws = None

    @staticmethod
    def _dtype(q):
        if q.dtype == torch.bfloat16:
            return 0
        if q.dtype == torch.float16:
            return 1
        raise TypeError(f"q: bf16 or fp16 expected, got {q.dtype}")

    def _fwd_args(self, q, k, v, cu_q, cu_k, max_q, max_k, out, lse):
        ptrs = [t.data_ptr() for t in (q, k, v, cu_q, cu_k, out, lse)]
        meta = _meta(q) + _meta(k) + _meta(v) + _meta(out) + _meta(lse) + _meta(cu_q) + _meta(cu_k) + [max_q, max_k]
        return ptrs, meta

    SCHEDULES = {"default": -1, "serial": 0, "overlap": 1, "pingpong": 2, "pingpong_tma": 3, "persistent_tma": 4,
                 "persistent_tma_2cta": 5, "persistent_tma_fold": 6, "persistent_tma_fold_k176": 7,
                 "persistent_tma_k176_2cta": 8, "persistent_tma_fold_by_block": 9, "persistent_tma_fold_by_block_2cta": 10}  # forward consumer schedules (dense_prefill.h)
    # backward schedules (dense_prefill.h): the _by_head / _by_block forms force both kernels' CTA order
    BWD_SCHEDULES = {"default": -1, "two_kernel": 0, "two_kernel_tma": 1, "two_kernel_tma_by_head": 2,
                     "two_kernel_tma_by_block": 3}

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, out=None, lse=None, poison=True,
            schedule="default"):
        total_q, h_q, _ = q.shape
        if out is None:
            out = torch.empty(total_q, h_q, v.shape[2], dtype=q.dtype, device=q.device)
        if lse is None:
            lse = torch.empty(h_q, total_q, dtype=torch.float32, device=q.device).T  # FlashMLA's layout
        if poison:
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        ptrs, meta = self._fwd_args(q, k, v, cu_q, cu_k, max_q, max_k, out, lse)
        err = ctypes.create_string_buffer(1024)
        rc = self.lib.dense_prefill_check_fwd((ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int64 * len(meta))(*meta),
                                              scale, int(causal), self._dtype(q), q.device.index or 0,
                                              ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                                              self.SCHEDULES[schedule], err, 1024)
        if rc != 0:
            raise RuntimeError(err.value.decode())
        return out, lse

    def bwd(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, out, lse, dout, grads=None, poison=True,
            schedule="default"):
        if grads is None:
            grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        dq, dk, dv = grads
        if poison:
            for g in grads:
                g.fill_(float("nan"))
        ptrs, meta = self._fwd_args(q, k, v, cu_q, cu_k, max_q, max_k, out, lse)
        ptrs += [dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), 0]
        meta += _meta(dout) + _meta(dq) + _meta(dk) + _meta(dv) + [0]
        err = ctypes.create_string_buffer(1024)
        ws_bytes = ctypes.c_int64(0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        args = lambda: ((ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int64 * len(meta))(*meta), scale, int(causal),
                        self._dtype(q), q.device.index or 0, stream, self.BWD_SCHEDULES[schedule],
                        ctypes.byref(ws_bytes), err, 1024)
        ptrs[11] = None
        self.lib.dense_prefill_check_bwd(*args())
        need = max(int(ws_bytes.value), 16)
        if self._ws is None or self._ws.numel() < need:
            self._ws = torch.empty(need, dtype=torch.uint8, device=q.device)
        ptrs[11] = self._ws.data_ptr()
        meta[-1] = self._ws.numel()
        rc = self.lib.dense_prefill_check_bwd(*args())
        if rc != 0:
            raise RuntimeError(err.value.decode())
        return dq, dk, dv
