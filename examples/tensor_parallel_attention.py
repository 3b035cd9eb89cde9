#!/usr/bin/env python3
"""Tensor-parallel DeepSeek-V3 / V3.2 attention on torch.distributed, decoded with flash_mla.

One attention layer of DeepSeek-V3 (MLA with weight absorption, as in
``examples/deepseek_v3_attention.py``) is split over the ranks of a ``torch.distributed`` process
group by query heads, the way DeepSeek is served with tensor parallelism (TP):

* every rank holds the replicated parts: ``q_a_proj`` + ``q_a_layernorm``, ``kv_a_proj_with_mqa`` +
  ``kv_a_layernorm``, the RoPE tables, the V3.2 indexer, and the **whole latent KV cache**
  (``[c_kv (512) | k_pe (64)]`` per token, the same on every rank);
* rank ``r`` holds heads ``[r * h / N, (r + 1) * h / N)``: its rows of ``q_b_proj`` and of
  ``kv_b_proj`` (``W_UK``, ``W_UV``, absorbed into the query and the output) and its columns of
  ``o_proj`` (row-parallel: each rank's partial ``o_proj`` output is summed by ``all_reduce``).

Two cache modes, each run as a prefill followed by ``--steps`` decode steps of one token per
request, every attention through ``flash_mla_with_kvcache``:

``dense``  DeepSeek-V3: a paged bf16 cache ``(num_blocks, page, 1, 576)``; the prefill runs in chunks
           of ``--prefill-chunk`` query rows with ``causal=True`` (bottom-right aligned, so prompts of
           different lengths share one chunk grid: a request's rows before its first token are
           padding and see no key).
``sparse`` DeepSeek-V3.2: the cache in the FP8 "V32" format (656 bytes per token: 512 e4m3 values,
           4 float32 tile scales, 64 bf16 RoPE values; spec §3.3), written by this script's torch
           quantizer (checked bit for bit against ``flash_mla.quant.quantize_k_cache`` at start);
           a lightning indexer (V3.2's form: ``sum_h w_h * relu(q_h . k)`` over ``--index-heads``
           heads, causal) picks ``--topk`` cache tokens for every query token, and the call is
           ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``. The indexer runs in
           float32 and without V3.2's Hadamard rotation / FP8 index cache (those are its own
           precision choices; the attention is what is checked here).

Checks, at every prefill chunk and decode step (rank 0 prints one line per step):

* ``err/TP1``: the TP layer output (after ``all_reduce``) against the single-process run of the same
  layer (all heads in one process, one ``flash_mla_with_kvcache`` call), max|a - r| / max|r|; with
  N > 1 ranks rank 0 runs that single-process pass itself before the TP pass. The latent attention
  outputs of all ranks are also gathered (``all_gather``) and compared head by head (``lat/TP1``).
* ``err/exact``: the TP output against exact math in float64 without absorption (``k_nope = W_UK
  c_kv``, ``v = W_UV c_kv`` per head, softmax over the keys the row may see: causal for dense, the
  indexer's selection for sparse) on the cache contents as stored (bf16 rows; FP8 rows dequantized
  by ``flash_mla.quant.dequantize_k_cache``).
* outputs finite; for sparse, the TP run's indexer chose the same tokens as the single-process run's.
  Pass: that, and every error below ``--tol`` (default 2e-2: bf16 rounding) at every step.

Timing (rank 0 prints it, and ``--json`` records it): each step runs once for the checked result,
then ``--repeat`` more times (the step is idempotent: the same cache rows are rewritten); the
step time is the mean over those repetitions (CUDA events on the GPU, ``perf_counter`` on the CPU),
the maximum over the ranks. ``layer`` is the whole TP layer step (projections, indexer, cache write,
attention, ``all_reduce``); ``attn`` is the ``flash_mla_with_kvcache`` call alone, timed the same
way. Tokens per second: the step's real (non-padding) query tokens over the layer step time.

Defaults: DeepSeek-V3's dimensions (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, qk 128 + 64,
v 128; V3.2's indexer: 64 heads x 128, top-2048), a batch of 8 prompts of 129 to 4000 tokens
(``--prompt-lens``, ``--batch``), prefill chunks of 512, 8 decode steps, pages of 64 tokens; on the
GPU a bf16 module and 20 timed repetitions. ``--small`` shrinks the model and batch for the CPU.

Run (exit code 0 iff every check passes on every rank):

    torchrun --nproc-per-node 2 examples/tensor_parallel_attention.py            # 2 GPUs (NCCL)
    torchrun --nproc-per-node 1 examples/tensor_parallel_attention.py            # TP1 only
    torchrun --nproc-per-node 2 examples/tensor_parallel_attention.py --device cpu --small   # gloo
    python examples/tensor_parallel_attention.py --small                        # one process, no torchrun

The GPU path (NCCL) needs a compute-capability-9.0 GPU per rank and a CUDA build of flash_mla; without
one (or with ``--device cpu``) the ranks use gloo and CPU tensors (flash_mla's reference backend).

``--json PATH`` (rank 0 writes it) holds::

    date, device ("cuda"/"cpu"), gpu (name or null), world_size, backend ("nccl"/"gloo"),
    torch, flash_mla (versions), config (every dimension and option of the run),
    timing (how the times were taken),
    modes: {dense|sparse: {steps: [{phase ("prefill"/"decode"), index, s_q, kv_len_max (longest
            cache length in the batch after the step), tokens (real query tokens), layer_ms,
            attn_ms, tokens_per_s (TP run), tp1_layer_ms, tp1_attn_ms, tp1_tokens_per_s (the
            single-process pass; null when world_size is 1), err_vs_tp1, lat_err_vs_tp1 (null when
            world_size is 1; null also marks a non-finite error), err_vs_exact (null with --no-exact),
            same_tokens_as_tp1 (sparse: the indexer chose the same tokens), ok}],
            decode: {layer_ms, attn_ms, tokens_per_s, tp1_layer_ms, tp1_attn_ms, tp1_tokens_per_s,
            speedup_vs_tp1 (tp1_layer_ms / layer_ms)}: means over the decode steps, plus
            max_err_vs_tp1, max_lat_err_vs_tp1, max_err_vs_exact: the worst of all steps}},
    pass (bool).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import flash_mla
import flash_mla.quant

KV_LORA_RANK = 512  # the latent (c_kv) width; V is the latent, d_v = 512 (the kernels' layout)
QK_ROPE = 64
D_QK = KV_LORA_RANK + QK_ROPE  # 576: one cache row is [c_kv (512) | k_pe (64)]
V32_BYTES = 656  # FP8 "V32" record: 512 e4m3 + 4 float32 scales + 64 bf16 (spec §3.3)
V32_TILE = 128

# DeepSeek-V3 config.json "rope_scaling" (YaRN) and rope_theta
YARN = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0)
ROPE_THETA = 10000.0

# the CPU settings of --small (and of the CI test): tiny model, page-boundary lengths
SMALL = dict(hidden=256, heads=8, q_lora_rank=96, index_heads=4, prompt_lens="21,70,5", steps=3,
             prefill_chunk=32, page_size=16, topk=32)


# --------------------------------------------------------------------------- model


@dataclasses.dataclass
class MLAConfig:
    """Attention dimensions; the defaults are DeepSeek-V3's (V3.2 adds the indexer)."""

    hidden: int = 7168
    heads: int = 128
    q_lora_rank: int = 1536
    qk_nope: int = 128
    v_head_dim: int = 128
    index_heads: int = 64  # DeepSeek-V3.2 indexer
    index_head_dim: int = 128
    topk: int = 2048

    @property
    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-0.5 times YaRN's mscale^2 (mscale = 0.1 * mscale_all_dim * ln(factor) + 1),
        as DeepSeek-V3 scales its attention logits."""
        m = 0.1 * YARN["mscale_all_dim"] * math.log(YARN["factor"]) + 1.0
        return (self.qk_nope + QK_ROPE) ** -0.5 * m * m


def yarn_inv_freq(dim: int = QK_ROPE) -> torch.Tensor:
    """YaRN RoPE frequencies (dim / 2,) for DeepSeek-V3's rope_scaling.

    Dimensions that rotate fewer than beta_slow times over the original context are interpolated
    (frequency / factor), those that rotate more than beta_fast times kept; a linear ramp between
    the two correction dimensions blends them (YaRN, arXiv:2309.00071, §3.2). With mscale ==
    mscale_all_dim the cos/sin amplitude stays 1; the logit scaling is in MLAConfig.softmax_scale.
    """
    base, factor, orig = ROPE_THETA, YARN["factor"], YARN["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(YARN["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(YARN["beta_slow"])), dim - 1)
    extrapolated = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    interpolated = extrapolated / factor
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return (interpolated * ramp + extrapolated * (1 - ramp)).float()


def make_weights(cfg: MLAConfig, seed: int, device) -> Dict[str, torch.Tensor]:
    """The full (unsharded) layer's weights in float32, the same on every rank (seeded generator on
    the device). Linear weights ~ N(0, 1/fan_in) (unit-variance activations: logits neither uniform
    nor one-hot), norm weights 1 + N(0, 0.1^2). Shapes follow DeepSeek's checkpoint:
    ``(out_features, in_features)``, per-head rows of q_b_proj ``[nope | rope]`` and of kv_b_proj
    ``[W_UK (nope) | W_UV (v)]``."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, dqk = cfg.heads, cfg.qk_nope + QK_ROPE
    shapes = {
        "q_a_proj": (cfg.q_lora_rank, cfg.hidden),
        "q_b_proj": (h * dqk, cfg.q_lora_rank),
        "kv_a_proj_with_mqa": (D_QK, cfg.hidden),
        "kv_b_proj": (h * (cfg.qk_nope + cfg.v_head_dim), KV_LORA_RANK),
        "o_proj": (cfg.hidden, h * cfg.v_head_dim),
        "indexer.wq_b": (cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "indexer.wk": (cfg.index_head_dim, cfg.hidden),
        "indexer.weights_proj": (cfg.index_heads, cfg.hidden),
    }
    w = {k: torch.randn(s, generator=g, device=device) / math.sqrt(s[1]) for k, s in shapes.items()}
    for name, n in (("q_a_layernorm", cfg.q_lora_rank), ("kv_a_layernorm", KV_LORA_RANK), ("indexer.k_norm", cfg.index_head_dim)):
        w[name] = 1 + 0.1 * torch.randn(n, generator=g, device=device)
    w["indexer.k_norm.bias"] = 0.1 * torch.randn(cfg.index_head_dim, generator=g, device=device)
    return w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay q_pe / k_pe out;
    x (..., 64), cos / sin broadcastable to (..., 32). Computed in float32, returned in x's dtype."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


class AttentionShard:
    """What one rank holds: the replicated down-projections and indexer, and the absorbed up- and
    output projections of its query heads ``heads`` (a range of head numbers).

    Tensors are (b, s, ...) blocks of tokens; ``dtype`` is the module dtype (bf16 on the GPU,
    float32 on the CPU); queries for flash_mla are bf16.
    """

    def __init__(self, cfg: MLAConfig, w: Dict[str, torch.Tensor], heads: range, dtype: torch.dtype):
        self.cfg, self.heads, self.h, self.dtype = cfg, heads, len(heads), dtype
        h_all, nope, dv = cfg.heads, cfg.qk_nope, cfg.v_head_dim
        sel = slice(heads.start, heads.stop)
        self.q_a = w["q_a_proj"].to(dtype)
        self.q_a_norm = w["q_a_layernorm"]
        self.kv_a = w["kv_a_proj_with_mqa"].to(dtype)
        self.kv_a_norm = w["kv_a_layernorm"]
        self.q_b = w["q_b_proj"].view(h_all, nope + QK_ROPE, -1)[sel].reshape(-1, cfg.q_lora_rank).to(dtype)
        kv_b = w["kv_b_proj"].view(h_all, nope + dv, KV_LORA_RANK)[sel]
        self.w_uk = kv_b[:, :nope].to(dtype).contiguous()  # (h, nope, 512): k_nope = W_UK c_kv
        self.w_uv = kv_b[:, nope:].to(dtype).contiguous()  # (h, v, 512):    v = W_UV c_kv
        self.o = w["o_proj"].view(cfg.hidden, h_all, dv)[:, sel].reshape(cfg.hidden, -1).to(dtype)
        # V3.2 indexer (replicated), float32
        self.iq = w["indexer.wq_b"]
        self.ik, self.ik_norm, self.ik_bias = w["indexer.wk"], w["indexer.k_norm"], w["indexer.k_norm.bias"]
        self.iw = w["indexer.weights_proj"]

    def latent_kv(self, hs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hs (b, s, hidden) -> the cache rows [kv_a_layernorm(c_kv) | rope(k_pe)] (b, s, 576), module dtype."""
        c_kv, k_pe = torch.split(hs @ self.kv_a.T, [KV_LORA_RANK, QK_ROPE], dim=-1)
        return torch.cat([rms_norm(c_kv, self.kv_a_norm), apply_rope(k_pe, cos, sin)], dim=-1)

    def q_latent(self, hs: torch.Tensor) -> torch.Tensor:
        """hs (b, s, hidden) -> q_a_layernorm(q_a_proj(hs)) (b, s, q_lora_rank): shared by the
        attention's queries and the indexer's (as in V3.2)."""
        return rms_norm(hs @ self.q_a.T, self.q_a_norm)

    def absorbed_q(self, cq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """cq (b, s, q_lora) -> flash_mla's query (b, s, h, 576) bf16: [q_nope W_UK (512) | rope(q_pe) (64)]."""
        b, s = cq.shape[:2]
        q = (cq @ self.q_b.T).view(b, s, self.h, self.cfg.qk_nope + QK_ROPE)
        q_nope, q_pe = torch.split(q, [self.cfg.qk_nope, QK_ROPE], dim=-1)
        q_lat = torch.einsum("bshd,hdc->bshc", q_nope, self.w_uk)
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None])
        return torch.cat([q_lat, q_pe], dim=-1).to(torch.bfloat16).contiguous()

    def output_partial(self, o_lat: torch.Tensor) -> torch.Tensor:
        """flash_mla's latent output (b, s, h, 512) -> W_UV per head -> this rank's o_proj columns
        -> (b, s, hidden): the rank's share of the layer output (the ranks' shares add up to it)."""
        b, s = o_lat.shape[:2]
        v = torch.einsum("bshc,hdc->bshd", o_lat.to(self.dtype), self.w_uv)
        return v.reshape(b, s, -1) @ self.o.T

    def index_keys(self, hs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The indexer's key per token (b, s, index_head_dim) float32: LayerNorm(wk hs), RoPE on its first 64 dims."""
        k = torch.nn.functional.layer_norm(hs.float() @ self.ik.T, (self.ik.shape[0],), self.ik_norm, self.ik_bias, 1e-6)
        return torch.cat([apply_rope(k[..., :QK_ROPE], cos, sin), k[..., QK_ROPE:]], dim=-1)

    def select_topk(self, cq: torch.Tensor, hs: torch.Tensor, cos, sin, key_cache: torch.Tensor,
                    positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """V3.2's lightning indexer: for each query token the ``topk`` cache positions t <= its own
        position with the highest ``sum_h w_h * relu(q_h . k_t)`` (w = weights_proj(hs) * heads^-0.5 *
        dim^-0.5). key_cache (b, T, dim) float32 holds the index keys of positions 0..T-1.
        Returns token positions (b, s, topk) int64, -1 for unused slots (rows with fewer than topk
        visible tokens, padding rows)."""
        cfg = self.cfg
        b, s = hs.shape[:2]
        qi = (cq.float() @ self.iq.T).view(b, s, cfg.index_heads, cfg.index_head_dim)
        qi = torch.cat([apply_rope(qi[..., :QK_ROPE], cos[:, :, None], sin[:, :, None]), qi[..., QK_ROPE:]], dim=-1)
        wi = (hs.float() @ self.iw.T) * (cfg.index_heads ** -0.5 * cfg.index_head_dim ** -0.5)  # (b, s, ih)
        T = key_cache.shape[1]
        k = min(cfg.topk, T)
        out = torch.full((b, s, cfg.topk), -1, dtype=torch.long, device=hs.device)
        t = torch.arange(T, device=hs.device)
        for r in range(b):
            scores = torch.einsum("sh,sht->st", wi[r], torch.relu(torch.einsum("shd,td->sht", qi[r], key_cache[r])))
            visible = (t[None, :] <= positions[r][:, None]) & valid[r][:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            vals, idx = scores.topk(k, dim=-1)
            out[r, :, :k] = idx.masked_fill(vals == float("-inf"), -1)
        return out


# --------------------------------------------------------------------------- FP8 V32 cache rows


def quantize_v32_rows(rows: torch.Tensor) -> torch.Tensor:
    """bf16 cache rows (n, 576) -> FP8 "V32" records (n, 656) uint8, on the rows' device (spec §3.3).

    Per 128-dim tile t of the 512 latent dims: scale_t = 2^ceil(log2(max(amax_t / 448, 1e-4))),
    bytes 0..511 = e4m3fn(x / scale_t) (round to nearest even), bytes 512..527 = the 4 scales as
    float32, bytes 528..655 = the 64 RoPE dims as bf16 -- the conversion of
    ``flash_mla.quant.quantize_k_cache`` (FlashMLA's format), here in torch so that decode steps on
    the GPU do not round-trip through the host. main() checks the two agree bit for bit.
    """
    n = rows.shape[0]
    x = rows.to(torch.bfloat16)
    nope = x[:, :KV_LORA_RANK].float().view(n, KV_LORA_RANK // V32_TILE, V32_TILE)
    amax = nope.abs().amax(dim=-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448.0, min=1e-4))))
    fp8 = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(n, KV_LORA_RANK)
    return torch.cat([fp8, scale.float().contiguous().view(torch.uint8).view(n, 16),
                      x[:, KV_LORA_RANK:].contiguous().view(torch.uint8).view(n, 2 * QK_ROPE)], dim=1)


# --------------------------------------------------------------------------- the paged cache


class PagedLatentCache:
    """The latent KV cache of a batch, the same on every rank: bf16 rows ``(num_blocks, page, 1, 576)``
    (dense) or V32 records ``(num_blocks, page, 1, 656)`` uint8 with a block stride of (page + 1) * 656
    bytes (sparse, FlashMLA's test layout), pages assigned to requests through a seeded random
    permutation (``block_table``); unused rows hold NaN (bf16) / 0xFF bytes (FP8 NaN) so any read of
    them shows. For sparse mode it also keeps the indexer's keys per position (b, T, dim)."""

    def __init__(self, mode: str, total_lens: Sequence[int], page: int, index_dim: int, seed: int, device):
        self.mode, self.page, self.device = mode, page, device
        b = len(total_lens)
        n_blocks = [-(-L // page) for L in total_lens]
        num_blocks = sum(n_blocks) + 2  # two pages nobody owns
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=g)
        bt = torch.zeros(b, max(n_blocks), dtype=torch.int32)
        k = 0
        for i, n in enumerate(n_blocks):
            bt[i, :n] = perm[k : k + n].to(torch.int32)
            k += n
        self.block_table = bt.to(device)
        if mode == "dense":
            self.k_cache = torch.full((num_blocks, page, 1, D_QK), float("nan"), dtype=torch.bfloat16, device=device)
        else:
            stride = flash_mla.quant.default_block_stride(flash_mla.quant.FORMAT_V32, page)
            buf = torch.full((num_blocks * stride,), 0xFF, dtype=torch.uint8, device=device)
            self.k_cache = buf.as_strided((num_blocks, page, 1, V32_BYTES), (stride, V32_BYTES, V32_BYTES, 1))
            self.index_keys = torch.zeros(b, max(total_lens), index_dim, dtype=torch.float32, device=device)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Token positions (b, s) int64 (>= 0) -> flat cache slots block * page + row (b, s) int64 (spec §3.2)."""
        blk = torch.gather(self.block_table.long(), 1, positions // self.page)
        return blk * self.page + positions % self.page

    def request_slots(self, r: int, positions: torch.Tensor) -> torch.Tensor:
        """Positions (n,) int64 of request r -> its flat cache slots (n,) int64."""
        return self.block_table[r].long()[positions // self.page] * self.page + positions % self.page

    def write(self, rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
              index_keys: Optional[torch.Tensor] = None) -> None:
        """Store cache rows (b, s, 576) at positions (b, s) where valid (b, s)."""
        slot = self.slots(positions.clamp_min(0))[valid]
        r = rows[valid]
        if self.mode == "dense":
            self.k_cache.view(-1, D_QK)[slot] = r.to(torch.bfloat16)
        else:
            self.k_cache[slot // self.page, slot % self.page, 0] = quantize_v32_rows(r)
            bi = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(positions)[valid]
            self.index_keys[bi, positions[valid]] = index_keys[valid]

    def rows_as_bf16(self) -> torch.Tensor:
        """The whole cache as bf16 rows (num_blocks, page, 1, 576): dense as stored, sparse dequantized
        by flash_mla.quant.dequantize_k_cache (its conversion, not this script's)."""
        if self.mode == "dense":
            return self.k_cache
        return flash_mla.quant.dequantize_k_cache(self.k_cache, D_QK)


# --------------------------------------------------------------------------- the batch schedule


@dataclasses.dataclass
class Step:
    """One block of query tokens: positions (b, s_q) int64 (negative = padding row), valid (b, s_q)."""

    phase: str  # "prefill" or "decode"
    index: int
    positions: torch.Tensor
    valid: torch.Tensor

    @property
    def seqlens(self) -> torch.Tensor:
        """Cache length per request after this step's tokens are written (b,) int32."""
        return (self.positions[:, -1] + 1).clamp_min(0).to(torch.int32)


def make_schedule(prompt_lens: Sequence[int], steps: int, chunk: int, device) -> List[Step]:
    """Prefill in ceil(max_len / chunk) chunks of `chunk` rows, prompts right-aligned into the chunk
    grid (with bottom-right-aligned causal masking, chunk k's row i of request r is position
    L_r - (K - k) * chunk + i; negative positions are padding); then `steps` decode steps of one token."""
    lens = torch.tensor(list(prompt_lens), dtype=torch.long, device=device)
    n_chunks = -(-max(prompt_lens) // chunk)
    out = []
    for k in range(n_chunks):
        pos = lens[:, None] - (n_chunks - k) * chunk + torch.arange(chunk, device=device)[None, :]
        out.append(Step("prefill", k, pos, pos >= 0))
    for i in range(steps):
        pos = (lens + i)[:, None]
        out.append(Step("decode", i, pos, torch.ones_like(pos, dtype=torch.bool)))
    return out


# --------------------------------------------------------------------------- one layer step


class TPContext:
    """The process group view: world size, rank, and the collectives (no-ops in one process)."""

    def __init__(self, world: int, rank: int, device: torch.device):
        self.world, self.rank, self.device = world, rank, device
        self.distributed = world > 1

    def all_reduce(self, x: torch.Tensor, op=None) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
        return x

    def all_gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, h_local, d) on every rank -> (b, s, h_local * world, d) in rank (= head) order."""
        if not self.distributed:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=2)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class LayerRun:
    """A pass of the layer over the schedule on one shard: its own cache, one call per step."""

    def __init__(self, shard: AttentionShard, ctx: TPContext, mode: str, tokens: torch.Tensor, inv_freq: torch.Tensor,
                 cache: PagedLatentCache):
        self.shard, self.ctx, self.mode, self.tokens, self.inv_freq, self.cache = shard, ctx, mode, tokens, inv_freq, cache

    def inputs(self, step: Step):
        b = self.tokens.shape[0]
        pos = step.positions.clamp_min(0)
        hs = self.tokens[torch.arange(b, device=pos.device)[:, None], pos]  # (b, s, hidden)
        hs = hs * step.valid[..., None].to(hs.dtype)  # padding rows: zero hidden states
        ang = pos[..., None].float() * self.inv_freq
        return hs, ang.cos(), ang.sin()

    def prepare(self, step: Step):
        """Everything of the step up to the attention call: cache write, query, indices.
        Returns (q, kwargs of flash_mla_with_kvcache, selected positions or None)."""
        sh = self.shard
        hs, cos, sin = self.inputs(step)
        lat = sh.latent_kv(hs, cos, sin)
        cq = sh.q_latent(hs)
        q = sh.absorbed_q(cq, cos, sin)
        if self.mode == "dense":
            self.cache.write(lat, step.positions, step.valid)
            return q, dict(block_table=self.cache.block_table, cache_seqlens=step.seqlens, causal=True), None
        self.cache.write(lat, step.positions, step.valid, sh.index_keys(hs, cos, sin))
        chosen = sh.select_topk(cq, hs, cos, sin, self.cache.index_keys, step.positions, step.valid)
        slots = self.cache.slots(chosen.clamp_min(0).flatten(1)).view_as(chosen)
        indices = torch.where(chosen >= 0, slots, -1).to(torch.int32)
        return q, dict(block_table=None, cache_seqlens=None, is_fp8_kvcache=True, indices=indices), chosen

    def attend(self, q, kw, sched):
        o_lat, _lse = flash_mla.flash_mla_with_kvcache(
            q, self.cache.k_cache, kw.pop("block_table"), kw.pop("cache_seqlens"), KV_LORA_RANK, sched,
            softmax_scale=self.shard.cfg.softmax_scale, **kw)
        return o_lat

    def step(self, step: Step, sched):
        """The whole TP layer step; returns (layer output (b, s, hidden) after all_reduce, the rank's
        latent attention output (b, s, h_local, 512), selected positions or None, the call's arguments)."""
        q, kw, chosen = self.prepare(step)
        o_lat = self.attend(q, dict(kw), sched)
        out = self.ctx.all_reduce(self.shard.output_partial(o_lat))
        return out, o_lat, chosen, (q, kw)


def time_ms(ctx: TPContext, fn: Callable[[], object], repeat: int) -> float:
    """Mean ms of fn() over `repeat` calls (CUDA events on the GPU), maximum over the ranks."""
    ctx.sync()
    ctx.barrier()
    if ctx.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / repeat
    else:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / repeat
    t = torch.tensor([ms], dtype=torch.float64, device=ctx.device)
    return float(ctx.all_reduce(t, dist.ReduceOp.MAX if ctx.distributed else None)[0])


@dataclasses.dataclass
class StepResult:
    out: torch.Tensor  # (b, s, hidden) layer output
    o_lat: torch.Tensor  # (b, s, h, 512), all heads (gathered)
    chosen: Optional[torch.Tensor]
    layer_ms: Optional[float]  # None: not timed (--repeat 0)
    attn_ms: Optional[float]


def run_pass(run: LayerRun, step: Step, repeat: int) -> StepResult:
    sched, _ = flash_mla.get_mla_metadata()  # the cache lengths change every step: a fresh scheduler object
    out, o_lat, chosen, (q, kw) = run.step(step, sched)
    layer_ms = time_ms(run.ctx, lambda: run.step(step, sched), repeat) if repeat > 0 else None
    attn_ms = time_ms(run.ctx, lambda: run.attend(q, dict(kw), sched), repeat) if repeat > 0 else None
    return StepResult(out, run.ctx.all_gather_heads(o_lat), chosen, layer_ms, attn_ms)


# --------------------------------------------------------------------------- exact math


EXACT_WEIGHTS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_b_proj", "o_proj")


def exact_weights(w: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The full layer's attention weights as the shards hold them (rounded to the module dtype), in float64."""
    return {k: w[k].to(dtype).to(torch.float64) for k in EXACT_WEIGHTS}


def exact_output(cfg: MLAConfig, W: Dict[str, torch.Tensor], tokens: torch.Tensor, inv_freq: torch.Tensor,
                 cache: PagedLatentCache, step: Step, chosen: Optional[torch.Tensor], rows_per_block: int = 128) -> torch.Tensor:
    """The layer output (b, s, hidden) float64 for the step's valid rows (0 elsewhere), without
    absorption: per head k = [W_UK c_kv | k_pe], v = W_UV c_kv, softmax(q.k * scale) v, o_proj.
    W: :func:`exact_weights`. Keys: the cache rows as stored (`cache.rows_as_bf16()`), of positions
    t <= the row's (dense) or of the row's selected positions (sparse). Query rows go in blocks of
    `rows_per_block` (the logits of a block are rows x heads x keys float64 values)."""
    f64 = torch.float64
    h, nope, dv = cfg.heads, cfg.qk_nope, cfg.v_head_dim
    kv_b = W["kv_b_proj"].view(h, nope + dv, KV_LORA_RANK)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    rows = cache.rows_as_bf16().to(f64).view(-1, D_QK)
    b, s = step.positions.shape
    out = torch.zeros(b, s, cfg.hidden, dtype=f64, device=tokens.device)
    for r in range(b):
        valid = step.valid[r]
        if not bool(valid.any()):
            continue
        pos_all = step.positions[r][valid]
        L = int(pos_all.max()) + 1
        keys = rows[cache.request_slots(r, torch.arange(L, device=pos_all.device))]  # (L, 576)
        c_kv, k_pe = keys[:, :KV_LORA_RANK], keys[:, KV_LORA_RANK:]
        k_nope = torch.einsum("tc,hdc->htd", c_kv, w_uk)
        v = torch.einsum("tc,hdc->htd", c_kv, w_uv)
        t = torch.arange(L, device=pos_all.device)
        o_rows = []
        for i0 in range(0, len(pos_all), rows_per_block):
            pos = pos_all[i0 : i0 + rows_per_block]
            hs = tokens[r, pos].to(f64)
            cq = hs @ W["q_a_proj"].T
            cq = cq * torch.rsqrt(cq.pow(2).mean(-1, keepdim=True) + 1e-6) * W["q_a_layernorm"]
            q = (cq @ W["q_b_proj"].T).view(-1, h, nope + QK_ROPE)
            ang = pos[:, None].to(f64) * inv_freq.to(f64)
            q_pe = apply_rope(q[..., nope:], ang.cos()[:, None], ang.sin()[:, None])
            if chosen is None:
                allowed = t[None, :] <= pos[:, None]
            else:
                sel = chosen[r][valid][i0 : i0 + rows_per_block]
                allowed = torch.zeros(len(pos), L + 1, dtype=torch.bool, device=pos.device)
                allowed.scatter_(1, torch.where(sel >= 0, sel, L), True)
                allowed = allowed[:, :L]
            logits = torch.einsum("shd,htd->sht", q[..., :nope], k_nope) + torch.einsum("shd,td->sht", q_pe, k_pe)
            logits = (logits * cfg.softmax_scale).masked_fill_(~allowed[:, None, :], float("-inf"))
            o_rows.append(torch.einsum("sht,htd->shd", torch.softmax(logits, dim=-1), v).reshape(len(pos), h * dv))
        out[r, valid] = torch.cat(o_rows) @ W["o_proj"].T
    return out


def rel_err(a: torch.Tensor, r: torch.Tensor) -> float:
    a, r = a.double(), r.double()
    return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------- driver


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="module dtype (auto: bfloat16 on GPU, float32 on CPU); queries and the dense cache are bf16")
    p.add_argument("--modes", default="dense,sparse", help="comma-separated: dense (V3, bf16 cache), sparse (V3.2, FP8 + top-k)")
    p.add_argument("--small", action="store_true",
                   help="CPU-sized defaults: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in SMALL.items()))
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int, help="total query heads, split evenly over the ranks (default 128)")
    p.add_argument("--q-lora-rank", type=int)
    p.add_argument("--index-heads", type=int)
    p.add_argument("--topk", type=int, help="tokens the V3.2 indexer selects per query token (default 2048)")
    p.add_argument("--prompt-lens", help="comma-separated prompt lengths, one request each "
                   "(default 4000,3000,2048,1536,1024,777,512,129)")
    p.add_argument("--batch", type=int, help="requests: the --prompt-lens list repeated cyclically to this many "
                   "(default: one request per listed length)")
    p.add_argument("--steps", type=int, help="decode steps, one new token per request each (default 8)")
    p.add_argument("--prefill-chunk", type=int, help="query rows per prefill call (default 512)")
    p.add_argument("--page-size", type=int, help="tokens per cache page (default 64)")
    p.add_argument("--repeat", type=int, help="timed repetitions per step (default 20 on GPU, 1 on CPU; 0: no timing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=2e-2, help="max|a-r|/max|r| per step, against TP1 and exact math")
    p.add_argument("--no-exact", action="store_true", help="skip the float64 exact-math check (faster at full size)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    full = dict(hidden=7168, heads=128, q_lora_rank=1536, index_heads=64, topk=2048,
                prompt_lens="4000,3000,2048,1536,1024,777,512,129", steps=8, prefill_chunk=512, page_size=64)
    for k, v in (SMALL if args.small else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def check_args(args, world: int) -> Tuple[List[int], List[str]]:
    """Validates the options against the world size; returns (prompt lengths, modes).
    Raises ValueError naming the option and what was expected."""
    try:
        lens = [int(x) for x in str(args.prompt_lens).split(",")]
    except ValueError:
        raise ValueError(f"--prompt-lens: expected comma-separated integers, got {args.prompt_lens!r}") from None
    if not lens or min(lens) < 1:
        raise ValueError(f"--prompt-lens: every prompt needs at least 1 token, got {args.prompt_lens!r}")
    if args.batch is not None:
        if args.batch < 1:
            raise ValueError(f"--batch: must be >= 1, got {args.batch}")
        lens = [lens[i % len(lens)] for i in range(args.batch)]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("dense", "sparse")]
    if bad or not modes:
        raise ValueError(f"--modes: expected a comma-separated subset of dense,sparse, got {args.modes!r}")
    for name in ("hidden", "heads", "q_lora_rank", "index_heads", "topk", "prefill_chunk", "page_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.steps < 0:
        raise ValueError(f"--steps: must be >= 0, got {args.steps}")
    if args.heads % world:
        raise ValueError(f"--heads {args.heads}: tensor parallelism splits the query heads evenly, so they must be "
                         f"a multiple of the {world} ranks (torchrun --nproc-per-node)")
    return lens, modes


def pick_device(want: str, world: int, local_rank: int) -> torch.device:
    gpu_ok = (torch.cuda.is_available() and torch.cuda.device_count() > 0
              and torch.cuda.get_device_capability(0) == (9, 0) and flash_mla.has_cuda_backend())
    if want == "cuda" and not gpu_ok:
        raise SystemExit("--device cuda: needs a compute-capability-9.0 GPU and a CUDA build of flash_mla")
    if want == "cpu" or not gpu_ok:
        if want == "auto" and torch.cuda.is_available() and local_rank == 0:
            print("note: a GPU is present but not used (needs compute capability 9.0 and a CUDA build of "
                  "flash_mla); running on the CPU with gloo", file=sys.stderr)
        return torch.device("cpu")
    if world > torch.cuda.device_count():
        raise SystemExit(f"{world} ranks but {torch.cuda.device_count()} GPU(s): one rank per GPU "
                         f"(torchrun --nproc-per-node {torch.cuda.device_count()}), or --device cpu")
    return torch.device("cuda", local_rank)


def check_quantizer(rows: torch.Tensor) -> bool:
    """This script's V32 quantizer against flash_mla.quant.quantize_k_cache, bit for bit."""
    ours = quantize_v32_rows(rows).cpu()
    lib = flash_mla.quant.quantize_k_cache(rows.to(torch.bfloat16).cpu().view(-1, 1, 1, D_QK), block_stride=V32_BYTES)
    return torch.equal(ours, lib.reshape(-1, V32_BYTES))


def check_step(step: Step, res: StepResult, ref: Optional[StepResult], exact: Optional[torch.Tensor],
               tol: float) -> dict:
    """The checks and numbers of one step (rank 0): res is the TP run's, ref the single-process
    run's (None with one rank), exact the float64 layer output (None with --no-exact)."""
    valid = step.valid
    e_tp1 = rel_err(res.out[valid], ref.out[valid]) if ref is not None else None
    e_lat = rel_err(res.o_lat[valid], ref.o_lat[valid]) if ref is not None else None
    same_tokens = ref is None or res.chosen is None or torch.equal(res.chosen, ref.chosen)
    e_ex = rel_err(res.out[valid], exact[valid]) if exact is not None else None
    good = (same_tokens and bool(torch.isfinite(res.out[valid]).all())
            and all(e is None or e < tol for e in (e_tp1, e_lat, e_ex)))
    n_tok = int(valid.sum())
    t1 = ref.layer_ms if ref is not None else None
    return dict(
        phase=step.phase, index=step.index, s_q=int(step.positions.shape[1]), kv_len_max=int(step.seqlens.max()),
        tokens=n_tok, layer_ms=res.layer_ms, attn_ms=res.attn_ms,
        tokens_per_s=n_tok / (res.layer_ms * 1e-3) if res.layer_ms else None,
        tp1_layer_ms=t1, tp1_attn_ms=ref.attn_ms if ref is not None else None,
        tp1_tokens_per_s=n_tok / (t1 * 1e-3) if t1 else None,
        err_vs_tp1=e_tp1, lat_err_vs_tp1=e_lat, err_vs_exact=e_ex, same_tokens_as_tp1=same_tokens, ok=good)


class Table:
    """Rank 0's per-step lines; the TP1 columns only when a separate single-process pass ran."""

    def __init__(self, world: int, with_tp1: bool):
        tp = f"TP{world}"
        cols = [("step", "step", 10, None), ("s_q", "s_q", 4, "d"), ("kv_len_max", "kv_max", 6, "d"),
                ("tokens", "tok", 5, "d"), ("tp1_layer_ms", "TP1 ms", 7, ".3f"), ("layer_ms", tp + " ms", 7, ".3f"),
                ("speedup", "x", 5, ".2f"), ("tokens_per_s", tp + " tok/s", 11, ".0f"),
                ("tp1_attn_ms", "attn TP1", 8, ".3f"), ("attn_ms", "attn " + tp, 8, ".3f"),
                ("err_vs_tp1", "err/TP1", 8, ".2e"), ("lat_err_vs_tp1", "lat/TP1", 8, ".2e"),
                ("err_vs_exact", "err/exact", 9, ".2e")]
        tp1_only = {"tp1_layer_ms", "speedup", "tp1_attn_ms", "err_vs_tp1", "lat_err_vs_tp1"}
        self.cols = [c for c in cols if with_tp1 or c[0] not in tp1_only]

    def header(self) -> str:
        h = " ".join(f"{name:>{width}}" for _, name, width, _ in self.cols) + "  result"
        return h + "\n" + "-" * len(h)

    def line(self, r: dict) -> str:
        r = dict(r, step=f"{r['phase']} {r['index']}",
                 speedup=r["tp1_layer_ms"] / r["layer_ms"] if r["tp1_layer_ms"] and r["layer_ms"] else None)
        cells = ["-" if r[key] is None else format(r[key], spec or "") for key, _, _, spec in self.cols]
        verdict = "ok" if r["ok"] else (
            "MISMATCH" if r["same_tokens_as_tp1"] else "MISMATCH (the indexer chose other tokens than TP1's)")
        return " ".join(f"{c:>{width}}" for c, (_, _, width, _) in zip(cells, self.cols)) + "  " + verdict


def decode_summary(rows: List[dict]) -> dict:
    """Means over the decode steps, the TP-N / TP1 speed-up, and the worst errors of all steps."""
    dec = [r for r in rows if r["phase"] == "decode"]

    def mean(key):
        vals = [r[key] for r in dec if r[key] is not None]
        return sum(vals) / len(vals) if vals else None

    out = {k: mean(k) for k in ("layer_ms", "attn_ms", "tokens_per_s", "tp1_layer_ms", "tp1_attn_ms", "tp1_tokens_per_s")}
    out["speedup_vs_tp1"] = out["tp1_layer_ms"] / out["layer_ms"] if out["tp1_layer_ms"] and out["layer_ms"] else None
    for key in ("err_vs_tp1", "lat_err_vs_tp1", "err_vs_exact"):
        vals = [r[key] for r in rows if r[key] is not None]
        out["max_" + key] = max(vals) if vals else None
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        lens, modes = check_args(args, world)
    except ValueError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    device = pick_device(args.device, world, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, **kw)
    ctx = TPContext(world, rank, device)
    try:
        return run(args, lens, modes, ctx, backend)
    finally:
        if world > 1:
            dist.destroy_process_group()


def run(args, lens: List[int], modes: List[str], ctx: TPContext, backend: str) -> int:
    device, world, rank = ctx.device, ctx.world, ctx.rank
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    repeat = args.repeat if args.repeat is not None else (20 if device.type == "cuda" else 1)
    cfg = MLAConfig(hidden=args.hidden, heads=args.heads, q_lora_rank=args.q_lora_rank,
                    index_heads=args.index_heads, topk=args.topk)
    h_local = cfg.heads // world
    main_rank = rank == 0
    say = print if main_rank else (lambda *a, **k: None)

    w = make_weights(cfg, args.seed, device)
    inv_freq = yarn_inv_freq().to(device)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    total = [L + args.steps for L in lens]
    tokens = torch.randn(len(lens), max(total), cfg.hidden, generator=g, device=device).to(dtype)
    shard = AttentionShard(cfg, w, range(rank * h_local, (rank + 1) * h_local), dtype)
    full = AttentionShard(cfg, w, range(cfg.heads), dtype) if world > 1 and main_rank else None
    schedule = make_schedule(lens, args.steps, args.prefill_chunk, device)
    w64 = exact_weights(w, dtype) if main_rank and not args.no_exact else None

    def new_cache(mode):  # the same pages on every rank and in both passes
        return PagedLatentCache(mode, total, args.page_size, cfg.index_head_dim, args.seed + 2, device)

    say(f"flash_mla {flash_mla.__version__}, torch {torch.__version__}, {world} rank(s), {backend}, device {device.type}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else " (flash_mla reference backend)"))
    say(f"DeepSeek-V3 attention: hidden {cfg.hidden}, {cfg.heads} heads ({h_local} per rank), q_lora {cfg.q_lora_rank}, "
        f"kv_lora {KV_LORA_RANK}, qk {cfg.qk_nope}+{QK_ROPE}, v {cfg.v_head_dim}, softmax_scale {cfg.softmax_scale:.6f} "
        f"(YaRN mscale); module {str(dtype)[6:]}; V3.2 indexer {cfg.index_heads} heads x {cfg.index_head_dim}, "
        f"topk {cfg.topk}")
    say(f"batch {len(lens)}: prompts {','.join(map(str, lens))}, prefill chunk {args.prefill_chunk}, "
        f"{args.steps} decode steps, page {args.page_size}; timing: mean of {repeat} repetitions, max over ranks")

    ok = True
    if "sparse" in modes:
        probe = torch.randn(64, D_QK, generator=g, device=device) * torch.logspace(-6, 3, 64, device=device)[:, None]
        probe[0] = 0  # an all-zero row: the 1e-4 floor of the scale
        q_ok = check_quantizer(probe)
        say(f"FP8 V32 quantizer (torch, {device.type}) vs flash_mla.quant.quantize_k_cache: "
            f"{'bit-exact' if q_ok else 'MISMATCH'}")
        ok &= q_ok

    progress = None
    if main_rank and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(modes) * len(schedule) * (2 if full is not None else 1), desc="steps",
                        unit="step", file=sys.stderr, dynamic_ncols=True)
    write = progress.write if progress is not None else say
    table = Table(world, full is not None)
    results = {}
    for mode in modes:
        # the single-process pass (TP1: all heads, rank 0) first, while the other ranks wait
        tp1: List[Optional[StepResult]] = [None] * len(schedule)
        if full is not None:
            run1 = LayerRun(full, TPContext(1, 0, device), mode, tokens, inv_freq, new_cache(mode))
            for i, step in enumerate(schedule):
                tp1[i] = run_pass(run1, step, repeat)
                progress and progress.update()
        ctx.barrier()
        cache = new_cache(mode)
        runner = LayerRun(shard, ctx, mode, tokens, inv_freq, cache)
        write(f"\n== {mode}: " + ("V3, bf16 paged cache" if mode == "dense" else f"V3.2, FP8 V32 cache + top-{cfg.topk} indices")
              + (f"; TP{world} vs the single-process run (TP1)" if full is not None else "")
              + ("; float64 exact math" if not args.no_exact else "; exact math off (--no-exact)"))
        write(table.header())
        rows = []
        for i, step in enumerate(schedule):
            res = run_pass(runner, step, repeat)
            progress and progress.update()
            if main_rank:
                exact = exact_output(cfg, w64, tokens, inv_freq, cache, step, res.chosen) if w64 is not None else None
                rows.append(check_step(step, res, tp1[i], exact, args.tol))
                ok &= rows[-1]["ok"]
                write(table.line(rows[-1]))
        if main_rank:
            summary = results.setdefault(mode, {"steps": rows, "decode": decode_summary(rows)})["decode"]
            if summary["layer_ms"] is not None:
                write(f"{mode} decode, mean over {args.steps} steps: TP{world} layer {summary['layer_ms']:.3f} ms "
                      f"({summary['tokens_per_s']:.0f} tok/s), attention {summary['attn_ms']:.3f} ms"
                      + (f"; TP1 layer {summary['tp1_layer_ms']:.3f} ms, attention {summary['tp1_attn_ms']:.3f} ms; "
                         f"speed-up {summary['speedup_vs_tp1']:.2f}x" if summary["tp1_layer_ms"] else ""))
        ctx.barrier()
    if progress is not None:
        progress.close()

    # every rank exits with rank 0's verdict
    verdict = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    if ctx.distributed:
        dist.broadcast(verdict, 0)
    ok = bool(verdict.item())
    if main_rank:
        say("PASS" if ok else "FAIL")
        if args.json:
            write_json(args.json, dict(
                date=datetime.date.today().isoformat(), device=device.type,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                world_size=world, backend=backend, torch=torch.__version__, flash_mla=flash_mla.__version__,
                config=dict(dataclasses.asdict(cfg), kv_lora_rank=KV_LORA_RANK, qk_rope=QK_ROPE, heads_per_rank=h_local,
                            softmax_scale=cfg.softmax_scale, prompt_lens=lens, steps=args.steps,
                            prefill_chunk=args.prefill_chunk, page_size=args.page_size, module_dtype=str(dtype)[6:],
                            modes=modes, repeat=repeat, tol=args.tol, seed=args.seed, exact_check=not args.no_exact),
                timing=("mean of `repeat` repetitions of each step after its checked run, maximum over the ranks; "
                        + ("CUDA events" if device.type == "cuda" else "time.perf_counter")
                        + "; layer = the whole TP layer step incl. all_reduce, attn = the flash_mla_with_kvcache call"),
                modes=results, **{"pass": ok}))
            say(f"wrote {args.json}")
    return 0 if ok else 1


def write_json(path: str, doc: dict) -> None:
    """JSON with non-finite numbers as null (an error of inf marks a failed step; strict JSON has no inf)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as fh:
        json.dump(clean(doc), fh, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
