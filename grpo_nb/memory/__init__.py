"""Where the memory goes, by category: counted (`accounting`), measured during training (`tracker`) and estimated
before it (`estimate`). Planning for a card on top of these is `grpo_nb.planning`."""

from .accounting import (CATEGORIES, GiB, current_memory_bytes, gradient_bytes, kv_cache_bytes, logprob_scratch_bytes,
                         model_bytes, optimizer_bytes, peak_memory_bytes, reset_peak_memory, sampling_bytes, step_peak)
from .estimate import (MemoryEstimate, build_on_meta, check_episode, check_planned_context, check_planner_arguments,
                       context_window, estimate_vram, optimizer_state_bytes, planner_config, resolve_config)
from .tracker import MemoryTracker

__all__ = ["CATEGORIES", "GiB", "MemoryEstimate", "MemoryTracker", "build_on_meta", "check_episode",
           "check_planned_context", "check_planner_arguments", "context_window", "current_memory_bytes",
           "estimate_vram", "gradient_bytes", "kv_cache_bytes", "logprob_scratch_bytes", "model_bytes",
           "optimizer_bytes", "optimizer_state_bytes", "peak_memory_bytes", "planner_config", "reset_peak_memory",
           "resolve_config", "sampling_bytes", "step_peak"]
