"""What the loop knows about transformers' stopping criteria and logits processors.

The stopping criteria of a `generate` call, split into what a blockwise step checks in bulk ([`StopRules`]:
maximum length, EOS ids) and the rest ([`split_stopping_criteria`]); and, for transformers' own logits
processors, whether one depends on the prefix at all ([`processor_ignores_prefix`]), at which prefix lengths it
may change the scores ([`processor_acts_at`]), and whether it is known to read its own row only
([`check_row_local_processors`]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation import GenerationConfig
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessor,
    MinLengthLogitsProcessor,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)

# sampling's warpers: each reads a row's scores only (a division, a top-k or top-p cut, a cut by probability)
_SCORE_ONLY_WARPERS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper,
)  # fmt: skip


@dataclass
class StopRules:
    """The stopping criteria of one `generate` call, split into the parts a blockwise step handles in bulk.

    Attributes:
        max_length (`int`): total length (decoder prompt included) at which every row stops.
        eos_token_ids (`torch.LongTensor` of shape `(num_eos,)`, *optional*): ids that end a row.
        others (`list[StoppingCriteria]`): any other criteria, evaluated token by token.
    """

    max_length: int
    eos_token_ids: torch.Tensor | None
    others: list[StoppingCriteria]


def split_stopping_criteria(stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig) -> StopRules:
    """The criteria as [`StopRules`]. A fractional length (`max_new_tokens=2.5`, which `generate` accepts) is
    rounded up: greedy search stops once a row's length is `>=` it, i.e. at its ceiling."""
    max_length = generation_config.max_length
    eos_token_ids = None
    others: list[StoppingCriteria] = []
    for criterion in stopping_criteria:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = min(max_length, criterion.max_length)
        elif isinstance(criterion, EosTokenCriteria):
            ids = criterion.eos_token_id.reshape(-1)
            eos_token_ids = ids if eos_token_ids is None else torch.cat([eos_token_ids, ids.to(eos_token_ids)])
        else:
            others.append(criterion)
    return StopRules(max_length=math.ceil(max_length), eos_token_ids=eos_token_ids, others=others)


def processor_ignores_prefix(processor: Any) -> bool:
    """Whether a logits processor's output depends on the scores only (never on `input_ids` or its length).

    Known from transformers' own processors: `suppress_tokens`, sampling's warpers (`temperature`, `top_k`,
    `top_p`, `min_p`, `typical_p`, `epsilon_cutoff`, `eta_cutoff`), and sequence biases / `bad_words_ids` made of
    single tokens only (a constant bias). Any other processor is taken to depend on the prefix.
    """
    if isinstance(processor, (SuppressTokensLogitsProcessor, *_SCORE_ONLY_WARPERS)):
        return True
    if isinstance(processor, SequenceBiasLogitsProcessor):  # NoBadWordsLogitsProcessor included
        return all(len(sequence) == 1 for sequence in processor.sequence_bias)
    return False


def apply_prefix_free_processors(processors: Any, scores: torch.Tensor) -> torch.Tensor:
    """The processors that ignore the prefix ([`processor_ignores_prefix`]), in order, on scores of any leading shape
    `(..., vocab_size)` in one call each: their composition at every position.

    Returns:
        `torch.Tensor` of the shape of `scores` (`scores` itself when no processor ignores the prefix).
    """
    prefix_free = [processor for processor in processors if processor_ignores_prefix(processor)]
    if not prefix_free:
        return scores
    flat = scores.reshape(-1, scores.shape[-1])
    no_prefix = flat.new_zeros((flat.shape[0], 1), dtype=torch.long)
    for processor in prefix_free:  # called directly: these known processors take no extra arguments
        flat = processor(no_prefix, flat)
    return flat.reshape(scores.shape)


def processor_acts_at(processor: Any, length: int) -> bool:
    """Whether a logits processor may change the scores when the prefix has `length` tokens.

    `False` only where transformers' processor is known to return its input unchanged at that length (forced
    BOS/EOS, minimum length, begin-suppression); any other processor is taken to act everywhere.
    """
    if isinstance(processor, ForcedEOSTokenLogitsProcessor):
        return length == processor.max_length - 1
    if isinstance(processor, ForcedBOSTokenLogitsProcessor):
        return length == 1
    if isinstance(processor, MinLengthLogitsProcessor):
        return length < processor.min_length
    if isinstance(processor, SuppressTokensAtBeginLogitsProcessor):
        return length == processor.begin_index
    return True


def is_row_local(processor: Any) -> bool:
    """Whether a logits processor is known to compute each row's scores from that row's data only: transformers'
    own processors (defined in a `transformers` module) but classifier-free guidance, which mixes the two halves of
    the batch, or one that declares `row_local = True`."""
    if isinstance(processor, ClassifierFreeGuidanceLogitsProcessor):
        return False
    return type(processor).__module__.split(".")[0] == "transformers" or getattr(processor, "row_local", False) is True


def check_row_local_processors(processors: Any) -> None:
    """A `ValueError` naming the first logits processor not known to be row-local ([`is_row_local`]).

    A blockwise step scores several positions per row in one pass, and rows advance at different speeds, so when a
    processor is called for row i at a prefix length, other rows' prefixes of that length may hold drafts that are
    rejected later. A processor that reads other rows to decide row i would see them, and the output would differ
    from greedy search's.
    """
    for processor in processors:
        if not is_row_local(processor):
            name = type(processor).__name__
            raise ValueError(
                f"The logits processor {name} is not known to be row-local: blockwise decoding calls processors on "
                "every row's prefix, where other rows may hold drafts not yet verified, so a processor that reads "
                "other rows of the batch to score a row would not reproduce greedy search. If row i's scores depend "
                f"only on row i's input_ids (and data kept for row i), declare it: set `row_local = True` on {name} "
                "(class or instance); else use the base model's generate without hf_blockwise."
            )


class ForcedPathRecorder(LogitsProcessor):
    """A last logits processor that records the scores every earlier processor produced and forces the next token
    of `candidate`: greedy search then walks the candidate's path and keeps the scores it would have compared.

    Args:
        candidate (`torch.LongTensor` of shape `(batch_size, length)`): decoder sequences, prompt included.

    Attributes:
        scores (`list[torch.Tensor]`): per step, the processed scores `(batch_size, vocab_size)` (a copy).
    """

    def __init__(self, candidate: torch.Tensor) -> None:
        self.candidate = candidate
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.scores.append(scores.detach().clone())
        position = min(input_ids.shape[1], self.candidate.shape[1] - 1)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.candidate[:, position : position + 1].to(scores.device), 0.0)
