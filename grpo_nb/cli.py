"""Command line: `grpo-nb demo` (also `python -m grpo_nb demo`)."""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-nb", description="GRPO training for reasoning LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the embedded default model on offline arithmetic (CPU, minutes)")
    demo.add_argument("--output-dir", default="grpo_nb_demo")
    demo.add_argument("--max-steps", type=int, default=None, help="default: the main job's")
    demo.add_argument("--eval-size", type=int, default=None, help="held-out problems (default: the main job's)")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import DEMO_EVAL_SIZE, DEMO_STEPS, run_demo

        run_demo(args.output_dir, max_steps=args.max_steps or DEMO_STEPS, eval_size=args.eval_size or DEMO_EVAL_SIZE,
                 seed=args.seed)
    return 0
