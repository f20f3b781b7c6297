"""What the ranks of a ring agree on, and what happens when one of them fails, on real gloo process groups.

Each case checks that every rank raised (the rank at fault its own error, the others one naming it), that
the ranks' messages agree, that no rank waited for the process-group timeout (kept short here, 15 s, so a
regression fails fast instead of hanging: a rank that waited for it raised a timeout error, and took at least
the timeout; neither bound depends on how loaded the machine is), and that the group is usable afterwards: a
barrier, then a ring call against the all-to-all reference. The exchange's row layout is checked without processes.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import time
import unittest
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor
from torch.testing._internal.common_utils import run_tests

from relay_compile import RingInputError, ring_moe, ring_moe_experts
from relay_compile.reference import a2a_moe, moe_weights
from relay_compile.runtime import agreement, specs, transport
from relay_compile.runtime.agreement import MESSAGE_WORDS, Claims, _decode, _encode
from relay_compile.runtime.ring_options import RingOptions
from relay_compile.runtime.transport import RingPeerError
from tests import distributed
from tests.distributed import DistributedTestCase
from tests.test_ring_moe import F, assert_close_rel, forward_backward, local_weights, plain_ffn, routed_inputs

# The short process-group timeout: a rank that waited in a collective for it took at least this long.
PG_TIMEOUT = datetime.timedelta(seconds=15)
# What gloo's error says when an operation waited for the timeout ("Timed out waiting 15000ms for recv ...").
GLOO_TIMED_OUT = "Timed out waiting"


def _exception_chain(e: BaseException | None) -> list[BaseException]:
    """``e`` and its causes and contexts."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


class ShortTimeoutCase(DistributedTestCase):
    e_l = 2

    def init_pg(self, backend: str = "gloo") -> dist.ProcessGroup:
        with mock.patch.object(distributed, "PG_TIMEOUT", PG_TIMEOUT):
            return super().init_pg(backend)

    def inputs(self, seed: int = 1, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        world = dist.get_world_size()
        x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=seed)
        return x.to(dtype), ids, scores.to(dtype), local_weights(self.rank, self.e_l, world, dtype)

    def raises_promptly(self, call: Callable[[], object], want: type[BaseException], pattern: str) -> str:
        """``call()`` raises ``want`` matching ``pattern`` without having waited for the process-group timeout
        (no timeout error in its chain, and sooner than the timeout); returns the message."""
        start = time.monotonic()
        with self.assertRaisesRegex(want, pattern) as caught:
            call()
        seconds = time.monotonic() - start
        chain = _exception_chain(caught.exception)
        self.assertFalse(any(GLOO_TIMED_OUT in str(e) for e in chain), f"{pattern}: a collective timed out: {chain}")
        self.assertLess(seconds, PG_TIMEOUT.total_seconds(), f"{pattern}: raised only after the timeout")
        return str(caught.exception)

    def same_on_every_rank(self, message: str) -> None:
        messages: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        self.assertEqual(len(set(messages)), 1, messages)

    def assert_group_usable(self, **ring_kw) -> None:
        """A barrier, then forward and backward of a correct ring call match the all-to-all layer."""
        dist.barrier()
        x, ids, scores, weights = self.inputs(seed=9)
        want = forward_backward(a2a_moe, x, ids, scores, weights, self.rank)
        got = forward_backward(ring_moe, x, ids, scores, weights, self.rank, **ring_kw)
        for g, w in zip(got, want, strict=True):
            assert_close_rel(g, w, 1e-5, "after the failure")


class ArgumentsAreAgreedByEveryRank(ShortTimeoutCase):
    def test_a_bad_argument_on_one_rank_raises_on_every_rank_naming_the_rank_and_the_argument(self) -> None:
        self.init_pg()
        x, ids, scores, (w1, w2, w3) = self.inputs()
        fault = 1
        cases = [
            ("x", dict(x=x[None]), r"x must be \(T, H\)"),
            ("topk_ids", dict(ids=ids.float()), "topk_ids must hold integer expert ids"),
            ("topk_scores", dict(scores=scores[:, :1]), "topk_scores must have topk_ids' shape"),
            ("w2", dict(w2=w2.transpose(1, 2)), r"w2 must be \(E_local, H, F\)"),
            ("w1", dict(w1=w1.double()), "w1 is torch.float64 on cpu but x is torch.float32"),
            ("routing", dict(routing="ring"), "routing='ring' is not one of"),
            ("max_hop_rows", dict(max_hop_rows=0), "max_hop_rows must be a positive row count"),
        ]
        for argument, change, message in cases:
            args = dict(x=x, ids=ids, scores=scores, w1=w1, w2=w2, w3=w3, routing="auto", max_hop_rows=None)
            args |= change if self.rank == fault else {}
            call = functools.partial(ring_moe, args["x"], args["ids"], args["scores"], args["w1"], args["w2"],
                                     args["w3"], routing=args["routing"], max_hop_rows=args["max_hop_rows"])
            if self.rank == fault:
                self.raises_promptly(call, ValueError, message)
            else:
                got = self.raises_promptly(call, RingInputError, f"rank {fault} passed a bad {argument}: ")
                self.assertIn(message.replace("\\", ""), got)
        # The functional API with any expert function, and a fault on rank 0.
        e_l = 0 if self.rank == 0 else self.e_l
        call = functools.partial(ring_moe_experts, x, ids, scores, [w1, w2, w3], expert_fn=plain_ffn,
                                 experts_per_rank=e_l)
        if self.rank == 0:
            self.raises_promptly(call, ValueError, "at least one expert")
        else:
            self.raises_promptly(call, RingInputError, "rank 0 passed a bad experts_per_rank")
        self.assert_group_usable(routing="token")

    def test_what_travels_and_the_schedule_options_must_agree_while_max_hop_rows_may_differ(self) -> None:
        self.init_pg()
        # Warm-up: the ring's first call has no counts capacity yet; a later mismatch must still be caught.
        x, ids, scores, weights = self.inputs()
        ring_moe(x, ids, scores, *weights)
        other = self.rank == 1
        for routing in ("expert", "token"):
            cases = [  # (what rank 1 passes differently, the disagreement named)
                (dict(dtype=torch.float16 if other else torch.bfloat16),
                 "x's dtype: rank 1 passes torch.float16 where rank 0 passes torch.bfloat16"),
                (dict(dtype=torch.bfloat16 if other else torch.float32), "x's dtype"),  # different byte sizes
                (dict(ids_dtype=torch.int32 if other else torch.int64), "topk_ids' dtype"),
                (dict(scores_dtype=torch.bfloat16 if other else torch.float32), "topk_scores' dtype"),
                (dict(kw=dict(overlap=not other)), "option overlap"),
                (dict(kw=dict(remat=not other)), "option remat"),
                (dict(kw=dict(routing="token" if other else "expert")), "option routing"),
                (dict(kw=dict(scores_applied="before" if other else "after")),
                 "where the scores apply \\(scores_applied\\): rank 1 passes before where rank 0 passes after"),
                (dict(width=F + 4 * other), r"weight shapes of rank 1 differ from rank 0's: weights\[0\] is"),
                (dict(e_l=self.e_l + other), "experts per rank"),
            ]
            for change, message in cases:
                call = self.mismatched_call(routing, **change)
                self.same_on_every_rank(self.raises_promptly(call, RingInputError, message))
        # Two ranks running different expert functions (different code) under one ring.
        fn = plain_ffn if self.rank == 0 else (lambda x_, c, s, w: plain_ffn(x_, c, s, w) * 2)
        call = functools.partial(ring_moe_experts, x, ids, scores, weights, expert_fn=fn, experts_per_rank=self.e_l)
        self.same_on_every_rank(self.raises_promptly(call, RingInputError, "the expert function"))
        self.assert_group_usable()

    def mismatched_call(self, routing: str, dtype: torch.dtype = torch.float32, ids_dtype: torch.dtype = torch.int64,
                        scores_dtype: torch.dtype | None = None, kw: dict | None = None, width: int = F,
                        e_l: int | None = None) -> Callable[[], Tensor]:
        world = dist.get_world_size()
        e_l = e_l or self.e_l
        x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=2)
        w = moe_weights(0, x.shape[1], width, e_l * world, experts=range(self.rank * e_l, (self.rank + 1) * e_l),
                        dtype=dtype)
        args = (x.to(dtype), ids.to(ids_dtype), scores.to(scores_dtype or dtype), w["w1"], w["w2"], w["w3"])
        return lambda: ring_moe(*args, **({"routing": routing} | (kw or {})))

    def test_max_hop_rows_may_differ_across_ranks_and_change_at_any_step(self) -> None:
        self.init_pg()
        # Per step, this rank's bound: the ranks switch at different steps (the first-call check used to hang).
        bounds = [[None, None, 3, 3, None, 1], [None, 5, 5, None, 2, 2]][self.rank]
        for routing in ("expert", "token", "auto"):
            for step, bound in enumerate(bounds):
                x, ids, scores, weights = self.inputs(seed=step)
                want = forward_backward(a2a_moe, x, ids, scores, weights, step)
                got = forward_backward(ring_moe, x, ids, scores, weights, step, routing=routing, max_hop_rows=bound)
                for g, w in zip(got, want, strict=True):
                    assert_close_rel(g, w, 1e-5, f"{routing} step {step} max_hop_rows={bound}")
        dist.barrier()


class SimulatedOOM(RuntimeError):
    pass


class Interrupt(BaseException):
    """Not an ``Exception``: the ring does not drain it, it abandons the program."""


class FailingFFN:
    """``plain_ffn`` that raises ``error`` at its ``fail_at``-th call on this rank (None: never)."""

    def __init__(self, fail_at: int | None, error: type[BaseException] = SimulatedOOM) -> None:
        self.calls, self.fail_at, self.error = 0, fail_at, error

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights) -> Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error(f"simulated failure at call {self.calls}")
        return plain_ffn(x_SH, counts_NL, splits_N, weights)


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward counts its calls on ``ffn`` and raises at ``ffn.fail_at_backward``."""

    @staticmethod
    def forward(ctx, out: Tensor, ffn: FailingBackwardFFN) -> Tensor:
        ctx.ffn = ffn
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        ffn = ctx.ffn
        ffn.backward_calls += 1
        if ffn.backward_calls == ffn.fail_at_backward:
            raise SimulatedOOM(f"simulated failure at backward call {ffn.backward_calls}")
        return grad, None


class FailingBackwardFFN:
    """``plain_ffn`` whose vector-Jacobian product raises at its ``fail_at_backward``-th call on this rank: a
    failure inside the backward's gradient ring (with ``remat=False``, after its replay ring posted its own
    transfers)."""

    def __init__(self, fail_at_backward: int | None) -> None:
        self.backward_calls, self.fail_at_backward = 0, fail_at_backward

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights) -> Tensor:
        return _RaiseInBackward.apply(plain_ffn(x_SH, counts_NL, splits_N, weights), self)


class FailuresInsideTheRing(ShortTimeoutCase):
    e_l = 1

    @property
    def world_size(self) -> int:
        return 3

    def run_failing(self, fail_at: int | None, routing: str, error: type[BaseException] = SimulatedOOM,
                    dtype: torch.dtype = torch.float32, **kw) -> list[Tensor]:
        x, ids, scores, weights = self.inputs(seed=4, dtype=dtype)
        fn = FailingFFN(fail_at, error)

        def ring(x_, ids_, scores_, *weights_, **ring_kw) -> Tensor:
            return ring_moe_experts(x_, ids_, scores_, weights_, expert_fn=fn, experts_per_rank=self.e_l,
                                    name="failing_ffn", **ring_kw)

        return forward_backward(ring, x, ids, scores, weights, 0, routing=routing, **kw)

    def test_every_rank_failing_at_its_own_hop_raises_its_error_and_leaves_the_group_usable(self) -> None:
        self.init_pg()
        world = dist.get_world_size()
        for routing in ("expert", "token"):
            for overlap in (True, False):
                # Forward hops 0, 1, 2 (one expert call per hop here), then backward recompute calls.
                for fail_at in (1 + self.rank, world + 1 + (self.rank + 1) % world):
                    call = functools.partial(self.run_failing, fail_at, routing, overlap=overlap)
                    self.raises_promptly(call, SimulatedOOM, "simulated failure")
                    dist.barrier()
            # An error the ring does not drain (not an Exception), on every rank at the same hop: the
            # transfers posted so far are completed before it leaves the op.
            call = functools.partial(self.run_failing, 2, routing, error=Interrupt)
            self.raises_promptly(call, Interrupt, "simulated failure")
        self.assert_group_usable()

    def test_one_rank_failing_inside_a_hop_fails_every_rank_whose_results_depend_on_it(self) -> None:
        self.init_pg()
        fault = 1
        x, ids, scores, weights = self.inputs(seed=4)
        want = a2a_moe(x, ids, scores, *weights)
        for routing in ("expert", "token"):
            for fail_at in (1, 2):  # forward hop 0, hop 1
                fn = FailingFFN(fail_at if self.rank == fault else None)
                call = functools.partial(ring_moe_experts, x, ids, scores, weights, expert_fn=fn,
                                         experts_per_rank=self.e_l, name="failing_ffn", routing=routing)
                if self.rank == fault:
                    self.raises_promptly(call, SimulatedOOM, "simulated failure")
                elif routing == "token":  # every rank's tokens meet rank 1's experts: every result depends on it
                    self.raises_promptly(call, RingPeerError, f"rank {fault} of the EP group failed inside this")
                else:  # expert routing forward: y depends on this rank's hops only
                    assert_close_rel(call(), want, 1e-5, f"rank {self.rank}")
                dist.barrier()
        # Expert routing backward, rank 1 failing at its first backward hop: the weight gradients of the
        # partitions it met after that (every other rank's) return to their owners without its share. In bf16
        # the failed rank's stand-in partial of hop 0 must have the fp32 of the travelling sums, or the transfer
        # sizes disagree.
        for dtype in (torch.float32, torch.bfloat16):
            call = functools.partial(self.run_failing, 4 if self.rank == fault else None, "expert", dtype=dtype)
            if self.rank == fault:
                self.raises_promptly(call, SimulatedOOM, "simulated failure")
            else:
                self.raises_promptly(call, RingPeerError,
                                     f"rank {fault} of the EP group failed inside this backward")
            dist.barrier()
        self.assert_group_usable()

    def test_a_failure_in_the_gradient_ring_after_the_replay_ring_reaches_every_dependent_rank(self) -> None:
        # remat=False posts the replay ring's transfers before the gradient ring's, whose indices are lower: the
        # status a rank sends on must be the one of the latest transfer posted, not of the highest index.
        self.init_pg()
        fault = 1
        x, ids, scores, weights = self.inputs(seed=4)
        fn = FailingBackwardFFN(1 if self.rank == fault else None)

        def ring(x_, ids_, scores_, *weights_) -> Tensor:
            return ring_moe_experts(x_, ids_, scores_, weights_, expert_fn=fn, experts_per_rank=self.e_l,
                                    name="failing_backward_ffn", routing="expert", remat=False)

        call = functools.partial(forward_backward, ring, x, ids, scores, weights, 0)
        if self.rank == fault:
            self.raises_promptly(call, SimulatedOOM, "simulated failure at backward call 1")
        else:
            self.raises_promptly(call, RingPeerError, f"rank {fault} of the EP group failed inside this backward")
        dist.barrier()
        self.assert_group_usable()

    def test_where_the_status_is_not_read_at_once_every_rank_raises_at_the_next_exchange(self) -> None:
        # As on an accelerator: the failure status stays on the device until the group's next exchange.
        self.init_pg()
        fault = 1
        x, ids, scores, weights = self.inputs(seed=4)
        with mock.patch.object(transport, "status_read_at_once", lambda device: False):
            fn = FailingFFN(1 if self.rank == fault else None)
            call = functools.partial(ring_moe_experts, x, ids, scores, weights, expert_fn=fn,
                                     experts_per_rank=self.e_l, name="failing_ffn", routing="token")
            if self.rank == fault:
                self.raises_promptly(call, SimulatedOOM, "simulated failure")
            else:
                call()  # its results depend on rank 1's hops: not known yet
            message = self.raises_promptly(
                functools.partial(ring_moe, x, ids, scores, *weights), RingPeerError,
                rf"rank {fault} of the EP group failed inside its previous ring on this group, and rank [02]"
            )
            self.same_on_every_rank(message)
            self.assert_group_usable()


@contextlib.contextmanager
def exchanges() -> Iterator[list[tuple[str, bool, list[list[int]]]]]:
    """Within: per agreement exchange of an op call, its direction, whether it was built from counts an earlier
    agreement read (``counts_agreed``: no device data) and the table it gathered."""
    seen: list[tuple[str, bool, list[list[int]]]] = []
    real = agreement._exchange

    def spy(ring, claims, bad_ids, counts_E, state, counts_agreed=False, before_read=None):
        table = real(ring, claims, bad_ids, counts_E, state, counts_agreed, before_read)
        seen.append((claims.direction, counts_agreed, table))
        return table

    with mock.patch.object(agreement, "_exchange", spy):
        yield seen


class FailuresInsideALongerRing(ShortTimeoutCase):
    """Four ranks: a transfer posted before the previous one's ``wait`` (``overlap``) must still carry the status
    that previous one brought, which arrives with the sums (``RingTransfer.wait_trailing``): expert routing's
    backward, token routing's forward and backward."""

    e_l = 1
    run_failing = FailuresInsideTheRing.run_failing

    @property
    def world_size(self) -> int:
        return 4

    def test_a_failure_at_any_backward_hop_never_leaves_a_dependent_rank_with_wrong_gradients(self) -> None:
        # Token routing's backward hops add into the dx and d_scores sums they receive too (sum_in_place).
        self.init_pg()
        world = dist.get_world_size()
        x, ids, scores, weights = self.inputs(seed=4)
        want = forward_backward(a2a_moe, x, ids, scores, weights, 0)
        names = ("y", "dx", "d_scores", "dw1", "dw2", "dw3")
        for fault in range(world):
            for routing in ("expert", "token"):
                for hop in range(world):  # expert calls 1..N are the forward's hops, N+1.. the backward's
                    call = functools.partial(self.run_failing, world + 1 + hop if self.rank == fault else None,
                                             routing)
                    try:
                        got = call()
                    except (RingPeerError, SimulatedOOM):
                        got = None  # raised: this rank knows its results are incomplete
                    if got is not None:
                        for name, g, w in zip(names, got, want, strict=True):
                            assert_close_rel(g, w, 1e-5, f"rank {self.rank} returned {name} with rank {fault} "
                                                         f"failing at {routing} routing's backward hop {hop}")
                    dist.barrier()
        self.assert_group_usable()

    def test_a_failure_at_any_forward_hop_of_token_routing_never_leaves_a_rank_with_a_wrong_output(self) -> None:
        # Token routing's forward hops add into the y sums they receive (sum_in_place), whose status arrives with
        # them: a rank returns y only where every hop that added to it computed. (Forward only: a rank that
        # returned its y would go on to a backward its failed peer never joins.)
        self.init_pg()
        world = dist.get_world_size()
        x, ids, scores, weights = self.inputs(seed=4)
        want = a2a_moe(x, ids, scores, *weights)
        for fault in range(world):
            for fail_at in range(1, world + 1):
                fn = FailingFFN(fail_at if self.rank == fault else None)
                try:
                    got = ring_moe_experts(x, ids, scores, weights, expert_fn=fn, experts_per_rank=self.e_l,
                                           name="failing_ffn", routing="token")
                except (RingPeerError, SimulatedOOM):
                    got = None
                if got is not None:
                    assert_close_rel(got, want, 1e-5, f"rank {self.rank} returned y with rank {fault} failing at "
                                                      f"its expert call {fail_at}")
                dist.barrier()
        self.assert_group_usable()


class BackwardAgreesOnItsForwardsCounts(ShortTimeoutCase):
    def test_the_backward_exchange_is_built_from_the_forwards_counts_into_the_same_table(self) -> None:
        # The backward's row comes from the counts its forward agreed on (runtime.ops: counts_E, a host output
        # of the forward op), not from the device: the same table, so the same decisions and gradients as a2a.
        self.init_pg()
        world = dist.get_world_size()
        compiled = torch.compile(ring_moe, backend="aot_eager", fullgraph=True)
        calls = [(ring_moe, {"routing": "expert"}), (ring_moe, {"routing": "token"}),
                 (ring_moe, {"routing": "expert", "save_projections": True}), (compiled, {"routing": "expert"})]
        for fn, kw in calls:
            for case in ("random", "one_rank", "uneven"):
                x, ids, scores = routed_inputs(case, self.rank, world, self.e_l * world, seed=3)
                weights = local_weights(self.rank, self.e_l, world)
                want = forward_backward(a2a_moe, x, ids, scores, weights, self.rank)
                with exchanges() as seen:
                    got = forward_backward(fn, x, ids, scores, weights, self.rank, **kw)
                for g, w in zip(got, want, strict=True):
                    assert_close_rel(g, w, 1e-5, f"{case} {kw}")
                (fwd, fwd_host, fwd_table), (bwd, bwd_host, bwd_table) = seen
                self.assertEqual((fwd, fwd_host, bwd, bwd_host), ("forward", False, "backward", True), f"{case} {kw}")
                want_NE = [torch.zeros(self.e_l * world, dtype=torch.int64) for _ in range(world)]
                dist.all_gather(want_NE, torch.bincount(ids.flatten(), minlength=self.e_l * world))
                counts = slice(agreement.COUNTS, None)
                self.assertEqual([r[counts] for r in bwd_table], [c.tolist() for c in want_NE], f"{case} {kw}")
                if fwd_table[0][counts]:  # the group's first call sends none in the forward (the cap grows after)
                    self.assertEqual([r[counts] for r in fwd_table], [r[counts] for r in bwd_table], f"{case} {kw}")
        self.check_host_and_device_rows_are_one_table()
        self.check_exchanges_without_counts_run_beside_the_compute_stream()

    def check_exchanges_without_counts_run_beside_the_compute_stream(self) -> None:
        """A kept region's and a token switch's rows hold nothing the device computes: built on the host and
        gathered beside the compute stream, so they do not wait for the work queued before them."""
        ring = transport.RingGroup.resolve(dist.group.WORLD.group_name)
        entered = []
        real = agreement.beside_compute

        def spy(device, after_queued=False):
            entered.append(after_queued)
            return real(device, after_queued)

        with mock.patch.object(agreement, "beside_compute", spy), exchanges() as seen:
            agreement.agree_kept(ring, torch.device("cpu"))
            tokens_N = agreement.agree_tokens(ring, torch.device("cpu"), 7 + self.rank)
        self.assertEqual(tokens_N, [7 + r for r in range(dist.get_world_size())])
        self.assertEqual([host for _, host, _ in seen], [True, True])
        self.assertEqual(entered, [False, False])  # host rows: the exchange waits for nothing queued

    def check_host_and_device_rows_are_one_table(self) -> None:
        """The same claims and counts, from the device and from the host: the same table, column for column."""
        ring = transport.RingGroup.resolve(dist.group.WORLD.group_name)
        state = agreement._group_state(ring)
        claims = Claims(direction="backward", tokens=5 + self.rank, hidden=16, top_k=2, experts_per_rank=self.e_l,
                        dtypes=(torch.float32, torch.int64, torch.float32, torch.float32))
        counts_E = torch.arange(self.e_l * dist.get_world_size()) * (self.rank + 1)
        no_bad = torch.zeros(1, dtype=torch.int64)
        from_device = agreement._exchange(ring, claims, no_bad, counts_E, state)
        from_host = agreement._exchange(ring, claims, no_bad, counts_E.clone(), state, counts_agreed=True)
        self.assertEqual(from_host, from_device)
        self.assertEqual(from_host[1][agreement.COUNTS:], (counts_E // (self.rank + 1) * 2).tolist())
        no_counts = torch.zeros(0, dtype=torch.int64)  # a kept region's or a token switch's row
        self.assertEqual(agreement._exchange(ring, claims, no_bad, no_counts, state, counts_agreed=True),
                         agreement._exchange(ring, claims, no_bad, no_counts, state))

    def test_a_backward_given_counts_of_another_shape_raises_on_every_rank(self) -> None:
        self.init_pg()
        x, ids, scores, weights = self.inputs()
        y = ring_moe(x, ids, scores, *weights)
        key = next(reversed(specs._FUNCTIONAL))  # the spec that call registered (the latest used)
        bad = torch.zeros(3, dtype=torch.int64) if self.rank == 1 else None
        call = functools.partial(torch.ops.relaymoe.ring_moe_backward, torch.ones_like(y), x, ids, scores, weights,
                                 key, None, bad)
        self.raises_promptly(call, ValueError, "counts_E must be the forward's")  # rank 1's own, or naming rank 1
        self.assert_group_usable()


class UnreadStatus(unittest.TestCase):
    """A ring's failure status that an exchange beside the compute stream may send only once computed."""

    @staticmethod
    def _event(done: bool) -> mock.Mock:
        return mock.Mock(**{"query.return_value": done})

    def test_a_status_not_computed_yet_waits_for_a_later_exchange_and_merges_with_the_next(self) -> None:
        state = agreement._GroupState()
        state.unread_status, state.unread_done = torch.tensor([2]), self._event(False)
        self.assertIsNone(state.take_status(waiting=False))  # beside the compute stream: not yet
        self.assertEqual(state.unread_status.tolist(), [2])  # kept
        state.unread_done.query.return_value = True
        self.assertEqual(state.take_status(waiting=False).tolist(), [2])
        self.assertIsNone(state.unread_status)
        state.unread_status, state.unread_done = torch.tensor([3]), self._event(False)
        self.assertEqual(state.take_status(waiting=True).tolist(), [3])  # an exchange on the compute stream
        self.assertIsNone(state.take_status(waiting=True))

    def test_remembered_statuses_merge_to_the_highest_failing_rank(self) -> None:
        group = object()
        ring = transport.RingGroup(group=group, rank=0, size=2, next_global=1, prev_global=1)  # type: ignore[arg-type]
        with mock.patch.object(agreement, "_GROUPS", {}):
            agreement.remember_status(ring, torch.tensor([3]))
            agreement.remember_status(ring, torch.tensor([0]))  # a later ring that heard of no failure
            self.assertEqual(agreement._group_state(ring).take_status(waiting=False).tolist(), [3])


class RowLayout(unittest.TestCase):
    """The exchange's row never depends on the arguments: a row of another length aborts gloo."""

    def test_the_header_has_one_length_whatever_the_claims(self) -> None:
        many = tuple((torch.float32, (2, 3, 4, 5, 6)) for _ in range(9))  # more weights and dims than listed
        claims = [
            Claims(),
            Claims(problem=ValueError("x" * 1000)),
            Claims(direction="backward", tokens=7, hidden=16, top_k=2, weights=((torch.bfloat16, (2, 8, 16)),),
                   options=RingOptions(routing="token", max_hop_rows=3)),
            Claims(weights=many),
        ]
        self.assertEqual(len({len(c.header(0)) for c in claims}), 1)
        self.assertEqual(claims[2].header(0)[:1], [0])  # no problem

    def test_a_problem_message_travels_truncated_to_its_words(self) -> None:
        self.assertEqual(_decode(_encode("ring_moe: x must be (T, H)")), "ring_moe: x must be (T, H)")
        self.assertEqual(len(_decode(_encode("é" * 200)).encode()), 8 * MESSAGE_WORDS)
        self.assertEqual(_decode(_encode("")), "")

    def test_max_hop_rows_is_not_claimed(self) -> None:
        a = Claims(options=RingOptions(max_hop_rows=3)).header(0)
        b = Claims(options=RingOptions(max_hop_rows=None)).header(0)
        self.assertEqual(a, b)

    def test_dtype_codes_round_trip_and_unknown_dtypes_get_a_stable_code(self) -> None:
        for dt in (torch.float32, torch.bfloat16, torch.int32):
            self.assertEqual(agreement.dtype_name(agreement.dtype_code(dt)), str(dt))
        self.assertEqual(agreement.dtype_code(torch.uint16), agreement.dtype_code(torch.uint16))
        self.assertGreaterEqual(agreement.dtype_code(torch.uint16), 1000)


if __name__ == "__main__":
    run_tests()
