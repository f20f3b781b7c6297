"""passes.host_reads: a tensor's elements read on the host (``tolist`` of split sizes) through one copy.

On CUDA each ``.item()`` is a stream sync; the pass leaves every read in place and points it at one host copy.
Here the device predicate is widened to the CPU (where the default leaves graphs alone) so the rewrite runs.
"""

from __future__ import annotations

import operator
from unittest import mock

import torch
import torch.fx as fx
from expecttest import TestCase
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.compile_fx import compile_fx

from relay_compile.backend import compiled_reports
from relay_compile.passes import host_reads
from relay_compile.passes.host_reads import batch_host_reads, find_host_reads


def anywhere(t: torch.Tensor) -> bool:
    return True


def dispatch_like(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatchers' idiom: both split lists read with one ``tolist``; the sizes shape the result."""
    splits = torch.stack([counts.sum(1), counts.sum(0)])
    send, recv = splits.tolist()
    parts = x.split(send)
    return torch.cat([p * (i + 1) for i, p in enumerate(parts)]), x.new_full((1,), sum(recv))


def captured(fn, *args: torch.Tensor, where=anywhere) -> tuple[fx.GraphModule, list]:
    """``fn``'s Dynamo graph after the pass, and what the pass batched; the compiled call must equal ``fn``'s."""
    out: list = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        out.append((gm, batch_host_reads(gm, where)))
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch.testing.assert_close(got, fn(*args))
    return out[0]


def reads_code(gm: fx.GraphModule) -> str:
    """The graph's code without Dynamo's runtime asserts (their text differs across torch versions)."""
    return "\n".join(line for line in gm.code.strip().splitlines()
                     if "_assert_scalar" not in line and " >= " not in line and " <= " not in line
                     and " == " not in line and "sym_sum_1" not in line)


X = torch.arange(12.0).view(6, 2)
COUNTS = torch.tensor([[1, 2], [2, 1]])


class HostReadsTest(TestCase):
    def test_the_elements_of_one_tensor_are_read_from_one_host_copy(self) -> None:
        gm, found = captured(dispatch_like, X, COUNTS)
        self.assertEqual([(r.base.name, r.paths) for r in found], [("splits", ((0, 0), (0, 1), (1, 0), (1, 1)))])
        self.assertExpectedInline(reads_code(gm), """\
def forward(self, L_counts_ : torch.Tensor, L_x_ : torch.Tensor):
    l_counts_ = L_counts_
    l_x_ = L_x_
    sum_1 = l_counts_.sum(1)
    sum_2 = l_counts_.sum(0);  l_counts_ = None
    splits = torch.stack([sum_1, sum_2]);  sum_1 = sum_2 = None
    splits_host = splits.to('cpu', copy = True);  splits = None
    getitem_8 = splits_host[0]
    getitem_9 = getitem_8[0]
    getitem_10 = getitem_8[1];  getitem_8 = None
    getitem_11 = splits_host[1];  splits_host = None
    getitem_12 = getitem_11[0]
    getitem_13 = getitem_11[1];  getitem_11 = None
    item = getitem_9.item();  getitem_9 = None
    item_1 = getitem_10.item();  getitem_10 = None
    item_2 = getitem_12.item();  getitem_12 = None
    item_3 = getitem_13.item();  getitem_13 = None
    split = l_x_.split([item, item_1]);  item = item_1 = None
    x = split[0]
    x_1 = split[1];  split = None
    mul = x * 1;  x = None
    mul_1 = x_1 * 2;  x_1 = None
    cat = torch.cat([mul, mul_1]);  mul = mul_1 = None
    sym_sum = torch.sym_sum((item_2, item_3));  item_2 = item_3 = None
    new_full = l_x_.new_full((1,), sym_sum);  l_x_ = sym_sum = None
    return (cat, new_full)""")

    def test_cpu_tensors_and_single_reads_are_left_alone_and_a_view_is_a_tensor_like_any(self) -> None:
        gm, found = captured(dispatch_like, X, COUNTS, where=None)  # the default: accelerators only
        self.assertEqual(found, [])
        self.assertNotIn("'cpu'", gm.code)

        def one_read_each(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            return x[: n.sum().item()] * n.max().item()

        def sliced(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            a, b = n[:2].tolist()  # the slice is the tensor copied
            return x[:a] * b

        self.assertEqual(captured(one_read_each, X, COUNTS[0])[1], [])
        gm, found = captured(sliced, X, COUNTS[0])
        self.assertEqual([(r.base.target, r.paths) for r in found], [(operator.getitem, ((0,), (1,)))])
        self.assertIn("to('cpu', copy = True)", gm.code)

    def test_reads_around_a_write_to_the_tensor_are_left_alone(self) -> None:
        def written(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            c = counts * 1
            a, b = c.tolist()
            c.add_(1)  # a copy before it would give the reads after it stale values
            d, e = c.tolist()
            return x[:a] * b + x[:d].sum() * e

        def written_through_another_view(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            c = counts * 1
            v = c.view(-1)
            a = v[0].item()
            c += 1  # operator.iadd on the view's base
            return x[:a] * v[1].item()

        self.assertEqual(captured(written_through_another_view, X, COUNTS[0])[1], [])

        def written_after(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            c = counts * 1
            a, b = c.tolist()
            c.add_(1)
            return x[:a] * b + c.sum()

        self.assertEqual(captured(written, X, COUNTS[0])[1], [])  # and the compiled call equals eager
        self.assertEqual([len(r.reads) for r in captured(written_after, X, COUNTS[0])[1]], [2])

    def test_the_finder_changes_nothing_and_reads_through_select_count(self) -> None:
        def selected(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return x[: counts.select(0, 0).item()] * counts.select(0, 1).item()

        seen: list = []

        def backend(gm: fx.GraphModule, example_inputs: list) -> object:
            before = gm.code
            seen.append([r.paths for r in find_host_reads(gm, anywhere)])
            self.assertEqual(gm.code, before)
            return gm.forward

        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            torch.compile(selected, backend=backend, fullgraph=True)(X, COUNTS[0])
        self.assertEqual(seen, [[((0,), (1,))]])
        self.assertIn("to('cpu', copy = True)", captured(selected, X, COUNTS[0])[0].code)

    def test_inductor_compiles_a_rewritten_graph_to_the_same_values(self) -> None:
        def backend(gm: fx.GraphModule, example_inputs: list) -> object:
            self.assertEqual(len(batch_host_reads(gm, anywhere)), 1)
            return compile_fx(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(dispatch_like, backend=backend, fullgraph=True)
        for counts in (COUNTS, torch.tensor([[3, 0], [0, 3]])):
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                got = compiled(X, counts)
            torch.testing.assert_close(got, dispatch_like(X, counts))

    def test_the_backend_batches_reads_in_checkpoint_bodies_and_of_graph_inputs(self) -> None:
        def block(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            y, total = dispatch_like(x, counts)  # the reads of a value computed in the body
            return y.square() * total

        def model(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            a, b = counts[0].tolist()  # the reads of a graph input (through an integer index)
            y = torch.utils.checkpoint.checkpoint(block, x, counts, use_reentrant=False)
            return y.sum() * (a + b)

        seen = len(compiled_reports())
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="relaymoe", options={"inner_compiler": "aot_eager"})
        with mock.patch.object(host_reads, "on_accelerator", anywhere):
            for counts in (COUNTS, torch.tensor([[2, 1], [0, 3]])):
                x = X.clone().requires_grad_()
                got = compiled(x, counts)
                (got_dx,) = torch.autograd.grad(got, x)
                want_x = X.clone().requires_grad_()
                want = model(want_x, counts)
                torch.testing.assert_close(got, want)
                torch.testing.assert_close(got_dx, torch.autograd.grad(want, want_x)[0])
        reports = compiled_reports()[seen:]
        self.assertEqual(len(reports), 1)
        self.assertEqual(sorted(reports[0].host_reads), ["l_counts_: 2 host reads from one copy",
                                                         "splits: 4 host reads from one copy"])

    def test_a_rewritten_graph_trains_like_eager_under_aot_autograd_without_recompiling(self) -> None:
        def loss(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            y, total = dispatch_like(x, counts)
            return (y.square().sum(1) * total).sum()

        seen: list[int] = []

        def backend(gm: fx.GraphModule, example_inputs: list) -> object:
            seen.append(len(batch_host_reads(gm, anywhere)))
            boxed = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
            return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, example_inputs)

        counter = CompileCounterWithBackend(backend)
        torch._dynamo.reset()
        compiled = torch.compile(loss, backend=counter, fullgraph=True)
        for counts in (COUNTS, torch.tensor([[0, 3], [3, 0]]), torch.tensor([[2, 0], [1, 3]])):
            x = X.clone().requires_grad_()
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                got = compiled(x, counts)
            (got_dx,) = torch.autograd.grad(got, x)
            want_x = X.clone().requires_grad_()
            want = loss(want_x, counts)
            (want_dx,) = torch.autograd.grad(want, want_x)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got_dx, want_dx)
        self.assertEqual(seen, [1])
        self.assertEqual(counter.frame_count, 1)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
