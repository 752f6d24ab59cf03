"""What a CUDA GPU computes natively, decided by its compute capability.

One question is asked in several places (the dtype `setup_reasoning_model` picks, the warning
for an explicit bfloat16, the Triton log-prob kernels, the planner's GPU catalogue): does this
GPU do bfloat16 natively? `torch.cuda.is_bf16_supported()` is not the answer: it counts
emulation by default and says True on a T4 (sm75), where bf16 runs without tensor cores and
PyTorch's attention falls back to its math kernel (memory quadratic in the length). Native
bf16 (tensor cores, FlashAttention) starts with Ampere, compute capability 8.0.
"""

from __future__ import annotations

import torch

# The dtypes a model is set up, planned or saved in, by the names every dtype= argument takes.
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}
SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # the planner's dtype names

NATIVE_BF16_CAPABILITY = (8, 0)  # Ampere: A100 (8.0), A10 / RTX 30xx (8.6), L4 / RTX 40xx (8.9), H100 (9.0)


def native_bf16(gpu) -> bool:
    """Whether a CUDA GPU computes bfloat16 natively (compute capability 8.0 or newer).

    `gpu`: a CUDA device (`torch.device`, "cuda", "cuda:1" or an index), or its compute
    capability as a (major, minor) tuple, e.g. (7, 5) for a T4.
    """
    if isinstance(gpu, tuple):
        capability = gpu
    else:
        device = torch.device(gpu) if not isinstance(gpu, int) else torch.device("cuda", gpu)
        capability = torch.cuda.get_device_capability(device)
    return tuple(capability) >= NATIVE_BF16_CAPABILITY


# Model types whose activations pass float16's range (65504): inf/NaN logits within the first steps. Their
# model cards (Google's, transformers') say bfloat16 or float32.
FP16_OVERFLOWS = ("gemma2", "gemma3", "gemma3_text")


def training_dtype(gpu, *, full_fine_tuning: bool = False, model_type: str | None = None) -> torch.dtype:
    """The dtype a model trains in on a CUDA GPU (`gpu` as `native_bf16` takes it): bfloat16 where it is
    native; before Ampere float16 under LoRA (the adapters train in float32 over the float16 weights),
    and float32 for full fine-tuning, since float16 weights cannot hold the small updates (train()
    refuses to train them), or for a `model_type` that overflows float16 (FP16_OVERFLOWS)."""
    if native_bf16(gpu):
        return torch.bfloat16
    return torch.float32 if full_fine_tuning or model_type in FP16_OVERFLOWS else torch.float16


def gpu_description(device) -> str:
    """'Tesla T4 (compute capability 7.5)': how messages name a CUDA device."""
    device = torch.device(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
