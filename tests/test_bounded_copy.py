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
            # Sizes around the 16-word step of the interpreter's blocks: fewer words than one step, several
            # steps per block, a last step cut short; bf16 and fp32; more blocks than steps.
            for numel, dtype in ((8, torch.bfloat16), (200, torch.bfloat16), (1000, torch.float32), (4, torch.float32)):
                src = torch.randn(numel, generator=gen).to(dtype)
                for ctas in (1, 3, 64):
                    dst = torch.full_like(src, float("nan"))
                    assert k._applies(dst, src), (numel, dtype)
                    k.bounded_copy_(dst, src, ctas)
                    assert torch.equal(dst.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                       src.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (numel, ctas)
            # What the kernel does not take is copied by Tensor.copy_: unaligned bytes, strided, mixed dtypes.
            odd, strided = torch.randn(7), torch.randn(16, 2)[:, 0]
            for dst, src in ((torch.empty(7), odd), (torch.empty(16), strided), (torch.empty(8).double(), torch.randn(8))):
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
