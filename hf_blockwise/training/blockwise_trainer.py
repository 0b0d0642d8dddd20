"""The module's name before 0.2 (now `hf_blockwise.training.heads_trainer`), kept for one release."""

from hf_blockwise.renamed import warn_renamed_module
from hf_blockwise.training.heads_trainer import BlockwiseHeadsTrainer, __getattr__  # noqa: F401 (the old names, with their warning)

warn_renamed_module(__name__, "hf_blockwise.training.heads_trainer")
