"""Two copies of a model trained in lock step: each step of the compiled copy starts from the eager copy's
parameters.

Two copies that train on their own drift apart by rounding (the ring adds a token's top-k contributions in
another order: ~1e-7 relative per step), and the drift feeds back through the optimizer. A routing decision at
a near-tie (a top-k choice, a capacity slot kept or dropped) can then go one way in one copy and the other way
in the other, and the copies compute different things: such a test fails on a correct ring, at random. So a
test that compares a compiled model with its eager original over several steps loads the eager copy's
parameters into the compiled copy before every step: each step checks one step of the same math, at the
parameters the training itself produced (a wrong gradient still moves the eager copy's trajectory, and the
compiled copy's gradients are compared at every step).

The copy is in place (``load_state_dict`` keeps the ``Parameter`` objects): Dynamo's guards on the parameters still hold, so nothing
recompiles.
"""

from __future__ import annotations

from torch import Tensor, nn


def parameters_of(model: nn.Module) -> dict[str, Tensor]:
    """A copy of ``model``'s state (parameters and buffers) by name."""
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def load_parameters(model: nn.Module, values: dict[str, Tensor]) -> None:
    """Copy ``values`` into ``model``'s parameters and buffers in place (``load_state_dict``: every name)."""
    model.load_state_dict(values, strict=True)


def follow(compiled: nn.Module, eager: nn.Module) -> None:
    """Start ``compiled``'s next step from ``eager``'s parameters (the two are built alike)."""
    load_parameters(compiled, parameters_of(eager))
