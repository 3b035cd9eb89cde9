#!/usr/bin/env python3
"""A real client: DeepSeek-V3 attention from Hugging Face ``transformers``, decoded with flash_mla.

What it does, step by step:

1. Builds a ``DeepseekV3Config`` with the real model's attention dims (hidden 7168, 128 heads,
   q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, YaRN RoPE with factor 40
   and mscale_all_dim 1 as in DeepSeek-V3's config.json) and instantiates
   ``modeling_deepseek_v3.DeepseekV3Attention`` (layer 0) with seeded random weights, eager
   attention. ``--heads`` / ``--hidden`` shrink it for CPU runs.
2. Prefills a batch of prompts of different lengths with the module's own eager attention
   (right-padded batch, additive causal + padding mask), and computes each prompt token's latent KV
   the way the module does: ``kv_a_proj_with_mqa`` -> split into c_kv (512) and k_pe (64) ->
   ``kv_a_layernorm`` on c_kv -> RoPE on k_pe (interleaved or ``rotate_half``, as the module's
   ``config.rope_interleave`` says). The module's own latents are captured during the prefill
   (through the ``past_key_values.update`` call it makes) and must match ours.
3. Stores ``[c_kv | k_pe]`` (576 values, bf16) into a paged cache ``(num_blocks, 64, 1, 576)``
   through a randomly permuted block table; unused slots and pages hold NaN.
4. Checks the prefill's last ``--tail`` positions: the same queries through
   ``flash_mla_with_kvcache(..., causal=True)`` (s_q = tail, bottom-right aligned).
5. Decodes ``--steps`` steps, one new token per request: q as the module computes it
   (q_a_proj -> q_a_layernorm -> q_b_proj -> split -> RoPE on q_pe), W_UK absorbed into q_nope
   (512-dim latent query per head), the new token's latent appended to the cache, then
   ``flash_mla_with_kvcache(q (b,1,h,576), k_cache, block_table, cache_seqlens, 512, sched,
   softmax_scale=module.scaling, causal=False)``, the latent output up-projected with W_UV and
   passed through ``o_proj``. Reference: the module's eager forward over the whole sequence
   (prompt + decoded tokens so far), last position.

Pass criterion per step: max|a - r| / max|r| < --tol (default 2e-2) against the module run in the
same dtype. With a bf16 module it also prints both errors against a float32 copy of the module
(same weights), to show the flash_mla path is as close to exact math as the module itself.

CUDA tensors (Hopper kernel) when a compute-capability-9.0 GPU and a CUDA build of flash_mla are
there, else CPU tensors (flash_mla's reference backend). Exit code 0 iff every check passes.

    python examples/deepseek_v3_attention.py                       # real dims, GPU if present
    python examples/deepseek_v3_attention.py --heads 16 --hidden 1024 --device cpu
"""

from __future__ import annotations

import argparse
import copy
import inspect
import math
import sys
from typing import List, Optional, Sequence

import torch

import flash_mla

try:
    import transformers
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds3
except ImportError as e:  # pragma: no cover - exercised only without transformers
    transformers = None
    _IMPORT_ERROR = e

KV_LORA_RANK = 512
QK_ROPE = 64
D_QK = KV_LORA_RANK + QK_ROPE  # 576: one cache row is [c_kv (512) | k_pe (64)]

# DeepSeek-V3 config.json "rope_scaling" (called rope_parameters in transformers 5)
YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
ROPE_THETA = 10000.0


# --------------------------------------------------------------------------- model set-up


def make_config(hidden: int, heads: int, rope: str, interleave: bool) -> "DeepseekV3Config":
    kw = dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=1536,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=128,
        qk_rope_head_dim=QK_ROPE,
        v_head_dim=128,
        max_position_embeddings=163840,
        num_hidden_layers=1,
        rope_interleave=interleave,
        attention_bias=False,
        attention_dropout=0.0,
    )
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        rp = {"rope_theta": ROPE_THETA, "rope_type": "default"} if rope == "default" else dict(YARN, rope_theta=ROPE_THETA)
        kw["rope_parameters"] = rp
    else:  # transformers 4.x spelled it rope_scaling + rope_theta
        kw["rope_theta"] = ROPE_THETA
        kw["rope_scaling"] = None if rope == "default" else {("type" if k == "rope_type" else k): v for k, v in YARN.items()}
    config = DeepseekV3Config(**kw)
    config._attn_implementation = "eager"
    return config


def init_weights(attn: torch.nn.Module, seed: int) -> None:
    """Seeded random weights, scaled so every projection keeps unit variance.

    Linear weights ~ N(0, 1/fan_in), RMSNorm weights 1 + N(0, 0.1^2). Then q and k elements are
    ~N(0, 1) and the attention logits have a std of about sqrt(192) * scaling (~1.9 with YaRN's
    mscale, ~1.0 without): a softmax that is neither uniform nor one-hot.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(attn.named_parameters()):
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:  # biases (attention_bias=True only)
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE exactly as DeepseekV3Attention applies it; x is (b, heads, s, 64), cos/sin (b, s, 64).

    interleave (``config.rope_interleave``, DeepSeek's checkpoint layout): rotation pairs are
    (x0, x1), (x2, x3), ...; the result is laid out de-interleaved, [even' | odd'] -- as
    ``apply_rotary_pos_emb_interleave`` does (transformers 5.x computes it on even/odd slices,
    4.x by view/transpose/reshape then rotate_half: the same values, the same layout).
    Otherwise ``apply_rotary_pos_emb``: x * cos + rotate_half(x) * sin.
    The layout of q_pe and k_pe only has to agree: flash_mla takes their dot product.
    """
    if interleave:
        c = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
        s = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * c) + (rot * s)


class LatentRecorder:
    """Stands in for the module's KV cache (``past_key_values``; ``cache`` from transformers 5.24):
    DeepseekV3Attention (transformers 5) calls ``update(kv_nope (b,1,s,512), k_rot (b,1,s,64),
    layer_idx, ...)`` with the latents it attends to (the trailing keyword is ``cache_kwargs`` or,
    from 5.24, ``kwargs``; both are ignored)."""

    def __init__(self) -> None:
        self.kv_nope: Optional[torch.Tensor] = None
        self.k_rot: Optional[torch.Tensor] = None

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, **kwargs):
        self.kv_nope, self.k_rot = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx=0):
        return 0


class LatentClient:
    """The client side: latent KV, absorbed queries and output projection around flash_mla."""

    def __init__(self, attn: torch.nn.Module, rotary: torch.nn.Module, kv_dtype: torch.dtype):
        self.attn, self.rotary, self.kv_dtype = attn, rotary, kv_dtype
        cfg = attn.config
        self.h = attn.num_heads
        self.nope, self.rope_dim, self.dv = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
        self.interleave = bool(getattr(cfg, "rope_interleave", True))
        assert attn.kv_lora_rank == KV_LORA_RANK and self.rope_dim == QK_ROPE
        # kv_b_proj.weight: (h * (nope + v), 512); per head rows [W_UK (nope) | W_UV (v)]
        w = attn.kv_b_proj.weight.detach().float().view(self.h, self.nope + self.dv, KV_LORA_RANK)
        self.w_uk = w[:, : self.nope, :]  # (h, 128, 512): k_nope = W_UK @ c_kv
        self.w_uv = w[:, self.nope :, :]  # (h, 128, 512): v = W_UV @ c_kv

    def cos_sin(self, x: torch.Tensor, positions: torch.Tensor):
        return self.rotary(x, positions)

    def latent_kv(self, hs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hs (b, s, hidden), positions (b, s) -> [c_kv | k_pe] (b, s, 576) in the module's dtype."""
        a = self.attn
        b, s = hs.shape[:2]
        compressed = a.kv_a_proj_with_mqa(hs)
        c_kv, k_pe = torch.split(compressed, [KV_LORA_RANK, self.rope_dim], dim=-1)
        c_kv = a.kv_a_layernorm(c_kv)
        cos, sin = self.cos_sin(hs, positions)
        k_pe = rope(k_pe.view(b, 1, s, self.rope_dim), cos, sin, self.interleave).view(b, s, self.rope_dim)
        return torch.cat([c_kv, k_pe], dim=-1)

    def absorbed_q(self, hs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hs (b, s, hidden) -> q (b, s, h, 576) in kv_dtype: [q_nope @ W_UK (512) | rope(q_pe) (64)]."""
        a = self.attn
        b, s = hs.shape[:2]
        if a.q_lora_rank is None:
            q = a.q_proj(hs)
        else:
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(hs)))
        q = q.view(b, s, self.h, self.nope + self.rope_dim).transpose(1, 2)  # (b, h, s, 192)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        cos, sin = self.cos_sin(hs, positions)
        q_pe = rope(q_pe, cos, sin, self.interleave)
        q_lat = torch.einsum("bhsd,hdc->bshc", q_nope.float(), self.w_uk)  # (b, s, h, 512)
        return torch.cat([q_lat, q_pe.transpose(1, 2).float()], dim=-1).to(self.kv_dtype).contiguous()

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """flash_mla's latent output (b, s, h, 512) -> W_UV per head -> o_proj -> (b, s, hidden)."""
        b, s = o_lat.shape[:2]
        v = torch.einsum("bshc,hdc->bshd", o_lat.float(), self.w_uv)  # (b, s, h, 128)
        return self.attn.o_proj(v.reshape(b, s, self.h * self.dv).to(self.attn.o_proj.weight.dtype))


# --------------------------------------------------------------------------- reference


def additive_mask(lens: Sequence[int], s: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(b, 1, s, s) additive mask: causal, and keys past each row's length masked (right padding)."""
    lens_t = torch.tensor(list(lens), device=device)
    i = torch.arange(s, device=device)
    allowed = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < lens_t[:, None, None])
    mask = torch.zeros(len(lens), 1, s, s, dtype=dtype, device=device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def eager_forward(attn, rotary, seqs: List[torch.Tensor], recorder=None) -> torch.Tensor:
    """The module's own eager forward over a right-padded batch; returns (b, s_max, hidden)."""
    lens = [int(x.shape[0]) for x in seqs]
    s = max(lens)
    hs = torch.zeros(len(seqs), s, seqs[0].shape[-1], dtype=seqs[0].dtype, device=seqs[0].device)
    for i, x in enumerate(seqs):
        hs[i, : lens[i]] = x
    pos = torch.arange(s, device=hs.device)[None].expand(len(seqs), -1)
    cos, sin = rotary(hs, pos)
    mask = additive_mask(lens, s, hs.dtype, hs.device)
    kwargs = {}
    if recorder is not None:  # the cache argument's name: ``cache`` from transformers 5.24, ``past_key_values`` before
        kwargs = {("cache" if "cache" in inspect.signature(attn.forward).parameters else "past_key_values"): recorder}
    out = attn(hidden_states=hs, position_embeddings=(cos, sin), attention_mask=mask, **kwargs)[0]
    return out


# --------------------------------------------------------------------------- checks


def rel_err(a: torch.Tensor, r: torch.Tensor) -> float:
    a, r = a.double(), r.double()
    return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))


def cos_sim(a: torch.Tensor, r: torch.Tensor) -> float:
    a, r = a.double().flatten(), r.double().flatten()
    return float((a @ r) / (a.norm() * r.norm()).clamp_min(1e-30))


def pick_device(want: str) -> str:
    gpu_ok = (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and flash_mla.has_cuda_backend()
    )
    if want == "auto":
        return "cuda" if gpu_ok else "cpu"
    if want == "cuda" and not gpu_ok:
        raise SystemExit("--device cuda: needs a compute-capability-9.0 GPU and a CUDA build of flash_mla")
    return want


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="module dtype (auto: bfloat16 on GPU, float32 on CPU); the KV cache is always bf16")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--prompt-lens", default="37,128,200", help="comma-separated prompt lengths (batch)")
    p.add_argument("--steps", type=int, default=4, help="decode steps (one new token per request each)")
    p.add_argument("--tail", type=int, default=4, help="prefill positions checked with causal s_q>1 (0: off)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--rope", choices=["yarn", "default"], default="yarn")
    p.add_argument("--no-interleave", action="store_true", help="config.rope_interleave=False (rotate_half)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=2e-2, help="max|a-r|/max|r| per step")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if transformers is None:
        print(f"transformers is not installed: {_IMPORT_ERROR}", file=sys.stderr)
        return 2
    device = pick_device(args.device)
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    kv_dtype = torch.bfloat16
    lens = [int(x) for x in args.prompt_lens.split(",")]
    b, steps, pbs = len(lens), args.steps, args.page_size
    if args.tail > min(lens):
        raise SystemExit(f"--tail {args.tail} exceeds the shortest prompt ({min(lens)})")

    config = make_config(args.hidden, args.heads, args.rope, not args.no_interleave)
    torch.manual_seed(args.seed)
    attn = hf_ds3.DeepseekV3Attention(config, layer_idx=0)
    init_weights(attn, args.seed)
    attn = attn.to(device=device, dtype=dtype).eval()
    rotary = hf_ds3.DeepseekV3RotaryEmbedding(config).to(device)
    # exact-math oracle: the same weights in float32 (only when the module itself is not float32)
    attn32 = copy.deepcopy(attn).float() if dtype != torch.float32 else None
    client = LatentClient(attn, rotary, kv_dtype)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else " (flash_mla reference backend)"))
    print(f"DeepseekV3Attention: hidden {config.hidden_size}, heads {config.num_attention_heads}, "
          f"q_lora {config.q_lora_rank}, kv_lora {config.kv_lora_rank}, qk {attn.qk_nope_head_dim}+"
          f"{attn.qk_rope_head_dim}, v {attn.v_head_dim}; module dtype {str(dtype)[6:]}, KV cache bf16; "
          f"rope {args.rope}, rope_interleave {client.interleave}; softmax_scale {attn.scaling:.6f} "
          f"(192^-0.5 = {192 ** -0.5:.6f})")

    # token hidden states: prompt + one per decode step, per request
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = [torch.randn(L + steps, config.hidden_size, generator=g).to(device=device, dtype=dtype) for L in lens]

    ok = True
    with torch.no_grad():
        # ---- prefill with the module (right-padded batch, additive causal+padding mask)
        rec = LatentRecorder()
        prefill_out = eager_forward(attn, rotary, [t[:L] for t, L in zip(tokens, lens)], recorder=rec)

        # ---- paged cache: [c_kv | k_pe] rows, random block order, NaN where unused
        n_blocks = [(L + steps + pbs - 1) // pbs for L in lens]
        num_blocks = sum(n_blocks) + 2
        perm = torch.randperm(num_blocks, generator=g)
        block_table = torch.zeros(b, max(n_blocks), dtype=torch.int32)
        k = 0
        for i, n in enumerate(n_blocks):
            block_table[i, :n] = perm[k : k + n].to(torch.int32)
            k += n
        bt_host, block_table = block_table, block_table.to(device)
        k_cache = torch.full((num_blocks, pbs, 1, D_QK), float("nan"), dtype=kv_dtype, device=device)

        def store(i: int, start: int, rows: torch.Tensor) -> None:
            """Write rows (n, 576) at token positions start.. of request i (page lookup via the block table)."""
            p = torch.arange(start, start + rows.shape[0])
            blk = bt_host[i, p // pbs].long().to(device)
            k_cache[blk, (p % pbs).to(device), 0] = rows.to(kv_dtype)

        latent_diff = 0.0
        for i, L in enumerate(lens):
            pos = torch.arange(L, device=device)[None]
            lat = client.latent_kv(tokens[i][None, :L], pos)[0]  # (L, 576)
            store(i, 0, lat)
            if rec.kv_nope is not None and tuple(rec.kv_nope.shape[1:2]) == (1,) and rec.kv_nope.shape[-1] == KV_LORA_RANK:
                mod = torch.cat([rec.kv_nope[i, 0, :L], rec.k_rot[i, 0, :L]], dim=-1)
                latent_diff = max(latent_diff, rel_err(lat, mod))
        if rec.kv_nope is None or rec.kv_nope.shape[-1] != KV_LORA_RANK:
            print("latent KV vs module: not checked (this transformers version caches expanded K/V)")
        else:
            lat_ok = latent_diff < args.tol  # bit-exact on CPU; GEMM shapes may round differently on GPU
            ok &= lat_ok
            print(f"latent KV [c_kv | k_pe] vs the module's own (captured in prefill): "
                  f"max|a-r|/max|r| = {latent_diff:.2e} {'ok' if lat_ok else 'MISMATCH'}")

        hdr = (f"{'check':>10} {'s_q':>3} {'kv lens':>20} {'max|ref|':>9} {'max|a-r|':>9} {'rel err':>8} "
               f"{'cos sim':>9}" + (f" {'eager/fp32':>10} {'flash/fp32':>10}" if attn32 is not None else "") + "  result")
        print(hdr)
        print("-" * len(hdr))

        def report(name, s_q, kv_lens, ours, ref, ref32):
            nonlocal ok
            e = rel_err(ours, ref)
            good = e < args.tol and bool(torch.isfinite(ours).all())
            ok &= good
            line = (f"{name:>10} {s_q:>3} {','.join(map(str, kv_lens)):>20} {ref.float().abs().max().item():9.3e} "
                    f"{(ours.double() - ref.double()).abs().max().item():9.3e} {e:8.2e} {cos_sim(ours, ref):9.6f}")
            if ref32 is not None:
                line += f" {rel_err(ref, ref32):10.2e} {rel_err(ours, ref32):10.2e}"
            print(line + ("  ok" if good else "  MISMATCH"))

        # ---- prefill tail: last `tail` prompt positions, causal s_q = tail
        if args.tail > 0:
            t = args.tail
            hs = torch.stack([tokens[i][L - t : L] for i, L in enumerate(lens)])
            pos = torch.stack([torch.arange(L - t, L, device=device) for L in lens])
            q = client.absorbed_q(hs, pos)
            seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
            sched, _ = flash_mla.get_mla_metadata()
            o_lat, _lse = flash_mla.flash_mla_with_kvcache(
                q, k_cache, block_table, seqlens, KV_LORA_RANK, sched, softmax_scale=attn.scaling, causal=True)
            ours = client.output(o_lat)
            ref = torch.stack([prefill_out[i, L - t : L] for i, L in enumerate(lens)])
            ref32 = None
            if attn32 is not None:
                out32 = eager_forward(attn32, rotary, [x[:L].float() for x, L in zip(tokens, lens)])
                ref32 = torch.stack([out32[i, L - t : L] for i, L in enumerate(lens)])
            report("prefill", t, lens, ours, ref, ref32)

        # ---- decode steps
        for step in range(steps):
            cur = [L + step for L in lens]  # position of the new token
            hs = torch.stack([tokens[i][p : p + 1] for i, p in enumerate(cur)])  # (b, 1, hidden)
            pos = torch.tensor(cur, device=device)[:, None]
            new_lat = client.latent_kv(hs, pos)  # (b, 1, 576)
            for i, p in enumerate(cur):
                store(i, p, new_lat[i])
            q = client.absorbed_q(hs, pos)  # (b, 1, h, 576)
            seqlens = torch.tensor([p + 1 for p in cur], dtype=torch.int32, device=device)
            sched, _ = flash_mla.get_mla_metadata()  # lengths changed: a fresh scheduler object
            o_lat, _lse = flash_mla.flash_mla_with_kvcache(
                q, k_cache, block_table, seqlens, KV_LORA_RANK, sched, softmax_scale=attn.scaling, causal=False)
            ours = client.output(o_lat)[:, 0]  # (b, hidden)

            seqs = [tokens[i][: p + 1] for i, p in enumerate(cur)]
            full = eager_forward(attn, rotary, seqs)
            ref = torch.stack([full[i, p] for i, p in enumerate(cur)])
            ref32 = None
            if attn32 is not None:
                full32 = eager_forward(attn32, rotary, [x.float() for x in seqs])
                ref32 = torch.stack([full32[i, p] for i, p in enumerate(cur)])
            report(f"decode {step}", 1, [p + 1 for p in cur], ours, ref, ref32)

    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
