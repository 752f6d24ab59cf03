"""The time simulation checked where it can be: predicted vs measured on this CPU (issue 27, item 2a).

    python benchmarks/step_time.py            # about 10 minutes on 2 cores

The same kernels `simulate_step(...).time(card)` prices on a GPU are priced here on this CPU, with the CPU's own
speeds measured first (`measure_cpu`: a large fp32 GEMM for FLOP/s, a large copy for bandwidth, a loop of tiny
ops for the cost of one op's dispatch), and compared with real timings of the embedded default (SmolLM2-135M,
fp32, LoRA r=16, gradient checkpointing as `setup_reasoning_model` sets it up on the CPU):

* the rollout engine's prefill, and one decode step at 1 / 4 / 16 rows (every row forced to the full length);
* the policy update (forward + backward of the GRPO loss, checkpointed) and the optimizer step on one batch;
* a whole `train()` step (rollout, rewards, update, optimizer), completions forced to their full length.

On the CPU nothing overlaps: each kernel costs its roofline plus one op's dispatch (`price(..., serial=True)`).
Results: results/step_time_cpu.json.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_nb import GRPOConfig, arithmetic_dataset, setup_reasoning_model, train  # noqa: E402
from grpo_nb.gpus import Card  # noqa: E402
from grpo_nb.optim import build_optimizer  # noqa: E402
from grpo_nb.rollout import RolloutEngine  # noqa: E402
from grpo_nb.simulate import forced_batch, simulate_step  # noqa: E402
from grpo_nb.step import accumulate_gradients, apply_update  # noqa: E402

PROMPT, COMPLETION = 64, 32


def best(fn, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_cpu() -> dict:
    """This CPU's speeds: fp32 GEMM FLOP/s, copy bandwidth (bytes read + written per second), one tiny op's cost."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = 2 * 2048**3 / best(lambda: a @ b)
    src, dst = torch.empty(64 * 2**20), torch.empty(64 * 2**20)  # 256 MB each, far beyond the caches
    src.normal_()
    copy = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))
    x, y = torch.ones(1), torch.ones(1)

    def tiny():
        for _ in range(10_000):
            torch.add(x, y)
    op = best(tiny) / 10_000
    return {"gemm_flops": gemm, "copy_bytes_per_s": copy, "op_seconds": op}


def cpu_card(speeds: dict) -> Card:
    rate = speeds["gemm_flops"]
    return Card("this CPU", (0, 0), torch.get_num_threads(), {"fp32": rate, "fp16": rate, "bf16": rate},
                speeds["copy_bytes_per_s"], float("inf"))


def predicted(model, speeds, **settings):
    step = simulate_step(model, device="cpu", dtype="fp32", gradient_checkpointing=True, **settings)
    return step.time(cpu_card(speeds), serial=True, host_s=speeds["op_seconds"])


def rollout_rows(model, tok, rows: int, speeds: dict) -> dict:
    ids = tok(["x " * (PROMPT - 1)], return_tensors="pt", add_special_tokens=False)
    prompt_ids, prompt_mask = ids["input_ids"][:, -PROMPT:], ids["attention_mask"][:, -PROMPT:]
    engine = RolloutEngine(max_completion_length=COMPLETION, min_new_tokens=COMPLETION, seed=0)
    engine(model, tok, prompt_ids, prompt_mask, rows)  # warm-up
    prefill, decode = [], []
    for _ in range(3):
        engine(model, tok, prompt_ids, prompt_mask, rows)
        prefill.append(engine.last_stats["prefill_s"])
        decode.append(engine.last_stats["decode_s"] / engine.last_stats["decode_steps"])
    generations = max(2, rows)  # GRPO's smallest group, decoded `rows` at a time
    time_ = predicted(model, speeds, max_prompt_length=prompt_ids.shape[1], max_completion_length=COMPLETION,
                      num_generations=generations, rollout_max_rows=rows)
    pieces = generations // rows
    steps = pieces * (COMPLETION - 1)
    return {"rows": rows, "prefill_measured_s": min(prefill), "prefill_predicted_s": time_.seconds("prefill") / pieces,
            "decode_step_measured_s": statistics.median(decode),
            "decode_step_predicted_s": time_.seconds("decode") / steps}


def update(model, speeds: dict, rows: int = 8) -> dict:
    config = GRPOConfig(num_generations=rows, per_device_train_batch_size=rows, max_prompt_length=PROMPT,
                        max_completion_length=COMPLETION, max_steps=1, logprob_backend="torch")
    optimizer, _, params = build_optimizer(model, config)
    batch = forced_batch(rows, PROMPT, COMPLETION, model.config.vocab_size)
    model.train()
    measured_update, measured_opt = [], []
    for _ in range(3):
        t = time.perf_counter()
        metrics = accumulate_gradients(model, params, batch, config)
        measured_update.append(time.perf_counter() - t)
        t = time.perf_counter()
        apply_update(optimizer, params, metrics, config)
        measured_opt.append(time.perf_counter() - t)
    time_ = predicted(model, speeds, max_prompt_length=PROMPT, max_completion_length=COMPLETION, num_generations=rows,
                      rollout=False, logprob_backend="torch")
    return {"rows": rows, "update_measured_s": min(measured_update[1:]), "update_predicted_s": time_.update,
            "optimizer_measured_s": min(measured_opt[1:]), "optimizer_predicted_s": time_.optimizer,
            "update_stages_predicted_s": {k: v.seconds for k, v in time_.stages.items()}}


def whole_step(model, tok, speeds: dict) -> dict:
    from grpo_nb import correctness_reward, xml_count_reward

    data = arithmetic_dataset(64, seed=0)
    records = train(model, tok, data, [xml_count_reward, correctness_reward], num_generations=8,
                    max_completion_length=COMPLETION, max_prompt_length=PROMPT, learning_rate=1e-5, max_steps=3,
                    generation_kwargs={"min_new_tokens": COMPLETION}, live=False, verbose=False, save_steps=None,
                    output_dir="/tmp/grpo_nb_step_time_run", logprob_backend="torch")
    lengths = [len(tok.apply_chat_template(p, add_generation_prompt=True)) for p in data["prompt"]]
    width = min(PROMPT, max(lengths))  # the widest prompt of the data set, as grpo-nb cuts it
    time_ = predicted(model, speeds, max_prompt_length=int(width), max_completion_length=COMPLETION,
                      num_generations=8, logprob_backend="torch")
    return {"steps": len(records), "step_measured_s": statistics.median(r["step_time"] for r in records[1:]),
            "generation_measured_s": statistics.median(r["generation_time"] for r in records[1:]),
            "step_predicted_s": time_.total, "rollout_predicted_s": time_.rollout, "prompt_width": int(width),
            "predicted_stages_s": {k: v.seconds for k, v in time_.stages.items()}}


def main():
    torch.manual_seed(0)
    speeds = measure_cpu()
    print(f"this CPU: GEMM {speeds['gemm_flops'] / 1e9:.1f} GFLOP/s, copy {speeds['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"one op {speeds['op_seconds'] * 1e6:.1f} us")
    model, tok = setup_reasoning_model()
    results = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "speeds": speeds, "prompt": PROMPT, "completion": COMPLETION}
    results["rollout"] = [rollout_rows(model, tok, rows, speeds) for rows in (1, 4, 16)]
    for r in results["rollout"]:
        print(f"{r['rows']:>2} rows: prefill {r['prefill_measured_s'] * 1e3:.0f} ms measured, "
              f"{r['prefill_predicted_s'] * 1e3:.0f} ms predicted; decode step {r['decode_step_measured_s'] * 1e3:.1f} ms "
              f"measured, {r['decode_step_predicted_s'] * 1e3:.1f} ms predicted")
    results["update"] = update(model, speeds)
    u = results["update"]
    print(f"update {u['update_measured_s']:.2f} s measured, {u['update_predicted_s']:.2f} s predicted; optimizer "
          f"{u['optimizer_measured_s'] * 1e3:.0f} ms measured, {u['optimizer_predicted_s'] * 1e3:.0f} ms predicted")
    results["step"] = whole_step(model, tok, speeds)
    s = results["step"]
    print(f"train() step {s['step_measured_s']:.2f} s measured, {s['step_predicted_s']:.2f} s predicted "
          f"({s['step_predicted_s'] / s['step_measured_s'] - 1:+.0%})")
    out = ROOT / "benchmarks" / "results" / "step_time_cpu.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
