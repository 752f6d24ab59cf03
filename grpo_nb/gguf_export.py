"""One GGUF file for llama.cpp, Ollama and LM Studio, written straight from the trained model.

    save_gguf(model, "out/model-f16.gguf", tokenizer)                       # 16-bit weights
    save_gguf(model, "out/model-q8_0.gguf", tokenizer, quantization="q8_0")  # about half the size

Llama and Qwen2 families (SmolLM, Llama 3.x, Qwen2.5, DeepSeek-R1-Distill-Qwen) with a
byte-level BPE tokenizer. The `gguf` package does the file format, the tensor names and the
Q8_0 / BF16 encodings; this module adds what llama.cpp's convert_hf_to_gguf.py adds on top:
the LoRA merge (save_merged's, on the fly, so the training model is untouched), the q/k
row order llama.cpp's Llama rotary embedding expects, the model's hyperparameters, and the
tokenizer (vocabulary, token types, merges, special ids, chat template). For SmolLM2 (Llama) and
tiny Qwen2 models its tensors are byte for byte, and its tokenizer fields value for value, the
ones llama.cpp's converter writes from a save_merged() folder.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch

from . import atomic_files, distributed
from .arguments import refuse
from .merging import check_fits_dtype, check_mergeable, is_peft, merged_numel, merged_tensors
from .output_checks import in_checkpoint
from .saving import check_can_write, check_disk_room, check_model

# name -> (tensor encoding of 2-D weights, the file type recorded in the header). 1-D tensors (norms,
# biases) stay float32 in every file, as llama.cpp writes them: they are tiny and its kernels want f32.
QUANTIZATIONS = {
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "f32": ("F32", "ALL_F32"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}
# transformers' model_type -> llama.cpp's architecture. Mistral (llama-like) and Qwen3 are not here on
# purpose: each differs in a detail (sliding window, q/k norms) this writer has not been checked against.
ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}

# llama.cpp names a byte-level BPE tokenizer's pre-tokenizer (its regex for splitting text before the
# merges) by the hash of the token ids of this text; the names below are the ones its
# convert_hf_to_gguf.py records for the families this writer supports.
_PRE_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
_PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3, 3.1, 3.2
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5, Qwen2, Qwen2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3 tokenizer
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}

F = "save_gguf"


def _gguf():
    try:
        import gguf
    except ImportError as err:  # a dependency of grpo-nb, so only a broken install gets here
        raise ImportError("save_gguf() needs the `gguf` package: pip install gguf") from err
    return gguf


def _output_file(path) -> Path:
    """The .gguf file about to be written, checked before any work: a file name (not a folder) whose
    folder can be written. An existing file there is replaced, as re-exporting means to, with a warning as
    save_adapter and save_merged give over a folder's model: it may be a download or another export."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        refuse(F, "path", path, "a file name ending in .gguf, as a str or pathlib.Path, e.g. 'out/model-f16.gguf'",
               TypeError)
    if (problem := atomic_files.name_problem(path)) is not None:
        refuse(F, "path", str(path), f"a file name ending in .gguf, and {problem}")
    path = atomic_files.expand(path)  # '~/out/model.gguf' as in a shell
    if path.is_dir():
        refuse(F, "path", str(path), f"a file name ending in .gguf, and this is a folder: e.g. "
               f"'{path / 'model-f16.gguf'}'")
    if path.suffix.lower() != ".gguf":
        refuse(F, "path", str(path), f"a file name ending in .gguf (llama.cpp and Ollama look for it): "
               f"e.g. '{path.with_suffix('.gguf')}'")
    if (problem := in_checkpoint(path)) is not None:  # as save_adapter and save_merged refuse a folder there
        refuse(F, "path", str(path), f"a file outside a training run's checkpoints; this one {problem}")
    check_can_write(F, path, start=path.parent)  # an old .gguf there is replaced
    if path.is_symlink() or path.exists():
        warnings.warn(f"{F}: {str(path)!r} already holds {_existing(path)}, which this export replaces. Pick a new "
                      f"name to keep it.", stacklevel=3)
    return path


def _existing(path: Path) -> str:
    """What the file this export replaces is, for the warning: a GGUF file (by its magic), a link, another file."""
    if path.is_symlink():
        return "a link (the link is replaced, not what it points to)"
    try:
        with open(path, "rb") as file:
            return "a GGUF file" if file.read(4) == b"GGUF" else "a file"
    except OSError:
        return "a file"


def _check_quantization(quantization) -> str:
    if not isinstance(quantization, str) or quantization.lower() not in QUANTIZATIONS:
        hint = ""
        if isinstance(quantization, str) and quantization.lower().startswith(("q4", "q5", "q6", "q3", "q2", "iq")):
            hint = (f"; for {quantization} write an f16 file and run llama.cpp's llama-quantize on it "
                    f"(`llama-quantize model-f16.gguf model-{quantization.lower()}.gguf {quantization.upper()}`)")
        refuse(F, "quantization", quantization, f"one of {', '.join(repr(q) for q in QUANTIZATIONS)}{hint}")
    return quantization.lower()


def _tokenizer_json(tokenizer) -> dict:
    """The tokenizer's `tokenizers` definition, refused unless it is a byte-level BPE (GPT-2 style)."""
    if tokenizer is None or not callable(getattr(tokenizer, "save_pretrained", None)):
        shown = tokenizer if tokenizer is None or isinstance(tokenizer, str) else f"<{type(tokenizer).__name__}>"
        refuse(F, "tokenizer", shown, "the model's tokenizer (from setup_reasoning_model): "
               "a GGUF file carries its vocabulary, without it llama.cpp cannot read text", TypeError)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        refuse(F, "tokenizer", type(tokenizer).__name__, "a fast tokenizer (AutoTokenizer.from_pretrained(..., "
               "use_fast=True))")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or model.get("byte_fallback") or not byte_level:
        kind = "SentencePiece-style BPE (Llama 2, Mistral)" if model.get("byte_fallback") else model.get("type")
        refuse(F, "tokenizer", type(tokenizer).__name__,
               f"a byte-level BPE tokenizer (GPT-2 style: SmolLM, Llama 3, Qwen2); this one is {kind}. Write the "
               "model with save_merged() and convert that folder with llama.cpp's convert_hf_to_gguf.py")
    return spec


def _pre_tokenizer(tokenizer) -> str:
    ids = tokenizer.encode(_PRE_CHECK_TEXT, add_special_tokens=False)
    checksum = sha256(str(ids).encode()).hexdigest()
    if checksum in _PRE_TOKENIZERS:
        return _PRE_TOKENIZERS[checksum]
    # llama.cpp's own converter stops here; a file that runs, with a generic split, is more use in a
    # notebook, and the warning says what that costs.
    warnings.warn(
        f"{F}(): the tokenizer's pre-tokenizer is not one llama.cpp knows by name (checksum {checksum[:16]}...); "
        "the file records 'default', so llama.cpp may split some text (digits, punctuation, spaces) into other "
        "tokens than transformers does. For an exact tokenizer, write save_merged() and convert the folder with "
        "an up-to-date llama.cpp convert_hf_to_gguf.py.", UserWarning, stacklevel=3)
    return "default"


def _looks_special(token: str) -> bool:
    # llama.cpp's rule of thumb for added tokens not flagged special: chat markers like <|im_start|>.
    return (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<｜") and token.endswith("｜>")) \
        or token in ("<pad>", "<mask>", "<s>", "</s>", "<unk>")


def _check_vocabulary_fits(tokenizer, n_vocab: int) -> None:
    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= n_vocab:
        refuse(F, "tokenizer", type(tokenizer).__name__,
               f"the model's tokenizer: it has token ids up to {max(vocab.values())} but the model's embedding has "
               f"{n_vocab} rows; load both from the same name, or model.resize_token_embeddings(len(tokenizer))")


def _vocabulary(tokenizer, n_vocab: int):
    """(tokens, token types) for ids 0..n_vocab-1, as llama.cpp's convert_hf_to_gguf.py lists them."""
    gguf = _gguf()
    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        token = by_id.get(i)
        if token is None:  # embedding rows past the tokenizer (Qwen2.5 pads its vocabulary to a round size)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if token in added:
            info = added_decoder.get(i)
            if info is not None and not info.normalized:
                # llama.cpp treats added tokens as already normalized: store them as the tokenizer writes them.
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            special = (info is not None and info.special) or _looks_special(token)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _add_tokenizer(writer, tokenizer, config, n_vocab: int) -> None:
    gguf = _gguf()
    _tokenizer_json(tokenizer)
    tokens, types = _vocabulary(tokenizer, n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # gguf's SpecialVocab reads merges, special token ids and the chat template from a saved tokenizer
    # folder, as llama.cpp's converter does; a temporary folder gives it the tokenizer as it is in memory.
    with tempfile.TemporaryDirectory(prefix="grpo-nb-gguf-") as folder:
        tokenizer.save_pretrained(folder)
        config.to_json_file(Path(folder) / "config.json")  # fallback special ids, read as the converter does
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise ValueError(f"{F}(tokenizer=...): the tokenizer has no BPE merges to write; it cannot be a GPT-2 "
                         f"style tokenizer. Pass the model's own tokenizer.")
    # What the tokenizer does, not what its config files claim: llama.cpp adds BOS/EOS by these flags.
    probe = tokenizer("a")["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and len(probe) > len(bare) \
        and probe[0] == tokenizer.bos_token_id
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and len(probe) > len(bare) \
        and probe[-1] == tokenizer.eos_token_id
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):  # the one in memory (prepare_tokenizer may have set it), not only the files'
        special.chat_template = template
    special.add_to_gguf(writer, quiet=True)


def _rope_settings(config) -> dict:
    """The rotary scaling as a plain dict (transformers 5's rope_parameters, or rope_scaling before it)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", None) or rope.get("rope_theta") or 10000.0)
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def _check_rope(config, model_type: str) -> None:
    kind = _rope_settings(config)["rope_type"]
    if kind not in ("default", "linear", "yarn") and not (kind == "llama3" and model_type == "llama"):
        raise NotImplementedError(f"{F}(): the model's rotary scaling {kind!r} is not written by save_gguf (it writes "
                                  f"default, linear, yarn and Llama's llama3). Write the model with save_merged() and "
                                  f"convert that folder with llama.cpp's convert_hf_to_gguf.py.")


def _llama3_rope_factors(rope: dict, head_dim: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent rotary scaling, as the per-frequency divisors llama.cpp reads from
    its rope_freqs tensor (high frequencies kept, low ones divided by `factor`, a smooth blend between)."""
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _header_sizes(config, n_vocab: int) -> dict:
    """The sizes the header records (each a uint32 in the file), by the config field each comes from."""
    heads = config.num_attention_heads
    sizes = {"max_position_embeddings": config.max_position_embeddings, "hidden_size": config.hidden_size,
             "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
             "num_attention_heads": heads, "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
             "vocab_size": n_vocab, "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}
    rope = _rope_settings(config)
    if rope["rope_type"] == "yarn" and rope.get("original_max_position_embeddings"):
        sizes["rope_parameters['original_max_position_embeddings']"] = rope["original_max_position_embeddings"]
    return sizes


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_header(config, n_vocab: int) -> None:
    """The header's values fit their fields (sizes uint32, the rest float32), checked before any tensor is
    converted: the gguf package finds out only when it writes the header, after the whole conversion."""
    for key, value in _header_sizes(config, n_vocab).items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**32:
            raise ValueError(f"{F}(): the model's config.{key}={value!r} does not fit a GGUF header: expected an "
                             f"integer from 1 to {2**32 - 1} (uint32). Set model.config.{key} to the model's real "
                             f"value (its config.json's).")
    rope = _rope_settings(config)
    floats = {"rms_norm_eps": config.rms_norm_eps, "rope_parameters['rope_theta']": rope["rope_theta"]}
    if rope["rope_type"] in ("linear", "yarn"):
        floats["rope_parameters['factor']"] = rope.get("factor")
    for key, value in floats.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= _FLOAT32_MAX:
            raise ValueError(f"{F}(): the model's config.{key}={value!r} does not fit a GGUF header: expected a "
                             f"finite number within float32's range (up to {_FLOAT32_MAX:.4g}). Set model.config.{key} "
                             f"to the model's real value (its config.json's).")


def _add_hyperparameters(writer, config, arch: str, n_vocab: int):
    """The model's shape and rotary settings; returns an extra tensor to write (Llama 3.1's rope_freqs) or None."""
    gguf = _gguf()
    sizes = _header_sizes(config, n_vocab)
    heads, head_dim = sizes["num_attention_heads"], sizes["head_dim"]
    writer.add_context_length(sizes["max_position_embeddings"])
    writer.add_embedding_length(sizes["hidden_size"])
    writer.add_feed_forward_length(sizes["intermediate_size"])
    writer.add_block_count(sizes["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(sizes["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(n_vocab)
    if getattr(config, "head_dim", None) or head_dim != config.hidden_size // heads:  # as llama.cpp's converter
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    rope = _rope_settings(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    kind = rope["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return None
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if rope.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        return None
    return _llama3_rope_factors(rope, head_dim)  # "llama3", checked by _check_rope


def _to_gguf_layout(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """Llama's q and k rows reordered for llama.cpp's rotary embedding.

    transformers rotates the two halves of each head (x[:d/2] with x[d/2:]); llama.cpp's Llama
    rotates adjacent pairs (x[0] with x[1]). Interleaving the halves of every head's rows of
    q_proj and k_proj (weight and bias) makes the two agree; transformers' GGUF loader undoes it.
    Qwen2 needs nothing: llama.cpp rotates it in the halves layout.
    """
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads = config.num_attention_heads
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    else:
        return tensor
    return tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, *tensor.shape[1:]).swapaxes(1, 2) \
        .reshape(tensor.shape)


def _encode(array: np.ndarray, quantization: str, gguf):
    """(data, raw type) of one tensor in the file: 1-D float32, 2-D in the chosen encoding. Q8_0 packs
    rows in blocks of 32; a row length that is not a multiple falls back to f16, as in llama.cpp."""
    if array.ndim < 2:
        kind = gguf.GGMLQuantizationType.F32
    else:
        kind = getattr(gguf.GGMLQuantizationType, QUANTIZATIONS[quantization][0])
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if array.shape[-1] % block:
            kind = gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(array, kind), kind


def save_gguf(model, path, tokenizer, *, quantization: str = "f16", name: str | None = None) -> Path:
    """Write the model (LoRA merged in) and its tokenizer as one GGUF file for llama.cpp / Ollama.

    Args:
        model: what train() trained: a LoRA (peft) model, a plain LlamaForCausalLM /
            Qwen2ForCausalLM, or a 4-bit (QLoRA) base, dequantized on the way. Not modified.
        path: the file to write, ending in .gguf; '~' is the home folder. Its folder is created; an old
            file there is replaced (a link there too, never written through).
        tokenizer: the model's tokenizer (byte-level BPE: SmolLM, Llama 3, Qwen2.5).
        quantization: "f16" (default; what the model computes with, rounded to 16 bits), "bf16",
            "f32", or "q8_0" (8 bits per weight plus a scale per 32: about 0.53 of f16's size; on
            SmolLM2-135M its greedy tokens were f16's at 96% of positions). For 4-bit files, run
            llama.cpp's llama-quantize on the f16 file.
        name: the model name recorded in the file; default the model's own.

    Returns the path written. Tensors are converted one at a time and staged in a temporary
    file (the system's temp folder; up to 256 MB stay in memory), so CPU memory does not hold
    the whole model twice; the .gguf file appears only once complete.

    Reading the file back with transformers (`from_pretrained(..., gguf_file=...)`): its GGUF reader
    before 5.24 does not follow the file's tokenizer metadata. A Llama file's end of text comes back
    as its BOS token, with no padding: set the special tokens from the file
    (`grpo_nb.models.set_gguf_special_tokens(tokenizer, path)`), as llama.cpp reads them. A Qwen2 file gets
    Qwen2's own special tokens (set them the same way) and Qwen2's own split of the text whatever
    `tokenizer.ggml.pre` names: where that is not "qwen2", read the tokenizer from the model's own
    folder rather than the GGUF file (tests/test_gguf.py shows both corrections). The file itself
    is the same whichever version wrote it.
    """
    _gguf()  # refuses before any work when the gguf package is missing
    if isinstance(tokenizer, (str, os.PathLike)) and callable(getattr(path, "save_pretrained", None)):
        raise TypeError(f"{F}(model, path, tokenizer): the path and the tokenizer are swapped (got a "
                        f"{type(path).__name__} as path and {str(tokenizer)!r} as tokenizer): the order is "
                        f"save_gguf(model, {str(tokenizer)!r}, tokenizer).")
    quantization = _check_quantization(quantization)
    check_model(F, model)
    base = model.get_base_model() if is_peft(model) else model
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        refuse(F, "model", f"<{type(base).__name__}, model_type={model_type!r}>",
               f"a Llama or Qwen2 family model (model_type {' or '.join(repr(a) for a in ARCHITECTURES)}); for "
               f"another architecture write save_merged() and convert that folder with llama.cpp's "
               f"convert_hf_to_gguf.py")
    if distributed.is_sharded(model):
        raise ValueError(f"{F}() needs the whole model in one process, and this one is sharded by "
                         "train(..., fsdp=True). Load the adapter train() saved, in one process: "
                         "model, tokenizer = load_for_inference(output_dir); save_gguf(model, path, tokenizer).")
    if name is not None and not isinstance(name, str):
        refuse(F, "name", name, "a str or None (the model's own name)", TypeError)
    _check_rope(config, model_type)
    check_mergeable(F, model)
    # Before any work, so that a wrong tokenizer or header value costs nothing:
    _tokenizer_json(tokenizer)
    n_vocab = base.get_input_embeddings().weight.shape[0]
    _check_vocabulary_fits(tokenizer, n_vocab)
    _check_header(config, n_vocab)
    path = _output_file(path)
    bits = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5}[quantization]
    check_disk_room(path.parent, int(merged_numel(base) * bits / 8), f"the {quantization} GGUF file")

    # Written in a private folder beside `path`, then renamed: a link at either name is never written through,
    # and the .gguf file appears only once complete.
    atomic_files.write_file(path, lambda file: _write_gguf(file, base, tokenizer, quantization, name, n_vocab))
    return path


def _write_gguf(file: Path, base, tokenizer, quantization: str, name: str | None, n_vocab: int) -> None:
    gguf = _gguf()
    config, model_type = base.config, base.config.model_type
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[model_type])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(file, gguf.MODEL_ARCH_NAMES[arch], use_temp_file=True)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or Path(str(getattr(config, "_name_or_path", "") or "model")).name or "model")
        writer.add_file_type(getattr(gguf.LlamaFileType, QUANTIZATIONS[quantization][1]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        rope_factors = _add_hyperparameters(writer, config, model_type, n_vocab)
        _add_tokenizer(writer, tokenizer, config, n_vocab)
        if rope_factors is not None:
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_factors.numpy())
        with torch.no_grad():
            try:
                # save_merged's merge, one tensor at a time (LoRA deltas added, 4-bit dequantized, tied once).
                for hf_name, tensor in merged_tensors(base):
                    if hf_name.endswith("rotary_emb.inv_freq"):
                        continue  # recomputed by every runtime from rope.freq_base
                    gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                    if gguf_name is None:
                        raise ValueError(f"{F}(): the model has a tensor {hf_name!r} with no place in a {model_type} "
                                         f"GGUF file; it was changed in a way this writer does not know (write "
                                         f"save_merged() and convert with llama.cpp's convert_hf_to_gguf.py)")
                    tensor = tensor.to("cpu", torch.float32)
                    if model_type == "llama":
                        tensor = _to_gguf_layout(hf_name, tensor, config)
                    # float16 holds what _encode writes as F16: f16's matrices, and q8_0's rows that are no whole
                    # blocks (1-D tensors stay F32; q8_0's blocks keep a float16 scale of max/127)
                    half = tensor.dim() >= 2 and (quantization == "f16" or (quantization == "q8_0" and tensor.shape[-1] % 32))
                    check_fits_dtype(F, hf_name, tensor, torch.float16 if half else None, "quantization='bf16' or 'f32'")
                    data, kind = _encode(tensor.contiguous().numpy(), quantization, gguf)
                    writer.add_tensor(gguf_name, data, raw_dtype=kind)
            except NotImplementedError as err:  # 8-bit bitsandbytes weights
                raise NotImplementedError(str(err).replace("save_merged()", f"{F}()")) from None
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
        if writer.temp_file is not None:
            writer.temp_file.close()
