"""Command line: `grpo-nb demo` (also `python -m grpo_nb demo`)."""

from __future__ import annotations

import argparse

from .arguments import SEED_LIMIT


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-nb", description="GRPO training for reasoning LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the embedded default model on offline arithmetic (CPU, minutes)")
    demo.add_argument("--output-dir", default="grpo_nb_demo")
    demo.add_argument("--max-steps", type=_int_from(1), default=None, help="default: the main job's")
    demo.add_argument("--long", action="store_true",
                      help="the main job's recipe for 40 steps (~7-11 minutes on 2 cores instead of ~2-3): learns more")
    demo.add_argument("--eval-size", type=_int_from(1), default=None, help="held-out problems (default: the main job's)")
    # GRPOConfig.seed's bound: torch's generators take 64 bits, and the run adds offsets to its seed
    demo.add_argument("--seed", type=_int_from(0, SEED_LIMIT), default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import DEMO_EVAL_SIZE, DEMO_LONG_STEPS, DEMO_STEPS, check_demo_arguments, run_demo

        if args.long and args.max_steps is not None:
            demo.error(f"--long runs {DEMO_LONG_STEPS} steps and --max-steps {args.max_steps} asks another number: "
                       f"pass one of them")
        max_steps = (DEMO_LONG_STEPS if args.long else DEMO_STEPS) if args.max_steps is None else args.max_steps
        eval_size = DEMO_EVAL_SIZE if args.eval_size is None else args.eval_size
        try:  # a usage error, before minutes of loading and evaluating
            check_demo_arguments(args.output_dir, max_steps, eval_size, args.seed)
        except ValueError as err:
            demo.error(str(err))
        run_demo(args.output_dir, max_steps=max_steps, eval_size=eval_size, seed=args.seed)
    return 0


def _int_from(low: int, limit: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        if limit is not None and value >= limit:
            raise argparse.ArgumentTypeError(f"{value} is too large: expected a whole number below "
                                             f"2**{limit.bit_length() - 1}")
        return value

    return parse
