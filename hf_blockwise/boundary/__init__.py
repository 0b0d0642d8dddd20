"""Every contact with transformers' generation internals, and every model quirk, in one package.

hf_blockwise plugs its decoding loop into `GenerationMixin.generate` as a callable `custom_generate`, so
transformers does all the preparation (generation config merging, encoder pass, decoder start tokens,
logits processors, stopping criteria, KV cache) and this package only replaces the decoding loop. What
that loop needs from transformers beyond public API is collected here and tested against the range below
(`TESTED_TRANSFORMERS_RANGE`, required by `pyproject.toml`; where releases differ, the difference is read from the
model or the call, not from a version number: the cache argument's name, [`cache_argument`]): when transformers
changes, this is the one package to revisit.

Modules, each importing only those listed before it (and none of them this package's `__init__`):

- `cache`: the croppable dynamic cache of the loop, the static caches of the compiled engine, cropping, row
  selection and beam search's reorder for both, and the check of `generate`'s cache arguments.
- `beam`: transformers' beam search one step at a time (`beam_search_step` over its own vectorized helpers), its
  state and options, its output (`BlockwiseBeamOutput`), and which beam searches the beam loop can reproduce.
- `tree`: a tree of drafts through the decoder forward: positions by depth (a hook on the position module),
  the ancestry mask, the capability of a decoder to take one, and compacting the cache to the accepted path.
- `models`: where a transformers seq2seq model keeps what the loop and the heads need: `BaseModelWrapper` and
  `unwrap_base` (and the checks of what wrappers and drafters are given: `check_wrap_arguments`,
  `check_materialized`, `check_same_projection`, `check_same_dtype`), decoder config, layer count, FFN width, MoE
  capacity, encoder width and input name, token embeddings and the shared-vocabulary check, the output projection
  (captured input, selected columns, logit bias, shortlist rows), and `decoder_forward`.
- `processors`: transformers' stopping criteria (`StopRules`) and logits processors, as a blockwise step uses them.
- `probes`: the tiny probe batch (`probe_inputs`, random encoder states for speech and vision encoders) and
  `check_output_projection`.
- `media`: speech and vision specifics: the encoder-output mask, the probe for decoders that read no frame mask
  (Whisper), and the Whisper segment options that blockwise decoding refuses.
- `inputs`: position limits and the input checks that turn deep failures into clear errors.
- `hub`: checkpoint files and local-path checks, an adapter's recorded or given base, `load_encoder_decoder`.
- `generate_call`: the `custom_generate` calling convention: `adapt_generate_call` (validation, `GenerateCall`),
  the decoder forward's kwargs and their row selection, the streamer lookup, `BlockwiseGenerateOutput`.
- `trainer`: what the trainers take from transformers' `Trainer` (`TRAINING_ARGS_NAME`); not re-exported here,
  so that importing hf_blockwise does not import `transformers.trainer`.

Everything public of the first ten is re-exported here: `from hf_blockwise import boundary as hf; hf.crop_cache`
and `from hf_blockwise.boundary import crop_cache` both work. Patch a name in the module that looks it up
(`hf_blockwise.boundary.cache.crop_cache`), not here.
"""

from hf_blockwise.boundary.beam import (
    BeamOptions,
    BeamSearchState,
    BlockwiseBeamOutput,
    beam_options,
    beam_search_output,
    beam_search_step,
    initial_beam_search,
    validate_beam_config,
)
from hf_blockwise.boundary.cache import (
    attention_window,
    crop_cache,
    is_static_cache,
    loop_decoder_cache,
    new_decoder_cache,
    reorder_cache_rows,
    select_cache_rows,
    static_cache_capacity,
    static_cache_mask,
    static_decoder_cache,
    unpin_static_cache,
)
from hf_blockwise.boundary.generate_call import (
    BlockwiseGenerateOutput,
    GenerateCall,
    adapt_generate_call,
    check_no_assistant_model,
    decoder_prompt_kwargs,
    encoder_hidden_states,
    forward_kwargs,
    generate_call_argument,
    is_beam_search,
    pad_token_tensor,
    select_forward_rows,
    stop_string_kwargs,
    streamer_from_generate_call,
    validate_generation_config,
)
from hf_blockwise.boundary.hub import (
    adapter_base,
    base_location,
    base_weights_fingerprint,
    check_local_path,
    from_hub,
    given_base,
    has_file,
    load_encoder_decoder,
    resolve_file,
    resolved_base_location,
    same_fingerprint,
    warn_if_other_base,
)
from hf_blockwise.boundary.inputs import (
    check_block_size_fits,
    check_decoder_length,
    check_generate_inputs,
    check_input_features,
    decoder_position_limit,
    encoder_position_limit,
    position_limit,
    warn_unmasked_padding,
)
from hf_blockwise.boundary.media import decoder_reads_frame_mask, encoder_output_mask, validate_segment_options
from hf_blockwise.boundary.models import (
    BaseModelWrapper,
    cache_argument,
    capture_output_projection_input,
    check_materialized,
    check_model_argument,
    check_same_dtype,
    check_same_projection,
    check_shared_vocabulary,
    check_wrap_arguments,
    decoder_config,
    decoder_ffn_width,
    decoder_forward,
    decoder_input_embeddings,
    decoder_layer_count,
    encoder_decoder_only,
    encoder_hidden_size,
    encoder_input_name,
    expert_capacity_limit,
    input_embeddings,
    model_name,
    output_projection_logits,
    project_columns,
    shortlist_projection,
    unwrap_base,
)
from hf_blockwise.boundary.probes import ProbeInputs, check_output_projection, probe_inputs
from hf_blockwise.boundary.processors import (
    ForcedPathRecorder,
    StopRules,
    apply_prefix_free_processors,
    check_row_local_processors,
    is_row_local,
    processor_acts_at,
    processor_ignores_prefix,
    split_stopping_criteria,
)
from hf_blockwise.boundary.tree import (
    TreeInputs,
    compact_cache,
    decoder_position_module,
    positions_at_depth,
    tree_attention_mask,
    tree_positions,
    tree_support,
)

# The transformers versions the boundary is tested against: the test command runs the whole suite on the installed one
# and the range's subset (`scripts/test.sh`, RANGE_TESTS) on the oldest and the newest of these; `pyproject.toml`
# requires the range they bound
TESTED_TRANSFORMERS_VERSIONS = ("5.21.0", "5.25.0")
TESTED_TRANSFORMERS_RANGE = ">=5.21,<5.26"

__all__ = [
    "TESTED_TRANSFORMERS_RANGE",
    "TESTED_TRANSFORMERS_VERSIONS",
    "BaseModelWrapper",
    "BeamOptions",
    "BeamSearchState",
    "BlockwiseBeamOutput",
    "BlockwiseGenerateOutput",
    "ForcedPathRecorder",
    "GenerateCall",
    "ProbeInputs",
    "StopRules",
    "TreeInputs",
    "adapt_generate_call",
    "adapter_base",
    "apply_prefix_free_processors",
    "attention_window",
    "base_location",
    "base_weights_fingerprint",
    "beam_options",
    "beam_search_output",
    "beam_search_step",
    "cache_argument",
    "capture_output_projection_input",
    "check_block_size_fits",
    "check_decoder_length",
    "check_generate_inputs",
    "check_input_features",
    "check_local_path",
    "check_materialized",
    "check_model_argument",
    "check_no_assistant_model",
    "check_output_projection",
    "check_row_local_processors",
    "check_same_dtype",
    "check_same_projection",
    "check_shared_vocabulary",
    "check_wrap_arguments",
    "compact_cache",
    "crop_cache",
    "decoder_config",
    "decoder_ffn_width",
    "decoder_forward",
    "decoder_input_embeddings",
    "decoder_layer_count",
    "decoder_position_limit",
    "decoder_position_module",
    "decoder_prompt_kwargs",
    "decoder_reads_frame_mask",
    "encoder_decoder_only",
    "encoder_hidden_size",
    "encoder_hidden_states",
    "encoder_input_name",
    "encoder_output_mask",
    "encoder_position_limit",
    "expert_capacity_limit",
    "forward_kwargs",
    "from_hub",
    "generate_call_argument",
    "given_base",
    "has_file",
    "initial_beam_search",
    "input_embeddings",
    "is_beam_search",
    "is_row_local",
    "is_static_cache",
    "load_encoder_decoder",
    "loop_decoder_cache",
    "model_name",
    "new_decoder_cache",
    "output_projection_logits",
    "pad_token_tensor",
    "position_limit",
    "positions_at_depth",
    "probe_inputs",
    "processor_acts_at",
    "processor_ignores_prefix",
    "project_columns",
    "reorder_cache_rows",
    "resolve_file",
    "resolved_base_location",
    "same_fingerprint",
    "select_cache_rows",
    "select_forward_rows",
    "shortlist_projection",
    "split_stopping_criteria",
    "static_cache_capacity",
    "static_cache_mask",
    "static_decoder_cache",
    "stop_string_kwargs",
    "streamer_from_generate_call",
    "tree_attention_mask",
    "tree_positions",
    "tree_support",
    "unpin_static_cache",
    "unwrap_base",
    "validate_beam_config",
    "validate_generation_config",
    "validate_segment_options",
    "warn_if_other_base",
    "warn_unmasked_padding",
]
