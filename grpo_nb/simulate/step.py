"""One GRPO step of grpo-nb, run on a model built on the meta device, every allocation counted.

`simulate_step()` builds the architecture from its config on the meta device (no weights),
applies what `setup_reasoning_model` applies (`models.prepare_for_training`: LoRA through
peft, plain or offloaded gradient checkpointing; NF4 weights as bitsandbytes stores them),
and runs the stages `train()` runs, with the functions `train()` uses: the rollout
(`RolloutEngine`, its KV cache at full length), the reference / old-policy log-probs when
the settings need them, the policy update (`step.accumulate_gradients`) and the optimizer
step (`step.apply_update`). `run_step()` is that sequence on any model: the honesty test
runs it on a real CPU model and compares. What TRL's step shares with it is in `build.py`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from types import SimpleNamespace

import torch

from .. import lora, models, parking
from ..arguments import need_bool, need_number, refuse
from ..attachments import attachments, base_model
from ..config import GRPOConfig
from ..hardware import DTYPE_NAMES
from ..memory import (check_episode, check_planned_context, check_planner_arguments, optimizer_bytes,
                      planner_config)
from ..memory.estimate import turn_budget
from ..rollout import RolloutEngine
from ..optim import build_optimizer
from ..step import accumulate_gradients, apply_update, policy_logprobs
from .build import SimulatedStep, forced_batch, meta_model, simulated_result, warm_optimizer
from . import ops
from .device import SimulatedDevice, attention_scratch
from .episodes import EpisodeRollout
from .ops import OpRecorder
from .tracker import AllocationTracker
from .trl_step import simulate_trl_step

EPISODE_DECODE_SAMPLES = 16  # decode steps recorded per turn of an episode (time()), the rest priced like them



# --------------------------------------------------------------------------------------
# The step


def run_step(model, batch, config, tracker: AllocationTracker, *, rollout=None, tokenizer=None,
             foreach: bool | None = None) -> dict:
    """grpo-nb's step on `model` and a ready `batch`, phase by phase under `tracker`.

    `rollout` (a `RolloutEngine`) generates `config.num_generations` completions for each of the
    batch's prompts first (their memory is the rollout phase; the update then trains on `batch`).
    `foreach`: AdamW's implementation (CUDA tensors get the multi-tensor one, the meta device
    the loop). Returns what the categories need: gradient and optimizer bytes.
    """
    optimizer, _, params = build_optimizer(model, config)
    if foreach is not None:
        for group in optimizer.param_groups:
            group["foreach"] = foreach
    if parking.of(optimizer) is not None:  # config.park_optimizer_state: parked as train() parks it, counted
        parking.attach(optimizer, CountedParking(optimizer, params[0].device, tracker))
    with tracker.phase("optimizer state"):
        warm_optimizer(optimizer, params)
        parking.park(optimizer)  # where the previous step's apply_update left it
    g = config.num_generations
    if rollout is not None:
        with tracker.phase("rollout"):
            rollout(model, tokenizer, batch.prompt_ids[::g], batch.prompt_mask[::g], g)
    if config.beta > 0:
        with tracker.phase("reference log-probs"), model.disable_adapter():
            batch.ref_logprobs = policy_logprobs(model, batch, config)
    if config.num_iterations > 1 and rollout is None:  # the engine returns the sampling log-probs itself
        with tracker.phase("old log-probs"):
            batch.old_logprobs = policy_logprobs(model, batch, config)
    with tracker.phase("policy update"):
        metrics = accumulate_gradients(model, params, batch, config)
    with tracker.phase("optimizer step"):
        apply_update(optimizer, params, metrics, config)
    return {"gradients": metrics.gradient_bytes, "optimizer": optimizer_bytes(optimizer),
            "optimizer_parked": parking.of(optimizer) is not None and parking.of(optimizer).parked}


class CountedParking(parking.OptimizerParking):
    """The optimizer's state parked between steps (grpo_nb.parking) beside the parameters' own device (the meta
    device, or the CPU checked against it): its host copies counted as host memory, as on CUDA, and each copy recorded
    as a transfer over the host link (priced in the optimizer's stage)."""

    def __init__(self, optimizer, device, tracker: AllocationTracker):
        super().__init__(optimizer, device, host=device)
        self.tracker = tracker

    def _host_tensor(self, like):
        with self.tracker.host():
            return super()._host_tensor(like)

    def _copy(self, dst, src, direction):
        ops.transfer(src.numel() * src.element_size(), direction)
        super()._copy(dst, src, direction)


# --------------------------------------------------------------------------------------
# The public entry point


def _exact_adapters(grpo_config, device: str) -> bool:
    """Whether the simulated rollout keeps the training forward's exact LoRA arithmetic, as make_rollout decides:
    num_iterations > 1 without the rollout correction. On the CPU a correction left at None may come on with the
    bf16 copies cpu_rollout_dtype="auto" picks (decided by train() on the real model): the simulation then makes
    the copies - in fp32 unless bf16 was asked for, the larger of the two."""
    correction = grpo_config.rollout_importance_sampling_correction
    if device == "cpu" and correction is None:
        return False
    return grpo_config.num_iterations > 1 and not correction


def simulate_step(
    model_or_config,
    *,
    max_prompt_length: int = 256,
    max_completion_length: int = 256,
    num_generations: int = 8,
    prompts_per_step: int = 1,
    per_device_train_batch_size: int | None = None,
    load_in_4bit: bool = False,
    lora_rank: int | None = 16,
    target_modules="all-linear",
    dtype: str | None = None,
    gradient_checkpointing: bool | str = "offload",
    logprob_backend: str = "auto",
    logprob_chunk_size: int | None = None,
    system: str = "grpo_nb",
    device: str = "cuda",
    beta: float = 0.0,
    num_iterations: int = 1,
    loss_type: str = "dapo",
    rollout: bool = True,
    rollout_max_rows: int | None = None,
    gpu=None,
    tool_turns: int = 1,
    tool_result_tokens: int = 0,
    prefix_sharing: bool = True,
    park_optimizer_state: bool | str = "auto",
    entropy_coef: float = 0.0,
    record_kernels: bool = False,
) -> SimulatedStep:
    """Run one GRPO step of `system` at full size on the meta device and count every allocation.

    Takes the arguments of `estimate_vram` (and returns the same categories), plus the GRPO
    settings that change what a step computes (`beta`, `num_iterations`, `loss_type`, `entropy_coef`: the entropy
    bonus, whose entropies carry their gradient) and
    whether to include the rollout (`rollout_max_rows`: completions decoded at once, as
    `GRPOConfig.rollout_max_rows`; TRL has no such setting). `system="trl"` runs TRL's own code path for the same batch
    (`grpo_nb.simulate.trl_step`). `device="cuda"` simulates a GPU (its attention kernels,
    bitsandbytes' CUDA path, offloading to pinned host memory, the Triton log-prob kernels);
    `device="cpu"` the CPU (used to check the simulation against a real run). `gpu`: the card
    whose kernels run (its compute capability picks the attention kernels, `grpo_nb.attention`):
    a name of `grpo_nb.gpus.CARDS`, a `Card`, or a (major, minor) capability; None: a card of
    compute capability 8.0 or newer (FlashAttention). `dtype` None: what the card trains in (bf16
    from 8.0; before it fp16 under LoRA, fp32 for full fine-tuning, as `setup_reasoning_model`). Nothing is computed and no weights are
    loaded: Qwen2.5-1.5B at 8 x 1280 tokens takes seconds.

    `tool_turns` > 1: each completion an episode of that many model turns with a tool result of `tool_result_tokens`
    tokens between turns, all within `max_completion_length` (`train(tools=...)`, `grpo_nb.simulate.episodes`): the
    rollout grows a dynamic KV cache turn by turn, every token decoded (slower to simulate: a model call per token).

    `record_kernels`: record the step's kernels now, so that `.time(card)` prices them without simulating the step
    again: grpo-nb's step counted and recorded in one pass (~1.5x a counting pass, against ~2.5x for the two; what
    `plan_for_gpu(simulate=True)` runs), TRL's in its two.

    `park_optimizer_state`: `GRPOConfig`'s (grpo-nb only): "auto" parks the optimizer's state in host memory between
    optimizer steps on CUDA (grpo_nb.parking), so the rollout and the policy update run without it:
    `settings["park_optimizer_state"]` says whether, and `phases` show it on the device in the optimizer step only.
    """

    capability = _capability(gpu, device)
    if dtype is None:  # what the card trains in (setup_reasoning_model's dtype="auto"): no bf16 before 8.0
        dtype = "bf16" if capability is None or capability >= (8, 0) else "fp16" if lora_rank is not None else "fp32"
    check_planner_arguments("simulate_step", max_prompt_length=max_prompt_length,
                            max_completion_length=max_completion_length, num_generations=num_generations,
                            prompts_per_step=prompts_per_step, per_device_train_batch_size=per_device_train_batch_size,
                            load_in_4bit=load_in_4bit, lora_rank=lora_rank, target_modules=target_modules, dtype=dtype,
                            gradient_checkpointing=gradient_checkpointing, logprob_backend=logprob_backend,
                            logprob_chunk_size=logprob_chunk_size, system=system, device=device, beta=beta,
                            num_iterations=num_iterations, loss_type=loss_type, rollout=rollout,
                            rollout_max_rows=rollout_max_rows, park_optimizer_state=park_optimizer_state)
    if beta > 0 and lora_rank is None and system == "grpo_nb":  # as train() refuses it
        refuse("simulate_step", "beta", beta, "0 with lora_rank=None: grpo-nb's reference policy is the model with its "
               "LoRA adapter switched off, and full fine-tuning has none (set lora_rank, or beta=0)")
    if rollout_max_rows is not None and system == "trl":  # not silently dropped: the widths compared would differ
        refuse("simulate_step", "rollout_max_rows", rollout_max_rows, "None with system='trl': TRL has no such "
               "setting (its rollout decodes all the step's completions at once, and that is what system='trl' "
               "simulates); leave rollout_max_rows out for TRL, or simulate grpo-nb's step (system='grpo_nb') for a "
               "narrower rollout")
    check_episode("simulate_step", tool_turns, tool_result_tokens, max_completion_length, system, rollout)
    need_bool("simulate_step", "record_kernels", record_kernels)
    need_bool("simulate_step", "prefix_sharing", prefix_sharing)  # (grpo-nb's update; TRL forwards every row)
    entropy_coef = need_number("simulate_step", "entropy_coef", entropy_coef, low=0)
    if entropy_coef and system == "trl":  # not silently dropped
        refuse("simulate_step", "entropy_coef", entropy_coef, "0 with system='trl': the simulation of TRL's step "
               "runs its loss without the entropy bonus")
    n = prompts_per_step * num_generations
    micro = min(per_device_train_batch_size or n, n)
    if n % micro:
        refuse("simulate_step", "per_device_train_batch_size", per_device_train_batch_size,
               f"a divisor of the {n} completions per step (prompts_per_step x num_generations), or None for all")
    config = planner_config("simulate_step", model_or_config)
    check_planned_context("simulate_step", config, max_prompt_length, max_completion_length)
    torch_dtype = DTYPE_NAMES[dtype]
    checkpointing = gradient_checkpointing
    if checkpointing == "offload" and device == "cpu":
        checkpointing = True  # on the CPU offloading is bookkeeping only (setup resolves "auto" to True there)
    backend = _resolve_backend(logprob_backend, device, torch_dtype)
    settings = dict(max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                    num_generations=num_generations, prompts_per_step=prompts_per_step,
                    per_device_train_batch_size=micro, load_in_4bit=load_in_4bit, lora_rank=lora_rank, dtype=dtype,
                    gradient_checkpointing=checkpointing, logprob_backend=backend, device=device, beta=beta,
                    num_iterations=num_iterations, loss_type=loss_type, rollout=rollout,
                    # a plain int: numpy's integers passed the check, and the engine inside takes no other kind
                    rollout_max_rows=int(rollout_max_rows) if rollout_max_rows is not None and system == "grpo_nb"
                    else None, capability=capability, tool_turns=int(tool_turns),
                    tool_result_tokens=int(tool_result_tokens),
                    park_optimizer_state=system == "grpo_nb" and parking.parks(park_optimizer_state, device),
                    prefix_sharing=prefix_sharing and system == "grpo_nb", entropy_coef=entropy_coef)
    if system == "trl":
        result = simulate_trl_step(config, torch_dtype, settings)
        if record_kernels:
            result._trace = result.record_ops()
        return result

    grpo_config = GRPOConfig(num_generations=num_generations, per_device_train_batch_size=micro,
                             park_optimizer_state=settings["park_optimizer_state"],
                             gradient_accumulation_steps=n // micro, max_completion_length=max_completion_length,
                             max_prompt_length=max_prompt_length, beta=beta, num_iterations=num_iterations,
                             loss_type=loss_type, logprob_backend=backend, logprob_chunk_size=logprob_chunk_size,
                             max_steps=1, prefix_sharing=prefix_sharing, entropy_coef=entropy_coef)
    result = _simulate(config, torch_dtype, settings, grpo_config, target_modules, "both" if record_kernels else False)
    # a partial, not a closure: a SimulatedStep pickles (users cache minutes-long simulations)
    result.record_ops = functools.partial(_simulate, config, torch_dtype, settings, grpo_config, target_modules, True)
    return result


def _simulate(config, torch_dtype, settings, grpo_config, target_modules, recorder_wanted):
    """The step of `simulate_step`: counted (a SimulatedStep), with every kernel recorded (an OpTrace), or
    (`recorder_wanted="both"`) both in one pass - the SimulatedStep holding the trace. A recorded rollout decodes
    one step more on CUDA (its decode step whole): the same peak; the rollout may then show a few KB more of sampling
    live at its own peak (the kv_cache category)."""
    s = settings
    device, checkpointing, n = s["device"], s["gradient_checkpointing"], s["prompts_per_step"] * s["num_generations"]
    started = time.perf_counter()
    tracker = AllocationTracker("meta", label_bytes=2**20 if device == "cuda" else 0)
    # On CUDA a rollout into a static KV cache has the same shapes at every token: a few show its peak
    # (memory), and its decode step (time: two, the first of which is a whole step).
    # (An episode's dynamic cache grows with every token: all of them decoded.)
    short = device == "cuda" and s["tool_turns"] == 1
    oracle = SimulatedDevice(device, end_sampling_after=(3 if recorder_wanted else 2) if short else None,
                             capability=s["capability"] or (8, 0))
    # an episode decodes every token of a growing cache: every so many of each turn's steps recorded stand for it
    every = 1 if s["tool_turns"] == 1 else max(
        1, turn_budget(s["max_completion_length"], s["tool_turns"], s["tool_result_tokens"]) // EPISODE_DECODE_SAMPLES)
    recorder = OpRecorder(tracker.phase_name, oracle, every) if recorder_wanted else contextlib.nullcontext()
    notes = []
    # the CPU's rollout multiplies by merged copies of the adapted weights (grpo_nb.lora): so does its simulation
    merging = lora.merge_on("meta") if device == "cpu" else contextlib.nullcontext()
    with merging, tracker, tracker.outputs_only_meta_kernels(scratch=attention_scratch if device == "cuda" else None):
        # The weights are counted from the model itself: building them (in 16 bits, then
        # quantised) is not what loading does on a GPU, so it is not counted as allocations.
        with tracker.paused():
            model = meta_model(config, torch_dtype, load_in_4bit=s["load_in_4bit"])
            model = models.prepare_for_training(model, max_seq_length=s["max_prompt_length"] + s["max_completion_length"],
                                                lora_rank=s["lora_rank"], target_modules=target_modules,
                                                gradient_checkpointing=checkpointing)
        if checkpointing == "offload":
            _offload_to_simulated_host(model, tracker)
        hooks = recorder.watch(base_model(model)) if recorder_wanted else []
        with oracle, recorder:
            batch = forced_batch(n, s["max_prompt_length"], s["max_completion_length"], config.vocab_size,
                                 device="meta", oracle=oracle, num_generations=grpo_config.num_generations)
            engine = None
            if s["rollout"]:
                engine = RolloutEngine(max_completion_length=s["max_completion_length"], min_new_tokens=0,
                                       decode="static" if device == "cuda" else "dynamic",
                                       max_rows=s["rollout_max_rows"], exact_adapters=_exact_adapters(grpo_config, device),
                                       cpu_dtype="bfloat16" if device == "cpu"
                                       and grpo_config.cpu_rollout_dtype == "bfloat16" else None)
            if engine is not None and s["tool_turns"] > 1:
                engine = EpisodeRollout(engine, s["tool_turns"], s["tool_result_tokens"])
            extra = run_step(model, batch, grpo_config, tracker, rollout=engine,
                             tokenizer=_TokenizerStandIn(config), foreach=True if device == "cuda" else None)
        for hook in hooks:
            hook.remove()
    trace = None
    if recorder_wanted:
        trace = recorder.finish()
        if short:
            trace.repeat_first_decode_step(s["max_completion_length"] - 1)
        else:
            trace.spread_decode_steps()
        if recorder_wanted != "both":
            return trace
    report = tracker.report()
    if s["logprob_backend"] == "torch" and device == "cuda":
        notes.append("Triton is not installed here, so the log-probs use the chunked PyTorch path a GPU without "
                     "Triton would take")
    result = simulated_result("grpo_nb", settings, report, model, extra, oracle, started, notes)
    result._trace = trace
    return result


def _capability(gpu, device: str):
    """The compute capability `simulate_step(gpu=...)` names (None on the CPU)."""
    if device != "cuda":
        if gpu is not None:
            refuse("simulate_step", "gpu", gpu, "None with device='cpu' (a card's kernels run on device='cuda')")
        return None
    if gpu is None:
        return (8, 0)
    if isinstance(gpu, tuple):
        if not (len(gpu) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in gpu)
                and 5 <= gpu[0] <= 12 and 0 <= gpu[1] <= 9):
            refuse("simulate_step", "gpu", gpu, "a CUDA compute capability as a (major, minor) pair of integers, from "
                   "(5, 0) to (12, 9), e.g. (7, 5) for a T4, or a card's name")
        return gpu
    from ..gpus import CARDS, card

    try:
        return card(gpu).capability
    except ValueError:
        refuse("simulate_step", "gpu", gpu, f"one of {sorted(CARDS)} (or the name torch.cuda.get_device_name() "
               f"gives for one), a grpo_nb.gpus.Card, or its compute capability as a pair, e.g. gpu=(7, 5)")


class _TokenizerStandIn(SimpleNamespace):
    """What the rollout engine reads of a tokenizer: the pad and end-of-sequence ids."""

    def __init__(self, config):
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        eos = 0 if eos is None else eos
        pad = getattr(config, "pad_token_id", None)
        super().__init__(pad_token_id=eos if pad is None else pad, eos_token_id=eos)


def _resolve_backend(backend: str, device: str, dtype: torch.dtype) -> str:
    """What `logprob_backend="auto"` becomes on the simulated device (see `logprobs.selective_logprobs`)."""
    if backend != "auto":
        return backend
    if device != "cuda":
        return "torch"
    try:
        from ..kernels import logprobs_triton  # noqa: F401
    except Exception:
        return "torch"
    return "triton"


class _SimulatedPinnedCopies:
    """Offloaded layer inputs as on CUDA: a copy in (pinned) host memory, a device copy when restored."""

    def __init__(self, tracker: AllocationTracker):
        self.tracker = tracker

    def copy_out(self, x):
        ops.transfer(x.numel() * x.element_size(), "to host")
        with self.tracker.host():
            return torch.empty(x.shape, dtype=x.dtype, device=x.device), None

    def copy_in(self, stored, device, prefetch, after):
        ops.transfer(stored.numel() * stored.element_size(), "to device")
        return torch.empty(stored.shape, dtype=stored.dtype, device=device), None

    def ready(self, tensor, event):
        pass


def _offload_to_simulated_host(model, tracker: AllocationTracker) -> None:
    base = base_model(model)
    attachments(base).offloader.host_copies = _SimulatedPinnedCopies(tracker)
