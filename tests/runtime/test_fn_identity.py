"""Expert functions keyed by what they compute, and the bounded registry of the functional API (no processes).

A closure made at every step used to register one more spec (holding what it captured) per step; with
``name=`` it raised at step 2. Here a ring of one runs ``ring_moe_experts`` for hundreds of steps.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import unittest
import weakref

import torch
from torch import Tensor

from relay_compile import ring_moe_experts
from relay_compile.runtime import specs
from relay_compile.runtime.fn_identity import identify, identity_code
from tests.test_ring_moe import assert_close_rel, local_weights, plain_ffn, routed_inputs


def scaled(scale: object):
    """A closure over ``scale``, made anew at every call (as code that builds its expert function per step)."""
    return lambda x_SH, counts_NL, splits_N, weights: plain_ffn(x_SH, counts_NL, splits_N, weights) * scale


def other_fn(x_SH, counts_NL, splits_N, weights):
    return plain_ffn(x_SH, counts_NL, splits_N, weights) + 1


class Experts:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(self, x_SH, counts_NL, splits_N, weights):
        return plain_ffn(x_SH, counts_NL, splits_N, weights) * self.scale


class DescribeKeysByWhatAFunctionComputes(unittest.TestCase):
    def test_closures_over_equal_values_share_a_key_and_other_values_only_share_the_identity(self) -> None:
        self.assertEqual(identify(scaled(2.0)), identify(scaled(2.0)))
        key2, identity2 = identify(scaled(2.0))
        key3, identity3 = identify(scaled(3.0))
        self.assertNotEqual(key2, key3)
        self.assertEqual(identity2, identity3)
        self.assertIn("scaled.<locals>.<lambda>", identity2)

    def test_different_code_has_a_different_identity(self) -> None:
        self.assertNotEqual(identify(plain_ffn)[1], identify(other_fn)[1])
        self.assertNotEqual(identify(plain_ffn)[1], identify(scaled(1.0))[1])

    def test_captured_objects_count_by_identity_in_the_key_and_not_at_all_in_the_identity(self) -> None:
        a, b = torch.ones(1), torch.ones(1)
        self.assertEqual(identify(scaled(a)), identify(scaled(a)))
        self.assertNotEqual(identify(scaled(a))[0], identify(scaled(b))[0])
        self.assertEqual(identify(scaled(a))[1], identify(scaled(b))[1])

    def test_bound_methods_and_partials_are_keyed_by_their_function_and_what_they_bind(self) -> None:
        e, f = Experts(2.0), Experts(2.0)
        self.assertEqual(identify(e.forward), identify(e.forward))  # a new bound-method object per access
        self.assertNotEqual(identify(e.forward)[0], identify(f.forward)[0])
        self.assertEqual(identify(e.forward)[1], identify(f.forward)[1])
        p, q = functools.partial(other_fn, counts_NL=None), functools.partial(other_fn, counts_NL=None)
        self.assertEqual(identify(p), identify(q))
        self.assertNotEqual(identify(p)[0], identify(functools.partial(other_fn, counts_NL=1))[0])

    def test_a_self_referencing_closure_is_described(self) -> None:
        def outer():
            def fn(x_SH, counts_NL, splits_N, weights):
                return fn if x_SH is None else plain_ffn(x_SH, counts_NL, splits_N, weights)
            return fn

        self.assertEqual(identify(outer()), identify(outer()))

    def test_identity_codes_are_62_bit_and_the_same_in_every_process(self) -> None:
        # The first 8 bytes of sha256, not the salted hash() of a str (which differs per process).
        want = int.from_bytes(hashlib.sha256(b"ffn").digest()[:8], "little") >> 2
        self.assertEqual(identity_code("ffn"), want)
        self.assertLess(identity_code("ffn"), 1 << 62)
        self.assertNotEqual(identity_code("ffn"), identity_code("ffn2"))


class TheFunctionalRegistryIsBounded(unittest.TestCase):
    def setUp(self) -> None:
        self.weights = local_weights(0, 4, 1)
        self.x, self.ids, self.scores = routed_inputs("random", 0, 1, 4, seed=3)
        self.base = ring_moe_experts(self.x, self.ids, self.scores, self.weights, expert_fn=plain_ffn,
                                     experts_per_rank=4)

    def run_fn(self, fn, **kw) -> Tensor:
        return ring_moe_experts(self.x, self.ids, self.scores, self.weights, expert_fn=fn, experts_per_rank=4, **kw)

    def test_a_closure_made_per_step_over_equal_values_registers_once(self) -> None:
        self.run_fn(scaled(2.0))
        before = specs.registered()
        for _ in range(300):
            y = self.run_fn(scaled(2.0))
        self.assertEqual(specs.registered(), before)
        assert_close_rel(y, 2.0 * self.base, 1e-6)

    def test_closures_over_new_objects_stay_bounded_and_release_what_they_captured(self) -> None:
        alive = []
        for step in range(300):
            scale = torch.tensor(1.0 + step)
            alive.append(weakref.ref(scale))
            y = self.run_fn(scaled(scale))
            assert_close_rel(y, (1.0 + step) * self.base, 1e-6, f"step {step}")
            del scale
        gc.collect()
        self.assertLessEqual(sum(r() is not None for r in alive), specs.MAX_FUNCTIONAL_SPECS)
        self.assertLessEqual(specs.registered(), specs.MAX_FUNCTIONAL_SPECS + 64)

    def test_a_stable_name_replaces_the_function_instead_of_raising(self) -> None:
        before = None
        for step in range(5):
            y = self.run_fn(scaled(float(step + 1)), name="my_experts")  # raised "already registered" at step 2
            before = before or specs.registered()
            assert_close_rel(y, (step + 1) * self.base, 1e-6, f"step {step}")
        self.assertEqual(specs.registered(), before)

    def test_a_backward_runs_with_its_forwards_function_after_eviction_or_replacement(self) -> None:
        def grads_of(fn, name: str | None, meanwhile=lambda: None) -> list[Tensor]:
            leaves = [t.detach().clone().requires_grad_() for t in (self.x, self.scores, *self.weights)]
            y = ring_moe_experts(leaves[0], self.ids, leaves[1], leaves[2:], expert_fn=fn, experts_per_rank=4,
                                 name=name)
            meanwhile()
            return list(torch.autograd.grad(y.sum(), leaves))

        def churn() -> None:
            # The name gets another function, and more specs than the registry keeps come and go.
            self.run_fn(scaled(torch.tensor(100.0)), name="held")
            for step in range(specs.MAX_FUNCTIONAL_SPECS + 5):
                self.run_fn(scaled(torch.tensor(float(step))))

        got = grads_of(scaled(torch.tensor(3.0)), "held", churn)
        want = grads_of(scaled(3.0), None)
        for g, w in zip(got, want, strict=True):
            assert_close_rel(g, w, 1e-6, "the backward used its forward's function")


if __name__ == "__main__":
    unittest.main()
