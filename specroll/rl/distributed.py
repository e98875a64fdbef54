"""Multi-process data parallel on ``torch.distributed`` (gloo: CPU processes on one or more machines).

Each process ("rank") holds a full replica of the policy. A GRPO step's prompts are split between the
ranks by whole groups, so every group's G completions, rewards and advantages stay on one rank and the
group statistics are exact. Each rank rolls out and scores its share, then the update runs on all ranks
at once:

- the loss weights of every mini-batch come from the lengths of *all* ranks' rows (gathered: a few
  integers per row), so ``grpo``, ``dapo`` and ``dr_grpo`` normalise over the global batch exactly as
  one process would;
- after the backward passes the gradients are summed over the ranks (``all_reduce``); every rank then
  clips and steps the same gradient, so the replicas stay identical without a broadcast per step.

The result is the single-process update on the union of the ranks' rows, up to floating-point summation
order (``tests/test_distributed.py`` checks it for every aggregation and for mini-batches). Rank 0
writes metrics and checkpoints; the others wait at a barrier. Rollout reuse: every rank's store also
gets the other ranks' completions. An online draft head: broadcast once, then each of its AdamW steps
averages the head's gradients over the ranks (``mean_grads``).

Launch: ``specroll train --nproc N`` (re-launches itself through ``torch.distributed.run``), or
``torchrun --nproc-per-node N -m specroll train ...`` for several machines. Outside such a launcher
``Dist()`` is the one-process no-op, and the trainer behaves exactly as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist


class Dist:
    """The process group as the trainer sees it; ``Dist()`` (world 1) turns every call into a no-op."""

    def __init__(self, rank: int = 0, world: int = 1):
        if not (0 <= rank < world):
            raise ValueError(f"rank {rank} is outside a world of {world} processes")
        self.rank, self.world = rank, world

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def shard(self, items: Sequence) -> list:
        """This rank's contiguous share of ``items`` (whose length the world size must divide)."""
        n = len(items)
        if n % self.world:
            raise ValueError(f"{n} items cannot be split evenly between {self.world} processes")
        k = n // self.world
        return list(items[self.rank * k:(self.rank + 1) * k])

    def gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (picklable objects; meant for small ones)."""
        if not self.active:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_main(self, obj) -> list | None:
        """``obj`` of every rank, in rank order, on rank 0 (None on the others): for large objects only rank 0
        needs, e.g. each rank's drafter state for a checkpoint."""
        if not self.active:
            return [obj]
        out: list | None = [None] * self.world if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place."""
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's ``.grad`` over the ranks. A rank whose rows gave a parameter no gradient
        contributes zeros (its ``.grad`` is created), so every rank takes part in every reduction."""
        if not self.active:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def mean_grads(self, params: Sequence[torch.nn.Parameter], has_data: bool) -> int:
        """Average every parameter's ``.grad`` over the ranks that had data (``has_data``; the others pass
        zeros). Returns how many had data (0: nobody did, and the caller skips its step). For learners whose
        loss is a mean over each rank's own batch, e.g. the online draft head."""
        if not self.active:
            return int(has_data)
        n = int(self.sum_(torch.tensor([int(has_data)]))[0])
        self.sum_grads(params)
        if n > 1:
            for p in params:
                p.grad.div_(n)
        return n

    def any(self, flag: bool) -> bool:
        """True if ``flag`` is true on any rank."""
        return bool(self.sum_(torch.tensor([int(flag)]))[0]) if self.active else flag

    def broadcast_params(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers into every rank's replica. Written with an in-place copy, which
        bumps each tensor's version counter (a c10d write into it would not), so caches keyed on those
        counters (the decoder's packed weights) see the change."""
        if not self.active:
            return
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                buf = t.detach().clone()
                dist.broadcast(buf, src=0)
                t.copy_(buf)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def agree_fast_bf16(self) -> bool:
        """Make every rank take the same ``auto`` dtypes: bf16 counts as fast only if it does on every rank
        (``device.fast_bf16`` may time a matmul, and ranks on different machines may differ). The answer is
        set as ``SPECROLL_FAST_BF16`` in this process, so every later ``auto`` follows it."""
        from .. import device

        fast = torch.tensor([int(device.fast_bf16())])
        if self.active:
            dist.all_reduce(fast, op=dist.ReduceOp.MIN)
        os.environ["SPECROLL_FAST_BF16"] = str(int(fast.item()))
        device.fast_bf16.cache_clear()
        return bool(fast.item())


def from_env() -> Dist:
    """The ``Dist`` of this process: a launcher (``torchrun``, ``specroll train --nproc``) sets
    ``WORLD_SIZE`` / ``RANK``; the gloo group is created here when it is not yet. Each rank then uses
    its share of this machine's cores for its own torch threads."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it (to 1 when it starts several processes)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    d = Dist(dist.get_rank(), dist.get_world_size())
    d.agree_fast_bf16()
    return d


def close(d: Dist) -> None:
    """Leave the process group (end of a run)."""
    if d.active and dist.is_initialized():
        dist.destroy_process_group()
