"""What the simulated steps share (grpo-nb's in `step.py`, TRL's in `trl_step.py`): the model built on the meta
device, the worst-case batch, the optimizer's moments as after a first step, and the report in the categories of
`estimate_vram` / `MemoryTracker` (`SimulatedStep`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ..memory import CATEGORIES, GiB, build_on_meta, model_bytes, step_peak
from ..batch import StepBatch
from .device import SimulatedDevice
from .ops import LOGPROB_CODE
from ..gpus import card as gpu_card
from .pricing import StepTime, price



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
    record_ops: object = field(default=None, repr=False)  # runs the step again, recording its kernels (an OpTrace)
    _trace: object = field(default=None, repr=False)

    def time(self, card="T4", **options) -> StepTime:
        """The step's time on `card` (a name in `grpo_nb.gpus.CARDS` or a `Card`), by stage: its kernels,
        recorded in a second simulated pass (seconds to minutes, once per SimulatedStep; none where
        `simulate_step(record_kernels=True)` recorded them with the step), priced by
        `pricing.price` (`options` are its keywords)."""
        if self._trace is None:
            if self.record_ops is None:
                raise ValueError(f"this simulation of {self.system} keeps no way to record its kernels: time() "
                                 f"prices what simulate_step() returns")
            self._trace = self.record_ops()
        options.setdefault("graph_decode", self.system == "grpo_nb" and self.settings.get("device") == "cuda")
        priced = price(self._trace, card, self.settings, **options)
        simulated = self.settings.get("capability")
        on = gpu_card(card).capability
        if simulated is not None and (tuple(simulated) >= (8, 0)) != (tuple(on) >= (8, 0)):
            priced.notes.append(f"simulated with the attention kernels of compute capability {simulated[0]}.{simulated[1]}, "
                                f"priced on a card of {on[0]}.{on[1]}, whose kernels differ (FlashAttention from 8.0): "
                                f"simulate_step(..., gpu={gpu_card(card).name!r}) for its own")
        if self.settings.get("dtype") == "bf16" and tuple(on) < (8, 0):
            priced.notes.append(f"priced in bf16, which a {gpu_card(card).name} (compute capability {on[0]}.{on[1]}) has no "
                                f"hardware for: its matmuls run emulated, several times slower; on it "
                                f"setup_reasoning_model trains in fp16: simulate_step(..., gpu={gpu_card(card).name!r}) "
                                f"without dtype for its own step")
        if self.system == "trl" and options["graph_decode"]:
            priced.notes.append("TRL's HF generate launches every kernel: graph_decode=True prices a decode TRL does "
                                "not run")
        return priced

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
    """The architecture of `config` on the meta device, in `dtype` (NF4 decoder layers with `load_in_4bit`).

    Built from a copy: from_config writes the dtype into the config it is given, and the simulation writes
    use_cache and the 4-bit quantization into the model's, which may be the config of the caller's live model."""
    model = build_on_meta("simulate_step", copy.deepcopy(config), dtype)
    if load_in_4bit:
        quantize_4bit_on_meta(model, dtype)
    model.config.use_cache = False
    return model


def forced_batch(num_sequences: int, prompt_length: int, completion_length: int, vocab_size: int, *,
                 device="cpu", oracle: SimulatedDevice | None = None, seed: int = 0, num_generations: int = 1):
    """The update's batch with every completion at its full length (the worst case): random ids, full masks, each
    prompt repeated for the `num_generations` completions of its group, as a rollout gives them.

    On the meta device each tensor's values are given to the oracle, so masks and lengths stay known.
    """
    g = torch.Generator().manual_seed(seed)
    n, p, c = num_sequences, prompt_length, completion_length
    values = {
        "prompt_ids": torch.randint(0, vocab_size, (n // num_generations, p), generator=g).repeat_interleave(
            num_generations, dim=0),
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
    return StepBatch(**batch, num_generations=1)


# --------------------------------------------------------------------------------------
# The report


def warm_optimizer(optimizer, params) -> None:
    """Give AdamW its moments as after the first step (they persist from then on), then drop the gradients."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def categorize(report, model, extra: dict, *, update_phases=("policy update",)) -> dict:
    """The step's peak split into the categories of `estimate_vram` (see memory/accounting.py's docstring)."""
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
                                 if a.phase in update_phases and any(c in a.where for c in LOGPROB_CODE))
    out["activations"] = max(0, update_peak - update_start - out["gradients"] - out["logprob_scratch"])
    # the simulated peak holds no weights: the model's are added to it (`other` is 0 until here)
    out["other"] = max(0, out["base_weights"] + out["trainable"] + report.peak
                       - step_peak(out, parked=extra.get("optimizer_parked", False)))  # (grpo_nb.parking)
    return out


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
