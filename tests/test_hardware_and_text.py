"""The dtype per GPU (decided by compute capability), the text reward functions see (decoded from each
completion's own ids), dataset values that only look fine (NaN answers, lone surrogates), and the one
argument check of the planner functions (issue 25)."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from peft import LoraConfig, get_peft_model

import grpo_nb.simulate.step as simulate_module
from grpo_nb import evaluate, sample_and_score, train
from grpo_nb.dataset_checks import check_dataset
from grpo_nb.hardware import native_bf16
from grpo_nb.logprobs import triton_kernels
from grpo_nb.memory import estimate_vram
from grpo_nb.planning import GPU_CAPABILITY, GPU_MEMORY_GIB, plan_for_gpu
from grpo_nb.models import default_dtype, prepare_tokenizer, resolve_dtype
from grpo_nb.simulate import simulate_step
from tiny_models import FAST
from tiny_models import tiny_model, tiny_tokenizer

TINY_CONFIG = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


# ------------------------------------------------------------------------ the dtype per GPU

def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    """This machine as one with `name` as its CUDA device. torch's is_bf16_supported() says True whatever
    the card, as it does on a T4 (it counts emulation by default)."""
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: SimpleNamespace(
        name=name, major=capability[0], minor=capability[1], total_memory=16 * 2**30))
    monkeypatch.setattr(cuda, "is_bf16_supported", lambda including_emulation=True: True)


CARDS = [("Tesla T4", (7, 5), torch.float16), ("Tesla V100-SXM2-16GB", (7, 0), torch.float16),
         ("NVIDIA A100-SXM4-40GB", (8, 0), torch.bfloat16), ("NVIDIA L4", (8, 9), torch.bfloat16),
         ("NVIDIA H100 80GB HBM3", (9, 0), torch.bfloat16)]


@pytest.mark.parametrize("name,capability,expected", CARDS, ids=[c[0] for c in CARDS])
def test_dtype_is_decided_by_compute_capability(monkeypatch, name, capability, expected):
    fake_gpu(monkeypatch, name, capability)
    assert native_bf16("cuda") == native_bf16(capability) == (expected == torch.bfloat16)
    assert default_dtype("cuda") == expected and default_dtype("cpu") == torch.float32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_dtype("bfloat16", "cuda") == resolve_dtype(torch.bfloat16, "cuda") == torch.bfloat16
        assert resolve_dtype("auto", "cuda") == expected
    if expected == torch.float16:  # an explicit bf16 on a pre-Ampere card runs emulated: said, with the fix
        assert len(caught) == 2, [str(w.message) for w in caught]
        message = str(caught[0].message)
        assert name in message and f"{capability[0]}.{capability[1]}" in message
        assert "emulates" in message and "math kernel" in message and "dtype='float16'" in message
        # the Triton log-prob kernels are not tried for bf16 on such a card
        weight = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda"))
        assert triton_kernels("auto", weight) is None
    else:
        assert not caught, [str(w.message) for w in caught]


def test_the_planner_plans_each_catalogued_card_in_its_dtype():
    assert set(GPU_CAPABILITY) == set(GPU_MEMORY_GIB)
    expected = {"T4": "fp16", "V100": "fp16", "P100": "fp16", "A100": "bf16", "L4": "bf16", "H100": "bf16"}
    for gpu, dtype in expected.items():
        plan = plan_for_gpu(gpu, TINY_CONFIG, max_completion_length=256, num_generations=2)
        assert plan.settings["dtype"] == dtype, gpu
    assert plan_for_gpu("Tesla T4", TINY_CONFIG, max_completion_length=256, num_generations=2).settings["dtype"] == "fp16"
    # the user's own dtype wins
    assert plan_for_gpu("T4", TINY_CONFIG, max_completion_length=256, num_generations=2,
                        dtype="fp32").settings["dtype"] == "fp32"


def test_gemma_2_and_3_are_not_given_float16(monkeypatch):
    """Gemma 2 / 3 activations overflow float16: on a card without native bf16 dtype='auto' loads them in
    float32 (said), an explicit float16 is warned about by name, and the planner plans them in fp32."""
    from transformers import Gemma2Config, Gemma3Config, Qwen2Config

    from grpo_nb.models import dtype_for_model

    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    auto = resolve_dtype("auto", "cuda")
    for config in (Gemma2Config(), Gemma3Config()):  # Gemma3Config: the multimodal one, its text config gemma3_text
        with pytest.warns(UserWarning, match=r"loading in float32, not float16: gemma\S* models overflow float16"):
            assert dtype_for_model("auto", auto, config) == torch.float32
        with pytest.warns(UserWarning, match=r"dtype='float16'\): gemma\S* models overflow float16.*dtype='auto'"):
            assert dtype_for_model("float16", torch.float16, config) == torch.float16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dtype_for_model("auto", auto, Qwen2Config()) == torch.float16
        assert dtype_for_model("auto", torch.bfloat16, Gemma2Config()) == torch.bfloat16
    gemma = {**TINY_CONFIG, "model_type": "gemma2", "head_dim": 16}
    plan = plan_for_gpu("T4", gemma, max_completion_length=256, num_generations=2)
    assert plan.settings["dtype"] == "fp32" and any("gemma2 models overflow fp16" in n for n in plan.notes)
    assert plan_for_gpu("L4", gemma, max_completion_length=256, num_generations=2).settings["dtype"] == "bf16"


# ------------------------------------------------------------------------ text from token ids

def bang_tokenizer():
    """A word-level tokenizer whose id 0 is an ordinary token, '!', as in Qwen2.5's and Llama 3's vocabularies
    (pad and EOS elsewhere): text decoded from zeroed padding would end in '! ! !'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"!": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": i for i in range(4, 512)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return prepare_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                     eos_token="</s>"))


def early_ending_model():
    """The tiny LoRA model, its EOS row of the output head scaled up so that some completions end early
    (a batch with padding) and others run to the length limit."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    with torch.no_grad():
        model.lm_head.weight[2] *= 12
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


ROWS = [{"prompt": f"w{5 + i} w{9 + i} w{20 + i}", "answer": str(i)} for i in range(8)]


class Seen:
    """A reward function that keeps what it was given."""

    __name__ = "seen"

    def __init__(self):
        self.completions, self.completion_ids = [], []

    def __call__(self, completions, completion_ids, **kwargs):
        self.completions += completions
        self.completion_ids += completion_ids
        return [0.0] * len(completions)


def assert_texts_are_the_models(tok, texts, ids, max_length):
    lengths = [len(i) for i in ids]
    assert min(lengths) < max_length and max(lengths) > min(lengths), f"no padded rows to check: {lengths}"
    assert texts == [tok.decode(i, skip_special_tokens=True) for i in ids]
    assert [t.split().count("!") for t in texts] == [i.count(0) for i in ids], texts  # each '!' one the model wrote


def test_rewards_and_records_get_the_text_the_model_wrote(tmp_path):
    tok, seen = bang_tokenizer(), Seen()
    history = train(early_ending_model(), tok, ROWS, [seen], **{**FAST, "num_completions_to_print": 8},
                    max_steps=1, verbose=False, live=False, output_dir=str(tmp_path / "run"))
    assert_texts_are_the_models(tok, seen.completions, seen.completion_ids, FAST["max_completion_length"])
    samples = [s["completion"] for s in history[0]["samples"]]
    assert samples == seen.completions[:len(samples)] and len(samples) == 8


def test_evaluate_and_sample_and_score_get_the_text_the_model_wrote():
    tok, model = bang_tokenizer(), early_ending_model()
    seen = Seen()
    result = evaluate(model, tok, ROWS, [seen], max_completion_length=6)
    assert result["completions"] == seen.completions
    assert_texts_are_the_models(tok, seen.completions, seen.completion_ids, 6)
    seen = Seen()
    sample_and_score(model, tok, [row["prompt"] for row in ROWS], [seen], n=2, max_completion_length=6)
    assert_texts_are_the_models(tok, seen.completions, seen.completion_ids, 6)


# ------------------------------------------------------------------------ what the model is asked (issue 25, probes 3-4)

def test_a_cut_prompt_says_what_max_prompt_length_none_means():
    """With max_prompt_length at what the context leaves (None's meaning), raising it would be refused: the
    warning says to load the model with a larger max_seq_length instead; and when every completion ran to
    the cap, it points at the EOS ids."""
    from grpo_nb.config import GRPOConfig
    from grpo_nb.trainer import warn_once

    batch = SimpleNamespace(prompts_cut=1, truncated=torch.ones(4, dtype=torch.bool), size=4)  # StepBatch's fields
    config = GRPOConfig(max_prompt_length=48, max_completion_length=16)
    with pytest.warns(UserWarning) as caught:
        warn_once(batch, config, set(), 64)
    cut, capped = (str(w.message) for w in caught)
    assert "max_prompt_length=None means max_seq_length - max_completion_length = 64 - 16" in cut
    assert "load the model with a larger max_seq_length" in cut and "Raise max_prompt_length" not in cut
    assert "Every completion ran to the cap" in capped and "model.generation_config.eos_token_id" in capped
    with pytest.warns(UserWarning, match="Raise max_prompt_length to keep them whole"):
        warn_once(batch, config, set(), 256)  # room to raise it


def test_the_chat_prompt_is_checked_as_the_model_will_see_it():
    from grpo_nb.checks import check_chat_prompt

    tok, model = prepare_tokenizer(tiny_tokenizer()), tiny_model("llama")
    messages = [{"role": "system", "content": "w4 w5"}, {"role": "user", "content": "w6"}]
    check_chat_prompt("train", model, tok, messages)  # the default template keeps both, ends turns with </s>
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'] }}: {{ m['content'] }}"
                         "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    with pytest.raises(ValueError, match=r"drops the messages' content: dataset row 0's message 0 \(system: 'w4 w5'\)"
                                         r".*A template without a system role leaves it out: merge it into the first"):
        check_chat_prompt("train", model, tok, messages)  # an early Phi-3 template: the system prompt vanishes
    check_chat_prompt("train", model, tok, messages[1:])


def test_a_tokenizer_whose_eos_was_changed_on_purpose_is_still_the_models():
    """The family check refuses a tokenizer whose EOS is not the model's only when the model's own end id means
    no end in it: a base model's tokenizer given the chat EOS (<|im_end|>) keeps <|endoftext|> at the model's id."""
    from grpo_nb.checks import check_same_model

    tok, model = tiny_tokenizer(510), tiny_model("llama")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    check_same_model("train", model, tok)  # the model's 2 is '</s>' here too
    model.config.eos_token_id = model.generation_config.eos_token_id = 7
    with pytest.raises(ValueError, match=r"not this model's tokenizer: the model ends text with id\(s\) \[7\].*"
                                         r"\(7 is 'w7'\).*eos_token_id = \[7, 511\]"):
        check_same_model("train", model, tok)
    model.generation_config.eos_token_id = [7, 511]  # the fix the message names
    check_same_model("train", model, tok)


def test_templates_that_open_the_answer_with_the_users_turn_are_not_warned_about():
    """Mistral's and Llama 2's templates have no add_generation_prompt branch: [/INST], written after the user's
    message, opens the assistant's turn. A ChatML template without the branch ends the prompt at <|im_end|>."""
    from grpo_nb.checks import check_chat_prompt

    model, tok = tiny_model("llama"), prepare_tokenizer(tiny_tokenizer())
    chat = [{"role": "user", "content": "w5 w6"}]
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] "
                         "+ ' [/INST]' }}{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_chat_prompt("train", model, tok, chat)
    tok.chat_template = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    with pytest.warns(UserWarning, match="opens no assistant turn") as caught:
        check_chat_prompt("train", model, tok, chat)
    assert "<|im_start|>assistant" in str(caught[0].message)


def test_the_context_window_counts_rope_scaling():
    from transformers import LlamaConfig, Qwen2Config

    from grpo_nb.attachments import position_window

    assert position_window(Qwen2Config(max_position_embeddings=32768)) == 32768
    assert position_window(Qwen2Config(max_position_embeddings=32768, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})) == 131072  # Qwen2.5's YaRN
    assert position_window(LlamaConfig(max_position_embeddings=131072, rope_scaling={  # Llama 3.1: extended already
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0})) == 131072
    assert position_window(SimpleNamespace()) is None
    # linear scaling: max_position_embeddings already holds the extended window (LLaMA-2-7B-32K), not x8 again
    assert position_window(LlamaConfig(max_position_embeddings=32768, rope_scaling={
        "rope_type": "linear", "factor": 8.0})) == 32768
    assert position_window(SimpleNamespace(max_position_embeddings=131072, rope_scaling={  # a flat dict, Gemma 3's
        "rope_type": "linear", "factor": 8.0})) == 131072
    # YaRN: original x factor, even where max_position_embeddings is above the original (Qwen3: 40960)
    assert position_window(Qwen2Config(max_position_embeddings=40960, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})) == 131072
    from grpo_nb.attachments import attachments
    from grpo_nb.checks import check_context

    model = tiny_model("llama")  # 256 positions, set up by hand beyond them (prepare_for_training(max_seq_length=))
    attachments(model).max_seq_length = 1024
    with pytest.raises(ValueError, match=r"evaluate\(model=...\) was set up with max_seq_length=1024, beyond the "
                                         r"model's context window of 256 tokens"):
        check_context("evaluate", model, None, 16)


# ------------------------------------------------------------------------ dataset values

@pytest.mark.parametrize("missing", [None, float("nan"), np.nan, np.float32("nan"), pd.NA],
                         ids=["None", "float-nan", "numpy-nan", "float32-nan", "pandas-NA"])
def test_a_missing_answer_is_refused_whatever_spells_it(missing):
    with pytest.raises(ValueError, match=r"Dataset row 1: its 'answer' is .*, a missing value.*row\['answer'\] is not"):
        check_dataset([{"prompt": "w5", "answer": "1"}, {"prompt": "w6", "answer": missing}, {"prompt": "w7",
                                                                                             "answer": "2"}])
    # a DataFrame's empty cell, in every way it reaches check_dataset
    frame = pd.DataFrame({"prompt": ["w5", "w6"], "answer": [4, missing if missing is not pd.NA else math.nan]})
    with pytest.raises(ValueError, match=r"Dataset row 1: its 'answer' is"):
        check_dataset(frame.to_dict("records"))
    assert check_dataset([{"prompt": "w5", "answer": 0.0}, {"prompt": "w6", "answer": 3}])[0] == ["prompt", "answer"]


def test_a_lone_surrogate_is_refused_naming_the_row_and_the_message():
    with pytest.raises(ValueError, match=r"Dataset row 1: its prompt holds a lone surrogate '\\ud800' at character 3"):
        check_dataset([{"prompt": "w5"}, {"prompt": "w6 \ud800 w7"}])
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w5 \udc80"}]
    with pytest.raises(ValueError, match=r"row 0: message 1 \(user\) of its prompt .*encode\('utf-8', 'replace'\)"):
        check_dataset([{"prompt": chat}])
    fixed = [{**m, "content": m["content"].encode("utf-8", "replace").decode()} for m in chat]
    assert check_dataset([{"prompt": fixed}]) == (["prompt"], True)


# ------------------------------------------------------------------------ one argument check for the planner

class Reached(Exception):
    pass


def reach(*args, **kwargs):
    raise Reached


BAD = [("per_device_train_batch_size", 0), ("max_completion_length", -1), ("num_generations", 2.0),
       ("lora_rank", 0), ("rollout_max_rows", 0), ("dtype", "int8"), ("gradient_checkpointing", 1),
       ("load_in_4bit", "yes"), ("target_modules", None), ("optim", "adam")]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_the_three_planner_functions_refuse_alike_before_any_work(monkeypatch, name, value):
    monkeypatch.setattr(simulate_module, "AllocationTracker", reach)  # where simulate_step's work starts
    messages = {}
    for func, call in (("estimate_vram", lambda: estimate_vram(TINY_CONFIG, **{name: value})),
                       ("simulate_step", lambda: simulate_step(TINY_CONFIG, **{name: value})),
                       ("plan_for_gpu", lambda: plan_for_gpu("T4", TINY_CONFIG, **{name: value}))):
        if func == "simulate_step" and name == "optim":
            continue  # the simulation runs torch's AdamW only
        with pytest.raises(ValueError) as err:
            call()
        messages[func] = str(err.value).replace(func, "<func>")
        assert str(err.value).startswith(f"{func}({name}={value!r}) is invalid: expected")
    assert len(set(messages.values())) == 1, messages


@pytest.mark.parametrize("config,fragment", [
    (dict(model_type="llama", hidden_size=64), "has no vocab_size, intermediate_size, num_hidden_layers, "
                                              "num_attention_heads"),
    ({**TINY_CONFIG, "hidden_size": 0}, "hidden_size=0 is invalid: expected an integer >= 1"),
    ({**TINY_CONFIG, "num_hidden_layers": -1}, "num_hidden_layers=-1 is invalid"),
    ({**TINY_CONFIG, "vocab_size": 0}, "vocab_size=0 is invalid"),
    ({**TINY_CONFIG, "num_attention_heads": 5}, "num_attention_heads=5 does not divide its hidden_size=64"),
    ({**TINY_CONFIG, "num_key_value_heads": 3}, "num_key_value_heads=3 does not divide its num_attention_heads=4"),
], ids=["partial", "hidden-0", "layers-negative", "vocab-0", "heads", "kv-heads"])
def test_config_dicts_with_missing_or_bad_sizes_are_refused(monkeypatch, config, fragment):
    monkeypatch.setattr(simulate_module, "AllocationTracker", reach)
    for func, call in (("estimate_vram", estimate_vram), ("simulate_step", simulate_step),
                       ("plan_for_gpu", lambda c: plan_for_gpu("T4", c))):
        with pytest.raises(ValueError, match=rf"^{func}: the config.*{fragment}"):
            call(config)
    # a model type's own spelling counts (GPT-2's n_embd, n_layer, n_head): only the missing size is named
    with pytest.raises(ValueError, match=r"has no intermediate_size, which"):
        estimate_vram(dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=100))


def test_simulate_step_batch_must_divide_the_completions(monkeypatch):
    monkeypatch.setattr(simulate_module, "AllocationTracker", reach)
    with pytest.raises(ValueError, match=r"simulate_step\(per_device_train_batch_size=3\).*divisor of the 8"):
        simulate_step(TINY_CONFIG, per_device_train_batch_size=3)
    with pytest.raises(Reached):  # None: all completions at once
        simulate_step(TINY_CONFIG, per_device_train_batch_size=None)


# ------------------------------------------------------------------------ full fine-tuning before Ampere, the context

def test_full_fine_tuning_before_ampere_plans_and_loads_float32(monkeypatch):
    """float16 weights cannot hold the small updates (train() refuses to train them): full fine-tuning on a
    T4 or V100 loads and plans float32, and an explicit float16 is refused before loading or planning."""
    import transformers

    from grpo_nb import setup_reasoning_model

    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    assert default_dtype("cuda", full_fine_tuning=True) == resolve_dtype("auto", "cuda", full_fine_tuning=True) \
        == torch.float32
    assert default_dtype("cuda") == torch.float16  # LoRA: the adapters train in float32 over float16 weights
    loaded = {}

    def load(path, **kwargs):
        loaded.update(kwargs)
        raise Reached

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: SimpleNamespace(max_position_embeddings=32768))  # Qwen2.5-1.5B's window
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    with pytest.raises(Reached):
        setup_reasoning_model("Qwen/Qwen2.5-1.5B-Instruct", lora_rank=None, device="cuda")
    assert loaded["dtype"] == torch.float32
    for dtype in ("float16", torch.float16):
        with pytest.raises(ValueError, match=r"setup_reasoning_model\(dtype=.*\) is invalid: expected 'auto', "
                                             r"'float32' or 'bfloat16' with lora_rank=None"):
            setup_reasoning_model("Qwen/Qwen2.5-1.5B-Instruct", lora_rank=None, dtype=dtype, device="cuda")
    plan = plan_for_gpu("T4", TINY_CONFIG, lora_rank=None, load_in_4bit=False, max_completion_length=256)
    assert plan.fits and plan.settings["dtype"] == "fp32"
    assert plan_for_gpu("A100", TINY_CONFIG, lora_rank=None, load_in_4bit=False,
                        max_completion_length=256).settings["dtype"] == "bf16"
    for func, call in (("plan_for_gpu", lambda: plan_for_gpu("T4", TINY_CONFIG, lora_rank=None, dtype="fp16")),
                       ("estimate_vram", lambda: estimate_vram(TINY_CONFIG, lora_rank=None, dtype="float16"))):
        with pytest.raises(ValueError, match=rf"{func}\(dtype='(fp|float)16'\) is invalid: expected 'fp32' or "
                                             r"'bf16' with lora_rank=None"):
            call()


def test_a_size_in_gib_says_what_it_plans_and_must_exceed_the_cuda_context():
    plan = plan_for_gpu(15, TINY_CONFIG, max_completion_length=256)
    assert plan.settings["dtype"] == "bf16" and "15 GiB is a size, not a card" in repr(plan)
    assert not plan_for_gpu(15, TINY_CONFIG, max_completion_length=256, dtype="fp16").notes  # the user's dtype
    assert not plan_for_gpu("T4", TINY_CONFIG, max_completion_length=256).notes
    for gib in (0.5, 0.6):
        with pytest.raises(ValueError, match=rf"plan_for_gpu\(gpu={gib}\) is invalid: expected more than the 0.6 "
                                             r"GiB that the CUDA context"):
            plan_for_gpu(gib, TINY_CONFIG)


def test_the_planner_stays_within_the_models_context(monkeypatch):
    """Prompt plus completion beyond max_position_embeddings is a run train() refuses (or one on positions the
    model never saw): plan_for_gpu leaves such candidates out and says so; the estimate and the simulation
    refuse such a length, naming it."""
    small = {**TINY_CONFIG, "max_position_embeddings": 2048}
    plan = plan_for_gpu("H100", small, max_prompt_length=256)
    assert plan.fits and plan.settings["max_completion_length"] == 1024
    assert all(length <= 1792 for length, *_ in plan.tried)
    assert "max_completion_length 32768, 16384, 8192, 4096, 2048 not tried: beyond the model's context window " \
           "of 2048 tokens (its config's max_position_embeddings) beside max_prompt_length=256" in repr(plan)
    with pytest.raises(ValueError, match=r"plan_for_gpu\(max_completion_length=4096\) is invalid: expected at most "
                                         r"1792 tokens: the model's context window of 2048"):
        plan_for_gpu("H100", small, max_completion_length=4096)
    with pytest.raises(ValueError, match=r"plan_for_gpu\(max_prompt_length=2048\) is invalid: expected less than"):
        plan_for_gpu("H100", small, max_prompt_length=2048)
    monkeypatch.setattr(simulate_module, "AllocationTracker", reach)
    for func, call in (("estimate_vram", estimate_vram), ("simulate_step", simulate_step)):
        with pytest.raises(ValueError, match=rf"{func}\(max_prompt_length=256, max_completion_length=8192\) is "
                                             r"invalid: 256 \+ 8192 = 8448 tokens is beyond the model's context "
                                             r"window of 2048 .*max_completion_length to 1792 or less"):
            call(small, max_completion_length=8192)
        with pytest.raises(Reached if func == "simulate_step" else AssertionError):
            assert call(small, max_completion_length=1792) is None  # the whole window is fine


def test_a_kernel_self_test_decides_once_and_gives_no_verdict_out_of_memory_or_inside_a_capture(monkeypatch):
    """`grpo_nb.kernels.self_tested`, which every Triton kernel passes before a GPU trusts it."""
    from grpo_nb.kernels import self_tested

    calls, verdicts = [], {}

    def check(result):
        def run():
            calls.append(result)
            if isinstance(result, BaseException):
                raise result
            return result
        return run

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert not self_tested(verdicts, ("cuda:0", 64), "k", "the ops", check(torch.OutOfMemoryError("full")))
    assert verdicts == {} and len(calls) == 1  # no verdict: asked again next time
    capturing[0] = True
    assert not self_tested(verdicts, ("cuda:0", 64), "k", "the ops", check(True))
    assert verdicts == {} and len(calls) == 1  # not run inside a capture
    capturing[0] = False
    assert self_tested(verdicts, ("cuda:0", 64), "k", "the ops", check(True))
    assert self_tested(verdicts, ("cuda:0", 64), "k", "the ops", check(False)) and len(calls) == 2  # kept
    for result, reason in ((False, "differ from the PyTorch reference"), ("no", "differ from the PyTorch reference"),
                           (torch.tensor(float("nan")), "differ"), (RuntimeError("out of resource"),
                                                                          "RuntimeError: out of resource")):
        with pytest.warns(RuntimeWarning, match=f"grpo-nb's k failed its self-test on cuda:1 .*{reason}.*the ops"):
            assert not self_tested(verdicts, ("cuda:1", id(result)), "k", "the ops", check(result))
