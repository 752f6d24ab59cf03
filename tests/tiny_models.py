"""Tiny random causal LMs and an offline tokenizer, built in-process (no downloads).

Shared by the test modules; not a test file itself.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model

VOCAB_SIZE = 512
HIDDEN_SIZE = 64

ARCHS = ("llama", "qwen2")
# (arch, tied) for every combination the tests parametrize over.
MODEL_CASES = [(arch, tied) for arch in ARCHS for tied in (True, False)]
MODEL_IDS = [f"{arch}-{'tied' if tied else 'untied'}" for arch, tied in MODEL_CASES]


def tiny_config(arch: str = "llama", *, tied: bool = False, vocab_size: int = VOCAB_SIZE, initializer_range: float = 0.1):
    """A 2-layer, 64-wide config with grouped-query attention (4 heads, 2 kv heads).

    `initializer_range` is larger than the usual 0.02 so the output distribution is far
    from uniform and the log-prob comparisons are not trivially satisfied.
    """
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**kwargs)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**kwargs)
    raise ValueError(f"unknown arch {arch!r}")


def tiny_model(arch: str = "llama", *, tied: bool = False, seed: int = 0, attn_implementation: str = "eager", **kw):
    """A seeded, fp32, eval-mode (no dropout) tiny random causal LM."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, tied=tied, **kw)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    else:
        assert model.lm_head.weight is not model.get_input_embeddings().weight
    return model


def tiny_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A whitespace word-level `PreTrainedTokenizerFast` with `vocab_size` entries, no files needed.

    Ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, then "w4" ... "w{vocab_size-1}".
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )


# --------------------------------------------------------------------------------------
# A tiny LoRA model, prompts and reward functions for whole train() runs (the `tok` fixture is in conftest.py)

FAST = dict(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=6,
            max_prompt_length=16, learning_rate=1e-3, save_steps=0)


def lora_model(seed=0):
    model = tiny_model("llama", seed=seed)
    model.generation_config.eos_token_id = 2
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.train()
    return model


def dataset(n=8):
    return Dataset.from_dict({
        "prompt": [" ".join(f"w{4 + (i * 7 + j) % 40}" for j in range(3 + i % 3)) for i in range(n)],
        "answer": [str(i) for i in range(n)],
    })


def count_w7(completions, **kwargs):
    return [float(c.split().count("w7")) for c in completions]


def length_reward(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def token_id_reward(completion_ids, **kwargs):
    """Varies from sample to sample even for a random model: every group carries signal."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def byte_tokenizer():
    """A byte-level tokenizer (ids 0-255 are the bytes) with a pad token and ChatML's markers as special tokens
    (<|im_end|> the EOS), 259 ids in all: any text encodes, within a tiny model's vocabulary (VOCAB_SIZE), with no
    files - for tool calls, JSON and chat templates."""
    out = bare_byte_tokenizer()
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": "<pad>"})
    out.eos_token = "<|im_end|>"
    out.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return out


def bare_byte_tokenizer():
    """Ids 0-255 the bytes, no special tokens and no chat template (byte_tokenizer adds ChatML's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left")


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-to-unicode table maps to `ch`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


# --------------------------------------------------------------------------------------
# Tools and episodes (tests/test_tools.py, the catalog's tool cases)

def multiply(a: int, b: int) -> int:  # TRL's GRPO guide's tool, as written there
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


class Scripted:
    """A rollout that writes `reply(prompt_text, k)` (k: the completion's place in its group), then the EOS."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations):
        from grpo_nb.rollout import RolloutBatch

        rows = []
        for ids, mask in zip(prompt_ids, prompt_mask):
            text = tokenizer.decode(ids[mask.bool()], skip_special_tokens=False)
            for k in range(num_generations):
                rows.append(tokenizer(self.reply(text, k), add_special_tokens=False)["input_ids"]
                            + [tokenizer.eos_token_id])
        self.calls.append(len(rows))
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        return RolloutBatch(prompt_ids.repeat_interleave(num_generations, 0),
                            prompt_mask.repeat_interleave(num_generations, 0), ids, mask,
                            torch.zeros(len(rows), dtype=torch.bool))


def chat(n=2):
    """Chat rows asking for a product the `multiply` tool computes."""
    return [{"prompt": [{"role": "user", "content": f"What is 3 times 4? ({i})"}], "answer": "12"} for i in range(n)]


def adapted_tiny_model(arch: str, generator):
    """`tiny_model(arch)` set up by grpo-nb with LoRA r=4, its lora_B drawn from `generator` (they start at zero),
    so the adapters change the outputs - what a rollout's merged copies are made from."""
    import torch

    from grpo_nb.models import prepare_for_training

    model = prepare_for_training(tiny_model(arch), lora_rank=4, gradient_checkpointing=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model
