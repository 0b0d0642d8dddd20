"""The feature drafter's network: one transformer decoder layer that predicts the base's next decoder state.

EAGLE (Li et al. 2024) drafts at the feature level: at each position the drafter reads the base's last hidden
state together with the embedding of the token chosen from it, and predicts the *next* hidden state, which the
base's own output projection turns into a draft token; fed back with that token, it drafts the one after.
For an encoder-decoder base the layer can also attend to the base's encoder output, computed once per call.

Attention here is written out (not transformers' modules): the drafter's key/value cache is laid out per row
with its own valid length, and training unrolls several drafting steps with the "training-time test" mask of
EAGLE-3, neither of which a stock decoder layer supports.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hf_blockwise.drafters.feature_block import AttentionMemory


# The layer runs once per drafted token on tiny tensors, where each module call's own overhead is a large part of
# the cost: its forward applies a plain nn.Linear's parameters with torch.nn.functional directly. Any other layer
# in its place (an int8 one, `quantize_linears_int8`) computes through its own forward: its float `weight` is kept
# only for code that reads it.
def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(layer) is nn.Linear:
        return F.linear(x, layer.weight, layer.bias)
    return layer(x)


def _norm(layer: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, layer.normalized_shape, layer.weight, layer.bias, layer.eps)


class DraftAttention(nn.Module):
    """Multi-head attention over explicit keys and values (self- or cross-attention)."""

    def __init__(self, hidden_size: int, num_heads: int, memory_size: int | None = None) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}")
        self.num_heads = num_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(memory_size or hidden_size, hidden_size)
        self.value = nn.Linear(memory_size or hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, T, d) -> (B, H, T, d/H)

    def memory(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> AttentionMemory:
        """Keys and values of `x` (shape `(batch_size, length, memory_size)`)."""
        return AttentionMemory(self._split(_linear(self.key, x)), self._split(_linear(self.value, x)), mask)

    def forward(self, x: torch.Tensor, memory: AttentionMemory) -> torch.Tensor:
        """
        Args:
            x (`torch.Tensor` of shape `(batch_size, num_queries, hidden_size)`).
        """
        attended = F.scaled_dot_product_attention(
            self._split(_linear(self.query, x)), memory.keys, memory.values, attn_mask=memory.mask
        )  # (B, H, Q, d/H)
        return _linear(self.out, attended.transpose(1, 2).flatten(2))


class FeatureDrafterLayer(nn.Module):
    """Fuses (state, token embedding) pairs, then self-attention, cross-attention (optional) and a feed-forward
    layer, pre-norm, and maps the result back to the space of the base's states.

    Args:
        hidden_size (`int`): width d of the base's states at its output projection.
        embedding_size (`int`): width of the base decoder's token embeddings.
        num_heads (`int`): attention heads.
        ffn_size (`int`): feed-forward width.
        encoder_hidden_size (`int`, *optional*): width of the encoder output; `None` for no cross-attention.
        shortlist_size (`int`, *optional*): size of the `shortlist` buffer of token ids drafts come from.
    """

    def __init__(
        self,
        hidden_size: int,
        embedding_size: int,
        num_heads: int,
        ffn_size: int,
        encoder_hidden_size: int | None = None,
        shortlist_size: int | None = None,
    ) -> None:
        super().__init__()
        # the base's states and embeddings come at architecture-specific scales (T5 rescales its states)
        self.state_norm = nn.LayerNorm(hidden_size)
        self.token_norm = nn.LayerNorm(embedding_size)
        self.fuse = nn.Linear(hidden_size + embedding_size, hidden_size)
        self.self_norm = nn.LayerNorm(hidden_size)
        self.self_attention = DraftAttention(hidden_size, num_heads)
        self.cross_norm = nn.LayerNorm(hidden_size) if encoder_hidden_size else None
        self.cross_attention = (
            DraftAttention(hidden_size, num_heads, encoder_hidden_size) if encoder_hidden_size else None
        )
        self.ffn_norm = nn.LayerNorm(hidden_size)
        self.ffn = nn.Sequential(nn.Linear(hidden_size, ffn_size), nn.GELU(), nn.Linear(ffn_size, hidden_size))
        self.out_norm = nn.LayerNorm(hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        shortlist = None if shortlist_size is None else torch.zeros(shortlist_size, dtype=torch.long)
        self.shortlist: torch.Tensor | None
        self.register_buffer("shortlist", shortlist)

    def inputs(self, states: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """The layer's input at each position: a state with the embedding of the token chosen from it.

        Args:
            states (`torch.Tensor` of shape `(..., hidden_size)`).
            token_embeddings (`torch.Tensor` of shape `(..., embedding_size)`).

        Returns:
            `torch.Tensor` of shape `(..., hidden_size)`.
        """
        fused = torch.cat(
            [_norm(self.state_norm, states), _norm(self.token_norm, token_embeddings.to(states.dtype))], -1
        )
        return _linear(self.fuse, fused)

    def self_memory(self, inputs: torch.Tensor) -> tuple[AttentionMemory, torch.Tensor]:
        """Self-attention keys and values of `inputs` (shape `(batch_size, length, hidden_size)`), and the
        normalized inputs they come from (the same positions' queries read them: pass them to [`forward`])."""
        normed = _norm(self.self_norm, inputs)
        return self.self_attention.memory(normed), normed

    def encoder_memory(self, encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None):
        """Cross-attention keys and values of the encoder output, or `None` without cross-attention.

        Args:
            encoder_hidden_states (`torch.Tensor` of shape `(batch_size, source_length, encoder_hidden_size)`).
            encoder_attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).
        """
        if self.cross_attention is None:
            return None
        mask = None if encoder_attention_mask is None else encoder_attention_mask.bool()[:, None, None, :]
        return self.cross_attention.memory(encoder_hidden_states.to(self.out.weight.dtype), mask)

    def forward(
        self, inputs: torch.Tensor, normed: torch.Tensor, memory: AttentionMemory, encoder: AttentionMemory | None
    ) -> torch.Tensor:
        """Predicted next states.

        Args:
            inputs (`torch.Tensor` of shape `(batch_size, num_queries, hidden_size)`): from [`inputs`].
            normed (`torch.Tensor` of the same shape): the normalized inputs, from [`self_memory`].
            memory ([`AttentionMemory`]): self-attention keys/values (the queries' own included) and mask.
            encoder ([`AttentionMemory`], *optional*): from [`encoder_memory`].

        Returns:
            `torch.Tensor` of shape `(batch_size, num_queries, hidden_size)`.
        """
        x = inputs + self.self_attention(normed, memory)
        if self.cross_attention is not None:
            if encoder is None:
                raise ValueError("This feature drafter was built with cross-attention; pass the encoder memory")
            x = x + self.cross_attention(_norm(self.cross_norm, x), encoder)
        up, down = self.ffn[0], self.ffn[2]
        x = x + _linear(down, F.gelu(_linear(up, _norm(self.ffn_norm, x))))
        return _linear(self.out, _norm(self.out_norm, x))


def unrolled_mask(length: int, depth: int, device: torch.device) -> torch.Tensor:
    """Self-attention mask of unrolled training step `depth` over the keys of steps 0..depth ("training-time
    test", EAGLE-3).

    At step i, position p stands for the i-th drafted position after the last verified one (p - i): it sees the
    verified keys of step 0 up to p - i, and the key that step m made at position p - i + m for m = 1..i (the
    drafted positions before it, and itself).

    Returns:
        `torch.BoolTensor` of shape `(length, (depth + 1) * length)`.
    """
    query = torch.arange(length, device=device)[:, None]  # (T, 1)
    key = torch.arange(length, device=device)[None, :]  # (1, T)
    blocks = [key <= query - depth]
    blocks += [key == query - depth + step for step in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)
