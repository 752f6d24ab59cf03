"""The attention kernel each card runs (grpo_nb.attention) and what the memory simulation counts for it.

No GPU here: the kernel rule is held to PyTorch's selection rules case by case, gqa_safe_sdpa to transformers'
own sdpa attention on the CPU (the card's answer forced), and the simulation's count to what each kernel holds.
"""

import pytest
import torch

from grpo_nb import attention
from grpo_nb.attention import EFFICIENT, FLASH, MATH, cuda_sdpa_kernel
from tiny_models import tiny_model

T4, P100, A100, H100 = (7, 5), (6, 0), (8, 0), (9, 0)
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.mark.parametrize("capability, dtype, head_dim, mask, grouped, kernel", [
    (A100, BF16, 128, False, True, FLASH),        # flash takes grouped keys
    (H100, F16, 256, False, False, FLASH),
    (A100, BF16, 128, True, True, MATH),          # a mask rules out flash, grouped keys the efficient kernel
    (A100, BF16, 128, True, False, EFFICIENT),
    (A100, F32, 128, False, True, MATH),          # fp32: no flash on any card
    (A100, F32, 128, False, False, EFFICIENT),
    (A100, BF16, 320, False, False, EFFICIENT),   # head_dim > 256: no flash
    (T4, F16, 128, False, True, MATH),            # sm75: no flash (transformers issue 48633)
    (T4, F16, 128, False, False, EFFICIENT),
    (T4, BF16, 128, False, False, MATH),          # no bf16 in the efficient kernel before sm80
    (T4, F16, 100, False, False, MATH),           # head_dim not a multiple of 8
    (P100, F32, 64, True, False, EFFICIENT),
    ((8, 6), BF16, 200, False, False, EFFICIENT),  # flash trains no head_dim in (192, 224] on sm86/89
    ((8, 9), BF16, 256, False, False, FLASH),
])
def test_cuda_kernel_rule(capability, dtype, head_dim, mask, grouped, kernel):
    assert cuda_sdpa_kernel(capability, dtype, head_dim, mask=mask, grouped=grouped) == kernel


def sdpa_model(arch="qwen2"):
    torch.manual_seed(0)
    model = tiny_model(arch)
    model.set_attn_implementation("sdpa")
    return model.eval()


def test_gqa_safe_sdpa_equals_transformers_sdpa_where_it_repeats_keys(monkeypatch):
    stock, ours = sdpa_model(), sdpa_model()
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads
    assert attention.use_gqa_safe_sdpa(ours) and ours.config._attn_implementation == attention.NAME
    calls = []
    real = attention.repeats_keys
    monkeypatch.setattr(attention, "_capability", lambda device: T4)  # as if on a T4
    monkeypatch.setattr(attention, "repeats_keys", lambda *a: calls.append(real(*a)) or calls[-1])
    ids = torch.randint(3, 100, (2, 9))
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with torch.no_grad():
        for mask in (None, padded):
            torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits,
                                       stock(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    layers = ours.config.num_hidden_layers
    assert calls == [True] * layers + [False] * layers  # repeated without a mask only


@pytest.mark.parametrize("capability", [T4, A100, H100])
def test_keys_transformers_repeats_itself_are_not_repeated_twice(monkeypatch, capability):
    """Above head_dim 256 transformers repeats grouped keys itself (no kernel takes them grouped): gqa_safe_sdpa
    leaves them to it (Gemma 4's full-attention layers have head_dim 512)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=320, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config).eval()
    ours = AutoModelForCausalLM.from_config(config).eval()
    ours.load_state_dict(stock.state_dict())
    attention.use_gqa_safe_sdpa(ours)
    monkeypatch.setattr(attention, "_capability", lambda device: capability)
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits)
    q, k = torch.zeros(1, 4, 5, 320), torch.zeros(1, 2, 5, 320)
    assert not attention.repeats_keys(q, k, k, None)


def test_on_the_cpu_gqa_safe_sdpa_changes_nothing():
    model = sdpa_model()
    attention.use_gqa_safe_sdpa(model)
    q, k = torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8)
    assert not attention.repeats_keys(q, k, k, None)
    eager = tiny_model("llama")
    assert eager.config._attn_implementation == "eager"
    assert not attention.use_gqa_safe_sdpa(eager) and eager.config._attn_implementation == "eager"
    # a model whose attention does not go through transformers' AttentionInterface is left as it is
    model = sdpa_model()
    model._can_set_attn_implementation = lambda: False
    assert not attention.use_gqa_safe_sdpa(model) and model.config._attn_implementation == "sdpa"


def test_prepared_model_uses_it_and_its_static_cache_rollout_still_decodes():
    from grpo_nb.models import prepare_for_training
    from grpo_nb.rollout import RolloutEngine
    from grpo_nb.rollout.static_cache import static_unsupported_reason
    from tiny_models import tiny_tokenizer

    model = prepare_for_training(sdpa_model(), max_seq_length=64, lora_rank=4, gradient_checkpointing=True)
    assert model.config._attn_implementation == attention.NAME
    assert static_unsupported_reason(model) is None
    tok = tiny_tokenizer()
    ids = torch.randint(3, 100, (2, 6))
    out = RolloutEngine(max_completion_length=5, decode="static")(model, tok, ids, torch.ones_like(ids), 2)
    assert out.completion_ids.shape[0] == 4


def simulated(gpu, system="grpo_nb", dtype="fp16", length=512):
    from transformers import LlamaConfig

    from grpo_nb.simulate import simulate_step

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
    return simulate_step(config, max_prompt_length=64, max_completion_length=length, num_generations=2,
                         rollout=False, dtype=dtype, gpu=gpu, system=system, lora_rank=4,
                         gradient_checkpointing=True)


def test_simulation_counts_the_math_kernel_where_the_card_has_no_fused_one():
    """[batch, heads, T, T] fp32 scores: on a T4 TRL's unpadded GQA forward (transformers asks for grouped keys)
    takes the math kernel; grpo-nb repeats the keys and takes the memory-efficient one; bf16 on a T4 has only
    the math kernel."""
    scores = 2 * 8 * (64 + 512) ** 2 * 4
    ours_t4, trl_t4 = simulated("T4"), simulated("T4", "trl")
    ours_a100, bf16_t4 = simulated("A100", dtype="bf16"), simulated((7, 5), dtype="bf16")
    assert trl_t4.peak - ours_t4.peak > 2 * scores
    assert bf16_t4.peak - ours_a100.peak > 2 * scores
    assert ours_t4.peak - ours_a100.peak < scores / 4


def test_flash_backward_scratch_matches_its_source_sizes_and_is_counted():
    from grpo_nb.simulate.device import attention_scratch

    aten = torch.ops.aten
    # Llama-3.1-8B at 57,344 tokens: 32 query heads, 8 key heads, head_dim 128 (the ~1.9 GB of issue 27)
    q = torch.empty(1, 32, 57344, 128, dtype=BF16, device="meta")
    k = torch.empty(1, 8, 57344, 128, dtype=BF16, device="meta")
    sizes = attention_scratch(aten._scaled_dot_product_flash_attention_backward.default, (q, q, k, k))
    nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in sizes)
    assert nbytes == 57344 * 32 * 128 * 4 + 32 * 57344 * 4 + 2 * 57344 * 32 * 128 * 2
    k = torch.empty(1, 32, 57344, 128, dtype=BF16, device="meta")
    assert len(attention_scratch(aten._scaled_dot_product_flash_attention_backward.default, (q, q, k, k))) == 2
    assert attention_scratch(aten.mm.default, (q, q)) is None

    # counted at the backward: one attention call with grouped keys, forward and backward on the meta device
    q, k = torch.empty(2, 8, 576, 32, dtype=BF16), torch.empty(2, 2, 576, 32, dtype=BF16)
    one_call = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in
                   attention_scratch(aten._scaled_dot_product_flash_attention_backward.default, (q, q, k, k)))
    assert _attention_peak(attention_scratch) - _attention_peak(None) == one_call


def _attention_peak(scratch):
    import torch.nn.functional as F

    from grpo_nb.simulate.device import SimulatedDevice
    from grpo_nb.simulate.tracker import AllocationTracker

    tracker = AllocationTracker("meta")
    with tracker, tracker.outputs_only_meta_kernels(scratch=scratch), SimulatedDevice("cuda", capability=A100):
        q = torch.empty(2, 8, 576, 32, dtype=BF16, device="meta", requires_grad=True)
        k, v = (torch.empty(2, 2, 576, 32, dtype=BF16, device="meta", requires_grad=True) for _ in range(2))
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    return tracker.report().peak
