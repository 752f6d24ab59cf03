"""The real training step at full size on PyTorch's meta device, every allocation counted.

    from grpo_nb.simulate import simulate_step
    step = simulate_step("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=True, max_completion_length=1024)
    print(step.table(), step.timeline())

`tracker.py` counts allocations (a C++ allocator registered for the meta device), `device.py`
makes the meta device behave like a GPU and answers the value questions code asks,
`step.py` runs grpo-nb's step and `trl_step.py` TRL's GRPOTrainer path for the same batch, both on what
`build.py` builds. The longest completion a card fits, simulated, is `grpo_nb.planning.simulated_longest_completion`.
"""

from .device import OracleError, SimulatedDevice
from .build import SimulatedStep, forced_batch, meta_model
from .step import run_step, simulate_step
from .tracker import AllocationTracker, TrackerReport

__all__ = ["AllocationTracker", "OracleError", "SimulatedDevice", "SimulatedStep", "TrackerReport", "forced_batch",
           "meta_model", "run_step", "simulate_step"]
