import torch

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
