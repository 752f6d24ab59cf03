"""Shapes of popular models, so the VRAM planner and the GPU benchmarks need no download.

Each entry is the subset of the model's `config.json` that decides memory: enough for
`transformers.AutoConfig.for_model(**entry)` to build the architecture (on the meta device
for the planner, with random weights for the benchmarks). Values are the published ones.
"""

from __future__ import annotations

import copy

_QWEN2 = dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=32768, vocab_size=151936)
_LLAMA3 = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, vocab_size=128256,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})

KNOWN_ARCHITECTURES: dict[str, dict] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, hidden_act="silu"),
    "Qwen/Qwen2.5-0.5B-Instruct": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(_QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B-Instruct": dict(_QWEN2, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                     num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(_QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                                     vocab_size=152064),
    "meta-llama/Llama-3.2-1B-Instruct": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                             tie_word_embeddings=True,
                                             rope_scaling=dict(_LLAMA3["rope_scaling"], factor=32.0)),
    "meta-llama/Llama-3.2-3B-Instruct": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                             num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                             tie_word_embeddings=True,
                                             rope_scaling=dict(_LLAMA3["rope_scaling"], factor=32.0)),
    "meta-llama/Llama-3.1-8B-Instruct": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                             tie_word_embeddings=False),
}
# The base (non-instruct) checkpoints share their shapes.
for _name in list(KNOWN_ARCHITECTURES):
    KNOWN_ARCHITECTURES[_name.removesuffix("-Instruct")] = KNOWN_ARCHITECTURES[_name]


def known_config(name: str):
    """A transformers config for a model in `KNOWN_ARCHITECTURES` (matched case-insensitively, org optional)."""
    from transformers import AutoConfig

    wanted = name.lower()
    for key, entry in KNOWN_ARCHITECTURES.items():
        if wanted in (key.lower(), key.split("/")[-1].lower()):
            entry = copy.deepcopy(entry)
            return AutoConfig.for_model(entry.pop("model_type"), **entry)
    raise KeyError(name)


def random_model(name_or_config, *, dtype=None, device=None, seed: int = 0):
    """A causal LM with random weights and the given architecture (for benchmarks; nothing is downloaded)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = known_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):  # initialise where it will live: an 8B model inits far faster on a GPU
        return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
