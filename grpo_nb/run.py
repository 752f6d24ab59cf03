"""What a training run is made of (`Run`: built once by `trainer.set_up`) and where it stands (`Progress`: what a
checkpoint keeps besides the weights and the optimizer). `train()` (trainer.py) moves them; `run_end.py` ends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from .batch import StepBatch
from .config import GRPOConfig
from .data import PromptSampler
from .distributed import World
from .memory import MemoryTracker
from .rollout import Rollout
from .tracking import new_run_id


@dataclass
class Run:
    """What `train()` builds around the model once, before the first step."""
    config: GRPOConfig
    world: World
    device: torch.device
    rollout: Rollout  # a RolloutEngine, HFGenerateRollout, vLLM's or the user's function (grpo_nb.rollout)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    params: list[torch.nn.Parameter]  # the trainable ones
    scaler: torch.amp.GradScaler | None  # fp16 weights only
    memory: MemoryTracker
    prompts: PromptSampler
    sharded: bool
    agent: object = None  # episodes.Agent: train(tools=..., environment_factory=...); None: single completions
    eval_warned: bool = False  # the held-out evaluation said its prompts were cut (once a run, not each time)
    auto_decided: frozenset = frozenset()  # settings the user left to grpo-nb that it decided for this run

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)


@dataclass
class Snapshot:
    """What the next step depends on besides the weights and the optimizer, taken at each step's end (inside the
    same deferred-interrupt block as the update): what a checkpoint of that step keeps, beside the history and the
    optimizer's, schedule's and loss scaler's states (`run_end.save_state`)."""
    step: int
    pending: tuple[dict, int] | None  # the generation batch still being trained on (StepBatch.state_dict()) and
    # the optimizer steps left on it (num_iterations), or None
    rng: dict  # python's, numpy's, torch's (and CUDA's) random states: checkpointing.rng_state()
    sampler: dict  # the prompt order and position: PromptSampler.state_dict()
    rollout: dict | None  # the engine's own random state: grpo_nb.rollout.rollout_state()
    run_id: str
    parent_run_id: str | None
    identity: dict  # what the run trains on: resume.run_identity()

    def as_state(self) -> dict:
        """The trainer state's entries (checkpoint_schema.STATE_KEYS) this snapshot gives, as they are written."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Progress:
    """Where the run stands: what a checkpoint keeps besides the weights and the optimizer."""
    step: int = 0
    history: list[dict] = field(default_factory=list)
    batch: StepBatch | None = None  # the generation batch being trained on
    iterations_left: int = 0  # optimizer steps still to take on it (num_iterations)
    snapshot: Snapshot | None = None  # taken at each step's end, and when the run starts
    warned: set = field(default_factory=set)  # the warnings this run has given (each is given once)
    run_id: str = field(default_factory=new_run_id)  # names the run in its trackers; kept when resumed in place
    parent_run_id: str | None = None  # the run a fork (a resume into another output_dir) started from
    updating: bool = False  # the weights moved past `step` and the bookkeeping has not caught up: nothing is saved
    start: int = 0  # the step this run started at (a resumed run's checkpoint step): no step trained while equal
    identity: dict = field(default_factory=dict)  # what the run trains on (resume.run_identity), kept in checkpoints
