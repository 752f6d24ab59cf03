"""One side of tests/test_distributed.py: train a tiny model, in one process or under torchrun.

    python tests/ddp_worker.py OUT_DIR ACCUMULATION            # one process
    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_worker.py OUT_DIR 1 [fsdp]

Completions come from a deterministic stand-in rollout (a function of each prompt's tokens
and the generation index), so one process and two ranks see the very same completions and
everything after them can be compared. Each rank writes its histories and final weights.
"""

import json
import os
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import tiny_model, tiny_tokenizer  # noqa: E402

from grpo_nb import save_adapter, train  # noqa: E402
from grpo_nb.distributed import whole  # noqa: E402
from grpo_nb.offload import enable_offloaded_checkpointing  # noqa: E402
from grpo_nb.models import prepare_tokenizer  # noqa: E402
from grpo_nb.rollout import RolloutBatch  # noqa: E402

WIDTH = 6


def fixed_rollout(model, tokenizer, prompt_ids, prompt_mask, num_generations):
    completions, lengths = [], []
    for ids, mask in zip(prompt_ids, prompt_mask):
        base = sum(ids[mask.bool()].tolist())
        for j in range(num_generations):
            length = 2 + (base + 3 * j) % (WIDTH - 1)
            completions.append([4 + (base * 7 + j * 13 + t * 5) % 500 for t in range(length)])
            lengths.append(length)
    ids = torch.zeros(len(completions), WIDTH, dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(c)
    mask = (torch.arange(WIDTH)[None] < torch.tensor(lengths)[:, None]).long()
    return RolloutBatch(prompt_ids.repeat_interleave(num_generations, 0), prompt_mask.repeat_interleave(num_generations, 0),
                        ids, mask, torch.ones(len(completions), dtype=torch.bool))


def token_id_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def main():
    out, accumulation = Path(sys.argv[1]), int(sys.argv[2])
    fsdp = sys.argv[3:] == ["fsdp"]  # shard the layers over the ranks instead of a whole copy on each
    rank = int(os.environ.get("RANK", "0"))
    tok = prepare_tokenizer(tiny_tokenizer())
    prompts = [" ".join(f"w{4 + (i * 7 + j) % 40}" for j in range(3 + i % 3)) for i in range(8)]
    results = {}
    for loss_type, extra in [("dapo", {}), ("grpo", {"beta": 0.04, "num_iterations": 2}),
                             ("dr_grpo", {"max_grad_norm": 1e-3})]:  # clipped: the norm spans the ranks' shards
        torch.manual_seed(0)
        model = get_peft_model(tiny_model("llama", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        if fsdp:  # sharded layers under grpo-nb's offloaded checkpointing, as setup_reasoning_model sets it on CUDA
            model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            enable_offloaded_checkpointing(model, min_offload_bytes=0)  # tiny activations too
        history = train(model, tok, [{"prompt": p} for p in prompts], token_id_reward, rollout=fixed_rollout,
                        num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
                        max_completion_length=WIDTH, max_prompt_length=16, learning_rate=1e-2, max_steps=3,
                        save_steps=2, loss_type=loss_type, output_dir=str(out / loss_type), verbose=False, live=False,
                        seed=1, fsdp=fsdp, **extra)
        weights = {n: whole(p).detach().tolist() for n, p in model.named_parameters() if p.requires_grad}
        save_adapter(model, out / f"{loss_type}_adapter")  # every rank calls it; rank 0 writes
        keep = ("step", "reward", "reward_std", "loss", "kl", "grad_norm", "completion_length_mean", "clip_ratio",
                "frac_reward_zero_std")
        results[loss_type] = {"history": [{k: r[k] for k in keep} for r in history], "weights": weights}
    # Resuming from rank 0's checkpoint works on every rank (not bit-exact across ranks: see train()).
    model = get_peft_model(tiny_model("llama", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    resumed = train(model, tok, [{"prompt": p} for p in prompts], token_id_reward, rollout=fixed_rollout,
                    num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
                    max_completion_length=WIDTH, max_prompt_length=16, learning_rate=1e-2, max_steps=4, save_steps=2,
                    output_dir=str(out / "dapo"), verbose=False, live=False, seed=1, resume_from_checkpoint=True,
                    fsdp=fsdp)
    results["resumed_steps"] = [r["step"] for r in resumed]
    results["resumed_weights"] = {n: whole(p).detach().tolist() for n, p in model.named_parameters() if p.requires_grad}
    layer_params = [p for layer in model.get_base_model().model.layers for p in layer.parameters()]
    results["layer_share"] = sum(getattr(p, "to_local", lambda: p)().numel() for p in layer_params) / \
        sum(p.numel() for p in layer_params)  # the part of the layers' weights this rank holds
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
