"""The time simulation checked on a GPU: the priced stages measured there (issue 27, item 2c).

    python benchmarks/step_time_gpu.py                 # on the GPU: measures, writes results/step_time_gpu_<card>.json
    python benchmarks/step_time_gpu.py --predict FILE  # anywhere: adds what simulate_step(...).time(card) predicts
    python benchmarks/step_time_gpu.py --graph-profile # on the GPU: where a CUDA-graph decode step's time goes

Measured on Qwen2.5-1.5B's shapes with random weights (nothing is downloaded; time does not depend on the
weights' values), LoRA r=16 on every linear layer, offloaded gradient checkpointing (what `setup_reasoning_model`
sets up on CUDA), in bf16 and as QLoRA (NF4 through bitsandbytes, as `setup_reasoning_model(load_in_4bit=True)`
loads it), for each:

* the rollout engine at 1 / 8 / 64 rows, every row forced to the full length, decoded from a CUDA graph
  (the default on CUDA) and eagerly (decode="static"): prefill and one decode step;
* the policy update (forward + backward of the GRPO loss, default log-prob backend) and the optimizer step on
  one batch of 8 x (256 + 1024) tokens, with the peak memory it allocated;
* a CUDA profile of one eager decode step and of the update (the kernels' own times, where the model misses).

Measuring runs each stage in its own try: a failure is recorded with its reason and the rest still runs; the
JSON is rewritten after every stage, so a run cut off by a time limit keeps what it measured. The prediction
pass simulates the same settings on the meta device (minutes on a CPU) and prices them on the card measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
PROMPT, COMPLETION, ROWS = 256, 64, (1, 8, 64)
UPDATE_ROWS, UPDATE_COMPLETION = 8, 1024
TOKENIZER = SimpleNamespace(eos_token_id=151645, pad_token_id=151643)  # Qwen2.5's; rollouts of ids need no more


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def build(kind: str, device: str, config=None):
    """The model as setup_reasoning_model would give it: bf16 (fp16 before sm80; NF4 under it) + LoRA + offloaded
    checkpointing on CUDA (plain on the CPU, where this runs only as a dry run)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from grpo_nb.architectures import known_config, random_model
    from grpo_nb.models import prepare_for_training, resolve_gradient_checkpointing

    from grpo_nb.hardware import training_dtype

    config = config or known_config(MODEL)
    dtype = training_dtype(device) if device == "cuda" else torch.float32  # bf16 from sm80, fp16 on a T4
    model = random_model(config, dtype=dtype, device=device)
    if kind == "qlora":
        path = Path("/tmp/step_time_gpu_model")
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant,
                                                     device_map={"": device})
    model.config._attn_implementation = "sdpa"
    return prepare_for_training(model, max_seq_length=PROMPT + UPDATE_COMPLETION, lora_rank=16,
                                gradient_checkpointing=resolve_gradient_checkpointing("auto", device))


def prompt(device, seed: int = 0):
    """One random prompt of PROMPT token ids (below Qwen2.5's special ids) and its mask."""
    ids = torch.randint(0, 150000, (1, PROMPT), generator=torch.Generator().manual_seed(seed)).to(device)
    return ids, torch.ones_like(ids)


def update_inputs(model, device, completion: int):
    """What one update runs on: its GRPOConfig, AdamW over the adapter and a batch at full length."""
    from grpo_nb import GRPOConfig
    from grpo_nb.optim import build_optimizer
    from grpo_nb.simulate import forced_batch

    config = GRPOConfig(num_generations=UPDATE_ROWS, per_device_train_batch_size=UPDATE_ROWS,
                        max_prompt_length=PROMPT, max_completion_length=completion, max_steps=1)
    optimizer, _, params = build_optimizer(model, config)
    return config, optimizer, params, forced_batch(UPDATE_ROWS, PROMPT, completion, model.config.vocab_size,
                                                   device=device)


# The decode's A/B variants (--variants): (LoRA branch exact?, done-check every n steps or None for the default).
# "exact, every step" is the engine as the first GPU run measured it; the default is the branch in the model's
# dtype and a done-check every CHECK_EVERY steps.
VARIANTS = {"default": (False, None), "exact_adapters": (True, None), "exact_adapters_check_every_step": (True, 1)}


def rollout(model, device, rows: int, decode: str, completion: int, variant: str = "default") -> dict:
    from grpo_nb.rollout import RolloutEngine

    ids, mask = prompt(device, seed=rows)
    exact, check_every = VARIANTS[variant]
    engine = RolloutEngine(max_completion_length=completion, min_new_tokens=completion, seed=0, decode=decode,
                           exact_adapters=exact)
    engine._check_every = check_every
    engine(model, TOKENIZER, ids, mask, rows)  # warm-up: kernels compiled, graph captured once
    runs = []
    for _ in range(2):
        wall, _ = timed(lambda: engine(model, TOKENIZER, ids, mask, rows))
        runs.append(dict(engine.last_stats, wall_s=wall))
    model.eval()
    with torch.no_grad():  # the prefill alone (the engine's prefill_s also holds the static cache's set-up)
        forward = min(timed(lambda: model(input_ids=ids, use_cache=True))[0] for _ in range(3))
    model.train()
    steps = [r["decode_s"] / r["decode_steps"] for r in runs]
    return {"rows": rows, "decode": decode, "variant": variant, "completion": completion,
            "mode_used": runs[-1]["decode"],
            "prefill_forward_s": forward, "engine_prefill_s": min(r["prefill_s"] for r in runs),
            "decode_step_s": statistics.median(steps), "rollout_wall_s": min(r["wall_s"] for r in runs),
            "decode_steps": runs[-1]["decode_steps"]}


def update(model, device, completion: int) -> dict:
    from grpo_nb.step import accumulate_gradients, apply_update

    config, optimizer, params, batch = update_inputs(model, device, completion)
    model.train()
    updates, steps, peak = [], [], None
    for i in range(3):
        if device == "cuda" and i == 2:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        seconds, metrics = timed(lambda: accumulate_gradients(model, params, batch, config))
        updates.append(seconds)
        if device == "cuda" and i == 2:
            peak = torch.cuda.max_memory_allocated() - base
        steps.append(timed(lambda: apply_update(optimizer, params, metrics, config))[0])
    return {"rows": UPDATE_ROWS, "prompt": PROMPT, "completion": completion, "update_s": min(updates[1:]),
            "first_update_s": updates[0], "optimizer_s": min(steps[1:]), "update_peak_above_start_bytes": peak,
            "logprob_backend": config.logprob_backend, "loss": float(metrics.loss) if hasattr(metrics, "loss") else None}


def profile(fn, path: Path, title: str) -> list:
    """The kernels' own device times of one call of `fn`, the top 40 by time (also as a table added to `path`)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        fn()
        sync()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    averages = prof.key_averages()
    with path.open("a") as f:
        f.write(f"\n\n#### {title}\n" + averages.table(sort_by=key, row_limit=60))
    rows = []
    for e in averages:
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key, "calls": e.count, "self_device_s": device_us / 1e6,
                     "self_cpu_s": e.self_cpu_time_total / 1e6})
    rows.sort(key=lambda r: -(r["self_device_s"] or r["self_cpu_s"]))
    return rows[:40]


def profile_stages(model, device, kind, out_dir: Path, update_completion: int, results: dict) -> None:
    """CUDA profiles of an eager rollout of 8 rows x 16 tokens and of one update (results[profile_...])."""
    from grpo_nb.rollout import RolloutEngine
    from grpo_nb.step import accumulate_gradients

    ids, mask = prompt(device)
    engine = RolloutEngine(max_completion_length=16, min_new_tokens=16, seed=0,
                           decode="static" if device == "cuda" else "dynamic")
    engine(model, TOKENIZER, ids, mask, 8)
    results[f"profile_{kind}_rollout_8_rows_16_tokens"] = profile(
        lambda: engine(model, TOKENIZER, ids, mask, 8), out_dir / "profiles.txt", f"{kind}: an eager rollout, 8 rows x 16 tokens")
    config, _, params, batch = update_inputs(model, device, update_completion)
    results[f"profile_{kind}_update"] = profile(
        lambda: accumulate_gradients(model, params, batch, config), out_dir / "profiles.txt", f"{kind}: one update, {UPDATE_ROWS} x ({PROMPT} + {update_completion})")


def measure(args) -> None:
    import grpo_nb  # noqa: F401  (imported first: its warnings and versions belong to the record)
    import peft
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"step_time_gpu_{name.split()[-1].lower() if device == 'cuda' else 'dry_run'}.json"
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "cuda": torch.version.cuda}
    for module in ("triton", "bitsandbytes"):
        try:
            versions[module] = __import__(module).__version__
        except Exception as err:  # noqa: BLE001  (recorded: the QLoRA rows then say why they are missing)
            versions[module] = f"missing: {err}"
    from grpo_nb.hardware import training_dtype

    dtype = str(training_dtype(device)).replace("torch.", "") if device == "cuda" else "float32"
    results = {"device": name, "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
               "dtype": dtype,
               "versions": versions, "model": f"{MODEL} shapes, random weights", "lora": "r=16, all-linear",
               "prompt": PROMPT, "rows": [], "errors": []}
    config = None
    if args.dry_run:  # a tiny Qwen2 on the CPU: the script's own check, nothing measured worth keeping
        from grpo_nb.architectures import known_config
        config = known_config(MODEL)
        config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=151936))
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:2]
    kinds = args.kinds.split(",")
    decodes = ("cuda_graph", "static") if device == "cuda" else ("dynamic",)
    completion = COMPLETION if not args.dry_run else 8
    update_completion = UPDATE_COMPLETION if not args.dry_run else 16

    def save():
        out.write_text(json.dumps(results, indent=1) + "\n")

    for kind in kinds:
        try:
            t = time.perf_counter()
            model = build(kind, device, config)
            print(f"{kind}: built in {time.perf_counter() - t:.1f} s", flush=True)
        except Exception as err:  # noqa: BLE001
            results["errors"].append({"kind": kind, "stage": "build", "error": traceback.format_exc()})
            print(f"{kind}: build failed: {err!r}", flush=True)
            save()
            continue
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        runs = [(decode, rows, "default") for decode in decodes for rows in ROWS]
        if args.variants:  # the same rollouts with what changed since the first GPU run undone, side by side
            # (eager decode only at 8 rows with the exact branch: an eager step is host-bound, ~75 ms on the H200)
            runs += [("cuda_graph", rows, v) for rows in ROWS for v in VARIANTS if v != "default"
                     if "cuda_graph" in decodes] + [(decodes[-1], 8, "exact_adapters")]
        for decode, rows, variant in runs:
            try:
                r = rollout(model, device, rows, decode, completion, variant)
                r.update(kind=kind, stage="rollout", weight_bytes=weight_bytes)
                results["rows"].append(r)
                print(f"{kind} {decode:>10} {rows:>2} rows {variant}: prefill {r['prefill_forward_s'] * 1e3:.1f} "
                      f"ms, decode step {r['decode_step_s'] * 1e3:.2f} ms ({r['mode_used']})", flush=True)
            except Exception as err:  # noqa: BLE001
                results["errors"].append({"kind": kind, "stage": f"rollout {decode} {rows} {variant}",
                                          "error": traceback.format_exc()})
                print(f"{kind} {decode} {rows} rows failed: {err!r}", flush=True)
            save()
        try:
            r = update(model, device, update_completion)
            r.update(kind=kind, stage="update", weight_bytes=weight_bytes)
            results["rows"].append(r)
            print(f"{kind} update {r['update_s']:.3f} s (first {r['first_update_s']:.2f} s), optimizer "
                  f"{r['optimizer_s'] * 1e3:.1f} ms, peak above start {(r['update_peak_above_start_bytes'] or 0) / 2**30:.2f} GiB",
                  flush=True)
        except Exception as err:  # noqa: BLE001
            results["errors"].append({"kind": kind, "stage": "update", "error": traceback.format_exc()})
            print(f"{kind} update failed: {err!r}", flush=True)
        save()
        if args.profile:
            try:
                profile_stages(model, device, kind, out_dir, update_completion, results)
            except Exception as err:  # noqa: BLE001
                results["errors"].append({"kind": kind, "stage": "profile", "error": traceback.format_exc()})
                print(f"{kind} profile failed: {err!r}", flush=True)
            save()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {out}", flush=True)


def predict(path: Path) -> None:
    """Add to a measured file what the simulation prices for the same settings on the card measured."""
    from grpo_nb.gpus import card as gpu_card
    from grpo_nb.simulate import simulate_step

    results = json.loads(path.read_text())
    card = gpu_card(results["device"])
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(results.get("dtype", "bfloat16"), "bf16")  # what was measured
    for r in results["rows"]:
        four_bit = r["kind"] == "qlora"
        if r["stage"] == "rollout" and r.get("variant", "default") != "default":
            continue  # the simulation prices the engine as it is
        if r["stage"] == "rollout":
            rows = r["rows"]
            generations = max(2, rows)  # GRPO's smallest group, decoded `rows` at a time
            step = simulate_step(MODEL, max_prompt_length=PROMPT, max_completion_length=r["completion"],
                                 num_generations=generations, rollout_max_rows=rows, load_in_4bit=four_bit, gpu=card,
                                 dtype=dtype)
            priced = step.time(card, graph_decode=r["mode_used"] == "cuda_graph")
            pieces = generations // rows
            r["prefill_predicted_s"] = priced.seconds("prefill") / pieces
            per_step = pieces * (r["completion"] - 1)
            r["decode_step_predicted_s"] = priced.seconds("decode") / per_step
            decode = priced.stages["decode"]  # where the priced step's time goes: the GPU's kernels, the host's launches
            r["decode_step_predicted_gpu_s"], r["decode_step_predicted_host_s"] = (decode.gpu_seconds / per_step,
                                                                                 decode.host_seconds / per_step)
            print(f"{r['kind']} {r['decode']:>10} {rows:>2} rows: prefill {r['prefill_forward_s'] * 1e3:.1f} ms "
                  f"measured, {r['prefill_predicted_s'] * 1e3:.1f} predicted; decode step "
                  f"{r['decode_step_s'] * 1e3:.2f} ms measured, {r['decode_step_predicted_s'] * 1e3:.2f} predicted")
        else:
            step = simulate_step(MODEL, max_prompt_length=PROMPT, max_completion_length=r["completion"],
                                 num_generations=r["rows"], load_in_4bit=four_bit, gpu=card, rollout=False,
                                 dtype=dtype)
            priced = step.time(card)
            r["update_predicted_s"], r["optimizer_predicted_s"] = priced.update, priced.optimizer
            r["update_stages_predicted_s"] = {k: v.seconds for k, v in priced.stages.items()}
            r["simulated_peak_bytes"] = step.peak
            print(f"{r['kind']} update {r['update_s']:.3f} s measured, {priced.update:.3f} predicted; optimizer "
                  f"{r['optimizer_s'] * 1e3:.1f} ms measured, {priced.optimizer * 1e3:.1f} predicted")
    results["predicted_on"] = card.name
    path.write_text(json.dumps(results, indent=1) + "\n")


def graph_profile(out_dir: Path) -> None:
    """A CUDA profile of one rollout decoded from a CUDA graph (bf16 LoRA, 1 row x 32 tokens): host time per graph
    launch, the syncs per step, the kernels each replay runs (step_time_gpu_<card>_graph_decode_profile.txt)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from grpo_nb.rollout import RolloutEngine

    model = build("lora", "cuda")
    ids, mask = prompt("cuda")
    engine = RolloutEngine(max_completion_length=32, min_new_tokens=32, seed=0, decode="cuda_graph")
    engine(model, TOKENIZER, ids, mask, 1)
    engine(model, TOKENIZER, ids, mask, 1)
    lines = [str(engine.last_stats)]
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine(model, TOKENIZER, ids, mask, 1)
    lines += [str(engine.last_stats), prof.key_averages().table(sort_by="cpu_time_total", row_limit=35),
              prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)]
    name = torch.cuda.get_device_name().split()[-1].lower()
    (out_dir / f"step_time_gpu_{name}_graph_decode_profile.txt").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--predict", type=Path, help="a measured JSON to add the simulation's prices to")
    ap.add_argument("--kinds", default="lora,qlora", help="lora, qlora or both (comma-separated)")
    ap.add_argument("--profile", action="store_true", help="also a CUDA profile of a decode and of the update")
    ap.add_argument("--graph-profile", action="store_true", help="only a CUDA profile of a CUDA-graph decode")
    ap.add_argument("--variants", action="store_true",
                    help="also decode with the exact LoRA branch, and with a done-check every step (A/B)")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: checks the script itself")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.predict:
        predict(args.predict)
    elif args.graph_profile:
        graph_profile(Path(args.out_dir))
    else:
        measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
