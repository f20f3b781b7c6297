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

from relay_compile.runtime import transport
from relay_compile.runtime.transport import (
    TAGS_PER_TRANSFER,
    RingGroup,
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


class OpsOfALargerRing(unittest.TestCase):
    """``dist`` replaced by a recorder: rank 1 of a ring of 3 (global ranks 10, 11, 12)."""

    RING = RingGroup(group=None, rank=1, size=3, next_global=12, prev_global=10)

    def test_each_tensor_of_a_transfer_goes_to_the_next_rank_and_comes_from_the_previous_under_its_own_tag(
        self,
    ) -> None:
        payload = [torch.ones(2), torch.ones(3), torch.ones(1)]
        receive = [torch.empty(2), torch.empty(3), torch.empty(1)]
        with mock.patch.object(transport, "dist") as fake:
            fake.P2POp.side_effect = lambda op, t, peer, group, tag: (op, t, peer, tag)
            work = mock.Mock()
            fake.batch_isend_irecv.return_value = [work]
            xfer = start_transfer(self.RING, 5, payload, receive)
        (ops,), _ = fake.batch_isend_irecv.call_args
        want = []
        for pos in range(3):
            tag = 5 * 64 + pos
            want += [(fake.isend, payload[pos], 12, tag), (fake.irecv, receive[pos], 10, tag)]
        self.assertEqual(len(ops), len(want))
        for got_op, want_op in zip(ops, want):
            self.assertIs(got_op[0], want_op[0])
            self.assertIs(got_op[1], want_op[1])
            self.assertEqual(got_op[2:], want_op[2:])
        self.assertEqual(TAGS_PER_TRANSFER, 64)
        self.assertEqual(xfer.works, [work])
        work.wait.assert_not_called()
        got = xfer.wait()
        self.assertEqual([id(t) for t in got], [id(t) for t in receive])  # the receive buffers themselves
        work.wait.assert_called_once_with()
        self.assertEqual(xfer.sent, [])  # the send tensors are released once the transfer completed

    def _ops(self, payload, receive):
        with mock.patch.object(transport, "dist") as fake:
            fake.P2POp.side_effect = lambda op, t, peer, group, tag: (op, t, peer, tag)
            start_transfer(self.RING, 2, payload, receive)
        (ops,), _ = fake.batch_isend_irecv.call_args
        return fake, ops

    def test_receive_buffers_are_aligned_views_of_one_buffer_unless_asked_for_separate_tensors(self) -> None:
        specs = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2,), torch.int64)]
        bufs = receive_buffers(specs, torch.device("cpu"))
        self.assertEqual([(tuple(b.shape), b.dtype) for b in bufs], [(s, d) for s, d in specs])
        base = bufs[0].untyped_storage().data_ptr()
        self.assertEqual([b.data_ptr() - base for b in bufs], [0, 32, 64])  # 30 and 28 bytes, 16-aligned
        self.assertEqual(bufs[0].untyped_storage().nbytes(), 80)
        separate = receive_buffers(specs, torch.device("cpu"), flat=False)
        self.assertEqual(len({b.untyped_storage().data_ptr() for b in separate}), 3)

    def test_a_payload_forwarded_as_it_was_received_travels_as_one_span_of_bytes(self) -> None:
        specs = [((3, 5), torch.bfloat16), ((7,), torch.float32)]
        arrived = receive_buffers(specs, torch.device("cpu"))
        arrived[0].fill_(1.5)
        arrived[1].fill_(-2.0)
        receive = receive_buffers(specs, torch.device("cpu"))
        fake, ops = self._ops(arrived, receive)
        self.assertEqual([(op[0], op[2], op[3]) for op in ops], [(fake.isend, 12, 128), (fake.irecv, 10, 128)])
        send_span, recv_span = ops[0][1], ops[1][1]
        self.assertEqual((send_span.dtype, send_span.numel(), recv_span.numel()), (torch.uint8, 60, 60))
        recv_span.copy_(send_span)  # what the peer's receive does: the views of the next buffer get the values
        self.assertTrue(torch.equal(receive[0], arrived[0]) and torch.equal(receive[1], arrived[1]))

    def test_a_payload_from_two_buffers_travels_as_two_spans(self) -> None:
        circ, trail = [((4,), torch.bfloat16), ((3,), torch.bfloat16)], [((5,), torch.float32), ((2,), torch.float32)]
        arrived = receive_buffers(circ, "cpu") + receive_buffers(trail, "cpu")
        receive = receive_buffers(circ, "cpu") + receive_buffers(trail, "cpu")
        _, ops = self._ops(arrived, receive)
        self.assertEqual([(op[1].dtype, op[1].numel(), op[3]) for op in ops],
                         [(torch.uint8, 22, 128), (torch.uint8, 22, 128), (torch.uint8, 40, 129), (torch.uint8, 40, 129)])

    def test_fresh_tensors_a_partial_mix_or_separate_receive_buffers_go_per_tensor(self) -> None:
        specs = [((4,), torch.float32), ((6,), torch.bfloat16)]
        arrived = receive_buffers(specs, torch.device("cpu"))
        cases = {
            "fresh payload": ([torch.ones(4), torch.ones(6, dtype=torch.bfloat16)], receive_buffers(specs, "cpu")),
            "mixed payload": ([arrived[0], torch.ones(6, dtype=torch.bfloat16)], receive_buffers(specs, "cpu")),
            "out of order": ([arrived[1], arrived[0]], receive_buffers(specs[::-1], "cpu")),
            "separate receive": (arrived, receive_buffers(specs, "cpu", flat=False)),
        }
        for name, (payload, receive) in cases.items():
            with self.subTest(name):
                _, ops = self._ops(payload, receive)
                self.assertEqual([op[1] for op in ops[::2]], payload)
                self.assertEqual(len(ops), 4)

    def test_tags_of_consecutive_transfers_never_collide(self) -> None:
        tags: list[int] = []
        with mock.patch.object(transport, "dist") as fake:
            fake.P2POp.side_effect = lambda op, t, peer, group, tag: tags.append(tag) if op is fake.isend else None
            for index in range(4):
                n = TAGS_PER_TRANSFER if index == 2 else 2  # a full transfer next to small ones
                start_transfer(self.RING, index, [torch.ones(1)] * n, [torch.empty(1)] * n)
        self.assertEqual(len(tags), len(set(tags)))
        self.assertEqual(len(tags), 2 + 2 + TAGS_PER_TRANSFER + 2)

    def test_a_payload_longer_than_the_tag_room_or_unlike_its_receive_buffers_is_refused(self) -> None:
        n = TAGS_PER_TRANSFER + 1
        for ring in (RingGroup.resolve(""), self.RING):
            with mock.patch.object(transport, "dist"):
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
            table = all_gather_rows(self.RING, torch.tensor([1, 2]))
        self.assertEqual(table.tolist(), [[1, 2], [101, 102], [201, 202]])


if __name__ == "__main__":
    unittest.main()
