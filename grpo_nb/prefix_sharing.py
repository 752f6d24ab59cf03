"""The policy update's micro-batch forwarded packed: each prompt once for its group, no padding ("prefix grouper").

A GRPO micro-batch holds several completions of one prompt (a group), and the plain update forwards a padded
[rows, prompt + completion] batch: the prompt's tokens pass through every layer once per completion, and so does
the padding - the prompts' left padding and each completion's right padding up to the longest. With a long shared
prompt (a system prompt, few-shot examples, tool descriptions) the prompt is most of the work: the main job's is
~150 of ~214 tokens a row.

Here the micro-batch goes through the decoder as one packed row of real tokens only: each prompt once, then the
real tokens of each of its completions, at the positions the plain rows give them. Every per-token layer
(embeddings, norms, projections, MLPs) sees each real token once. Attention is the one place tokens meet:
grpo_nb.attention's sdpa reads the `shared_prefix` keyword this module passes through the decoder and runs
`PackedRows.attend`: the prompts' tokens, gathered into a padded [prompts, width] layout, attend to their prompt
causally; each completion's tokens to its prompt and its own earlier tokens, as each row of the plain batch did.
So log-probs and gradients equal the plain forward's to float rounding (tests/test_prefix_sharing.py).

It is used where it pays - at least 25% fewer tokens than the padded batch (`MIN_SAVING`: a long shared prompt, or
much padding) - and the model allows it: grpo-nb's sdpa attention (not eager or flash kernels), full-attention
layers only, rotary factors that do not follow the sequence's length; masks that are a run of ones (left-padded
prompts, right-padded completions). Elsewhere `layout` returns None and the rows go as they are.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .attachments import rope_depends_on_length, text_config, windowed_attention
from .attention import NAME as SDPA_NAME

# Packed, each completion's attention takes copies of its prompt's keys and values (repeated to every head where the
# mask rules out grouped keys): ~2.5 [token, hidden] tensors per padded token at the layer's worst moment, against
# ~11.4 per token forwarded (memory.estimate's layer moment). Below a quarter fewer tokens the plain batch's peak is
# the lower (simulated: Qwen2.5-1.5B, 8 x (256 + 1024), bf16 on an sm80 card: 17.5% fewer tokens, +0.05 GB), so it
# is left as it is.
MIN_SAVING = 0.25


@dataclass
class PackedRows:
    """A micro-batch as one packed row of its T real tokens (each prompt once, then its completions' tokens), and
    where each token sits in the padded layouts attention works in. Slots index the packed row; padding slots
    point at token 0 and are masked."""
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T] the plain rows' positions
    prompt_slots: torch.Tensor  # [k, Pw] each prompt's tokens, right-padded
    completion_slots: torch.Tensor  # [N, Tc] each completion's tokens, right-padded
    group: torch.Tensor  # [N] the prompt of each completion
    prompt_mask: torch.Tensor  # [k, 1, Pw, Pw] bool: the prompt keys each prompt query sees
    completion_mask: torch.Tensor  # [N, 1, Tc, Pw + Tc] bool: the prompt and own keys each completion query sees
    output_index: torch.Tensor  # [T] each token's place among the two attention outputs, flattened and joined
    predictors: torch.Tensor  # [N, Tc] the token whose state predicts each completion token
    attended: int = 0  # attention layers that read this layout in the forward (`hidden_states` checks them all did)

    def attend(self, query, key, value, attention):
        """One attention layer: [1, heads, T, d] in, [1, T, heads, d] out. `attention(q, k, v, mask)` is the
        model's own sdpa (grouped keys, scaling and dropout handled as everywhere else)."""
        self.attended += 1

        def padded(x, slots):  # [1, h, T, d] -> [rows, h, width, d]
            return x[0][:, slots].transpose(0, 1)

        pk, pv = padded(key, self.prompt_slots), padded(value, self.prompt_slots)
        prompt_out, _ = attention(padded(query, self.prompt_slots), pk, pv, self.prompt_mask)
        completion_out, _ = attention(padded(query, self.completion_slots),
                                      torch.cat([pk[self.group], padded(key, self.completion_slots)], dim=2),
                                      torch.cat([pv[self.group], padded(value, self.completion_slots)], dim=2),
                                      self.completion_mask)
        joined = torch.cat([prompt_out.flatten(0, 1), completion_out.flatten(0, 1)])  # [slots, h, d]
        return joined[self.output_index].unsqueeze(0), None


def shareable_config(config) -> bool:
    """Whether a model of this config, set up by grpo-nb (its sdpa), can run the packed layout."""
    # a window the two attention parts would not apply; rotary factors that the packed row's length would change
    return windowed_attention(config) is None and not rope_depends_on_length(config)


def shareable(model) -> bool:
    if getattr(text_config(model), "_attn_implementation", None) != SDPA_NAME:
        return False  # only grpo-nb's sdpa (set up by setup_reasoning_model) reads the layout
    return shareable_config(model)


def prompts_per_micro_batch(micro_batch: int, num_generations: int) -> int:
    """The most distinct prompts a micro-batch of `micro_batch` consecutive rows holds, groups of `num_generations`
    rows in order (the planner's worst case)."""
    # a micro-batch starts at a multiple of micro_batch: its place in a group, r, is a multiple of their gcd; it
    # overlaps (r + micro_batch - 1) // num_generations + 1 groups, most at the largest r
    last = num_generations - math.gcd(micro_batch, num_generations)
    return (last + micro_batch - 1) // num_generations + 1


def group_starts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[int]:
    """The rows where a run of equal prompts (ids where real, and padding) begins."""
    same = ((prompt_ids[1:] == prompt_ids[:-1]) | (prompt_mask[1:] == 0)).all(1) & \
        (prompt_mask[1:] == prompt_mask[:-1]).all(1)
    return [0] + (torch.nonzero(~same).flatten() + 1).tolist()


def _one_run(mask: torch.Tensor, left: bool) -> bool:
    """Each row's ones are one run at the row's end (left padding) or start (right padding)."""
    mask = mask.flip(1) if left else mask
    return bool((mask == mask.cummin(dim=1).values).all())


def layout(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> PackedRows | None:
    """The packed layout of these rows, or None where it does not apply or pay (the rows then go as they are)."""
    if not shareable(model) or refused(model) or not _one_run(prompt_mask, left=True) or \
            not _one_run(completion_mask, left=False):
        return None
    n, tp = prompt_ids.shape
    starts = group_starts(prompt_ids, prompt_mask)
    prompt_lengths = [int(x) for x in prompt_mask[starts].sum(1).tolist()]
    lengths = [int(x) for x in completion_mask.sum(1).tolist()]
    if min(prompt_lengths) < 1 or \
            sum(prompt_lengths) + sum(lengths) > (1 - MIN_SAVING) * n * (tp + completion_ids.shape[1]):
        return None  # (a prompt of no token has no position to pack at: the plain batch's meaning, whatever it is)
    device = prompt_ids.device
    ends = starts[1:] + [n]
    ids, positions, prompt_slots, completion_slots, group, output_index = [], [], [], [], [], []
    width, tc = max(prompt_lengths), completion_ids.shape[1]
    prompt_last, offset = [], 0
    for g, (start, end, p) in enumerate(zip(starts, ends, prompt_lengths)):
        ids.append(prompt_ids[start, tp - p:])
        positions.append(torch.arange(p))
        prompt_slots.append(offset + torch.arange(width).clamp(max=p - 1))
        output_index.append(g * width + torch.arange(p))
        prompt_last.append(offset + p - 1)
        offset += p
        for row in range(start, end):
            length = lengths[row]
            ids.append(completion_ids[row, :length])
            positions.append(p + torch.arange(length))
            # (a completion of no token: its slots point at its prompt's last token, all masked)
            completion_slots.append(offset + torch.arange(tc).clamp(max=length - 1) if length else
                                    torch.full((tc,), offset - 1))
            output_index.append(len(starts) * width + row * tc + torch.arange(length))
            group.append(g)
            offset += length
    prompt_slots, completion_slots = torch.stack(prompt_slots), torch.stack(completion_slots)
    group = torch.tensor(group)
    # the state at the prompt's last token predicts completion token 0, token t's state token t + 1
    predictors = torch.cat([torch.tensor(prompt_last)[group, None], completion_slots[:, :-1]], dim=1)
    prompt_keys = torch.arange(width)[None] < torch.tensor(prompt_lengths)[:, None]  # [k, Pw]
    own_keys = torch.arange(tc)[None] < torch.tensor(lengths)[:, None]  # [N, Tc]: the masks are runs of ones
    eye = torch.eye(width, dtype=torch.bool)
    # a padding query sees itself, so no row of a softmax is empty (its output is never read)
    prompt_sees = (torch.ones(width, width, dtype=torch.bool).tril() & prompt_keys[:, None]) | eye
    own = (torch.ones(tc, tc, dtype=torch.bool).tril() & own_keys[:, None]) | torch.eye(tc, dtype=torch.bool)
    completion_sees = torch.cat([prompt_keys[group][:, None].expand(-1, tc, -1), own], dim=2)
    return PackedRows(torch.cat(ids).to(device)[None], torch.cat(positions).to(device)[None],
                      prompt_slots.to(device), completion_slots.to(device), group.to(device),
                      prompt_sees[:, None].to(device), completion_sees[:, None].to(device),
                      torch.cat(output_index).to(device), predictors.to(device))


def hidden_states(decoder, packed: PackedRows, layers: int) -> torch.Tensor | None:
    """[N, Tc, H]: the decoder's last hidden states that predict each completion token, from one forward of the
    packed row (padding places hold a real token's state: their log-probs are masked, as the plain batch's). None
    when fewer than the model's `layers` attention layers read the layout: a decoder layer that does not pass its
    keyword arguments on to its attention (StableLM's, Nemotron's) leaves the packed row under the placeholder mask,
    every token seeing every other - the caller then forwards the rows as they are (`refuse`)."""
    # a 4D mask is taken by transformers as it is (no [T, T] mask is built for the packed row); attention reads
    # `shared_prefix` instead
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=packed.input_ids.device)
    hidden = decoder(input_ids=packed.input_ids, attention_mask=placeholder, position_ids=packed.positions,
                     use_cache=False, shared_prefix=packed).last_hidden_state
    if packed.attended != layers:
        return None
    return hidden[0][packed.predictors]


_REFUSED: set = set()  # the model classes whose layers lose the layout (warned once each)


def refuse(model) -> None:
    """`model`'s decoder layers lose the layout on the way to attention: packing stays off for its kind (one
    warning), since every forward would be wasted."""
    kind = type(model)
    if kind not in _REFUSED:
        _REFUSED.add(kind)
        warnings.warn(f"prefix_sharing: {kind.__name__}'s decoder layers do not pass their keyword arguments on to "
                      f"attention, so the packed update cannot run on it; its rows go as they are (equal results, "
                      f"no saving). Set prefix_sharing=False to skip the check.", RuntimeWarning, stacklevel=4)


def refused(model) -> bool:
    return type(model) in _REFUSED
