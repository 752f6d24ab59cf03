"""Data-parallel GRPO over torch.distributed: the same `train()` under `torchrun` or `accelerate launch`.

Each rank (process) holds the whole model, rolls out and scores its share of the step's
prompts (whole groups: a prompt's completions never leave their rank, so advantages need no
communication), and runs the policy update on them. Every rank normalises its loss by the
totals of the *global* batch (sequences, and tokens for "dapo"), so summing the ranks'
gradients with one all-reduce gives exactly the gradient of the whole batch, and every rank
then takes the same optimizer step. Rank 0 alone logs, shows the dashboard and writes
checkpoints; records describe the global batch.

With one process (the usual notebook case) every function here is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def setup(device: torch.device) -> World:
    """Join the process group the launcher described (RANK / WORLD_SIZE / MASTER_ADDR env vars).

    torchrun and `accelerate launch` both set these; a process group the caller already
    started is used as is. NCCL on CUDA, gloo on the CPU.
    """
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed support.")
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return World(dist.get_rank(), dist.get_world_size())


def local_device() -> torch.device:
    """The device this process should use: its own GPU under a launcher (LOCAL_RANK), else cuda or cpu."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce(value: torch.Tensor, world: World, op=None) -> torch.Tensor:
    """The sum (or `op`) of `value` over ranks, as a new tensor; `value` itself with one process."""
    if not world.distributed:
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=op or dist.ReduceOp.SUM)
    return out


def all_reduce_gradients(params, world: World) -> None:
    """Sum every parameter's gradient over ranks, in one flat buffer (one collective, not one per tensor)."""
    if not world.distributed:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
        offset += n


def gather_rows(value: torch.Tensor, world: World) -> torch.Tensor:
    """Rank-ordered concatenation of each rank's rows (the same row count on every rank); 2-D
    tensors of different widths are right-padded with zeros to the widest first."""
    if not world.distributed:
        return value
    if value.dtype == torch.bool:  # gloo has no bool collectives
        return gather_rows(value.to(torch.uint8), world).bool()
    if value.dim() > 1:
        width = int(all_reduce(torch.tensor(value.shape[1], device=value.device), world, dist.ReduceOp.MAX))
        value = torch.cat([value, value.new_zeros(value.shape[0], width - value.shape[1])], dim=1)
    pieces = [torch.empty_like(value) for _ in range(world.size)]
    dist.all_gather(pieces, value.contiguous())
    return torch.cat(pieces)


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
