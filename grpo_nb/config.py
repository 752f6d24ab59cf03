"""GRPOConfig: every knob of a run, named as in TRL's GRPOConfig wherever the concept matches.

Defaults suit a free 15 GB T4 with a ~1.5B model in 4-bit: one prompt x 8 generations per
optimizer step, 256-token completions, LoRA-sized learning rate.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass

from .loss import ADVANTAGE_ESTIMATORS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS, check_groups

LR_SCHEDULERS = ("constant", "linear", "cosine")


@dataclass
class GRPOConfig:
    # --- output and bookkeeping
    output_dir: str = "grpo_nb_output"
    max_steps: int = 300
    logging_steps: int = 1
    save_steps: int = 100  # 0 disables intermediate checkpoints; the final adapter is always saved
    save_total_limit: int | None = 3  # resumable checkpoints kept in output_dir (newest); None keeps all
    seed: int = 42
    log_completions: bool = True
    num_completions_to_print: int = 4  # sample traces kept in each history record
    sample_history_steps: int | None = 200  # records older than this many steps drop their samples (flat memory)

    # --- batch shape: one optimizer step sees per_device_train_batch_size x
    # gradient_accumulation_steps completions = that / num_generations prompts
    num_generations: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1

    # --- generation
    max_prompt_length: int | None = 512  # longer prompts are cut from the left (with a warning)
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None  # extra generate() arguments, e.g. {"min_new_tokens": 256}
    mask_truncated_completions: bool = False  # drop completions that hit the length limit from the loss
    rollout_max_rows: int | None = None  # completions the native engine decodes at once (its KV cache's rows); None: all

    # --- the GRPO objective
    beta: float = 0.0  # KL coefficient; > 0 needs a LoRA model (the reference is the adapter switched off)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: same as epsilon; DAPO uses 0.28
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"  # "rloo": leave-one-out baseline (REINFORCE Leave-One-Out)
    importance_sampling_level: str = "token"  # "sequence": GSPO's one ratio per completion (TRL's name)
    top_entropy_quantile: float = 1.0  # < 1: policy gradient only on the highest-entropy tokens (TRL's name)
    num_iterations: int = 1  # optimizer steps per generation batch
    dynamic_sampling: bool = False  # DAPO: replace groups with all-equal rewards by freshly sampled ones
    dynamic_sampling_max_rounds: int = 4  # rollouts per step at most when dynamic_sampling refills the batch
    reward_weights: list[float] | None = None
    reward_timeout: float | None = None  # seconds a reward function may take per batch; None: no limit
    use_bias_correction_kl: bool = False  # TRL defaults to True; see grpo_loss

    # --- optimisation
    learning_rate: float = 5e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_nonfinite_steps: int = 5  # this many skipped (NaN/inf) steps in a row stop the run
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    logprob_chunk_size: int | None = None  # rows per chunk in selective_logprobs; None picks by vocab size
    logprob_backend: str = "auto"  # "triton" kernels on CUDA (after a self-test), else "torch"

    # --- several processes (torchrun / accelerate launch); no effect in one process
    fsdp: bool = False  # shard the decoder layers' weights over ranks (FSDP2) instead of a full copy on each

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # TRL's older boolean form
            self.scale_rewards = "group" if self.scale_rewards else "none"
        self.validate()

    @property
    def completions_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def prompts_per_step(self) -> int:
        return self.completions_per_step // self.num_generations

    def validate(self) -> None:
        """Raise ValueError naming the field, the bad value and what is allowed."""

        def bad(name, allowed):
            raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r} is invalid: {allowed}")

        def need_int(name, low):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                bad(name, f"expected an integer >= {low}")

        def need_num(name, low=None, high=None, low_open=False, optional=False):
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "expected a finite number")
            if low is not None and (v <= low if low_open else v < low):
                bad(name, f"expected a number {'>' if low_open else '>='} {low}" + (f" and <= {high}" if high else ""))
            if high is not None and v > high:
                bad(name, f"expected a number <= {high}")

        check_groups(self.num_generations, 0, minimum=2)
        for name, low in [("max_steps", 1), ("logging_steps", 1), ("save_steps", 0),
                          ("per_device_train_batch_size", 1), ("gradient_accumulation_steps", 1),
                          ("max_completion_length", 1), ("top_k", 0), ("num_iterations", 1),
                          ("num_completions_to_print", 0), ("max_nonfinite_steps", 1),
                          ("dynamic_sampling_max_rounds", 1)]:
            need_int(name, low)
        for name in ("dynamic_sampling", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "expected True or False")
        need_int("seed", 0)  # numpy's generators take no negative seeds
        if self.save_total_limit is not None:
            need_int("save_total_limit", 1)
        if self.sample_history_steps is not None:
            need_int("sample_history_steps", 1)
        if self.max_prompt_length is not None:
            need_int("max_prompt_length", 1)
        if self.rollout_max_rows is not None:
            need_int("rollout_max_rows", 1)
        need_num("temperature", 0, low_open=True)
        need_num("top_p", 0, 1, low_open=True)
        need_num("min_p", 0, 1, optional=True)
        need_num("repetition_penalty", 0, low_open=True)
        need_num("beta", 0)
        need_num("epsilon", 0, low_open=True)
        need_num("epsilon_high", 0, low_open=True, optional=True)
        need_num("learning_rate", 0)
        need_num("adam_beta1", 0, 1)
        need_num("adam_beta2", 0, 1)
        need_num("weight_decay", 0)
        need_num("max_grad_norm", 0, low_open=True)
        need_num("reward_timeout", 0, low_open=True, optional=True)
        need_num("warmup_ratio", 0, 1)
        need_num("top_entropy_quantile", 0, 1, low_open=True)
        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", f"allowed: {', '.join(LOSS_TYPES)}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            bad("advantage_estimator", f"allowed: {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            bad("importance_sampling_level", f"allowed: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
        if self.importance_sampling_level == "sequence" and self.loss_type != "grpo":
            warnings.warn(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} sums per-token terms, so "
                f"each completion weighs by its length instead of GSPO's per-sequence objective; GSPO's paper "
                f"uses loss_type='grpo'.", stacklevel=3)
        if self.scale_rewards not in SCALE_REWARDS:
            bad("scale_rewards", f"allowed: {', '.join(SCALE_REWARDS)} (or True/False)")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            bad("lr_scheduler_type", f"allowed: {', '.join(LR_SCHEDULERS)}")
        if self.logprob_chunk_size is not None:
            need_int("logprob_chunk_size", 1)
        if self.logprob_backend not in ("auto", "torch", "triton"):
            bad("logprob_backend", "allowed: auto, torch, triton")
        if self.generation_kwargs is not None:
            if not isinstance(self.generation_kwargs, dict):
                bad("generation_kwargs", "expected a dict of generate() arguments, e.g. {'min_new_tokens': 64}")
            owned = {"max_new_tokens", "input_ids", "attention_mask", "num_return_sequences"} & set(self.generation_kwargs)
            if owned:
                bad("generation_kwargs", f"{sorted(owned)} are set by grpo-nb; use max_completion_length / "
                                         "num_generations instead")
        if self.reward_weights is not None:
            if not isinstance(self.reward_weights, (list, tuple)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in self.reward_weights
            ):
                bad("reward_weights", "expected a list of finite numbers, one per reward function")
            self.reward_weights = [float(w) for w in self.reward_weights]
        check_groups(self.num_generations, self.completions_per_step, minimum=2,
                     total_is=f"per_device_train_batch_size x gradient_accumulation_steps = "
                              f"{self.per_device_train_batch_size} x {self.gradient_accumulation_steps}",
                     fix=f"Use a multiple of {self.num_generations}, e.g. "
                         f"per_device_train_batch_size={self.num_generations}.")

    def replace(self, **overrides) -> "GRPOConfig":
        """A copy with some fields changed; an unknown name is an error that suggests the closest field."""
        names = [f.name for f in dataclasses.fields(self)]
        for key in overrides:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=3)
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                raise ValueError(f"GRPOConfig has no field {key!r}.{hint}")
        return dataclasses.replace(self, **overrides)
