"""The reference all-to-all MoE layer equals the dense one-process loop, at world sizes 1, 2 and 4.

Every rank builds the same global problem from one seed (all ranks' tokens, routing, upstream gradient and all
experts' weights), runs its share through ``a2a_moe``, and compares output and gradients with its slice of
``dense_moe`` on the whole problem.

Legend: T tokens (per rank), K top-k, H hidden, F expert FFN width, E experts, L local experts, G global tokens.
"""

from __future__ import annotations

import unittest
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch._dynamo.testing import CompileCounterWithBackend

from relay_compile.reference import AllToAllMoE, a2a_moe, dense_moe, dense_moe_block, moe_weights
from tests.distributed import DistributedTestCase

H, F, E = 16, 8, 8
RTOL, ATOL = 1e-5, 1e-5


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One global MoE problem: every rank's tokens and routing, upstream gradient, all experts' weights."""

    tokens: list[int]
    x_GH: Tensor
    ids_GK: Tensor
    scores_GK: Tensor
    grad_GH: Tensor
    weights: dict[str, Tensor]

    def rows(self, rank: int) -> slice:
        start = sum(self.tokens[:rank])
        return slice(start, start + self.tokens[rank])


def _routing(kind: str, num_tokens: int, top_k: int, world: int, gen: torch.Generator) -> Tensor:
    """Global expert ids ``(G, K)`` of one routing pattern."""
    logits_GE = torch.rand(num_tokens, E, generator=gen)
    num_local = E // world
    if kind == "random":
        pass
    elif kind == "one_expert":  # every token's first choice is the last expert
        logits_GE[:, E - 1] += 2.0
    elif kind == "one_rank":  # all pairs on rank 0: the other ranks receive nothing
        logits_GE[:, :num_local] += 2.0
    elif kind == "skewed":  # uneven counts; the last experts get no pairs
        logits_GE -= torch.arange(E) * 0.6
    elif kind == "duplicate":  # every pair of every token on expert 1 (ids repeat inside a token)
        return torch.ones(num_tokens, top_k, dtype=torch.int64)
    else:
        raise ValueError(f"unknown routing {kind!r}")
    return logits_GE.topk(top_k, dim=-1).indices


def _problem(
    tokens: list[int], top_k: int, routing: str, world: int, activation: str = "swiglu", seed: int = 0
) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(tokens)
    return Problem(
        tokens=tokens,
        x_GH=torch.randn(num_tokens, H, generator=gen),
        ids_GK=_routing(routing, num_tokens, top_k, world, gen),
        scores_GK=torch.rand(num_tokens, top_k, generator=gen),
        grad_GH=torch.randn(num_tokens, H, generator=gen),
        weights=moe_weights(seed, H, F, E, activation=activation),
    )


def _leaves(*tensors: Tensor | None) -> list[Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _dense_results(p: Problem, activation: str) -> dict[str, Tensor]:
    """Output and gradients of ``dense_moe`` on the whole problem."""
    x, scores, w1, w2, w3 = _leaves(p.x_GH, p.scores_GK, p.weights["w1"], p.weights["w2"], p.weights.get("w3"))
    y = dense_moe(x, p.ids_GK, scores, w1, w2, w3, activation)
    y.backward(p.grad_GH)
    out = {"y": y.detach(), "x": x.grad, "scores": scores.grad, "w1": w1.grad, "w2": w2.grad}
    if w3 is not None:
        out["w3"] = w3.grad
    return out


def _a2a_results(
    p: Problem, rank: int, world: int, group: dist.ProcessGroup | None, activation: str, **kwargs: object
) -> dict[str, Tensor]:
    """Output and gradients of ``a2a_moe`` on this rank's share (``kwargs`` go to ``a2a_moe``)."""
    rows, num_local = p.rows(rank), E // world
    experts = slice(rank * num_local, (rank + 1) * num_local)
    w3_all = p.weights.get("w3")
    x, scores, w1, w2, w3 = _leaves(
        p.x_GH[rows],
        p.scores_GK[rows],
        p.weights["w1"][experts],
        p.weights["w2"][experts],
        None if w3_all is None else w3_all[experts],
    )
    fn = kwargs.pop("fn", a2a_moe)
    y = fn(x, p.ids_GK[rows], scores, w1, w2, w3, group=group, activation=activation, **kwargs)
    y.backward(p.grad_GH[rows])
    out = {"y": y.detach(), "x": x.grad, "scores": scores.grad, "w1": w1.grad, "w2": w2.grad}
    if w3 is not None:
        out["w3"] = w3.grad
    return out


def _dense_share(dense: dict[str, Tensor], p: Problem, rank: int, world: int) -> dict[str, Tensor]:
    """This rank's slice of the dense results: its tokens' rows, its experts' weight gradients."""
    rows, num_local = p.rows(rank), E // world
    experts = slice(rank * num_local, (rank + 1) * num_local)
    return {k: v[experts] if k.startswith("w") else v[rows] for k, v in dense.items()}


class ReferenceCases:
    """Cases shared by every world size; the class that mixes this in is a ``DistributedTestCase``."""

    top_k: int
    tokens: list[int]

    def _check_routing(self, group: dist.ProcessGroup, routing: str, tokens: list[int], **kwargs: object) -> None:
        activation = str(kwargs.pop("activation", "swiglu"))
        p = _problem(tokens, self.top_k, routing, self.world_size, activation)
        got = _a2a_results(p, self.rank, self.world_size, group, activation, **kwargs)
        want = _dense_share(_dense_results(p, activation), p, self.rank, self.world_size)
        self.assertEqual(sorted(got), sorted(want))
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{routing} {tokens} {name}: {m}"
            )

    def test_a2a_moe_forward_and_gradients_equal_dense_moe_for_random_and_adversarial_routing(self) -> None:
        group = self.init_pg()
        for routing in ("random", "one_expert", "one_rank", "skewed", "duplicate"):
            self._check_routing(group, routing, self.tokens)
        self._check_routing(group, "random", self.tokens, activation="gelu", use_grouped_mm=False)
        self._check_routing(group, "one_rank", [0] + self.tokens[1:])  # a rank without tokens

    def test_all_to_all_moe_with_shared_expert_equals_the_dense_block_forward_and_backward(self) -> None:
        group = self.init_pg()
        seed, batch, seq = 7, 2, 8
        moe = AllToAllMoE(H, F, E, self.top_k, group=group, shared_ffn=12, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        x_BSH = torch.randn(self.world_size, batch, seq, H, generator=gen).requires_grad_()
        y_BSH = moe(x_BSH[self.rank])
        y_BSH.square().sum().backward()

        weights = {k: v.requires_grad_() for k, v in moe.full_weights(seed).items()}
        x_ref = x_BSH.detach().clone().requires_grad_()
        y_ref = dense_moe_block(x_ref.view(-1, seq, H), weights, self.top_k).view_as(x_ref)
        # Replicated parameters and x get this rank's loss only; experts get every rank's.
        replicated = ["gate", "shared_w1", "shared_w2", "shared_w3"]
        local_grads = torch.autograd.grad(
            y_ref[self.rank].square().sum(), [x_ref] + [weights[k] for k in replicated], retain_graph=True
        )
        y_ref.square().sum().backward()

        num_local = E // self.world_size
        experts = slice(self.rank * num_local, (self.rank + 1) * num_local)
        torch.testing.assert_close(y_BSH, y_ref[self.rank], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(x_BSH.grad, local_grads[0], rtol=RTOL, atol=ATOL)
        got = [moe.router.weight.grad] + [getattr(moe, k).grad for k in replicated[1:]]
        for name, g, want in zip(replicated, got, local_grads[1:]):
            torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL, msg=name)
        for name in ("w1", "w2", "w3"):
            torch.testing.assert_close(getattr(moe, name).grad, weights[name].grad[experts], rtol=RTOL, atol=ATOL)


class ReferenceWorld2Test(ReferenceCases, DistributedTestCase):
    top_k = 4
    tokens = [24, 40]

    @property
    def world_size(self) -> int:
        return 2

    def test_compiled_a2a_moe_is_one_graph_with_three_all_to_alls_and_matches_eager(self) -> None:
        group = self.init_pg()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(a2a_moe, backend=counter, fullgraph=True)
        # The split sizes come from .tolist(): without this, Dynamo breaks the graph there.
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            for routing in ("random", "skewed", "one_rank"):
                p = _problem(self.tokens, self.top_k, routing, self.world_size)
                want = _a2a_results(p, self.rank, self.world_size, group, "swiglu", use_grouped_mm=False)
                # use_grouped_mm=False: torch._grouped_mm's fake kernel demands bf16 under compile.
                got = _a2a_results(p, self.rank, self.world_size, group, "swiglu", use_grouped_mm=False, fn=compiled)
                for name in want:
                    torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=routing)
        self.assertEqual(counter.frame_count, 1)  # no recompile across routings: the splits are unbacked
        a2a = torch.ops._c10d_functional.all_to_all_single  # Dynamo records the packet
        num_a2a = sum(node.target is a2a for node in counter.graphs[0].graph.nodes)
        self.assertEqual(num_a2a, 3)  # counts, dispatch, combine
        # The group by name, compiled (what the bench passes, docs/ARCHITECTURE.md section 5): the default
        # group's result.
        p = _problem(self.tokens, self.top_k, "skewed", self.world_size)
        compiled_by_name = torch.compile(a2a_moe, backend="aot_eager", fullgraph=True)
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            by_name = _a2a_results(p, self.rank, self.world_size, dist.group.WORLD.group_name, "swiglu",
                                   use_grouped_mm=False, fn=compiled_by_name)
        default = _a2a_results(p, self.rank, self.world_size, None, "swiglu", use_grouped_mm=False)
        for name in default:
            torch.testing.assert_close(by_name[name], default[name], rtol=RTOL, atol=ATOL, msg=f"by name: {name}")

class ReferenceWorld4Test(ReferenceCases, DistributedTestCase):
    top_k = 2
    tokens = [16, 24, 5, 32]

    @property
    def world_size(self) -> int:
        return 4


class ReferenceWorld1Test(unittest.TestCase):
    """Without a process group: no collectives, the same math."""

    def test_a2a_moe_without_a_process_group_equals_dense_moe(self) -> None:
        for routing in ("random", "one_expert", "skewed", "duplicate"):
            for use_grouped_mm in (None, False):
                p = _problem([48], 3, routing, 1)
                got = _a2a_results(p, 0, 1, None, "swiglu", use_grouped_mm=use_grouped_mm)
                want = _dense_results(p, "swiglu")
                for name in want:
                    torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=routing)

    def test_all_to_all_moe_block_equals_the_dense_block_without_a_process_group(self) -> None:
        moe = AllToAllMoE(H, F, E, 2, shared_ffn=8, seed=3, activation="silu")
        x_BSH = torch.randn(2, 16, H)
        want = dense_moe_block(x_BSH, moe.full_weights(3), 2, activation="silu")
        torch.testing.assert_close(moe(x_BSH), want, rtol=RTOL, atol=ATOL)

    def test_init_weights_is_the_same_for_every_expert_layout(self) -> None:
        full = moe_weights(5, H, F, E)
        shard = moe_weights(5, H, F, E, experts=range(4, 6))
        torch.testing.assert_close(shard["w2"], full["w2"][4:6], rtol=0, atol=0)
        torch.testing.assert_close(shard["gate"], full["gate"], rtol=0, atol=0)

    def test_a2a_moe_rejects_an_unknown_activation(self) -> None:
        p = _problem([8], 2, "random", 1)
        with self.assertRaisesRegex(ValueError, "a2a_moe: activation='tanh' is not one of"):
            a2a_moe(p.x_GH, p.ids_GK, p.scores_GK, p.weights["w1"], p.weights["w2"], activation="tanh")


if __name__ == "__main__":
    unittest.main()
