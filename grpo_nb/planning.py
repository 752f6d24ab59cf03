"""Planning for a GPU: which settings fit a card (`plan_for_gpu`), the longest completion that fits (estimated in
milliseconds, or simulated step by step), what of a card a run may use, and what to change after out of memory.

On top of the estimate (`memory.estimate`) and the simulation (`grpo_nb.simulate`), which both count the same
categories (`memory.accounting`).
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from dataclasses import dataclass, field

import torch

from .arguments import need_bool, need_number, plain, refuse
from .attachments import base_model
from .gpus import CARDS, Card
from .gpus import card as gpu_card
from .hardware import DTYPE_NAMES, FP16_OVERFLOWS, SHORT_NAMES, native_bf16, training_dtype
from .memory.accounting import CATEGORIES, GiB
from .simulate import simulate_step
from .memory.estimate import (MemoryEstimate, check_episode, check_planner_arguments, context_window, estimate_vram,
                              planner_config, resolve_config, turn_budget)

# --------------------------------------------------------------------------------------
# Planning for a GPU

GPU_MEMORY_GIB = {
    "T4": 15.0, "P100": 16.0, "V100": 16.0, "V100-32GB": 32.0, "L4": 22.5, "A10G": 22.5, "A10": 22.5,
    "RTX3090": 24.0, "RTX4090": 24.0, "A100": 40.0, "A100-40GB": 40.0, "A100-80GB": 80.0, "L40S": 45.0,
    "H100": 80.0, "H200": 141.0,
}
# Compute capability of each card above: from 8.0 (Ampere) a card computes bf16 natively and the planner
# plans in bf16; older cards (P100, V100, T4) train in fp16, as setup_reasoning_model's dtype="auto" picks.
# The cards the time pricing knows carry theirs in gpus.CARDS; the others are listed here.
_CAPABILITY_OF_UNPRICED = {"V100": (7, 0), "V100-32GB": (7, 0), "A10": (8, 6), "RTX3090": (8, 6), "RTX4090": (8, 9),
                           "L40S": (8, 9)}
GPU_CAPABILITY = {name: _CAPABILITY_OF_UNPRICED.get(name) or gpu_card(name).capability for name in GPU_MEMORY_GIB}
MAX_GPU_GIB = 1024  # a number above this is not a GiB count of any card


def gpu_memory_gib(gpu: str) -> float:
    """A card's memory from its name (see `catalogued_gpu`)."""
    return GPU_MEMORY_GIB[catalogued_gpu(gpu)]


def gpu_dtype(gpu: str, *, full_fine_tuning: bool = False, model_type: str | None = None) -> str:
    """The compute dtype a catalogued card trains in (`hardware.training_dtype`): "bf16" where it is native,
    else "fp16", or "fp32" for full fine-tuning and for model types that overflow fp16 (Gemma 2 / 3)."""
    dtype = training_dtype(GPU_CAPABILITY[catalogued_gpu(gpu)], full_fine_tuning=full_fine_tuning,
                           model_type=model_type)
    return SHORT_NAMES[dtype]


def catalogued_gpu(gpu: str) -> str:
    """The key of `GPU_MEMORY_GIB` a card's name means: a key itself ("T4", "A100-80GB"), or the name
    torch.cuda.get_device_name() reports ("Tesla T4", "NVIDIA A100-SXM4-80GB") when it matches one
    card of the table only (or several of the same memory and capability)."""
    known = {k.upper(): k for k in GPU_MEMORY_GIB}
    key = str(gpu).upper().replace(" ", "").replace("NVIDIA", "")
    if key in known:
        return known[key]
    # "NVIDIA GeForce RTX 4090" -> NVIDIA, GEFORCE, RTX, 4090, and RTX4090 from neighbours
    words = re.split(r"[\s_-]+", str(gpu).upper())
    words += [a + b for a, b in zip(words, words[1:])]
    found = {k: v for k, v in known.items() if k.split("-")[0] in words}
    # a size in the name ("A100-SXM4-80GB") picks the entry of that size
    sized = {k: v for k, v in found.items() if "-" in k and k.split("-", 1)[1] in words}
    found = sized or {k: v for k, v in found.items() if "-" not in k}
    if len({(GPU_MEMORY_GIB[v], GPU_CAPABILITY[v]) for v in found.values()}) == 1:
        return next(iter(found.values()))
    refuse("plan_for_gpu", "gpu", gpu, f"a GPU name, one of {sorted(GPU_MEMORY_GIB)}"
           + (f" (this name matches {sorted(found)}, which differ in memory)" if found else "")
           + ", or the card's memory in GiB as a number, e.g. plan_for_gpu(24)")


# The CUDA context and cuBLAS/cuDNN workspaces live outside torch's allocator.
_CUDA_CONTEXT_GIB = 0.6


def usable_gpu_bytes(gpu_gib: float, headroom: float = 0.1) -> int:
    """What of a card's memory a run's allocation peak may take.

    The card's memory less the CUDA context and library workspaces (0.6 GiB: a CUDA 12 context
    with PyTorch's kernels loaded takes 0.3-0.5 GiB, cuBLAS keeps up to 32 MiB of workspace per
    stream on Hopper, cuDNN and NCCL some more), then less `headroom` of the rest for the caching
    allocator's rounding and fragmentation (its reserved memory runs 5-10% above what is
    allocated in steady training). `plan_for_gpu` and the simulation's fit search both use it.
    """
    return int((gpu_gib - _CUDA_CONTEXT_GIB) * (1 - headroom) * GiB)


@dataclass
class Plan:
    gpu: str
    budget_bytes: int
    fits: bool
    settings: dict
    estimate: MemoryEstimate | None
    tried: list
    simulated: object = None  # the plan's step run on the meta device (grpo_nb.simulate), with simulate=True
    notes: list = field(default_factory=list)  # what the plan assumed or left out, in words
    _time: object = field(default=None, repr=False)
    # with simulate=True on a card of known speeds: every setting tried at the chosen length and generations,
    # as (settings that differ, simulated peak bytes - estimated where the estimate alone ruled it out -, StepTime or
    # None where it did not fit)
    alternatives: list = field(default_factory=list)
    # with max_step_seconds: (that limit, [(length, generations, seconds) that fit but were priced slower])
    slow: tuple = ()

    @property
    def categories(self) -> dict | None:
        """The memory categories of the simulated step (else of the estimate), for the widgets' planned bar."""
        chosen = self.simulated if self.simulated is not None else self.estimate
        return None if chosen is None else chosen.categories

    @property
    def priced_time(self):
        """The step's time if already priced (`time` prices it at first access), else None."""
        return self._time

    @property
    def time(self):
        """The simulated step priced on the named card (a grpo_nb.simulate.pricing.StepTime), or None: no
        simulation, or a card without known speeds. Priced at the first call (a second simulated pass, about
        as long as the first), then kept."""
        if self._time is None and self.simulated is not None and self.fits:
            try:
                card = gpu_card(self.gpu)
            except ValueError:
                return None
            self._time = self.simulated.time(card)
        return self._time

    def __repr__(self):
        if not self.fits and self.slow:
            line = (f"Plan({self.gpu}: what fits in {self.budget_bytes / GiB:.1f} GiB is slower than "
                    f"max_step_seconds={self.slow[0]:.3g})")
        elif not self.fits:
            line = f"Plan({self.gpu}: nothing tried fits in {self.budget_bytes / GiB:.1f} GiB)"
        else:
            s = self.settings
            checked = f", simulated {self.simulated.peak / GiB:.2f} GiB" if self.simulated is not None else ""
            t = self._time  # shown once priced (`plan.time`)
            timed = f"; priced {t.total:.1f} s per step (rollout {t.rollout:.1f} s, update {t.update:.1f} s)" if t else ""
            rows = f", rollout_max_rows={s['rollout_max_rows']}" if s.get("rollout_max_rows") else ""
            if s.get("tool_turns", 1) > 1:
                rows += f", tool_turns={s['tool_turns']}, tool_result_tokens={s['tool_result_tokens']}"
            line = (f"Plan({self.gpu}, {self.budget_bytes / GiB:.1f} GiB usable): load_in_4bit={s['load_in_4bit']}, "
                    f"num_generations={s['num_generations']}, max_completion_length={s['max_completion_length']}, "
                    f"gradient_checkpointing={s['gradient_checkpointing']!r}{rows} "
                    f"-> estimated peak {self.estimate.total / GiB:.2f} GiB{checked}{timed}")
        return "\n".join([line, *(f"Note: {note}" for note in self.notes), *self._trade_offs()])

    def _trade_offs(self) -> list:
        if len(self.alternatives) < 2:
            return []
        lines = ["Tried at this length (fastest that fits chosen):"]
        for changed, peak, t in self.alternatives:
            what = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            lines.append(f"  {what}: simulated {peak / GiB:.2f} GiB, "
                         + (f"{t.total:.1f} s per step" if t is not None else "does not fit"))
        return lines


# With fastest=True, 16-bit weights are kept over 4-bit ones unless 4-bit is priced more than this much faster
QUALITY_MARGIN = 0.1

# The completion lengths the planner tries, longest first (plan_for_gpu, and the advice after out of memory).
COMPLETION_LENGTHS = (32768, 16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64)
GENERATION_COUNTS = (16, 12, 8, 6, 4, 2)


def plan_for_gpu(
    gpu: str | float = "T4",
    model_or_config="Qwen/Qwen2.5-1.5B-Instruct",
    *,
    max_prompt_length: int = 256,
    num_generations=GENERATION_COUNTS[:-1],
    max_completion_length=tuple(n for n in COMPLETION_LENGTHS if n >= 256),
    load_in_4bit=(False, True),
    headroom: float = 0.1,
    simulate: bool = False,
    fastest: bool = True,
    max_step_seconds: float | None = None,
    tool_turns: int = 1,
    tool_result_tokens: int = 0,
    **estimate_kwargs,
) -> Plan:
    """The longest completions (then the most generations, then 16-bit over 4-bit) that fit on `gpu`.

    Args:
        gpu: a name in `GPU_MEMORY_GIB` ("T4", "A100-80GB", ...) or the card's memory in GiB. A named
            card is planned in the dtype it trains in (`GPU_CAPABILITY`: bf16 from compute capability
            8.0; before, fp16 under LoRA and fp32 for full fine-tuning, as `setup_reasoning_model`
            picks) unless `dtype` is given. A size names no card, so no compute capability: it is
            planned in `dtype` (default bf16), and the plan's notes say so.
        model_or_config: anything `estimate_vram` takes.
        headroom: fraction of the card kept free for fragmentation and spikes.
        simulate: check the planner's choice by running the real step at that size on the meta
            device (`grpo_nb.simulate.simulate_step`, no GPU needed; seconds per try at a few
            thousand tokens, minutes at tens of thousands); a choice whose
            simulated peak does not fit falls through to the next candidate. The plan then carries
            the simulated step (`plan.simulated`: its categories, phases and largest allocations),
            which the widgets' `vram_figure(planned=plan)` draws.
        fastest: with `simulate=True` on a card whose speeds are known (`grpo_nb.gpus.CARDS`): at the
            length and generations chosen, also try the other `load_in_4bit` candidates, plain
            gradient checkpointing beside offloading, and the widest rollout that fits (all
            completions at once, else halved until it fits: `rollout_max_rows`), where you did not
            set them; price each that fits on the card (`simulate_step(...).time`) and keep the
            fastest (so a length fits if it fits decoding one completion at a time; 16-bit weights
            are kept unless 4-bit is priced more than `QUALITY_MARGIN` faster). `plan.alternatives`
            lists them (peak, seconds), `plan.time` the chosen one's stages. Each try is two
            simulated passes: seconds at a few thousand tokens, minutes at tens of thousands.
            grpo-nb's step only (with `system="trl"` the plan is priced, not searched).
        max_step_seconds: with `simulate=True` on a card of known speeds: a setting that fits but whose
            step is priced above this many seconds is passed over like one that does not fit (the
            longest completion that fits *and* runs a step in that time).
        tool_turns, tool_result_tokens: multi-turn episodes (`train(tools=...)`), as in `estimate_vram`: every
            estimate (and simulation) counts that rollout, and a length too short to share among the turns and
            results is left out (the notes say so). Their time is priced as the model's work (every turn's
            prefill and decode steps; the tools' own time is not known here).
        Candidates for `num_generations`, `max_completion_length` and `load_in_4bit` are tried
        longest completion first (those beyond the model's context window beside `max_prompt_length`
        are left out, and the plan's notes say so); the other keyword arguments go to `estimate_vram`.
    """
    as_tuple = lambda v: tuple(v) if isinstance(v, (list, tuple, range)) else (v,)  # noqa: E731
    # Every candidate and setting is checked before the first (possibly minutes-long, simulated) try.
    unknown = [k for k in estimate_kwargs if k not in inspect.signature(estimate_vram).parameters]
    if unknown:
        close = difflib.get_close_matches(unknown[0], inspect.signature(estimate_vram).parameters, n=1)
        raise TypeError(f"plan_for_gpu({unknown[0]}={estimate_kwargs[unknown[0]]!r}) is invalid: plan_for_gpu passes "
                        f"its other keyword arguments to estimate_vram, which has no argument {unknown[0]!r}."
                        + (f" Did you mean {close[0]}?" if close else ""))
    for arg, values in (("max_completion_length", max_completion_length), ("num_generations", num_generations),
                        ("load_in_4bit", load_in_4bit)):
        if not as_tuple(values):
            refuse("plan_for_gpu", arg, values, "a value or a non-empty list of candidates")
        for value in as_tuple(values):
            check_planner_arguments("plan_for_gpu", **{arg: value})
    check_planner_arguments("plan_for_gpu", max_prompt_length=max_prompt_length, **estimate_kwargs)
    # the turns checked against the longest candidate; shorter ones they do not fit in are left out below
    check_episode("plan_for_gpu", tool_turns, tool_result_tokens, max(as_tuple(max_completion_length)),
                  estimate_kwargs.get("system", "grpo_nb"))
    episodes = dict(tool_turns=int(tool_turns), tool_result_tokens=int(tool_result_tokens)) if tool_turns > 1 else {}
    if True in as_tuple(load_in_4bit):
        check_planner_arguments("plan_for_gpu", load_in_4bit=True, lora_rank=estimate_kwargs.get("lora_rank", 16))
    need_number("plan_for_gpu", "headroom", headroom, 0, 1, high_open=True)
    need_bool("plan_for_gpu", "simulate", simulate)
    need_bool("plan_for_gpu", "fastest", fastest)
    if max_step_seconds is not None:
        need_number("plan_for_gpu", "max_step_seconds", max_step_seconds, 0, low_open=True)
        if not simulate:
            refuse("plan_for_gpu", "max_step_seconds", max_step_seconds, "None without simulate=True: a step's time "
                   "is priced from its simulated kernels (plan_for_gpu(..., simulate=True, max_step_seconds=...))")
    if simulate and estimate_kwargs.get("optim", "adamw_torch") != "adamw_torch":
        refuse("plan_for_gpu", "optim", estimate_kwargs["optim"], "'adamw_torch' with simulate=True: the meta device "
               "runs torch's AdamW, not bitsandbytes' kernels (plan with simulate=False for the 8-bit states)")
    cfg = planner_config("plan_for_gpu", model_or_config)
    lengths, notes = completions_in_context(cfg, max_prompt_length, as_tuple(max_completion_length))
    if episodes:
        short = sorted(n for n in lengths if n < tool_turns or turn_budget(n, tool_turns, tool_result_tokens) < 1)
        lengths = [n for n in lengths if n not in short]
        if short:
            notes.append(f"max_completion_length {', '.join(map(str, short))} not tried: too short for {tool_turns} "
                         f"turns and {tool_turns - 1} results of {tool_result_tokens} tokens, at least one sampled "
                         f"token a turn")
        if not lengths:  # all of them beyond the context window or too short: the longest one's reason
            check_episode("plan_for_gpu", tool_turns, tool_result_tokens, max(short), "grpo_nb")
    gpu = plain(gpu)  # np.float32(15) is a size too
    if isinstance(gpu, (Card, tuple)):
        what = f"Card(name={gpu.name!r}, ...)" if isinstance(gpu, Card) else repr(gpu)
        raise ValueError(f"plan_for_gpu(gpu={what}) is invalid: expected a card's name (e.g. 'T4') or its memory in "
                         f"GiB: a plan needs the card's memory, which a Card or a compute capability does not hold. "
                         f"To price a plan on your own Card: plan_for_gpu(<its memory in GiB>, ..., "
                         f"simulate=True).simulated.time(card)")
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        need_number("plan_for_gpu", "gpu", gpu, 0, low_open=True)
        if gpu > MAX_GPU_GIB:  # no card comes near; torch's total_memory and nvidia-smi give bytes and MiB
            unit, size = ("bytes", gpu / GiB) if gpu >= GiB else ("MiB (as nvidia-smi shows it)", gpu / 1024)
            refuse("plan_for_gpu", "gpu", gpu, f"the card's memory in GiB, e.g. 16, or a name such as 'T4'; "
                   f"{gpu:g} looks like {unit}, which is {size:.1f} GiB: plan_for_gpu({size:.1f})")
        if gpu <= _CUDA_CONTEXT_GIB:
            refuse("plan_for_gpu", "gpu", gpu, f"more than the {_CUDA_CONTEXT_GIB} GiB that the CUDA context and its "
                   f"libraries take on any card before the first tensor: {gpu:g} GiB leaves nothing for the run")
        name, gib = f"{gpu:g} GiB GPU", float(gpu)
        if "dtype" not in estimate_kwargs:
            notes.append(f"{gpu:g} GiB is a size, not a card, so it has no compute capability: planned in bf16 "
                         f"(compute capability 8.0+). On a T4 or V100 LoRA trains in fp16 (the same memory) and full "
                         f"fine-tuning in fp32: pass the card's name, e.g. plan_for_gpu('T4'), or dtype=")
    else:
        name, gib = str(gpu).strip(), gpu_memory_gib(gpu)
        if estimate_kwargs.get("device", "cuda") != "cuda":
            refuse("plan_for_gpu", "device", estimate_kwargs["device"], f"'cuda' (or left out) when planning for a "
                   f"GPU ({name}): device='cpu' plans the CPU's step, with its runtime and its kernels")
        if (isinstance(estimate_kwargs.get("dtype"), str) and DTYPE_NAMES.get(estimate_kwargs["dtype"]) is torch.bfloat16
                and not native_bf16(GPU_CAPABILITY[catalogued_gpu(gpu)])):
            notes.append(f"{name} has no bfloat16 hardware: bf16 is emulated there (its matmuls several times slower "
                         f"than fp16); setup_reasoning_model picks fp16 on it")
        # A card without native bf16 (T4, V100) trains LoRA in fp16 and full fine-tuning in fp32, as
        # setup_reasoning_model's dtype="auto" picks; fp32 too for Gemma 2 / 3, which overflow fp16.
        model_type, picked = getattr(cfg, "model_type", None), "dtype" not in estimate_kwargs
        estimate_kwargs.setdefault("dtype", gpu_dtype(gpu, full_fine_tuning=estimate_kwargs.get("lora_rank", 16) is None,
                                                      model_type=model_type))
        if picked and estimate_kwargs["dtype"] == "fp32" and model_type in FP16_OVERFLOWS:
            notes.append(f"planned in fp32: {model_type} models overflow fp16 and {name} has no native bf16")
    budget = usable_gpu_bytes(gib, headroom)
    # A named card's attention kernels (FlashAttention from compute capability 8.0) in the simulated step
    capability = GPU_CAPABILITY[catalogued_gpu(gpu)] if isinstance(gpu, str) else None
    if max_step_seconds is not None and not _priceable(name):
        refuse("plan_for_gpu", "max_step_seconds", max_step_seconds, f"None for {name}: it is not a card whose speeds "
               f"grpo-nb knows (grpo_nb.gpus.CARDS: {', '.join(CARDS)}), so no step can be priced")
    tried, slow = [], []
    # Choosing by time, a length fits if it fits decoding one completion at a time; `_fastest` then widens the rollout
    # (TRL's step has no rollout width and no offloading to choose: only grpo-nb's step is searched)
    fastest = fastest and estimate_kwargs.get("system", "grpo_nb") == "grpo_nb"
    widening = simulate and fastest and _priceable(name) and "rollout_max_rows" not in estimate_kwargs
    fit_kwargs = {**estimate_kwargs, "rollout_max_rows": 1} if widening else estimate_kwargs
    for length in sorted(lengths, reverse=True):
        for gens in sorted(as_tuple(num_generations), reverse=True):
            for q in sorted(as_tuple(load_in_4bit)):  # 16-bit first: better quality when it fits
                est = estimate_vram(model_or_config, max_prompt_length=max_prompt_length,
                                    max_completion_length=length, num_generations=gens, load_in_4bit=q, **episodes,
                                    **fit_kwargs)
                tried.append((length, gens, q, est.total))
                if est.total > budget:
                    continue
                if not simulate:
                    return Plan(name, budget, True, dict(est.settings), est, tried, notes=notes)
                simulated = simulate_step(model_or_config, max_prompt_length=max_prompt_length,
                                          max_completion_length=length, num_generations=gens, load_in_4bit=q,
                                          gpu=capability, record_kernels=_priceable(name), **episodes, **fit_kwargs)
                if simulated.peak <= budget:
                    plan = Plan(name, budget, True, dict(est.settings), est, tried, simulated, notes=notes)
                    if not _priceable(name):
                        notes.append(f"no time priced: {name} is not a card whose speeds grpo-nb knows "
                                     f"(grpo_nb.gpus.CARDS); price the step yourself: plan.simulated.time(card)")
                    elif fastest:
                        plan = _fastest(plan, model_or_config, capability, as_tuple(load_in_4bit), max_prompt_length,
                                        {**estimate_kwargs, **episodes})
                    if max_step_seconds is not None and plan.time.total > max_step_seconds:
                        slow.append((length, gens, plan.time.total))
                        if fastest:
                            break  # every load_in_4bit candidate was priced at this length
                        continue
                    if slow:
                        plan.notes.append(f"passed over as slower than max_step_seconds={max_step_seconds:.3g}: "
                                     + _slow_list(slow))
                        plan.slow = (max_step_seconds, slow)
                    return plan
    if slow:
        notes.append(f"every setting that fits is slower than max_step_seconds={max_step_seconds:.3g}: "
                     + _slow_list(slow))
    return Plan(name, budget, False, {}, None, tried, notes=notes, slow=(max_step_seconds, slow) if slow else ())


def _slow_list(slow) -> str:
    return ", ".join(f"{n} tokens x {g} generations ({t:.3g} s)" for n, g, t in slow)


def _fastest(plan: Plan, model_or_config, capability, quantized: tuple, max_prompt_length: int, kwargs: dict) -> Plan:
    """The fastest of the settings that fit at `plan`'s length and generations (see plan_for_gpu's `fastest`)."""
    s, card = plan.settings, gpu_card(plan.gpu)
    rows = s["num_generations"] * s.get("prompts_per_step", 1)
    choices = [dict(load_in_4bit=q) for q in sorted(set(quantized))]
    if "gradient_checkpointing" not in kwargs:
        choices = [{**c, "gradient_checkpointing": g} for c in choices for g in ("offload", True)]
    widths = [None] if "rollout_max_rows" in kwargs else [None] + [w for w in (rows // 2, rows // 4, 2, 1) if 0 < w < rows]
    fixed = dict(kwargs)  # what you set is kept; only what you left out varies
    best, tried, kept = None, [], []
    for choice in choices:
        for width in dict.fromkeys(widths):  # the widest rollout that fits is the fastest one
            settings = {**choice, **({"rollout_max_rows": width} if width is not None else {})}
            shape = dict(max_prompt_length=max_prompt_length, max_completion_length=s["max_completion_length"],
                         num_generations=s["num_generations"])
            estimate = estimate_vram(model_or_config, **shape, **fixed, **settings).total
            if estimate > 1.05 * plan.budget_bytes:  # the estimate is within a few % of the simulation: skip it
                tried.append((settings, estimate, None))
                continue
            same = all(s.get(k) == v for k, v in settings.items()) and (width is None) == (s.get("rollout_max_rows") is None)
            step = plan.simulated if same else simulate_step(model_or_config, **shape, gpu=capability, record_kernels=True,
                                                             **fixed, **settings)
            if step.peak > plan.budget_bytes:
                tried.append((settings, step.peak, None))
                continue
            seconds = step.time(card)
            tried.append((settings, step.peak, seconds))
            kept.append((settings, step, seconds))
            if best is None or seconds.total < best[2].total:
                best = (settings, step, seconds)
            break
    settings, step, seconds = best
    notes = list(plan.notes)
    if settings.get("load_in_4bit"):
        # 16-bit weights train a little better: kept unless 4-bit is more than QUALITY_MARGIN faster
        full = [(a, st, t) for a, st, t in kept if not a.get("load_in_4bit")]
        if full:
            a, st, t = min(full, key=lambda x: x[2].total)
            if t.total <= (1 + QUALITY_MARGIN) * seconds.total:
                settings, step, seconds = a, st, t
            else:
                notes.append(f"chose 4-bit weights ({seconds.total:.3g} s per step) over 16-bit ones, which fit too "
                             f"({t.total:.3g} s): pass load_in_4bit=(False,) to keep 16-bit weights (full precision)")
    estimate = estimate_vram(model_or_config, max_prompt_length=max_prompt_length,
                             max_completion_length=s["max_completion_length"], num_generations=s["num_generations"],
                             **{**fixed, **settings})
    chosen = Plan(plan.gpu, plan.budget_bytes, True, dict(estimate.settings), estimate, plan.tried, step,
                  notes=notes, _time=seconds, alternatives=tried)
    return chosen


def _priceable(gpu: str) -> bool:
    try:
        gpu_card(gpu)
    except ValueError:
        return False
    return True


def completions_in_context(cfg, max_prompt_length: int, lengths) -> tuple[list, list]:
    """The candidate completion lengths that fit beside the prompt in the model's context window, and a
    note naming those left out; refused when none does."""
    context = context_window(cfg)
    room = context - max_prompt_length if context else math.inf
    if room < 1:
        refuse("plan_for_gpu", "max_prompt_length", max_prompt_length, f"less than the model's context window of "
               f"{context} tokens (its config's max_position_embeddings), leaving room for the completion")
    fitting, beyond = [n for n in lengths if n <= room], sorted((n for n in lengths if n > room), reverse=True)
    if not fitting:
        refuse("plan_for_gpu", "max_completion_length", lengths if len(lengths) > 1 else lengths[0],
               f"at most {room} tokens: the model's context window of {context} (its config's "
               f"max_position_embeddings) less max_prompt_length={max_prompt_length}")
    notes = [f"max_completion_length {', '.join(map(str, beyond))} not tried: beyond the model's context window of "
             f"{context} tokens (its config's max_position_embeddings) beside max_prompt_length={max_prompt_length}"
             ] if beyond else []
    return fitting, notes


def completion_steps_in_context(model_or_config, max_prompt_length: int, step: int) -> int:
    """How many `step`s of completion fit beside the prompt in the model's context window."""
    context = context_window(resolve_config(model_or_config)) or 2**20
    return (context - max_prompt_length) // step


def estimated_longest_completion(gpu_gib: float, model_or_config, *, system: str = "grpo_nb", lengths=None, step: int = 256,
                       headroom: float = 0.1, **estimate_kwargs) -> int:
    """The longest max_completion_length whose estimate fits a `gpu_gib` card (0 if none).

    The card's usable memory is `usable_gpu_bytes(gpu_gib, headroom)`. Candidates are `lengths`, or
    by default every multiple of `step` that leaves the prompt room in the model's context window
    (searched by doubling, then bisection: the estimate grows with the length).
    """
    budget = usable_gpu_bytes(gpu_gib, headroom)
    fits = lambda n: estimate_vram(model_or_config, max_completion_length=n, system=system,  # noqa: E731
                                   **estimate_kwargs).total <= budget
    if lengths is not None:  # those beyond the model's context window cannot run at all
        room = completion_steps_in_context(model_or_config, estimate_kwargs.get("max_prompt_length", 256), 1)
        return max((n for n in lengths if n <= room and fits(n)), default=0)
    most = completion_steps_in_context(model_or_config, estimate_kwargs.get("max_prompt_length", 256), step)
    lo = 0
    while lo < most and fits(min(most, max(1, 2 * lo)) * step):
        lo = min(most, max(1, 2 * lo))
    hi = min(most, max(1, 2 * lo))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step


def simulated_longest_completion(gpu_gib: float, model_or_config, *, system: str = "grpo_nb", step: int = 256,
                       headroom: float = 0.1, **kwargs):
    """The longest `max_completion_length` (a multiple of `step`, the prompt within the model's context)
    whose simulated step fits a `gpu_gib` card, with `usable_gpu_bytes`'s allowance for what is
    not allocated tensors. Returns (length, its SimulatedStep); (0, None) if nothing fits.

    The estimate (`estimated_longest_completion`: `estimate_vram`, within a few percent of the
    simulation) proposes the length; simulations then walk from there in steps of `step`, up
    while the next length fits, down until one does.
    """
    budget = usable_gpu_bytes(gpu_gib, headroom)
    most = completion_steps_in_context(model_or_config, kwargs.get("max_prompt_length", 256), step)
    simulated = {"rollout", "beta", "num_iterations", "loss_type", "gpu"}  # simulate_step's own arguments
    n = max(1, estimated_longest_completion(gpu_gib, model_or_config, system=system, step=step, headroom=headroom,
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


# --------------------------------------------------------------------------------------
# Out-of-memory guidance

_PHASE_ADVICE = {
    "rollout": ("generation holds the KV cache of every completion: lower num_generations or "
                "max_completion_length, or train fewer prompts per step (gradient_accumulation_steps)"),
    "update": ("the update holds activations of one micro-batch: lower per_device_train_batch_size, keep "
               "gradient_checkpointing='offload' (the default on CUDA), or shorten max_completion_length"),
    # the training steps fit: only the evaluation's own batch is the evaluation's to change
    "evaluation": ("the held-out evaluation (train(eval_dataset=...)) generates per_device_eval_batch_size prompts "
                   "(or the whole eval set, where it is smaller) at once beside the training's weights and optimizer "
                   "state, each with a KV cache of its prompt and max_completion_length tokens: lower "
                   "per_device_eval_batch_size below the eval set's size (1 takes the least), or shorten the eval "
                   "set's prompts (fewer rows make each evaluation shorter, not its peak lower); the training steps "
                   "themselves fit"),
}


def oom_message(phase: str, step: int, config, model, breakdown: dict | None, device) -> str:
    """What ran out, what memory held at that moment, and settings that would fit (from the planner)."""
    # an evaluation runs after its step is complete (eval_on_start's before the first)
    when = (f"of step {step + 1}" if phase != "evaluation" else
            f"after step {step}" if step else "before the first step")
    lines = [f"Out of memory during the {phase} {when}."]
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        lines.append(f"At that moment: {torch.cuda.memory_allocated(device) / GiB:.2f} GiB allocated, "
                     f"{torch.cuda.memory_reserved(device) / GiB:.2f} GiB reserved, of {total / GiB:.1f} GiB on "
                     f"{torch.cuda.get_device_name(device)}.")
    else:
        total = None
    if breakdown:
        parts = ", ".join(f"{k.replace('_', ' ')} {breakdown[k] / GiB:.2f}" for k in CATEGORIES if breakdown.get(k))
        lines.append(f"The last completed step used (GiB): {parts}; peak {breakdown.get('peak', 0) / GiB:.2f}.")
    if phase == "evaluation":
        lines.append(f"This run: per_device_eval_batch_size={config.per_device_eval_batch_size}, "
                     f"max_prompt_length={config.max_prompt_length}, max_completion_length="
                     f"{config.max_completion_length}, load_in_4bit={_is_4bit(model)}.")
    else:
        lines.append(f"This run: num_generations={config.num_generations}, max_completion_length="
                     f"{config.max_completion_length}, per_device_train_batch_size="
                     f"{config.per_device_train_batch_size}, load_in_4bit={_is_4bit(model)}.")
    lines.append("What to change: " + _PHASE_ADVICE.get(phase, _PHASE_ADVICE["update"]) + ".")
    if total and phase != "evaluation":  # the planner sizes the training step, which fit
        gens = tuple(g for g in GENERATION_COUNTS if g <= config.num_generations) or (2,)
        lengths = tuple(n for n in COMPLETION_LENGTHS if n <= config.max_completion_length) or (
            config.max_completion_length,)

        def plan_for(lengths):
            return plan_for_gpu(total / GiB, model, max_prompt_length=config.max_prompt_length or 256,
                                num_generations=gens, max_completion_length=lengths,
                                load_in_4bit=(True,) if _is_4bit(model) else (False, True), optim=config.optim)

        try:
            plan = plan_for(lengths)
            if plan.fits and (plan.settings["num_generations"], plan.settings["max_completion_length"]) == (
                    config.num_generations, config.max_completion_length):
                # The planner thinks this very run fits, yet it ran out: something else holds memory on this
                # GPU (another process, a second model) or the estimate is low here. Offering the same settings
                # would send the user round in a circle, so offer the next smaller completion length instead.
                lines.append(f"The planner estimated this run at {plan.estimate.total / GiB:.1f} GiB, below this "
                             "GPU's size: check what else holds memory on it (nvidia-smi).")
                shorter = tuple(n for n in lengths if n < config.max_completion_length)
                plan = plan_for(shorter) if shorter else None
        except Exception as err:  # the advice must never hide the error itself
            plan = None
            lines.append(f"(The planner could not size this model: {err!r}.)")
        if plan is not None and plan.fits:
            s = plan.settings
            lines.append(f"The planner's estimate of what fits this GPU: num_generations={s['num_generations']}, "
                         f"max_completion_length={s['max_completion_length']}, per_device_train_batch_size="
                         f"{s['per_device_train_batch_size']}, load_in_4bit={s['load_in_4bit']} (estimated peak "
                         f"{plan.estimate.total / GiB:.1f} GiB).")
        elif plan is not None:
            lines.append("The planner finds no setting of this model that fits this GPU: use a smaller model.")
    return "\n".join(lines)


def _is_4bit(model) -> bool:
    base = base_model(model)
    return bool(getattr(base, "is_loaded_in_4bit", False))
