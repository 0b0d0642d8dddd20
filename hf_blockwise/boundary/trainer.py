"""What the trainers take from transformers' `Trainer` beyond its public API: the one place that overrides its
private checkpoint methods.

Not imported by `hf_blockwise.boundary` itself: `transformers.trainer` takes over a second to import, which
`import hf_blockwise` (every CLI start included) does not need. The trainers (`hf_blockwise.training`) import this
module directly.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# The file name under which `Trainer._save` writes the training arguments beside a checkpoint.
from transformers.trainer import TRAINING_ARGS_NAME

from hf_blockwise.serialization import atomic_write

__all__ = ["TRAINING_ARGS_NAME", "AdapterCheckpointMixin"]


class AdapterCheckpointMixin:
    """Checkpoints of a `Trainer` written and read in the trained model's own adapter format.

    transformers' `Trainer` writes a checkpoint's model in `_save` and reads it back in `_load_from_checkpoint`
    (resuming) and `_load_best_model` (`load_best_model_at_end`), private methods that assume a whole
    `PreTrainedModel` or a PEFT model. A trainer of an adapter (proposal heads, a drafter) lists this mixin before
    its `Trainer` class and implements two public hooks instead:

    - `save_adapter(model, output_dir)`: write the (unwrapped) model into `output_dir`, as its `save_pretrained`;
    - `load_adapter(model, checkpoint_dir)`: load what `save_adapter` wrote into the (unwrapped) model.

    Beside the model, a checkpoint holds the `processing_class` (when given) and the training arguments, as
    transformers writes them. Checkpoints of sharded models (FSDP, DeepSpeed ZeRO-3, SageMaker MP), whose local
    parameters are empty, are not supported and refused.
    """

    def save_adapter(self, model: nn.Module, output_dir: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement save_adapter(model, output_dir)")

    def load_adapter(self, model: nn.Module, checkpoint_dir: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement load_adapter(model, checkpoint_dir)")

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model)
        # transformers hands a gathered state_dict for DeepSpeed (ZeRO 1/2 hold whole weights on every process, so
        # the unwrapped model saves as it is) and for sharded models, whose local parameters are empty
        if state_dict is not None and any(parameter.numel() == 0 for parameter in model.parameters()):
            raise ValueError(
                f"{type(self).__name__} saves its model with save_adapter and cannot save sharded parameters "
                "(FSDP, DeepSpeed ZeRO-3, SageMaker model parallelism); train on one device, with DDP or ZeRO 1/2"
            )
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if not self.args.should_save:
            return
        self.save_adapter(model, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        atomic_write(os.path.join(output_dir, TRAINING_ARGS_NAME), lambda path: torch.save(self.args, path))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self.load_adapter(self.accelerator.unwrap_model(self.model if model is None else model), resume_from_checkpoint)

    def _load_best_model(self) -> None:
        self.load_adapter(self.accelerator.unwrap_model(self.model), self.state.best_model_checkpoint)
