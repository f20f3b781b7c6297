"""A small Qwen3-style MoE transformer whose MoE blocks are expert-parallel through all-to-alls.

    model = MoETransformer(MoEModelConfig(), group=ep_group, seed=0)
    logits_BSV = model(tokens_BS)

Each layer is ``x + attn(norm(x))``, then ``x + moe(norm(x))``: RMSNorm, causal self-attention through
``torch.nn.functional.scaled_dot_product_attention`` with rotary embeddings and Qwen3's per-head q/k RMSNorm,
RMSNorm, and the reference ``AllToAllMoE`` block (router, experts, optional shared expert). A final RMSNorm and
an untied LM head give the logits.

Under expert parallelism every rank holds all non-expert parameters (``replicated_parameters``: embedding,
attention, norms, routers, shared experts, LM head), identical on every rank, and only its own experts
(``expert_parameters``: ``w1``/``w2``/``w3`` of each block). The model code is unmodified all-to-all EP: the
``relaymoe`` backend finds the MoE blocks in its graph and runs them as rings.

Initialization is a pure function of ``seed``: the same on every rank, on every device, and for every EP size
(each expert's weights come from ``moe_weights``, see ``relay_compile.reference``).

Legend: B batch, S sequence, H hidden, N heads, D head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch import Tensor, nn

from relay_compile.reference import AllToAllMoE

__all__ = ["MoEModelConfig", "MoETransformer"]


@dataclass(frozen=True, kw_only=True)
class MoEModelConfig:
    """Sizes of the model (global: ``experts`` is the number of experts of the whole EP group)."""

    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    # Expert FFN width.
    ffn: int = 32
    experts: int = 8
    top_k: int = 4
    # Width of the replicated SwiGLU shared expert; 0: none (Qwen3-MoE has none, Qwen2-MoE has one).
    shared_ffn: int = 0
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """Rotary tables ``(S, D)``: position s, frequency i repeated for both halves of the head."""
    inv_freq_D2 = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles_SD2 = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq_D2[None, :]
    angles_SD = torch.cat([angles_SD2, angles_SD2], dim=-1)
    return angles_SD.cos(), angles_SD.sin()


def _apply_rope(x_BNSD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Rotate-half rotary embedding (Llama/Qwen layout)."""
    half = x_BNSD.shape[-1] // 2
    rotated_BNSD = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return (x_BNSD * cos_SD + rotated_BNSD * sin_SD).to(x_BNSD.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings and per-head q/k RMSNorm (Qwen3), no biases."""

    def __init__(self, cfg: MoEModelConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"Attention: hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
        self.heads, self.head_dim, self.rope_theta = cfg.heads, cfg.head_dim, cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)

    def _heads(self, x_BSH: Tensor) -> Tensor:
        batch, seq, _ = x_BSH.shape
        return x_BSH.view(batch, seq, self.heads, self.head_dim)

    def forward(self, x_BSH: Tensor) -> Tensor:
        batch, seq, hidden = x_BSH.shape
        # q/k norms before the transpose, as Qwen3 orders them: on contiguous heads. (Normalizing the transposed
        # view also trips torch 2.11's CUDA `_fused_rms_norm_backward`, whose gradient's strides differ from its
        # fake's, so aot_autograd's backward fails in a `view`: docs/bench/h200-aot-eager.)
        q_BNSD = self.q_norm(self._heads(self.q_proj(x_BSH))).transpose(1, 2)
        k_BNSD = self.k_norm(self._heads(self.k_proj(x_BSH))).transpose(1, 2)
        v_BNSD = self._heads(self.v_proj(x_BSH)).transpose(1, 2)
        cos_SD, sin_SD = _rope_cos_sin(seq, self.head_dim, self.rope_theta, x_BSH.device)
        q_BNSD, k_BNSD = _apply_rope(q_BNSD, cos_SD, sin_SD), _apply_rope(k_BNSD, cos_SD, sin_SD)
        out_BNSD = nnf.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, is_causal=True)
        return self.o_proj(out_BNSD.transpose(1, 2).reshape(batch, seq, hidden))


class DecoderLayer(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + moe(moe_norm(x))``."""

    def __init__(
        self, cfg: MoEModelConfig, group: dist.ProcessGroup | None, seed: int, use_grouped_mm: bool | None
    ) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.moe = AllToAllMoE(
            cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, group, shared_ffn=cfg.shared_ffn, seed=seed,
            use_grouped_mm=use_grouped_mm,
        )

    def forward(self, x_BSH: Tensor) -> Tensor:
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH))
        return x_BSH + self.moe(self.moe_norm(x_BSH))


class MoETransformer(nn.Module):
    """Embedding, ``cfg.layers`` decoder layers, final RMSNorm, LM head: ``forward(tokens_BS) -> logits_BSV``.

    Args:
        cfg: model sizes.
        group: the EP group of every MoE block; None: the default group (or one process).
        seed: initialization seed, identical on every rank.
        use_grouped_mm: passed to each ``AllToAllMoE``; False for fp32 under ``torch.compile`` (the fake kernel
            of ``torch._grouped_mm`` demands bf16), None picks it where it runs.
    """

    def __init__(
        self,
        cfg: MoEModelConfig,
        group: dist.ProcessGroup | None = None,
        *,
        seed: int = 0,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, group, seed * 1000 + 1 + i, use_grouped_mm) for i in range(cfg.layers)
        )
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self._init_replicated(seed)

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's experts: their gradients are complete after backward (the a2a brings every rank's)."""
        return [p for layer in self.layers for p in (layer.moe.w1, layer.moe.w2, layer.moe.w3) if p is not None]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds alike: their gradients must be reduced over the EP group."""
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]

    @torch.no_grad()
    def _init_replicated(self, seed: int) -> None:
        """Embedding ``N(0, 1)``, linear layers ``N(0, 1/fan_in)``, norms 1, from one CPU generator.

        The MoE blocks (router, experts, shared expert) were initialized by ``AllToAllMoE`` from their seeds.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        moe_params = {id(p) for layer in self.layers for p in layer.moe.parameters()}
        for name, p in self.named_parameters():
            if id(p) in moe_params:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # nn.Linear weight (out, in)
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)

    def forward(self, tokens_BS: Tensor) -> Tensor:
        x_BSH = self.embed(tokens_BS)
        for layer in self.layers:
            x_BSH = layer(x_BSH)
        return self.lm_head(self.norm(x_BSH))
