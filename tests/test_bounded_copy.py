"""``kernels.bounded_copy``: a copy by a fixed number of thread blocks (the stand-in's NCCL-like link copies)."""

from __future__ import annotations

import unittest

import torch

from relay_compile.kernels import bounded_copy as k
from tests.triton_interpreter import run_interpreted


class BoundedCopy(unittest.TestCase):
    def test_off_cuda_and_without_the_interpreter_it_is_tensor_copy(self) -> None:
        src = torch.arange(40, dtype=torch.float32)
        dst = torch.empty_like(src)
        self.assertFalse(k._applies(dst, src))
        k.bounded_copy_(dst, src, 4)
        self.assertTrue(torch.equal(dst, src))

    def test_kernel_under_the_interpreter_copies_every_byte_whatever_the_blocks(self) -> None:
        script = """
            import torch
            from relay_compile.kernels import bounded_copy as k
            gen = torch.Generator().manual_seed(0)
            # Sizes around the 16-word step of the interpreter's blocks: one step, several steps per block, more
            # blocks than steps; bf16 and fp32.
            sizes = ((32, torch.bfloat16), (320, torch.bfloat16), (1008, torch.float32), (16, torch.float32))
            for numel, dtype in sizes:
                src = torch.randn(numel, generator=gen).to(dtype)
                words = torch.int16 if dtype == torch.bfloat16 else torch.int32
                for ctas in (1, 3, 64):
                    dst = torch.full_like(src, float("nan"))
                    assert k._applies(dst, src), (numel, dtype)
                    k.bounded_copy_(dst, src, ctas)
                    assert torch.equal(dst.view(words), src.view(words)), (numel, ctas)
            # What the kernel does not take is copied by Tensor.copy_: not a multiple of 64 bytes, strided, mixed
            # dtypes, a negative view.
            cases = ((torch.empty(4), torch.randn(4)), (torch.empty(16), torch.randn(16, 2)[:, 0]),
                     (torch.empty(16).double(), torch.randn(16)), (torch.empty(16), torch.randn(16)._neg_view()))
            for dst, src in cases:
                assert not k._applies(dst, src)
                k.bounded_copy_(dst, src, 2)
                assert torch.equal(dst, src.to(dst.dtype))
            print("ok")
        """
        run_interpreted(self, script)

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
    def test_triton_kernel_on_cuda(self) -> None:
        src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
        for ctas in (1, 16):
            dst = torch.zeros_like(src)
            k.bounded_copy_(dst, src, ctas)
            self.assertTrue(torch.equal(dst.view(torch.int16), src.view(torch.int16)))
