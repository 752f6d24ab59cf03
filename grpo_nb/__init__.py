"""grpo-nb: memory-efficient GRPO training of reasoning LLMs, made for notebooks and small GPUs.

    from grpo_nb import setup_reasoning_model, train, arithmetic_dataset, STARTER_REWARDS
    model, tokenizer = setup_reasoning_model()          # embedded SmolLM2-135M-Instruct, offline
    history = train(model, tokenizer, arithmetic_dataset(), STARTER_REWARDS, max_steps=20)
"""

from .config import GRPOConfig
from .data import SYSTEM_PROMPT, arithmetic_dataset, format_gsm8k, load_gsm8k
from .evaluation import evaluate
from .gguf_export import save_gguf
from .logprobs import completion_logprobs, selective_logprobs
from .loss import group_advantages, grpo_loss
from .memory import estimate_vram
from .planning import plan_for_gpu
from .models import prepare_tokenizer, setup_reasoning_model
from .offload import enable_offloaded_checkpointing
from .openenv_adapter import openenv_environment
from .play import Episode, play
from .prototyping import preview_rewards, sample_and_score
from .reward_contract import RewardFunctionError, completion_text
from .rewards import (
    STARTER_REWARDS,
    correctness_reward,
    integer_answer_reward,
    overlong_penalty,
    proximity_reward,
    soft_format_reward,
    strict_format_reward,
    weighted_reward,
    xml_count_reward,
)
from .rollout import HFGenerateRollout, RolloutEngine
from .saving import load_for_inference, save_adapter, save_merged
from .tools import tool_chat_template
from .trainer import train
from .trl_config import from_trl_config

__version__ = "0.1.0"

__all__ = [
    "Episode",
    "GRPOConfig",
    "HFGenerateRollout",
    "RewardFunctionError",
    "RolloutEngine",
    "STARTER_REWARDS",
    "SYSTEM_PROMPT",
    "arithmetic_dataset",
    "completion_logprobs",
    "completion_text",
    "correctness_reward",
    "enable_offloaded_checkpointing",
    "estimate_vram",
    "evaluate",
    "format_gsm8k",
    "from_trl_config",
    "group_advantages",
    "grpo_loss",
    "integer_answer_reward",
    "load_for_inference",
    "load_gsm8k",
    "openenv_environment",
    "overlong_penalty",
    "plan_for_gpu",
    "play",
    "prepare_tokenizer",
    "preview_rewards",
    "proximity_reward",
    "sample_and_score",
    "save_adapter",
    "save_gguf",
    "save_merged",
    "selective_logprobs",
    "setup_reasoning_model",
    "soft_format_reward",
    "strict_format_reward",
    "tool_chat_template",
    "train",
    "weighted_reward",
    "xml_count_reward",
]
