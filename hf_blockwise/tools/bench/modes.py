"""The grammar of the bench's mode names, parsed once into a frozen [`Mode`].

A mode name is a family (`greedy`, `heads`, `feature`, `iad`, `gad_pp`, `ct2`, ...), optionally sized
(`heads_k3`, `oracle_k4`, `feature_k6_t0.3`, `feature_t0.3`), drafting trees when sized with nodes (`feature_k6_n10`:
trees of 10 drafts, `feature_k6_n16_m4`: 4 candidates per node), and optionally suffixed `_int8` (a few families,
and sized modes, on the int8 quantized model) or `_compiled` (through the compiled engine), then `_b<N>` (beam search)
or `_sample` (sampling at the bench's temperature and top-p: `greedy_sample` is transformers' own sampling,
`assisted_sample` its assisted sampling, `loop_sample` and `greedy_compiled_sample` the loop's without drafts).
Everything else reads the parsed fields.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hf_blockwise.drafters.feature import check_draft_threshold
from hf_blockwise.drafters.trees import check_tree_options
from hf_blockwise.loading import DRAFTERS
from hf_blockwise.modeling.config import MAX_BLOCK_SIZE, check_block_size

COMPILED_SUFFIX = "_compiled"
# the variants a family may come in: eager float32, on the int8 model (for `ct2`: CTranslate2's int8 compute
# type), through the compiled engine (`blockwise_compile=True`), and both
_EAGER, _INT8, _COMPILED, _INT8_COMPILED = "", "_int8", COMPILED_SUFFIX, "_int8" + COMPILED_SUFFIX
_EVERY_VARIANT = (_EAGER, _INT8, _COMPILED, _INT8_COMPILED)
# the float32 model drafted by its feature drafter with the drafter's layer in int8: exact w.r.t. float32 greedy
INT8_DRAFTER_FAMILY = "feature_int8d"
# Every family and the variants it has; the mode names are generated from them. `greedy_compiled` is the loop with
# no drafter through the engine, the exact reference of every other `*_compiled` mode (and `greedy_int8_compiled`
# of the compiled int8 ones: the int8 model's greedy output); `hf_greedy_compiled` is transformers' own greedy
# with a static cache and a compiled forward, as a user would set it up.
FAMILIES: dict[str, tuple[str, ...]] = {
    "greedy": _EVERY_VARIANT, "beam4": (_EAGER,), "prompt_lookup": (_EAGER,), "assisted": (_EAGER,),
    "hf_greedy": (_COMPILED,), "heads": _EVERY_VARIANT, "heads_full_vocab": (_EAGER,), "heads_top2": (_EAGER,),
    "seq_heads": (_EAGER, _COMPILED), "feature": _EVERY_VARIANT, INT8_DRAFTER_FAMILY: (_EAGER, _COMPILED),
    "composite": (_EAGER, _COMPILED), "iad": (_EAGER, _INT8, _COMPILED), "iad_realign": (_EAGER,),
    "gad": (_EAGER, _COMPILED), "gad_pp": (_EAGER,), "loop": (_EAGER,), "oracle": (_EAGER, _COMPILED),
    "ct2": (_EAGER, _INT8),
}  # fmt: skip
MODE_NAMES = tuple(family + variant for family, variants in FAMILIES.items() for variant in variants)
COMPILED_MODES = tuple(name for name in MODE_NAMES if name.endswith(COMPILED_SUFFIX))
INT8_MODES = tuple(name for name in MODE_NAMES if name.removesuffix(COMPILED_SUFFIX).endswith(_INT8))
# What a run shows unless told otherwise: the references (transformers' greedy, the engine's float32 and int8
# greedy), CTranslate2, the fastest exact modes (docs/guides/bench.md), and the oracle (the ceiling of any drafter);
# `--modes all` runs every mode
DEFAULT_MODES = (
    "greedy", "greedy_compiled", "greedy_int8_compiled", "heads_compiled", "feature_compiled", "composite_compiled",
    "feature_int8_compiled", "oracle_compiled", "ct2", "ct2_int8",
)  # fmt: skip
ALL_MODES = "all"
# The CPU fast path, step by step (Devlin 2017, Table 1): blockwise heads drafting over the whole vocabulary,
# + the heads' vocabulary shortlist, + int8 matrix products (with int8 greedy as that step's exact reference).
FAST_PATH_MODES = ("greedy", "heads_full_vocab", "heads", "greedy_int8", "heads_int8")
# The loop alone, without a trained drafter: what `--model-config` runs.
LOOP_MODES = ("greedy", "loop", "oracle")
DEFAULT_ORACLE_BLOCK_SIZES = (4,)
# the greedy modes every other mode is compared with, in the order a batch is decoded (references first)
REFERENCE_MODES = ("greedy", "greedy_int8", "greedy_compiled", "greedy_int8_compiled")

_ORACLE = re.compile(r"oracle_k(\d+)")
# transformers' beam search with N beams (`beam4`), and any mode of the loop or CTranslate2 as a beam search of N
# beams (`feature_compiled_b4`, `loop_b4`, the engine's `greedy_compiled_b4`, `ct2_int8_b4`), compared with
# `beam<N>`; trees too (`feature_k4_n10_compiled_b4`)
_BEAM = re.compile(r"beam(\d+)")
_BEAMS_SUFFIX = re.compile(r"(.+)_b(\d+)")
_BEAM_FAMILIES = ("loop", "greedy", "ct2", "heads", "seq_heads", "feature", "composite")
# sampling (`feature_compiled_sample`): transformers' own (`greedy_sample`, `assisted_sample`: another random stream,
# compared with nothing) and the loop's, each drafting mode compared with the loop's undrafted sampling under the
# same seed (`loop_sample`; through the engine `greedy_compiled_sample`, itself compared with `loop_sample`)
SAMPLE_SUFFIX = "_sample"
_SAMPLE_FAMILIES = ("loop", "greedy", "assisted", "heads", "seq_heads", "feature", "composite")
# a model drafter at another block size k and (feature drafter) draft threshold: `feature_k6_t0.3`, `heads_k3`
# and trees: `feature_k6_n10` (10 drafts per row), `feature_k6_n16_m4` (4 candidates per node), `..._int8`
_SIZED = re.compile(
    r"(heads|seq_heads|feature)_k(\d+)(?:_t([0-9.]+))?(?:_n(\d+)(?:_m(\d+))?)?(_int8)?|feature_t([0-9.]+)"
)
# GAD at another block size (`gad_k4`), and GAD++ with its top-β and tolerance τ (`gad_pp_k8_beta3_tau2`): the
# settings of Ge et al.'s sweeps, each a mode of one run (`scripts/gad_sweep.py`)
_GAD = re.compile(r"(gad|gad_pp)_k(\d+)(?:_beta(\d+))?(?:_tau([0-9.]+))?")
# the drafter ([`hf_blockwise.loading.build_drafter`]) of each drafting family, from the one registry of drafters
_DRAFTERS = {family: kind.name for kind in DRAFTERS.values() for family in kind.bench_families}
_BATCH_ONE_ONLY = ("prompt_lookup", "assisted")  # transformers' assisted generation decodes one row at a time
_CT2_COMPUTE_TYPES = {False: "float32", True: "int8"}


@dataclass(frozen=True)
class Mode:
    """One parsed mode name.

    Attributes:
        name (`str`): the name as given (the row of the report).
        family (`str`): what decodes: `greedy`, `hf_greedy`, `beam4`, `prompt_lookup`, `assisted`, `loop`, `oracle`,
            `ct2`, or a drafting family (`heads`, `heads_full_vocab`, `heads_top2`, `seq_heads`, `feature`,
            `feature_int8d` (its layer in int8, over the float32 model), `composite`, `iad`, `iad_realign`, `gad`,
            `gad_pp`).
        compiled (`bool`): through the compiled engine (`_compiled`).
        int8 (`bool`): int8 weights (`_int8`; for `ct2`, CTranslate2's int8 compute type).
        block_size (`int`, *optional*): the k of a sized mode (`heads_k3`, `oracle_k4`); `None`: the trained one
            (an `oracle` without k stands for one `oracle_k{k}` per configured block size).
        threshold (`float`, `"config"` or `None`): the feature drafter's draft threshold: its config's unless the
            name is sized (`feature_k6`: none; `feature_k6_t0.3`: 0.3).
        tree_nodes (`int`, *optional*): drafts per row of a tree (`feature_k6_n10`); `None` drafts chains.
        tree_branching (`int`): candidates per drafted state of a tree (`_m4`; default 2).
        num_beams (`int`): beam search of this many beams (`beam4`, `feature_compiled_b4`); 1: greedy.
        sample (`bool`): sampling (`_sample`) at the bench's temperature and top-p, seeded alike in every mode.
        top_beta (`int`, *optional*), tolerance (`float`, *optional*): GAD++'s β and τ (`gad_pp_k8_beta3_tau2`);
            `None`: the bench's `--gad-top-beta` / `--gad-tolerance`.
    """

    name: str
    family: str
    compiled: bool = False
    int8: bool = False
    block_size: int | None = None
    threshold: float | str | None = "config"
    tree_nodes: int | None = None
    tree_branching: int = 2
    num_beams: int = 1
    sample: bool = False
    top_beta: int | None = None
    tolerance: float | None = None

    @classmethod
    def parse(cls, name: str) -> Mode:
        """The mode called `name`; a `ValueError` names the known ones."""
        if name.endswith(SAMPLE_SUFFIX) and name != SAMPLE_SUFFIX:
            mode = cls.parse(name.removesuffix(SAMPLE_SUFFIX))
            if mode.family not in _SAMPLE_FAMILIES or mode.num_beams > 1 or mode.sample or mode.int8:
                raise ValueError(
                    f"mode {name!r}: a _sample suffix follows a float32 chain or tree mode of {_SAMPLE_FAMILIES}"
                )
            return dataclasses.replace(mode, name=name, sample=True)
        beams = _BEAMS_SUFFIX.fullmatch(name)
        if beams and int(beams.group(2)) > 1:
            mode = cls.parse(beams.group(1))
            if mode.family not in _BEAM_FAMILIES or mode.num_beams > 1:
                raise ValueError(f"mode {name!r}: a _b<beams> suffix follows a mode of {_BEAM_FAMILIES}")
            if mode.family == "greedy" and not mode.compiled:  # transformers' eager beam search is `beam<N>`
                raise ValueError(f"mode {name!r}: transformers' beam search is beam<N>, the loop's loop_b<N>")
            return dataclasses.replace(mode, name=name, num_beams=int(beams.group(2)))
        beam = _BEAM.fullmatch(name)
        if beam and int(beam.group(1)) > 1:
            return cls(name, "beam", num_beams=int(beam.group(1)))
        plain = name.removesuffix(COMPILED_SUFFIX)
        compiled = plain != name
        if name in MODE_NAMES:
            int8 = plain.endswith("_int8")
            family = "hf_greedy" if plain == "hf_greedy" else plain.removesuffix("_int8")
            return cls(name, family, compiled=compiled, int8=int8)
        oracle = _ORACLE.fullmatch(plain)
        if oracle:
            return _checked_sizes(cls(name, "oracle", compiled=compiled, block_size=int(oracle.group(1))))
        gad = _gad_mode(name, plain, compiled)
        if gad is not None:
            return _checked_sizes(gad)
        sized = _SIZED.fullmatch(plain)
        raw = sized and (sized.group(3) or sized.group(7))
        if sized and (not raw or _is_number(raw)):
            nodes, branching = sized.group(4), sized.group(5)
            return _checked_sizes(cls(
                name, sized.group(1) or "feature", compiled, int8=bool(sized.group(6)),
                block_size=int(sized.group(2)) if sized.group(2) else None, threshold=float(raw) if raw else None,
                tree_nodes=int(nodes) if nodes else None, tree_branching=int(branching) if branching else 2,
            ))  # fmt: skip
        raise ValueError(
            f"Unknown mode {name!r}; choose from {MODE_NAMES}, oracle_k<k>, heads_k<k>, seq_heads_k<k>, feature_k<k>, "
            "feature_k<k>_t<threshold>, feature_t<threshold>, trees <heads|feature>_k<k>_n<nodes>[_m<branching>] (each "
            "sized one also with _int8 and _compiled suffixes), gad_k<k>[_compiled], gad_pp_k<k>[_beta<β>][_tau<τ>], "
            "beam<N> (transformers' beam search), a chain mode of the loop or CTranslate2 with _b<N> last (beam "
            "search of N beams), and a float32 mode of the loop, greedy or assisted with _sample last (sampling)"
        )

    @property
    def cpu_only(self) -> bool:
        """Whether this mode decodes with torch's dynamic int8 products, which run on a CPU (CTranslate2's int8 runs
        on its own devices)."""
        return (self.int8 and self.family != "ct2") or self.family == INT8_DRAFTER_FAMILY

    def at_block_size(self, block_size: int) -> Mode:
        """This (unsized oracle) mode at block size k: `oracle_k{k}`, with the `_compiled` suffix if it has one."""
        name = f"{self.family}_k{block_size}" + (COMPILED_SUFFIX if self.compiled else "")
        return dataclasses.replace(self, name=name, block_size=block_size)

    @property
    def reference(self) -> str | None:
        """The greedy mode whose output this one must reproduce: int8 modes are exact w.r.t. the int8 model, compiled
        modes w.r.t. the engine's own greedy (`greedy_compiled`, itself compared with eager greedy); beam search
        modes w.r.t. transformers' beam search of as many beams (`beam4`), which is compared with greedy; sampling
        modes w.r.t. the loop's undrafted sampling (`None` for transformers' own and for `loop_sample`)."""
        if self.sample:
            if self.family in ("assisted", "loop") or (self.family == "greedy" and not self.compiled):
                return None
            return "greedy_compiled_sample" if self.compiled and self.family != "greedy" else "loop_sample"
        if self.num_beams > 1 and self.family != "beam":
            return f"beam{self.num_beams}"
        if self.on_int8_model:
            return "greedy_int8_compiled" if self.compiled and self.family != "greedy" else "greedy_int8"
        if self.compiled and self.family not in ("greedy", "hf_greedy"):
            return "greedy_compiled"
        return "greedy"

    @property
    def drafter(self) -> str | None:
        """The drafter this mode decodes with (a name of [`hf_blockwise.loading.DRAFTER_NAMES`]), or `None`."""
        return _DRAFTERS.get(self.family)

    @property
    def on_int8_model(self) -> bool:
        """Whether this mode decodes with the int8 quantized torch model."""
        return self.int8 and self.family != "ct2"

    @property
    def on_int8_drafter(self) -> bool:
        """Whether this mode drafts with an int8 copy of the feature drafter over the float32 model."""
        return self.family == INT8_DRAFTER_FAMILY

    @property
    def ct2_compute_type(self) -> str | None:
        """CTranslate2's compute type of a `ct2` mode (`float32` or `int8` weights), else `None`."""
        return _CT2_COMPUTE_TYPES[self.int8] if self.family == "ct2" else None

    @property
    def batch_one_only(self) -> bool:
        """Whether this mode only runs at batch size 1 (transformers' assisted generation decodes one row)."""
        return self.family in _BATCH_ONE_ONLY


def _checked_sizes(mode: Mode) -> Mode:
    """`mode`, or a `ValueError` naming it and the size that no drafter could take (`feature_k0`, `feature_k4_n0`,
    `heads_k4_n1000`, `feature_t1.5`): checked when the name is read, before any model loads."""
    try:
        if mode.block_size is not None:
            check_block_size(mode.block_size)
        if isinstance(mode.threshold, float):
            check_draft_threshold(mode.threshold, "the threshold (_t)")
        if mode.tree_nodes is not None:
            # the most candidates any tree drafter ranks at this k and branching (a drafter checks its own too)
            depths = (mode.block_size or MAX_BLOCK_SIZE) - 1
            check_tree_options(mode.tree_nodes, mode.tree_branching, depths, frontier=mode.tree_branching)
    except ValueError as error:
        raise ValueError(f"mode {mode.name!r}: {error}") from None
    return mode


def _gad_mode(name: str, plain: str, compiled: bool) -> Mode | None:
    """The sized GAD mode called `name` (`gad_k4`, `gad_pp_k8_beta3_tau2`; `plain` without `_compiled`), or `None`."""
    gad = _GAD.fullmatch(plain)
    if gad is None:
        return None
    family, block_size, beta, tau = gad.groups()
    loose = beta is not None or tau is not None
    # only GAD++ has β and τ, and only exact GAD runs through the engine (as the unsized families)
    if (family == "gad" and loose) or (family == "gad_pp" and compiled) or not _is_number(tau or "0"):
        return None
    top_beta, tolerance = (int(beta) if beta else None), (float(tau) if tau else None)
    return Mode(name, family, compiled, block_size=int(block_size), top_beta=top_beta, tolerance=tolerance)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
