"""One GRPO step of grpo-nb, run on a model built on the meta device, every allocation counted.

`simulate_step()` builds the architecture from its config on the meta device (no weights),
applies what `setup_reasoning_model` applies (`models.prepare_for_training`: LoRA through
peft, plain or offloaded gradient checkpointing; NF4 weights as bitsandbytes stores them),
and runs the stages `train()` runs, with the functions `train()` uses: the rollout
(`RolloutEngine`, its KV cache at full length), the reference / old-policy log-probs when
the settings need them, the policy update (`trainer.accumulate_gradients`) and the optimizer
step (`trainer.apply_update`). `run_step()` is that sequence on any model: the honesty test
runs it on a real CPU model and compares.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..arguments import refuse
from ..attachments import attachments, base_model
from ..memory import (CATEGORIES, GiB, build_on_meta, check_context, check_planner_arguments, model_bytes,
                      optimizer_bytes, planner_config)
from .device import SimulatedDevice
from .tracker import AllocationTracker

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
# Labels of allocations made by the log-prob computation (its working memory).
_LOGPROB_CODE = ("grpo_nb/logprobs.py", "grpo_nb/kernels/", "trl/kernels/", "trl/trainer/utils.py")


@dataclass
class SimulatedStep:
    """A step's allocation peak and where it went, in the categories of `estimate_vram` / `MemoryTracker`.

    `peak` is the most bytes the step's tensors held on the device at once, as the code
    allocates them (the sum over live storages: what `torch.cuda.max_memory_allocated` reports).
    It does not include what the CUDA context, the caching allocator's rounding and
    fragmentation and library workspaces add on a real GPU (`fits()` adds a stated allowance).
    """

    system: str
    settings: dict
    categories: dict
    peak: int
    phases: dict            # phase -> {"start": bytes live when it began, "peak": its highest}
    largest_at_peak: list   # (phase: where in the code, bytes, allocations) live at the peak
    host_peak: int          # pinned host memory (offloaded activations) at its highest
    questions: list         # what the code asked the oracle, and the answers
    seconds: float
    counted_peak: int = 0   # the peak of what the step itself allocated (the weights excluded)
    notes: list = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.peak

    def __getitem__(self, key):
        return self.peak if key == "total" else self.categories[key]

    def table(self) -> str:
        rows = ["| category | GiB |", "|---|---:|"]
        rows += [f"| {k} | {self.categories[k] / GiB:.2f} |" for k in CATEGORIES]
        rows.append(f"| **peak (allocated)** | **{self.peak / GiB:.2f}** |")
        return "\n".join(rows)

    def timeline(self) -> str:
        lines = [f"{name:<24} start {p['start'] / GiB:7.2f} GiB   peak {p['peak'] / GiB:7.2f} GiB"
                 for name, p in self.phases.items()]
        lines.append("live at the peak:")
        lines += [f"  {b / GiB:7.3f} GiB  x{n:<3} {where}" for where, b, n in self.largest_at_peak]
        return "\n".join(lines)

    def __repr__(self):
        return f"SimulatedStep({self.system}, peak {self.peak / GiB:.2f} GiB allocated)\n{self.table()}"


# --------------------------------------------------------------------------------------
# Building the model and the batch


def quantize_4bit_on_meta(model, compute_dtype: torch.dtype) -> None:
    """Replace the decoder's nn.Linear layers with bitsandbytes NF4 layers, as `load_in_4bit` loads them.

    Each weight becomes what bitsandbytes stores after quantising (double quantisation, as
    `setup_reasoning_model` asks for): packed uint8 [n/2, 1], an 8-bit absmax per 64 weights,
    an fp32 absmax per 256 of those, the 16-entry NF4 code, the 256-entry absmax code and an
    offset. The output head stays in the compute dtype, as transformers keeps it.
    """
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, torch.nn.Linear) or child is head:
                continue
            out_f, in_f = child.out_features, child.in_features
            n = out_f * in_f
            layer = bnb.nn.Linear4bit(in_f, out_f, bias=child.bias is not None, compute_dtype=compute_dtype,
                                      compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                      device="meta")
            blocks = -(-n // 64)
            meta = dict(device="meta")
            nested = QuantState(absmax=torch.empty(-(-blocks // 256), dtype=torch.float32, **meta),
                                code=torch.empty(256, dtype=torch.float32, **meta), blocksize=256,
                                dtype=torch.float32)
            state = QuantState(absmax=torch.empty(blocks, dtype=torch.uint8, **meta), shape=torch.Size([out_f, in_f]),
                               code=torch.empty(16, dtype=torch.float32, **meta), blocksize=64, quant_type="nf4",
                               dtype=compute_dtype, offset=torch.empty((), dtype=torch.float32, **meta),
                               state2=nested)
            layer.weight = bnb.nn.Params4bit(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, **meta),
                                             requires_grad=False, quant_state=state, blocksize=64,
                                             compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                             bnb_quantized=True, module=layer)
            layer.quant_state = state
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(module, name, layer)
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=compute_dtype)
    model.config.quantization_config = quantization
    model.hf_quantizer = AutoHfQuantizer.from_config(quantization)  # what trainers check a 4-bit model by
    model.is_loaded_in_4bit = True
    model.is_quantized = True
    model.quantization_method = "bitsandbytes"


def meta_model(config, dtype: torch.dtype, *, load_in_4bit: bool = False):
    """The architecture of `config` on the meta device, in `dtype` (NF4 decoder layers with `load_in_4bit`)."""
    model = build_on_meta("simulate_step", config, dtype)
    if load_in_4bit:
        quantize_4bit_on_meta(model, dtype)
    model.config.use_cache = False
    return model


def forced_batch(num_sequences: int, prompt_length: int, completion_length: int, vocab_size: int, *,
                 device="cpu", oracle: SimulatedDevice | None = None, seed: int = 0):
    """The update's batch with every completion at its full length (the worst case): random ids, full masks.

    On the meta device each tensor's values are given to the oracle, so masks and lengths stay known.
    """
    g = torch.Generator().manual_seed(seed)
    n, p, c = num_sequences, prompt_length, completion_length
    values = {
        "prompt_ids": torch.randint(0, vocab_size, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab_size, (n, c), generator=g),
        "completion_mask": torch.ones(n, c, dtype=torch.long),
        "loss_mask": torch.ones(n, c, dtype=torch.long),
        "advantages": torch.randn(n, generator=g),
    }
    if torch.device(device).type == "meta":
        batch = {k: oracle.know(torch.empty(v.shape, dtype=v.dtype, device="meta"), v) for k, v in values.items()}
    else:
        batch = {k: v.to(device) for k, v in values.items()}
    from ..step import StepBatch

    return StepBatch(**batch, num_generations=1)


# --------------------------------------------------------------------------------------
# The step


def warm_optimizer(optimizer, params) -> None:
    """Give AdamW its moments as after the first step (they persist from then on), then drop the gradients."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_step(model, batch, config, tracker: AllocationTracker, *, rollout=None, tokenizer=None,
             foreach: bool | None = None) -> dict:
    """grpo-nb's step on `model` and a ready `batch`, phase by phase under `tracker`.

    `rollout` (a `RolloutEngine`) generates `config.num_generations` completions for each of the
    batch's prompts first (their memory is the rollout phase; the update then trains on `batch`).
    `foreach`: AdamW's implementation (CUDA tensors get the multi-tensor one, the meta device
    the loop). Returns what the categories need: gradient and optimizer bytes.
    """
    from ..step import accumulate_gradients, apply_update, build_optimizer, policy_logprobs

    optimizer, _, params = build_optimizer(model, config)
    if foreach is not None:
        for group in optimizer.param_groups:
            group["foreach"] = foreach
    with tracker.phase("optimizer state"):
        warm_optimizer(optimizer, params)
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
    grads = metrics["gradient_bytes"]
    with tracker.phase("optimizer step"):
        apply_update(optimizer, params, metrics, config)
    return {"gradients": grads, "optimizer": optimizer_bytes(optimizer)}


def categorize(report, model, extra: dict, *, update_phases=("policy update",)) -> dict:
    """The step's peak split into the categories of `estimate_vram` (see memory.py's docstring)."""
    out = dict.fromkeys(CATEGORIES, 0)
    out.update(model_bytes(model))
    out["optimizer"] = extra["optimizer"]
    out["gradients"] = extra["gradients"]
    if "rollout" in report.phase_peaks:
        out["kv_cache"] = max(0, report.phase_peaks["rollout"] - report.phase_start["rollout"])
    update = max(update_phases, key=lambda p: report.phase_peaks.get(p, -1))
    update_peak = report.phase_peaks.get(update, 0)
    update_start = min((report.phase_start.get(p, update_peak) for p in update_phases), default=0)
    out["logprob_scratch"] = sum(a.bytes for a in report.live_at_phase_peak.get(update, [])
                                 if a.phase in update_phases and any(c in a.where for c in _LOGPROB_CODE))
    out["activations"] = max(0, update_peak - update_start - out["gradients"] - out["logprob_scratch"])
    static = out["base_weights"] + out["trainable"] + out["optimizer"]
    dynamic = max(out["kv_cache"], out["gradients"] + out["activations"] + out["logprob_scratch"])
    out["other"] = max(0, out["base_weights"] + out["trainable"] + report.peak - static - dynamic)
    return out


# --------------------------------------------------------------------------------------
# The public entry point


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
    dtype: str = "bf16",
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
) -> SimulatedStep:
    """Run one GRPO step of `system` at full size on the meta device and count every allocation.

    Takes the arguments of `estimate_vram` (and returns the same categories), plus the GRPO
    settings that change what a step computes (`beta`, `num_iterations`, `loss_type`) and
    whether to include the rollout (`rollout_max_rows`: completions decoded at once, as
    `GRPOConfig.rollout_max_rows`; TRL has no such setting). `system="trl"` runs TRL's own code path for the same batch
    (`grpo_nb.simulate.trl_step`). `device="cuda"` simulates a GPU (its attention kernels,
    bitsandbytes' CUDA path, offloading to pinned host memory, the Triton log-prob kernels);
    `device="cpu"` the CPU (used to check the simulation against a real run). Nothing is
    computed and no weights are loaded: Qwen2.5-1.5B at 8 x 1280 tokens takes seconds.
    """
    from ..config import GRPOConfig
    from ..models import prepare_for_training

    check_planner_arguments("simulate_step", max_prompt_length=max_prompt_length,
                            max_completion_length=max_completion_length, num_generations=num_generations,
                            prompts_per_step=prompts_per_step, per_device_train_batch_size=per_device_train_batch_size,
                            load_in_4bit=load_in_4bit, lora_rank=lora_rank, target_modules=target_modules, dtype=dtype,
                            gradient_checkpointing=gradient_checkpointing, logprob_backend=logprob_backend,
                            logprob_chunk_size=logprob_chunk_size, system=system, device=device, beta=beta,
                            num_iterations=num_iterations, loss_type=loss_type, rollout=rollout,
                            rollout_max_rows=rollout_max_rows)
    n = prompts_per_step * num_generations
    micro = min(per_device_train_batch_size or n, n)
    if n % micro:
        refuse("simulate_step", "per_device_train_batch_size", per_device_train_batch_size,
               f"a divisor of the {n} completions per step (prompts_per_step x num_generations), or None for all")
    config = planner_config("simulate_step", model_or_config)
    check_context("simulate_step", config, max_prompt_length, max_completion_length)
    torch_dtype = _DTYPES[dtype]
    checkpointing = gradient_checkpointing
    if checkpointing == "offload" and device == "cpu":
        checkpointing = True  # on the CPU offloading is bookkeeping only (setup resolves "auto" to True there)
    backend = _resolve_backend(logprob_backend, device, torch_dtype)
    settings = dict(max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                    num_generations=num_generations, prompts_per_step=prompts_per_step,
                    per_device_train_batch_size=micro, load_in_4bit=load_in_4bit, lora_rank=lora_rank, dtype=dtype,
                    gradient_checkpointing=checkpointing, logprob_backend=backend, device=device, beta=beta,
                    num_iterations=num_iterations, loss_type=loss_type, rollout=rollout,
                    rollout_max_rows=rollout_max_rows if system == "grpo_nb" else None)
    if system == "trl":
        from .trl_step import simulate_trl_step

        return simulate_trl_step(config, torch_dtype, settings)

    grpo_config = GRPOConfig(num_generations=num_generations, per_device_train_batch_size=micro,
                             gradient_accumulation_steps=n // micro, max_completion_length=max_completion_length,
                             max_prompt_length=max_prompt_length, beta=beta, num_iterations=num_iterations,
                             loss_type=loss_type, logprob_backend=backend, logprob_chunk_size=logprob_chunk_size,
                             max_steps=1)
    started = time.perf_counter()
    tracker = AllocationTracker("meta", label_bytes=2**20 if device == "cuda" else 0)
    oracle = SimulatedDevice(device, end_sampling_after=2 if device == "cuda" else None)
    notes = []
    with tracker, tracker.outputs_only_meta_kernels():
        # The weights are counted from the model itself: building them (in 16 bits, then
        # quantised) is not what loading does on a GPU, so it is not counted as allocations.
        with tracker.paused():
            model = meta_model(config, torch_dtype, load_in_4bit=load_in_4bit)
            model = prepare_for_training(model, max_seq_length=max_prompt_length + max_completion_length,
                                         lora_rank=lora_rank, target_modules=target_modules,
                                         gradient_checkpointing=checkpointing)
        if checkpointing == "offload":
            _offload_to_simulated_host(model, tracker)
        with oracle:
            batch = forced_batch(n, max_prompt_length, max_completion_length, config.vocab_size, device="meta",
                                 oracle=oracle)
            engine = None
            if rollout:
                from ..rollout import RolloutEngine

                # CUDA decodes into a static KV cache sized for the whole rollout before the first
                # token, and every decode step has the same shapes: two steps show the rollout's peak.
                engine = RolloutEngine(max_completion_length=max_completion_length, min_new_tokens=0,
                                       decode="static" if device == "cuda" else "dynamic", max_rows=rollout_max_rows)
            extra = run_step(model, batch, grpo_config, tracker, rollout=engine,
                             tokenizer=_TokenizerStandIn(config), foreach=True if device == "cuda" else None)
    report = tracker.report()
    if backend == "torch" and device == "cuda":
        notes.append("Triton is not installed here, so the log-probs use the chunked PyTorch path a GPU without "
                     "Triton would take")
    return simulated_result("grpo_nb", settings, report, model, extra, oracle, started, notes)


def simulated_result(system, settings, report, model, extra, oracle, started, notes) -> SimulatedStep:
    """The report in the categories, every byte count including the (uncounted, constant) weights."""
    weights = model_bytes(model)
    static = weights["base_weights"] + weights["trainable"]
    largest = [("weights: the model's parameters and buffers", static, 1)] + report.by_location(11)
    return SimulatedStep(
        system=system, settings=settings, categories=categorize(report, model, extra), peak=static + report.peak,
        phases={p: {"start": static + report.phase_start.get(p, 0), "peak": static + b}
                for p, b in report.phase_peaks.items()},
        largest_at_peak=sorted(largest, key=lambda x: -x[1]), host_peak=report.host_peak,
        questions=oracle.questions, seconds=time.perf_counter() - started, notes=notes, counted_peak=report.peak)


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
        with self.tracker.host():
            return torch.empty(x.shape, dtype=x.dtype, device=x.device), None

    def copy_in(self, stored, device, prefetch, after):
        return torch.empty(stored.shape, dtype=stored.dtype, device=device), None

    def ready(self, tensor, event):
        pass


def _offload_to_simulated_host(model, tracker: AllocationTracker) -> None:
    base = base_model(model)
    attachments(base).offloader.host_copies = _SimulatedPinnedCopies(tracker)


def longest_completion(gpu_gib: float, model_or_config, *, system: str = "grpo_nb", step: int = 256,
                       headroom: float = 0.1, **kwargs):
    """The longest `max_completion_length` (a multiple of `step`, the prompt within the model's context)
    whose simulated step fits a `gpu_gib` card, with `memory.usable_gpu_bytes`'s allowance for what is
    not allocated tensors. Returns (length, its SimulatedStep); (0, None) if nothing fits.

    The planner (`memory.longest_completion`: `estimate_vram`, within a few percent of the
    simulation) proposes the length; simulations then walk from there in steps of `step`, up
    while the next length fits, down until one does.
    """
    from ..memory import completion_steps_in_context, usable_gpu_bytes
    from ..memory import longest_completion as planned_longest

    budget = usable_gpu_bytes(gpu_gib, headroom)
    most = completion_steps_in_context(model_or_config, kwargs.get("max_prompt_length", 256), step)
    simulated = {"rollout", "beta", "num_iterations", "loss_type"}  # simulate_step's own arguments
    n = max(1, planned_longest(gpu_gib, model_or_config, system=system, step=step, headroom=headroom,
                               **{k: v for k, v in kwargs.items() if k not in simulated}) // step)

    def run(n):
        return simulate_step(model_or_config, system=system, max_completion_length=n * step, **kwargs)

    result = run(n)
    if result.peak > budget:
        while n > 1:  # down until one fits
            n -= 1
            result = run(n)
            if result.peak <= budget:
                return n * step, result
        return 0, None
    while n < most:  # up while the next one fits
        nxt = run(n + 1)
        if nxt.peak > budget:
            break
        n, result = n + 1, nxt
    return n * step, result
