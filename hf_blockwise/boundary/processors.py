"""What the loop knows about transformers' stopping criteria and logits processors.

The stopping criteria of a `generate` call, split into what a blockwise step checks in bulk ([`StopRules`]:
maximum length, EOS ids) and the rest ([`split_stopping_criteria`]); and, for transformers' own logits
processors, whether one depends on the prefix at all ([`processor_ignores_prefix`]) and at which prefix lengths it
may change the scores ([`processor_acts_at`]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation import GenerationConfig
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)


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
    return StopRules(max_length=max_length, eos_token_ids=eos_token_ids, others=others)


def processor_ignores_prefix(processor: Any) -> bool:
    """Whether a logits processor's output depends on the scores only (never on `input_ids` or its length).

    Known from transformers' own processors: `suppress_tokens`, and sequence biases / `bad_words_ids` made of
    single tokens only (a constant bias). Any other processor is taken to depend on the prefix.
    """
    if isinstance(processor, SuppressTokensLogitsProcessor):
        return True
    if isinstance(processor, SequenceBiasLogitsProcessor):  # NoBadWordsLogitsProcessor included
        return all(len(sequence) == 1 for sequence in processor.sequence_bias)
    return False


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
