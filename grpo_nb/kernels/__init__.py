"""Optional Triton kernels.

Nothing here is imported by `grpo_nb` at import time: `grpo_nb.logprobs` loads
`grpo_nb.kernels.logprobs_triton` on first use, so the package works without triton and
`TRITON_INTERPRET=1` (the CPU interpreter) may be set any time before that first use.
"""

# Where a kernel called on the meta device reports its work (a Triton launch runs nothing there): set by
# grpo_nb.simulate.device - (name, FLOPs, bytes, dtype, *the tensors it writes) to the time simulation's op record
# and the simulated device, which forgets any values it knew for them. None when no simulation is loaded.
meta_launch = None
