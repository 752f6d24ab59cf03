"""Multi-turn episodes in the simulated step (issue 28): the rollout as `train(tools=...)` runs it with grpo-nb's engine.

An episode's turns all share one budget, `max_completion_length` tokens over every turn and every tool result, so
the update trains on batches of the single-turn step's shapes (tool tokens are masked out of the loss, not out of
the batch). What differs is the rollout: the first turn is sampled into a KV cache that keeps every row, and each
later turn prefills only the tool's result (and the last sampled token) on top of it, then decodes - on CUDA a
static cache made for the whole budget at the first turn, each turn's decode steps replayed from one CUDA graph
(on the CPU a dynamic cache, grown turn by turn). With `rollout_max_rows` below the
step's rows, `grpo_nb.episodes.run_episodes` cannot keep every row on one cache: each turn is then a rollout of its
own (in pieces of `max_rows`, a static KV cache on CUDA), the conversation so far its prompt. `EpisodeRollout`
drives the engine through those turns with every turn and result at its share of the budget (the worst case, as
the single-turn simulation runs every completion to its full length).
"""

from __future__ import annotations

import torch

from ..memory.estimate import turn_budget
from ..rollout import RolloutEngine


class EpisodeRollout:
    """A rollout of `turns` model turns per completion, a tool result of `result_tokens` tokens between turns,
    as `grpo_nb.episodes.run_episodes` drives the engine: on one KV cache (`start_episodes` /
    `continue_episodes`), or, when the engine decodes fewer rows at once than there are, a new rollout per turn."""

    def __init__(self, engine: RolloutEngine, turns: int, result_tokens: int):
        self.engine, self.turns, self.result_tokens = engine, turns, result_tokens

    def __call__(self, model, tokenizer, prompt_ids, prompt_mask, num_generations):
        engine = self.engine
        full = engine.max_completion_length
        per_turn = turn_budget(full, self.turns, self.result_tokens)
        rows = prompt_ids.shape[0] * num_generations
        engine.max_completion_length = per_turn  # each turn's share (run_episodes gives later turns it as a budget)
        try:
            if engine.max_rows is None or rows <= engine.max_rows:
                # (the cache is made for the whole budget, as run_episodes' first turn makes it)
                batch, state = engine.start_episodes(model, tokenizer, prompt_ids, prompt_mask, num_generations,
                                                     room=full)
                try:
                    result = [tokenizer.pad_token_id] * self.result_tokens  # a tool result's tokens (any values)
                    for _ in range(self.turns - 1):
                        engine.continue_episodes(model, tokenizer, state, list(range(rows)), [result] * rows, per_turn)
                finally:
                    state.release()
                return batch
            # run_episodes' other path: the conversation so far (prompt, turns, results) is each later turn's prompt
            batch = engine(model, tokenizer, prompt_ids, prompt_mask, num_generations)
            ids = prompt_ids.repeat_interleave(num_generations, dim=0)
            mask = prompt_mask.repeat_interleave(num_generations, dim=0)
            turn = batch
            for _ in range(self.turns - 1):
                result = torch.full((rows, self.result_tokens), tokenizer.pad_token_id, dtype=ids.dtype, device=ids.device)
                ids = torch.cat([ids, turn.completion_ids, result], dim=1)
                mask = torch.cat([mask, torch.ones((rows, turn.completion_ids.shape[1] + self.result_tokens),
                                                   dtype=mask.dtype, device=mask.device)], dim=1)
                turn = engine(model, tokenizer, ids, mask, 1)
            return batch
        finally:
            engine.max_completion_length = full
