#!/usr/bin/env python3
"""A DeepSeek-V3-style MLA attention ``torch.nn.Module`` on flash_mla: training prefill and absorbed decode.

The two forms of Multi-head Latent Attention, as a model calls them:

* ``prefill`` (training, with backward): MHA form through ``flash_attn_varlen_func``. Per head
  ``q = [q_nope (128) | rope(q_pe) (64)]`` (d_qk 192), ``k = [W_UK c_kv (128) | rope(k_pe) (64), the same
  k_pe for every head]`` (192), ``v = W_UV c_kv`` (d_v 128); packed varlen rows ``(total, heads, dim)``,
  ``cu_seqlens`` int32, ``causal=True``. ``v`` and ``k_nope`` are views of one ``kv_b_proj`` output
  (last dim contiguous is all that is needed). ``lse`` is ``(total, heads)``, natural log, and carries no
  gradient.
* ``decode``: absorbed form through ``flash_mla_with_kvcache``. The cache row of a token is
  ``[kv_a_layernorm(c_kv) (512) | rope(k_pe) (64)]`` (576, bf16) in a paged cache
  ``(num_blocks, page, 1, 576)`` addressed by ``block_table``; the query is
  ``[q_nope W_UK (512) | rope(q_pe) (64)]`` per head, ``(b, 1, heads, 576)``; V is the first 512 values of
  the row (c_kv), so the output ``(b, 1, heads, 512)`` is latent: ``W_UV`` then ``o_proj`` follow. One
  ``get_mla_metadata()`` object per decoding step, shared by every layer's call.

Both calls get the model's ``softmax_scale`` (``(qk_nope + qk_rope) ** -0.5``, times YaRN's mscale^2 where
the model uses YaRN): the decode's default ``576 ** -0.5`` is not the model's scale.

Checks (exit code 0 iff all pass), against float64 torch attention without absorption:
prefill outputs and ``lse`` of a 2-layer stack, the gradients of the input and every weight; then
``--steps`` decode steps after the prefill, each layer's next-token output and ``lse`` against
attention recomputed over the whole sequence (prompt + decoded tokens). ``--compile`` runs the
prefill (forward and backward) and the decode under ``torch.compile(fullgraph=True)``. CPU tensors
(flash_mla's reference backend) unless ``--device cuda``.

    python examples/mla_module.py
    python examples/mla_module.py --compile
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import List, Optional, Sequence

import torch
import torch.nn as nn

import flash_mla

KV_LORA, ROPE, NOPE, DV = 512, 64, 128, 128
DQK = NOPE + ROPE  # 192: the MHA form's head dim


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE (theta 10000) on x (T, ..., 64) at positions pos (T,)."""
    inv = 1.0 / 10000 ** (torch.arange(0, ROPE, 2, dtype=torch.float64, device=x.device) / ROPE)
    f = pos.to(torch.float64)[:, None] * inv
    cos, sin = (torch.cat([f, f], -1).cos().to(x.dtype), torch.cat([f, f], -1).sin().to(x.dtype))
    for _ in range(x.dim() - 2):
        cos, sin = cos[:, None], sin[:, None]
    half = ROPE // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class MLA(nn.Module):
    def __init__(self, hidden: int, heads: int, q_lora: int, softmax_scale: float):
        super().__init__()
        self.h, self.scale = heads, softmax_scale

        def w(o, i):
            return nn.Parameter(torch.randn(o, i) / math.sqrt(i))

        self.q_a, self.q_b = w(q_lora, hidden), w(heads * DQK, q_lora)
        self.kv_a, self.kv_b = w(KV_LORA + ROPE, hidden), w(heads * (NOPE + DV), KV_LORA)
        self.o = w(hidden, heads * DV)
        self.q_norm = nn.Parameter(1 + 0.1 * torch.randn(q_lora))
        self.kv_norm = nn.Parameter(1 + 0.1 * torch.randn(KV_LORA))

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """x (T, hidden) -> q_nope (T, h, 128), rope(q_pe) (T, h, 64), c_kv (T, 512), rope(k_pe) (T, 64)."""
        q = (rms_norm(x @ self.q_a.T, self.q_norm) @ self.q_b.T).view(-1, self.h, DQK)
        q_nope, q_pe = q.split([NOPE, ROPE], -1)
        c_kv, k_pe = (x @ self.kv_a.T).split([KV_LORA, ROPE], -1)
        return q_nope, rope(q_pe, pos), rms_norm(c_kv, self.kv_norm), rope(k_pe, pos)

    def latent_rows(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The cache rows [c_kv | rope(k_pe)] (T, 576)."""
        _, _, c_kv, k_pe = self.project(x, pos)
        return torch.cat([c_kv, k_pe], -1)

    def mha_qkv(self, x: torch.Tensor, pos: torch.Tensor):
        q_nope, q_pe, c_kv, k_pe = self.project(x, pos)
        k_nope, v = (c_kv @ self.kv_b.T).view(-1, self.h, NOPE + DV).split([NOPE, DV], -1)  # views
        q = torch.cat([q_nope, q_pe], -1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.h, -1)], -1)
        return q, k, v

    def prefill(self, x: torch.Tensor, pos: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int):
        """x (total, hidden) packed requests -> (out (total, hidden), lse (total, h))."""
        q, k, v = self.mha_qkv(x, pos)
        bf = torch.bfloat16
        out, lse = flash_mla.flash_attn_varlen_func(q.to(bf), k.to(bf), v.to(bf), cu_seqlens, cu_seqlens,
                                                    max_seqlen, max_seqlen, softmax_scale=self.scale, causal=True)
        return out.to(x.dtype).flatten(1) @ self.o.T, lse

    def decode(self, x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor, sched):
        """One new token per request: x (b, hidden) at positions pos (b,). Writes its cache row, attends over
        the paged cache (cache_seqlens = pos + 1) -> (out (b, hidden), lse (b, h, 1))."""
        q_nope, q_pe, c_kv, k_pe = self.project(x, pos)
        page = k_cache.shape[1]
        slot = block_table.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
        k_cache.view(-1, KV_LORA + ROPE)[slot] = torch.cat([c_kv, k_pe], -1).to(k_cache.dtype)
        w = self.kv_b.view(self.h, NOPE + DV, KV_LORA)
        w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
        q = torch.cat([torch.einsum("bhd,hdc->bhc", q_nope, w_uk), q_pe], -1)[:, None].to(k_cache.dtype)
        o_lat, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, KV_LORA, sched,
                                                      softmax_scale=self.scale, causal=False)
        v = torch.einsum("bhc,hdc->bhd", o_lat[:, 0].to(x.dtype), w_uv)
        return v.flatten(1) @ self.o.T, lse


def exact_attention(m: MLA, x: torch.Tensor, pos: torch.Tensor, lens: Sequence[int]):
    """float64 causal MHA per request (no absorption, no flash_mla) -> (out (total, hidden), lse (total, h))."""
    q, k, v = m.mha_qkv(x, pos)
    outs, lses, a = [], [], 0
    for n in lens:
        s = torch.einsum("qhd,khd->hqk", q[a:a + n], k[a:a + n]) * m.scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        lses.append(torch.logsumexp(s, -1).T)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:a + n]))
        a += n
    return torch.cat(outs).flatten(1) @ m.o.T, torch.cat(lses)


def rel_err(a: torch.Tensor, r: torch.Tensor) -> float:
    a, r = a.detach().double(), r.detach().double()
    return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--q-lora", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt-lens", default="5,37,1,64")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the prefill and the decode")
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    b, total, pbs = len(lens), sum(lens), args.page_size
    scale = DQK ** -0.5  # a YaRN model: times mscale^2
    layers = nn.ModuleList(MLA(args.hidden, args.heads, args.q_lora, scale) for _ in range(args.layers)).to(dev)
    exact = nn.ModuleList(MLA(args.hidden, args.heads, args.q_lora, scale) for _ in range(args.layers)).double().to(dev)
    exact.load_state_dict({k: v.double() for k, v in layers.state_dict().items()})
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(b)], dtype=torch.int32, device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    prefill = (lambda m, *a: m.prefill(*a))
    decode = (lambda m, *a: m.decode(*a))
    if args.compile:
        prefill, decode = torch.compile(prefill, fullgraph=True), torch.compile(decode, fullgraph=True)
    failures: List[str] = []

    def check(name: str, a: torch.Tensor, r: torch.Tensor, tol: float) -> None:
        e = rel_err(a, r)
        good = e < tol and bool(torch.isfinite(a).all())
        print(f"{name:48s} max|a-r|/max|r| {e:.2e}  {'ok' if good else 'MISMATCH'}")
        if not good:
            failures.append(name)

    print(f"flash_mla {flash_mla.__version__}, torch {torch.__version__}, device {dev.type}"
          f"{', torch.compile' if args.compile else ''}; {args.layers} layers, {args.heads} heads, prompts {lens}")
    # ---- prefill (training): residual stack, outputs, lse and gradients against float64
    x = torch.randn(total, args.hidden, device=dev, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    h, h64 = x, x64
    for i, (m, m64) in enumerate(zip(layers, exact)):
        y, lse = prefill(m, h, pos, cu, max(lens))
        y64, lse64 = exact_attention(m64, h64, pos, lens)
        check(f"prefill layer {i} lse (total, heads)", lse, lse64, args.tol)
        h, h64 = h + y, h64 + y64
    check("prefill output", h, h64, args.tol)
    g = torch.randn_like(h64)
    (h * g.to(h.dtype)).sum().backward()
    (h64 * g).sum().backward()
    check("prefill grad of the input", x.grad, x64.grad, args.tol)
    for (name, w), w64 in zip(layers.named_parameters(), exact.parameters()):
        check(f"prefill grad of {name}", w.grad, w64.grad, args.tol)

    # ---- decode after the prefill: a paged latent cache per layer, pages in random order, NaN where unused
    steps = args.steps
    n_pages = [-(-(n + steps) // pbs) for n in lens]
    num_blocks = sum(n_pages) + 1
    perm = torch.randperm(num_blocks)
    block_table = torch.zeros(b, max(n_pages), dtype=torch.int32)
    for i, n in enumerate(n_pages):
        block_table[i, :n] = perm[sum(n_pages[:i]) : sum(n_pages[:i]) + n]
    block_table = block_table.to(dev)
    caches = [torch.full((num_blocks, pbs, 1, KV_LORA + ROPE), float("nan"), dtype=torch.bfloat16, device=dev)
              for _ in layers]
    new_tokens = torch.randn(b, steps, args.hidden, device=dev)
    seqs64 = [torch.cat([x.detach()[cu[i]:cu[i + 1]], new_tokens[i]]).double() for i in range(b)]  # layer inputs
    with torch.no_grad():
        h = x.detach()
        for m, cache in zip(layers, caches):  # the prompts' cache rows, from each layer's input
            rows = m.latent_rows(h, pos).to(torch.bfloat16)
            slot = block_table.long()[torch.repeat_interleave(torch.arange(b, device=dev), torch.tensor(lens, device=dev)),
                                      pos // pbs] * pbs + pos % pbs
            cache.view(-1, KV_LORA + ROPE)[slot] = rows
            h = h + m.prefill(h, pos, cu, max(lens))[0]
        for step in range(steps):
            cur = torch.tensor([n + step for n in lens], device=dev)
            seqlens = (cur + 1).to(torch.int32)
            sched, _ = flash_mla.get_mla_metadata()  # one per step (the lengths changed), shared by the layers
            h = new_tokens[:, step]
            inputs64 = [s[: n + step + 1] for s, n in zip(seqs64, lens)]
            for i, (m, m64, cache) in enumerate(zip(layers, exact, caches)):
                y, lse = decode(m, h, cur, cache, block_table, seqlens, sched)
                ref = [exact_attention(m64, s, torch.arange(s.shape[0], device=dev), [s.shape[0]]) for s in inputs64]
                check(f"decode step {step} layer {i} output", y, torch.stack([r[0][-1] for r in ref]), args.tol)
                check(f"decode step {step} layer {i} lse (b, heads, 1)", lse[:, :, 0],
                      torch.stack([r[1][-1] for r in ref]), args.tol)
                h = h + y
                inputs64 = [s + r[0] for s, r in zip(inputs64, ref)]
    print("PASS" if not failures else f"FAIL: {', '.join(failures)}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
