"""Several reward functions: TRL 1.16's multi_objective_aggregation ("sum_then_normalize" | "normalize_then_sum", GDPO),
checked against TRL's own _generate_and_score_completions on fixed rewards; and reward functions that cannot run in a
helper thread (math_verify's signal.alarm), refused with reward_timeout before any rollout."""

from __future__ import annotations

import functools
import math
import sys
import textwrap

import pytest
import torch

from grpo_nb import GRPOConfig
from grpo_nb.batch import StepBatch
from grpo_nb.reward_calls import aggregated_advantages, check_reward_threads, combine_rewards
from grpo_nb.loss import group_advantages
from tiny_models import tiny_model, tiny_tokenizer

G = 4
N = 5 * G
NAN = math.nan
# two functions' rewards by position, with None (NaN) where a function does not score: group 0 all scored, group 1
# one function alone on some, group 2 a function with one score only, group 3 flat, group 4 scored by none
FIRST = [1.0, 0.0, 3.0, 2.0, 5.0, NAN, 1.0, 4.0, 2.0, 2.0, NAN, 7.0, 1.0, 1.0, 1.0, 1.0, NAN, NAN, NAN, NAN]
SECOND = [10.0, -5.0, 0.0, 20.0, NAN, 0.5, 0.25, NAN, NAN, 3.0, NAN, NAN, 2.0, 2.0, 2.0, 2.0, NAN, NAN, NAN, NAN]
WEIGHTS = [1.0, 0.5]


def per_func() -> torch.Tensor:
    return torch.tensor([FIRST, SECOND]).T.contiguous()


def by_position(values):
    def reward(completions, **kwargs):
        return [None if math.isnan(v) else v for v in values]
    return reward


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    trl = pytest.importorskip("trl", reason="TRL is the parity oracle (the dev extra installs trl)")
    from datasets import Dataset

    root = tmp_path_factory.mktemp("aggregation")
    tiny_model("llama", seed=0, attn_implementation="sdpa").save_pretrained(root / "model")
    first, second = by_position(FIRST), by_position(SECOND)
    first.__name__, second.__name__ = "first", "second"
    args = trl.GRPOConfig(output_dir=str(root / "out"), report_to=[], per_device_train_batch_size=N, num_generations=G,
                          max_completion_length=4, use_cpu=True, bf16=False, save_strategy="no", seed=0,
                          reward_weights=WEIGHTS, multi_objective_aggregation="normalize_then_sum")
    trainer = trl.GRPOTrainer(model=str(root / "model"), reward_funcs=[first, second], args=args,
                              processing_class=tiny_tokenizer(),
                              train_dataset=Dataset.from_dict({"prompt": ["w5 w6 w7"] * G}))
    trainer.model.train()
    return trainer


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_advantages_match_trl(trl_trainer, aggregation):
    trl_trainer.multi_objective_aggregation = aggregation
    prompts = [f"w{5 + 3 * i} w6 w7" for i in range(N // G)]
    out = trl_trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])
    ours = aggregated_advantages(per_func(), G, reward_weights=WEIGHTS, aggregation=aggregation)
    torch.testing.assert_close(ours, out["advantages"], atol=1e-5, rtol=1e-5)
    assert (ours[16:] == 0).all()  # scored by none: no signal


def test_normalize_then_sum_differs_and_reaches_the_batch():
    """GDPO's point: a function with a wide range (SECOND) no longer outweighs the other; StepBatch takes the
    config's aggregation (and a batch made without per-function rewards keeps the weighted total's)."""
    summed = aggregated_advantages(per_func(), G, reward_weights=WEIGHTS)
    torch.testing.assert_close(summed, group_advantages(combine_rewards(per_func(), WEIGHTS), G))
    gdpo = aggregated_advantages(per_func(), G, reward_weights=WEIGHTS, aggregation="normalize_then_sum")
    assert not torch.allclose(summed, gdpo)
    ids = torch.ones(N, 2, dtype=torch.long)
    batch = StepBatch(ids, ids, ids, ids, ids, None, G, combine_rewards(per_func(), WEIGHTS), per_func())
    config = GRPOConfig(num_generations=G, per_device_train_batch_size=N, reward_weights=WEIGHTS)
    torch.testing.assert_close(batch.with_advantages(config).advantages, summed)
    gdpo_config = GRPOConfig(num_generations=G, per_device_train_batch_size=N, reward_weights=WEIGHTS,
                             multi_objective_aggregation="normalize_then_sum")
    torch.testing.assert_close(batch.with_advantages(gdpo_config).advantages, gdpo)
    with pytest.raises(ValueError, match="multi_objective_aggregation='gdpo' is invalid: allowed: sum_then_normalize"):
        GRPOConfig(multi_objective_aggregation="gdpo")


# ----------------------------------------------------------------------------- math_verify under reward_timeout

@pytest.fixture
def fake_math_verify(tmp_path, monkeypatch):
    """A module named math_verify (the real one may not be installed, and is never imported by grpo-nb), and a
    module of reward functions written against it as open-r1's and TRL's are."""
    (tmp_path / "math_verify.py").write_text("def parse(text, **kw):\n    return [text]\n\n"
                                             "def verify(gold, answer, **kw):\n    return gold == answer\n")
    (tmp_path / "some_rewards.py").write_text(textwrap.dedent("""
        import threading

        import math_verify
        from math_verify import parse, verify

        def accuracy_reward(completions, solution, **kwargs):  # open-r1's: math_verify's own timeouts
            return [float(verify(parse(s), parse(c))) for c, s in zip(completions, solution)]

        def module_reward(completions, solution, **kwargs):
            return [float(math_verify.verify(s, c)) for c, s in zip(completions, solution)]

        def _check(c, s):
            return float(verify(parse(s), parse(c)))

        def helper_reward(completions, solution, **kwargs):  # math_verify one call away
            return [_check(c, s) for c, s in zip(completions, solution)]

        def trl_style_reward(completions, solution, **kwargs):  # TRL's accuracy_reward: timeouts off in a thread
            main = threading.current_thread() is threading.main_thread()
            return [float(verify(parse(s), parse(c), timeout_seconds=5 if main else None))
                    for c, s in zip(completions, solution)]

        def plain_reward(completions, **kwargs):
            return [0.0] * len(completions)

        import ast

        class helpers:  # a user's own verify(), beside math_verify's imported above
            @staticmethod
            def verify(a, b):
                return a == b

        def ast_reward(completions, **kwargs):  # ast.parse and helpers.verify: no use of the global parse / verify
            return [float(bool(ast.parse("1")) and helpers.verify(1, 1)) for c in completions]

        def local_import_reward(completions, solution, **kwargs):  # math_verify imported inside the function
            from math_verify import verify as check
            return [float(check(s, c)) for c, s in zip(completions, solution)]
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("math_verify", "some_rewards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import some_rewards

    yield some_rewards
    for name in ("math_verify", "some_rewards"):
        sys.modules.pop(name, None)


def test_math_verify_rewards_are_refused_with_a_timeout(fake_math_verify):
    m = fake_math_verify

    @functools.wraps(m.accuracy_reward)
    def wrapped(*args, **kwargs):
        return m.accuracy_reward(*args, **kwargs)

    class Scorer:
        def __call__(self, completions, **kwargs):
            return m.helper_reward(completions, **kwargs)

    refused = {"accuracy_reward": m.accuracy_reward, "module_reward": m.module_reward,
               "helper_reward": m.helper_reward, "partial": functools.partial(m.accuracy_reward, solution=["1"]),
               "wrapped": wrapped, "lambda": lambda completions, **kw: m.accuracy_reward(completions, **kw),
               "object": Scorer(), "math_verify.verify itself": m.math_verify.verify,
               "imported inside": m.local_import_reward}
    for what, func in refused.items():
        with pytest.raises(ValueError, match="calls math_verify") as err:
            check_reward_threads([m.plain_reward, func], 30.0)
        assert "signal.alarm" in str(err.value) and "reward_timeout=None" in str(err.value), what
        check_reward_threads([m.plain_reward, func], None)  # without a timeout they run in the main thread
    check_reward_threads([m.plain_reward, m.trl_style_reward], 30.0)  # it checks for the main thread itself
    check_reward_threads([m.ast_reward], 30.0)  # attribute names that match math_verify's functions: not a use
