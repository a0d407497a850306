"""Every option of every command, declared once: name, type, default, help, choices, CLI spellings, batch key, API doc.

One :class:`Option` per option. From :data:`OPTIONS` (the ``quantize`` options, in
:class:`~ctconvert.pipeline.options.QuantizeOptions`' field order) and :data:`COMMANDS`
(each command's options in ``--help`` order, some in a command's own spelling) are derived:

* the click options of every command (``ctconvert.cli``, :func:`click_spec`);
* the fields and defaults of :class:`~ctconvert.pipeline.options.QuantizeOptions`, hence the
  keyword check of :func:`ctconvert.api.quantize` (``QuantizeOptions.from_kwargs``);
* the job keys of ``batch`` (:func:`job_keys`);
* the per-option part of :func:`ctconvert.api.quantize`'s docstring (:func:`api_doc`);
* the keywords a ``quantize`` command line gives the API (:func:`ctconvert.cli.api_keywords`).

Imports nothing of the package but the layout version (torch-free: ``ctconvert --help`` reads it).
The kernel-native ``--target`` names are spelled here (:data:`QUANTIZE_TARGETS`, :data:`REPACK_TARGETS`);
a table of targets exposed by ``layouts/`` would replace these two tuples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .layouts.versions import DEFAULT_LAYOUT_VERSION, LAYOUT_VERSIONS

__all__ = [
    "COMMANDS",
    "DEFAULT_ACT_DTYPE",
    "DEFAULT_CALIBRATION_BATCH_TOKENS",
    "DEFAULT_CALIBRATION_SAMPLES",
    "DEFAULT_CALIBRATION_SEQ_LEN",
    "DEFAULT_CHUNK_ELEMS",
    "DEFAULT_HOLD_BYTES",
    "DEFAULT_LAYOUT_VERSION",
    "DEFAULT_LM_HEAD_CHUNK_ROWS",
    "DEFAULT_SHARD_SIZE",
    "OBSERVER_NAMES",
    "OPTIONS",
    "Option",
    "api_doc",
    "click_spec",
    "job_keys",
]

#: the largest output shard unless told otherwise (decimal units, as transformers: :func:`ctconvert.checkpoint.writer.parse_size`)
DEFAULT_SHARD_SIZE = "5GB"
#: calibration: samples (rows of tokens) x tokens per sample, and the tokens run through the model at a time
DEFAULT_CALIBRATION_SAMPLES = 8
DEFAULT_CALIBRATION_SEQ_LEN = 256
DEFAULT_CALIBRATION_BATCH_TOKENS = 4096
#: the activation dtype a kernel-native layout is built for unless told otherwise
DEFAULT_ACT_DTYPE = "bf16"
#: rows of lm_head processed at a time
DEFAULT_LM_HEAD_CHUNK_ROWS = 8192
#: the executor: elements per row chunk, and the largest NVFP4 fused set read once and held until its global scale is known
DEFAULT_CHUNK_ELEMS = 4 * 2**20
DEFAULT_HOLD_BYTES = 1 << 30

#: ``quantize --target``: the kernel-native layouts a quantize run can write
QUANTIZE_TARGETS = ("marlin", "cutlass-nvfp4", "cutlass-2of4", "cutlass-2of4-sm80", "marlin-24")
#: ``quantize --observer``: llm-compressor's weight observer names (``llmcompressor/observers/``, 0.14.0.1) that
#: :data:`ctconvert.formats.observers.OBSERVERS` implements (spelled here for a torch-free ``--help``; a test holds them equal)
OBSERVER_NAMES = ("minmax", "memoryless_mse", "nvfp4_expanded_mse", "imatrix_mse", "nvfp4_expanded_imatrix")
#: ``repack --target``: the layouts repack builds, and compressed-tensors to undo one
REPACK_TARGETS = ("marlin", "cutlass-nvfp4", "cutlass-2of4", "cutlass-2of4-sm80", "compressed-tensors")


#: ``Option.cli_default`` when the CLI's default is the API's
SAME = type("SameAsTheApi", (), {"__repr__": lambda self: "SAME", "__slots__": ()})()


@dataclass(frozen=True)
class Option:
    """One option. ``name``: the API keyword, the :class:`QuantizeOptions` field and the click parameter.

    ``type``: ``"text"``, ``"flag"``, ``"int"``, ``"int>=1"``, ``"path"``, ``"file"`` (a path, not a folder) or
    ``"choice"`` (of ``choices``). ``flags``: the CLI spellings (empty: ``--name-with-dashes``; ``None``: no CLI
    option); ``cli_default``: the CLI's default where it differs from the API's (``None`` there says "not
    given"); ``invert``: the CLI flag sets the option to ``False`` (``--no-default-ignore``); ``multiple``: a
    repeatable CLI option, each value possibly a comma-separated list (:func:`split_list`), ``empty`` what none
    gives. ``job_key``: the ``batch`` key (default ``name``). ``field``: a quantize option (else the CLI's
    own: ``--output``, ``--all-layers`` ...). ``annotation``: the field's type; ``doc``: the API docstring text.
    """

    name: str
    default: Any = None
    help: str | None = None
    type: str = "text"
    choices: tuple[str, ...] = ()
    case_sensitive: bool = True
    flags: tuple[str, ...] | None = ()
    show_default: bool = False
    required: bool = False
    cli_default: Any = SAME
    invert: bool = False
    multiple: bool = False
    empty: Any = ()
    job_key: str | None = None
    field: bool = True
    annotation: str = "str"
    doc: str = ""

    def but(self, **changes) -> Option:
        """This option as one command spells it (another help, required, other choices ...)."""
        return dataclasses.replace(self, **changes)

    @property
    def cli_flags(self) -> tuple[str, ...]:
        return self.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def cli_name(self) -> str:
        """The click parameter name: the option's name, or for an inverted flag the flag's."""
        return self.cli_flags[-1].lstrip("-").replace("-", "_") if self.invert else self.name


def _flag(name: str, help: str | None, doc: str, **kw) -> Option:
    return Option(name, False, help=help, type="flag", annotation="bool", doc=doc, **kw)


def _choice(name: str, default: str, choices: tuple[str, ...], help: str, doc: str) -> Option:
    """A choice of names, any case, its default shown in ``--help``."""
    return Option(name, default, help=help, type="choice", choices=choices, case_sensitive=False, show_default=True, doc=doc)


_DENSE_DTYPES = ("keep", "bf16", "fp16", "fp32")
_ACT_DTYPES = (DEFAULT_ACT_DTYPE, "fp16")

_QUANTIZE = (
    # what is quantized
    _choice(
        "lm_head",
        "none",
        ("none", "nvfp4a16", "fp8"),
        "Also quantize lm_head (own config group).",
        "``none`` | ``nvfp4a16`` | ``fp8``.",
    ),
    Option(
        "targets",
        None,
        help="Modules to quantize: names, re:patterns or Linear (default Linear). Repeat, or separate with commas.",
        multiple=True,
        empty=None,
        annotation="tuple[str, ...] | None",
        doc="compressed-tensors style names, ``re:`` patterns or ``Linear`` (None: ``Linear``).",
    ),
    Option(
        "ignore",
        None,
        help="Modules to leave dense (names or re:patterns), added to the defaults. Repeat, or separate with commas.",
        multiple=True,
        annotation="tuple[str, ...] | None",
        doc="names or ``re:`` patterns kept dense, added to the default ignores.",
    ),
    _flag(
        "skip_incompatible",
        "Keep weights the scheme cannot take dense (listed in ignore and reported) instead of failing.",
        "keep a weight the scheme cannot take dense (listed in ``ignore`` and reported) instead of refusing it.",
    ),
    _flag(
        "allow_unloadable",
        "Quantize modules vLLM 0.33 cannot load quantized (gpt-oss experts, most MoE routers) when targets name them.",
        "quantize a module vLLM 0.33 cannot load quantized (gpt-oss experts, the MoE router of most families: "
        ":func:`ctconvert.checkpoint.families.vllm_dense_reason`) when a target names it, instead of refusing it "
        "(:class:`UnsupportedError`, exit 4); the output is then for other loaders, and ``verify`` reports those modules.",
    ),
    _flag(
        "keep_unclassified",
        "Keep tensors no rule classifies dense (listed in ignore and reported) instead of failing.",
        "keep a floating tensor of 2 or more dimensions that no rule classifies (or fused 3-D experts of a family whose layout is not known) "
        "dense, list its module in ``ignore`` and report it; by default it is refused by name (:class:`UnsupportedError`, exit 4).",
    ),
    Option(
        "default_ignore",
        True,
        help="Drop every default ignore (lm_head, routers, towers, MTP, Linear outside the blocks).",
        type="flag",
        flags=("--no-default-ignore",),
        invert=True,
        annotation="bool",
        doc="apply the default ignores (``lm_head``, MoE routers, vision/audio towers, MTP layers, Linear layers outside the blocks); "
        "``False`` drops them all. A module named in ``targets`` (a name or ``re:`` pattern) is quantized whatever the defaults say.",
    ),
    _flag(
        "quantize_mtp",
        "Also quantize multi-token-prediction (MTP) layers (dense by default).",
        "also quantize multi-token-prediction layers (dense by default).",
    ),
    Option(
        "sparsity",
        None,
        help="Magnitude 2:4 pruning along K. With DENSE, FP8_DYNAMIC or W8A8: sparse-24-bitmask, which vLLM <= 0.18 loads "
        "(SM90; current vLLM does not); with W4A16 and --target marlin-24: marlin-24, which vLLM <= 0.15 loads.",
        type="choice",
        choices=("2:4",),
        annotation="str | None",
        doc='``"2:4"``: magnitude 2:4 pruning along K before quantizing, written as ``sparse-24-bitmask`` (``scheme`` ``DENSE``, '
        '``FP8_DYNAMIC`` or ``W8A8``; vLLM <= 0.18 loads it) or, with ``target="marlin-24"`` and ``W4A16``, as ``marlin-24`` '
        "(vLLM <= 0.15). See :mod:`ctconvert.plan.sparsity`.",
    ),
    Option(
        "group_size",
        None,
        help="W4A16/W8A16: columns per weight scale (default: the preset's, 128).",
        type="int>=1",
        annotation="int | None",
        doc="the weight group size of W4A16, W4A16_ASYM or W8A16 (None: the preset's); the bytes are compressed-tensors' for it.",
    ),
    Option(
        "symmetric",
        None,
        help="W4A16/W8A16: weights without / with a zero point (default: the preset's).",
        type="flag",
        flags=("--symmetric/--asymmetric",),
        annotation="bool | None",
        doc="weights of W4A16, W4A16_ASYM or W8A16 without (True) / with (False) a zero point (None: the preset's).",
    ),
    _choice(
        "observer",
        "minmax",
        OBSERVER_NAMES,
        "Weight observer (llm-compressor's names): minmax rounds to nearest with min/max scales; memoryless_mse and "
        "nvfp4_expanded_mse search each group's range for the least error, data-free, with llm-compressor 0.14's bytes; "
        "imatrix_mse and nvfp4_expanded_imatrix weight that error by each input channel's E[x^2] over the calibration data.",
        "``minmax`` (each group's min/max: the default bytes, no ``observer`` field in the config), ``memoryless_mse`` or "
        "``nvfp4_expanded_mse``: the weight ranges llm-compressor 0.14.0.1's observer of that name searches on its eager CPU path "
        "(:mod:`ctconvert.formats.observers`), the same bytes, recorded as ``observer``/``observer_kwargs`` in the weights' "
        "QuantizationArgs. ``imatrix_mse`` / ``nvfp4_expanded_imatrix``: the same search with the error of each input channel "
        "weighted by its mean square activation, from a calibration pass over ``calibration`` (the built-in corpus by default; "
        "llm-compressor's statistic, eager attention). :class:`UsageError` for a scheme or option it cannot honour (a block or per-tensor scheme, calibrated "
        "activations, ``kv_cache``, ``sparsity``).",
    ),
    Option(
        "recipe",
        None,
        help="An llm-compressor recipe (YAML/JSON): one QuantizationModifier with config_groups or scheme, targets, ignore, "
        "per-group weight observers; several schemes in one output. Instead of --scheme.",
        type="file",
        annotation="str | Path | None",
        doc="the path of an llm-compressor 0.14 recipe (:mod:`ctconvert.plan.recipe`: ``quant_stage: quant_modifiers: "
        "QuantizationModifier:``), used instead of ``scheme`` (pass ``scheme=None``): each Linear takes the scheme of the config "
        "group whose targets match it (compressed-tensors' rule), the recipe's ``ignore`` and observers apply, and the defaults "
        "(lm_head, routers ...) do not (the recipe is applied as ``oneshot`` applies it). :class:`UsageError` for what ctconvert "
        "does not implement (another modifier, an argument, a calibrated scheme), named, and with ``scheme``, ``targets``, "
        "``ignore``, ``lm_head``, ``observer``, ``sparsity``, ``group_size``/``symmetric`` or ``kv_cache``.",
    ),
    _choice(
        "dense_dtype",
        "keep",
        _DENSE_DTYPES,
        "Cast the tensors that are not quantized (embeddings, norms, biases, a dense lm_head ...) to this dtype, "
        "like mlx_lm.convert --dtype; config.json's torch_dtype follows. keep: their stored dtype.",
        "``keep`` (stored dtypes), ``bf16``, ``fp16`` or ``fp32``: every floating tensor that is not quantized is written in that "
        "dtype (``torch.Tensor.to``, round to nearest even) and ``config.json``'s dtype says so (:mod:`ctconvert.plan.dense_dtype`); "
        "quantized weights are the bytes of a run without it. :class:`UsageError` for another value; :class:`BadInputError` (exit 3) "
        "naming file and tensor for a finite value beyond the target's range (fp32 -> fp16).",
    ),
    # calibration (schemes with static activation scales, --kv-cache)
    Option(
        "calibration",
        None,
        help="Calibration data: plain text, JSON lines with a 'text' field, or token ids (default: the built-in English corpus).",
        type="file",
        annotation="str | Path | None",
        doc="for schemes with static or W4A4 activation scales (``NVFP4``, ``FP8``, ``W8A8_STATIC``, ``W8A8_STATIC_ASYM``) and "
        "``kv_cache``: a text file, JSON lines with a ``text`` field, or token ids (:mod:`ctconvert.calibration.data`); None: the "
        "built-in English corpus.",
    ),
    Option(
        "calibration_samples",
        DEFAULT_CALIBRATION_SAMPLES,
        help="Calibration samples (rows of tokens).",
        type="int",
        show_default=True,
        annotation="int",
        doc="calibration samples (rows of tokens).",
    ),
    Option(
        "calibration_seq_len",
        DEFAULT_CALIBRATION_SEQ_LEN,
        help="Tokens per calibration sample.",
        type="int",
        show_default=True,
        annotation="int",
        doc="tokens per calibration sample.",
    ),
    Option(
        "calibration_batch_tokens",
        DEFAULT_CALIBRATION_BATCH_TOKENS,
        flags=None,
        annotation="int",
        doc="tokens run through the model at a time while calibrating (the same scales whatever it says).",
    ),
    _choice(
        "kv_cache",
        "none",
        ("none", "fp8", "fp8-head"),
        "FP8 KV cache with calibrated k_scale/v_scale: per tensor (fp8) or per KV head (fp8-head).",
        "``none``, ``fp8`` (calibrated per-tensor ``k_scale``/``v_scale``) or ``fp8-head`` (per KV head).",
    ),
    # the output
    Option(
        "max_shard_size",
        DEFAULT_SHARD_SIZE,
        help="Largest output shard (e.g. 5GB, 500MB).",
        show_default=True,
        annotation="str | int",
        doc='the largest output shard (``"5GB"``, ``"500MB"``, ``"2GiB"`` or bytes).',
    ),
    _flag("overwrite", "Replace an existing output folder (atomically, at the end).", "replace an existing output folder (atomically, at the end)."),
    _flag("dry_run", "Print the plan and exit without reading tensor data.", "make the plan (``result.plan``) and return without reading tensor data."),
    _flag(
        "resume",
        "Reuse the shards an interrupted run of the same command finished (checked by content hash).",
        "keep the shards an interrupted run of the same command finished (each checked against the xxh3-128 content hash journaled when it was written).",
    ),
    _flag(
        "refresh",
        "Against an existing output: re-derive only tensors whose source changed; rewrite only their shards.",
        "against an existing output, re-derive only the tensors whose source bytes changed and rewrite only their shards.",
    ),
    _flag(
        "keep_other_weights",
        "Also copy weights in other formats (*.bin, *.pth, original/, *.gguf ...).",
        "also copy weights in other formats (``*.bin``, ``*.pth``, ``original/``, ``*.gguf`` ...); by default they are left out and listed in the notes.",
    ),
    _flag(
        "allow_nonfinite",
        "Copy pass-through tensors holding NaN/inf (with a note) instead of failing.",
        "copy pass-through tensors (norms, embeddings, a dense ``lm_head``) that hold NaN/inf, with a note naming them; by default "
        "such a tensor is refused (:class:`BadInputError`, exit 3). Quantized weights with NaN/inf are always refused.",
        flags=("--allow-non-finite",),
        job_key="allow_non_finite",
    ),
    # kernel-native layout (quantize --target)
    Option(
        "target",
        None,
        help="Also repack into this kernel-native layout (see `ctconvert repack`). marlin-24 (with --sparsity 2:4 and W4A16) "
        "writes the compressed-tensors marlin-24 format, which vLLM <= 0.15 loads.",
        type="choice",
        choices=QUANTIZE_TARGETS,
        annotation="str | None",
        doc="write this kernel-native layout in the same pass (:func:`quantize_to_target`; not with ``resume``/``refresh``).",
    ),
    Option(
        "layout_version",
        DEFAULT_LAYOUT_VERSION,
        help=f"With --target: vLLM release whose layout to build  [default: {DEFAULT_LAYOUT_VERSION}]",
        cli_default=None,
        doc="with ``target``: the vLLM release whose layout to build.",
    ),
    Option(
        "act_dtype",
        DEFAULT_ACT_DTYPE,
        help=f"With --target: activation dtype  [default: {DEFAULT_ACT_DTYPE}]",
        type="choice",
        choices=_ACT_DTYPES,
        cli_default=None,
        doc="with ``target``: the activation dtype the kernel will run with (``bf16`` | ``fp16``).",
    ),
    # how it runs (the same bytes whatever these say)
    Option(
        "device",
        "auto",
        help="auto, cpu, cuda, cuda:N, cuda:0,1 or all (every GPU).",
        show_default=True,
        doc="``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``cuda:0,1`` or ``all`` (several GPUs share the work by fused set and tensor; the bytes are the same).",
    ),
    Option(
        "impl",
        "auto",
        flags=None,
        doc="quantizer implementation: ``auto`` (C kernels on the CPU, Triton on CUDA, when available), ``torch``, ``native`` or "
        "``triton``; the same bytes. ``CTCONVERT_NATIVE=0`` disables the C kernels.",
    ),
    Option(
        "lm_head_chunk_rows",
        DEFAULT_LM_HEAD_CHUNK_ROWS,
        help="Rows of lm_head processed at a time.",
        type="int>=1",
        show_default=True,
        annotation="int",
        doc="rows of lm_head processed at a time.",
    ),
    Option("chunk_elems", DEFAULT_CHUNK_ELEMS, flags=None, annotation="int", doc="elements per row chunk."),
    Option(
        "hold_bytes",
        DEFAULT_HOLD_BYTES,
        flags=None,
        annotation="int",
        doc="the largest NVFP4 fused set read once and held until its global scale is known (larger sets are read twice).",
    ),
    Option(
        "map_input",
        None,
        flags=None,
        annotation="bool | None",
        doc="on the CPU, read row chunks as views of the mapped input files (default: yes, unless ``CTCONVERT_MMAP=0``).",
    ),
    Option(
        "tp",
        1,
        help="Check that every tensor splits over this many tensor-parallel ranks.",
        type="int>=1",
        show_default=True,
        annotation="int",
        doc="the tensor-parallel degree to check the output for (:mod:`ctconvert.plan.parallel`): whether each rank's slice of every "
        "quantized tensor keeps whole groups, blocks, tiles and vocabulary rows. A dry run always reports the largest TP degree "
        "(``result.parallel``); a real run with ``tp > 1`` or ``ep`` notes what does not split.",
    ),
    Option(
        "ep",
        None,
        help="Check the MoE experts for this many expert-parallel ranks (then not split by --tp).",
        type="int>=1",
        annotation="int | None",
        doc="the expert-parallel degree to check the MoE experts for (then not split by ``tp``).",
    ),
    _choice(
        "executor",
        "local",
        ("local", "ray"),
        "Where the work runs: local (this machine) or ray (output shards as tasks on a Ray cluster; pip install 'ctconvert[ray]'). The same bytes.",
        "``local`` (this machine's devices) or ``ray``: Ray tasks on the cluster of ``ray_address`` convert the output shards, the same bytes "
        "(:mod:`ctconvert.pipeline.ray_executor`); ``result.nodes`` names the nodes. :class:`UsageError` without the ``ray`` extra or its cluster.",
    ),
    Option(
        "ray_address",
        None,
        help="With --executor ray: the cluster to join (HOST:6379, ray://HOST:10001, auto); default RAY_ADDRESS, else a local Ray instance.",
        annotation="str | None",
        doc='with ``executor="ray"``: the address ``ray.init`` joins (``HOST:6379``, ``ray://HOST:10001``, ``auto``); None: Ray\'s own '
        "default (``RAY_ADDRESS`` when set, else a new local Ray instance).",
    ),
    Option(
        "ray_keep_workers",
        0,
        help="With --executor ray: keep one converting worker per node (per GPU with --device cuda), its imports done, for this many "
        "seconds after its last task, so that the next run of any driver starts at once (0: none; kept workers hold their CPUs or GPU).",
        type="int",
        annotation="int",
        doc='with ``executor="ray"``: seconds a *resident* worker (a detached Ray actor per node, or per GPU with CUDA, Python, Ray, '
        "torch and the engine imported) stays after its last conversion, for the next run of any driver of the same ctconvert code "
        "(:mod:`ctconvert.pipeline.ray_residents`); 0: none, Ray tasks as before. A kept worker holds its resources meanwhile. "
        "The same bytes either way.",
    ),
)
#: every quantize option, in :class:`~ctconvert.pipeline.options.QuantizeOptions`' field order
OPTIONS: dict[str, Option] = {o.name: o for o in _QUANTIZE}

_OUTPUT = Option("output", None, help="Output folder (created; must not exist unless --overwrite).", type="path", flags=("-o", "--output"), field=False)
_OUTPUT_REQUIRED = _OUTPUT.but(help="Output folder.", required=True)
_SCHEME = Option(
    "scheme",
    None,
    help="compressed-tensors preset: FP8_DYNAMIC, FP8_BLOCK, W8A8, W4A16, W4A16_ASYM, W8A16, NVFP4A16, MXFP4A16, MXFP4, MXFP8A16, MXFP8, "
    "W4AFP8; calibrated: NVFP4, FP8, W8A8_STATIC, W8A8_STATIC_ASYM (DENSE: with --sparsity only); or a .json/.yaml file holding a "
    "compressed-tensors QuantizationScheme.",
    flags=("-s", "--scheme"),
    field=False,
)
_ALL_LAYERS = Option("all_layers", False, help="With --dry-run: list every tensor (default: each when <= 60, else a summary).", type="flag", field=False)
_O = OPTIONS

#: each command's options, in ``--help`` order (the arguments and the group's ``--json`` ... are the CLI's)
COMMANDS: dict[str, tuple[Option, ...]] = {
    "quantize": (
        _OUTPUT,
        _SCHEME,
        _O["sparsity"],
        _ALL_LAYERS,
        _O["group_size"],
        _O["symmetric"],
        _O["observer"],
        _O["recipe"],
        _O["lm_head"],
        _O["targets"],
        _O["ignore"],
        _O["max_shard_size"],
        _O["overwrite"],
        _O["dry_run"],
        _O["skip_incompatible"],
        _O["allow_unloadable"],
        _O["device"],
        _O["lm_head_chunk_rows"],
        _O["resume"],
        _O["refresh"],
        _O["target"],
        _O["layout_version"],
        _O["act_dtype"],
        _O["allow_nonfinite"],
        _O["keep_other_weights"],
        _O["tp"],
        _O["ep"],
        _O["calibration"],
        _O["calibration_samples"],
        _O["calibration_seq_len"],
        _O["kv_cache"],
        _O["keep_unclassified"],
        _O["default_ignore"],
        _O["quantize_mtp"],
        _O["dense_dtype"],
        _O["executor"],
        _O["ray_address"],
        _O["ray_keep_workers"],
    ),
    "inspect": (_ALL_LAYERS.but(help="List every layer (default: every layer when <= 60, else a summary per scheme)."),),
    "verify": (Option("reference", None, help="The dense source: compare every tensor with it.", type="path", field=False), _O["tp"], _O["ep"]),
    "decompress": (
        _OUTPUT_REQUIRED,
        Option(
            "dtype",
            None,
            help="Cast every float tensor to this dtype (and say so in config.json). "
            "Default: dequantized weights in the model's dtype, other tensors as stored.",
            type="choice",
            choices=("bf16", "fp16", "fp32"),
            field=False,
        ),
        _O["max_shard_size"].but(help=None),
        _O["overwrite"].but(help=None),
    ),
    "convert": (
        _OUTPUT,
        _SCHEME.but(help="The target, when not the source's own: NVFP4A16 for a ModelOpt NVFP4 source drops its input scales.", required=False),
        _O["max_shard_size"],
        _O["overwrite"],
        _O["dry_run"].but(help="Print the plan and exit without writing."),
    ),
    "repack": (
        _OUTPUT_REQUIRED,
        _O["target"].but(
            flags=("-t", "--target"),
            required=True,
            choices=REPACK_TARGETS,
            help="Kernel layout to build, or compressed-tensors to undo a repack. cutlass-2of4: the SM90 CUTLASS 2:4 tensors of vLLM <= 0.18; "
            "cutlass-2of4-sm80: PyTorch's SM80 semi-structured layout.",
        ),
        _O["layout_version"].but(
            cli_default=SAME,
            show_default=True,
            help=f"vLLM release whose layout to build ({', '.join(LAYOUT_VERSIONS[:-4:-1])} ... {LAYOUT_VERSIONS[0]}).",
        ),
        _O["act_dtype"].but(cli_default=SAME, show_default=True, help="Activation dtype the kernel will run with."),
        _O["device"].but(help="auto, cpu, cuda or cuda:N."),
        _O["max_shard_size"].but(help=None),
        _O["overwrite"].but(help=None),
    ),
    "batch": (
        Option("keep_going", False, help="Run every job even after one fails.", type="flag", field=False),
        _O["executor"].but(help="Run every job on this executor (local or ray) unless its executor key says otherwise.", cli_default=None, show_default=False),
        _O["ray_address"].but(help="With --executor ray: the cluster to join; default RAY_ADDRESS, else a local Ray instance."),
        _O["ray_keep_workers"].but(cli_default=None),
    ),
}


def click_spec(o: Option) -> tuple[tuple[str, ...], dict]:
    """``(declarations, keywords)`` of ``click.option`` for ``o``, but its ``type`` (the CLI builds the click type
    from ``o.type``, ``o.choices``): the flags, the parameter name, default, help and the rest."""
    kw: dict = {"help": o.help} if o.help is not None else {}
    if o.type == "flag" and "/" not in o.cli_flags[-1]:
        kw["is_flag"] = True  # off unless given (an inverted flag, given, sets its option to False)
    elif o.multiple:
        kw["multiple"] = True
    elif not (o.required or o.type == "path"):  # those have no default: click takes an explicit None as given
        kw["default"] = o.default if o.cli_default is SAME else o.cli_default
    if o.show_default:
        kw["show_default"] = True
    if o.required:
        kw["required"] = True
    return (*o.cli_flags, o.cli_name), kw


def job_keys() -> dict[str, str]:
    """``batch`` job key -> option name, for every quantize option (the CLI's spelling where it differs)."""
    return {o.job_key or o.name: o.name for o in OPTIONS.values()}


def api_doc(indent: str = "        ") -> str:
    """The per-option part of :func:`ctconvert.api.quantize`'s docstring: ``name (default value): doc`` for every option, in field order."""
    import textwrap

    entries = (f"{o.name} (default ``{o.default!r}``): {o.doc}" for o in OPTIONS.values())
    return "\n".join(textwrap.fill(e, width=116, initial_indent=indent, subsequent_indent=indent + "    ") for e in entries)
