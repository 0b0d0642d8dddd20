"""`NARDrafterTrainer`: trains a [`NARDrafterModel`] with transformers' `Seq2SeqTrainer` (Ge et al. §3.2.1)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.boundary.trainer import AdapterCheckpointMixin
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.modeling.nar_model import NARDrafterModel
from hf_blockwise.training.common import (
    StepMetricsTrainer,
    check_trainer_inputs,
    decode_for_evaluation,
    with_pad_collator,
)
from hf_blockwise.training.nar_config import NARDrafterTrainingArguments


def sample_draft_rows(
    labels: torch.Tensor,
    num_drafts: int,
    decoder_start_token_id: int,
    mask_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draws one prefix length per row and lays out the drafter's decoder input and draft labels for it.

    A row with prefix length p reads: decoder start, target[:p], `num_drafts - 1` masks (then padding); the
    outputs at positions p .. p + num_drafts - 1 are to predict target[p : p + num_drafts], which is what
    [`nar_decoder_inputs`] feeds at inference after p verified tokens.

    Args:
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`): target ids (end-of-sequence
            included), padded with -100.
        generator (`torch.Generator`, *optional*): source of the prefix lengths, uniform over each target.

    Returns:
        decoder_input_ids (`torch.LongTensor` of shape `(batch_size, width)`),
        draft_positions (`torch.LongTensor` of shape `(batch_size, num_drafts)`),
        draft_labels (`torch.LongTensor` of shape `(batch_size, num_drafts)`): -100 past a target's end.
    """
    batch_size, target_length = labels.shape
    lengths = (labels != -100).sum(dim=1)  # (B,)
    if bool((lengths == 0).any()):
        raise ValueError("an example has empty labels; the drafter needs at least the end-of-sequence token")
    device = None if generator is None else generator.device
    uniform = torch.rand(batch_size, generator=generator, device=device).to(labels.device)  # (B,)
    prefix = torch.minimum((uniform * lengths).long(), lengths - 1)  # (B,) in [0, length)
    width = int((prefix + num_drafts).max())
    columns = torch.arange(width, device=labels.device)  # (W,)
    previous_target = labels.gather(1, (columns - 1).clamp(0, target_length - 1).expand(batch_size, -1))  # (B, W)
    decoder_input_ids = torch.where(columns[None, :] <= prefix[:, None], previous_target, mask_token_id)
    decoder_input_ids[:, 0] = decoder_start_token_id
    decoder_input_ids = torch.where(columns < (prefix + num_drafts)[:, None], decoder_input_ids, pad_token_id)
    draft_positions = prefix[:, None] + torch.arange(num_drafts, device=labels.device)  # (B, D)
    inside = draft_positions < lengths[:, None]
    draft_labels = torch.where(inside, labels.gather(1, draft_positions.clamp(max=target_length - 1)), -100)
    return decoder_input_ids, draft_positions, draft_labels


class NARDrafterTrainer(AdapterCheckpointMixin, StepMetricsTrainer):
    """Trains a non-autoregressive drafter to predict the next `block_size - 1` target tokens after a random prefix.

    Datasets hold `input_ids` (source) and `labels` (the full target, end-of-sequence included); each step
    draws `prefixes_per_example` prefix lengths per example ([`sample_draft_rows`]).

    - Train on the verifier's own greedy outputs (sequence-level distillation, `hf_blockwise.training.distill`) so that
      drafts agree with what the verifier will accept; Ge et al. distil both models from one teacher.
    - The loss is the mean cross-entropy of the drafts; only their positions are projected onto the vocabulary.
    - `freeze_encoder=True` keeps the encoder as initialised (from the verifier, say), and with it the
      embeddings and output projection where the architecture shares them with the encoder.
    - Per-draft top-1 accuracy is logged as `draft_{i}_accuracy` (draft i is i tokens after the prefix).
    - Checkpoints hold the drafter model in transformers' format plus `nar_drafter_config.json`, so any
      checkpoint loads with [`NARDrafterModel.from_pretrained`]; `resume_from_checkpoint` works as usual.
    - With `verifier=`, `evaluate` also decodes the evaluation set with the drafter and reports `mean_accepted`.

    Args:
        drafter ([`NARDrafterModel`]): its model is trained in place.
        args ([`NARDrafterTrainingArguments`]): the training arguments.
        verifier (`nn.Module`, *optional*): the model the drafts are for, used by `evaluate` only.
    """

    def __init__(
        self,
        drafter: NARDrafterModel,
        args: NARDrafterTrainingArguments,
        verifier: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        check_trainer_inputs("NARDrafterTrainer", drafter, NARDrafterModel, args, NARDrafterTrainingArguments)
        kwargs = with_pad_collator(kwargs, drafter.model.config.pad_token_id)
        if args.freeze_encoder:
            drafter.model.get_encoder().requires_grad_(False)
        super().__init__(model=drafter.model, args=args, **kwargs)
        self.drafter_config = drafter.nar_config
        # a BlockwiseHeadsModel's own generate would bring its heads; the drafter is what is evaluated here
        self.verifier = None if verifier is None else hf.unwrap_base(verifier)

    def training_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        unwrapped = self.accelerator.unwrap_model(model)
        copies = self.args.prefixes_per_example
        labels = inputs["labels"].repeat_interleave(copies, dim=0)
        # seeded by the step, so that a resumed run draws the prefixes an uninterrupted one would have
        generator = torch.Generator(device=labels.device)
        generator.manual_seed(self.args.seed * 1_000_003 + (1 + self.state.global_step if model.training else 0))
        decoder_input_ids, draft_positions, draft_labels = sample_draft_rows(
            labels, self.drafter_config.block_size - 1, unwrapped.config.decoder_start_token_id,
            self.drafter_config.mask_token_id, unwrapped.config.pad_token_id, generator,
        )  # fmt: skip
        sources = {key: inputs[key].repeat_interleave(copies, dim=0) for key in ("input_ids", "attention_mask")}
        # only the draft positions are projected onto the vocabulary: the prefix positions carry no loss
        with hf.project_columns(unwrapped, draft_positions):
            outputs = model(**sources, decoder_input_ids=decoder_input_ids, use_cache=False, return_dict=True)
        logits = outputs.logits.float()  # (B, D, V)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), draft_labels.flatten(), ignore_index=-100)
        self._record_accuracy(logits, draft_labels, "train" if model.training else "eval")
        return loss, outputs

    @torch.no_grad()
    def _record_accuracy(self, logits: torch.Tensor, draft_labels: torch.Tensor, split: str) -> None:
        is_label = draft_labels != -100  # (B, D)
        correct = (logits.argmax(dim=-1) == draft_labels) & is_label
        for index in range(draft_labels.shape[1]):
            if bool(is_label[:, index].any()):
                accuracy = correct[:, index].sum() / is_label[:, index].sum()
                self.step_metrics.add(split, f"draft_{index + 1}_accuracy", float(accuracy))

    def evaluation_decoding(self, dataset) -> dict[str, float]:
        """With a verifier, the drafter's mean accepted block on `dataset` ([`mean_accepted`]); else nothing."""
        return {} if self.verifier is None else {"mean_accepted": self.mean_accepted(dataset)}

    @torch.no_grad()
    def mean_accepted(self, dataset) -> float:
        """Mean accepted block when the verifier decodes (the first `eval_decoding_samples` of) `dataset`."""
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()  # dropout would make the drafts random
        drafter = NARDrafterModel(model, self.drafter_config).drafter(verifier=self.verifier)
        results = decode_for_evaluation(
            self.verifier,
            dataset,
            pad_token_id=model.config.pad_token_id,
            batch_size=self.args.eval_decoding_batch_size,
            max_new_tokens=self.args.eval_max_new_tokens,
            limit=self.args.eval_decoding_samples,
            description="GAD eval",
            show_progress=self.is_world_process_zero(),
            custom_generate=blockwise_generate,
            assistant=drafter,
        )
        model.train(was_training)
        return results["mean_accepted"]

    def save_adapter(self, model: nn.Module, output_dir: str) -> None:
        NARDrafterModel(model, self.drafter_config).save_pretrained(output_dir)

    def load_adapter(self, model: nn.Module, checkpoint_dir: str) -> None:
        NARDrafterModel(model, self.drafter_config).load_weights(checkpoint_dir)
