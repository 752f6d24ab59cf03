"""Optional Triton kernels.

Nothing here is imported by `grpo_nb` at import time: `grpo_nb.logprobs` loads
`grpo_nb.kernels.logprobs_triton` on first use, so the package works without triton and
`TRITON_INTERPRET=1` (the CPU interpreter) may be set any time before that first use.
"""
