import pytest
import torch

from grpo_nb.attachments import attachments
from grpo_nb.models import prepare_tokenizer
from grpo_nb.rollout import HFGenerateRollout, completion_mask_from_eos, encode_prompts
from tiny_models import tiny_model, tiny_tokenizer


def test_mask_runs_through_the_first_eos():
    ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    mask, truncated = completion_mask_from_eos(ids, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_prompts_are_left_padded_and_cut_from_the_left():
    tok = prepare_tokenizer(tiny_tokenizer())
    ids, mask, cut = encode_prompts(tok, ["w5 w6 w7", "w8", "w9 w10 w11 w12 w13"], 4, "cpu")
    assert cut == 1
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert ids[2].tolist() == tok.convert_tokens_to_ids(["w10", "w11", "w12", "w13"])


def test_greedy_rollout_equals_generate():
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("qwen2", seed=3)
    ids, mask, _ = encode_prompts(tok, ["w5 w6 w7", "w8"], None, "cpu")
    out = HFGenerateRollout(max_completion_length=5, greedy=True)(model, tok, ids, mask, num_generations=2)
    assert out.prompt_ids.shape[0] == 4 and torch.equal(out.prompt_ids[0], out.prompt_ids[1])
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.shape[1]:]
    n = ref.shape[1]
    assert torch.equal(out.completion_ids[::2, :n] * out.completion_mask[::2, :n], ref * out.completion_mask[::2, :n])


def test_sampling_is_seeded():
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama", seed=1)
    ids, mask, _ = encode_prompts(tok, ["w5 w6"], None, "cpu")
    roll = HFGenerateRollout(max_completion_length=6, temperature=1.0)
    torch.manual_seed(0)
    a = roll(model, tok, ids, mask, 4).completion_ids
    torch.manual_seed(0)
    b = roll(model, tok, ids, mask, 4).completion_ids
    assert torch.equal(a, b) and len({tuple(r.tolist()) for r in a}) > 1


# --------------------------------------------------------------------------------------
# make_rollout: which engine train() gets

def _config(**kw):
    from grpo_nb import GRPOConfig

    return GRPOConfig(max_completion_length=5, **kw)


def test_auto_is_the_native_engine_with_the_run_settings():
    from grpo_nb.rollout.engine import RolloutEngine
    from grpo_nb.rollout import make_rollout

    r = make_rollout("auto", tiny_model("llama"), None, _config(temperature=0.7, top_k=5, seed=11,
                                                                 generation_kwargs={"min_new_tokens": 2}))
    assert isinstance(r, RolloutEngine)
    assert (r.temperature, r.top_k, r.seed, r.min_new_tokens, r.max_completion_length) == (0.7, 5, 11, 2, 5)
    assert isinstance(make_rollout("native", tiny_model("llama"), None, _config()), RolloutEngine)


def test_hf_kind_and_generate_only_kwargs_choose_generate():
    from grpo_nb.rollout import make_rollout

    assert isinstance(make_rollout("hf", tiny_model("llama"), None, _config()), HFGenerateRollout)
    beams = _config(generation_kwargs={"no_repeat_ngram_size": 3})
    r = make_rollout("auto", tiny_model("llama"), None, beams)  # only generate() knows this one
    assert isinstance(r, HFGenerateRollout) and r.generation_kwargs == {"no_repeat_ngram_size": 3}
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        make_rollout("native", tiny_model("llama"), None, beams)


def test_auto_uses_the_vllm_rollout_the_model_was_set_up_with():
    from grpo_nb.rollout import make_rollout

    class Configurable:
        def configure(self, **knobs):
            self.knobs = knobs
            return self

    model = tiny_model("llama")
    attachments(model).rollout = Configurable()
    r = make_rollout("auto", model, None, _config(temperature=0.9, seed=3))
    assert r is attachments(model).rollout and r.knobs["temperature"] == 0.9 and r.knobs["seed"] == 3
    with pytest.raises(ValueError, match="generation_kwargs"):
        make_rollout("vllm", model, None, _config(generation_kwargs={"min_new_tokens": 2}))


def test_bad_kinds_say_what_is_allowed(monkeypatch):
    import grpo_nb.rollout.vllm_backend as vr
    from grpo_nb.rollout import make_rollout

    with pytest.raises(ValueError, match="'auto', 'native', 'hf', 'vllm'"):
        make_rollout("fast", tiny_model("llama"), None, _config())
    monkeypatch.setattr(vr, "vllm_available", lambda: False)
    with pytest.raises(ImportError, match="pip install"):
        make_rollout("vllm", tiny_model("llama"), None, _config())
    custom = lambda *a: None  # noqa: E731
    assert make_rollout(custom, tiny_model("llama"), None, _config()) is custom


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_assistant_prefill_is_continued_not_closed():
    """A chat prompt whose last message is the assistant's is a prefill the model continues (TRL's
    maybe_apply_chat_template): not closed as a finished turn with a fresh assistant turn opened after it."""
    from grpo_nb.models import DEFAULT_CHAT_TEMPLATE
    from grpo_nb.rollout import prompt_texts

    tok = prepare_tokenizer(tiny_tokenizer())
    question = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "What is 2+3?"}]
    prefilled = question + [{"role": "assistant", "content": "<reasoning>\n"}]
    tok.chat_template = CHATML
    asked, started = prompt_texts(tok, [question, prefilled])
    assert asked.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert started == asked + "<reasoning>\n"
    tok.chat_template = DEFAULT_CHAT_TEMPLATE  # base models: grpo-nb's own template
    asked, started = prompt_texts(tok, [question, prefilled])
    assert asked.endswith("User: What is 2+3?\nAssistant:") and started == asked + " <reasoning>\n"



def test_prompts_start_with_the_bos_the_tokenizer_adds_once():
    """A tokenizer that puts a BOS before any text (Llama, Gemma, Mistral): plain-text prompts get it, as TRL
    1.16 tokenizes them (add_special_tokens), and so do chat prompts through grpo-nb's template for base
    models; a text that already starts with it keeps one. A tokenizer that adds none is left as it was."""
    from tokenizers import processors

    from grpo_nb.models import DEFAULT_CHAT_TEMPLATE

    chat = [{"role": "user", "content": "w5"}]
    plain = prepare_tokenizer(tiny_tokenizer())
    assert plain.chat_template == DEFAULT_CHAT_TEMPLATE
    assert encode_prompts(plain, ["w5 w6"], None, "cpu")[0].tolist() == [[5, 6]]
    tok = tiny_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = prepare_tokenizer(tok)
    ids, mask, _ = encode_prompts(tok, ["w5 w6", "<s> w5 w6", chat], None, "cpu")
    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    assert rows[0] == rows[1] == [1, 5, 6]
    assert rows[2][:2] == [1, plain(plain.apply_chat_template(chat, tokenize=False))["input_ids"][0]]
    assert rows[2].count(1) == 1


def test_a_cut_prompt_keeps_its_bos_and_an_appended_eos_is_dropped():
    """A prompt cut to max_prompt_length keeps its last tokens behind its BOS (the model expects it at position 0);
    a tokenizer that appends an EOS to every text (add_eos_token=True) does not end plain prompts with it (the
    model would be asked to go on after the end), while a chat prompt's own end tokens stay."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"<s> $A {tok.eos_token}", special_tokens=[("<s>", 1), (tok.eos_token, eos)])
    tok = prepare_tokenizer(tok)
    ids, mask, cut = encode_prompts(tok, ["w5 w6 w7 w8 w9", "w5 w6"], 3, "cpu")
    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    assert rows == [[1, 8, 9], [1, 5, 6]] and cut == 1
    assert encode_prompts(tok, ["w5 w6"], None, "cpu")[0].tolist() == [[1, 5, 6]]

# --------------------------------------------------------------------------------------
# What a model folder brings: its generation_config.json, its chat template (issue 25, probe 4)

def test_hf_rollout_samples_with_grpo_nb_settings_only():
    """generate() would fill every unset field from the model's generation_config (someone's
    generation_config.json): banned words, no repeated n-grams, beams. None of it applies; the model keeps it."""
    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama", seed=1)
    ids, mask, _ = encode_prompts(tok, ["w5 w6", "w7"], None, "cpu")
    roll = HFGenerateRollout(max_completion_length=6, temperature=1.0)
    torch.manual_seed(0)
    plain = roll(model, tok, ids, mask, 3).completion_ids
    folder_settings = dict(bad_words_ids=[[i] for i in range(3, 300)], no_repeat_ngram_size=2, min_new_tokens=6)
    for name, value in folder_settings.items():
        setattr(model.generation_config, name, value)
    torch.manual_seed(0)
    assert torch.equal(roll(model, tok, ids, mask, 3).completion_ids, plain)
    assert model.generation_config.bad_words_ids == folder_settings["bad_words_ids"]  # put back as it was


def test_eos_token_ids_name_a_generation_config_eos_that_is_no_token_id():
    from grpo_nb.rollout import eos_token_ids

    tok = prepare_tokenizer(tiny_tokenizer())
    model = tiny_model("llama")
    for value in ("311", 311.0, [[311]], True, [2, False]):
        model.generation_config.eos_token_id = value
        with pytest.raises(ValueError, match=r"model\.generation_config\.eos_token_id=.* is not a token id .*"
                                             r"generation_config\.json.*eos_token_id = 2 \(the tokenizer's EOS\)"):
            eos_token_ids(model, tok)
    model.generation_config.eos_token_id = [7, 2]
    assert eos_token_ids(model, tok) == [2, 7]


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}{{ m['content'] }", "is not valid Jinja (line 1"),
    ("{{ undefined_thing.attribute }}", "uses a variable the tokenizer does not provide"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed without end"),
    ("{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
     "refused them: Conversation roles must alternate"),
])
def test_a_failing_chat_template_is_named_with_the_row(template, said):
    from grpo_nb.rollout import prompt_texts

    tok = prepare_tokenizer(tiny_tokenizer())
    tok.chat_template = template
    with pytest.raises(ValueError, match=r"Dataset row 7: the tokenizer's chat template failed on its messages "
                                         r"\(roles \['user'\]\): it " + said.replace("(", r"\(")):
        prompt_texts(tok, ["plain text is not rendered", [{"role": "user", "content": "w5"}]], first_row=6)


# --------------------------------------------------------------------------------------
# What a rollout returns is checked before any reward reads it (issue 25, probe 9)

def _user_rollout(mistake):
    """A user's rollout function: the tiny model's greedy next tokens, with one of the common mistakes."""
    from grpo_nb.rollout import RolloutBatch

    def rollout(model, tokenizer, prompt_ids, prompt_mask, num_generations):
        tile = prompt_ids.repeat if mistake == "repeat" else lambda g, _: prompt_ids.repeat_interleave(g, dim=0)
        ids = tile(num_generations, 1)
        mask = (prompt_mask.repeat(num_generations, 1) if mistake == "repeat"
                else prompt_mask.repeat_interleave(num_generations, dim=0))
        completion = torch.tensor([[5, 6, tokenizer.eos_token_id]] * ids.shape[0])
        if mistake == "whole":  # generate()'s output: prompt and completion
            completion = torch.cat([ids, completion], dim=1)
        done = torch.ones_like(completion)
        logprobs = torch.full(completion.shape, 0.5) if mistake == "positive" else None
        if mistake == "right_padded":  # tokenizer.pad with padding_side="right": pads after the prompt
            real = [(r[m.bool()], int((~m.bool()).sum())) for r, m in zip(ids, mask)]
            ids = torch.stack([torch.cat([r, r.new_zeros(pad)]) for r, pad in real])
            mask = torch.stack([torch.cat([torch.ones(len(r)), torch.zeros(pad)]) for r, pad in real]).long()
        if mistake == "twos":
            done = done * 2
        if mistake == "float_ids":
            completion = completion.float()
        if mistake == "dict":
            return {"completion_ids": completion}
        truncated = torch.full((ids.shape[0],), 2) if mistake == "int_truncated" else torch.zeros(ids.shape[0])
        return RolloutBatch(ids, mask, completion, done, truncated.long(), logprobs)

    rollout.__name__ = f"my_{mistake}_rollout"
    return rollout


@pytest.mark.parametrize("mistake, message", [
    ("repeat", r"'my_repeat_rollout' returned row 1 with the prompt of another group: .*\.repeat instead of "
               r"\.repeat_interleave"),
    ("whole", r"completion_ids that each begin with their own prompt, padding included: generate\(\)'s whole"),
    ("positive", r"sampling_logprobs that are no sampled tokens' log-probs"),
    ("int_truncated", r"truncated of dtype torch.int64 holding other values than 0 and 1"),
    ("right_padded", r"a prompt_mask that is not left-padded"),
    ("twos", r"a completion_mask holding other values than 0 and 1 \(\[2\]\)"),
    ("float_ids", r"completion_ids of dtype torch.float32, where token ids"),
    ("dict", r"returned a dict, not a RolloutBatch"),
])
def test_a_rollouts_batch_that_means_something_else_is_refused(mistake, message):
    from grpo_nb.scoring import score_groups

    tok, model = prepare_tokenizer(tiny_tokenizer()), tiny_model("llama")
    rows = [{"prompt": "w5 w6"}, {"prompt": "w7 w8 w9"}]
    with pytest.raises(ValueError, match=message):
        score_groups(model, tok, rows, _user_rollout(mistake), 2)
    fine = score_groups(model, tok, rows, _user_rollout("none"), 2)  # the same function without the mistake
    assert fine.texts and fine.rollout.truncated.dtype == torch.bool  # its 0/1 ints read as bools


def test_a_user_rollouts_logprobs_are_never_the_old_policy_and_its_0_1_truncated_reads_as_bool(tmp_path):
    """num_iterations=2: a user's function's log-probs (here the sampler's shifted, as before temperature) are not
    taken as the old policy, so the first pass over a batch is on-policy (clip ratio 0); its truncated as 0/1 ints
    is read as bools (~ of an int would flip the sign of mask_truncated_completions' mask)."""
    from grpo_nb import train
    from grpo_nb.rollout import RolloutEngine
    from tiny_models import FAST, dataset, lora_model, token_id_reward

    engine = RolloutEngine(max_completion_length=6, seed=0)

    def shifted(model, tokenizer, prompt_ids, prompt_mask, num_generations):
        out = engine(model, tokenizer, prompt_ids, prompt_mask, num_generations)
        out.sampling_logprobs = out.sampling_logprobs * 3.0  # plausible, and wrong
        out.truncated = out.truncated.long()
        return out

    tok = prepare_tokenizer(tiny_tokenizer())
    history = train(lora_model(), tok, dataset(), token_id_reward, output_dir=str(tmp_path), max_steps=2,
                    num_iterations=2, rollout=shifted, verbose=False, live=False, **FAST)
    assert history[0]["clip_ratio"] == 0.0  # 0.5 when they were taken as the old policy
