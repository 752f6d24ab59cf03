"""The time simulation checked where it can be: predicted vs measured on this CPU (issue 27, item 2a).

    python benchmarks/step_time.py            # about 4 minutes on 2 cores, alone

The same kernels `simulate_step(...).time(card)` prices on a GPU are priced here on this CPU, with the CPU's own
speeds measured first, and compared with real timings of the embedded default (SmolLM2-135M, fp32, LoRA r=16):

* the rollout engine's prefill, and one decode step at 1 / 4 / 16 rows (every row forced to the full length);
* the policy update (forward + backward of the GRPO loss, checkpointed) and the optimizer step on one batch;
* a whole `train()` step (rollout, rewards, update, optimizer), completions forced to their full length, with
  gradient checkpointing as train() sets it on this CPU (off where the memory allows).

The CPU's speeds (`measure_cpu`): a large fp32 GEMM for FLOP/s and a large copy for bandwidth (the roofline of
every kernel), and two measurements of what one number per machine cannot say:

* every product the simulated step records, timed one by one at its own shape (`measure_matmuls`): MKL's rate
  ranged from ~90 to ~430 GFLOP/s across the step's shapes (a [768, 16] LoRA product, a 4-row decode product, a
  [768, 1536] layer product), and the priced product is the measured one;
* the host's work per kernel, stage by stage (`measure_host`): the same code run on a copy of the model whose
  layers are 36 wide (the same layers, heads, vocabulary and LoRA, so the same kernels, each doing almost no
  arithmetic): its measured time, less its kernels' roofline, over the number of kernels it launches. This is
  Python, `nn.Module` calls, autograd and PyTorch's dispatch - the view ops the simulation does not record
  included.

On the CPU nothing overlaps: each kernel costs its price plus its stage's host work (`price(..., serial=True)`).
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_nb import GRPOConfig, arithmetic_dataset, setup_reasoning_model, train  # noqa: E402
from grpo_nb.gpus import Card  # noqa: E402
from grpo_nb.lora import SKINNY_ROWS  # noqa: E402
from grpo_nb.models import checkpointing_for, find_checkpointing_layers  # noqa: E402
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


class _Norm(torch.nn.Module):
    """Six kernels of eager PyTorch written in Python, as model code is: what one op costs to dispatch."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-5))


def measure_cpu() -> dict:
    """This CPU's speeds: fp32 GEMM FLOP/s (2048^3), copy bandwidth (bytes read + written per second, 256 MB
    buffers), one op's dispatch from Python model code (a 6-kernel RMSNorm module on 8 numbers), and the fraction
    of its roofline a matmul of 1-1024 rows reaches on the weights of a layer (576 x 1536, 64 of them in turn so
    that they stream from memory as a model's do)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = 2 * 2048**3 / best(lambda: a @ b)
    src, dst = torch.empty(64 * 2**20), torch.empty(64 * 2**20)
    src.normal_()
    copy = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))
    norm, x = _Norm(), torch.ones(1, 8)
    with torch.no_grad():
        op = best(lambda: [norm(x) for _ in range(2000)]) / 2000 / 6
    weights = [torch.randn(1536, 576) for _ in range(64)]
    efficiency = []
    for rows in (1, 4, 16, 64, 256, 1024):
        inputs = torch.randn(rows, 576)
        seconds = best(lambda: [torch.nn.functional.linear(inputs, w) for w in weights], repeats=3) / len(weights)
        roofline = max(2 * rows * 576 * 1536 / gemm, 4 * (576 * 1536 + rows * (576 + 1536)) / copy)
        efficiency.append((rows, min(1.0, roofline / seconds)))
    return {"gemm_flops": gemm, "copy_bytes_per_s": copy, "op_seconds": op, "matmul_efficiency": efficiency}


def forced_prompt(tok) -> tuple:
    """(ids, mask) of one PROMPT-token prompt for the rollouts timed here."""
    ids = tok(["x " * (PROMPT - 1)], return_tensors="pt", add_special_tokens=False)
    return ids["input_ids"][:, -PROMPT:], ids["attention_mask"][:, -PROMPT:]


def measure_matmuls(ops, speeds: dict) -> None:
    """Time every product shape among `ops` (recorded matmuls) not yet in speeds["matmul_seconds"]: each shape's
    larger operand (the weight) cycled through copies totalling up to ~600 MB (more than this CPU's last-level
    cache), as a model's weights stream from memory; the median of three passes of the mean over the copies."""
    known = {tuple(entry[:4]) for entry in speeds.setdefault("matmul_seconds", [])}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    from grpo_nb.simulate.pricing import _DTYPES

    for op in ops:
        if op.kind != "matmul" or len(op.shape) != 3:
            continue
        key = (*op.shape, _DTYPES.get(str(op.dtype), "fp32"))
        if key in known:
            continue
        known.add(key)
        m, n, k, dtype = key
        kind = dtypes[dtype]
        # the larger operand is the weight (a decode step's `W @ x.T` has it on the left)
        copies = max(1, min(64, 600 * 2**20 // (max(m * k, k * n) * 4)))
        if m * k > k * n:
            weights = [torch.randn(m, k, dtype=kind) for _ in range(copies)]
            if op.stage in ("prefill", "decode") and n <= SKINNY_ROWS:
                # a rollout's few-row product, recorded as the simulation runs it (W @ x.T): on the CPU
                # `lora.skinny_linear` times it both ways and keeps the faster (`ProductChoice`), so both are timed
                x = torch.randn(n, k, dtype=kind)
                ways = [lambda: [w @ x.t() for w in weights], lambda: [F.linear(x, w) for w in weights]]
            else:
                b = torch.randn(k, n, dtype=kind)
                ways = [lambda: [w @ b for w in weights]]
        else:
            a = torch.randn(m, k, dtype=kind)
            weights = [torch.randn(k, n, dtype=kind) for _ in range(copies)]
            ways = [lambda: [a @ w for w in weights]]
        for run in ways:
            run()
        seconds = min(statistics.median(best(run, repeats=1) for _ in range(3)) for run in ways) / copies
        speeds["matmul_seconds"].append([m, n, k, dtype, seconds])


def cpu_card(speeds: dict) -> Card:
    rate = speeds["gemm_flops"]
    return Card("this CPU", (0, 0), torch.get_num_threads(), {"fp32": rate, "fp16": rate, "bf16": rate},
                speeds["copy_bytes_per_s"], float("inf"),
                matmul_efficiency=tuple(tuple(p) for p in speeds["matmul_efficiency"]),
                matmul_seconds=tuple(((m, n, k, d), s) for m, n, k, d, s in speeds.get("matmul_seconds", [])))


def predicted(model, speeds, gradient_checkpointing=True, serial=True, host_s=None, **settings):
    """`simulate_step` of `model` priced on this CPU: its products timed at their shapes first, each kernel with
    its stage's host work (speeds["host_seconds"]; `host_s` of the tiny-op loop where not measured yet)."""
    step = simulate_step(model, device="cpu", dtype="fp32", gradient_checkpointing=gradient_checkpointing, **settings)
    step._trace = step.record_ops()
    measure_matmuls(step._trace.ops, speeds)
    host_s = speeds.get("host_seconds") or speeds["op_seconds"] if host_s is None else host_s
    return step.time(cpu_card(speeds), serial=serial, host_s=host_s)


def narrow_copy(model, tok, width: int = 36) -> tuple:
    """The embedded default with every layer `width` wide (head_dim 4, intermediate 8): the same layers, heads,
    vocabulary, LoRA and code path, so the same kernels, each with almost no arithmetic. Random weights."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from grpo_nb.models import text_config

    config = text_config(model).__class__.from_dict(text_config(model).to_dict())
    config.hidden_size, config.intermediate_size = width, 8
    config.head_dim = width // config.num_attention_heads
    folder = tempfile.mkdtemp(prefix="grpo_nb_narrow_")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return setup_reasoning_model(folder)


def measure_host(model, tok, speeds: dict, rows: int = 4) -> dict:
    """Host seconds per kernel for the rollout's prefill and decode steps, the update (forward, log-probs, loss,
    backward) and the optimizer step, measured on `narrow_copy`: (its time - its kernels' price) / its kernels."""
    narrow, ntok = narrow_copy(model, tok)
    prompt_ids, prompt_mask = forced_prompt(ntok)
    engine = RolloutEngine(max_completion_length=COMPLETION, min_new_tokens=COMPLETION, seed=0)
    engine(narrow, ntok, prompt_ids, prompt_mask, rows)
    prefill, decode = [], []
    for _ in range(5):
        engine(narrow, ntok, prompt_ids, prompt_mask, rows)
        prefill.append(engine.last_stats["prefill_s"])
        decode.append(engine.last_stats["decode_s"])  # all COMPLETION - 1 decode steps, as priced
    bare = dict(serial=True, host_s=0.0)
    rollout = predicted(narrow, speeds, max_prompt_length=PROMPT, max_completion_length=COMPLETION,
                        num_generations=rows, rollout_max_rows=rows, **bare).stages
    measured = update(narrow, speeds, rows=8, predict=False)
    trained = predicted(narrow, speeds, max_prompt_length=PROMPT, max_completion_length=COMPLETION, num_generations=8,
                        rollout=False, logprob_backend="torch", **bare).stages
    update_stages = [s for s in ("forward", "log-probs", "loss", "backward", "reference log-probs", "old log-probs")
                     if s in trained]
    found = {"prefill": (min(prefill), [rollout["prefill"]]), "decode": (statistics.median(decode), [rollout["decode"]]),
             "update": (measured["update_measured_s"], [trained[s] for s in update_stages]),
             "optimizer": (measured["optimizer_measured_s"], [trained["optimizer"]])}
    host, speeds["host_calibration"] = {}, {}
    for name, (wall, stages) in found.items():
        priced, kernels = sum(s.seconds for s in stages), sum(s.kernels for s in stages)
        host[name] = max(0.0, (wall - priced) / kernels)
        speeds["host_calibration"][name] = {"measured_s": wall, "priced_without_host_s": priced, "kernels": kernels}
    per_update = host.pop("update")
    host.update({stage: per_update for stage in update_stages})
    host["default"] = speeds["op_seconds"]
    return host


def op_classes(model, tok, speeds: dict, rows: int = 4) -> list:
    """Where the model is wrong: one rollout of `rows` rows, measured per ATen op (torch.profiler's self time) and
    priced per op; what no op accounts for (Python, modules, the framework) is the row "outside ATen ops"."""
    from torch.profiler import ProfilerActivity, profile

    from grpo_nb.simulate.pricing import kernel_seconds

    prompt_ids, prompt_mask = forced_prompt(tok)
    engine = RolloutEngine(max_completion_length=COMPLETION, min_new_tokens=COMPLETION, seed=0)
    engine(model, tok, prompt_ids, prompt_mask, rows)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        engine(model, tok, prompt_ids, prompt_mask, rows)
        wall = time.perf_counter() - t
    measured = {}
    for e in prof.key_averages():
        if e.key.startswith("aten::") and e.self_cpu_time_total > 0:
            measured[e.key[6:]] = (e.count, e.self_cpu_time_total / 1e6)
    step = simulate_step(model, device="cpu", dtype="fp32", gradient_checkpointing=True, max_prompt_length=PROMPT,
                         max_completion_length=COMPLETION, num_generations=rows)
    step._trace = step.record_ops()
    measure_matmuls(step._trace.ops, speeds)
    card, priced, host = cpu_card(speeds), {}, speeds.get("host_seconds", {})
    for op in step._trace.ops:
        if op.stage in ("prefill", "decode"):
            n, s = priced.get(op.name, (0, 0.0))
            priced[op.name] = (n + 1, s + kernel_seconds(op, card) + host.get(op.stage, speeds["op_seconds"]))
    rows_out = [{"op": name, "measured_calls": measured.get(name, (0, 0))[0], "measured_s": measured.get(name, (0, 0))[1],
                 "priced_calls": priced.get(name, (0, 0))[0], "priced_s": priced.get(name, (0, 0))[1]}
                for name in set(measured) | set(priced)]
    rows_out.sort(key=lambda r: -max(r["measured_s"], r["priced_s"]))
    inside = sum(s for _, s in measured.values())
    rows_out.insert(0, {"op": "outside ATen ops (Python, modules, framework)", "measured_calls": 0,
                        "measured_s": max(0.0, wall - inside), "priced_calls": 0, "priced_s": 0.0})
    rows_out.insert(0, {"op": "the whole rollout", "measured_calls": 0, "measured_s": wall, "priced_calls": 0,
                        "priced_s": sum(r["priced_s"] for r in rows_out)})
    return rows_out[:25]


def rollout_rows(model, tok, rows: int, speeds: dict) -> dict:
    prompt_ids, prompt_mask = forced_prompt(tok)
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


def update(model, speeds: dict, rows: int = 8, predict: bool = True) -> dict:
    """One group's update (its prompt shared by its `rows` completions, as simulated), checkpointed."""
    config = GRPOConfig(num_generations=rows, per_device_train_batch_size=rows, max_prompt_length=PROMPT,
                        max_completion_length=COMPLETION, max_steps=1, logprob_backend="torch")
    optimizer, _, params = build_optimizer(model, config)
    batch = forced_batch(rows, PROMPT, COMPLETION, model.config.vocab_size, num_generations=rows)
    model.train()
    measured_update, measured_opt = [], []
    for _ in range(3):
        t = time.perf_counter()
        metrics = accumulate_gradients(model, params, batch, config)
        measured_update.append(time.perf_counter() - t)
        t = time.perf_counter()
        apply_update(optimizer, params, metrics, config)
        measured_opt.append(time.perf_counter() - t)
    if not predict:
        return {"update_measured_s": min(measured_update[1:]), "optimizer_measured_s": min(measured_opt[1:])}
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
                    generation_kwargs={"min_new_tokens": COMPLETION}, live=False, verbose=False, save_steps=0,
                    output_dir="/tmp/grpo_nb_step_time_run", logprob_backend="torch",
                    cpu_rollout_dtype=None)  # fp32 rollouts, what the simulation prices ("auto" may pick bf16 copies)
    lengths = [len(tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]) for p in data["prompt"]]
    width = min(PROMPT, max(lengths))  # the widest prompt of the data set, as grpo-nb cuts it
    # train() on the CPU drops gradient checkpointing where the update's activations fit (models.checkpointing_for)
    config = GRPOConfig(num_generations=8, max_completion_length=COMPLETION, max_prompt_length=int(width),
                        logprob_backend="torch")
    with checkpointing_for(model, config):
        checkpointed = any(getattr(layer, "gradient_checkpointing", False) for layer in find_checkpointing_layers(model))
    time_ = predicted(model, speeds, gradient_checkpointing=checkpointed, max_prompt_length=int(width),
                      max_completion_length=COMPLETION, num_generations=8, logprob_backend="torch")
    return {"steps": len(records), "step_measured_s": statistics.median(r["step_time"] for r in records[1:]),
            "generation_measured_s": statistics.median(r["generation_time"] for r in records[1:]),
            "step_predicted_s": time_.total, "rollout_predicted_s": time_.rollout, "prompt_width": int(width),
            "gradient_checkpointing": checkpointed,
            "predicted_stages_s": {k: v.seconds for k, v in time_.stages.items()}}


def main():
    torch.manual_seed(0)
    speeds = measure_cpu()
    print(f"this CPU: GEMM {speeds['gemm_flops'] / 1e9:.1f} GFLOP/s, copy {speeds['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"one op {speeds['op_seconds'] * 1e6:.1f} us; a layer's matmul reaches of its roofline "
          + ", ".join(f"{e:.0%} at {r} rows" for r, e in speeds["matmul_efficiency"]))
    model, tok = setup_reasoning_model()
    speeds["host_seconds"] = measure_host(model, tok, speeds)
    print("host work per kernel: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in speeds["host_seconds"].items()))
    results = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "speeds": speeds, "prompt": PROMPT, "completion": COMPLETION}
    results["rollout"] = [rollout_rows(model, tok, rows, speeds) for rows in (1, 4, 16)]
    for r in results["rollout"]:
        print(f"{r['rows']:>2} rows: prefill {r['prefill_measured_s'] * 1e3:.0f} ms measured, "
              f"{r['prefill_predicted_s'] * 1e3:.0f} ms predicted; decode step {r['decode_step_measured_s'] * 1e3:.1f} ms "
              f"measured, {r['decode_step_predicted_s'] * 1e3:.1f} ms predicted")
    results["op_classes_rollout_4_rows"] = op_classes(model, tok, speeds)
    for r in results["op_classes_rollout_4_rows"][:12]:
        print(f"  {r['op']:<48} measured {r['measured_s'] * 1e3:8.1f} ms ({r['measured_calls']} calls), priced "
              f"{r['priced_s'] * 1e3:8.1f} ms ({r['priced_calls']} calls)")
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
