"""What the trainers take from transformers' `Trainer` beyond its public API.

Not imported by `hf_blockwise.boundary` itself: `transformers.trainer` takes over a second to import, which
`import hf_blockwise` (every CLI start included) does not need. The trainers (`hf_blockwise.training`) import this
module directly.
"""

from __future__ import annotations

# The file name under which `Trainer._save` writes the training arguments beside a checkpoint; the trainers that
# override `_save` to write their own model format write the arguments under the same name.
from transformers.trainer import TRAINING_ARGS_NAME

__all__ = ["TRAINING_ARGS_NAME"]
