"""One side of tests/test_distributed.py's check that every rank trains with the same settings, under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_settings_worker.py OUT_DIR

Each rank passes train() something of its own - a seed computed from RANK (the usual "seed each rank" idiom),
then a dataset shuffled per process - and writes what train() raised each time: both are refused at set-up, on
every rank, before a rollout."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import FAST, count_w7, dataset, lora_model, tiny_tokenizer  # noqa: E402

from grpo_nb import train  # noqa: E402
from grpo_nb.models import prepare_tokenizer  # noqa: E402


def main():
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    tok = prepare_tokenizer(tiny_tokenizer())
    results = {}
    for name, ds, overrides in [("seed", dataset(), {"seed": 42 + rank}),
                                ("dataset", dataset().shuffle(seed=rank), {})]:
        try:
            train(lora_model(), tok, ds, count_w7, **{**FAST, "max_steps": 1, "verbose": False, "live": False,
                                                      "output_dir": str(out / name), **overrides})
            results[name] = None
        except ValueError as err:
            results[name] = str(err)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    import torch.distributed as dist

    # train() joined the gloo group before refusing; left to interpreter exit, gloo's threads can abort the process
    # ("terminate called without an active exception", seen once in a full run)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
