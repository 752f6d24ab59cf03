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
A layer's gradient checkpoint runs inside FSDP's hooks on it, on every transformers version
(checkpoint_inside_hooks).

With one process (the usual notebook case) every function here is a no-op. Under a launcher, its
variables are checked first (launcher_world), the wait for the other processes to arrive is bounded
(GRPO_NB_DIST_TIMEOUT seconds, default 300), and every rank's settings must agree (check_same_settings).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # a torch build without distributed support
    DTensor, distribute_tensor = (), None
try:
    from torch.distributed.constants import default_pg_timeout
except ImportError:
    default_pg_timeout = timedelta(minutes=30)

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


# How long joining the process group waits for the other processes to arrive (torch's own wait is 30 minutes: a cell
# that hangs without a word when a WORLD_SIZE > 1 left in the environment names processes that will never come).
# Long enough for real launches, where some processes load a large model first; GRPO_NB_DIST_TIMEOUT (seconds) sets
# another. Only the meeting is bounded: the collectives of the run keep torch's own timeouts.
RENDEZVOUS_TIMEOUT_S = 300.0
MAX_RENDEZVOUS_TIMEOUT_S = 7 * 24 * 3600.0

_UNSET = ("To train in this one process, unset them (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: "
          "`unset WORLD_SIZE RANK LOCAL_RANK MASTER_ADDR MASTER_PORT` in the shell, or os.environ.pop(name) for "
          "each in a notebook before train()); to train on several processes, launch the script with torchrun (or "
          "accelerate launch), which starts the processes and sets them for each")


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"The environment variable {name}={text!r} is not a whole number. A launcher (torchrun, "
                         f"accelerate launch) sets it for data-parallel training. {_UNSET}.") from None


def launcher_world() -> tuple[int, int]:
    """(WORLD_SIZE, RANK) as the launcher set them, checked: whole numbers, 0 <= RANK < WORLD_SIZE and, for more
    than one process, MASTER_ADDR and MASTER_PORT present (where the processes meet). (1, 0) without WORLD_SIZE or
    with WORLD_SIZE=1: one process, rank 0 whatever a stale RANK says."""
    size = _env_int("WORLD_SIZE", 1)
    if size < 1:
        raise ValueError(f"The environment variable WORLD_SIZE={os.environ['WORLD_SIZE']!r} must be the number of "
                         f"processes, 1 or more. {_UNSET}.")
    if size == 1:
        return 1, 0
    rank = _env_int("RANK", -1)
    if not 0 <= rank < size:
        said = f"is {os.environ['RANK']!r}" if os.environ.get("RANK", "").strip() else "is not set"
        raise ValueError(f"WORLD_SIZE={size} in the environment makes grpo-nb train data-parallel, but RANK {said}: "
                         f"it must be this process's number, 0 to {size - 1}. {_UNSET}.")
    _env_int("LOCAL_RANK", 0)  # a whole number when set (local_device reads it)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name, "").strip()]
    if missing:
        raise ValueError(f"WORLD_SIZE={size} in the environment makes grpo-nb train data-parallel, but "
                         f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (where the "
                         f"processes meet). {_UNSET}.")
    port = _env_int("MASTER_PORT", 0)
    if not 0 < port < 2**16:
        raise ValueError(f"The environment variable MASTER_PORT={os.environ['MASTER_PORT']!r} must be a port, 1 to "
                         f"65535. {_UNSET}.")
    return size, rank


def rendezvous_timeout() -> float:
    """Seconds joining the process group waits for every process: GRPO_NB_DIST_TIMEOUT, else RENDEZVOUS_TIMEOUT_S."""
    text = os.environ.get("GRPO_NB_DIST_TIMEOUT", "").strip()
    if not text:
        return RENDEZVOUS_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_RENDEZVOUS_TIMEOUT_S:  # a timedelta holds up to ~1e14 s; a week is plenty
        raise ValueError(f"The environment variable GRPO_NB_DIST_TIMEOUT={text!r} must be a number of seconds from "
                         f"0 to {MAX_RENDEZVOUS_TIMEOUT_S:g} (a week): "
                         f"how long joining the process group waits for the other processes (unset: "
                         f"{RENDEZVOUS_TIMEOUT_S:g}).")
    return seconds


def setup(device: torch.device) -> World:
    """Join the process group the launcher described (RANK / WORLD_SIZE / MASTER_ADDR env vars).

    torchrun and `accelerate launch` both set these; a process group the caller already
    started is used as is. NCCL on CUDA, gloo on the CPU. The variables are checked first
    (`launcher_world`), and the processes' meeting waits GRPO_NB_DIST_TIMEOUT seconds
    (RENDEZVOUS_TIMEOUT_S unset), then fails with a message instead of torch's silent 30 minutes.
    """
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    size, rank = launcher_world()
    if size <= 1:
        return World()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed support.")
    timeout = rendezvous_timeout()
    try:
        # What init_process_group("env://") does, with the meeting's wait bounded: rank 0 (or torchrun's agent)
        # holds the store at MASTER_ADDR:MASTER_PORT and waits for the others. The process group then keeps
        # torch's own timeouts for the run's collectives (a rank 0 writing a large checkpoint makes the others
        # wait at a barrier for minutes).
        store, rank, size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
        store.set_timeout(default_pg_timeout)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                store=dist.PrefixStore("default_pg", store), rank=rank, world_size=size)
    except Exception as err:  # torch's DistStoreError ("timed out"), a refused connection, a port in use, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise RuntimeError(
            f"Process {rank} of WORLD_SIZE={size} could not join the process group at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({type(err).__name__}: {first}). "
            f"WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT in the environment make grpo-nb train data-parallel, "
            f"waiting up to {timeout:g} s for the other {size - 1} process{'es' if size > 2 else ''}. {_UNSET}. "
            f"Processes that start slowly (a large model loading) need a longer wait: set "
            f"GRPO_NB_DIST_TIMEOUT=<seconds>.") from err
    return World(dist.get_rank(), dist.get_world_size())


# GRPOConfig fields each rank may set for itself: where rank 0 alone writes and logs (paths may also read
# differently on another machine), and the memory knobs that split the same computation into other chunks.
PER_RANK_SETTINGS = frozenset({"output_dir", "logging_dir", "log_completions_path", "report_to", "run_name", "project",
                               "rollout_max_rows", "logprob_chunk_size"})


def check_same_settings(world: World, config, data: dict) -> None:
    """Refuse ranks that would train apart: every other GRPOConfig field, and the dataset (its size and a digest of a
    few rows), must agree on every rank. Each rank takes its slice of one shuffle drawn from `seed` (its sampling
    seed is offset per rank by grpo-nb itself), so a per-rank seed or dataset order puts the same prompts in a
    step twice; a per-rank learning rate trains different weights; a per-rank max_steps leaves one rank waiting
    for the other forever. `data`: the dataset's resume.data_identity. A collective: every rank calls it, at
    set-up, and every rank raises the same error."""
    if not world.distributed:
        return
    import dataclasses
    import json

    def comparable(value) -> str:  # the same text on every rank (an object a setting holds by its kind)
        return json.dumps(value, sort_keys=True, default=lambda v: type(v).__name__)

    mine = {f.name: comparable(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name not in PER_RANK_SETTINGS}
    mine["the dataset's rows"], mine["the dataset's contents"] = str(data["rows"]), data["rows_digest"]
    everyone: list = [None] * world.size
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        differ = [key for key in first if theirs.get(key) != first[key]]
        if not differ:
            continue
        shown = "; ".join(f"{key} {first[key]} on rank 0, {theirs.get(key)} on rank {rank}"
                          if not key.startswith("the dataset's contents") else
                          f"{key}: other rows or another order on rank {rank} than on rank 0" for key in differ[:6])
        why = []
        if "seed" in differ:
            why.append("seed draws the data order, of which each rank takes its own slice: grpo-nb offsets each "
                       "rank's sampling seed itself, so pass the same seed everywhere (not seed + rank)")
        if {"cpu_rollout_dtype", "rollout_importance_sampling_correction"} & set(differ):
            why.append("cpu_rollout_dtype='auto' (the default) decides per machine whether CPU rollouts use bf16 "
                       "copies (a CPU with native bf16, the model's size): on hosts that differ, set "
                       "cpu_rollout_dtype='bfloat16' or None, and rollout_importance_sampling_correction, explicitly")
        if "the dataset's contents" in differ or "the dataset's rows" in differ:
            why.append("each rank picks its rows by position in the same shuffle: build the dataset the same way on "
                       "every rank (a .shuffle() needs the same seed=, or none)")
        raise ValueError(f"The {world.size} processes were given different settings: {shown}"
                         f"{' (and ' + str(len(differ) - 6) + ' more)' if len(differ) > 6 else ''}. Every rank must "
                         f"train with the same GRPOConfig (all but {', '.join(sorted(PER_RANK_SETTINGS))}) and the "
                         f"same dataset, or the ranks train apart (duplicate prompts in a step, other weights on "
                         f"each rank, a rank waiting forever). {'; '.join(why) + '. ' if why else ''}Compute nothing "
                         f"of them from RANK or LOCAL_RANK.")


def launch_rank() -> int:
    """This process's rank before `setup` (the process group's, else the launcher's RANK; 0 alone, whatever a stale
    RANK says when WORLD_SIZE is unset or 1: that process is rank 0, and takes the output_dir lock)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launcher_world()[1]


def local_device() -> torch.device:
    """The device this process should use: its own GPU under a launcher (LOCAL_RANK), else cuda or cpu."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if _env_int("WORLD_SIZE", 1) <= 1:  # one process: a LOCAL_RANK left in the environment is not its GPU
        return torch.device("cuda", 0)
    return torch.device("cuda", _env_int("LOCAL_RANK", 0))


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


def gather_objects(value, world: World) -> list:
    """Every rank's `value` (any object pickle can copy), in rank order, on every rank; [value] in one process."""
    if not world.distributed:
        return [value]
    out = [None] * world.size
    dist.all_gather_object(out, value)
    return out


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
        checkpoint_inside_hooks(layer)  # before fully_shard, whose FSDP<Layer> class then subclasses it
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


def checkpoints_around_hooks(layer) -> bool:
    """Does `layer`'s class checkpoint its whole `__call__`, module hooks included, rather than its `forward`?

    transformers' GradientCheckpointingLayer did so up to 5.17 at least (5.24 checkpoints `forward`, inside the
    hooks): its `__call__` hands `nn.Module.__call__` to `_gradient_checkpointing_func`. Only that `__call__`
    counts: a layer class with a `__call__` of its own keeps it.
    """
    call = _call_around_hooks()
    return call is not None and type(layer).__call__ is call


def _call_around_hooks():
    """transformers' GradientCheckpointingLayer.__call__ where it checkpoints around the hooks (5.17), else None."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return vars(GradientCheckpointingLayer).get("__call__")


_INSIDE_HOOKS_CLASSES: dict[type, type] = {}


def checkpoint_inside_hooks(layer) -> None:
    """Make `layer` checkpoint its `forward` inside its module hooks, as newer transformers do; a no-op where it
    does already.

    FSDP's hooks on a layer gather its weights before the forward, free them after, and reduce-scatter the
    gradients once the layer's backward is done. When the checkpoint holds the hooks (transformers 5.17), the
    checkpoint function is handed the layer before the gather: grpo-nb's offloaded checkpoint passes the layer's
    parameters to its autograd Function as inputs then, and those are the shards, while the forward computes
    with the gathered copies, so no gradient reached either and every step's gradient norm was 0. With the
    checkpoint inside the hooks, any checkpoint function (offloaded, or torch's) sees the gathered weights, and
    FSDP's backward hooks run around the layer's recomputed backward, as for a layer without checkpointing.
    The layer's class is swapped for a subclass of the same name (per class, once): `layer(...)` is then
    `nn.Module.__call__` (the hooks), whose `forward` checkpoints the class's own forward.
    """
    cls = type(layer)
    if not checkpoints_around_hooks(layer):
        call = _call_around_hooks()
        if call is not None and call in (vars(base).get("__call__") for base in cls.__mro__) \
                and getattr(layer, "gradient_checkpointing", False):
            import transformers

            raise ValueError(f"{cls.__name__} overrides __call__ over transformers' GradientCheckpointingLayer, whose "
                             f"__call__ (transformers {transformers.__version__}) checkpoints the layer around FSDP's "
                             f"hooks: sharded and checkpointed, it would get no gradients, and grpo-nb cannot tell what "
                             f"its override does. Upgrade transformers (5.24 checkpoints inside the hooks), train "
                             f"without gradient checkpointing, or without fsdp")
        return
    if cls not in _INSIDE_HOOKS_CLASSES:
        _INSIDE_HOOKS_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__call__": torch.nn.Module.__call__, "forward": _checkpointed_forward(cls),
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    layer.__class__ = _INSIDE_HOOKS_CLASSES[cls]


def _checkpointed_forward(cls):
    """`cls.forward` (looked up at each call: a forward patched later is the one that runs) through the layer's
    `_gradient_checkpointing_func` when training with checkpointing on, with the cache arguments transformers' own
    `__call__` switches off under checkpointing (a recompute must not write the cache a second time)."""

    @functools.wraps(cls.forward)
    def checkpointed(self, *args, **kwargs):
        forward = cls.forward
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return forward(self, *args, **kwargs)
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            for name in ("past_key_values", "cache", "layer_past"):
                if kwargs.get(name) is not None:
                    kwargs[name] = None
        return self._gradient_checkpointing_func(functools.partial(forward, self, **kwargs), *args)

    return checkpointed


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
