"""passes.split_reads: an all-to-all whose split lists a graph reads element by element takes the tensors instead.

Single process, on the stand-in group (rank 0 of 4 whose peers mirror it: ``bench.standin_group``), so the
functional all-to-alls run; real multi-rank equality of kept regions is in tests/runtime/test_all_to_all.py and of
the released packages' blocks in tests/thirdparty.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from expecttest import TestCase
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from relay_compile.bench.standin_group import standin_group
from relay_compile.passes.host_reads import batch_host_reads
from relay_compile.passes.split_reads import fold_split_reads
from relay_compile.runtime.split_all_to_all import split_all_to_all

WORLD = 4


def dispatcher(x: torch.Tensor, counts_NL: torch.Tensor, group: str) -> torch.Tensor:
    """The dispatchers' idiom (transformers' expert parallelism, the reference layer): the counts exchanged, both
    split lists read with one ``tolist``, the rows sent and returned; ``sum(recv)`` sizes a tensor in between."""
    recv_NL = funcol.wait_tensor(funcol.all_to_all_single(counts_NL.flatten(), None, None, group)).view(WORLD, -1)
    send, recv = torch.stack([counts_NL.sum(1), recv_NL.sum(1)]).tolist()
    for v in send + recv:
        torch._check(v >= 0)
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, recv, send, group))
    ids = torch.arange(recv_NL.numel()).repeat_interleave(recv_NL.flatten(), output_size=sum(recv))
    out = got * (1 + ids.unsqueeze(1))
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(out, send, recv, group))


class _WaitTensor(torch.autograd.Function):
    """transformers' expert parallelism hands the experts ``_WaitTensor.apply(recv_tokens)``: Dynamo traces it to a
    higher-order op whose bodies take the received rows' split sizes as lifted shape symbols."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def dispatcher_with_a_function(x: torch.Tensor, counts_NL: torch.Tensor, group: str) -> torch.Tensor:
    recv_NL = funcol.wait_tensor(funcol.all_to_all_single(counts_NL.flatten(), None, None, group)).view(WORLD, -1)
    send, recv = torch.stack([counts_NL.sum(1), recv_NL.sum(1)]).tolist()
    got = _WaitTensor.apply(funcol.all_to_all_single_autograd(x, recv, send, group))
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(got.sin(), send, recv, group))


def round_trip(x: torch.Tensor, counts_NL: torch.Tensor, group: str) -> torch.Tensor:
    """The rows sent and straight back: the combine's input is the dispatch's wait, which the rewrite erases."""
    recv_NL = funcol.wait_tensor(funcol.all_to_all_single(counts_NL.flatten(), None, None, group)).view(WORLD, -1)
    send, recv = torch.stack([counts_NL.sum(1), recv_NL.sum(1)]).tolist()
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, recv, send, group))
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(got, send, recv, group)) * 2


class _ZerosOfRows(torch.autograd.Function):
    """A function whose backward builds a tensor of the received rows' size: the lifted symbol is read there."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        ctx.rows = t.shape[0]
        return t * 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad + grad.new_zeros(ctx.rows, 1)


def dispatcher_with_a_sized_backward(x: torch.Tensor, counts_NL: torch.Tensor, group: str) -> torch.Tensor:
    recv_NL = funcol.wait_tensor(funcol.all_to_all_single(counts_NL.flatten(), None, None, group)).view(WORLD, -1)
    send, recv = torch.stack([counts_NL.sum(1), recv_NL.sum(1)]).tolist()
    got = _ZerosOfRows.apply(funcol.wait_tensor(funcol.all_to_all_single_autograd(x, recv, send, group)))
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(got, send, recv, group))


def dispatcher_with_an_expert_loop(x: torch.Tensor, counts_NL: torch.Tensor, group: str) -> torch.Tensor:
    """The received rows split by their per-(source, expert) counts, read on their own: torch.split relates those
    reads to the rows received, a relation of the split sizes to other sizes."""
    recv_NL = funcol.wait_tensor(funcol.all_to_all_single(counts_NL.flatten(), None, None, group)).view(WORLD, -1)
    send, recv = torch.stack([counts_NL.sum(1), recv_NL.sum(1)]).tolist()
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, recv, send, group))
    blocks = torch.split(got, recv_NL.flatten().tolist())
    out = torch.cat([b * (i + 1) for i, b in enumerate(blocks)])
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(out, send, recv, group))


def part_of_a_row(x: torch.Tensor, counts_NL: torch.Tensor, group: str) -> torch.Tensor:
    """Split lists that are the first N elements of longer rows: the op would read the whole row."""
    recv_NL = funcol.wait_tensor(funcol.all_to_all_single(counts_NL.flatten(), None, None, group)).view(WORLD, -1)
    padded = torch.nn.functional.pad(torch.stack([counts_NL.sum(1), recv_NL.sum(1)]), (0, 1))
    send, recv = (row[:WORLD] for row in padded.tolist())
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, recv, send, group))


def splits_also_split(x: torch.Tensor, counts_NL: torch.Tensor, group: str) -> torch.Tensor:
    """The received rows split by the same list the all-to-all read: the reads have a use the pass cannot fold."""
    recv_NL = funcol.wait_tensor(funcol.all_to_all_single(counts_NL.flatten(), None, None, group)).view(WORLD, -1)
    send, recv = torch.stack([counts_NL.sum(1), recv_NL.sum(1)]).tolist()
    for v in send + recv:
        torch._check(v >= 0)
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, recv, send, group))
    parts = torch.split(got, recv)
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(
        torch.cat([p * (i + 1) for i, p in enumerate(parts)]), send, recv, group))


PAIRS = 10


def counts(seed: int) -> torch.Tensor:
    """``(N, E_l)``: ``PAIRS`` pairs per destination expert, none to rank 1 (an empty split), uneven elsewhere."""
    experts = torch.tensor([0, 1, 4, 5, 6, 7])
    picks = experts[torch.randint(0, len(experts), (PAIRS,), generator=torch.Generator().manual_seed(seed))]
    return torch.bincount(picks, minlength=2 * WORLD).view(WORLD, 2)


def compiled(fn, fold: bool, fullgraph: bool = True) -> tuple[object, list[fx.GraphModule], list]:
    """``fn`` through aot_autograd with the backend's two passes before it (``fold``: split_reads too); the
    Dynamo graphs after the passes, and what the pass returned."""
    graphs, found = [], []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        batch_host_reads(gm, lambda t: True)
        if fold:
            found.append(fold_split_reads(gm))
        graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=False)

    def run(*args):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return compiled_fn(*args)
    return run, graphs, found


def fwd_bwd(fn, x: torch.Tensor, c: torch.Tensor, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().clone().requires_grad_()
    y = fn(leaf, c, group)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).cos()).sum().backward()
    return y.detach(), leaf.grad


class SplitReadsTest(TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.group = standin_group(WORLD).group_name

    def folded(self, fn, seeds=(3,), fullgraph: bool = True) -> tuple[fx.GraphModule, list, list[str]]:
        """``fn`` compiled with the pass, equal to eager at each seed's counts (one compile: the sizes are read
        per call); its graph, what the pass rewrote, and why it left the rest."""
        run, graphs, found = compiled(fn, fold=True, fullgraph=fullgraph)
        for seed in seeds:
            c, x = counts(seed), torch.randn(PAIRS, 3)
            for got, want in zip(fwd_bwd(run, x, c, self.group), fwd_bwd(fn, x, c, self.group)):
                torch.testing.assert_close(got, want)
        (gm,), [(done, skipped)] = graphs, found
        return gm, done, skipped

    def test_both_all_to_alls_take_the_split_tensors_and_every_read_goes(self) -> None:
        gm, done, skipped = self.folded(dispatcher, seeds=(0, 1, 2))
        self.assertEqual([(str(m.send), str(m.recv)) for m in done],
                         [("stack_host[0]", "stack_host[1]"), ("stack_host[1]", "stack_host[0]")])
        self.assertEqual(skipped, [])
        code = "\n".join(line.split(";")[0] for line in gm.code.strip().splitlines()).replace(repr(self.group), "G")
        self.assertNotIn(".item()", code)
        self.assertNotIn("_assert_scalar", code)
        # The dispatch's row count is the op's (one unbacked size), the combine's the rows the dispatch sent.
        self.assertExpectedInline("\n".join(line for line in code.splitlines() if "split_all_to_all" in line
                                            or "sym_size" in line or "repeat_interleave" in line), """\
    split_all_to_all_default = torch.ops.relaymoe.split_all_to_all.default(l_x_, getitem_20, getitem_21, G, None)
    sym_size_int = torch.ops.aten.sym_size.int(split_all_to_all_default, 0)
    ids = arange.repeat_interleave(flatten_1, output_size = sym_size_int)
    out = split_all_to_all_default * add
    split_all_to_all_default_1 = torch.ops.relaymoe.split_all_to_all.default(out, getitem_22, getitem_23, G, 10)
    return (split_all_to_all_default_1,)""")

    def test_an_autograd_function_handed_the_sizes_as_shape_symbols_does_not_keep_them(self) -> None:
        gm, done, skipped = self.folded(dispatcher_with_a_function)
        self.assertEqual((len(done), skipped), (2, []))
        self.assertNotIn(".item()", gm.code)
        self.assertIn("autograd_function_apply", gm.code)

    def test_a_round_trip_whose_combine_reads_the_dispatchs_erased_wait_is_rewritten(self) -> None:
        gm, done, skipped = self.folded(round_trip, seeds=(1, 4))
        self.assertEqual((len(done), skipped), (2, []))
        self.assertNotIn("wait_tensor(split_all_to_all", gm.code)

    def test_without_fullgraph_the_unbacked_rows_come_from_the_shape_env_not_a_graph_break(self) -> None:
        # Dynamo allows data-dependent output shapes only under fullgraph (or capture_dynamic_output_shape_ops);
        # the traced graph had them already, so the op's fake makes its size anyway.
        torch._dynamo.utils.counters.clear()
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False):
            gm, done, _ = self.folded(dispatcher, fullgraph=False)
        self.assertEqual(len(done), 2)
        self.assertEqual(dict(torch._dynamo.utils.counters["graph_break"]), {})

    def test_a_function_whose_backward_reads_the_lifted_size_keeps_the_reads(self) -> None:
        gm, done, skipped = self.folded(dispatcher_with_a_sized_backward)
        self.assertEqual(done, [])
        self.assertRegex(skipped[0], r"the split sizes are also read by autograd_function_apply")
        self.assertEqual(gm.code.count(".item()"), 2 * WORLD)

    def test_a_relation_to_other_sizes_reads_the_rows_received(self) -> None:
        # The per-expert reads stay (the loop reads them); what related their sum to the received split sizes now
        # relates it to the op's row count.
        gm, done, skipped = self.folded(dispatcher_with_an_expert_loop, seeds=(2, 6))
        self.assertEqual((len(done), skipped), (2, []))
        self.assertEqual(gm.code.count(".item()"), 2 * WORLD)

    def test_lists_that_are_part_of_a_row_are_not_matched(self) -> None:
        gm, done, skipped = self.folded(part_of_a_row)
        self.assertEqual((done, skipped), ([], []))
        self.assertNotIn("split_all_to_all", gm.code)

    def test_reads_with_a_use_it_cannot_fold_leave_every_all_to_all_that_shares_them_as_traced(self) -> None:
        gm, done, skipped = self.folded(splits_also_split, seeds=(5,))
        self.assertEqual(done, [])
        (reason,) = skipped
        self.assertRegex(reason, "^tensor_1, tensor_2: the split sizes are also read by split \\(split\\)$")
        self.assertNotIn("split_all_to_all", gm.code)
        self.assertEqual(gm.code.count(".item()"), 2 * WORLD)

    def test_folded_and_traced_graphs_agree_and_the_folded_one_binds_no_split_size(self) -> None:
        c = counts(7)
        x = torch.randn(PAIRS, 3)
        results = []
        for fold in (False, True):
            run, graphs, _ = compiled(dispatcher, fold)
            results.append(fwd_bwd(run, x, c, self.group))
            (gm,) = graphs
            unbacked = {s for n in gm.graph.nodes for s in n.meta.get("unbacked_bindings", {})}
            self.assertEqual(len(unbacked), 0 if fold else 2 * WORLD, gm.code)
        for got, want in zip(*results):
            torch.testing.assert_close(got, want)


class SplitAllToAllOpTest(TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.group = standin_group(WORLD).group_name

    def test_a_row_count_the_splits_do_not_give_raises_naming_the_op(self) -> None:
        sizes = torch.tensor([1, 0, 2, 1])
        x = torch.randn(4, 2)
        # The stand-in mirrors rank 0: it receives from rank s what it sent to rank -s mod N (the same sizes here).
        got = split_all_to_all(x, sizes, sizes[[0, 3, 2, 1]], self.group)
        self.assertEqual(got.shape, (4, 2))
        with self.assertRaisesRegex(RuntimeError, r"split_all_to_all: the graph expects 5 rows back but the split "
                                                  r"sizes receive 4"):
            split_all_to_all(x, sizes, sizes[[0, 3, 2, 1]], self.group, 5)

    def test_the_backward_returns_the_rows_the_input_had(self) -> None:
        send, recv = torch.tensor([2, 1, 0, 0]), torch.tensor([2, 0, 0, 1])
        x = torch.randn(3, 2, requires_grad=True)
        y = split_all_to_all(x, send, recv, self.group)
        g = torch.randn_like(y)
        y.backward(g)
        want = funcol.all_to_all_single_autograd(x, [2, 0, 0, 1], [2, 1, 0, 0], self.group)
        (wx,) = torch.autograd.grad(funcol.wait_tensor(want), x, g)
        torch.testing.assert_close(y, funcol.wait_tensor(want))
        torch.testing.assert_close(x.grad, wx)
