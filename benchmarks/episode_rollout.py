"""Episodes with tools: the native engine going on from each episode's KV cache vs prefilling the conversation
again at every turn (what any other rollout gets, and what TRL does with HF generate), one run, same model.

The embedded SmolLM2-135M-Instruct on the CPU, greedy, `--episodes` episodes of a chat prompt that offers one
tool (grpo-nb's tool template: the tool's schema in the system turn), and every turn that ends is taken as a
call (a fixed call format), so each episode runs `--rounds` tool rounds: `--rounds + 1` turns of at most
`--turn` tokens each, a tool result between them. Both paths must give the same tokens (greedy); the table
gives each path's wall time (median of `--repeats`, interleaved, after one uncounted warm-up pass) and the tokens
it prefilled, with the machine's load average (other work running meanwhile skews the seconds, not the tokens).

    python benchmarks/episode_rollout.py            # a few minutes on 2 cores

Writes benchmarks/results/episode_rollout_cpu.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


class EveryTurnCalls:
    """Every turn that ends asks for the tool (so that the number of turns is the benchmark's, not the model's)."""

    def parse(self, text, tools=None):
        return text, [{"name": "multiply", "arguments": {"a": 17, "b": 23}}]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turn", type=int, default=48, help="tokens a turn may take before it is ended")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from grpo_nb import GRPOConfig, setup_reasoning_model
    from grpo_nb.episodes import make_agent, run_episodes
    from grpo_nb.rollout import RolloutEngine, eos_token_ids

    torch.manual_seed(0)
    model, tok = setup_reasoning_model(lora_rank=16)
    eos = eos_token_ids(model, tok)
    rows = [{"prompt": [{"role": "user", "content": f"Use the tool to work out {17 + i} times 23, then say the "
                                                     f"answer in one sentence."}]} for i in range(args.episodes // 2)]
    budget = (args.rounds + 1) * args.turn + args.rounds * 64
    timings = {"kv_cache": [], "prefill_again": []}
    outputs, stats = {}, {}
    load_before = os.getloadavg()[0]
    for repeat in range(args.repeats + 1):  # the first pass warms up (allocations, kernels) and is not counted
        for path in timings:
            engine = RolloutEngine(max_completion_length=budget, greedy=True)
            # each turn ends after `turn` tokens at most: an engine budget per turn, the episode's over all turns
            engine.max_completion_length = args.turn
            rollout = engine if path == "kv_cache" else (lambda *a, _e=engine: _e(*a))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                agent = make_agent([multiply], None, tok, GRPOConfig(max_tool_calling_iterations=args.rounds))
            agent.format = EveryTurnCalls()
            prefilled = []
            original = model.forward

            def counting(*a, _f=original, **kw):  # the tokens each forward is given (decode steps: 1 per row)
                ids = kw.get("input_ids")
                if ids is not None and ids.shape[1] > 1:
                    prefilled.append(int(kw["attention_mask"][:, -ids.shape[1]:].sum()))
                return _f(*a, **kw)

            model.forward = counting
            started = time.perf_counter()
            try:
                episodes = run_episodes(model, tok, rows, rollout, 2, agent, max_prompt_length=None,
                                        max_completion_length=budget, context=None, device=model.device,
                                        eos_ids=eos, vocab_size=model.get_input_embeddings().weight.shape[0],
                                        engine=True)
            finally:
                model.forward = original
            if repeat:
                timings[path].append(time.perf_counter() - started)
            outputs[path] = episodes.batch.completion_ids[episodes.batch.completion_mask.bool()].tolist()
            stats[path] = {"prefilled_tokens": sum(prefilled), "turns": episodes.turns,
                           "sampled_tokens": int(episodes.batch.env_mask.sum()),
                           "tool_tokens": int((episodes.batch.completion_mask * (1 - episodes.batch.env_mask)).sum())}
    same = outputs["kv_cache"] == outputs["prefill_again"]
    result = {
        "benchmark": "episode_rollout.py",
        "model": "SmolLM2-135M-Instruct (embedded default), LoRA r=16, fp32",
        "settings": vars(args) | {"episode_budget": budget, "greedy": True},
        "same_tokens": same,
        "seconds": {k: statistics.median(v) for k, v in timings.items()},
        "all_seconds": timings,
        "stats": stats,
        "speedup": statistics.median(timings["prefill_again"]) / statistics.median(timings["kv_cache"]),
        "device": f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads",
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},  # other work on the machine meanwhile
        "versions": {"torch": torch.__version__},
    }
    out = ROOT / "benchmarks" / "results" / "episode_rollout_cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("| path | seconds (median) | tokens prefilled | sampled tokens | tool tokens |")
    print("|---|---|---|---|---|")
    for path in timings:
        s = stats[path]
        print(f"| {path} | {result['seconds'][path]:.2f} | {s['prefilled_tokens']:,} | {s['sampled_tokens']:,} | "
              f"{s['tool_tokens']:,} |")
    print(f"same tokens: {same}; speedup {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
