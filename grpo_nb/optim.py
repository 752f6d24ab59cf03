"""The optimizer, its learning-rate schedule and the fp16 loss scaler a run trains with."""

from __future__ import annotations

import math

import torch

from . import parking
from .config import GRPOConfig


def build_optimizer(model, config: GRPOConfig):
    """AdamW over the trainable parameters, and the learning-rate schedule: (optimizer, scheduler, params). Its state
    waits in host memory between optimizer steps where `config.park_optimizer_state` says (grpo_nb.parking)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        # e.g. load_for_inference's model: an adapter loaded for use, which a finished run's output_dir holds
        inference = (" Its adapter was loaded for inference (load_for_inference, or peft's from_pretrained without "
                     "is_trainable=True): to train it further, as a new run from its weights, load it with "
                     "peft.PeftModel.from_pretrained(<its base model>, <the adapter's folder>, is_trainable=True)."
                     if getattr(model, "peft_config", None) else "")
        raise ValueError(f"The model has no trainable parameters.{inference} For a fresh adapter, load the model with "
                         f"setup_reasoning_model(lora_rank=...).")
    optimizer = adamw(params, config)
    parked = parking.parking_for(optimizer, config.park_optimizer_state, params[0].device, config.optim)
    parking.attach(optimizer, parked)
    warmup = warmup_steps(config.warmup_ratio, config.max_steps)

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, config.max_steps - warmup)
        if config.lr_scheduler_type == "linear":
            return 1.0 - progress
        if config.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor), params


def warmup_steps(warmup_ratio: float, max_steps: int) -> int:
    """The steps the learning rate warms up over: transformers' count, ceil(ratio x steps), with float noise rounded
    off first: a TRL warmup_steps=15 over 22 steps, read as the ratio 15/22, gives 14.999999999999998, which is 15
    steps (int() made it 14)."""
    return math.ceil(round(warmup_ratio * max_steps, 6))


def follow_schedule(optimizer, scheduler, learning_rate: float) -> None:
    """After a resume, the learning rate this run's schedule gives at the restored step: a run resumed
    with a higher max_steps or another learning_rate follows them, rather than the old run's ending
    schedule (whose last lr is 0 for "linear"). Unchanged settings give the restored values exactly."""
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = learning_rate * factor(scheduler.last_epoch)
    scheduler.load_state_dict({**scheduler.state_dict(), "_last_lr": [g["lr"] for g in optimizer.param_groups]})


def adamw(params, config: GRPOConfig):
    """The AdamW that config.optim names: torch's, or bitsandbytes' 8-bit / paged one."""
    settings = dict(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                    weight_decay=config.weight_decay)
    if config.optim in ("adamw_torch", "adamw_torch_fused"):  # fused: one kernel for all parameters (TRL's default)
        return torch.optim.AdamW(params, fused=config.optim == "adamw_torch_fused" or None, **settings)
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ImportError(f"optim={config.optim!r} needs bitsandbytes: pip install bitsandbytes (or use "
                          f"optim='adamw_torch').") from err
    # Paging lets the states move to CPU RAM when the GPU runs short; with the parameters on the CPU there
    # is nothing to page, and bitsandbytes would warn and fall back to the same unpaged optimizer.
    paged = config.optim.startswith("paged_") and params[0].device.type == "cuda"
    if "8bit" in config.optim:
        return (bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit)(params, **settings)
    return bnb.optim.PagedAdamW32bit(params, **settings) if paged else bnb.optim.AdamW32bit(params, **settings)


def build_grad_scaler(model, device):
    """Loss scaling for fp16 weights (T4-class GPUs); bf16 and fp32 need none."""
    if any(p.dtype == torch.float16 for p in model.parameters()):
        return torch.amp.GradScaler(device.type, init_scale=2.0**12)
    return None
