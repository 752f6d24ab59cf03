"""Memory accounting during training and the VRAM planner, held against each other.

The planner (`estimate_vram`) builds the architecture on the meta device and works out each
category from shapes; the accounting (`MemoryTracker`, in every history record) counts tensors
and reads the process's peaks. Here: the counts agree exactly on tiny models, and on real CPU
runs of the embedded default the planner's peak is within 15% of the measured one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_nb.attachments import attachments
from grpo_nb.memory import CATEGORIES, GiB, estimate_vram, kv_cache_bytes, model_bytes
from grpo_nb.planning import estimated_longest_completion, plan_for_gpu
from tiny_models import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _lora(model, r=8):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=r, target_modules="all-linear", task_type="CAUSAL_LM"))


@pytest.mark.parametrize("tied", [True, False])
def test_planner_counts_equal_the_real_models_tensors(tied):
    model = _lora(tiny_model("llama", tied=tied))
    counted = model_bytes(model)
    est = estimate_vram(tiny_config("llama", tied=tied), lora_rank=8, dtype="fp32", device="cpu", max_prompt_length=64,
                        max_completion_length=64)
    assert est["trainable"] == counted["trainable"] > 0
    assert est["base_weights"] == counted["base_weights"]  # tiny Llama has no buffers that persist
    assert est["optimizer"] == 2 * counted["trainable"] == est["gradients"] * 2


def test_planner_counts_4bit_weights_like_bitsandbytes():
    pytest.importorskip("bitsandbytes", reason="4-bit layers come from bitsandbytes (the dev extra installs it)")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = tiny_config("qwen2", tied=False)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, quantization_config=q, device_map={"": "cpu"},
                                                     dtype=torch.float32)
    counted = model_bytes(_lora(model))
    est = estimate_vram(cfg, lora_rank=8, load_in_4bit=True, dtype="fp32", device="cpu", max_prompt_length=64,
                        max_completion_length=64)
    assert est["trainable"] == counted["trainable"]
    # Packed weights exactly; bitsandbytes' per-tensor constants (code books) are the difference.
    assert abs(est["base_weights"] - counted["base_weights"]) / counted["base_weights"] < 0.10
    full = estimate_vram(cfg, lora_rank=8, dtype="fp32", device="cpu", max_prompt_length=64,
                         max_completion_length=64)
    assert est["base_weights"] < 0.6 * full["base_weights"]


def test_kv_cache_bytes_equal_generates_cache():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 500, (3, 17))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    layers = cache.layers if hasattr(cache, "layers") else None
    tensors = [t for layer in layers for t in (layer.keys, layer.values)] if layers else \
        [t for kv in cache.to_legacy_cache() for t in kv]
    assert kv_cache_bytes(model.config, 3, 17, 4) == sum(t.numel() * t.element_size() for t in tensors)


def test_estimates_move_the_right_way():
    name = "Qwen/Qwen2.5-1.5B-Instruct"
    base = dict(max_prompt_length=256, max_completion_length=1024, num_generations=8, load_in_4bit=True)
    ours, trl = estimate_vram(name, **base), estimate_vram(name, system="trl", **base)
    assert set(ours.categories) == set(CATEGORIES)
    # TRL 1.16 builds no full logits either; the difference is in the layers' recompute.
    assert ours.total < 0.7 * trl.total and ours["activations"] < 0.4 * trl["activations"]
    longer = estimate_vram(name, **{**base, "max_completion_length": 4096})
    assert longer.total > ours.total and longer["kv_cache"] > 3 * ours["kv_cache"]
    assert estimate_vram(name, **{**base, "load_in_4bit": False})["base_weights"] > 2.5 * ours["base_weights"]
    plain = estimate_vram(name, gradient_checkpointing=True, **base)
    assert plain["activations"] > ours["activations"]  # offloading moves the layer inputs to the CPU
    # Micro-batching: more generations with the same micro-batch grow the KV cache, not the activations.
    more = estimate_vram(name, per_device_train_batch_size=8, **{**base, "num_generations": 16})
    assert more["activations"] == ours["activations"] and more["kv_cache"] > ours["kv_cache"]
    assert "Peak" in ours.table(trl) and "x |" in ours.table(trl)


def test_estimate_from_a_config_dict_a_model_and_bad_input():
    d = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    a = estimate_vram(d, dtype="fp32", device="cpu")
    b = estimate_vram(tiny_model("llama"), dtype="fp32", device="cpu", max_prompt_length=64,
                      max_completion_length=64)
    assert a["base_weights"] == b["base_weights"]
    with pytest.raises(ValueError, match="model_type"):
        estimate_vram({"hidden_size": 64})
    with pytest.raises(ValueError, match=r"estimate_vram\(system='vllm'\) is invalid"):
        estimate_vram(d, system="vllm")
    with pytest.raises(ValueError, match="no config for 'no/such-model'"):
        estimate_vram("no/such-model")
    with pytest.raises(ValueError, match="load_in_4bit needs lora_rank"):
        estimate_vram(d, load_in_4bit=True, lora_rank=None)


def test_plan_for_gpu():
    plan = plan_for_gpu("T4", "Qwen/Qwen2.5-1.5B-Instruct")
    assert plan.fits and plan.estimate.total <= plan.budget_bytes < 15 * GiB
    bigger = plan_for_gpu("A100-80GB", "Qwen/Qwen2.5-1.5B-Instruct")
    assert bigger.settings["max_completion_length"] >= plan.settings["max_completion_length"]
    assert not plan_for_gpu(2, "meta-llama/Llama-3.1-8B-Instruct").fits
    with pytest.raises(ValueError, match=r"plan_for_gpu\(gpu='TPU'\) is invalid: expected a GPU name"):
        plan_for_gpu("TPU")
    # 8 generations of Llama-3.1-8B in 15 GB, micro-batches of 1: TRL's generation batch holds every
    # group's KV cache at once; grpo-nb decodes one completion at a time (rollout_max_rows=1).
    kw = dict(load_in_4bit=True, per_device_train_batch_size=1, lengths=[1024 * i for i in range(1, 129)])
    ours = estimated_longest_completion(15, "meta-llama/Llama-3.1-8B-Instruct", rollout_max_rows=1, **kw)
    trl = estimated_longest_completion(15, "meta-llama/Llama-3.1-8B-Instruct", system="trl", gradient_checkpointing=True, **kw)
    assert ours >= 4 * trl > 0


def test_plan_checked_by_a_simulation():
    plan = plan_for_gpu(3, "Qwen/Qwen2.5-0.5B-Instruct", num_generations=(4,), max_completion_length=(512, 256),
                        load_in_4bit=(True,), max_prompt_length=64, simulate=True)
    assert plan.fits and plan.simulated is not None and plan.simulated.peak <= plan.budget_bytes
    assert plan.simulated.settings["max_completion_length"] == plan.settings["max_completion_length"]
    assert "simulated" in repr(plan)


@pytest.mark.parametrize("system", ["grpo_nb", "trl"])
def test_planner_within_10_percent_of_the_simulated_step(system):
    """estimate_vram against the real step run on the meta device (grpo_nb.simulate), mid-size shapes.

    benchmarks/simulated_memory.py holds the same at the seeds' full configurations."""
    from grpo_nb.simulate import simulate_step

    for model, kw in [("Qwen/Qwen2.5-0.5B-Instruct", dict(max_prompt_length=128, max_completion_length=896,
                                                          num_generations=4, per_device_train_batch_size=2)),
                      ("meta-llama/Llama-3.2-1B-Instruct", dict(max_prompt_length=64, max_completion_length=448,
                                                                num_generations=4, load_in_4bit=True))]:
        checkpointing = "offload" if system == "grpo_nb" else True
        simulated = simulate_step(model, system=system, gradient_checkpointing=checkpointing, **kw)
        estimate = estimate_vram(model, system=system, gradient_checkpointing=checkpointing, **kw)
        assert abs(estimate.total - simulated.peak) <= 0.10 * simulated.peak, (model, estimate.total, simulated.peak)
        assert estimate["base_weights"] == pytest.approx(simulated["base_weights"], rel=1e-3)
        assert estimate["trainable"] == simulated["trainable"] and estimate["optimizer"] == simulated["optimizer"]


# --------------------------------------------------------------------------------------
# Real runs on the embedded default, each in a fresh process

_RUN = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(2)
    from grpo_nb import setup_reasoning_model, train
    from grpo_nb.data import arithmetic_dataset
    from grpo_nb.memory import estimate_vram
    G, MICRO, C, P = (int(a) for a in sys.argv[1:5])
    # checkpointed, as the estimate below (a CPU run set up with "auto" may train without: models.checkpointing_for)
    model, tok = setup_reasoning_model(seed=0, max_seq_length=P + C, gradient_checkpointing=True)
    # Prompts padded to exactly P tokens, completions forced to C tokens: the planner's worst case.
    ds = [{"prompt": " ".join(["seven"] * (P - 40)), "answer": "1"} for _ in range(4)]
    hist = train(model, tok, ds, lambda completions, **k: [float(len(c)) for c in completions],
                 max_steps=1, num_generations=G, per_device_train_batch_size=MICRO,
                 gradient_accumulation_steps=G // MICRO, max_completion_length=C, max_prompt_length=P,
                 generation_kwargs={"min_new_tokens": C}, save_steps=0, output_dir=sys.argv[5], verbose=False)
    r = hist[-1]
    est = estimate_vram(model, max_prompt_length=P,
                        max_completion_length=C, num_generations=G, per_device_train_batch_size=MICRO,
                        dtype="fp32", gradient_checkpointing=True, device="cpu")
    print(json.dumps({"measured": r["memory"], "estimate": est.categories, "estimate_total": est.total}))
""")


def _run(tmp_path, g, micro, c, p=128):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _RUN, str(g), str(micro), str(c), str(p), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mem")
    return {"g4": _run(tmp, 4, 4, 64), "g8": _run(tmp, 8, 4, 64)}


def test_records_carry_every_category(runs):
    m = runs["g4"]["measured"]
    assert set(CATEGORIES) <= set(m) and all(m[k] >= 0 for k in CATEGORIES)
    assert m["peak"] == max(m["rollout_peak"], m["update_peak"]) > m["base_weights"] > 500 * 2**20
    static = m["base_weights"] + m["trainable"] + m["optimizer"]
    dynamic = max(m["kv_cache"], m["gradients"] + m["activations"] + m["logprob_scratch"])
    assert static + dynamic + m["other"] == m["peak"]
    assert m["trainable"] > 0 and m["optimizer"] == 2 * m["trainable"] == 2 * m["gradients"]
    assert m["activations"] > 0 and m["kv_cache"] > 0


@pytest.mark.parametrize("run", ["g4", "g8"])
def test_planner_within_15_percent_of_measured_peak(runs, run):
    r = runs[run]
    measured, estimate = r["measured"]["peak"], r["estimate_total"]
    assert abs(estimate - measured) / measured <= 0.15, (estimate / 2**20, measured / 2**20)


def test_update_memory_does_not_grow_with_num_generations(runs):
    # Same micro-batch (4 completions), twice the generations: the update's activations stay put.
    a, b = runs["g4"]["measured"]["activations"], runs["g8"]["measured"]["activations"]
    assert b < 1.3 * a + 32 * 2**20, (a / 2**20, b / 2**20)


def test_records_report_offloaded_layer_inputs(tmp_path):
    from grpo_nb import enable_offloaded_checkpointing, train
    from grpo_nb.models import prepare_tokenizer
    from tiny_models import tiny_tokenizer

    model = tiny_model("llama")
    model.generation_config.eos_token_id = 2
    model = _lora(model)
    enable_offloaded_checkpointing(model)
    model.train()
    data = [{"prompt": "w5 w6 w7"}, {"prompt": "w9 w10"}]
    hist = train(model, prepare_tokenizer(tiny_tokenizer()), data, lambda completion_ids, **k: [float(sum(c) % 5)
                 for c in completion_ids], max_steps=2, num_generations=4, per_device_train_batch_size=4,
                 max_completion_length=6, max_prompt_length=8, save_steps=0, output_dir=str(tmp_path), verbose=False)
    for r in hist:
        m = r["memory"]
        # Two layers, each input [4, prompt + completion, 64] fp32, offloaded for the micro-batch.
        assert 2 * 4 * 8 * 64 * 4 <= m["offloaded_peak"] <= 2 * 4 * 14 * 64 * 4, m["offloaded_peak"]
    assert attachments(model).offloader.stats()["offloaded_bytes"] == 0  # nothing left behind
