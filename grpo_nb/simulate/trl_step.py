"""TRL's GRPOTrainer step for the same batch, on the meta device, every allocation counted.

What runs is TRL's own code: a `trl.GRPOTrainer` is built around the meta model (so its peft
wrapping, its casting of QLoRA adapters to bf16, `enable_input_require_grads` and its fused
LM head are its own), and the step calls its methods. What is not TRL's, said plainly:

* The config is TRL's `GRPOConfig` with `place_model_on_device` overridden to False (the property
  transformers documents for integrations to override), so the Trainer leaves the meta model where
  it is instead of moving it to a device.
* Gradient checkpointing is switched on as `Trainer.train()` would (`gradient_checkpointing_enable`
  with the config's kwargs), and `current_gradient_accumulation_steps` set as its loop sets it: the
  step runs without `train()`, calling `compute_loss` and `accelerator.backward` per micro-batch.
* The trainer runs "on the CPU" (the meta device stands for the GPU), so its autocast context is
  the CPU's: `SimulatedDevice` applies CUDA autocast's rules to meta tensors while it is on, and
  `torch.is_autocast_enabled` / `get_autocast_dtype` asked about "meta" (TRL's fused LM head asks
  its input's device type) answer with that context's state.
* TRL's fused LM head folds logits tiles with Triton kernels on CUDA and with torch ops elsewhere;
  the simulation makes it take its CUDA path (`_use_triton` true for meta tensors) with the
  kernels' launches as no-ops: they only write into buffers TRL allocated, as on a GPU. Its
  backward accumulates the gradient GEMMs with `_addmm_fp32`, which on CUDA is one
  `torch.addmm(..., out_dtype=float32)` into the accumulator (no copies) and elsewhere upcasts
  both operands to fp32 first: the simulation takes the CUDA branch's allocations (none).
* The rollout is HF `generate` as TRL calls it (`unwrap_model_for_generation`, TRL's generation
  config, no grad), for one new token after a DynamicCache filled to the full length: generate's
  cache grows by one column per token (a new tensor per layer each step), so its largest moment
  is the last token's.
* The optimizer step is `torch.optim.AdamW` (multi-tensor) over the trainable parameters, like
  grpo-nb's; TRL's default fused AdamW holds the same states.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import tempfile
import time

import torch

from ..attachments import base_model, text_config
from ..memory import optimizer_bytes
from ..rollout.engine import cache_argument
from . import ops
from .device import SimulatedDevice, attention_scratch, written_by_kernel
from .ops import OpRecorder
from .build import forced_batch, meta_model, simulated_result, warm_optimizer
from .tracker import AllocationTracker


@contextlib.contextmanager
def _cuda_paths_for_meta(autocast_from: str):
    """The substitutions listed in the module docstring, undone on exit."""
    import trl.kernels.chunked_logprob as chunked
    import trl.trainer.utils as trl_utils

    def no_launch(*args, **kwargs):
        tile = args[0]  # the fold reads the logits tile once (and its backward writes it back)
        ops.kernel("TRL log-prob fold (Triton)", 4 * tile.numel(), 2 * tile.numel() * tile.element_size(), tile.dtype)
        written_by_kernel(*args)

    class _Kernel:  # `kernel[grid](...)` is a no-op
        def __getitem__(self, grid):
            return no_launch

    is_enabled, get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    use_triton = lambda device: device.type in ("cuda", "xpu", "meta")  # noqa: E731
    def addmm_fp32(acc, a, b):  # CUDA's torch.addmm(acc, a, b, out_dtype=float32, out=acc): no temporaries
        ops.kernel("TRL addmm into fp32 (backward)", 2 * a.shape[0] * a.shape[1] * b.shape[1],
                   (a.numel() + b.numel()) * a.element_size() + 2 * acc.numel() * 4, a.dtype)
        written_by_kernel(acc)

    saved = [(chunked, "_use_triton", chunked._use_triton), (trl_utils, "_use_triton", trl_utils._use_triton),
             (chunked, "_addmm_fp32", getattr(chunked, "_addmm_fp32", None)),
             (chunked, "_forward_kernel", getattr(chunked, "_forward_kernel", None)),
             (chunked, "_backward_kernel", getattr(chunked, "_backward_kernel", None)),
             (torch, "is_autocast_enabled", is_enabled), (torch, "get_autocast_dtype", get_dtype)]
    chunked._use_triton = trl_utils._use_triton = use_triton
    chunked._forward_kernel = chunked._backward_kernel = _Kernel()
    chunked._addmm_fp32 = addmm_fp32
    chunked.triton = getattr(chunked, "triton", None) or _Cdiv()
    torch.is_autocast_enabled = lambda *a: is_enabled(autocast_from if a and a[0] == "meta" else a[0]) if a \
        else is_enabled()
    torch.get_autocast_dtype = lambda device_type: get_dtype(autocast_from if device_type == "meta" else device_type)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class _Cdiv:
    """`triton.cdiv` where triton is missing (TRL's backward computes its grid with it)."""

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)


def _config_staying_in_place(config_class):
    """TRL's config class, with the Trainer told not to move the model (the meta model has no data to move)."""

    class StayInPlace(config_class):
        @property
        def place_model_on_device(self):
            return False

    return StayInPlace


def _stand_in_tokenizer(config):
    """A word-level tokenizer with the config's special ids: what the trainer reads of its tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    vocab = {"<pad>": 0, "</s>": 1, "x": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="x")),
                                  pad_token="<pad>", eos_token="</s>", unk_token="x")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok, eos


def simulate_trl_step(config, dtype: torch.dtype, settings: dict):
    """TRL's step at `settings` (see `simulate_step`), counted like grpo-nb's; `time()` prices it."""
    result = _simulate_trl(config, dtype, settings, False)
    result.record_ops = functools.partial(_simulate_trl, config, dtype, settings, True)  # pickles, unlike a lambda
    return result


def _simulate_trl(config, dtype: torch.dtype, settings: dict, recorder_wanted: bool):
    """Counted (a SimulatedStep), or with every kernel recorded (an OpTrace)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import unwrap_model_for_generation

    if settings["device"] != "cuda":
        raise ValueError("simulate_step(system='trl') simulates TRL on a GPU only (device='cuda')")
    started = time.perf_counter()
    s = settings
    n = s["prompts_per_step"] * s["num_generations"]
    micro = s["per_device_train_batch_size"]
    tracker = AllocationTracker("meta", label_bytes=2**20)
    oracle = SimulatedDevice("cuda", autocast_from="cpu", end_sampling_after=None, capability=s["capability"])
    recorder = OpRecorder(tracker.phase_name) if recorder_wanted else contextlib.nullcontext()
    notes = ["TRL's trainer is built around the meta model; see grpo_nb/simulate/trl_step.py for what the "
             "simulation substitutes"]
    with tracker, tracker.outputs_only_meta_kernels(scratch=attention_scratch), _cuda_paths_for_meta("cpu"):
        with tracker.paused():
            model = meta_model(config, dtype, load_in_4bit=s["load_in_4bit"])
            tokenizer, eos = _stand_in_tokenizer(config)
            args = _config_staying_in_place(GRPOConfig)(
                output_dir=tempfile.mkdtemp(prefix="grpo_nb_sim_trl_"), report_to=[], use_cpu=True,
                bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, per_device_train_batch_size=micro,
                gradient_accumulation_steps=n // micro, num_generations=s["num_generations"],
                max_completion_length=s["max_completion_length"], beta=s["beta"], loss_type=s["loss_type"],
                num_iterations=s["num_iterations"], gradient_checkpointing=bool(s["gradient_checkpointing"]),
                save_strategy="no", logging_strategy="no", optim="adamw_torch")
            peft_config = None
            if s["lora_rank"]:
                peft_config = LoraConfig(r=s["lora_rank"], lora_alpha=s["lora_rank"], target_modules="all-linear",
                                         task_type="CAUSAL_LM")
            trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * n}),
                                  processing_class=tokenizer, peft_config=peft_config)
            model = trainer.model
            if args.gradient_checkpointing:  # what Trainer.train() does before the first step
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
            trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
            model.train()
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-6, foreach=True)
        hooks = recorder.watch(base_model(model)) if recorder_wanted else []
        with oracle, recorder:
            batch = forced_batch(n, s["max_prompt_length"], s["max_completion_length"], config.vocab_size,
                                 device="meta", oracle=oracle, num_generations=s["num_generations"])
            with tracker.phase("optimizer state"):
                warm_optimizer(optimizer, params)
            if s["rollout"]:
                with tracker.phase("rollout"):
                    if recorder_wanted:  # the prefill and the first decode step: the cache at its shortest
                        _trl_generate(trainer, batch, unwrap_model_for_generation, from_prompts=True)
                    _trl_generate(trainer, batch, unwrap_model_for_generation)
            with tracker.phase("policy update"):
                for start in range(0, n, micro):
                    inputs = {k: getattr(batch, k)[start : start + micro] for k in
                              ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
                    inputs["num_items_in_batch"] = batch.completion_mask.sum()
                    inputs["old_per_token_logps"] = inputs["ref_per_token_logps"] = None
                    if s["beta"]:
                        inputs["ref_per_token_logps"] = oracle.know(
                            torch.empty(inputs["completion_ids"].shape, device="meta"),
                            torch.zeros(inputs["completion_ids"].shape))
                    loss = trainer.compute_loss(model, inputs)
                    trainer.accelerator.backward(loss)
                grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            with tracker.phase("optimizer step"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        for hook in hooks:
            hook.remove()
    if recorder_wanted:
        # generate's cache grows by a column per token, so a decode step's cost is linear in its length: the
        # first and last steps recorded stand for half of the steps each
        steps = s["max_completion_length"] - 1
        for units in recorder.trace.decode_units().values():
            for unit in units:
                recorder.trace.repeats[unit] = steps / len(units)
        return recorder.trace
    report = tracker.report()
    extra = {"gradients": grads, "optimizer": optimizer_bytes(optimizer)}
    return simulated_result("trl", {**settings, "trl_version": _trl_version()}, report, model, extra, oracle, started, notes)


def _trl_generate(trainer, batch, unwrap_model_for_generation, *, from_prompts: bool = False):
    """HF generate as TRL calls it, one token after a KV cache already holding the rest of the completion
    (`from_prompts`: two tokens from the prompts, the prefill and the first decode step)."""
    from transformers import DynamicCache

    g = trainer.num_generations
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    config = trainer.generation_config
    generation_config = copy.deepcopy(config)
    generation_config.max_new_tokens = 2 if from_prompts else 1
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     generation_kwargs=trainer.generation_kwargs,
                                     gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model, \
            torch.no_grad():
        if from_prompts:
            model.generate(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask,
                           generation_config=generation_config)
            return
        text = text_config(model)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        cache = DynamicCache(config=text)
        shape = (ids.shape[0], heads, ids.shape[1] - 1, head_dim)
        dtype = model.get_output_embeddings().weight.dtype
        for layer in range(text.num_hidden_layers):
            cache.update(torch.empty(shape, dtype=dtype, device="meta"), torch.empty(shape, dtype=dtype, device="meta"),
                         layer)
        model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config,
                       **{cache_argument(model): cache})
    del g


def _trl_version() -> str:
    import trl

    return trl.__version__
