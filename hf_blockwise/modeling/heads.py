"""The proposal heads of Stern et al. (2018), §6 and Figure 3, as pure tensor modules."""

from __future__ import annotations

import torch
from torch import nn


class BlockwiseHeads(nn.Module):
    """k − 1 proposal heads sharing one feed-forward layer, with a residual connection per head.

    One hidden layer of width `num_heads * head_hidden_size` maps the decoder state z to `num_heads` updates of
    width `hidden_size`; head i's state is `z + update_i`. The base model's own output projection then turns
    each head state into logits (see [`head_logits`]). The output layer starts at zero, so every head starts
    as an exact copy of the base model's next-token distribution p1: untrained heads are harmless.

    Args:
        hidden_size (`int`): width d of the decoder states fed to the output projection.
        head_hidden_size (`int`): hidden width of one head.
        num_heads (`int`): k − 1.
        shortlist_size (`int`, *optional*): size of the `shortlist` buffer of token ids the heads propose from.
        token_embedding_size (`int`, *optional*): when set, the hidden layer also reads the embedding of the
            token chosen from each state (`BlockwiseHeadsConfig.condition_on_token`).
    """

    def __init__(
        self,
        hidden_size: int,
        head_hidden_size: int,
        num_heads: int,
        shortlist_size: int | None = None,
        token_embedding_size: int | None = None,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.token_embedding_size = token_embedding_size
        self.up = nn.Linear(hidden_size + (token_embedding_size or 0), num_heads * head_hidden_size)
        self.down = nn.Linear(num_heads * head_hidden_size, num_heads * hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        # a `None` buffer is left out of the state dict, so heads without a shortlist save no such entry
        shortlist = None if shortlist_size is None else torch.zeros(shortlist_size, dtype=torch.long)
        self.shortlist: torch.Tensor | None
        self.register_buffer("shortlist", shortlist)

    def forward(
        self, states: torch.Tensor, num_heads: int | None = None, token_embeddings: torch.Tensor | None = None
    ) -> torch.Tensor:
        """
        Args:
            states (`torch.Tensor` of shape `(..., hidden_size)`): decoder states at the output projection.
            num_heads (`int`, *optional*): evaluate only the first `num_heads` heads. The shared hidden layer
                is computed in full, but only their rows of the output layer are, which is most of the cost.
            token_embeddings (`torch.Tensor` of shape `(..., token_embedding_size)`, *optional*): embeddings of
                the tokens chosen from `states`; required exactly when the heads were built to read them.

        Returns:
            `torch.Tensor` of shape `(..., num_heads, hidden_size)`: one state per head.
        """
        if (token_embeddings is None) != (self.token_embedding_size is None):
            raise ValueError(
                "These heads were built with token_embedding_size="
                f"{self.token_embedding_size}; pass token_embeddings exactly when it is set"
            )
        num_heads = self.num_heads if num_heads is None else num_heads
        rows = num_heads * self.hidden_size
        inputs = states if token_embeddings is None else torch.cat([states, token_embeddings.to(states)], dim=-1)
        hidden = torch.relu(self.up(inputs))  # (..., K * head_hidden)
        updates = nn.functional.linear(hidden, self.down.weight[:rows], self.down.bias[:rows])  # (..., n * d)
        return states.unsqueeze(-2) + updates.unflatten(-1, (num_heads, self.hidden_size))


class SequentialHeads(nn.Module):
    """Hydra-style heads: head i reads the decoder state *and* the embeddings of the tokens before its own, the
    base's chosen token t_0 and the drafts t_1..t_i of the heads before it, so later guesses are conditioned on
    earlier ones (Ankner et al. 2024). Each head is one hidden layer with a residual connection; the output
    layers start at zero, so untrained heads copy the base's next-token distribution.

    Args:
        hidden_size (`int`): width d of the decoder states fed to the output projection.
        head_hidden_size (`int`): hidden width of one head.
        num_heads (`int`): k − 1.
        token_embedding_size (`int`): width of the base decoder's token embeddings.
        shortlist_size (`int`, *optional*): size of the `shortlist` buffer of token ids the heads propose from.
    """

    def __init__(
        self,
        hidden_size: int,
        head_hidden_size: int,
        num_heads: int,
        token_embedding_size: int,
        shortlist_size: int | None = None,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.token_embedding_size = token_embedding_size
        self.up = nn.ModuleList(
            nn.Linear(hidden_size + (head + 1) * token_embedding_size, head_hidden_size) for head in range(num_heads)
        )
        self.down = nn.ModuleList(nn.Linear(head_hidden_size, hidden_size) for _ in range(num_heads))
        for layer in self.down:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        shortlist = None if shortlist_size is None else torch.zeros(shortlist_size, dtype=torch.long)
        self.shortlist: torch.Tensor | None
        self.register_buffer("shortlist", shortlist)

    def head(self, index: int, states: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """Head `index`'s state.

        Args:
            states (`torch.Tensor` of shape `(..., hidden_size)`): the base decoder's states.
            token_embeddings (`torch.Tensor` of shape `(..., index + 1, token_embedding_size)`): t_0..t_index.

        Returns:
            `torch.Tensor` of shape `(..., hidden_size)`.
        """
        inputs = torch.cat([states, token_embeddings.to(states.dtype).flatten(-2)], dim=-1)
        return states + self.down[index](torch.relu(self.up[index](inputs)))

    def forward(
        self, states: torch.Tensor, token_embeddings: torch.Tensor, num_heads: int | None = None
    ) -> torch.Tensor:
        """All heads at once, teacher-forced: head i reads the given embeddings of t_0..t_i.

        Args:
            states (`torch.Tensor` of shape `(..., hidden_size)`): the base decoder's states.
            token_embeddings (`torch.Tensor` of shape `(..., num_heads, token_embedding_size)`): t_0..t_(num_heads-1).

        Returns:
            `torch.Tensor` of shape `(..., num_heads, hidden_size)`.
        """
        num_heads = self.num_heads if num_heads is None else num_heads
        return torch.stack(
            [self.head(index, states, token_embeddings[..., : index + 1, :]) for index in range(num_heads)], dim=-2
        )
