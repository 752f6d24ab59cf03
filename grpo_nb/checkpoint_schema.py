"""What a checkpoint may hold, checked before any of it is used.

A checkpoint folder may be someone else's (a shared Drive folder, a downloaded run), and resuming
hands its contents to numpy's random generator (an out-of-range position crashes the process),
torch's scheduler (its state is written into the scheduler's __dict__), the optimizer, the
trackers (the run id names a folder) and the model. So every field that train() writes is
checked here against what grpo-nb itself writes - type, range, shape, finiteness, agreement
with the other fields and with this run - and the first that differs is refused by name.
Nothing here changes anything: the caller applies the state once all of it has passed.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import MISSING, fields

import numpy as np
import torch

from .tracking import RUN_ID

# The dtypes a stored numpy array may be read back as. The dtype is a string from the file, and
# numpy takes any type there, e.g. "<U999999999": gigabytes per element.
ARRAY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64")
STATE_KEYS = ("step", "history", "optimizer", "scheduler", "scaler", "rng", "sampler", "rollout", "pending")
# Optimizer moments that have their parameter's shape: torch's AdamW, and bitsandbytes' (state1/2).
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "state1", "state2")
# Per-parameter optimizer values that are never negative: second moments (means of squares), whose square
# root divides the update (a negative one makes it NaN), and bitsandbytes' scales and code map for them.
NONNEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "state2", "absmax1", "absmax2", "qmap2")
# The dtypes weights and moments are trained in. float8 and float4 are storage formats no optimizer step
# writes (and torch's isfinite does not take them).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The largest process id any system hands out is below 2**22 (Linux's pid_max); os.kill overflows past 2**31.
MAX_PID = 2**31 - 1
_ABSENT = object()


class CheckpointError(ValueError):
    """A checkpoint (or a lock file) that does not hold what grpo-nb writes: damaged, or someone else's."""


class Refused(Exception):
    """One field that failed its check. The caller names the folder and the file (CheckpointError)."""

    def __init__(self, field: str, expected: str, value=_ABSENT):
        super().__init__(f"{field} is {describe(value)}; expected {expected}")


def describe(value) -> str:
    """A short description of a value from a file (which may be huge)."""
    if value is _ABSENT:
        return "missing"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        text = f"a {value.dtype} {type(value).__name__} of shape {tuple(value.shape)}"
        bad = nonfinite(value) if isinstance(value, torch.Tensor) else 0
        return text + (f" with {bad} NaN or inf values" if bad else "")
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def need(ok: bool, field: str, expected: str, value=_ABSENT) -> None:
    if not ok:
        raise Refused(field, expected, value)


def is_int(value, low: int = 0, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value, low: float = 0.0) -> bool:
    """A finite real number >= low (an int or a float, not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= low)


def is_plain(value, depth: int = 64) -> bool:
    """JSON-like data (what a record holds): no tensors, arrays or bytes, and nested at most `depth` deep (what
    grpo-nb writes nests a few levels; comparing or printing data nested thousands deep overflows Python's stack)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth == 0:
        return False
    if isinstance(value, (list, tuple)):
        return all(is_plain(v, depth - 1) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and is_plain(v, depth - 1) for k, v in value.items())


def nonfinite(tensor: torch.Tensor, nan_ok: bool = False) -> int:
    """How many NaN or inf values (with nan_ok: inf) `tensor` holds; 0 for integers. Any floating dtype is
    counted, float8 read as float32; one torch cannot read (float4) counts as all of its values."""
    if not tensor.is_floating_point():
        return 0
    try:
        tensor = tensor if tensor.dtype in FLOAT_DTYPES else tensor.float()
        return int((torch.isinf(tensor) if nan_ok else ~torch.isfinite(tensor)).sum())
    except (NotImplementedError, RuntimeError, TypeError):
        return tensor.numel()


def finite(tensor: torch.Tensor, nan_ok: bool = False) -> bool:
    return nonfinite(tensor, nan_ok) == 0


def byte_state(value, field: str, accepts) -> None:
    """A random generator's state (a uint8 tensor) that `accepts(state)`, run on a throwaway generator, takes."""
    need(isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1, field,
         "a generator state (a 1-D uint8 tensor)", value)
    try:
        accepts(value)
    except (RuntimeError, TypeError, ValueError) as err:
        raise Refused(field, f"a state torch's generator accepts ({err})", value) from None


# ----------------------------------------------------------------------------------------
# On its own: what trainer.snapshot and trainer.save_state write


def check_trainer_state(state) -> None:
    """Every field train() writes, on its own terms and against each other (step, history, schedule)."""
    need(isinstance(state, dict), "the state", "a JSON object", state)
    for key in STATE_KEYS:
        need(key in state, key, "present (train() writes it)")
    step = state["step"]
    need(is_int(step), "step", "the number of steps trained: an integer >= 0", step)
    # run_id: absent in checkpoints written before runs had ids (the resumed run gets a new one);
    # parent_run_id: the run a resumed fork started from, None for a run started fresh.
    for key in ("run_id", "parent_run_id"):
        run_id = state.get(key)
        need(run_id is None or (isinstance(run_id, str) and RUN_ID.fullmatch(run_id) is not None), key,
             "a run id as grpo-nb makes them, e.g. '20250101-120000-a1b2c3' (it names the tracker's folder)", run_id)
    check_history(state["history"], step)
    check_optimizer(state["optimizer"])
    check_scheduler(state["scheduler"], step)
    check_scaler(state["scaler"])
    check_rng(state["rng"])
    check_sampler(state["sampler"])
    rollout, pending = state["rollout"], state["pending"]
    need(rollout is None or isinstance(rollout, dict), "rollout", "None or the rollout's state (a JSON object)",
         rollout)
    need(pending is None or (isinstance(pending, tuple) and len(pending) == 2), "pending",
         "None or (a generation batch, the optimizer steps left on it)", pending)
    if pending is not None:
        need(is_int(pending[1], 1), "pending[1]", "the optimizer steps still to take on the batch: an integer >= 1",
             pending[1])
    if "identity" in state:  # absent in checkpoints written before runs recorded it
        check_identity(state["identity"])


def check_identity(identity) -> None:
    """What the run trained on (resume.run_identity): its base model and its data. Its names and digests are
    compared with this run's and shown in messages: short strings, numbers."""
    need(isinstance(identity, dict) and isinstance(identity.get("base"), dict)
         and isinstance(identity.get("dataset"), dict), "identity",
         "{'base': {...}, 'dataset': {...}} (what the run trained on)", identity)
    agent = identity.get("agent")  # a run with tools / environments (resume.run_identity)
    need(agent is None or (isinstance(agent, dict) and all(
        isinstance(agent.get(k), list) and len(agent[k]) <= 4096
        and all(isinstance(v, str) and len(v) <= 4096 for v in agent[k]) for k in ("tools", "environments"))),
        "identity.agent", "None or {'tools': [names], 'environments': [class names]}", agent)
    base, data = identity["base"], identity["dataset"]
    for key in ("model_type", "name_or_path"):
        value = base.get(key)
        need(value is None or (isinstance(value, str) and len(value) <= 4096), f"identity.base.{key}",
             "None or a name (a string)", value)
    fingerprint = base.get("fingerprint")
    need(fingerprint is None or (isinstance(fingerprint, list) and len(fingerprint) <= 16 and all(
        isinstance(values, list) and len(values) <= 4096 and all(v is None or is_number(v, -math.inf) for v in values)
        for values in fingerprint)), "identity.base.fingerprint", "None or lists of sampled weights (numbers)",
        fingerprint)
    layers = base.get("layers")  # absent in older checkpoints: only the embedding and norm are compared
    need(layers is None or (isinstance(layers, dict) and len(layers) <= 2048 and all(
        isinstance(name, str) and len(name) <= 4096 and isinstance(values, list) and len(values) <= 4096
        and all(v is None or is_number(v, -math.inf) for v in values) for name, values in layers.items())),
        "identity.base.layers", "None or {weight name: its sampled values (numbers)}", layers)
    need(is_int(data.get("rows")), "identity.dataset.rows", "the dataset's number of rows", data.get("rows", _ABSENT))
    for key in ("rows_digest", "prompts_digest"):
        value = data.get(key)
        need(value is None or (isinstance(value, str) and len(value) <= 64), f"identity.dataset.{key}",
             "None or a hex digest", value)


def check_history(history, step: int) -> None:
    """One plain record per step, in order, none after the checkpoint's step."""
    need(isinstance(history, list), "history", "a list of step records", history)
    last = 0
    for i, record in enumerate(history):
        field = f"history[{i}]"
        need(isinstance(record, dict) and is_plain(record), field, "a step record (plain JSON data)", record)
        need(is_int(record.get("step", _ABSENT), last + 1, step), f"{field}.step",
             f"an integer from {last + 1} to the checkpoint's step {step} (records are in step order)",
             record.get("step", _ABSENT))
        # what the loop reads back from earlier records (the streaks of skipped and unscored steps)
        need(isinstance(record.get("skipped_nonfinite"), bool), f"{field}.skipped_nonfinite", "True or False",
             record.get("skipped_nonfinite", _ABSENT))
        reward = record.get("reward", _ABSENT)
        need(is_number(reward, -math.inf) or (isinstance(reward, float) and math.isnan(reward)), f"{field}.reward",
             "a number (NaN: nothing was scored)", reward)
        # use_adaptive_entropy's state, read back by step.entropy_control (TRL's coefficient >= 0; an entropy >= 0)
        if "entropy_coef" in record:
            need(is_number(record["entropy_coef"]), f"{field}.entropy_coef", "a finite number >= 0",
                 record["entropy_coef"])
        if "entropy_window" in record:  # NaN: a step whose entropies were not finite
            window = record["entropy_window"]
            need(is_number(window) or (isinstance(window, float) and math.isnan(window)), f"{field}.entropy_window",
                 "a number >= 0 (NaN: the step's entropy was not finite)", window)
        for key in ("eval", "eval_start"):  # held-out evaluations (train(eval_dataset=...)), which the views draw
            if key in record:
                check_evaluation(record[key], f"{field}.{key}")
        last = record["step"]


SHARES = ("accuracy", "lenient_accuracy", "format_rate", "truncation_rate", "tool_call_rate")


def check_evaluation(evaluation, field: str) -> None:
    """A step's held-out evaluation (evaluation.eval_record): rates in [0, 1] (an accuracy None without answers),
    their intervals [low, high] within [0, 1], counts and times >= 0, each reward function's mean a number (NaN:
    it scored none)."""
    need(isinstance(evaluation, dict), field, "a held-out evaluation (a JSON object of its numbers)", evaluation)
    need(is_int(evaluation.get("n", _ABSENT), 1), f"{field}.n", "the number of rows evaluated (an integer >= 1)",
         evaluation.get("n", _ABSENT))
    for key in SHARES:
        if evaluation.get(key) is not None:
            need(is_number(evaluation[key]) and evaluation[key] <= 1, f"{field}.{key}", "a share from 0 to 1, or None",
                 evaluation[key])
    for key in ("mean_length", "tool_calls", "seconds"):
        if key in evaluation:
            need(is_number(evaluation[key]), f"{field}.{key}", "a number >= 0", evaluation[key])
    intervals = evaluation.get("intervals", {})
    need(isinstance(intervals, dict), f"{field}.intervals", "{rate: [low, high]}", intervals)
    for key, bounds in intervals.items():
        need(isinstance(bounds, (list, tuple)) and len(bounds) == 2 and all(is_number(b) and b <= 1 for b in bounds)
             and bounds[0] <= bounds[1], f"{field}.intervals.{key}", "[low, high], two shares from 0 to 1", bounds)
    rewards = evaluation.get("rewards", {})
    need(isinstance(rewards, dict), f"{field}.rewards", "{reward function: mean}", rewards)
    for name, mean in rewards.items():
        need(is_number(mean, -math.inf) or (isinstance(mean, float) and math.isnan(mean)), f"{field}.rewards.{name}",
             "a number (NaN: the function scored no completion)", mean)


def check_optimizer(state) -> None:
    """torch's optimizer state_dict: groups of parameter indices and hyperparameters, finite per-parameter state."""
    need(isinstance(state, dict) and isinstance(state.get("param_groups"), list)
         and isinstance(state.get("state"), dict), "optimizer",
         "an optimizer state ({'state': {...}, 'param_groups': [...]})", state)
    indices = []
    for g, group in enumerate(state["param_groups"]):
        field = f"optimizer.param_groups[{g}]"
        need(isinstance(group, dict), field, "a parameter group (a JSON object)", group)
        params = group.get("params", _ABSENT)
        need(isinstance(params, list) and all(is_int(i) for i in params), f"{field}.params",
             "a list of parameter indices (integers >= 0)", params)
        indices += params
        for key, value in group.items():
            check_hyperparameter(f"{field}.{key}", key, value)
    need(len(set(indices)) == len(indices), "optimizer.param_groups", "each parameter in one group, once",
         [g.get("params") for g in state["param_groups"]])
    for index, values in state["state"].items():
        field = f"optimizer.state[{index!r}]"
        need(is_int(index) and index in indices, field, "the state of a parameter in param_groups", values)
        need(isinstance(values, dict), field, "a parameter's state (a JSON object)", values)
        for name, value in parameter_state(values, field):
            check_parameter_state(name, value)
        step = values.get("step", 0)
        need(is_number(step) or (isinstance(step, torch.Tensor) and step.numel() == 1 and float(step) >= 0),
             f"{field}.step", "the optimizer's step count: one number >= 0", step)


def check_parameter_state(field: str, value) -> None:
    """One value of a parameter's optimizer state: finite; a moment floating-point (bitsandbytes' 8-bit states:
    uint8 codes); a second moment and the scales and code map of one never negative."""
    key = field.rsplit(".", 1)[1]
    need(isinstance(value, torch.Tensor) or is_number(value, -math.inf), field, "a tensor or a number", value)
    if key in MOMENTS:
        eight_bit = key in ("state1", "state2") and isinstance(value, torch.Tensor) and value.dtype == torch.uint8
        need(isinstance(value, torch.Tensor) and (value.dtype in FLOAT_DTYPES or eight_bit), field,
             "a floating-point tensor (float32, bfloat16, float16; bitsandbytes' 8-bit codes: uint8)", value)
    need(not isinstance(value, torch.Tensor) or finite(value), field, "finite numbers", value)
    if key in NONNEGATIVE:
        need(bool((value >= 0).all()) if isinstance(value, torch.Tensor) else value >= 0, field,
             "numbers >= 0 (a second moment is a mean of squares; its square root divides the update)", value)


def parameter_state(values: dict, field: str):
    """(field, value) of each entry of one parameter's optimizer state; bitsandbytes nests its 8-bit states
    one level down (__bnb_optimizer_quant_state__)."""
    for name, value in values.items():
        if isinstance(value, dict):
            for inner, v in value.items():
                yield f"{field}.{name}.{inner}", v
        else:
            yield f"{field}.{name}", value


def check_hyperparameter(field: str, key: str, value) -> None:
    """One entry of an optimizer parameter group: what AdamW (torch's or bitsandbytes') keeps there."""
    if key == "params":
        return
    if key in ("lr", "initial_lr", "weight_decay"):
        need(is_number(value), field, "a finite number >= 0", value)
    elif key == "eps":
        need(is_number(value) and value > 0, field, "a finite number > 0", value)
    elif key == "betas":
        need(isinstance(value, (tuple, list)) and value and all(is_number(b) and b < 1 for b in value), field,
             "numbers in [0, 1)", value)
    elif key in ("maximize", "differentiable"):  # grpo-nb's AdamW minimises the loss, without autograd through it
        need(value is False, field, "False", value)
    else:  # flags and settings: foreach, fused, amsgrad, optim_bits, ...
        need(value is None or isinstance(value, bool) or is_number(value, -math.inf), field,
             "None, True/False or a finite number", value)


def check_scheduler(state, step: int) -> None:
    """torch's LambdaLR state: its count agrees with the step, its learning rates are finite and >= 0."""
    need(isinstance(state, dict), "scheduler", "the learning-rate schedule's state (a JSON object)", state)
    need(state.get("last_epoch", _ABSENT) == step and is_int(state.get("last_epoch")), "scheduler.last_epoch",
         f"the checkpoint's step {step} (the schedule moves once per step)", state.get("last_epoch", _ABSENT))
    for key in ("base_lrs", "_last_lr"):
        lrs = state.get(key, _ABSENT)
        need(isinstance(lrs, list) and lrs and all(is_number(lr) for lr in lrs), f"scheduler.{key}",
             "a list of learning rates (finite numbers >= 0)", lrs)
    lambdas = state.get("lr_lambdas", _ABSENT)
    # LambdaLR copies a dict here into its schedule function's __dict__; grpo-nb's is a plain function: None.
    need(isinstance(lambdas, list) and all(x is None for x in lambdas), "scheduler.lr_lambdas",
         "a list of None (the schedule is a function, which is not stored)", lambdas)


def check_scaler(state) -> None:
    """None (no fp16 loss scaling) or torch's GradScaler state."""
    if state is None:
        return
    need(isinstance(state, dict), "scaler", "None or a GradScaler state (a JSON object)", state)
    for key in ("scale", "growth_factor", "backoff_factor"):
        value = state.get(key, _ABSENT)
        need(is_number(value) and value > 0, f"scaler.{key}", "a finite number > 0", value)
    need(is_int(state.get("growth_interval"), 1), "scaler.growth_interval", "an integer >= 1",
         state.get("growth_interval", _ABSENT))
    need(is_int(state.get("_growth_tracker")), "scaler._growth_tracker", "an integer >= 0",
         state.get("_growth_tracker", _ABSENT))


def check_rng(state) -> None:
    """python's, numpy's and torch's random states (and CUDA's), each one its own generator accepts."""
    need(isinstance(state, dict), "rng", "the random states (a JSON object)", state)
    for key in ("python", "numpy", "torch"):
        need(key in state, f"rng.{key}", "present")
    python = state["python"]
    need(isinstance(python, tuple) and len(python) == 3 and (python[2] is None or is_number(python[2], -math.inf)),
         "rng.python", "python's random.getstate(): (version, state, None or a number)", python)
    try:
        random.Random().setstate(python)
    except (TypeError, ValueError, OverflowError) as err:
        raise Refused("rng.python", f"a state python's random accepts ({err})", python) from None
    numpy = state["numpy"]
    # numpy takes any position, and reads out of bounds from it (a segfault): checked here.
    need(isinstance(numpy, tuple) and len(numpy) == 5 and numpy[0] == "MT19937"
         and isinstance(numpy[1], np.ndarray) and numpy[1].dtype == np.uint32 and numpy[1].shape == (624,)
         and is_int(numpy[2], 0, 624) and numpy[3] in (0, 1) and is_number(numpy[4], -math.inf), "rng.numpy",
         "numpy's random.get_state(): ('MT19937', 624 uint32 keys, a position 0..624, 0 or 1, a number)", numpy)
    byte_state(state["torch"], "rng.torch", torch.Generator().set_state)
    if "cuda" in state:
        cuda = state["cuda"]
        need(isinstance(cuda, list), "rng.cuda", "a list of CUDA generator states, one per GPU", cuda)
        for i, value in enumerate(cuda):
            # Set only where CUDA is (checkpointing.set_rng_state); then each GPU's own generator judges it.
            here = torch.cuda.is_available() and i < torch.cuda.device_count()
            byte_state(value, f"rng.cuda[{i}]",
                       torch.Generator(device=f"cuda:{i}").set_state if here else lambda state: None)


def check_sampler(state) -> None:
    """data.PromptSampler's state: its generator and the epoch's remaining dataset rows."""
    need(isinstance(state, dict), "sampler", "the prompt sampler's state (a JSON object)", state)
    byte_state(state.get("generator", _ABSENT), "sampler.generator", torch.Generator().set_state)
    order = state.get("order", _ABSENT)
    need(isinstance(order, list) and all(is_int(i) for i in order) and len(set(order)) == len(order),
         "sampler.order", "the epoch's remaining dataset rows: distinct integers >= 0", order)
    if "world_size" in state:  # absent in checkpoints written before it was kept
        need(is_int(state["world_size"], 1), "sampler.world_size", "the number of processes that trained the run: an "
             "integer >= 1", state["world_size"])


# ----------------------------------------------------------------------------------------
# Against this run: its optimizer, schedule, rollout, model and the pending batch's dataclass


def check_fits_run(state: dict, *, optimizer, scheduler, rollout, batch_type, vocab_size: int | None,
                   native_rollout: bool = False, model=None) -> None:
    """What `check_trainer_state` passed, against the objects this run will load it into (`rollout`: the run's
    engine when it keeps a random state, a grpo_nb.rollout.ResumableRollout, else None; `native_rollout`: it is
    grpo-nb's RolloutEngine, whose state's values are checked too; `model`: names the parameters in warnings)."""
    check_optimizer_fits(state["optimizer"], optimizer, stepped=state["step"] > 0, model=model)
    groups = len(optimizer.param_groups)
    own = scheduler.state_dict()
    for key, value in state["scheduler"].items():
        # LambdaLR.load_state_dict writes every key into the scheduler's __dict__: only its own keys may pass.
        need(key in own, f"scheduler.{key}", f"no such key (torch's {type(scheduler).__name__} has "
                                             f"{', '.join(own)})", value)
        if isinstance(own[key], list):
            need(isinstance(value, list) and len(value) == groups, f"scheduler.{key}",
                 f"a list of {groups} (one per parameter group)", value)
        elif isinstance(own[key], (bool, int, float)):
            need(type(value) is type(own[key]), f"scheduler.{key}", f"a {type(own[key]).__name__}", value)
    if state["rollout"] is not None and rollout is not None:
        check_rollout_fits(state["rollout"], rollout, native_rollout)
    if state["pending"] is not None:
        check_batch(state["pending"][0], batch_type, vocab_size)


def check_optimizer_fits(state: dict, optimizer, *, stepped: bool = False, model=None) -> None:
    """torch maps the saved groups onto this optimizer's in order: the same groups, sizes and moment shapes.
    `stepped`: the run had trained steps, so its parameters had gradients and the optimizer state for them."""
    saved, groups = state["param_groups"], optimizer.param_groups
    need(len(saved) == len(groups), "optimizer.param_groups", f"{len(groups)} group(s), as this run's optimizer has",
         [g["params"] for g in saved])
    param_of = {}
    for g, (old, new) in enumerate(zip(saved, groups)):
        need(len(old["params"]) == len(new["params"]), f"optimizer.param_groups[{g}].params",
             f"{len(new['params'])} parameters, as this run trains", old["params"])
        param_of.update(zip(old["params"], new["params"]))
    for index, values in state["state"].items():
        param = param_of[index]
        for field, value in parameter_state(values, f"optimizer.state[{index!r}]"):
            if field.rsplit(".", 1)[1] in MOMENTS:
                need(isinstance(value, torch.Tensor) and value.shape == param.shape, field,
                     f"a tensor of its parameter's shape {tuple(param.shape)}", value)
    stateless = [i for i in param_of if i not in state["state"]]
    if stateless and (state["state"] or stepped):  # none before a first update; else none for a parameter is odd
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        listed = ", ".join(f"{names.get(id(param_of[i]), f'index {i}')} {tuple(param_of[i].shape)}"
                           for i in stateless[:5])
        warnings.warn(f"The checkpoint's optimizer state has no entry for {len(stateless)} of the {len(param_of)} "
                      f"trained parameters ({listed}{', ...' if len(stateless) > 5 else ''}): their optimizer moments "
                      "restart from zero, so their next updates are a first step's. That is right only for parameters "
                      "that never had a gradient (or a run whose every update was skipped); otherwise the file was "
                      "edited or cut - resume from an earlier checkpoint to keep them.", stacklevel=2)


def check_rollout_fits(state: dict, rollout, native: bool) -> None:
    """The rollout's own state_dict keys; grpo-nb's engine's (`native`) seed, generator and its device. A user's
    rollout's values are its own (its load_state_dict reads them): its "seed" or "generator" may be anything."""
    own = rollout.state_dict()
    need(set(state) == set(own), "rollout", f"this run's rollout state, with the keys {sorted(own)}", state)
    if not native:
        return
    need(state.get("seed") is None or is_int(state.get("seed")), "rollout.seed", "None or an integer >= 0",
         state.get("seed"))
    device, generator = state.get("device"), state.get("generator")
    if generator is None:
        return
    try:
        made = torch.Generator(device=device)
    except (RuntimeError, TypeError):
        raise Refused("rollout.device", "a device this machine has, e.g. 'cpu' or 'cuda:0' (a run sampled on a GPU "
                      "resumes on a GPU)", device) from None
    byte_state(generator, "rollout.generator", made.set_state)


def check_batch(batch, batch_type, vocab_size: int | None) -> None:
    """A generation batch still being trained on, field by field as `batch_type` (step.StepBatch) declares them:
    the annotation gives each field's kind; rows are completions, in whole groups; token ids index the vocabulary."""
    name = batch_type.__name__
    need(isinstance(batch, dict), "pending[0]", f"a {name} (a JSON object of its fields)", batch)
    declared = {f.name: f for f in fields(batch_type)}
    for key in batch:
        need(key in declared, f"pending[0].{key}", f"one of {name}'s fields ({', '.join(declared)})", batch[key])
    for f in declared.values():
        need(f.name in batch or f.default is not MISSING or f.default_factory is not MISSING,
             f"pending[0].{f.name}", "present (it has no default)")
    ids = batch.get("completion_ids")
    need(isinstance(ids, torch.Tensor) and ids.dim() == 2, "pending[0].completion_ids",
         "a 2-D tensor [completions, tokens]", ids)
    rows, width = ids.shape
    prompt = batch.get("prompt_ids")
    need(isinstance(prompt, torch.Tensor) and prompt.dim() == 2, "pending[0].prompt_ids",
         "a 2-D tensor [completions, tokens]", prompt)
    for key, value in batch.items():
        field = f"pending[0].{key}"
        kinds = [k.strip() for k in str(declared[key].type).split("|")]
        need(any(is_kind(value, kind) for kind in kinds), field, " or ".join(kinds), value)
        if isinstance(value, torch.Tensor):
            check_batch_tensor(field, key, value, rows, prompt.shape[1] if key.startswith("prompt_") else width,
                               vocab_size)
        elif isinstance(value, list):
            need(len(value) == rows, field, f"a list of {rows} (one per completion)", value)
    generations = batch.get("num_generations")
    need(is_int(generations, 1) and rows % generations == 0, "pending[0].num_generations",
         f"an integer >= 1 dividing the {rows} completions (whole groups)", generations)
    check_batch_entries(batch)


def check_batch_entries(batch: dict) -> None:
    """The entries of the fields the step's record reads (records.make_record)."""
    need(all(isinstance(t, str) for t in batch.get("texts", [])), "pending[0].texts", "the completions' texts",
         batch.get("texts"))
    for i, row in enumerate(batch.get("rows", [])):
        need(isinstance(row, dict) and is_prompt(row.get("prompt")), f"pending[0].rows[{i}]",
             "a dataset row with a 'prompt' (a string or a list of chat messages)", row)
    for i, extra in enumerate(batch.get("extras", [])):
        need(isinstance(extra, dict), f"pending[0].extras[{i}]", "the columns log_extra gave (a JSON object)", extra)
    for name, values in batch.get("logged_metrics", {}).items():
        need(isinstance(values, list) and all(is_number(v, -math.inf) for v in values),
             f"pending[0].logged_metrics[{name!r}]", "the numbers log_metric was given (a list)", values)


def is_kind(value, kind: str) -> bool:
    """`value` is of the kind a dataclass annotation names ("torch.Tensor", "int", "float", "list", "None", ...)."""
    if kind == "torch.Tensor":
        return isinstance(value, torch.Tensor)
    if kind == "int":
        return is_int(value)
    if kind == "float":  # times and counts: finite, >= 0
        return is_number(value)
    if kind == "None":
        return value is None
    if kind.split("[")[0] == "dict":
        return isinstance(value, dict) and is_plain(value)
    return type(value).__name__ == kind.split("[")[0]  # list, str, bool (list[str]: a list)


def check_batch_tensor(field: str, key: str, value: torch.Tensor, rows: int, width: int, vocab_size) -> None:
    """By the field's name: *_ids are tokens, *_mask 0/1, prompt_*/completion_*/*_mask/*_logprobs one column per
    token; everything has a row per completion and finite values (rewards, rewards_per_func: NaN is 'no score')."""
    per_token = key.startswith(("prompt_", "completion_")) or key.endswith(("_mask", "_logprobs"))
    shape = f"[{rows}, {width}]" if per_token else f"[{rows}] or [{rows}, k]"
    need(value.dim() in (1, 2) and value.shape[0] == rows and (not per_token or tuple(value.shape) == (rows, width)),
         field, f"a tensor of shape {shape}", value)
    if key.endswith("_ids"):
        high = vocab_size - 1 if vocab_size else math.inf
        need(not value.is_floating_point() and value.dtype != torch.bool
             and (value.numel() == 0 or (int(value.min()) >= 0 and int(value.max()) <= high)), field,
             f"token ids from 0 to {high} (this model's vocabulary)", value)
    if key.endswith("_mask"):
        need(bool(((value == 0) | (value == 1)).all()), field, "0s and 1s", value)
    need(finite(value, nan_ok=key in ("rewards", "rewards_per_func")), field, "finite numbers", value)


def pending_misfit(pending: tuple, config, reward_funcs: int) -> str | None:
    """Why a generation batch still being trained on (checked by check_batch) does not fit this run's settings,
    or None when it does. It was made under the checkpoint's: its groups' size, one reward column per function,
    and the log-probs that run's loss needed; under other settings the loss would fail, or mean something else."""
    batch, left = pending
    if batch["num_generations"] != config.num_generations:
        return (f"its groups have {batch['num_generations']} completions each; num_generations is now "
                f"{config.num_generations}")
    scores = batch.get("rewards_per_func")
    if scores is not None and (scores.dim() != 2 or scores.shape[1] != reward_funcs):
        return (f"it holds the scores of {scores.shape[1] if scores.dim() == 2 else 1} reward function(s); this run "
                f"has {reward_funcs}")
    needs = {"old_logprobs": ("the sampling policy's log-probs", "num_iterations > 1", config.num_iterations > 1),
             "ref_logprobs": ("the reference policy's log-probs", "beta > 0", config.beta > 0),
             "sampling_logprobs": ("the rollout engine's log-probs", "rollout_importance_sampling_correction=True",
                                   config.rollout_importance_sampling_correction)}
    for key, (what, setting, needed) in needs.items():
        if needed and batch.get(key) is None:
            return f"it was made without {what} ({key}), which {setting} needs"
        if not needed and batch.get(key) is not None:
            return f"it was made with {what} ({key}) for {setting}, which is no longer set"
    if left >= config.num_iterations:
        return f"it has {left} more optimizer step(s) to go; num_iterations is now {config.num_iterations}"
    return None


def is_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt))


# ----------------------------------------------------------------------------------------
# Weights and the lock file


def check_weights(tensors: dict, params: dict) -> None:
    """trainable.safetensors: floating-point and finite (a run never writes NaN weights: a step whose update is not
    finite is skipped), so that a resumed run cannot overwrite the good final adapter with NaNs."""
    for name, tensor in tensors.items():
        need(tensor.dtype in FLOAT_DTYPES, name, f"a {params[name].dtype} tensor like the model's (weights are "
             f"trained and saved in {', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)})", tensor)
        need(finite(tensor), name, "finite weights", tensor)


def check_lock(owner) -> None:
    """output_dir's lock file: {"pid": the holder's process id, "host": its machine, "started": when}."""
    need(isinstance(owner, dict), "the lock", '{"pid": ..., "host": ..., "started": ...}', owner)
    need(is_int(owner.get("pid"), 1, MAX_PID), "pid", "a process id (an integer >= 1)", owner.get("pid", _ABSENT))
    need(isinstance(owner.get("host"), str), "host", "a machine's name (a string)", owner.get("host", _ABSENT))
    need(isinstance(owner.get("started"), str), "started", "a time (a string)", owner.get("started", _ABSENT))
