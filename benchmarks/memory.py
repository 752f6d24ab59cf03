"""GRPO training memory, grpo-nb vs TRL's GRPOTrainer, side by side in one run.

Every measurement runs in its own fresh process, so neither system sees the other's allocator
state. Both get the same model, the same LoRA (or QLoRA) adapter, the same prompts, the same
generations and the same completion lengths (forced with `min_new_tokens`), so they do the
same work.

CPU mode (default; minutes): the embedded SmolLM2-135M-Instruct, 4 generations, completions of
128 and 512 tokens, two full GRPO steps (rollout, rewards, update) of each library's own
trainer. Memory is the process's peak RSS over the steps (VmHWM), and its rise over the
loaded model. Both are gradient-checkpointed; grpo-nb runs once more at its default,
gradient_checkpointing="auto" (no checkpointing where the planner finds the memory), for the
time a user of each library gets without choosing (TRL's default checkpoints).

GPU mode (`--gpu`): random-weight models built from the configs of Qwen2.5-1.5B and
Llama-3.1-8B (no downloads), LoRA and QLoRA, 8 generations, completions of 1K-20K tokens.
Generating 8 x 20K tokens with a random model through `generate()` takes longer than the
measurement is worth, and both libraries generate the same way (HF `generate` with a KV
cache, which the planner sizes), so GPU mode measures the policy update: forward + backward
of each library's own GRPO loss (`GRPOTrainer._compute_loss` for TRL) on a batch of forced
completions, plus the longest completion each fits under a 15 GB cap
(`torch.cuda.set_per_process_memory_fraction`, a T4 stand-in) and on the whole card.
On the GPU machine, carry the wheels it lacks (trl, datasets, bitsandbytes, ...):

    pip install --no-index --no-deps --target /tmp/wheels .whl/*.whl
    PYTHONPATH=/tmp/wheels python benchmarks/memory.py --gpu

Results: JSON in benchmarks/results/memory_<cpu|cuda>.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Large allocations straight from mmap, so memory freed by torch goes back to the OS at once
# and the CPU's peak RSS follows the live tensors instead of glibc's cached heap.
MEASURE_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

# --------------------------------------------------------------------------------------
# Workers (run in a fresh interpreter; print one JSON line)

WORKER = r"""
import gc, json, sys, time
import torch
spec = json.loads(sys.argv[1])
system, G, P, C = spec["system"], spec["generations"], spec["prompt_len"], spec["completion_len"]
cuda = torch.cuda.is_available()
if cuda and spec.get("memory_gib"):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, spec["memory_gib"] * 2**30 / total))

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def peak():
    if cuda:
        return torch.cuda.max_memory_allocated()
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]) * 1024

def reset():
    gc.collect()
    if cuda:
        torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    open("/proc/self/clear_refs", "w").write("5")
    return rss()

from grpo_nb import setup_reasoning_model
path = None
if spec.get("arch"):
    from grpo_nb.architectures import random_model
    import os
    path = f"/tmp/grpo_nb_bench/{spec['arch'].replace('/', '_')}"
    if not os.path.exists(path + "/config.json"):
        random_model(spec["arch"], dtype=torch.bfloat16, device="cuda" if cuda else "cpu").save_pretrained(path)
        from transformers import AutoTokenizer
        # A byte-level tokenizer is enough: the token ids are forced, never decoded for rewards.
        AutoTokenizer.from_pretrained(str(__import__("grpo_nb").models.embedded_default_path())).save_pretrained(path)
gc_mode = spec.get("gradient_checkpointing") or (("offload" if cuda else True) if system == "grpo_nb" else True)
model, tok = setup_reasoning_model(path, seed=0, max_seq_length=P + C + 16, load_in_4bit=spec.get("qlora", False),
                                   lora_rank=16, gradient_checkpointing=gc_mode)
prompt = " ".join(["seven"] * P)
with torch.no_grad():  # page in weights that loading left memory-mapped, so they count as loaded
    for p in model.parameters():
        p.float().sum() if p.is_floating_point() else p.sum()
reward = lambda completions, **kw: [float(len(str(c)) % 7) for c in completions]
loaded = reset()
t0 = time.perf_counter()
try:
    if spec["mode"] == "train" and system == "grpo_nb":
        from grpo_nb import train
        hist = train(model, tok, [{"prompt": prompt}] * 4, reward, max_steps=spec["steps"], num_generations=G,
                     per_device_train_batch_size=G, max_completion_length=C, max_prompt_length=P + 8,
                     generation_kwargs={"min_new_tokens": C}, beta=0.0, loss_type="dapo", save_steps=0,
                     output_dir="/tmp/grpo_nb_bench/out", verbose=False, log_completions=False)
        lengths = [h["completion_length_mean"] for h in hist]
    elif spec["mode"] == "train":
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir="/tmp/grpo_nb_bench/trl", report_to=[], per_device_train_batch_size=G,
                          num_generations=G, max_completion_length=C, generation_kwargs={"min_new_tokens": C},
                          max_steps=spec["steps"], use_cpu=not cuda, bf16=cuda, gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": False}, loss_type="dapo", beta=0.0,
                          save_strategy="no", logging_steps=1, learning_rate=5e-6)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": [prompt] * 4}))
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    else:  # "update": forward + backward of the GRPO loss on forced completions
        dev = next(model.parameters()).device
        g = torch.Generator().manual_seed(0)
        V = model.get_base_model().config.vocab_size
        batch = {"prompt_ids": torch.randint(0, V, (G, P), generator=g).to(dev),
                 "prompt_mask": torch.ones(G, P, dtype=torch.long, device=dev),
                 "completion_ids": torch.randint(0, V, (G, C), generator=g).to(dev),
                 "completion_mask": torch.ones(G, C, dtype=torch.long, device=dev),
                 "advantages": torch.randn(G, generator=g).to(dev)}
        if system == "trl":
            from datasets import Dataset
            from trl import GRPOConfig, GRPOTrainer
            args = GRPOConfig(output_dir="/tmp/grpo_nb_bench/trl", report_to=[], per_device_train_batch_size=G,
                              num_generations=G, max_completion_length=C, use_cpu=not cuda, bf16=cuda,
                              gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                              loss_type="dapo", beta=0.0, save_strategy="no")
            trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                                  train_dataset=Dataset.from_dict({"prompt": ["hi"] * G}))
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = 1
            loaded = reset()
            t0 = time.perf_counter()
            loss = trainer._compute_loss(trainer.model, dict(batch, num_items_in_batch=batch["completion_mask"].sum()))
            loss.backward()
        else:
            from grpo_nb import completion_logprobs, grpo_loss
            micro = spec.get("micro_batch") or G
            for s in range(0, G, micro):
                sl = slice(s, s + micro)
                lp = completion_logprobs(model, batch["prompt_ids"][sl], batch["prompt_mask"][sl],
                                         batch["completion_ids"][sl], batch["completion_mask"][sl])
                part = grpo_loss(lp, None, None, batch["advantages"][sl], batch["completion_mask"][sl],
                                 loss_type="dapo", num_sequences=G, num_tokens=batch["completion_mask"].sum())[0]
                part.backward()
        lengths = [C]
    if cuda:
        torch.cuda.synchronize()
    status = "ok"
except torch.OutOfMemoryError:
    status, lengths = "oom", []
seconds = time.perf_counter() - t0
print(json.dumps({"status": status, "peak_mib": peak() / 2**20, "loaded_mib": loaded / 2**20,
                  "extra_mib": (peak() - loaded) / 2**20, "seconds": seconds, "completion_lengths": lengths}))
"""


def run(spec: dict, timeout: int = 3600) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], env=MEASURE_ENV,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"status": "error", "stderr": out.stderr[-2000:]}
    return json.loads(lines[-1])


def side_by_side(spec: dict, defaults: bool = False) -> dict:
    """Both libraries on `spec`, both gradient-checkpointed (the like-for-like memory comparison); `defaults`: also
    grpo-nb at its own default, gradient_checkpointing="auto" - on the CPU without checkpointing where the planner
    finds the memory for it -, against TRL's, which is checkpointing (GRPOConfig's default): the time a user of
    each gets without choosing."""
    row = dict(spec)
    runs = [("trl", "trl", {}), ("grpo_nb", "grpo_nb", {})]
    if defaults:
        runs.append(("grpo_nb", "grpo_nb_defaults", {"gradient_checkpointing": "auto"}))
    for system, key, extra in runs:
        row[key] = run({**spec, "system": system, **extra})
        print(f"  {key:17s} {row[key]}", flush=True)
    a, b = row["trl"], row["grpo_nb"]
    if a.get("status") == b.get("status") == "ok":
        row["peak_ratio_grpo_nb_over_trl"] = round(b["peak_mib"] / a["peak_mib"], 3)
        row["extra_ratio_grpo_nb_over_trl"] = round(b["extra_mib"] / a["extra_mib"], 3)
        row["time_ratio_grpo_nb_over_trl"] = round(b["seconds"] / a["seconds"], 3)
    if a.get("status") == "ok" and row.get("grpo_nb_defaults", {}).get("status") == "ok":
        row["time_ratio_at_defaults"] = round(row["grpo_nb_defaults"]["seconds"] / a["seconds"], 3)
    return row


def longest_fitting(spec: dict, system: str, lengths, memory_gib=None) -> int:
    best = 0
    for c in lengths:
        r = run({**spec, "system": system, "completion_len": c, "memory_gib": memory_gib})
        print(f"  {system} {c} tokens within {memory_gib or 'the card'} GiB: {r.get('status')}", flush=True)
        if r.get("status") != "ok":
            break
        best = c
    return best


def markdown(results: dict) -> str:
    lines = ["| mode | model | completions | trl peak | grpo-nb peak | ratio | trl extra | grpo-nb extra | ratio "
             "| trl s | grpo-nb s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        a, b = r["trl"], r["grpo_nb"]
        if a.get("status") != "ok" or b.get("status") != "ok":
            lines.append(f"| {r['mode']} | {r['model']} | {r['generations']} x {r['completion_len']} | "
                         f"{a.get('status')} | {b.get('status')} | | | | | | |")
            continue
        lines.append(
            f"| {r['mode']} | {r['model']} | {r['generations']} x {r['completion_len']} | {a['peak_mib']:.0f} MiB | "
            f"{b['peak_mib']:.0f} MiB | {r['peak_ratio_grpo_nb_over_trl']:.2f} | {a['extra_mib']:.0f} MiB | "
            f"{b['extra_mib']:.0f} MiB | {r['extra_ratio_grpo_nb_over_trl']:.2f} | {a['seconds']:.1f} | "
            f"{b['seconds']:.1f} |")
    for r in results["runs"]:
        if "time_ratio_at_defaults" in r:
            d = r["grpo_nb_defaults"]
            lines.append(f"\nAt each library's default ({r['generations']} x {r['completion_len']}): grpo-nb "
                         f"(gradient_checkpointing='auto') {d['seconds']:.1f} s, peak {d['peak_mib']:.0f} MiB; TRL "
                         f"(checkpointing) {r['trl']['seconds']:.1f} s: {r['time_ratio_at_defaults']:.2f}x")
    for item in results.get("longest", []):
        lines.append(f"\nLongest completion ({item['model']}, {item['generations']} generations) within "
                     f"{item['budget']}: TRL {item['trl']}, grpo-nb {item['grpo_nb']} tokens")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="GPU mode (see above)")
    ap.add_argument("--completion-len", type=int, nargs="+", default=None)
    ap.add_argument("--generations", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import transformers

    try:
        import trl
    except ImportError:
        sys.exit("benchmarks/memory.py needs TRL for the baseline: pip install 'grpo-nb[dev]'")
    if args.gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device; run without --gpu for the CPU mode")
    device = torch.cuda.get_device_name() if args.gpu else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    results = {"benchmark": "memory", "device": device, "torch": torch.__version__,
               "transformers": transformers.__version__, "trl": trl.__version__,
               "date": time.strftime("%Y-%m-%d"), "runs": [], "longest": []}
    if not args.gpu:
        gens = args.generations or 4
        for c in args.completion_len or [128, 512]:
            spec = {"mode": "train", "model": "SmolLM2-135M-Instruct (embedded), LoRA r=16", "generations": gens,
                    "prompt_len": args.prompt_len or 64, "completion_len": c, "steps": args.steps}
            print(f"{gens} x {c} tokens, {args.steps} GRPO steps", flush=True)
            results["runs"].append(side_by_side(spec, defaults=True))
    else:
        gens = args.generations or 8
        for arch in ("Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"):
            for qlora in (False, True):
                for c in args.completion_len or [1024, 4096, 16384, 20480]:
                    spec = {"mode": "update", "arch": arch, "qlora": qlora, "generations": gens,
                            "model": f"{arch.split('/')[-1]} {'QLoRA' if qlora else 'LoRA'} r=16 (random weights)",
                            "prompt_len": args.prompt_len or 256, "completion_len": c}
                    print(spec["model"], c, flush=True)
                    results["runs"].append(side_by_side(spec))
        spec = {"mode": "update", "arch": "Qwen/Qwen2.5-1.5B-Instruct", "qlora": True, "generations": gens,
                "prompt_len": args.prompt_len or 256}
        lengths = [1024 * 2**i for i in range(8)]  # 1K .. 128K
        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        for budget in (15, None):
            item = {"model": "Qwen2.5-1.5B QLoRA", "generations": gens,
                    "budget": f"{budget} GB" if budget else f"the whole card ({total_gib:.0f} GiB)"}
            for system in ("trl", "grpo_nb"):
                item[system] = longest_fitting(spec, system, lengths, budget)
            results["longest"].append(item)
    tag = "cuda" if args.gpu else "cpu"
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"memory_{tag}.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    out.with_suffix(".md").write_text(f"# {results['benchmark']} on {device}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
