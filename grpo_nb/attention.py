"""Which kernel CUDA's scaled_dot_product_attention runs, and grouped keys kept off the math kernel.

PyTorch runs the first kernel whose constraints a call meets (aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp, torch 2.11-2.13):

* flash attention: compute capability 8.0 to 12.1, fp16 or bf16, head_dim <= 256, no mask; takes grouped
  keys (fewer key/value heads than query heads, `enable_gqa=True`) as they are;
* memory-efficient attention: compute capability 5.0 and up, fp16 or fp32 (bf16 too from 8.0), head_dim a
  multiple of 8 (fp16/bf16) or 4 (fp32), any additive mask; no grouped keys;
* the math kernel: anything, holding the [batch, heads, queries, keys] scores in fp32 (its inputs are upcast):
  memory quadratic in the length.

transformers asks for grouped keys (`enable_gqa=True`) whenever a call has no mask (`use_gqa_in_sdpa` does
not look at the card: transformers issue 48633). On a T4 (sm75, no flash) - or in fp32 on any card - every
unpadded forward of a model with grouped keys (Llama 3, Qwen 2.5, Mistral...), such as the prefill of equal
prompts or an update whose completions all reach max_completion_length, then falls to the math kernel: at 8 x
1280 tokens a Qwen2.5-1.5B layer's scores alone take 0.6 GB, at 57,344 tokens nothing fits. `gqa_safe_sdpa`,
registered with transformers' AttentionInterface as "grpo_nb_sdpa" and set on a model by
`use_gqa_safe_sdpa`, repeats the keys itself in that case (as transformers does when there is a mask), so the
memory-efficient kernel takes the call; everywhere else it is transformers' own sdpa_attention_forward.

The memory simulation (grpo_nb.simulate) routes its meta-device calls with the same `cuda_sdpa_kernel` rule for
the card it stands for, so what it counts is what this code makes the card run.
"""

from __future__ import annotations

import contextvars
import functools
import inspect

import torch

NAME = "grpo_nb_sdpa"
FLASH, EFFICIENT, MATH = "flash", "efficient", "math"

# The card a meta-device simulation stands for (its compute capability), set by grpo_nb.simulate while it runs:
# meta tensors have no card to ask.
simulated_capability: contextvars.ContextVar = contextvars.ContextVar("grpo_nb_simulated_capability", default=None)


def cuda_sdpa_kernel(capability: tuple, dtype: torch.dtype, head_dim: int, *, mask: bool, grouped: bool,
                     training: bool = True) -> str:
    """The kernel CUDA's SDPA picks on a card of `capability` for a call of these properties (`training`: inputs
    that require grad; FlashAttention trains no head_dim in (192, 224] on sm86, sm89 and sm12x)."""
    low = dtype in (torch.float16, torch.bfloat16)
    capability = tuple(capability)
    no_flash_backward = training and 192 < head_dim <= 224 and ((8, 6) <= capability <= (8, 9) or capability[0] == 12)
    if (8, 0) <= capability <= (12, 1) and low and head_dim <= 256 and not mask and not no_flash_backward:
        return FLASH
    efficient_dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability >= (8, 0) else ())
    if capability >= (5, 0) and dtype in efficient_dtypes and head_dim % (8 if low else 4) == 0 and not grouped:
        return EFFICIENT
    return MATH


def _capability(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    if device.type == "meta":
        return simulated_capability.get()
    return None  # the CPU's kernels take grouped keys in every path


@functools.cache
def _use_gqa_in_sdpa():
    """transformers' own rule and how many arguments it takes (they differ across transformers versions)."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    return use_gqa_in_sdpa, len(inspect.signature(use_gqa_in_sdpa).parameters)


def _transformers_groups_keys(attention_mask, key, value) -> bool:
    """Whether transformers' sdpa attention passes these keys grouped (`enable_gqa=True`) rather than repeating
    them itself (`use_gqa_in_sdpa`)."""
    rule, arity = _use_gqa_in_sdpa()
    return bool(rule(*(attention_mask, key, value)[:arity]))


def repeats_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask) -> bool:
    """Whether `gqa_safe_sdpa` repeats the keys: transformers would pass them grouped (no mask, head_dim <= 256),
    and the card's fused kernels would leave that call to the math kernel although the memory-efficient one takes
    it once the keys are repeated."""
    if attention_mask is not None or key.shape[1] == query.shape[1] or query.shape[2] == 1:
        return False
    if not _transformers_groups_keys(attention_mask, key, value):
        return False  # transformers repeats them itself
    capability = _capability(query.device)
    if capability is None:
        return False
    training = query.requires_grad or key.requires_grad
    kernel = lambda grouped: cuda_sdpa_kernel(capability, query.dtype, query.shape[-1], mask=False,  # noqa: E731
                                              grouped=grouped, training=training)
    return kernel(True) == MATH and kernel(False) == EFFICIENT


def gqa_safe_sdpa(module, query, key, value, attention_mask, shared_prefix=None, **kwargs):
    """transformers' sdpa attention, with grouped keys repeated where only that keeps them off the math kernel.
    `shared_prefix`: the policy update's packed rows of a prompt and its completions (grpo_nb.prefix_sharing),
    attended in their two parts by this same function."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if shared_prefix is not None:
        return shared_prefix.attend(query, key, value, lambda q, k, v, mask: gqa_safe_sdpa(
            module, q, k, v, mask, **{**kwargs, "is_causal": False}))
    if repeats_keys(query, key, value, attention_mask):
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # equal heads: enable_gqa changes nothing
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_gqa_safe_sdpa(model) -> bool:
    """Run `model`'s sdpa attention through `gqa_safe_sdpa` (registered with transformers under NAME). Models
    with another attention implementation (eager, flash_attention_2, ...) are left as they are. Returns whether
    the model now uses it."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return False  # its attention does not go through the AttentionInterface (e.g. Falcon): left as it is
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_safe_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as sdpa
    model.set_attn_implementation(NAME)
    return getattr(model.config, "_attn_implementation", None) == NAME
