"""GRPOConfig: every knob of a run, named as in TRL's GRPOConfig wherever the concept matches.

Defaults suit a free 15 GB T4 with a ~1.5B model in 4-bit: one prompt x 8 generations per
optimizer step, 256-token completions, LoRA-sized learning rate.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import threading
import warnings
from dataclasses import dataclass

from .arguments import SEED_LIMIT, need_int, need_number, plain, refuse
from .logprobs import LOGPROB_BACKENDS
from .loss import (ADVANTAGE_ESTIMATORS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, ROLLOUT_CORRECTION_MODES,
                   SCALE_REWARDS, check_groups)
from .reward_calls import MULTI_OBJECTIVE_AGGREGATIONS
from .tracking import path_problem, project_problem, report_to_problem

LR_SCHEDULERS = ("constant", "linear", "cosine")
# transformers' names; the 8-bit ones keep AdamW's two moments in 8 bits (bitsandbytes): ~2 bytes per
# trainable parameter instead of 8. "adamw_bnb_8bit" is transformers' other name for "adamw_8bit".
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit",
              "paged_adamw_32bit")
# TRL's names for options grpo-nb names for what they do here; `replace` (so train(**overrides)) accepts both.
# The correction applies to any rollout engine that returns log-probs, not only vLLM.
TRL_RENAMES = {
    "vllm_importance_sampling_correction": "rollout_importance_sampling_correction",
    "vllm_importance_sampling_mode": "rollout_importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "rollout_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min": "rollout_importance_sampling_clip_min",
}  # (TRL's deprecated vllm_importance_sampling_cap: TRL itself copies it into vllm_importance_sampling_clip_max)
# TRL fields that grpo-nb decides elsewhere: from a trl.GRPOConfig they are ignored with a warning that says
# where (trl_config.from_trl_config); as keywords (train(bf16=True)) the same sentence says why there is no field.
DECIDED_ELSEWHERE = {
    "bf16": "the model's dtype decides (setup_reasoning_model picks bf16 on GPUs that compute it natively, "
            "compute capability 8.0+, and fp16 on a T4 or V100)",
    "fp16": "the model's dtype decides (fp16 weights get loss scaling)",
    "tf32": "the model's dtype decides",
    "use_cpu": "the model's device decides",
    "gradient_checkpointing": "setup_reasoning_model(gradient_checkpointing=...) decides",
    "activation_checkpointing": "setup_reasoning_model(gradient_checkpointing=...) decides",
    "gradient_checkpointing_kwargs": "setup_reasoning_model(gradient_checkpointing=...) decides",
    "disable_tqdm": "train(verbose=...) and the dashboard show progress",
    "logging_first_step": "every step is recorded",
    "log_level": "grpo-nb does not use the Trainer's logger",
    "dataloader_num_workers": "prompts are read without a DataLoader",
    "dataloader_pin_memory": "prompts are read without a DataLoader",
    "dataloader_persistent_workers": "prompts are read without a DataLoader",
    "remove_unused_columns": "every dataset column already goes to the reward functions",
    "num_train_epochs": "max_steps is set (TRL ignores num_train_epochs then too)",
}
# generate() sampling knobs that are GRPOConfig fields: the loss computes the policy's log-probs with the
# config's values, so sampling with others (through generation_kwargs) would train on another distribution.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# apply_chat_template() arguments grpo-nb sets itself where it renders prompts: not chat_template_kwargs'
TEMPLATE_OWNED = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message", "tools", "return_dict",
                  "return_tensors", "return_assistant_tokens_mask")
# generate() arguments that take objects rather than settings: passed on as given (the others must be values
# grpo_config.json can hold).
GENERATE_OBJECTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "streamer", "assistant_model",
                    "custom_generate", "negative_prompt_ids", "negative_prompt_attention_mask")


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
    report_to: str | list[str] | None = "none"  # "tensorboard", "wandb", "trackio", a list, "all" (installed), "none"
    run_name: str | None = None  # the run's name in W&B / Trackio / TensorBoard's folder; None: a time stamp
    project: str | None = None  # W&B / Trackio project; None: $WANDB_PROJECT for W&B, else "grpo-nb"
    logging_dir: str | None = None  # TensorBoard's event files go in <logging_dir>/<run>; None: output_dir/runs/<run>
    log_completions_path: str | None = None  # a .jsonl file: each logged completion, one JSON object per line

    # --- held-out evaluation during training: train(..., eval_dataset=heldout) (TRL's names). Greedy completions of
    # the eval set, judged and scored as evaluate() does (accuracies with intervals, format, length, rewards), go into
    # the record of each step that evaluated, as record["eval"]. The eval set is used whole: pass a small one.
    eval_strategy: str | None = None  # "steps": every eval_steps and at the last step; "no": never; None: "steps"
    # when eval_steps is set, else "no" ("epoch" has no counterpart: runs count steps)
    eval_steps: int | None = None  # steps between two evaluations; None with eval_strategy="steps": logging_steps
    per_device_eval_batch_size: int = 8  # eval prompts generated at once (one greedy completion each)
    eval_on_start: bool = False  # also evaluate before the first step (the baseline): step 1's record["eval_start"]

    # --- batch shape: one optimizer step sees per_device_train_batch_size x
    # gradient_accumulation_steps completions = that / num_generations prompts
    num_generations: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1

    # --- generation
    # longer prompts are cut from the left (with a warning); None: what the model's context (setup's
    # max_seq_length) leaves after max_completion_length
    max_prompt_length: int | None = None
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None  # extra generate() arguments, e.g. {"min_new_tokens": 256}
    # extra apply_chat_template() arguments wherever prompts are rendered, e.g. {"enable_thinking": False} for Qwen3
    # (TRL's name; a JSON string is read as TRL reads it)
    chat_template_kwargs: dict | None = None
    mask_truncated_completions: bool = False  # drop completions that hit the length limit from the loss
    rollout_max_rows: int | None = None  # completions the native engine decodes at once (its KV cache's rows); None: all
    # "bfloat16": a CPU rollout's merged weights in bf16 (half the bytes a decode step reads; AVX512-BF16 / AMX
    # products), the update's stay the model's own; pair with rollout_importance_sampling_correction. None: the model's.
    # "auto": bf16 with the correction where it pays (an fp32 model of 64 MB+ on a CPU with native bf16, grpo-nb's
    # engine), else None - decided when train() starts (grpo_nb.rollout.rollout_precision)
    cpu_rollout_dtype: str | None = "auto"

    # --- the GRPO objective
    beta: float = 0.0  # KL coefficient; > 0 needs a LoRA model (the reference is the adapter switched off)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: same as epsilon; DAPO uses 0.28
    # two-sided clipping (TRL's name; INTELLECT-2 uses 4): the clipped loss's unclipped ratio term capped at delta, so
    # a negative-advantage token far off-policy cannot push with its whole ratio; None: no cap. TRL: > 1 + epsilon_high
    delta: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"  # "rloo": leave-one-out baseline (REINFORCE Leave-One-Out)
    importance_sampling_level: str = "token"  # "sequence": GSPO's one ratio per completion (TRL's name)
    top_entropy_quantile: float = 1.0  # < 1: policy gradient only on the highest-entropy tokens (TRL's name)
    num_iterations: int = 1  # optimizer steps per generation batch
    dynamic_sampling: bool = False  # DAPO: replace groups with all-equal rewards by freshly sampled ones
    dynamic_sampling_max_rounds: int = 4  # rollouts per step at most when dynamic_sampling refills the batch
    reward_weights: list[float] | None = None
    # several reward functions: "sum_then_normalize" weighs and sums the rewards, then takes the advantage against
    # the group; "normalize_then_sum" (GDPO) normalizes each function's rewards in its group first (TRL's name)
    multi_objective_aggregation: str = "sum_then_normalize"
    reward_timeout: float | None = None  # seconds a reward function may take per batch; None: no limit
    use_bias_correction_kl: bool = False  # TRL defaults to True; see grpo_loss
    sapo_temperature_pos: float = 1.0  # loss_type="sapo": gate temperature where the advantage is > 0 (TRL's name)
    sapo_temperature_neg: float = 1.05  # ... where it is <= 0
    # loss_type="vespo": the gamma weight's exponent k and decay lambda where the advantage is >= 0 / < 0 (TRL's names)
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # drop negative-advantage completions whose mean per-token KL to the sampling policy is above it (DeepSeek-V3.2's
    # off-policy sequence mask; TRL's name); None: off
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0  # loss -= entropy_coef x mean token entropy (TRL's name); the start value when adaptive
    # Skywork-OR1's adaptive entropy control (TRL's names): after each step entropy_coef moves by entropy_coef_delta,
    # up while the entropy is <= entropy_target, down otherwise, within [entropy_coef_min, entropy_coef_max]; it
    # applies only while the entropy is <= entropy_target. Its state is in each step's record (entropy_coef, entropy_window)
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    # Weight each token's policy gradient by p_trainer / p_rollout when the rollout engine's log-probs differ
    # from the trainer's (vLLM, a half-precision engine): TRL's vllm_importance_sampling_*, for any engine
    # that returns its sampling log-probs (the native engine, vLLM); see loss.rollout_importance_weights.
    # None: on where cpu_rollout_dtype="auto" picks bf16, else off (TRL: True, but only with vLLM)
    rollout_importance_sampling_correction: bool | None = None
    # token_/sequence_ x truncate/mask. None: "token_truncate" for bf16 CPU rollout copies (their rounding differs
    # from the trainer's a little on every token - ~0.007 nats on the embedded default -, which a sequence-level
    # weight compounds over a completion: ~0.6 at 64 tokens, ~0.15 at 256), else TRL's "sequence_mask"
    rollout_importance_sampling_mode: str | None = None
    rollout_importance_sampling_clip_max: float | None = 3.0  # ratios above: clipped (truncate) or zeroed (mask)
    rollout_importance_sampling_clip_min: float | None = None  # ratios below; None: no lower bound

    # --- tools and environments: train(..., tools=[...], environment_factory=...) (TRL's names)
    max_tool_calling_iterations: int | None = None  # rounds of tool calls per episode; None: until the token budget
    tool_timeout: float | None = 30.0  # seconds a tool call may take; past it the model reads an error (None: wait)

    # --- optimisation
    learning_rate: float = 5e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_nonfinite_steps: int = 5  # this many skipped (NaN/inf) steps in a row stop the run
    max_unscored_steps: int = 5  # this many steps in a row in which no reward function scored any completion stop it
    lr_scheduler_type: str = "linear"
    optim: str = "adamw_torch"  # one of OPTIMIZERS; "paged_adamw_8bit" is what Unsloth's T4 notebooks use
    warmup_ratio: float = 0.0
    logprob_chunk_size: int | None = None  # rows per chunk in selective_logprobs; None picks by vocab size
    logprob_backend: str = "auto"  # "triton" kernels on CUDA (after a self-test), else "torch"
    # the update forwards a prompt once for the completions of its group in a micro-batch, not once per completion
    # (grpo_nb.prefix_sharing; equal log-probs and gradients, fewer tokens forwarded)
    prefix_sharing: bool = True
    # the optimizer's state waits in (pinned) host memory from one optimizer step to the next, off the device through
    # the rollout and the policy update (grpo_nb.parking; the same results). "auto": on CUDA, unless the optimizer is
    # paged (the driver moves its state already) or the state would take over half the host memory available
    park_optimizer_state: bool | str = "auto"

    # --- several processes (torchrun / accelerate launch); no effect in one process
    fsdp: bool = False  # shard the decoder layers' weights over ranks (FSDP2) instead of a full copy on each

    def __new__(cls, *args, **kwargs):
        check_names(cls, kwargs)  # GRPOConfig(bf16=True) says what a TRL user needs to know, not a bare TypeError
        return super().__new__(cls)

    def __post_init__(self):
        validate(self)

    @property
    def completions_per_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def prompts_per_step(self) -> int:
        return self.completions_per_step // self.num_generations

    @property
    def eval_interval(self) -> int | None:
        """Steps between two held-out evaluations during training (eval_strategy, eval_steps; transformers' rule:
        eval_steps None is logging_steps), or None when the run evaluates at no interval (eval_on_start aside)."""
        strategy = self.eval_strategy or ("steps" if self.eval_steps is not None else "no")
        return None if strategy == "no" else (self.eval_steps or self.logging_steps)

    def evaluates_at(self, step: int) -> bool:
        """Whether the run evaluates after optimizer step `step`: every eval_interval steps, and at the last step
        (as transformers' Trainer does with eval_strategy="steps")."""
        interval = self.eval_interval
        return interval is not None and (step % interval == 0 or step == self.max_steps)

    def fitted_to(self, context: int | None) -> "GRPOConfig":
        """max_prompt_length=None made concrete for a model whose context is `context` tokens."""
        if self.max_prompt_length is None and context and context > self.max_completion_length:
            return self.replace(max_prompt_length=context - self.max_completion_length)
        return self

    def anchored(self) -> "GRPOConfig":
        """output_dir, logging_dir and log_completions_path as absolute paths ('~' expanded), taken once when a run
        starts: a working directory changed during the run (a reward's sandbox, a callback's %cd) must not move
        where it writes, away from the folder its checks and its lock are on."""
        # realpath, as the system reads a path: 'link/../x' is beside the link's target, where the checks looked
        paths = {name: os.path.realpath(os.path.expanduser(os.fspath(getattr(self, name))))
                 for name in ("output_dir", "logging_dir", "log_completions_path") if getattr(self, name) is not None}
        return self.replace(**paths)

    def replace(self, **overrides) -> "GRPOConfig":
        """A copy with some fields changed; an unknown name is an error that suggests the closest field.
        TRL's names in TRL_RENAMES are taken for grpo-nb's."""
        for trl_name, ours in TRL_RENAMES.items():
            if trl_name in overrides:
                if ours in overrides:
                    raise ValueError(f"GRPOConfig: {trl_name}= and {ours}= set the same option (the first is TRL's "
                                     f"name for it): pass only {ours}=")
                overrides[ours] = overrides.pop(trl_name)
        check_names(type(self), overrides)
        return dataclasses.replace(self, **overrides)

    @classmethod
    def check_names(cls, settings) -> None:
        check_names(cls, settings)


# --------------------------------------------------------------------------------------
# Validation: each field against what it may be, with a message naming the field, the value and what is allowed

F = "GRPOConfig."  # how need_int / need_number (arguments.refuse) name a field: GRPOConfig.<name>=<value>
INTS = {"max_steps": 1, "logging_steps": 1, "save_steps": 0, "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1, "max_completion_length": 1, "top_k": 0, "num_iterations": 1,
        "num_completions_to_print": 0, "max_nonfinite_steps": 1, "max_unscored_steps": 1,
        "dynamic_sampling_max_rounds": 1, "per_device_eval_batch_size": 1,
        "seed": 0}  # numpy's generators take no negative seeds
OPTIONAL_INTS = {"save_total_limit": 1, "sample_history_steps": 1, "max_prompt_length": 1, "rollout_max_rows": 1,
                 "logprob_chunk_size": 1, "max_tool_calling_iterations": 0, "eval_steps": 1}
# (low, high, low_open, high_open, optional)
NUMBERS = {
    "temperature": (0, None, True, False, False), "top_p": (0, 1, True, False, False),
    "min_p": (0, 1, False, False, True), "repetition_penalty": (0, None, True, False, False),
    "beta": (0, None, False, False, False), "epsilon": (0, None, True, False, False),
    "epsilon_high": (0, None, True, False, True), "learning_rate": (0, None, False, False, False),
    # AdamW's moments decay by beta each step: 1 never forgets
    "adam_beta1": (0, 1, False, True, False), "adam_beta2": (0, 1, False, True, False),
    "weight_decay": (0, None, False, False, False), "max_grad_norm": (0, None, True, False, False),
    "reward_timeout": (0, None, True, False, True), "warmup_ratio": (0, 1, False, False, False),
    "tool_timeout": (0, None, True, False, True),
    # 0 keeps only the highest-entropy token(s), as TRL documents it ("Range: [0.0-1.0]")
    "top_entropy_quantile": (0, 1, False, False, False),
    "sapo_temperature_pos": (0, None, True, False, False), "sapo_temperature_neg": (0, None, True, False, False),  # SAPO divides by them
    # VESPO's phi(w) = e^lambda w^k e^(-lambda w); TRL raises a lambda below 1e-4 to 1e-4
    "vespo_k_pos": (0, None, False, False, False), "vespo_lambda_pos": (0, None, False, False, False),
    "vespo_k_neg": (0, None, False, False, False), "vespo_lambda_neg": (0, None, False, False, False),
    "off_policy_mask_threshold": (0, None, False, False, True),  # a mean KL per token: >= 0
    "entropy_coef": (0, None, False, False, False),  # a bonus: TRL documents it positive
    "entropy_coef_min": (0, None, False, False, False), "entropy_coef_max": (0, None, False, False, False),
    "entropy_coef_delta": (0, None, False, False, False), "entropy_target": (0, None, False, False, False),
    "rollout_importance_sampling_clip_max": (0, None, True, False, True),  # ratios are > 0
    "rollout_importance_sampling_clip_min": (0, None, False, False, True),
}
# Below this temperature sampling is greedy in practice, so a group's completions come out the same (zero
# advantages, nothing learned), as with do_sample=False. The logits are divided by it: a gap of 1/16 between the two
# likeliest tokens (bf16's spacing at the logits' usual size, 8 to 16; a smaller gap is an exact tie) becomes 62 at
# 1e-3, which makes the second token e**-62 (1e-27) times as likely. vLLM, for its part, raises any temperature below
# 1e-2 to 1e-2 and samples greedily below 1e-5.
MIN_TEMPERATURE = 1e-3
CHOICES = {"loss_type": LOSS_TYPES, "advantage_estimator": ADVANTAGE_ESTIMATORS,
           "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS, "scale_rewards": SCALE_REWARDS,
           "lr_scheduler_type": LR_SCHEDULERS, "optim": OPTIMIZERS, "logprob_backend": LOGPROB_BACKENDS,
           "rollout_importance_sampling_mode": ROLLOUT_CORRECTION_MODES,
           "multi_objective_aggregation": MULTI_OBJECTIVE_AGGREGATIONS}


def config_for(caller: str, **fields) -> GRPOConfig:
    """A GRPOConfig of `fields` for a function that takes some of its settings as arguments (play(), evaluate()):
    a refusal names the caller's argument, not the config's field."""
    try:
        return GRPOConfig(**fields)
    except ValueError as err:
        raise ValueError(str(err).replace("GRPOConfig.", f"{caller} argument ")) from None


def validate(config: GRPOConfig) -> None:
    """Raise ValueError naming the field, the bad value and what is allowed; numbers and paths stored as
    grpo_config.json holds them (numpy numbers as Python's, '~' expanded)."""
    for f in dataclasses.fields(config):  # np.int64 from np.arange or a DataFrame: stored in grpo_config.json
        setattr(config, f.name, plain(getattr(config, f.name)))
    if isinstance(config.scale_rewards, bool):  # TRL's older boolean form
        config.scale_rewards = "group" if config.scale_rewards else "none"
    check_groups(config.num_generations, 0, minimum=2)
    for name, low in INTS.items():
        need_int(F, name, getattr(config, name), low)
    if config.seed >= SEED_LIMIT:
        refuse(F, "seed", config.seed, "an integer in [0, 2**63) (torch's random generators take 64 bits, and "
               "a run adds offsets to its seed)")
    for name, low in OPTIONAL_INTS.items():
        need_int(F, name, getattr(config, name), low, optional=True)
    for f in dataclasses.fields(config):  # a YAML or command-line "False" is a str, and any str is true
        value = getattr(config, f.name)
        if f.type in ("bool", "bool | None") and not (isinstance(value, bool) or (value is None and f.type != "bool")):
            bad(f.name, value, "expected True or False" + (" or None" if f.type != "bool" else "")
                + (" (a bool, not the text)" if isinstance(value, str) else ""))
    if config.max_grad_norm is None or (isinstance(config.max_grad_norm, (int, float)) and not isinstance(
            config.max_grad_norm, bool) and config.max_grad_norm in (0, math.inf)):
        bad("max_grad_norm", config.max_grad_norm, "expected a finite number > 0: grpo-nb always clips the gradient "
            "norm. For no clipping (what 0 or None mean in transformers and TRL), pass a norm no gradient reaches, "
            "e.g. max_grad_norm=1e9")
    for name, (low, high, low_open, high_open, optional) in NUMBERS.items():
        need_number(F, name, getattr(config, name), low, high, low_open=low_open, high_open=high_open,
                    optional=optional)
    for name in ("tool_timeout", "reward_timeout"):  # waited for with Thread.join, which takes no longer wait
        if getattr(config, name) is not None and getattr(config, name) > threading.TIMEOUT_MAX:
            bad(name, getattr(config, name), f"expected at most {threading.TIMEOUT_MAX:.0f} seconds "
                f"(threading.TIMEOUT_MAX, the longest wait Python's threads take); for no limit pass None")
    check_not_greedy(config)
    for name, choices in CHOICES.items():
        if getattr(config, name) not in choices and not (name == "rollout_importance_sampling_mode"
                                                          and config.rollout_importance_sampling_mode is None):
            bad(name, getattr(config, name), f"allowed: {', '.join(choices)}"
                + (" (or True/False)" if name == "scale_rewards" else "")
                + ("; grpo-nb's 'constant' applies warmup_ratio, so use lr_scheduler_type='constant'"
                   if getattr(config, name) == "constant_with_warmup" else ""))
    if not (isinstance(config.park_optimizer_state, bool) or config.park_optimizer_state == "auto"):
        text = str(config.park_optimizer_state) in ("True", "False")
        bad("park_optimizer_state", config.park_optimizer_state, "expected True, False" + (" (a bool, not the text)"
            if text else "") + " or 'auto' (parks the optimizer's state on CUDA; not on the CPU, whose memory is "
            "the host's already)")
    check_paths(config)
    check_loss_options(config)
    check_cpu_rollout_dtype(config)
    check_eval_options(config)
    if config.generation_kwargs is not None:
        config.generation_kwargs = checked_generation_kwargs(config.generation_kwargs)
    if config.chat_template_kwargs is not None:
        config.chat_template_kwargs = checked_chat_template_kwargs(config.chat_template_kwargs)
    check_aggregation(config)
    if config.reward_weights is not None:
        if not isinstance(config.reward_weights, (list, tuple)) or not all(
                isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
                for w in config.reward_weights):
            bad("reward_weights", config.reward_weights, "expected a list of finite numbers, one per reward function")
        config.reward_weights = [float(w) for w in config.reward_weights]
    check_groups(config.num_generations, config.completions_per_step, minimum=2,
                 total_is=f"per_device_train_batch_size x gradient_accumulation_steps = "
                          f"{config.per_device_train_batch_size} x {config.gradient_accumulation_steps}",
                 fix=f"Use a multiple of {config.num_generations}, e.g. "
                     f"per_device_train_batch_size={config.num_generations}.")


def check_paths(config: GRPOConfig) -> None:
    """The folders and files a run writes, and the trackers' names; stored as text with '~' expanded."""
    if config.output_dir is None:  # TRL's own default is a folder too; checkpoints and the adapter need one
        bad("output_dir", None, "a folder for checkpoints and the adapter (e.g. 'grpo_nb_output'); to keep "
                                "no checkpoints during the run set save_steps=0")
    if (problem := path_problem(config.output_dir, file=False)) is not None:
        bad("output_dir", config.output_dir, problem.replace("for TensorBoard's event files",
                                                             "for checkpoints and the adapter"))
    config.output_dir = os.path.expanduser(os.fspath(config.output_dir))  # a str in grpo_config.json; '~' as a shell
    if (problem := report_to_problem(config.report_to)) is not None:
        bad("report_to", config.report_to, problem)
    for name in ("run_name", "project"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            bad(name, value, "expected a non-empty string, or None")
    if (problem := project_problem(config.project, config.report_to)) is not None:
        bad("project", config.project, problem)
    for name, file in (("logging_dir", False), ("log_completions_path", True)):
        if (problem := path_problem(getattr(config, name), file=file)) is not None:
            bad(name, getattr(config, name), problem)
        if getattr(config, name) is not None:  # saved in grpo_config.json, which holds no Path objects
            setattr(config, name, os.path.expanduser(os.fspath(getattr(config, name))))
    if config.log_completions_path is not None and not config.log_completions:
        bad("log_completions_path", config.log_completions_path, "it writes the completions each record keeps, "
            "and log_completions=False keeps none: set log_completions=True, or log_completions_path=None")


def checked_generation_kwargs(kwargs) -> dict:
    """Extra generate() arguments: none that grpo-nb sets itself or that the loss must know (the sampling
    knobs), none that would make a group's completions identical, only names generate() knows (a typo
    fails here, not after loading), and values grpo_config.json can hold (numpy numbers made Python's)."""
    if keys := [k for k in kwargs if not isinstance(k, str)]:
        bad_kwargs(kwargs, f"its keys are generate()'s argument names, as text, e.g. {{'min_new_tokens': "
                           f"64}}; got the key {keys[0]!r} ({type(keys[0]).__name__})")
    given = set(kwargs)
    if knobs := [k for k in SAMPLING_FIELDS if k in given]:
        bad_kwargs(kwargs, f"{knobs[0]!r} is a GRPOConfig field: set GRPOConfig.{knobs[0]}="
                           f"{kwargs[knobs[0]]!r} (train(..., {knobs[0]}=...)) instead, and "
                           f"drop it from generation_kwargs: the log-probs must use the sampling settings, "
                           f"and the loss reads them from the config")
    if owned := given & {"max_new_tokens", "input_ids", "attention_mask", "num_return_sequences"}:
        bad_kwargs(kwargs, f"{sorted(owned)} are set by grpo-nb; use max_completion_length / "
                           "num_generations instead")
    if owned := given & {"eos_token_id", "pad_token_id"}:
        bad_kwargs(kwargs, f"{sorted(owned)} are taken from the tokenizer and the model's generation_config: "
                           "set tokenizer.eos_token / model.generation_config.eos_token_id (a list for "
                           "several stop tokens) instead")
    if kwargs.get("do_sample", True) is not True or kwargs.get("num_beams", 1) != 1:
        bad_kwargs(kwargs, "GRPO compares a group of sampled completions, and greedy or beam search makes "
                           "them all the same (no signal to learn from): drop do_sample/num_beams; for "
                           "less varied samples lower GRPOConfig.temperature (train(..., temperature=0.7))")
    if "stop_strings" in given:
        bad_kwargs(kwargs, "stop_strings needs the tokenizer inside generate(), which grpo-nb does not "
                           "pass: end completions with a stop token instead (tokenizer.eos_token, or "
                           "model.generation_config.eos_token_id as a list)")
    from transformers import GenerationConfig  # here: keeps `import grpo_nb.config` light

    known = set(GenerationConfig().to_dict()) | set(GENERATE_OBJECTS) | {"synced_gpus", "use_model_defaults"}
    if unknown := sorted(k for k in given if k not in known):
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        bad_kwargs(kwargs, f"{unknown} {'is not an argument' if len(unknown) == 1 else 'are not arguments'} "
                           f"of transformers' generate()" + (f"; did you mean {close[0]!r}?" if close else ""))
    for key, kind in (("logits_processor", "LogitsProcessor"), ("stopping_criteria", "StoppingCriteria")):
        value = kwargs.get(key, [])
        if not isinstance(value, (list, tuple)) or not all(callable(f) for f in value):
            bad_kwargs(kwargs, f"generation_kwargs[{key!r}] must be a list of {kind} objects (callables), "
                               f"got {value!r}; generate() would fail on it at the first rollout")
    if not callable(kwargs.get("prefix_allowed_tokens_fn", len)):
        bad_kwargs(kwargs, "generation_kwargs['prefix_allowed_tokens_fn'] must be a function (batch_id, "
                           "input_ids) -> allowed token ids")
    return {key: value if key in GENERATE_OBJECTS else setting(kwargs, key, value) for key, value in kwargs.items()}


def setting(kwargs, key, value):
    """A generate() setting as JSON holds it: numpy numbers as Python's (inside lists and dicts too)."""
    value = plain(value)
    if isinstance(value, (list, tuple)):
        return type(value)(setting(kwargs, key, v) for v in value)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: setting(kwargs, key, v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    bad_kwargs(kwargs, f"generation_kwargs[{key!r}] holds {value!r}, a {type(value).__name__}: generate() "
                       f"settings are numbers, text, or lists and dicts of them, which grpo_config.json "
                       f"stores with the run")


def checked_chat_template_kwargs(kwargs) -> dict:
    """Extra apply_chat_template() arguments: a dict (or its JSON text, as TRL takes it) of names the template reads
    (e.g. enable_thinking), none that grpo-nb sets where it renders, values grpo_config.json can hold."""
    import json

    if isinstance(kwargs, str):  # TRL's GRPOConfig takes the dict's JSON text (from a command line or a YAML file)
        try:
            kwargs = json.loads(kwargs)
        except ValueError:
            bad("chat_template_kwargs", kwargs, 'expected a dict, or its JSON text, e.g. {"enable_thinking": false}')
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        bad("chat_template_kwargs", kwargs, "expected a dict of apply_chat_template() arguments by name, e.g. "
                                            "{'enable_thinking': False} (Qwen3's template reads it)")
    if owned := sorted(set(kwargs) & set(TEMPLATE_OWNED)):
        bad("chat_template_kwargs", kwargs, f"{owned} {'is' if len(owned) == 1 else 'are'} set by grpo-nb where it "
                                            f"renders prompts: drop {'it' if len(owned) == 1 else 'them'}")
    kwargs = {key: plain(value) for key, value in kwargs.items()}  # numpy's True / 1.5 are True / 1.5 here too
    try:
        json.dumps(kwargs, allow_nan=False)
    except (TypeError, ValueError):
        bad("chat_template_kwargs", kwargs, "its values must be finite numbers, text, True/False, None, or lists and "
                                            "dicts of them: grpo_config.json stores them with the run")
    return kwargs


def check_aggregation(config: GRPOConfig) -> None:
    """multi_objective_aggregation="normalize_then_sum" is TRL's GDPO: its advantages are normalized sums over the
    whole batch, with GRPO's mean baseline, so scale_rewards has no say and RLOO's leave-one-out baseline none."""
    if config.multi_objective_aggregation != "normalize_then_sum":
        return
    if config.advantage_estimator == "rloo":
        bad("multi_objective_aggregation", config.multi_objective_aggregation,
            "it normalizes each reward function's rewards against its group's mean and then the sums against the "
            "batch's (TRL's definition), which leaves no place for advantage_estimator='rloo''s leave-one-out "
            "baseline: use advantage_estimator='grpo', or multi_objective_aggregation='sum_then_normalize'")
    if config.scale_rewards != "group":
        warnings.warn(f"multi_objective_aggregation='normalize_then_sum' divides each reward function's rewards by "
                      f"their group's std and the sums by the batch's, as TRL does whatever scale_rewards says: "
                      f"scale_rewards={config.scale_rewards!r} has no effect with it.", stacklevel=5)


EVAL_STRATEGIES = (None, "no", "steps")


def check_eval_options(config: GRPOConfig) -> None:
    """eval_strategy is TRL's "no" or "steps" (or None: "steps" when eval_steps is set); eval_steps with "no" would
    never evaluate, so the two are refused together rather than one of them dropped."""
    if config.eval_strategy == "epoch":
        bad("eval_strategy", config.eval_strategy, "a run here counts optimizer steps, not epochs: use "
            "eval_strategy='steps' with eval_steps set to the steps of an epoch (len(dataset) // prompts per step)")
    if config.eval_strategy not in EVAL_STRATEGIES:
        bad("eval_strategy", config.eval_strategy, "allowed: 'no', 'steps', or None ('steps' when eval_steps is set)")
    if config.eval_strategy == "no" and config.eval_steps is not None:
        bad("eval_steps", config.eval_steps, "eval_strategy='no' never evaluates during training: set "
            "eval_strategy='steps' (or leave it None) to evaluate every eval_steps, or drop eval_steps")


def check_not_greedy(config: GRPOConfig) -> None:
    """Sampling settings that make decoding greedy (top_k=1, min_p=1: only the likeliest token is kept) or greedy in
    practice (a temperature below MIN_TEMPERATURE) are refused as generation_kwargs' do_sample=False is: every
    completion of a group would be the same, so no group has a reward spread to learn from."""
    same = ("every completion of a group would be the same (greedy decoding), so every advantage is 0 and nothing is "
            "learned: GRPO compares a group of sampled completions")
    lower = "for less varied samples lower the temperature instead (e.g. temperature=0.7)"
    if config.top_k == 1:
        bad("top_k", config.top_k, f"top_k=1 keeps only the likeliest token, so {same}. Use top_k=0 (off) or a "
                                   f"larger one (e.g. 50); {lower}")
    if config.min_p == 1:
        bad("min_p", config.min_p, f"min_p=1 keeps only the likeliest token (and any tied with it), so {same}. Use "
                                   f"min_p=None (off) or a smaller one (e.g. 0.1); {lower}")
    if config.temperature < MIN_TEMPERATURE:
        bad("temperature", config.temperature, f"expected {MIN_TEMPERATURE:g} or more: below it sampling is greedy "
                                               f"in practice, so {same}. Use e.g. temperature=0.7")


CPU_ROLLOUT_DTYPES = (None, "bfloat16", "auto")


def check_cpu_rollout_dtype(config: GRPOConfig) -> None:
    """cpu_rollout_dtype: one the native engine merges into (whether it applies to the run, and what corrects for
    it, make_rollout says)."""
    if str(config.cpu_rollout_dtype) == "torch.bfloat16":
        config.cpu_rollout_dtype = "bfloat16"  # the config's values stay plain (checkpoints keep them as JSON)
    if config.cpu_rollout_dtype not in CPU_ROLLOUT_DTYPES:
        bad("cpu_rollout_dtype", config.cpu_rollout_dtype,
            "allowed: None (the model's own dtype), 'bfloat16' (a CPU rollout's merged weights in bf16) or 'auto' "
            "(bf16 where it pays)" + (" - None itself, not the text (a YAML null)"
                                      if str(config.cpu_rollout_dtype).lower() in ("none", "null") else ""))


def correction_mode(config: GRPOConfig) -> str:
    """The rollout correction's mode as the run applies it (`rollout_importance_sampling_mode=None`: token-level
    truncation for bf16 CPU rollout copies, TRL's sequence-level mask otherwise)."""
    if config.rollout_importance_sampling_mode is not None:
        return config.rollout_importance_sampling_mode
    return "token_truncate" if config.cpu_rollout_dtype == "bfloat16" else "sequence_mask"


def check_loss_options(config: GRPOConfig) -> None:
    """How the options of the loss go together: GSPO's sequence-level ratio, the rollout log-prob correction's
    clip bounds (TRL's vllm_importance_sampling_*), CISPO's cap, the two-sided clip's delta."""
    check_delta(config)
    if config.importance_sampling_level == "sequence" and config.loss_type not in ("grpo", "sapo", "luspo", "vespo"):
        warnings.warn(
            f"importance_sampling_level='sequence' with loss_type={config.loss_type!r} sums per-token terms, so "
            f"each completion weighs by its length instead of GSPO's per-sequence objective; GSPO's paper "
            f"uses loss_type='grpo'.", stacklevel=5)
    if config.loss_type == "luspo" and config.importance_sampling_level != "sequence":  # as TRL warns
        warnings.warn("loss_type='luspo' scales each completion's GSPO term by its length: the LUSPO paper uses it "
                      "with importance_sampling_level='sequence' (one ratio per completion); with 'token' each "
                      "token keeps its own ratio. Set importance_sampling_level='sequence'.", stacklevel=5)
    if config.loss_type == "vespo" and config.importance_sampling_level != "token":  # as TRL warns
        warnings.warn("loss_type='vespo' weighs each completion by its whole importance ratio itself; "
                      "importance_sampling_level='sequence' then changes only the KL term's bias correction. Leave "
                      "importance_sampling_level='token' (the default).", stacklevel=5)
    mode = correction_mode(config)
    if (config.loss_type == "vespo" and config.rollout_importance_sampling_correction
            and mode.startswith("sequence")):  # as TRL refuses
        bad("rollout_importance_sampling_mode", mode,
            "loss_type='vespo' folds the rollout correction's per-token ratios into its own sequence weight, so it "
            "needs 'token_truncate' or 'token_mask' (as TRL)")
    if config.use_adaptive_entropy and config.entropy_coef_min > config.entropy_coef_max:
        bad("entropy_coef_min", config.entropy_coef_min,
            f"expected at most entropy_coef_max={config.entropy_coef_max!r}: the adaptive coefficient stays between them")
    low, high = config.rollout_importance_sampling_clip_min, config.rollout_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        bad("rollout_importance_sampling_clip_min", low,
            f"expected less than rollout_importance_sampling_clip_max={high!r}: no ratio would be kept")
    if config.rollout_importance_sampling_correction and mode.endswith("truncate") and low is None and high is None:
        bad("rollout_importance_sampling_clip_max", high, f"rollout_importance_sampling_mode="
            f"{mode!r} clips the ratios, so set it or "
            f"rollout_importance_sampling_clip_min (TRL's default clip_max is 3.0)")
    if config.rollout_importance_sampling_correction:
        check_correction_keeps_one(mode, low, high)
    cap = config.epsilon if config.epsilon_high is None else config.epsilon_high
    if config.loss_type == "cispo" and cap < 1:  # as in TRL: a warning, the run is legal
        warnings.warn(
            f"loss_type='cispo' caps the importance weight at epsilon_high itself (not 1 + epsilon_high), and "
            f"epsilon_high={config.epsilon_high!r}"
            + (f" falls back to epsilon={config.epsilon!r}" if config.epsilon_high is None else "")
            + ": every weight near 1 is cut to that, scaling the whole update down. CISPO's papers use "
              "epsilon_high around 5.0 (TRL's recommendation for ScaleRL); set epsilon_high=5.0.", stacklevel=5)


def check_delta(config: GRPOConfig) -> None:
    """delta caps the ratio in the clipped loss's unclipped term (TRL 1.16: coef_1 = clamp(coef_1, max=delta) before
    min(coef_1 A, clip(coef_1) A)). TRL checks nothing; here a value that cannot be a ratio cap is refused, and one
    that does nothing with the loss type (which TRL ignores silently) is said."""
    delta, cap = config.delta, 1 + (config.epsilon if config.epsilon_high is None else config.epsilon_high)
    if delta is None:
        return
    try:  # the loss compares float ratios with it: an int past a float's range is no cap either
        number = isinstance(delta, (int, float)) and not isinstance(delta, bool) and math.isfinite(float(delta))
    except OverflowError:
        number = False
    if not number or delta <= 0:
        bad("delta", delta, f"expected a finite number > 0, or None (no cap): it caps the importance ratio in the "
            f"clipped loss's unclipped term (TRL's two-sided clipping). TRL recommends delta > 1 + epsilon_high = "
            f"{cap:g}; INTELLECT-2, which introduced it, uses delta=4")
    if delta <= cap and config.loss_type not in ("cispo", "sapo", "vespo"):  # legal in TRL, but not what it is for
        warnings.warn(f"GRPOConfig.delta={delta!r} is at or below 1 + epsilon_high = {cap:g}, where TRL recommends "
                      f"delta > 1 + epsilon_high: the cap then cuts positive-advantage tokens at ratio {delta!r} "
                      f"instead of {cap:g}" + (", and below 1 it takes the gradient of every positive-advantage token "
                      "even on-policy (ratio 1), so only negative advantages are learned from" if delta < 1 else "")
                      + ". delta is a ratio cap, not a clip epsilon: e.g. delta=4 (INTELLECT-2's).", stacklevel=6)
    if config.loss_type in ("cispo", "sapo", "vespo"):
        # a warning, not a refusal: TRL runs the same config ignoring delta, so a converted TRL config trains the
        # same here; the user learns that the setting they chose does nothing
        how = {"cispo": "caps its detached importance weight at epsilon_high itself",
               "sapo": "gates the ratio with a smooth sigmoid", "vespo": "weighs each completion by a smooth gamma "
               "weight of its ratio"}[config.loss_type]
        warnings.warn(f"GRPOConfig.delta={delta!r} has no effect with loss_type={config.loss_type!r}, which {how} and "
                      f"has no unclipped ratio term to cap (TRL ignores delta there too). delta applies to loss_type "
                      f"'grpo', 'bnpo', 'dr_grpo', 'dapo' and 'luspo'; otherwise set delta=None.", stacklevel=6)


def check_correction_keeps_one(mode: str, low: float | None, high: float | None) -> None:
    """The correction's bounds are ratios p_trainer / p_rollout around 1 (not a clip epsilon): bounds that leave out
    1, the ratio of every token on which the engine and the trainer agree, drop every token with a "*_mask" mode
    (no step trains anything: refused) and set every weight to the bound with "*_truncate" (said)."""
    if high is not None and high < 1:
        name, bound, side = "rollout_importance_sampling_clip_max", high, "below"
    elif low is not None and low > 1:
        name, bound, side = "rollout_importance_sampling_clip_min", low, "above"
    else:
        return
    why = (f"{name}={bound!r} is {side} 1: ratio 1 (the engine's log-probs agreeing with the trainer's, as they do "
           f"for nearly every token) lies outside the bounds")
    fix = ("The bounds are ratios p_trainer / p_rollout around 1, not a clip epsilon: TRL's defaults are "
           "clip_max=3.0 and clip_min=None")
    if mode.endswith("mask"):
        bad(name, bound, f"{why}, and rollout_importance_sampling_mode={mode!r} zeroes every ratio outside them: "
                         f"every token would be dropped, so no step would train anything. {fix}")
    warnings.warn(f"rollout_importance_sampling_mode={mode!r}: {why}, so nearly every weight is clipped to {bound!r}, "
                  f"scaling the whole update by about that. {fix}.", stacklevel=6)


def bad(name: str, value, allowed: str):
    raise ValueError(f"GRPOConfig.{name}={value!r} is invalid: {allowed}")


def bad_kwargs(kwargs, allowed: str):
    bad("generation_kwargs", kwargs, allowed)


def check_names(cls, settings) -> None:
    """Each name a field; else a ValueError suggesting the closest, or saying where grpo-nb decides what a
    TRL field (bf16, gradient_checkpointing, ...) would."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in settings:
        if key in names:
            continue
        if key in DECIDED_ELSEWHERE and key != "num_train_epochs":  # its sentence is about a TRL config's max_steps
            raise ValueError(f"GRPOConfig has no field {key!r}: {DECIDED_ELSEWHERE[key]}. Drop {key}=.")
        close = difflib.get_close_matches(key, names, n=3) if isinstance(key, str) else []
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"GRPOConfig has no field {key!r}.{hint}")
