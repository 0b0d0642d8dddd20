"""The module's name before 0.2 (now `hf_blockwise.training.heads_config`), kept for one release."""

import warnings

from hf_blockwise.training.heads_config import BlockwiseHeadsTrainingArguments, __getattr__  # noqa: F401 (the old names, with their warning)

warnings.warn(
    f"{__name__} is now hf_blockwise.training.heads_config; the old module will be removed in the next release",
    FutureWarning,
    stacklevel=2,
)
