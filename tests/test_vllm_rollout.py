"""The vLLM rollout backend against an in-process vLLM stand-in (tests/fake_vllm.py).

vLLM itself cannot be installed here; these tests pin the seam contract, the parameter
mapping, the LoRA sync (a new adapter id each call, outputs follow the live weights) and the
sleep/wake discipline, on real samples from a tiny HF model.
"""

import sys

import pytest
import torch

import fake_vllm
from grpo_nb.attachments import attachments
from grpo_nb.rollout import RolloutBatch
from grpo_nb.rollout.vllm_backend import VLLMRollout, vllm_available
from tiny_models import tiny_tokenizer

# A generous EOS set so that, with 10-token completions, some rows end and some are cut.
EOS_IDS = [2, *range(4, 60)]


@pytest.fixture
def vllm(monkeypatch):
    return fake_vllm.install(monkeypatch)


def _peft(path, rank=4):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base.generation_config.eos_token_id = EOS_IDS
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", init_lora_weights=False))
    return model.eval()


def _prompts():
    # Ragged, left-padded: lengths 3, 5, 1.
    ids = torch.tensor([[0, 0, 100, 101, 102], [200, 201, 202, 203, 204], [0, 0, 0, 0, 300]])
    return ids, (ids != 0).long()


def _rollout(model, vllm, **kw):
    llm = vllm.LLM(model=str(model.get_base_model().name_or_path), enable_lora=True, enable_sleep_mode=True)
    knobs = dict(max_completion_length=10, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                 seed=7)
    knobs.update(kw)
    return VLLMRollout(model, None, llm=llm, **knobs), llm


def _live_logprobs(model, batch, temperature=1.0):
    """log_softmax(logits / T) of each completion token under the live (LoRA) model, one row at a time."""
    out = torch.zeros(batch.completion_ids.shape)
    for i in range(batch.completion_ids.shape[0]):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        n = int(batch.completion_mask[i].sum())
        ids = torch.cat([prompt, batch.completion_ids[i, :n]])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / temperature
        out[i, :n] = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    return out


def test_seam_shapes_masks_eos_truncation_and_groups(vllm, saved_base):
    model, tok = _peft(saved_base), tiny_tokenizer()
    rollout, llm = _rollout(model, vllm)
    ids, mask = _prompts()
    out = rollout(model, tok, ids, mask, 4)
    assert isinstance(out, RolloutBatch)
    n, tc = out.completion_ids.shape
    assert n == 12 and 1 <= tc <= 10
    # Prompts repeated per generation, groups adjacent, padding kept.
    assert torch.equal(out.prompt_ids, ids.repeat_interleave(4, 0))
    assert torch.equal(out.prompt_mask, mask.repeat_interleave(4, 0))
    # vLLM got one request per prompt with n=G, left padding stripped.
    call = llm.generate_calls[0]
    assert [p["prompt_token_ids"] for p in call["prompts"]] == [[100, 101, 102], [200, 201, 202, 203, 204], [300]]
    assert call["sampling_params"].n == 4
    # Rows equal the engine's completions in order (prompt-major, generation-minor).
    raw = [c.token_ids for r in _replay(llm, 0) for c in r.outputs]
    for i, r in enumerate(raw):
        k = int(out.completion_mask[i].sum())
        assert out.completion_ids[i, :k].tolist() == r[:k]
        assert (out.completion_ids[i, k:] == tok.pad_token_id).all()  # right-padded with pad
        has_eos = any(t in EOS_IDS for t in r)
        assert bool(out.truncated[i]) == (not has_eos)
        if has_eos:  # mask through the first EOS, inclusive
            assert out.completion_ids[i, k - 1].item() in EOS_IDS and len(r) == k
        else:
            assert k == len(r) == 10
    assert out.truncated.any() and (~out.truncated).any(), "the fixture should give both ended and cut rows"
    # Within each group the samples differ (n independent samples, not one copied).
    for g in range(3):
        rows = {tuple(out.completion_ids[4 * g + j].tolist()) for j in range(4)}
        assert len(rows) > 1


def _replay(llm, k):
    """Re-run generate call k on the fake (deterministic: seeded) to see the raw engine outputs."""
    return llm.replay(k)


def test_sampling_params_map_from_our_knobs(vllm, saved_base):
    model = _peft(saved_base)
    ids, mask = _prompts()
    rollout, llm = _rollout(model, vllm, temperature=0.7, top_p=0.9, top_k=0, min_p=None, repetition_penalty=1.1,
                            max_completion_length=6, seed=3)
    rollout(model, tiny_tokenizer(), ids, mask, 2)
    sp = llm.generate_calls[0]["sampling_params"]
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.max_tokens) == \
        (2, 0.7, 0.9, -1, 0.0, 1.1, 6)
    assert sp.stop_token_ids == EOS_IDS and sp.seed == 3
    assert sp.logprobs is None  # T != 1 under raw logprobs: not the distribution we need
    rollout.configure(top_k=20, min_p=0.05, temperature=1.0)
    rollout(model, tiny_tokenizer(), ids, mask, 2)
    sp2 = llm.generate_calls[1]["sampling_params"]
    assert (sp2.top_k, sp2.min_p, sp2.logprobs) == (20, 0.05, 0)
    assert sp2.seed != sp.seed  # a fresh seed per step, not the same samples again
    with pytest.raises(TypeError, match="unknown knobs"):
        rollout.configure(temprature=1.0)


def test_processed_logprobs_mode_used_only_without_filters(vllm, saved_base):
    model = _peft(saved_base)
    rollout, _ = _rollout(model, vllm, temperature=0.7, logprobs_mode="processed_logprobs")
    assert rollout.returns_logprobs()
    rollout.configure(top_p=0.9)
    assert not rollout.returns_logprobs()
    rollout.configure(top_p=1.0, repetition_penalty=1.1)
    assert not rollout.returns_logprobs()


def test_lora_synced_every_call_new_id_and_outputs_follow_live_weights(vllm, saved_base, tmp_path):
    model, tok = _peft(saved_base), tiny_tokenizer()
    rollout, llm = _rollout(model, vllm, adapter_dir=tmp_path / "adapter")
    ids, mask = _prompts()
    first = rollout(model, tok, ids, mask, 2)
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert torch.allclose(first.sampling_logprobs, _live_logprobs(model, first), atol=1e-5)

    # Change the LoRA weights (as an optimizer step would) and roll out again.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    second = rollout(model, tok, ids, mask, 2)
    ids_used = [c["lora_request"].lora_int_id for c in llm.generate_calls]
    assert ids_used == [1, 2] and ("load_lora", 2) in llm.calls  # a new id: vLLM re-reads the adapter
    assert all(c["lora_request"].lora_path == str(tmp_path / "adapter") for c in llm.generate_calls)
    # The engine's logprobs are the NEW live model's, not the first adapter's (no stale copy).
    assert torch.allclose(second.sampling_logprobs, _live_logprobs(model, second), atol=1e-5)
    stale = llm.replay(1, lora_request=llm.generate_calls[0]["lora_request"])  # same seed, old adapter
    assert [c.token_ids for r in stale for c in r.outputs] != \
        [c.token_ids for r in _replay(llm, 1) for c in r.outputs]


def test_sampling_logprobs_positions_and_padding(vllm, saved_base):
    model, tok = _peft(saved_base), tiny_tokenizer()
    rollout, llm = _rollout(model, vllm)
    ids, mask = _prompts()
    out = rollout(model, tok, ids, mask, 3)
    assert out.sampling_logprobs is not None and out.sampling_logprobs.shape == out.completion_ids.shape
    assert (out.sampling_logprobs[out.completion_mask == 0] == 0).all()
    assert (out.sampling_logprobs[out.completion_mask == 1] < 0).all()
    raw = [c for r in _replay(llm, 0) for c in r.outputs]
    for i, c in enumerate(raw):
        for j, (t, step) in enumerate(zip(c.token_ids, c.logprobs)):
            assert out.sampling_logprobs[i, j].item() == pytest.approx(step[t].logprob, abs=1e-6)
    assert torch.allclose(out.sampling_logprobs, _live_logprobs(model, out), atol=1e-5)


def test_no_logprobs_when_temperature_is_not_one(vllm, saved_base):
    model, tok = _peft(saved_base), tiny_tokenizer()
    rollout, _ = _rollout(model, vllm, temperature=0.8)
    ids, mask = _prompts()
    assert rollout(model, tok, ids, mask, 2).sampling_logprobs is None  # the trainer recomputes


def test_wake_before_and_sleep_after_each_generate(vllm, saved_base):
    model, tok = _peft(saved_base), tiny_tokenizer()
    rollout, llm = _rollout(model, vllm)
    ids, mask = _prompts()
    rollout(model, tok, ids, mask, 2)
    rollout(model, tok, ids, mask, 2)
    events = [e for e, _ in llm.calls if e in ("sleep", "wake_up", "generate")]
    assert events == ["sleep", "wake_up", "generate", "sleep", "wake_up", "generate", "sleep"]
    assert all(level == 1 for e, level in llm.calls if e == "sleep")
    assert llm.asleep


def test_engine_is_put_back_to_sleep_when_generate_fails(vllm, saved_base):
    model, tok = _peft(saved_base), tiny_tokenizer()
    rollout, llm = _rollout(model, vllm)

    def boom(*a, **k):
        raise RuntimeError("engine died")

    llm.generate = boom
    with pytest.raises(RuntimeError, match="engine died"):
        rollout(model, tok, *_prompts(), 2)
    assert llm.asleep


def test_builds_llm_on_the_base_weights(vllm, saved_base):
    model = _peft(saved_base, rank=4)
    rollout = VLLMRollout(model, None, max_completion_length=5, gpu_memory_utilization=0.3, max_model_len=64)
    llm = rollout.llm
    kw = llm.kwargs
    assert kw["model"] == str(saved_base) and kw["enable_lora"] and kw["enable_sleep_mode"]
    assert kw["max_lora_rank"] == 8  # rank 4 rounded up to a value vLLM accepts
    assert kw["gpu_memory_utilization"] == 0.3 and kw["max_model_len"] == 64 and kw["dtype"] == "float32"
    assert kw["logprobs_mode"] == "raw_logprobs"
    assert llm.asleep  # memory handed back to training right after the build


def test_full_fine_tuning_is_not_implemented(vllm, saved_base):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_base)
    with pytest.raises(NotImplementedError, match="rollout='native'"):
        VLLMRollout(model, None, max_completion_length=5)
    assert fake_vllm.LLM.instances == []  # refused before building an engine


def test_missing_vllm_raises_clear_error_before_loading(monkeypatch):
    import transformers

    from grpo_nb.models import setup_reasoning_model

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    if vllm_available():
        pytest.skip("vLLM is installed here")

    def no_loading(*a, **k):
        raise AssertionError("loaded a model before checking for vLLM")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    with pytest.raises(ImportError, match=r"pip install 'grpo-nb\[vllm\]'"):
        setup_reasoning_model("some/model", fast_inference=True, device="cpu")


def test_fast_inference_full_fine_tune_refused_before_loading(vllm, monkeypatch):
    import transformers

    from grpo_nb.models import setup_reasoning_model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(NotImplementedError, match="lora_rank"):
        setup_reasoning_model("some/model", fast_inference=True, lora_rank=None, device="cpu")


def test_setup_reasoning_model_fast_inference_attaches_rollout(vllm, saved_base):
    from grpo_nb.models import setup_reasoning_model

    model, tok = setup_reasoning_model(saved_base, fast_inference=True, gpu_memory_utilization=0.4, lora_rank=8,
                                       max_seq_length=128, gradient_checkpointing=False, device="cpu")
    rollout = attachments(model).rollout
    assert isinstance(rollout, VLLMRollout) and attachments(model).rollout is rollout
    assert rollout.llm.kwargs["gpu_memory_utilization"] == 0.4 and rollout.llm.kwargs["max_model_len"] == 128
    assert rollout.llm.kwargs["model"] == str(saved_base) and rollout.llm.asleep
    rollout.configure(max_completion_length=4)
    ids, mask = _prompts()
    out = rollout(model, tok, ids, mask, 2)
    assert out.completion_ids.shape[0] == 6 and out.completion_ids.shape[1] <= 4
    plain, _ = setup_reasoning_model(saved_base, lora_rank=8, gradient_checkpointing=False, device="cpu")
    assert attachments(plain).rollout is None
