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
    """

    def __init__(self, hidden_size: int, head_hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.up = nn.Linear(hidden_size, num_heads * head_hidden_size)
        self.down = nn.Linear(num_heads * head_hidden_size, num_heads * hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """
        Args:
            states (`torch.Tensor` of shape `(..., hidden_size)`): decoder states at the output projection.

        Returns:
            `torch.Tensor` of shape `(..., num_heads, hidden_size)`: one state per head.
        """
        updates = self.down(torch.relu(self.up(states)))  # (..., num_heads * hidden_size)
        return states.unsqueeze(-2) + updates.unflatten(-1, (self.num_heads, self.hidden_size))


def output_projection_logits(base_model: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """Applies the base model's output projection, and the logit bias it adds after it, to `states`.

    BART, mBART, Marian and Pegasus add a `final_logits_bias` buffer after `lm_head`; the rescaling T5 applies
    happens *before* `lm_head`, so it is already part of the captured states.

    Args:
        base_model: a transformers seq2seq model.
        states (`torch.Tensor` of shape `(..., hidden_size)`).

    Returns:
        `torch.Tensor` of shape `(..., vocab_size)`.
    """
    logits = base_model.get_output_embeddings()(states)
    final_logits_bias = getattr(base_model, "final_logits_bias", None)
    if final_logits_bias is not None:
        logits = logits + final_logits_bias.reshape(-1).to(logits.dtype)
    return logits
