"""Issue 11's combinations, through ``torch.compile(model, backend="relaymoe")`` alone: two MoE layers in one
graph, shared experts beside routed experts, the block under ``torch.utils.checkpoint``, and an EP group that is
a sub-group of a larger world. Each region is rewritten into a ring and three SGD steps equal eager (fp32, 1e-5
of scale; ``Idioms.check_rewritten_and_equal_to_eager``), with no all-to-all in the profile of a compiled step.
Under ``torch.utils.checkpoint`` (the block alone, or a whole transformer layer: attention + MoE) the region is
rewritten inside the checkpoint's body (``passes.scopes``), and the ring runs once forward and once backward.

Legend: T tokens per rank, H hidden, F expert FFN width, E experts, K top-k, Fs shared-expert width, A heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.testing._internal.common_utils import run_tests

from relay_compile.backend import compiled_reports
from relay_compile.reference import AllToAllMoE, Group
from tests.passes.test_idioms import E, F, H, Idioms, K, T

FS = 12
A = 2


def moe(group: Group, seed: int, shared_ffn: int = 0) -> AllToAllMoE:
    # fp32 without torch._grouped_mm: its fake kernel demands bf16 under compile (docs/ARCHITECTURE.md section 5).
    return AllToAllMoE(H, F, E, K, group=group, shared_ffn=shared_ffn, seed=seed, use_grouped_mm=False)


class TwoMoE(nn.Module):
    """Two residual MoE blocks in a row: one graph, two regions."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.first, self.second = moe(group, seed=3), moe(group, seed=4)

    def forward(self, x_TH: Tensor) -> Tensor:
        h_TH = x_TH + self.first(x_TH)
        return h_TH + self.second(h_TH)


class CheckpointedMoE(nn.Module):
    """The block under non-reentrant activation checkpointing (recomputed in backward)."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.block = moe(group, seed=6)

    def forward(self, x_TH: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x_TH, use_reentrant=False)


class Layer(nn.Module):
    """A post-norm transformer layer: causal attention over the rank's T tokens, then the MoE block, each with a
    residual and an RMSNorm after it (so the backward of the last norm reads the MoE block's output)."""

    def __init__(self, group: Group, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.wqkv_3HH = nn.Parameter(torch.randn(3 * H, H, generator=gen) / H**0.5)
        self.wo_HH = nn.Parameter(torch.randn(H, H, generator=gen) / H**0.5)
        self.moe = moe(group, seed=seed)

    def forward(self, x_TH: Tensor) -> Tensor:
        q_ATD, k_ATD, v_ATD = (t.view(T, A, H // A).transpose(0, 1) for t in (x_TH @ self.wqkv_3HH.T).chunk(3, -1))
        attn_TH = nn.functional.scaled_dot_product_attention(q_ATD, k_ATD, v_ATD, is_causal=True)
        h_TH = nn.functional.rms_norm(x_TH + attn_TH.transpose(0, 1).reshape(T, H) @ self.wo_HH.T, (H,))
        return nn.functional.rms_norm(h_TH + self.moe(h_TH), (H,))


class CheckpointedLayers(nn.Module):
    """Full activation checkpointing (torchtitan's ``full`` AC, Megatron's full recompute): each whole layer
    under ``torch.utils.checkpoint``, so each MoE block sits in a checkpoint body with the attention."""

    def __init__(self, group: Group, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(group, seed=20 + i) for i in range(layers))

    def forward(self, x_TH: Tensor) -> Tensor:
        for layer in self.layers:
            x_TH = torch.utils.checkpoint.checkpoint(layer, x_TH, use_reentrant=False)
        return x_TH


class CombinationsWorld2(Idioms):
    def test_two_layers_and_shared_experts_are_rewritten_and_train_like_eager(self) -> None:
        group = self.init_pg()
        self.check_rewritten_and_equal_to_eager(lambda: TwoMoE(group), "two MoE layers in one graph", regions=2)
        self.check_rewritten_and_equal_to_eager(lambda: moe(group, seed=5, shared_ffn=FS),
                                                "shared experts beside routed experts")

    def test_block_under_activation_checkpointing_is_rewritten_and_trains_like_eager(self) -> None:
        group = self.init_pg()
        self.check_rewritten_and_equal_to_eager(lambda: CheckpointedMoE(group), "MoE block under checkpoint")
        # The ring's output is saved, not recomputed: the profile shows one forward ring per layer
        # (check_step_events), though the post-norm's backward reads it.
        self.check_rewritten_and_equal_to_eager(lambda: CheckpointedLayers(group, layers=2),
                                                "attention + MoE layers, each under checkpoint", regions=2)
        (graph,) = compiled_reports()[-1:]
        self.assertEqual([r.anchor.split(".")[0] for r in graph.regions], ["wrap_body_0", "wrap_body_1"])


class CombinationsWorld4(Idioms):
    @property
    def world_size(self) -> int:
        return 4

    def test_ep_sub_group_of_a_larger_world_is_rewritten_and_trains_like_eager(self) -> None:
        self.init_pg()
        # EP inside data parallelism: two EP groups of 2; every rank creates both, uses its own.
        ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group = ep_groups[self.rank // 2]
        self.check_rewritten_and_equal_to_eager(lambda: moe(group, seed=7), "EP sub-group [0, 1] / [2, 3]")
        (region,) = compiled_reports()[-1].regions
        self.assertEqual((region.group_name, region.group_size), (group.group_name, 2))  # the ring runs in it


if __name__ == "__main__":
    run_tests()
