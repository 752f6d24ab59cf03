"""The user's whole path on a CUDA GPU: setup_reasoning_model -> train() -> save -> load, on a tiny model.

Every other test runs on the CPU; these run only where a GPU is (benchmarks/README.md says how a lent GPU
machine runs them). The dtypes are the cards': bf16 (Ampere and newer), fp16 with its loss scaler (a T4, which
has no bf16), and QLoRA's NF4 base through bitsandbytes. What the CPU cannot check is what they hold: the
CUDA-graph decode, the Triton log-prob kernels, offloaded checkpointing and the 4-bit matmuls inside one real
step, with finite losses, moved weights and an adapter that loads back.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = [
    pytest.param({"dtype": "bfloat16"}, id="bf16"),
    pytest.param({"dtype": "float16"}, id="fp16-T4-path"),
    pytest.param({"dtype": "float16", "load_in_4bit": True}, id="qlora-fp16"),
]


@pytest.mark.parametrize("setup", CASES)
def test_train_saves_and_loads_on_cuda(saved_base, tmp_path, setup):
    if setup.get("load_in_4bit") and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("load_in_4bit needs bitsandbytes")
    from grpo_nb.hardware import native_bf16

    if setup["dtype"] == "bfloat16" and not native_bf16("cuda"):  # torch's is_bf16_supported() counts emulation
        pytest.skip("this GPU has no bf16 of its own (a T4 emulates it)")
    from grpo_nb import load_for_inference, save_adapter, setup_reasoning_model, train
    from grpo_nb.attachments import base_model
    from tiny_models import FAST, dataset, token_id_reward

    model, tok = setup_reasoning_model(saved_base, device="cuda", lora_rank=8, max_seq_length=64, **setup)
    assert next(model.parameters()).device.type == "cuda"
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    history = train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "run"), verbose=False,
                    live=False, **{**FAST, "max_steps": 3, "learning_rate": 5e-2})
    assert len(history) == 3
    assert all(math.isfinite(r["loss"]) for r in history if not r.get("skipped")), history
    assert not all(r.get("skipped") for r in history), "every step was skipped (non-finite gradients)"
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])]
    assert moved, "no LoRA weight changed in three steps"
    assert base_model(model).config.pad_token_id is not None
    save_adapter(model, tmp_path / "adapter", tok)
    loaded, _ = load_for_inference(tmp_path / "adapter", device="cuda", dtype=setup["dtype"])
    ids = tok("w5 w6 w7", return_tensors="pt").to("cuda")
    model.eval()
    with torch.no_grad():
        ours, theirs = model(**ids).logits.float(), loaded(**ids).logits.float()
    assert torch.isfinite(theirs).all()
    if not setup.get("load_in_4bit"):  # a 4-bit base differs from the 16-bit one load_for_inference loads
        assert torch.allclose(ours, theirs, atol=5e-2, rtol=5e-2), (ours - theirs).abs().max()


def test_train_decodes_from_a_cuda_graph(saved_base, tmp_path, monkeypatch):
    """train() on CUDA decodes from a CUDA graph (the engine's default there), with no fallback warning."""
    import warnings

    from grpo_nb import setup_reasoning_model, train
    from grpo_nb.rollout.engine import RolloutEngine
    from tiny_models import FAST, dataset, token_id_reward

    seen, call = [], RolloutEngine.__call__

    def spy(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        seen.append(self.last_stats["decode"])
        return out

    monkeypatch.setattr(RolloutEngine, "__call__", spy)
    model, tok = setup_reasoning_model(saved_base, device="cuda", lora_rank=8, max_seq_length=64, dtype="float16")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*falls back.*")
        train(model, tok, dataset(), token_id_reward, output_dir=str(tmp_path / "run"), verbose=False, live=False,
              **{**FAST, "max_steps": 1})
    assert seen and set(seen) == {"cuda_graph"}, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16-T4-path"])
def test_graph_decode_lora_branch_in_model_dtype(dtype):
    """The CUDA-graph rollout with the LoRA branch in the model's dtype: its log-probs stay within 16-bit rounding
    of the training forward's, as close as the exact branch's (exact_adapters) are on this card."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from grpo_nb import lora
    from grpo_nb.logprobs import completion_logprobs
    from grpo_nb.rollout import RolloutEngine
    from tiny_models import tiny_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    lora.register(config)
    model = get_peft_model(tiny_model("llama", seed=4).to(device="cuda", dtype=dtype), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    ids = torch.randint(3, 500, (2, 10), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    gaps = {}
    for exact in (True, False):
        engine = RolloutEngine(max_completion_length=12, min_new_tokens=12, seed=0, decode="cuda_graph",
                               exact_adapters=exact)
        out = engine(model, tok, ids, torch.ones_like(ids), 2)
        assert engine.last_stats["decode"] == "cuda_graph"
        with torch.no_grad():
            forward = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                          out.completion_mask, backend="torch")
        gaps[exact] = (out.sampling_logprobs - forward).abs()
    assert gaps[False].max() <= max(0.1, 2 * gaps[True].max()) and gaps[False].mean() <= 0.02 + gaps[True].mean()
