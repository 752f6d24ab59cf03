"""Memory measured during training, by category (`memory.accounting`): `train()` calls the phase methods around
the rollout and the update, and each step's record carries `breakdown()`.

On CUDA the allocator's peaks per phase; on the CPU (Linux) the process's peak resident set size per phase (VmHWM,
reset through /proc/self/clear_refs). Weights, adapters, optimizer states and gradients are counted from the tensors
themselves; the KV cache and the log-prob scratch from their shapes; activations are what the update phase's peak
holds above its starting level beyond gradients and scratch, up to the end of the last backward (`end_backward`:
a parked optimizer state comes back for the optimizer step after it, grpo_nb.parking).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .. import lora, parking
from ..attachments import attachments, base_model, text_config
from .accounting import (CATEGORIES, current_memory_bytes, kv_cache_bytes, model_bytes, optimizer_bytes,
                         peak_memory_bytes, reset_peak_memory, sampling_bytes, step_peak)

# --------------------------------------------------------------------------------------
# Measurement during training


@dataclass
class MemoryTracker:
    """Per-step memory by category; `train()` calls the phase methods, records carry `breakdown()`."""

    model: object
    optimizer: object
    device: torch.device
    _phase: dict = field(default_factory=dict)
    # the highest peak of the held-out evaluations (train(eval_dataset=...)) since a step's record last took it
    evaluation_peak: int = 0
    # False once the OS kept the process's lifetime peak on the CPU (memory.reset_peak_memory): peaks are upper bounds
    peaks_reset: bool = True

    def _reset_peak(self) -> None:
        self.peaks_reset = reset_peak_memory(self.device) and self.peaks_reset

    def start_rollout(self) -> None:
        self._phase = {}
        lora.last_merged_bytes = 0  # set by this rollout if it merges the adapters (the CPU: grpo_nb.lora)
        self._reset_peak()

    def end_rollout(self, batch_size: int, seq_len: int) -> None:
        cfg = text_config(self.model)
        # The cache is in the compute dtype, which the (never quantised) output head carries.
        base = base_model(self.model)
        dtype_bytes = base.get_output_embeddings().weight.element_size()
        self._phase["rollout_peak"] = peak_memory_bytes(self.device)
        # (on the CPU the rollout's merged LoRA weights with it: rollout-only copies, gone when it ends)
        self._phase["kv_cache"] = (kv_cache_bytes(cfg, batch_size, seq_len, dtype_bytes)
                                   + sampling_bytes(cfg.vocab_size, batch_size) + lora.last_merged_bytes)

    def start_update(self) -> None:
        offloader = attachments(self.model).offloader
        if offloader is not None:
            offloader.reset_stats()  # its peak is then this update's
        self._phase["update_start"] = current_memory_bytes(self.device)
        self._reset_peak()

    def end_backward(self) -> None:
        """The policy update's backward is done; the optimizer step comes next."""
        self._phase["backward_peak"] = peak_memory_bytes(self.device)

    def end_update(self, *, gradients: int, logprob_scratch: int) -> None:
        self._phase["update_peak"] = peak_memory_bytes(self.device)
        self._phase["gradients"] = gradients
        self._phase["logprob_scratch"] = logprob_scratch

    @contextmanager
    def measure_evaluation(self):
        """Around a held-out evaluation (outside the rollout and the update): its peak into `evaluation_peak`. A
        step's record takes it as record["memory"]["evaluation_peak"] (take_evaluation_peak): the evaluation after
        the step, or eval_on_start's before step 1 - the run's highest peak, with a wide per_device_eval_batch_size."""
        self._reset_peak()
        yield
        self.evaluation_peak = max(self.evaluation_peak, peak_memory_bytes(self.device))

    def take_evaluation_peak(self, memory: dict) -> None:
        """`memory` (a step's record["memory"]) gets "evaluation_peak" when an evaluation ran since the last step."""
        if self.evaluation_peak:
            memory["evaluation_peak"], self.evaluation_peak = self.evaluation_peak, 0

    def breakdown(self) -> dict:
        ph = self._phase
        out = dict.fromkeys(CATEGORIES, 0)
        out.update(model_bytes(self.model))
        out["optimizer"] = optimizer_bytes(self.optimizer)
        out["gradients"] = ph.get("gradients", 0)
        out["logprob_scratch"] = ph.get("logprob_scratch", 0)
        out["kv_cache"] = ph.get("kv_cache", 0)
        # a parked state is on the device in the optimizer step only (memory.step_peak counts it there)
        holder = parking.of(self.optimizer)
        out["optimizer_parked"] = holder is not None and holder.parked
        update_peak = ph.get("update_peak", 0)
        rise = max(0, ph.get("backward_peak", update_peak) - ph.get("update_start", update_peak))
        out["activations"] = max(0, rise - out["gradients"] - out["logprob_scratch"])
        peak = max(ph.get("rollout_peak", 0), update_peak)
        out["other"] = max(0, peak - step_peak(out, parked=out["optimizer_parked"]))  # `other` is 0 until here
        out["peak"] = peak
        # What stays allocated between steps (CUDA allocated / CPU resident): flat over a healthy run.
        out["current"] = current_memory_bytes(self.device)
        out["rollout_peak"] = ph.get("rollout_peak", 0)
        out["update_peak"] = update_peak
        if not self.peaks_reset:  # the peaks, and `activations` and `other` read from them, may be the run's earlier
            out["peaks_upper_bound"] = True  # highs (a sandbox without /proc/self/clear_refs): said, not hidden
        if self.device.type == "cuda":
            out["reserved_peak"] = int(torch.cuda.max_memory_reserved(self.device))
        offloader = attachments(self.model).offloader
        if offloader is not None:
            out["offloaded_peak"] = int(offloader.stats()["peak_offloaded_bytes"])  # in CPU RAM, not in `peak`
        return out

