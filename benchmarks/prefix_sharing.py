"""The prompt forwarded once per group in the policy update (`GRPOConfig.prefix_sharing`, issue 30 item 3): what it
saves on this CPU and, priced by the simulation, on a T4.

    python benchmarks/prefix_sharing.py            # ~5 minutes on 2 cores; alone on the machine for the timings
    python benchmarks/prefix_sharing.py --cpu-only

1. CPU, the main job's shapes: the embedded default (SmolLM2-135M, fp32, LoRA r=16), 2 of the main job's one-shot
   arithmetic prompts x 8 completions of up to 64 tokens (random tokens, some ending early), micro-batches of 8:
   `accumulate_gradients` (the update: forward, log-probs, loss, backward) with and without sharing, interleaved,
   median of 3 after a warm-up, with and without gradient checkpointing; the gradients compared.
2. Simulated (`simulate_step`, the real update on the meta device) at the seeds' shape, Qwen2.5-1.5B QLoRA
   8 x (256 + 1024) on a T4, and with a long shared prompt (few-shot examples, tool descriptions: 1024 + 256):
   peak memory, the update's activations, and the update priced on a T4 (`SimulatedStep.time`).
Results: results/prefix_sharing.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_nb import arithmetic_dataset, setup_reasoning_model  # noqa: E402
from grpo_nb.batch import StepBatch  # noqa: E402
from grpo_nb.config import GRPOConfig  # noqa: E402
from grpo_nb.demo import DEMO_TASK  # noqa: E402
from grpo_nb.step import accumulate_gradients  # noqa: E402

G, PROMPTS, COMPLETION, REPEATS = 8, 2, 64, 3


def main_job_batch(tokenizer) -> StepBatch:
    """2 of the main job's prompts, each repeated for its 8 completions, as a rollout gives them."""
    rows = arithmetic_dataset(PROMPTS, seed=0, **DEMO_TASK)
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(100, tokenizer.vocab_size, (PROMPTS * G, COMPLETION), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    for r in range(0, PROMPTS * G, 3):  # a third end early
        completion_mask[r, 16 + r:] = 0
    return StepBatch(enc.input_ids.repeat_interleave(G, 0), enc.attention_mask.repeat_interleave(G, 0),
                     completion_ids, completion_mask, completion_mask.clone(),
                     torch.randn(PROMPTS * G, generator=g), G)


def cpu_update() -> dict:
    out = {}
    for checkpointing in (False, True):
        model, tokenizer = setup_reasoning_model(seed=0, gradient_checkpointing=checkpointing)
        batch = main_job_batch(tokenizer)
        params = [p for p in model.parameters() if p.requires_grad]
        seconds, cpu_seconds, grads = {False: [], True: []}, {False: [], True: []}, {}
        for repeat in range(REPEATS + 1):
            for share in (False, True):
                config = GRPOConfig(num_generations=G, per_device_train_batch_size=G,
                                    gradient_accumulation_steps=PROMPTS, prefix_sharing=share)
                started, cpu = time.perf_counter(), time.process_time()
                accumulate_gradients(model, params, batch, config)
                if repeat:  # the first is a warm-up
                    seconds[share].append(time.perf_counter() - started)
                    cpu_seconds[share].append(time.process_time() - cpu)
                grads[share] = torch.cat([p.grad.flatten() for p in params])
                for p in params:
                    p.grad = None
        plain, shared = statistics.median(seconds[False]), statistics.median(seconds[True])
        diff = float((grads[True] - grads[False]).abs().max() / grads[False].abs().max())
        prompt_tokens = int(batch.prompt_mask[0].sum())
        out["checkpointed" if checkpointing else "not checkpointed"] = {
            "update_seconds_plain": round(plain, 2), "update_seconds_shared": round(shared, 2),
            "speedup": round(plain / shared, 2),
            # the process's CPU time too: a machine shared with other work stretches the wall time, not this
            "update_cpu_seconds_plain": round(statistics.median(cpu_seconds[False]), 2),
            "update_cpu_seconds_shared": round(statistics.median(cpu_seconds[True]), 2), "gradient_max_abs_diff_relative": diff,
            "prompt_tokens": prompt_tokens, "prompt_width": batch.prompt_ids.shape[1],
            "tokens_forwarded_plain": batch.size * (batch.prompt_ids.shape[1] + COMPLETION),
            "tokens_forwarded_shared": PROMPTS * (batch.prompt_ids.shape[1] + G * COMPLETION)}
        print(checkpointing, out, flush=True)
    return out


def simulated() -> dict:
    from grpo_nb.simulate import simulate_step

    out = {}
    for name, prompt, completion in (("seed shape", 256, 1024), ("long shared prompt", 1024, 256)):
        row = {}
        for share in (False, True):
            sim = simulate_step("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=True, gpu="T4", num_generations=8,
                                max_prompt_length=prompt, max_completion_length=completion, prefix_sharing=share)
            priced = sim.time("T4")
            row["shared" if share else "plain"] = {
                "peak_gib": round(sim.peak / 2**30, 3), "activations_gib": round(sim["activations"] / 2**30, 3),
                "update_seconds_t4": round(priced.update, 2), "step_seconds_t4": round(priced.total, 2)}
        out[f"Qwen2.5-1.5B QLoRA T4, 8 x ({prompt} + {completion}), {name}"] = row
        print(name, row, flush=True)
    return out


if __name__ == "__main__":
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_update()}
    if "--cpu-only" not in sys.argv:
        results["simulated"] = simulated()
    path = ROOT / "benchmarks" / "results" / "prefix_sharing.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
