"""One training step of the full model on rank 0 of the stand-in EP group, and one measured probe of it.

    trainer = Trainer.build(cfg, group)
    probe = trainer.probe(run_layer, tokens=16384, warmup=1, repeats=2, budget_bytes=40 << 30)

A step: forward through ``run_layer`` per layer, the chunked loss, backward of ``loss / N``, an in-place
all-reduce (sum) of each replicated parameter's gradient over the EP group, and the mixed-precision AdamW
step (``optimizer.MixedPrecisionAdamW``). A probe: ``warmup`` steps, then ``repeats`` timed steps whose peak
is measured with ``relay_compile.memory.PeakMemory``; an out-of-memory error anywhere means "does not fit"
and everything it held is released before the probe returns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relay_compile.bench.full_model.model import FullModel, FullModelConfig, LayerRunner
from relay_compile.bench.full_model.optimizer import MixedPrecisionAdamW
from relay_compile.bench.measure import free_cached, is_oom
from relay_compile.bench.standin_group import drop_pending_messages
from relay_compile.memory import PeakMemory

__all__ = ["Probe", "Trainer"]


@dataclass(kw_only=True)
class Probe:
    """One measured length of one row (JSON-able). Times in ms, memory in bytes; None where not measured."""

    tokens: int
    fits: bool
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: int | None = None  # per-rank peak of a step: resident + the most allocated above it
    resident_bytes: int | None = None  # parameters, masters and AdamW state, between steps
    memory_budget: float | None = None  # the partitioner's fraction ("budget" rows)
    link_ms: float | None = None  # modeled link time of one step (link.py), simulated
    error: str = ""


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of ``fn()``: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@dataclass
class Trainer:
    """The model, its optimizer and its EP group: what every row trains (rows differ in ``run_layer`` only)."""

    model: FullModel
    optimizer: MixedPrecisionAdamW
    group: dist.ProcessGroup

    @classmethod
    def build(cls, cfg: FullModelConfig, group: dist.ProcessGroup, lr: float = 1e-4) -> Trainer:
        model = FullModel(cfg, group.group_name)
        buckets: list[list[nn.Parameter]] = [
            [*model.embed.parameters()], *([*layer.parameters()] for layer in model.layers),
            [*model.norm.parameters(), *model.lm_head.parameters()],
        ]
        return cls(model, MixedPrecisionAdamW(buckets, lr=lr, fused=cfg.device == "cuda"), group)

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def resident_bytes(self) -> int:
        """Bytes kept across steps: parameters, fp32 masters, AdamW state."""
        tensors = [*self.model.parameters(), *self.optimizer.state_tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def batch(self, tokens: int, step: int) -> Tensor:
        """``tokens / S`` random sequences of ``S + 1`` tokens ``(B, S + 1)`` (inputs and shifted targets)."""
        cfg = self.model.cfg
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + step)
        return torch.randint(cfg.vocab, (tokens // cfg.seq_len, cfg.seq_len + 1), generator=gen).to(self.device)

    def step(self, run_layer: LayerRunner, tokens_BS1: Tensor) -> Tensor:
        """One training step (module docstring); returns the loss."""
        inputs_T, targets_T = tokens_BS1[:, :-1].reshape(-1), tokens_BS1[:, 1:].reshape(-1)
        self.optimizer.zero_grad()
        loss = self.model.loss(self.model.hidden_states(inputs_T, run_layer), targets_T)
        (loss / dist.get_world_size(self.group)).backward()
        for p in self.model.replicated_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
        self.optimizer.step()
        return loss.detach()

    def _measured_steps(
        self, run_layer: LayerRunner, tokens: int, warmup: int, repeats: int
    ) -> tuple[float, int, int]:
        """(median step ms, resident bytes after warm-up, peak bytes above them) of ``repeats`` steps."""
        batch = self.batch(tokens, step=0)
        for _ in range(warmup):
            self.step(run_layer, batch)
        resident = self.resident_bytes()
        with PeakMemory(self.device) as mem:
            times = [_timed(lambda: self.step(run_layer, batch), self.device) for _ in range(max(1, repeats))]
        return statistics.median(times), resident, mem.peak_bytes

    def probe(self, run_layer: LayerRunner, tokens: int, *, warmup: int, repeats: int, budget_bytes: int) -> Probe:
        """Train ``warmup`` + ``repeats`` steps at ``tokens`` per rank; fits: no OOM and peak <= budget."""
        try:
            step_ms, resident, above = self._measured_steps(run_layer, tokens, warmup, repeats)
        except Exception as e:  # an OOM is an answer ("does not fit"); anything else is a bug to raise
            if not is_oom(e):
                raise
            drop_pending_messages()  # a ring interrupted mid-transfer leaves a posted send
            return Probe(tokens=tokens, fits=False, error="out of memory")
        finally:  # the steps' tensors died with _measured_steps' frame (or the exception): return their blocks
            self.optimizer.zero_grad()
            free_cached(str(self.device))
        peak = resident + above
        return Probe(tokens=tokens, fits=peak <= budget_bytes, step_ms=step_ms,
                     tokens_per_s=tokens / (step_ms / 1e3), peak_bytes=peak, resident_bytes=resident)
