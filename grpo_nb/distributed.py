"""Data-parallel GRPO over torch.distributed: the same `train()` under `torchrun` or `accelerate launch`.

Each rank (process) holds the whole model, rolls out and scores its share of the step's
prompts (whole groups: a prompt's completions never leave their rank, so advantages need no
communication), and runs the policy update on them. Every rank normalises its loss by the
totals of the *global* batch (sequences, and tokens for "dapo"), so summing the ranks'
gradients with one all-reduce gives exactly the gradient of the whole batch, and every rank
then takes the same optimizer step. Rank 0 alone logs, shows the dashboard and writes
checkpoints; records describe the global batch.

With `fsdp=True` the decoder layers' weights are sharded over the ranks instead (FSDP2,
torch's `fully_shard`): each rank keeps 1/world of every layer, gathers a layer's whole weights
just before it runs and frees them after, and its gradients are reduce-scattered (summed, not
averaged: the loss is already normalised by the global batch) during backward. Embeddings,
final norm and lm_head stay whole on every rank (tied to each other in many models, and read
directly by the log-prob path); their gradients, if they train, are all-reduced as above.
Checkpoints gather the shards into whole tensors, so they load the same with any number of ranks.

With one process (the usual notebook case) every function here is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # a torch build without distributed support
    DTensor, distribute_tensor = (), None

from .attachments import base_model


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


def launch_rank() -> int:
    """This process's rank before `setup` (the process group's, else the launcher's RANK; 0 alone)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


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
    """Sum every parameter's gradient over ranks, in one flat buffer (one collective, not one per tensor).

    Sharded (FSDP) parameters are left out: their backward already summed them into each rank's shard.
    """
    params = [p for p in params if not isinstance(p, DTensor)]
    if not world.distributed or not params:
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


# ----------------------------------------------------------------------------------------
# FSDP: sharded decoder layers


def shard_model(model, world: World) -> None:
    """Shard the decoder layers' weights (frozen base and LoRA alike) over the ranks, in place.

    Call before building the optimizer: the sharded parameters replace the originals.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .offload import find_checkpointing_layers

    base = base_model(model)
    layers = find_checkpointing_layers(model)
    if not layers or not hasattr(base, "get_decoder"):
        raise ValueError(f"fsdp=True shards transformers decoder layers, and {type(base).__name__} has none that "
                         "grpo-nb recognises. Train it without fsdp (each rank then holds the whole model).")
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world.size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    decoder = base.get_decoder()
    # The decoder stack is the root FSDP module, owning none of the weights: FSDP keeps a root's
    # gathered weights after its forward, so a layer as root would never free its gathered copy.
    fully_shard(decoder, mesh=mesh, ignored_params={p for p in decoder.parameters() if not isinstance(p, DTensor)})
    for module in [*layers, decoder]:
        # Each rank's loss is normalised by the global batch already: sum the ranks' gradients.
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
        else:  # older torch
            module.set_reduce_scatter_divide_factor(1.0)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-scaled sum


def is_sharded(model) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, also when some gradients are FSDP shards and some whole:
    the norm is over the whole gradient (the shards' squares summed over ranks)."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    unsharded = [g for g in grads if not isinstance(g, DTensor)]
    with torch.no_grad():
        squares = torch.stack([g.float().pow(2).sum() for g in sharded]).sum()
        dist.all_reduce(squares)
        if unsharded:
            squares = squares + torch.stack([g.float().pow(2).sum() for g in unsharded]).sum()
        total = squares.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's
        for g in sharded + unsharded:
            g.mul_(coef.to(g.dtype))
    return total


def like(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A whole `tensor` placed as `param` is: split into this rank's shard when `param` is sharded
    (a collective: every rank calls it for the same parameters in the same order)."""
    if not isinstance(param, DTensor):
        return tensor
    return distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a possibly sharded tensor (a collective when sharded)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_trainable_state(model) -> dict[str, torch.Tensor] | None:
    """Every trainable tensor whole, on the CPU, gathered from the shards; None for an unsharded
    model (whose tensors are whole already). A collective: every rank calls it."""
    if not is_sharded(model):
        return None
    with torch.no_grad():
        return {name: whole(p).detach().cpu() for name, p in model.named_parameters() if p.requires_grad}


def full_optimizer_state(optimizer) -> dict:
    """optimizer.state_dict() with sharded moments gathered whole, so that it loads with any number
    of ranks. A collective when sharded: every rank calls it."""
    state = optimizer.state_dict()
    if not any(isinstance(v, DTensor) for s in state["state"].values() for v in s.values()):
        return state
    return {**state, "state": {i: {k: whole(v).cpu() if isinstance(v, DTensor) else v for k, v in s.items()}
                               for i, s in state["state"].items()}}


def load_optimizer_state(optimizer, state: dict) -> None:
    """The checkpoint's per-parameter state (moments, step counts) into `optimizer`, whole moments of sharded
    parameters split into their shards. Its hyperparameters (betas, weight_decay, eps, ...) stay the
    optimizer's own, this run's config's: load_state_dict would put the checkpoint's back, while the resume's
    warning says the new settings apply (the lr follows this run's schedule: step.follow_schedule)."""
    own = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, own):
        group.update(settings)
    for param, values in optimizer.state.items():
        if isinstance(param, DTensor):
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    values[key] = like(param, value)
