"""optim=: torch's AdamW or bitsandbytes' 8-bit / paged ones, counted by the planner and the records."""

import pytest
import torch

import grpo_nb.checkpointing as ckpt
from grpo_nb import GRPOConfig, estimate_vram, train
from grpo_nb.checkpointing import checkpoints
from grpo_nb.memory import optimizer_bytes, optimizer_state_bytes
from grpo_nb.optim import adamw
from tiny_models import FAST, dataset, token_id_reward

bnb = pytest.importorskip("bitsandbytes", reason="the 8-bit optimizers are bitsandbytes' (in the dev extra)")


@pytest.mark.parametrize("optim, expected", [("adamw_torch", torch.optim.AdamW), ("adamw_torch_fused", torch.optim.AdamW),
                                             ("adamw_8bit", "AdamW8bit"),
                                             ("adamw_bnb_8bit", "AdamW8bit"), ("paged_adamw_8bit", "AdamW8bit"),
                                             ("paged_adamw_32bit", "AdamW32bit")])
def test_each_name_builds_its_optimizer_and_the_planner_counts_its_states(optim, expected):
    """Paging has nothing to do with parameters on the CPU, so the paged names get the unpaged optimizer there."""
    params = [torch.nn.Parameter(torch.randn(512, 64)) for _ in range(3)]  # over bitsandbytes' 4096-value floor
    optimizer = adamw(params, GRPOConfig(optim=optim, learning_rate=1e-3))
    assert isinstance(optimizer, getattr(bnb.optim, expected) if isinstance(expected, str) else expected)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    n = sum(p.numel() for p in params)
    planned = optimizer_state_bytes(optim, n, n * 4)
    measured = optimizer_bytes(optimizer)
    # bitsandbytes also keeps two 256-entry fp32 code books per tensor (2 KiB), which the planner leaves out
    assert planned <= measured <= planned + 2 * 1024 * len(params) + 64 * len(params), (planned, measured)
    if "8bit" in optim:
        assert measured < 0.3 * 8 * n  # ~2 bytes per parameter instead of AdamW's 8


def test_8bit_states_take_a_quarter_in_the_estimate():
    full = estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=True).categories["optimizer"]
    small = estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=True, optim="adamw_8bit").categories["optimizer"]
    assert 0.25 <= small / full <= 0.26


def wide_lora_model():
    """LoRA matrices of 64 x 64 = 4096 values: bitsandbytes keeps smaller tensors' states in 32 bits."""
    from peft import LoraConfig, get_peft_model

    from tiny_models import tiny_model

    model = tiny_model("llama", seed=0)
    model.generation_config.eos_token_id = 2
    return get_peft_model(model, LoraConfig(r=64, lora_alpha=64, target_modules=["q_proj", "v_proj"])).train()


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_8bit"])
def test_adamw_trains_and_resumes_exactly(tok, tmp_path, optim):
    # a constant rate: the first run stops at step 2 by max_steps, so a decaying schedule would differ
    settings = dict(FAST, max_steps=4, save_steps=2, seed=3, verbose=False, live=False, optim=optim,
                    lr_scheduler_type="constant")
    unbroken_model = wide_lora_model()
    unbroken = train(unbroken_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "a"), **settings)
    assert all(r["memory"]["optimizer"] > 0 for r in unbroken)

    model = wide_lora_model()
    train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"), **{**settings, "max_steps": 2})
    state = ckpt.read_state(checkpoints(tmp_path / "b")[-1])["optimizer"]["state"]
    quantized = [v for s in state.values() for v in s.get("__bnb_optimizer_quant_state__", {}).values()
                 if torch.is_tensor(v) and v.dtype == torch.uint8]
    assert bool(quantized) == (optim == "adamw_8bit")  # the 8-bit moments are in the checkpoint
    resumed_model = wide_lora_model()
    resumed = train(resumed_model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "b"),
                    resume_from_checkpoint=True, **settings)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in unbroken]
    for (name, a), b in zip(unbroken_model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bad", ["adam", "adamw_4bit", 8, None])
def test_unknown_optimizer_names_the_option(bad):
    with pytest.raises(ValueError, match=r"optim=.*allowed: adamw_torch, adamw_torch_fused, adamw_8bit"):
        GRPOConfig(optim=bad)
    with pytest.raises(ValueError, match="optim"):
        estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", optim=bad)
