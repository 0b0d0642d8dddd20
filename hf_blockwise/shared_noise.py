"""The noise a sampling call draws with (`generation/sampling.py`) and its drafters draft with (`drafters/`): standard
Gumbel noise that is a fixed hash of (the call's seed, the row, the position, the token), in torch operations only,
so that eager code and a compiled drafting block compute the same draws.
"""

from __future__ import annotations

import torch

# splitmix64's constants, as signed 64-bit integers (torch has no uint64 arithmetic on CPU): products wrap
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(value: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (value >> bits) & ((1 << (64 - bits)) - 1)


def _mix(value: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of 64-bit integers whose outputs look independent for nearby inputs."""
    value = value + _GOLDEN
    value = (value ^ _shift_right(value, 30)) * _MIX_1
    value = (value ^ _shift_right(value, 27)) * _MIX_2
    return value ^ _shift_right(value, 31)


def position_keys(seed: int, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 64-bit key per (row, position) of a call: the noise of a token is a hash of it and the key ([`gumbel`]).

    Args:
        seed (`int`): the call's seed.
        rows (`torch.LongTensor` of shape `(b,)`): each row's index in the caller's batch.
        positions (`torch.LongTensor` of shape `(b,)` or `(b, n)`): the position each token takes (the length of its
            prefix, decoder start included).

    Returns:
        `torch.LongTensor` of the shape of `positions`.
    """
    row_keys = _mix(torch.full_like(rows, seed, device=positions.device) ^ _mix(rows.to(positions.device)))  # (b,)
    return _mix(row_keys.reshape(-1, *[1] * (positions.dim() - 1)) ^ _mix(positions))


def gumbel(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise of `tokens` under `keys` ([`position_keys`], broadcast together), as float32."""
    bits = _shift_right(_mix(keys ^ tokens), 11)  # 53 random bits
    uniform = (bits.double() + 0.5) * 2.0**-53  # in (0, 1)
    return (-torch.log(-torch.log(uniform))).float()


def shared_gumbel_noise(
    seed: int, rows: torch.Tensor, positions: torch.Tensor, vocab_size: int, token_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Standard Gumbel noise that depends on (seed, row, position, token) only.

    Args:
        seed (`int`): the call's seed.
        rows (`torch.LongTensor` of shape `(b,)`): each row's index in the caller's batch.
        positions (`torch.LongTensor` of shape `(b, n)`): the position of the token each score vector decides
            (the length of its prefix, decoder start included).
        vocab_size (`int`): the noise of tokens `0..vocab_size - 1`, unless `token_ids` is given.
        token_ids (`torch.LongTensor` of shape `(S,)` or per position `(b, n, S)`, *optional*): the noise of these
            tokens only (a drafter's shortlist or candidates): what the full vocabulary's noise holds at those ids.

    Returns:
        `torch.FloatTensor` of shape `(b, n, vocab_size)`, or `(b, n, S)` with `token_ids`.
    """
    device = positions.device
    tokens = torch.arange(vocab_size, device=device) if token_ids is None else token_ids.to(device)
    return gumbel(position_keys(seed, rows, positions)[..., None], tokens)  # (b, n, V)
