"""Ring transport without processes: the ring of one, and the P2P ops a larger ring would post.

A ring of one never touches ``torch.distributed``. For the tag layout and peers of a larger ring, ``dist`` is
replaced by a recorder inside ``transport`` (no process group exists): what is checked is which ops the
transport builds, not that gloo or NCCL deliver them (the distributed tests do that).
"""

from __future__ import annotations

import dataclasses
import unittest
from unittest import mock

import torch
import torch.distributed as dist

from relay_compile.runtime import transport
from relay_compile.runtime.transport import (
    TAGS_PER_TRANSFER,
    RingGroup,
    RingRun,
    RingTransportError,
    all_gather_rows,
    receive_buffers,
    start_transfer,
)


class RingOfOne(unittest.TestCase):
    def test_the_empty_group_name_resolves_to_a_ring_of_one_with_no_group(self) -> None:
        ring = RingGroup.resolve("")
        self.assertEqual((ring.group, ring.rank, ring.size, ring.next_global, ring.prev_global), (None, 0, 1, 0, 0))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            ring.rank = 1  # type: ignore[misc]

    def test_a_transfer_on_a_ring_of_one_returns_the_payload_itself_and_posts_nothing(self) -> None:
        ring = RingGroup.resolve("")
        a = torch.arange(6.0).view(2, 3)
        b = torch.arange(12.0).view(3, 4).t()  # not contiguous: comes back as a contiguous copy
        with mock.patch.object(transport, "dist") as fake:
            xfer = start_transfer(ring, 3, [a, b], [torch.empty(2, 3), torch.empty(4, 3)])
            got = xfer.wait()
        self.assertEqual(fake.mock_calls, [])
        self.assertIs(got[0], a)
        self.assertTrue(got[1].is_contiguous())
        self.assertTrue(torch.equal(got[1], b))

    def test_collectives_on_a_ring_of_one_are_the_identity(self) -> None:
        ring = RingGroup.resolve("")
        row = torch.tensor([5, 0, 2, 3], dtype=torch.int64)
        with mock.patch.object(transport, "dist") as fake:
            table = all_gather_rows(ring, row)
        self.assertEqual(fake.mock_calls, [])
        self.assertEqual(table.tolist(), [[5, 0, 2, 3]])


class _RecordingGroup:
    """Stands in for a process group: records the ring's sends and receives, returns one ``Work`` mock each."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, torch.Tensor, int, int]] = []
        self.works: list[mock.Mock] = []

    def _post(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> mock.Mock:
        assert len(tensors) == 1
        self.ops.append((kind, tensors[0], peer, tag))
        self.works.append(mock.Mock())
        return self.works[-1]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> mock.Mock:
        return self._post("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> mock.Mock:
        return self._post("recv", tensors, src, tag)


class OpsOfALargerRing(unittest.TestCase):
    """A recording group: rank 1 of a ring of 3 (group ranks 2 and 0 are its neighbours; global 12 and 10)."""

    def ring(self) -> RingGroup:
        return RingGroup(group=_RecordingGroup(), rank=1, size=3, next_global=12, prev_global=10)  # type: ignore[arg-type]

    def test_each_tensor_of_a_transfer_goes_to_the_next_rank_and_comes_from_the_previous_under_its_own_tag(
        self,
    ) -> None:
        payload = [torch.ones(2), torch.ones(3), torch.ones(1)]
        receive = [torch.empty(2), torch.empty(3), torch.empty(1)]
        ring = self.ring()
        xfer = start_transfer(ring, 5, payload, receive)
        want = []
        for pos in range(3):
            tag = 5 * 64 + pos
            want += [("send", payload[pos], 2, tag), ("recv", receive[pos], 0, tag)]
        ops = ring.group.ops
        self.assertEqual(len(ops), len(want))
        for got_op, want_op in zip(ops, want):
            self.assertEqual(got_op[0], want_op[0])
            self.assertIs(got_op[1], want_op[1])
            self.assertEqual(got_op[2:], want_op[2:])
        self.assertEqual(TAGS_PER_TRANSFER, 64)
        self.assertEqual(xfer.works, ring.group.works)
        for work in xfer.works:
            work.wait.assert_not_called()
        got = xfer.wait()
        self.assertEqual([id(t) for t in got], [id(t) for t in receive])  # the receive buffers themselves
        for work in xfer.works:
            work.wait.assert_called_once_with()
        self.assertEqual(xfer.sent, [])  # the send tensors are released once the transfer completed

    def test_a_coalescing_backend_gets_the_batch_between_start_and_end_of_coalescing_as_c10d_posts_it(self) -> None:
        """NCCL's path (``batch_isend_irecv``'s coalescing manager): one ``Work`` for the whole batch."""
        group = mock.create_autospec(dist.ProcessGroup, instance=True)
        ring = RingGroup(group=group, rank=1, size=3, next_global=12, prev_global=10)
        payload, receive = [torch.ones(2)], [torch.empty(2)]
        with mock.patch.object(transport, "_coalesces", return_value=True):
            xfer = start_transfer(ring, 0, payload, receive)
        names = [c[0] for c in group.method_calls]
        self.assertEqual(names, ["_start_coalescing", "send", "recv", "_end_coalescing"])
        self.assertEqual(group.send.call_args.args, ([payload[0]], 2, 0))
        self.assertEqual(group.recv.call_args.args, ([receive[0]], 0, 0))
        self.assertEqual(xfer.works, [group._end_coalescing.return_value])

    def test_only_a_cpp_group_whose_backend_coalesces_is_coalesced(self) -> None:
        python_group = mock.create_autospec(dist.ProcessGroup, instance=True)  # the stand-in's kind: op by op
        self.assertFalse(transport._coalesces(python_group, torch.device("cpu")))
        python_group._get_backend.assert_not_called()

    def _ops(self, payload, receive):
        ring = self.ring()
        start_transfer(ring, 2, payload, receive)
        return ring.group.ops

    def test_receive_buffers_are_aligned_views_of_one_buffer_unless_asked_for_separate_tensors(self) -> None:
        specs = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2,), torch.int64)]
        bufs = receive_buffers(specs, torch.device("cpu"))
        self.assertEqual([(tuple(b.shape), b.dtype) for b in bufs], [(s, d) for s, d in specs])
        self.assertTrue(all(b.is_contiguous() for b in bufs))
        base = bufs[0].untyped_storage().data_ptr()
        self.assertEqual([b.data_ptr() - base for b in bufs], [0, 32, 64])  # 30 and 28 bytes, 16-aligned
        self.assertEqual(bufs[0].untyped_storage().nbytes(), 80)
        same_dtype = receive_buffers([((3, 5), torch.float32), ((2, 2, 4), torch.float32), ((3,), torch.float32)],
                                     "cpu")
        base = same_dtype[0].untyped_storage().data_ptr()
        self.assertEqual([b.data_ptr() - base for b in same_dtype], [0, 64, 128])  # 60 and 64 bytes, 16-aligned
        self.assertEqual([b.stride() for b in same_dtype], [(5, 1), (8, 4, 1), (1,)])
        self.assertEqual(same_dtype[0].untyped_storage().nbytes(), 140)
        separate = receive_buffers(specs, torch.device("cpu"), flat=False)
        self.assertEqual(len({b.untyped_storage().data_ptr() for b in separate}), 3)

    def test_a_payload_forwarded_as_it_was_received_travels_as_its_buffer(self) -> None:
        mixed = [((3, 5), torch.bfloat16), ((7,), torch.float32)]
        same = [((3, 5), torch.float32), ((7,), torch.float32)]
        for specs in (mixed, same):
            with self.subTest(dtypes=[d for _, d in specs]):
                arrived = receive_buffers(specs, torch.device("cpu"))
                arrived[0].fill_(1.5)
                arrived[1].fill_(-2.0)
                receive = receive_buffers(specs, torch.device("cpu"))
                ops = self._ops(arrived, receive)
                self.assertEqual([(op[0], op[2], op[3]) for op in ops], [("send", 2, 128), ("recv", 0, 128)])
                send_span, recv_span = ops[0][1], ops[1][1]
                self.assertEqual(send_span.nbytes, recv_span.nbytes)
                self.assertEqual(send_span.untyped_storage().data_ptr(), arrived[0].untyped_storage().data_ptr())
                recv_span.copy_(send_span)  # what the peer's receive does: the views of the next buffer get the values
                self.assertTrue(torch.equal(receive[0], arrived[0]) and torch.equal(receive[1], arrived[1]))

    def test_a_payload_from_two_buffers_travels_as_two_spans(self) -> None:
        circ, trail = [((4,), torch.bfloat16), ((3,), torch.bfloat16)], [((5,), torch.float32), ((2,), torch.float32)]
        arrived = receive_buffers(circ, "cpu") + receive_buffers(trail, "cpu")
        receive = receive_buffers(circ, "cpu") + receive_buffers(trail, "cpu")
        ops = self._ops(arrived, receive)
        self.assertEqual([(op[1].dtype, op[1].nbytes, op[3]) for op in ops],
                         [(torch.bfloat16, 22, 128), (torch.bfloat16, 22, 128), (torch.float32, 40, 129),
                          (torch.float32, 40, 129)])

    def test_trailing_accumulators_travel_first_as_a_batch_of_their_own_under_the_same_tags(self) -> None:
        """A hop adds into the sums it receives while the weights beside them are for the next hop: the sums'
        batch is posted first and can be waited for alone (NCCL: its own coalesced group)."""
        circ, trail = [((4,), torch.bfloat16), ((3,), torch.bfloat16)], [((5,), torch.float32), ((2,), torch.float32)]
        arrived = receive_buffers(circ, "cpu") + receive_buffers(trail, "cpu")
        receive = receive_buffers(circ, "cpu") + receive_buffers(trail, "cpu")
        ring = self.ring()
        xfer = start_transfer(ring, 2, arrived, receive, trailing_from=2)
        ops = ring.group.ops
        # The same spans and tags as one batch (position 0: the weights, 1: the sums), the sums posted first.
        self.assertEqual([(op[0], op[1].dtype, op[3]) for op in ops],
                         [("send", torch.float32, 129), ("recv", torch.float32, 129),
                          ("send", torch.bfloat16, 128), ("recv", torch.bfloat16, 128)])
        works = ring.group.works
        sums = xfer.wait_trailing()
        self.assertEqual([id(t) for t in sums], [id(t) for t in receive[2:]])
        for w in works[:2]:
            w.wait.assert_called_once_with()
        for w in works[2:]:
            w.wait.assert_not_called()  # the weights still travel
        self.assertFalse(xfer.done)
        self.assertEqual([id(t) for t in xfer.wait_trailing()], [id(t) for t in receive[2:]])  # no second wait
        self.assertEqual([id(t) for t in xfer.wait()], [id(t) for t in receive])
        for w in works:
            # Each work waited exactly once: a gloo work waited again waits for a completion that never comes.
            w.wait.assert_called_once_with()
        # Without accumulators (or without circulating tensors) a transfer is one batch, as before.
        for split in (None, 0, 4):
            ring = self.ring()
            one = start_transfer(ring, 2, arrived, receive, trailing_from=split)
            self.assertEqual([op[3] for op in ring.group.ops], [128, 128, 129, 129])
            self.assertEqual(one.trailing_works, [])

    def test_a_coalescing_backend_gets_each_batch_of_a_split_transfer_as_its_own_group(self) -> None:
        group = mock.create_autospec(dist.ProcessGroup, instance=True)
        first, second = mock.Mock(), mock.Mock()
        group._end_coalescing.side_effect = [first, second]
        ring = RingGroup(group=group, rank=1, size=3, next_global=12, prev_global=10)
        payload, receive = [torch.ones(2), torch.zeros(3)], [torch.empty(2), torch.empty(3)]
        with mock.patch.object(transport, "_coalesces", return_value=True):
            xfer = start_transfer(ring, 0, payload, receive, trailing_from=1)
        names = [c[0] for c in group.method_calls]
        self.assertEqual(names, ["_start_coalescing", "send", "recv", "_end_coalescing"] * 2)
        self.assertIs(group.method_calls[1].args[0][0], payload[1])  # the accumulator first
        self.assertEqual(xfer.works, [first, second])
        xfer.wait_trailing()
        first.wait.assert_called_once_with()
        second.wait.assert_not_called()
        xfer.wait()
        first.wait.assert_called_once_with()
        second.wait.assert_called_once_with()

    def test_the_status_travels_with_the_sums_and_is_heard_when_they_arrive(self) -> None:
        """A later transfer may be posted before this one's ``wait``: it must carry the status this one brought."""
        ring = self.ring()
        arrived = receive_buffers([((4,), torch.float32)], "cpu") + receive_buffers([((2,), torch.float32)], "cpu")
        receive = receive_buffers([((4,), torch.float32)], "cpu") + receive_buffers([((2,), torch.float32)], "cpu")
        with RingRun(ring, torch.device("cpu"), "test") as run:
            xfer = start_transfer(ring, 3, arrived, receive, trailing_from=1)
            tags = [op[3] for op in ring.group.ops]
            self.assertEqual(tags, [193, 193, transport.STATUS_TAG + 3, transport.STATUS_TAG + 3, 192, 192])
            assert xfer.status_in is not None
            xfer.status_in.fill_(3)  # what the previous rank's status brings: rank 2 failed
            xfer.wait_trailing()
            self.assertIs(run.heard, xfer.status_in)
            self.assertEqual(run.status.tolist(), [3])
            xfer.wait()
        self.assertEqual(run.heard_seq, 0)

    def test_a_failed_early_wait_is_not_waited_again(self) -> None:
        ring = self.ring()
        arrived = receive_buffers([((4,), torch.float32)], "cpu") + receive_buffers([((2,), torch.float32)], "cpu")
        receive = receive_buffers([((4,), torch.float32)], "cpu") + receive_buffers([((2,), torch.float32)], "cpu")
        xfer = start_transfer(ring, 3, arrived, receive, trailing_from=1)
        works = ring.group.works
        works[1].wait.side_effect = RuntimeError("peer gone")
        with self.assertRaisesRegex(RingTransportError, "transfer 3 of rank 1.*peer gone"):
            xfer.wait_trailing()
        xfer.wait()  # what a failed run's settling does: the weights' batch only
        for w in works:
            self.assertEqual(w.wait.call_count, 1)

    def test_whether_groups_travel_as_buffers_is_decided_by_structure_never_by_sizes(self) -> None:
        """Token routing sends one source's partition and receives another's: the sizes differ on one rank and
        may agree on its neighbour, so a size test would split a link's two sides differently (a hang)."""
        arrived = receive_buffers([((5, 4), torch.bfloat16), ((5,), torch.int64)], "cpu")
        receive = receive_buffers([((3, 4), torch.bfloat16), ((3,), torch.int64)], "cpu")
        ops = self._ops(arrived, receive)
        self.assertEqual([(op[0], op[3]) for op in ops], [("send", 128), ("recv", 128)])
        self.assertEqual((ops[0][1].nbytes, ops[1][1].nbytes), (88, 56))  # 40 + 40 and 24 + 24, 16-aligned

    def test_fresh_tensors_a_partial_mix_or_separate_receive_buffers_go_per_tensor(self) -> None:
        specs = [((4,), torch.float32), ((6,), torch.bfloat16)]
        arrived = receive_buffers(specs, torch.device("cpu"))
        cases = {
            "fresh payload": ([torch.ones(4), torch.ones(6, dtype=torch.bfloat16)], receive_buffers(specs, "cpu")),
            "mixed payload": ([arrived[0], torch.ones(6, dtype=torch.bfloat16)], receive_buffers(specs, "cpu")),
            "out of order": ([arrived[1], arrived[0]], receive_buffers(specs[::-1], "cpu")),
            "separate receive": (arrived, receive_buffers(specs, "cpu", flat=False)),
            "a group cut short": (arrived[:1], receive_buffers(specs[:1], "cpu")),
        }
        for name, (payload, receive) in cases.items():
            with self.subTest(name):
                ops = self._ops(payload, receive)
                self.assertEqual([op[1] for op in ops[::2]], payload)
                self.assertEqual(len(ops), 2 * len(payload))

    def test_tags_of_consecutive_transfers_never_collide(self) -> None:
        ring = self.ring()
        for index in range(4):
            n = TAGS_PER_TRANSFER if index == 2 else 2  # a full transfer next to small ones
            start_transfer(ring, index, [torch.ones(1)] * n, [torch.empty(1)] * n)
        tags = [op[3] for op in ring.group.ops if op[0] == "send"]
        self.assertEqual(len(tags), len(set(tags)))
        self.assertEqual(len(tags), 2 + 2 + TAGS_PER_TRANSFER + 2)

    def test_a_payload_longer_than_the_tag_room_or_unlike_its_receive_buffers_is_refused(self) -> None:
        n = TAGS_PER_TRANSFER + 1
        for ring in (RingGroup.resolve(""), self.ring()):
            with self.subTest(size=ring.size):
                with self.assertRaises(AssertionError):
                    start_transfer(ring, 0, [torch.ones(1)] * n, [torch.empty(1)] * n)
                with self.assertRaises(AssertionError):
                    start_transfer(ring, 0, [torch.ones(1)] * 2, [torch.empty(1)])

    def test_the_row_gather_hands_a_flat_output_and_returns_one_row_per_rank(self) -> None:
        def gather(out, row, group=None):
            self.assertEqual(out.dim(), 1)  # gloo's all-gather rejects a 2-D output
            out.copy_(torch.cat([row + 100 * r for r in range(3)]))

        with mock.patch.object(transport, "dist") as fake:
            fake.all_gather_single.side_effect = gather
            table = all_gather_rows(self.ring(), torch.tensor([1, 2]))
        self.assertEqual(table.tolist(), [[1, 2], [101, 102], [201, 202]])


if __name__ == "__main__":
    unittest.main()
