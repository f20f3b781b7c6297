"""The benchmark's model: a Qwen3-MoE-shaped decoder whose MoE blocks are all-to-all expert parallelism.

    cfg = QWEN3_30B_A3B.with_(layers=8)
    model = FullModel(cfg, group_name)                      # this rank's experts, everything else replicated
    h_TH = model.hidden_states(tokens_T, run_layer)          # run_layer(layer, x_TH) -> x_TH: eager, checkpoint, compiled
    loss = model.loss(h_TH, targets_T)                       # LM head + cross-entropy in checkpointed chunks

Each layer is ``x + attn(norm(x))`` (``attention_block``), then ``x + moe(norm(x))`` (``moe_block``): RMSNorm,
grouped-query causal attention through ``scaled_dot_product_attention`` (``enable_gqa``) with rotary embeddings
and Qwen3's per-head q/k RMSNorm, RMSNorm, and the reference ``AllToAllMoE`` (Qwen3 router, SwiGLU experts).
Tokens travel as ``(T, H)``: ``T = B * S`` tokens per rank, ``B`` packed sequences of ``cfg.seq_len`` each
(attention is causal within a sequence), so the token count is one dimension that Dynamo can keep symbolic.

The loss never holds the ``(T, V)`` logits: the LM head and cross-entropy run on ``cfg.loss_chunk`` tokens at a
time under ``torch.utils.checkpoint`` (recomputed in backward), as long-context training does.

Legend: T tokens per rank, B sequences, S sequence length, H hidden, N query heads, G KV heads, D head dim,
V vocabulary, E experts, K top-k, F expert FFN width, C loss chunk.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from relay_compile.bench.configs import DTYPES
from relay_compile.reference import AllToAllMoE

__all__ = ["QWEN3_30B_A3B", "TINY_MODEL", "DecoderLayer", "FullModel", "FullModelConfig", "LayerRunner", "fused_gqa"]


@dataclass(frozen=True, kw_only=True)
class FullModelConfig:
    """Sizes of the model and its data on one rank of an EP group of ``ep`` ranks (``experts`` is global)."""

    name: str
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    ffn: int
    experts: int
    top_k: int
    ep: int
    seq_len: int
    loss_chunk: int
    dtype: str = "bf16"
    device: str = "cuda"
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.experts % self.ep:
            raise ValueError(f"FullModelConfig {self.name}: experts={self.experts} is not a multiple of ep={self.ep}")
        if self.heads % self.kv_heads:
            raise ValueError(f"FullModelConfig {self.name}: heads={self.heads} is not a multiple of "
                             f"kv_heads={self.kv_heads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def label(self) -> str:
        return (f"{self.name}: {self.layers} layers, H={self.hidden}, {self.heads}q/{self.kv_heads}kv heads x "
                f"{self.head_dim}, E={self.experts} K={self.top_k} F={self.ffn}, V={self.vocab}, EP={self.ep}, "
                f"sequences of {self.seq_len}, {self.dtype} on {self.device}")

    def with_(self, **changes: Any) -> FullModelConfig:
        return dataclasses.replace(self, **changes)


# Qwen3-30B-A3B's shapes (hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8, expert FFN 768,
# vocabulary 151936, rope theta 1e6); the layer count is the benchmark's choice (the real model has 48).
QWEN3_30B_A3B = FullModelConfig(
    name="Qwen3-30B-A3B-shaped", vocab=151_936, hidden=2048, heads=32, kv_heads=4, head_dim=128, layers=8,
    ffn=768, experts=128, top_k=8, ep=8, seq_len=4096, loss_chunk=1024,
)
# A CPU-sized model of the same structure, for tests.
TINY_MODEL = FullModelConfig(
    name="tiny", vocab=512, hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, ffn=32, experts=16, top_k=4,
    ep=4, seq_len=64, loss_chunk=64, dtype="fp32", device="cpu",
)


def _rope_cos_sin(seq_len: int, head_dim: int, theta: float, like: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary tables ``(S, D)`` in ``like``'s dtype: position s, frequency i repeated for both halves."""
    inv_freq_D2 = theta ** -(torch.arange(0, head_dim, 2, device=like.device, dtype=torch.float32) / head_dim)
    angles_SD2 = torch.arange(seq_len, device=like.device, dtype=torch.float32)[:, None] * inv_freq_D2[None, :]
    angles_SD = torch.cat([angles_SD2, angles_SD2], dim=-1)
    return angles_SD.cos().to(like.dtype), angles_SD.sin().to(like.dtype)


def _apply_rope(x_BNSD: Tensor, cos_SD: Tensor, sin_SD: Tensor) -> Tensor:
    """Rotate-half rotary embedding (Llama/Qwen layout), in ``x``'s dtype."""
    half = x_BNSD.shape[-1] // 2
    rotated_BNSD = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return x_BNSD * cos_SD + rotated_BNSD * sin_SD


@functools.cache
def fused_gqa(device_type: str) -> bool:
    """Whether SDPA's fused CUDA kernels (flash, cuDNN) take fewer KV heads than query heads; True off CUDA.

    Where they do not, ``Attention`` repeats the KV heads (more memory) rather than let SDPA fall back to its
    math kernel, which holds (S, S) scores per head.
    """
    if device_type != "cuda":
        return True
    q_BNSD = torch.randn(1, 4, 128, 64, device=device_type, dtype=torch.bfloat16)
    kv_BGSD = torch.randn(1, 2, 128, 64, device=device_type, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            nnf.scaled_dot_product_attention(q_BNSD, kv_BGSD, kv_BGSD, is_causal=True, enable_gqa=True)
    except RuntimeError:
        return False
    return True


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings and per-head q/k RMSNorm (Qwen3), no biases."""

    def __init__(self, cfg: FullModelConfig, **factory: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.repeat_kv = not fused_gqa(torch.device(factory["device"]).type)
        q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, q_dim, bias=False, **factory)
        self.k_proj = nn.Linear(cfg.hidden, kv_dim, bias=False, **factory)
        self.v_proj = nn.Linear(cfg.hidden, kv_dim, bias=False, **factory)
        self.o_proj = nn.Linear(q_dim, cfg.hidden, bias=False, **factory)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps, **factory)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps, **factory)

    def _heads(self, x_TX: Tensor, heads: int) -> Tensor:
        """``(T, heads * D) -> (B, heads, S, D)``."""
        return x_TX.view(-1, self.cfg.seq_len, heads, self.cfg.head_dim).transpose(1, 2)

    def forward(self, x_TH: Tensor) -> Tensor:
        cfg = self.cfg
        q_BNSD = self.q_norm(self._heads(self.q_proj(x_TH), cfg.heads))
        k_BGSD = self.k_norm(self._heads(self.k_proj(x_TH), cfg.kv_heads))
        v_BGSD = self._heads(self.v_proj(x_TH), cfg.kv_heads)
        cos_SD, sin_SD = _rope_cos_sin(cfg.seq_len, cfg.head_dim, cfg.rope_theta, x_TH)
        q_BNSD, k_BGSD = _apply_rope(q_BNSD, cos_SD, sin_SD), _apply_rope(k_BGSD, cos_SD, sin_SD)
        if self.repeat_kv:
            group = cfg.heads // cfg.kv_heads
            k_BGSD, v_BGSD = k_BGSD.repeat_interleave(group, dim=1), v_BGSD.repeat_interleave(group, dim=1)
        out_BNSD = nnf.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True,
                                                   enable_gqa=not self.repeat_kv)
        return self.o_proj(out_BNSD.transpose(1, 2).reshape(x_TH.shape[0], cfg.heads * cfg.head_dim))


class DecoderLayer(nn.Module):
    """``attention_block`` then ``moe_block``; each adds its branch to the residual stream ``(T, H)``."""

    def __init__(self, cfg: FullModelConfig, group_name: str | None, seed: int, **factory: Any) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, **factory)
        self.attn = Attention(cfg, **factory)
        self.moe_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, **factory)
        # torch._grouped_mm's fake kernel demands bf16 under torch.compile: other dtypes loop over experts.
        grouped = None if cfg.torch_dtype == torch.bfloat16 else False
        self.moe = AllToAllMoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, group_name, seed=seed,
                               use_grouped_mm=grouped, **factory)

    def attention_block(self, x_TH: Tensor) -> Tensor:
        return x_TH + self.attn(self.attn_norm(x_TH))

    def moe_block(self, x_TH: Tensor) -> Tensor:
        return x_TH + self.moe(self.moe_norm(x_TH))

    def forward(self, x_TH: Tensor) -> Tensor:
        return self.moe_block(self.attention_block(x_TH))


# How a training step runs one layer: ``run_layer(layer, x_TH) -> x_TH`` (eager, checkpointed, compiled).
LayerRunner = Callable[[DecoderLayer, Tensor], Tensor]


def _chunk_loss_sum(model: FullModel, h_CH: Tensor, targets_C: Tensor) -> Tensor:
    logits_CV = model.lm_head(model.norm(h_CH))
    return nnf.cross_entropy(logits_CV.float(), targets_C, reduction="sum")


class FullModel(nn.Module):
    """Embedding, ``cfg.layers`` decoder layers, final RMSNorm, untied LM head (see the module docstring).

    Args:
        cfg: sizes, dtype and device (parameters are created there).
        group_name: the EP group of every MoE block, by name (compiled code keeps a str as a constant; Dynamo
            cannot proxy the stand-in group object), None for one process.
    """

    def __init__(self, cfg: FullModelConfig, group_name: str | None) -> None:
        super().__init__()
        self.cfg = cfg
        factory: dict[str, Any] = {"dtype": cfg.torch_dtype, "device": torch.device(cfg.device)}
        torch.manual_seed(cfg.seed)  # the replicated parameters' default initialization, on their device
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, group_name, cfg.seed * 1000 + 1 + i, **factory) for i in range(cfg.layers)
        )
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, **factory)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, **factory)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def expert_parameters(self) -> list[nn.Parameter]:
        """This rank's experts: their gradients arrive complete (the all-to-all or ring brings every rank's)."""
        return [p for layer in self.decoder_layers() for p in (layer.moe.w1, layer.moe.w2, layer.moe.w3)
                if p is not None]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds alike: their gradients must be reduced over the EP group."""
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]

    def hidden_states(self, tokens_T: Tensor, run_layer: LayerRunner) -> Tensor:
        """The last layer's output ``(T, H)`` for ``T`` tokens (``B`` packed sequences of ``cfg.seq_len``)."""
        if tokens_T.shape[0] % self.cfg.seq_len:
            raise ValueError(f"FullModel: {tokens_T.shape[0]} tokens are not whole sequences of {self.cfg.seq_len}")
        x_TH = self.embed(tokens_T)
        for layer in self.decoder_layers():
            x_TH = run_layer(layer, x_TH)
        return x_TH

    def loss(self, h_TH: Tensor, targets_T: Tensor) -> Tensor:
        """Mean next-token cross-entropy; logits exist for ``cfg.loss_chunk`` tokens at a time (checkpointed)."""
        total = h_TH.new_zeros((), dtype=torch.float32)
        for h_CH, targets_C in zip(h_TH.split(self.cfg.loss_chunk), targets_T.split(self.cfg.loss_chunk),
                                   strict=True):
            total = total + checkpoint(_chunk_loss_sum, self, h_CH, targets_C, use_reentrant=False)
        return total / targets_T.shape[0]
