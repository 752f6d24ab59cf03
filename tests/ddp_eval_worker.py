"""One side of tests/test_eval_during_training.py's data-parallel test: train(eval_dataset=...) under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_eval_worker.py OUT_DIR

Each rank trains one step of the tiny model (ddp_worker's deterministic stand-in rollout) with a 5-row held-out set
evaluated before the step and after it, and writes rank<r>.json: the evaluations as its history keeps them, the
held-out rows its own reward function saw (its share), and the messages of two refused runs (another eval set on
rank 1; fsdp=True).
"""

import json
import os
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_worker import WIDTH, fixed_rollout, token_id_reward  # noqa: E402
from tiny_models import tiny_model, tiny_tokenizer  # noqa: E402

from grpo_nb import train  # noqa: E402
from grpo_nb.models import prepare_tokenizer  # noqa: E402

# idx 100 + i: the held-out rows (the training rows' are below 100), 5 of them: 2 on rank 0, 3 on rank 1
HELD_OUT = [{"prompt": p, "answer": a, "idx": 100 + i}
            for i, (p, a) in enumerate([("w5 w6", "7"), ("w8", "3"), ("w9 w10 w11", "1"), ("w12 w7", "7"),
                                        ("w13", "13")])]
TRAIN = [{"prompt": " ".join(f"w{4 + (i * 7 + j) % 40}" for j in range(3 + i % 3)), "idx": i} for i in range(8)]
SEEN = []  # the held-out rows this process's reward function scored
TOKENIZER = prepare_tokenizer(tiny_tokenizer())


def squared_index(completions, idx, **kwargs):
    """(idx - 100)^2 on a held-out row: its mean over the whole set is 6.0 only if each row counted once."""
    SEEN.extend(i for i in idx if i >= 100)
    return [float((i - 100) ** 2) if i >= 100 else 0.0 for i in idx]


def model():
    torch.manual_seed(0)
    return get_peft_model(tiny_model("llama", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def run(out, name, eval_dataset, **settings):
    return train(model(), TOKENIZER, TRAIN, [token_id_reward, squared_index], rollout=fixed_rollout, num_generations=4,
                 per_device_train_batch_size=4, max_completion_length=WIDTH, max_prompt_length=16, learning_rate=1e-2,
                 max_steps=1, save_steps=0, output_dir=str(out / name), verbose=False, live=False, seed=1,
                 eval_dataset=eval_dataset, eval_steps=1, eval_on_start=True, per_device_eval_batch_size=1, **settings)


def refused(out, name, eval_dataset, **settings):
    try:
        run(out, name, eval_dataset, **settings)
    except ValueError as err:
        return str(err)
    return None


if __name__ == "__main__":
    out, rank = Path(sys.argv[1]), int(os.environ.get("RANK", "0"))
    history = run(out, "run", HELD_OUT)
    results = {"eval_start": history[0]["eval_start"], "eval": history[0]["eval"], "seen": SEEN,
               "evaluation_peak": history[0]["memory"].get("evaluation_peak"),
               "other_rows": refused(out, "other", HELD_OUT if rank == 0 else HELD_OUT[::-1]),
               "fsdp": refused(out, "fsdp", HELD_OUT, fsdp=True)}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
