"""Data parallel on the CPU: 2 gloo processes under torchrun equal one process with the same global batch,
with whole weights on each rank (DDP-style) and with the layers sharded over the ranks (fsdp=True)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from grpo_nb.checkpointing import read_state

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
MODES = ["ddp", "fsdp"]


def run_worker(out, processes, accumulation, mode="ddp"):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] \
        if processes > 1 else [sys.executable]
    done = subprocess.run([*launcher, str(WORKER), str(out), str(accumulation), *(["fsdp"] if mode == "fsdp" else [])],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single_dir = tmp_path_factory.mktemp("single")
    single = run_worker(single_dir, 1, accumulation=2)  # 2 prompts x 4 in one process
    ranks = {}
    for mode in MODES:  # 1 prompt x 4 on each of 2 ranks
        ranks_dir = tmp_path_factory.mktemp(mode)
        ranks[mode] = (run_worker(ranks_dir, 2, accumulation=1, mode=mode), ranks_dir)
    return (single[0], single_dir), ranks


def close(a, b):
    torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_two_ranks_equal_one_process(runs, mode, loss_type):
    (single, _), ranks = runs
    ranks = ranks[mode][0]
    for rank in ranks:
        ours, theirs = rank[loss_type], single[loss_type]
        for a, b in zip(ours["history"], theirs["history"], strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (loss_type, a["step"], key)
        for name, value in theirs["weights"].items():
            close(ours["weights"][name], value)
    # Both ranks hold the same weights.
    assert ranks[0][loss_type]["weights"] == ranks[1][loss_type]["weights"]


def test_each_rank_holds_its_share_of_the_layers(runs):
    (single, _), ranks = runs
    assert single["layer_share"] == 1.0 and [r["layer_share"] for r in ranks["ddp"][0]] == [1.0, 1.0]
    shares = [r["layer_share"] for r in ranks["fsdp"][0]]
    assert sum(shares) == pytest.approx(1.0) and all(0.45 < s < 0.55 for s in shares), shares


@pytest.mark.parametrize("mode", MODES)
def test_only_rank_zero_writes(runs, mode):
    out = runs[1][mode][1] / "dapo"
    assert (out / "checkpoint-2" / "trainer_state.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary folders left by a second writer


@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_hold_whole_tensors(runs, mode):
    """A sharded run's checkpoint and adapter are the whole tensors, the same as one process writes."""
    (_, single_dir), ranks = runs
    ours, theirs = ranks[mode][1] / "dapo", single_dir / "dapo"
    for name in ("checkpoint-2/trainable.safetensors", "checkpoint-2/adapter_model.safetensors",
                 "adapter_model.safetensors", "../dapo_adapter/adapter_model.safetensors"):  # the last by save_adapter
        a, b = safetensors.torch.load_file(ours / name), safetensors.torch.load_file(theirs / name)
        assert a.keys() == b.keys() and a, name
        for key in a:
            close(a[key], b[key])
    a, b = (read_state(d / "checkpoint-2")["optimizer"] for d in (ours, theirs))
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(a["state"][i][key]) is torch.Tensor  # not a DTensor shard
            close(a["state"][i][key], b["state"][i][key])


@pytest.mark.parametrize("mode", MODES)
def test_resume_from_rank_zeros_checkpoint(runs, mode):
    """Every rank resumes from rank 0's checkpoint (whole tensors, split again into shards under fsdp)
    and the resumed run ends where one process's does (the stand-in rollout is deterministic)."""
    (single, _), ranks = runs
    assert single["resumed_steps"] == [1, 2, 3, 4]
    for rank in ranks[mode][0]:
        assert rank["resumed_steps"] == [1, 2, 3, 4]
        for name, value in single["resumed_weights"].items():
            close(rank["resumed_weights"][name], value)


def test_fsdp_in_one_process_warns_and_trains_unsharded(tmp_path):
    from tiny_models import FAST, count_w7, dataset, lora_model
    from tiny_models import tiny_tokenizer

    from grpo_nb import train
    from grpo_nb.distributed import is_sharded
    from grpo_nb.models import prepare_tokenizer

    model = lora_model()
    with pytest.warns(UserWarning, match="this is one process, so it trains unsharded"):
        history = train(model, prepare_tokenizer(tiny_tokenizer()), dataset(), count_w7, **FAST, max_steps=1,
                        fsdp=True, verbose=False, live=False, output_dir=str(tmp_path))
    assert len(history) == 1 and not is_sharded(model)


def test_ranks_given_other_settings_are_refused(tmp_path):
    """A seed computed per rank, or a dataset shuffled per process, would put the same prompts twice in a step
    (each rank takes its slice of one shuffle drawn from the seed): refused on every rank at set-up, naming the
    setting and each rank's value."""
    worker = WORKER.parent / "ddp_settings_worker.py"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        said = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "seed 42 on rank 0, 43 on rank 1" in said["seed"] and "not seed + rank" in said["seed"], said
        assert "the dataset's contents: other rows or another order on rank 1" in said["dataset"], said
        assert ".shuffle() needs the same seed=" in said["dataset"], said
    assert not (tmp_path / "seed" / "checkpoint-1").exists()


def test_launcher_variables_are_checked(monkeypatch):
    """WORLD_SIZE / RANK / MASTER_* left in a notebook's environment: a message naming the variable, not a 30-minute
    wait or torch's raw error; WORLD_SIZE=1 with a stale RANK is one process, rank 0 (it takes the output_dir lock)."""
    from grpo_nb import distributed

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRPO_NB_DIST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "1")
    assert distributed.launch_rank() == 0 and distributed.setup(torch.device("cpu")) == distributed.World()
    for env, fragment in [({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
                          ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be the number of processes"),
                          ({"WORLD_SIZE": "2", "RANK": ""}, "but RANK is not set"),
                          ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK is '5': it must be this process's number, 0 to 1"),
                          ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a whole number"),
                          ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not set"),
                          ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
                           "MASTER_PORT='99999' must be a port")]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match="unset") as err:
            distributed.launch_rank()
        assert fragment in str(err.value) and "torchrun" in str(err.value)
        for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GRPO_NB_DIST_TIMEOUT", "1e300")  # probe P34 F3: past what a timedelta holds
    with pytest.raises(ValueError, match="GRPO_NB_DIST_TIMEOUT='1e300' must be a number of seconds from 0 to"):
        distributed.rendezvous_timeout()
    monkeypatch.setenv("GRPO_NB_DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="GRPO_NB_DIST_TIMEOUT='soon' must be a number of seconds"):
        distributed.rendezvous_timeout()


@pytest.fixture
def one_rank_group():
    """A process group of this one process (gloo), so FSDP can shard here; taken down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("offloaded", [True, False])
def test_sharded_layers_checkpointed_around_their_hooks_get_gradients(one_rank_group, offloaded, monkeypatch):
    """transformers 5.17's decoder layers checkpoint their whole __call__, FSDP's hooks (gather the shards, then
    reduce-scatter the gradients) included, where 5.24's checkpoint their forward inside the hooks. grpo-nb's
    offloaded checkpoint then got the layer's shards, not the gathered weights the forward used: no gradient
    reached the layers, and every fsdp=True step on 5.17 had grad_norm 0. Here 5.17's layer is emulated (on any
    version) and a sharded model's gradients must equal the unsharded model's."""
    import functools

    from peft import LoraConfig, get_peft_model
    from tiny_models import tiny_model
    from torch.distributed.tensor import DTensor
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from grpo_nb.distributed import World, checkpoints_around_hooks, shard_model
    from grpo_nb.offload import enable_offloaded_checkpointing, find_checkpointing_layers

    def call_517(self, *args, **kwargs):  # transformers 5.17's GradientCheckpointingLayer.__call__, in short
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(torch.nn.Module.__call__, self, **kwargs), *args)
        return torch.nn.Module.__call__(self, *args, **kwargs)

    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", call_517, raising=False)

    class CheckpointedCall(LlamaDecoderLayer):
        pass

    # Set after the class statement, so a newer transformers' __init_subclass__ does not wrap it to checkpoint again.
    CheckpointedCall.forward = lambda self, *args, **kwargs: LlamaDecoderLayer.forward(self, *args, **kwargs)

    def gradients(shard):
        model = get_peft_model(tiny_model("llama", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for name, param in model.named_parameters():  # B is zero at init: A's gradient would be zero too
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        for layer in find_checkpointing_layers(model):
            layer.__class__ = CheckpointedCall
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if offloaded:
            enable_offloaded_checkpointing(model, min_offload_bytes=0)
        assert all(checkpoints_around_hooks(layer) for layer in find_checkpointing_layers(model))
        model.train()
        if shard:
            shard_model(model, World(0, 1))
        logits = model(input_ids=torch.arange(4, 20).view(2, 8)).logits
        logits.float().pow(2).mean().backward()
        return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                for name, p in model.named_parameters() if p.requires_grad}

    whole, sharded = gradients(shard=False), gradients(shard=True)
    assert whole.keys() == sharded.keys()
    for name, grad in whole.items():
        assert sharded[name] is not None and sharded[name].abs().sum() > 0, name
        torch.testing.assert_close(sharded[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_layer_class_with_its_own_call_keeps_it():
    """Only transformers' GradientCheckpointingLayer.__call__ (5.17's, around the hooks) is moved inside them: a
    model's layer class whose __call__ is its own is left as it is."""
    from grpo_nb.distributed import checkpoint_inside_hooks, checkpoints_around_hooks

    class Own(torch.nn.Linear):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 2

    layer = Own(2, 2)
    assert not checkpoints_around_hooks(layer)
    checkpoint_inside_hooks(layer)
    assert type(layer) is Own


def test_an_override_over_517s_checkpointing_call_is_refused(monkeypatch):
    """A decoder layer class whose own __call__ delegates to 5.17's GradientCheckpointingLayer.__call__ still
    checkpoints around FSDP's hooks (the probe: all 28 parameters without gradients, no word): refused, not left."""
    import functools

    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from grpo_nb.distributed import checkpoint_inside_hooks
    from tiny_models import tiny_config

    def call_517(self, *args, **kwargs):  # transformers 5.17's, in short
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(torch.nn.Module.__call__, self, **kwargs), *args)
        return torch.nn.Module.__call__(self, *args, **kwargs)

    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", call_517, raising=False)

    class Delegating(LlamaDecoderLayer):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    # A class's forward patched after one of its layers was moved: the patch runs (it was the first forward seen).
    class Plain(LlamaDecoderLayer):
        pass

    Plain.forward = lambda self, *args, **kwargs: LlamaDecoderLayer.forward(self, *args, **kwargs)
    first, second = Plain(tiny_config("llama"), 0), Plain(tiny_config("llama"), 1)
    checkpoint_inside_hooks(first)
    calls = []
    Plain.forward = lambda self, *args, **kwargs: calls.append(1) or LlamaDecoderLayer.forward(self, *args, **kwargs)
    checkpoint_inside_hooks(second)
    hidden = torch.randn(1, 3, 64)
    rotary = torch.ones(1, 3, 16), torch.zeros(1, 3, 16)
    first(hidden, position_embeddings=rotary)
    second(hidden, position_embeddings=rotary)
    assert len(calls) == 2

    layer = Delegating(tiny_config("llama"), 0)
    checkpoint_inside_hooks(layer)  # not checkpointed: nothing to move
    layer.gradient_checkpointing = True
    with pytest.raises(ValueError, match="Delegating overrides __call__ over transformers' GradientCheckpointingLayer"):
        checkpoint_inside_hooks(layer)
