"""Decoder MLPs that run a tile of tokens at a time, so their intermediates never exist for the whole batch.

A decoder layer's MLP widens every token to `intermediate_size` (Qwen2.5-1.5B: 8960, Llama-3.1-8B:
14336) and keeps several such tensors - the gate and up projections, the activation, their
product, and in backward their gradients. For the 8 x 1280 tokens of a GRPO micro-batch each
is 0.18 GB in bf16, and together they are the largest part of the policy update's peak (see
`grpo_nb.simulate`). The MLP treats every token on its own, so it can as well run on tiles of
`tile_tokens` tokens: in training each tile is checkpointed (non-reentrant), so its
intermediates are recomputed tile by tile in backward; without grad (rollouts, log-prob passes)
tiles simply run one after the other. Outputs and gradients are those of the whole-batch MLP
(up to the matmuls' blocking); the price is one more forward of the MLP in backward, paid only
by batches longer than a tile.

`enable_tiled_mlp(model)` sets each decoder layer's `mlp.forward` on the model instance (the
module tree and its parameter names do not change, so adapters save and load as before);
`disable_tiled_mlp` puts the modules' own forward back.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_TILE_TOKENS = 2048


def tiled_forward(mlp_forward, x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """`mlp_forward(x)` computed `tile_tokens` tokens at a time (x: [..., hidden])."""
    shape = x.shape
    tokens = x.numel() // shape[-1]
    if tokens <= tile_tokens:
        return mlp_forward(x)
    tiles = x.reshape(tokens, shape[-1]).split(tile_tokens)
    if torch.is_grad_enabled():
        outs = [checkpoint(mlp_forward, tile, use_reentrant=False) for tile in tiles]
    else:
        outs = [mlp_forward(tile) for tile in tiles]
    return torch.cat(outs).view(*shape[:-1], -1)


def decoder_mlps(model) -> list:
    """The `mlp` module of every decoder layer (transformers' GradientCheckpointingLayer) of a model."""
    from .offload import find_checkpointing_layers

    return [layer.mlp for layer in find_checkpointing_layers(model) if isinstance(getattr(layer, "mlp", None),
                                                                                 torch.nn.Module)]


def enable_tiled_mlp(model, tile_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Run every decoder layer's MLP `tile_tokens` tokens at a time; returns how many MLPs were tiled."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r} is invalid: expected a positive integer")
    mlps = decoder_mlps(model)
    for mlp in mlps:
        # The module's own forward (even if tiling was on already), through a weak reference: a strong
        # one in the module's own __dict__ would be a reference cycle.
        ref = weakref.ref(mlp)
        mlp.forward = lambda x, _ref=ref: tiled_forward(type(_ref()).forward.__get__(_ref()), x, tile_tokens)
        mlp.grpo_nb_tile_tokens = tile_tokens
    return len(mlps)


def disable_tiled_mlp(model) -> None:
    for mlp in decoder_mlps(model):
        mlp.__dict__.pop("forward", None)
        mlp.__dict__.pop("grpo_nb_tile_tokens", None)
