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
