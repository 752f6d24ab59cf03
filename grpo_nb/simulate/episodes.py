"""Multi-turn episodes in the simulated step (issue 28): the rollout as `train(tools=...)` runs it with grpo-nb's engine.

An episode's turns all share one budget, `max_completion_length` tokens over every turn and every tool result, so
the update trains on batches of the single-turn step's shapes (tool tokens are masked out of the loss, not out of
the batch). What differs is the rollout: the first turn is sampled into a dynamic KV cache that keeps every row,
and each later turn prefills only the tool's result (and the last sampled token) on top of it, then decodes -
the cache grows turn by turn instead of being allocated once at full length. `EpisodeRollout` drives the engine
through those turns with every turn and result at its share of the budget (the worst case, as the single-turn
simulation runs every completion to its full length).
"""

from __future__ import annotations

from ..memory.estimate import turn_budget
from ..rollout import RolloutEngine


class EpisodeRollout:
    """A rollout of `turns` model turns per completion, a tool result of `result_tokens` tokens between turns,
    through `RolloutEngine.start_episodes` / `continue_episodes` (what `grpo_nb.episodes.run_episodes` calls)."""

    def __init__(self, engine: RolloutEngine, turns: int, result_tokens: int):
        self.engine, self.turns, self.result_tokens = engine, turns, result_tokens

    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations):
        engine = self.engine
        full = engine.max_completion_length
        per_turn = turn_budget(full, self.turns, self.result_tokens)
        engine.max_completion_length = per_turn  # the first turn's share; later turns get it as their budget
        try:
            batch, state = engine.start_episodes(model, tokenizer, prompt_ids, prompt_mask, num_generations)
            rows = list(range(batch.completion_ids.shape[0]))
            result = [tokenizer.pad_token_id] * self.result_tokens  # a tool result's tokens (their values: any)
            for _ in range(self.turns - 1):
                engine.continue_episodes(model, tokenizer, state, rows, [result] * len(rows), per_turn)
        finally:
            engine.max_completion_length = full
        return batch
