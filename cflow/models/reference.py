"""PipelineNativeLM: the PyTorch reference of docs/DESIGN.md's pipeline-native layer, the oracle for everything.

Full-sequence forward (training) and incremental decode with a KV cache share one code path:
`forward(ids, cache)` runs T new tokens after the cache's positions. The delay buffers (streams
a_j and expert outputs e_j) live within one call: no state but the KV cache crosses tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ir.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables in the Hugging Face (rotate-half) convention, so HF Llama weights run unchanged."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.wq = nn.Linear(c.d_model, c.n_heads * hd, bias=c.attn_bias)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * hd, bias=c.attn_bias)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * hd, bias=c.attn_bias)
        self.wo = nn.Linear(c.n_heads * hd, c.d_model, bias=False)

    def forward(self, h: torch.Tensor, pos0: int, kv: tuple | None) -> tuple[torch.Tensor, tuple]:
        """h: [B, T, d]; kv: cached (k, v) [B, n_kv, S, hd] or None. Returns output and the new cache."""
        c, (B, T, _) = self.c, h.shape
        hd = c.head_dim
        q = self.wq(h).view(B, T, c.n_heads, hd).transpose(1, 2)
        k = self.wk(h).view(B, T, c.n_kv_heads, hd).transpose(1, 2)
        v = self.wv(h).view(B, T, c.n_kv_heads, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(torch.arange(pos0, pos0 + T), hd, c.rope_theta)
        q, k = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        if kv is not None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        S = k.shape[2]
        rep = c.n_heads // c.n_kv_heads
        kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # Causal over absolute positions: query at pos0 + i sees keys 0 .. pos0 + i.
        mask = torch.arange(S)[None, :] <= (pos0 + torch.arange(T))[:, None]
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        out = out.transpose(1, 2).reshape(B, T, c.n_heads * hd)
        return self.wo(out), (k, v)


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d, hidden, bias=False)
        self.w_up = nn.Linear(d, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    """Router -> softmax -> top-k (renormalised or not) -> SwiGLU experts, plus an optional shared expert."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        E, d, i = c.n_experts, c.d_model, c.expert_dim
        self.router = nn.Linear(d, E, bias=False)
        # Stacked expert weights [E, out, in] (one Linear's weight per expert).
        self.w_gate = nn.Parameter(torch.empty(E, i, d))
        self.w_up = nn.Parameter(torch.empty(E, i, d))
        self.w_down = nn.Parameter(torch.empty(E, d, i))
        for w, fan_in in ((self.w_gate, d), (self.w_up, d), (self.w_down, i)):
            nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        self.shared = SwiGLU(d, c.shared_expert_dim) if c.shared_expert_dim else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if c.shared_expert_gate else None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.router(h).float(), dim=-1)
        w, idx = torch.topk(probs, self.c.top_k, dim=-1)
        if self.c.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(h.dtype), idx

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        w, idx = self.route(x)
        out = torch.zeros_like(x)
        for e in range(self.c.n_experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            ye = F.linear(F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e]), self.w_down[e])
            out.index_add_(0, tok, ye * w[tok, slot, None])
        return self.add_shared(x, out).reshape(shape)

    def add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + the shared expert's output (gated by sigmoid if the model has a gate)."""
        if self.shared is None:
            return out
        s = self.shared(x)
        if self.shared_gate is not None:
            s = s * torch.sigmoid(self.shared_gate(x))
        return out + s


class Block(nn.Module):
    """One weight block: attention, dense FFN and MoE with their pre-norms. Arch5 runs a block twice."""

    def __init__(self, c: ModelConfig, has_dense: bool, has_moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps) if has_dense else None
        self.ffn = SwiGLU(c.d_model, c.ffn_dim) if has_dense else None
        self.moe_norm = RMSNorm(c.d_model, c.norm_eps) if has_moe else None
        self.moe = MoE(c) if has_moe else None


class PipelineNativeLM(nn.Module):
    """docs/DESIGN.md's reference model:

        a_l = x_{l-1} + Attn_l(norm_attn_l(x_{l-1}))
        b_l = a_l + Dense_l(norm_ffn_l(a_{l-dd}))          (a_j = x_0 for j <= 0)
        e_l = MoE_l(norm_moe_l(b_l or a_l))                 (post- or pre-dense routing)
        x_l = b_l + e_{l-de}                                (e_j = 0 for j < 1)
        logits = head(norm_final(x_L + e_{L-de+1} + ... + e_L))
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.d_model)
        # Block i serves layers i+1, i+1+n_blocks, ...: its FFN kinds come from its first layer
        # (the config forbids per-layer masks together with sharing).
        self.blocks = nn.ModuleList(Block(c, c.has_dense(i + 1), c.has_moe(i + 1)) for i in range(c.n_blocks))
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.normal_(m.bias, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, ids: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        """ids: [B, T] (or [T]) new tokens. cache: None (no caching) or a list, filled/updated in place
        with one (k, v) per layer. Returns logits [B, T, vocab] (or [T, vocab])."""
        c = self.config
        squeeze = ids.dim() == 1
        if squeeze:
            ids = ids[None]
        pos0 = 0 if not cache else cache[0][0].shape[2]
        if pos0 + ids.shape[1] > c.max_seq_len:
            raise ValueError(f"sequence of {pos0 + ids.shape[1]} tokens exceeds max_seq_len={c.max_seq_len}")
        x0 = self.tok_embeddings(ids)
        a = {0: x0}  # post-attention streams by layer (a_0 = x_0 serves every j <= 0)
        e: dict[int, torch.Tensor] = {}  # expert outputs by layer, consumed de layers later
        x = x0
        for layer in range(1, c.n_layers + 1):
            blk = self.blocks[c.block_of(layer)]
            kv = cache[layer - 1] if cache and len(cache) >= layer else None
            t, new_kv = blk.attn(blk.attn_norm(x), pos0, kv)
            if cache is not None:
                if len(cache) >= layer:
                    cache[layer - 1] = new_kv
                else:
                    cache.append(new_kv)
            a[layer] = x + t
            b = a[layer]
            if blk.ffn is not None:
                b = b + blk.ffn(blk.ffn_norm(a[max(layer - c.dense_delay, 0)]))
            if blk.moe is not None:
                e[layer] = blk.moe(blk.moe_norm(b if c.routing == "post" else a[layer]))
            x = b
            if layer - c.expert_delay in e:
                x = x + e[layer - c.expert_delay]
        # Flush the injections still pending after the last layer.
        for j in range(c.n_layers - c.expert_delay + 1, c.n_layers + 1):
            if c.expert_delay and j in e:
                x = x + e[j]
        logits = F.linear(self.norm(x), self.head_weight())
        return logits[0] if squeeze else logits

    @torch.no_grad()
    def generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy decode with the KV cache (the reference for runtime generations)."""
        cache: list = []
        out = list(ids)
        logits = self.forward(torch.tensor(ids), cache)
        for _ in range(max_new_tokens):
            nxt = int(logits[-1].argmax())
            out.append(nxt)
            if len(out) >= self.config.max_seq_len:
                break
            logits = self.forward(torch.tensor([nxt]), cache)
        return out
