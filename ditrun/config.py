"""The configuration schema: every key a ditrun run reads, with its type, default and meaning.

YAML files under ``ditrun/conf/`` only choose and override these values; an unknown key is an
error raised by Hydra when the config is composed, before any work starts.

Glossary (docs/GLOSSARY.md):

reference: the picture an edit starts from (Kontext's input image, diffusers' word): an edit's ``image``, sized by
    ``workload.ref_*``
full quality: the edit's output at BF16, no quantization, no step cache, layout ``single``, same seed and size: what
    every SSIM and verdict compares against (``metrics.full_quality_*``)
emulation: a quantized format's exact torch implementation, the definition its fast kernels are tested against
    (``precision.backend=emulation``)
held-out pictures: the pictures the trained editor never saw in training, on which it is judged (docs/EDITOR.md)
layout: how a job's ranks split the work: ``LayoutKind`` (one ``layout.name``), ``LayoutPlan`` (its degrees: replicas,
    CFG, SP, head groups), ``Placement`` (the plan and the node of each rank), ``Layout`` (the placement bound to one
    rank, with its process groups)
exchange shape: the geometry of one all-to-all's buffers (``ExchangeShape``)
plan: a decision made before the first edit, named by its type: ``LayoutPlan``, ``CompilePlan``, ``PrecisionPlan``
step cache: reuse of the DiT's block outputs across denoising steps (``cache=``)
compile cache: compiled code and graphs shared by jobs (``model.compile_cache``, ``ditrun warm``)
full-quality cache: the full-quality outputs kept between runs (``metrics.full_quality_dir``); the prompt cache keeps
    encoded prompts (``workload.prompt_cache_dir``)
tune: ``ditrun tune``: measure each linear's backends per shape and write the fastest to ``precision.tuning_file``;
    Inductor's own kernel tuning is ``model.compile_tuning``
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ditrun.editor import FOLDER as EDITOR_FOLDER
from ditrun.errors import UserError

RENAMED_KEYS = {
    f"metrics.reference_{name}": f"metrics.full_quality_{name}" for name in ("dtype", "dir", "steps", "true_cfg_scale")
}
"""Old key -> its name now (``reference`` is the Kontext input picture; the BF16 output is the full-quality one)."""


def take_renamed_keys(cfg, say: bool = False) -> None:
    """Move each old key's value in ``cfg`` (a config, or the plain data of a recorded run) to its name now; ``say``:
    one notice line per old key given. An old and a new name given different values is one sentence."""
    for old, new in RENAMED_KEYS.items():
        (group, old_leaf), new_leaf = old.split("."), new.split(".")[1]
        node = cfg.get(group) if hasattr(cfg, "get") else None
        if not hasattr(node, "get"):  # no such group, or a recorded file's that is not a mapping
            continue
        value, now = node.get(old_leaf), node.get(new_leaf)
        if old_leaf in node and new_leaf not in node:  # a run recorded before the rename
            node[new_leaf], node[old_leaf] = value, None
            continue
        if value is None:
            continue
        if now is not None and now != value:
            raise UserError(f"{old}={value} and {new}={now} disagree: {old} is {new}'s old name; give {new} only.")
        node[new_leaf], node[old_leaf] = value, None
        if say:
            print(f"ditrun: {old} is now {new}; read as it (rename it where you set it).", file=sys.stderr, flush=True)


# The option files of the config groups (``precision=fp8`` reads ``conf/precision/fp8.yaml``).
CONF_DIR = Path(__file__).resolve().parent / "conf"


@dataclass
class ModelConfig:
    """Which DiT to run: a named size preset, optionally with its geometry overridden, or a
    diffusers-format transformer folder."""

    preset: str = "tiny"
    """Size preset (``ditrun.model.presets.PRESETS``): ``tiny`` (CI), ``small`` (a CPU demo), ``editor`` (the
    geometry of ditrun's trained editor, which the default run loads: ``conf/model/editor.yaml``), ``flux-dev``
    (FLUX.1-dev / Kontext geometry). A config built from this schema alone, without a ``model=`` choice, gets
    ``tiny``."""
    path: Optional[str] = None
    """A diffusers ``FluxTransformer2DModel`` folder (``config.json`` + ``*.safetensors``), or a whole diffusers
    FLUX.1 (Kontext) pipeline folder (``model_index.json``, ``transformer/``, ``vae/``, text encoders and
    tokenizers: prompts are then encoded by its encoders, docs/WORKLOAD.md). When set, the transformer's
    ``config.json`` gives the geometry and the preset is ignored; unset means seeded random weights."""
    weights_seed: int = 0
    """Seed of the random weights used when ``path`` is unset; every rank draws the same weights."""
    variant: Optional[str] = None
    """Block variant: ``flux`` (GELU MLP, LayerNorm modulation) or ``krea3`` (SwiGLU MLP, sigmoid gate on
    the attention output, RMSNorm modulation). Unset takes the preset's."""
    num_layers: Optional[int] = None
    """Double-stream blocks; unset takes the preset's."""
    num_single_layers: Optional[int] = None
    """Single-stream blocks; unset takes the preset's."""
    num_attention_heads: Optional[int] = None
    """Attention heads; unset takes the preset's."""
    attention_head_dim: Optional[int] = None
    """Channels per head; unset takes the preset's."""
    joint_attention_dim: Optional[int] = None
    """Width of the text embeddings fed to ``context_embedder``; unset takes the preset's."""
    pooled_projection_dim: Optional[int] = None
    """Width of the pooled text embedding; unset takes the preset's."""
    guidance_embeds: Optional[bool] = None
    """Whether the model embeds a distilled guidance value (FLUX.1-dev does); unset takes the preset's."""
    dtype: str = "auto"
    """Compute dtype: ``auto`` (bf16 on GPUs, fp32 on CPUs), ``bf16``, ``fp16`` or ``fp32``."""
    compile: str = "auto"
    """Regional ``torch.compile`` of the blocks (``model/compile.py``): ``auto`` (on for GPUs), ``on``, ``off``."""
    compile_backend: str = "inductor"
    """``torch.compile``'s backend: ``inductor`` (fused kernels: the fast one), or a debugging backend such as
    ``aot_eager`` (traces and checks the graphs, runs them eagerly: finds a graph break without codegen)."""
    fuse: str = "auto"
    """Stack the linears that read one input into one GEMM: ``auto`` (when compiled), ``on``, ``off``."""
    compile_tuning: bool = False
    """Let inductor tune its generated kernels' tile sizes (coordinate descent; GPUs only): a few % faster blocks,
    a much longer first compile (docs/PERFORMANCE.md#start-up), cached for later processes.
    ``precision=fp8_all`` sets it."""
    compile_cache: Optional[str] = "auto"
    """A folder of compiled code shared by jobs (``run/compile_cache.py``): a compiled run loads the entry of its
    key before compiling, and global rank 0 writes it after its first edit, so a later job (any node, any rank)
    finds the blocks compiled. ``auto``: ``$XDG_CACHE_HOME/ditrun/compile`` (``~/.cache/ditrun/compile``); on a
    cluster, a folder on shared storage; ``off`` or ``null``: none (Inductor's own cache on the node only)."""
    compile_cache_trust: list[str] = field(default_factory=list)
    """Who besides you and root may have written the compile cache's entries that this run loads (they are code it
    runs): user names (or ids) and at most one ``group:<name>``, whose members are trusted and which may write the
    entries and the folder (``ditrun/trust.py``, docs/COMPILE_CACHE.md#trust-what-a-run-loads-as-code). Entries this run
    writes are readable by them (0640 and the group's; 0644 for users alone; 0600 when empty). An entry anyone else
    could have written is set aside with a warning and the run compiles as without it."""
    cuda_graphs: str = "auto"
    """Replay the DiT's forward from CUDA graphs (``model/graphs.py``): ``auto`` (on for compiled GPU models),
    ``on``, ``off``. Only forwards that exchange nothing inside are graphed (layout ``single``, or CFG layouts
    with one worker per branch); one graph per input shape, captured at its first call."""


@dataclass
class LayoutConfig:
    """How the workers of one model replica share a denoising step (README.md#parallel-layouts, docs/LAYOUTS.md)."""

    name: str = "single"
    """``single``, ``ulysses``, ``cfg_batch`` or ``cfg_split`` (``ditrun.parallel.layout.LAYOUTS``)."""
    replicas: int = 1
    """Data-parallel replicas; the world size must be ``replicas`` x workers per replica."""
    head_groups: int = 1
    """Split the heads into this many groups so one group's exchange overlaps another's attention."""
    allow_cross_node_sp: bool = False
    """Let an SP group span nodes. Off, a layout whose SP group would have ranks on two nodes is refused
    before any model is built (docs/LAYOUTS.md); on, its exchanges cross the network (``copy_engine`` sends
    to off-node peers through the collective library)."""


@dataclass
class PrecisionConfig:
    """Numeric format per model component (docs/PRECISION.md). The allowed names are the registries'
    (``ditrun.kernels.linear.LINEAR_FORMATS``, ``ditrun.kernels.attention.ATTENTION_KERNELS``)."""

    name: str = "bf16"
    """The preset chosen (the file under ``conf/precision/``); records name what actually ran."""
    mlp: str = "bf16"
    """MLP linears (and the single blocks' fused ``proj_out``): ``bf16`` (not quantized), ``fp8``, ``mxfp8``,
    ``mxfp6``, ``mxfp6_e3m2``, ``mxfp4``."""
    qkv: str = "bf16"
    """Q/K/V (and gate) projections, stacked into one GEMM when quantized: same choices as ``mlp``."""
    out: str = "bf16"
    """Attention output projections: same choices as ``mlp``."""
    attention: str = "bf16"
    """Attention itself: ``bf16`` (SDPA, not quantized), ``fp8_pv`` (Q, K, V and P in FP8: cuDNN's and AITER's
    fused FP8 kernels), ``int8qk`` (INT8 Q/K, V in the compute dtype), ``int8qk_fp8v``, ``int8qk_mxfp6v``."""
    quantized_exchange: bool = True
    """With a quantized ``attention`` and an SP group of more than one rank, each rank quantizes its own tokens'
    Q, K and V before the all-to-all, which then carries codes and scales (docs/TRANSPORT.md); ``false`` exchanges
    them in the model dtype and quantizes after (the comparison: the same outputs, more bytes). No effect on
    ``bf16`` attention."""
    quantizer: str = "compiled"
    """How a compiled block quantizes FP8 linears' activations: ``compiled`` (torch arithmetic traced into the
    block's graph, fused by Inductor into the kernel that makes the activation) or ``kernel`` (an FP8 down
    projection's input [attention output | activation(hidden)] by ditrun's Triton kernel, one kernel; the rest as
    ``compiled``). The same numbers either way, up to the activation's fp32 rounding (docs/PRECISION.md)."""
    backend: str = "auto"
    """``auto`` (the tuned or preferred fast backend where the device has one, else the exact emulation,
    said once), ``emulation`` (always), ``fast`` (fast backends only: an error before any GPU work if a
    format has none here)."""
    scale_mode: str = "rceil"
    """MX block scales: ``rceil`` (round the needed scale up; NVIDIA, cuDNN, AITER) or ``floor`` (OCP v1.0)."""
    tuning_file: Optional[str] = None
    """The dispatch table written by ``ditrun tune``; unset means ``$XDG_CACHE_HOME/ditrun/dispatch.json``."""


@dataclass
class TransportConfig:
    """How the all-to-all of sequence-parallel attention moves data."""

    name: str = "collective"
    """A name in ``ditrun.transport.registry.TRANSPORTS``: ``collective`` (NCCL/RCCL/gloo
    ``all_to_all_single``) or ``copy_engine`` (per-peer one-sided copies; docs/LAYOUTS.md)."""
    timeout_s: Optional[float] = None
    """``copy_engine``: seconds any wait for a peer may take before the run fails naming that peer;
    unset means ``launcher.collective_timeout_s``."""
    node_size: int = 0
    """``copy_engine``: peers on another node go through the collective; 0 takes the nodes the rendezvous
    found (``parallel/placement.py``), N > 0 treats each N consecutive ranks of the run as one node, for
    the copy engine only (tests of the mixed path)."""


@dataclass
class CacheConfig:
    """Step caching (docs/CACHE.md): on the steps it caches, only the first ``blocks`` blocks run and the rest's
    last residual is reused. The names are ``ditrun.cache.CACHE_POLICIES``."""

    name: str = "none"
    """``none`` (every step runs every block), ``first_block`` (the first blocks' residual decides, per step and
    CFG branch) or ``static`` (the steps given below compute, whatever the weights)."""
    blocks: int = 1
    """Blocks run on every step (double-stream blocks first, then single-stream ones); ``first_block``: their
    residual decides. ``static`` allows 0 (a cached step then runs no block). Fewer than the model's blocks: a
    cached step skips the others."""
    threshold: float = 0.08
    """``first_block``: the rest runs when the first blocks' residual changed by at least this much (relative L1,
    summed over the SP group's tokens) since the last computed step; 0 computes every step."""
    warmup_steps: int = 1
    """``first_block``: the first steps always compute."""
    max_cached: Optional[int] = None
    """``first_block``: at most this many cached steps in a row; unset means no cap."""
    extrapolate: bool = False
    """Reuse the rest's residual extrapolated linearly from the last two computed steps (TaylorSeer's first
    order) instead of as it was."""
    compute_first: int = 1
    """``static``: the first steps that compute (step 0 always does)."""
    compute_last: int = 1
    """``static``: the last steps that compute."""
    compute_every: int = 2
    """``static``: between them, every this-many-th step computes, counted from ``compute_first``."""
    compute_steps: Optional[list[int]] = None
    """``static``: the steps that compute (0-based, with 0), instead of the three keys above."""


@dataclass
class EditConfig:
    """One edit of a workload: a reference image, a prompt and a seed."""

    id: str = ""
    """Name of the edit; also the stem of its output PNG."""
    image: str = ""
    """A picture shipped in a package (``skimage:<name>``, a function of skimage.data, a stereo pair's left view;
    ``matplotlib:<file>`` in matplotlib's sample_data; ``sklearn:<file>``, a scikit-learn sample image), or a path to
    an image file."""
    prompt: str = ""
    """The instruction: encoded by the text encoders of a diffusers pipeline folder (``model.path``), or
    the seed of a stand-in embedding; a ``prompt_embeds`` file takes precedence."""
    prompt_embeds: Optional[str] = None
    """A safetensors file with ``prompt_embeds`` [L, D] or [1, L, D] and ``pooled_prompt_embeds`` [P] or
    [1, P] (and optionally ``negative_prompt_embeds`` / ``negative_pooled_prompt_embeds`` of the same forms);
    D and P are the model's ``joint_attention_dim`` and ``pooled_projection_dim``."""
    seed: Optional[int] = None
    """Noise seed (0 to 2**64 - 1); unset means ``workload.seed`` + the edit's index."""
    width: Optional[int] = None
    """Output width in pixels (multiple of 16); unset means ``workload.width``."""
    height: Optional[int] = None
    """Output height in pixels (multiple of 16); unset means ``workload.height``."""
    ref_width: Optional[int] = None
    """Reference width in pixels (multiple of 16, set together with ``ref_height``); unset means
    ``workload.ref_width``, and when both are unset ``ref_resize`` decides."""
    ref_height: Optional[int] = None
    """Reference height in pixels (multiple of 16, set together with ``ref_width``)."""
    target: Optional[str] = None
    """The edit's correct result, when it is known: an edit of ``ditrun.editor.transforms.EDITS`` (``mirror``,
    ``grayscale``, ...: that transform of the reference at the output's size) or an image file (resized to the
    output's size). Records then carry ``ssim_target`` (the output against it) and ``ssim_target_bf16`` (the BF16
    reference's output against it)."""


@dataclass
class WorkloadConfig:
    """The edits to run and how each is sampled."""

    name: str = "default"
    """A label for reports."""
    edits: list[EditConfig] = field(default_factory=list)
    """The edits, inline. Ignored when ``manifest`` is set."""
    manifest: Optional[str] = None
    """A YAML (a list, or a mapping with ``edits:``) or JSONL file of edits with the keys of ``EditConfig``."""
    limit: Optional[int] = None
    """Run only the first N edits (a positive integer); unset runs them all."""
    width: int = 256
    """Default output width in pixels (multiple of 16)."""
    height: int = 256
    """Default output height in pixels (multiple of 16)."""
    steps: int = 8
    """Denoising steps per edit (at least 1)."""
    ref_width: Optional[int] = None
    """Default reference width in pixels (multiple of 16, with ``ref_height``); unset lets ``ref_resize`` decide."""
    ref_height: Optional[int] = None
    """Default reference height in pixels (multiple of 16, with ``ref_width``)."""
    ref_resize: str = "output"
    """Size of a reference without ``ref_width``/``ref_height``: ``output`` (the edit's output size),
    ``kontext`` (the preferred Kontext resolution of the closest aspect ratio, then rounded down to
    multiples of 16: diffusers' ``FluxKontextPipeline`` default) or ``none`` (the image's own size
    rounded down to multiples of 16: diffusers' ``_auto_resize=False``)."""
    true_cfg_scale: float = 2.5
    """True classifier-free guidance scale, diffusers' ``true_cfg_scale``: above 1 every step runs a
    conditional and an unconditional branch; at 1 or below only the conditional one (as diffusers)."""
    guidance_scale: float = 3.5
    """Value fed to the guidance embedding of guidance-distilled models, diffusers' ``guidance_scale``
    (ignored by models without one)."""
    seed: int = 0
    """Base noise seed (0 to 2**64 - 1)."""
    text_len: Optional[int] = None
    """Prompt tokens: diffusers' ``max_sequence_length`` (T5 tokens) when a pipeline folder encodes the prompts, else
    the stand-in embedding's length (at least 1; an embeddings file brings its own length). Unset: the model's
    (``model.folders.model_text_len``: a pipeline folder's T5 tokenizer's ``model_max_length`` up to 512, as the
    editor's folder records the 32 it was trained with; else diffusers' default 512; 32 for stand-in prompts)."""
    text_len_from: Optional[str] = None
    """Set by ditrun when it resolves ``text_len``: where the number came from (this key, the folder's tokenizer,
    diffusers' default, the stand-in length). Recorded in the run's config; a value given here is replaced."""
    vae_path: Optional[str] = None
    """A diffusers ``AutoencoderKL`` folder; unset uses a pipeline folder's ``vae/`` (``model.path``), else
    the fixed linear RGB<->latent map."""
    prompt_cache_dir: Optional[str] = None
    """Cache of prompts encoded by a pipeline folder's text encoders; unset means
    ``$XDG_CACHE_HOME/ditrun/prompts`` (``~/.cache/ditrun/prompts``)."""


@dataclass
class FaultConfig:
    """Failure injection, for testing that a crash never hangs the job."""

    crash_rank: Optional[int] = None
    """Global rank that raises an error on purpose."""
    crash_at_step: int = 0
    """Denoising step (of the first edit it runs) at which ``crash_rank`` fails and ``freeze_rank`` freezes."""
    freeze_rank: Optional[int] = None
    """Global rank that stops itself (SIGSTOP: alive, silent, its connections open) at ``crash_at_step``."""
    hang_rank: Optional[int] = None
    """Global rank that hangs (sleeps, forever) once its edits are done, as a stuck rank would."""
    pause_in: Optional[str] = None
    """A phase a rank works through alone (``prompts``, ``references``, ``build``, ``compile``) in which
    ``pause_rank`` says ``paused in <phase>`` and then sleeps, as a phase of hours would compute; a stop ends it."""
    pause_rank: Optional[int] = None
    """Global rank that ``pause_in`` holds; unset: every rank that enters the phase."""


@dataclass
class TestingConfig:
    """Settings for ditrun's own tests, not for users: failure injection and transport delays. A rerun may change
    them (``results/rundir.py``'s ``MAY_DIFFER``); the user's listings (README, docs) leave them out."""

    fault: FaultConfig = field(default_factory=FaultConfig)
    """Failure injection (``launch/faults.py``)."""
    chaos_s: float = 0.0
    """``transport=copy_engine`` on CPUs: a random delay of up to this many seconds before each copy."""


@dataclass
class LauncherConfig:
    """Where the workers run."""

    name: str = "local"
    """A label: ``local`` spawns ``world`` processes here unless already under torchrun/srun/mpirun."""
    world: int = 1
    """Total workers (all replicas, all groups)."""
    rendezvous_timeout_s: float = 120.0
    """Seconds to wait for all ranks to join before failing with the ranks that did not arrive."""
    collective_timeout_s: float = 60.0
    """Seconds any single collective may take before the job is failed instead of hanging; also how long a
    rank may go without finishing a denoising step while the others wait for it at the end of the run."""
    stop_timeout_s: float = 30.0
    """After a stop signal reached ditrun's own spawner, or a rank's parent process died: seconds the ranks
    get to stop at a step boundary before they are killed."""
    master_port: Optional[int] = None
    """Rendezvous port; unset derives one from the job id (or picks a free one locally)."""


@dataclass
class MetricsConfig:
    """What is measured and reported (see docs/METRICS.md)."""

    warmup_edits: int = 1
    """Edits left out of the timing medians (compilation, allocator warm-up)."""
    transfer_breakdown: bool = False
    """Also record exposed transfer seconds per layer kind and per head group in each edit's record."""
    ssim: bool = True
    """Compute SSIM of every edit against its full-quality output (BF16, no cache; the same edit, seed and size;
    layout ``single``), and of a second full-quality run (``ssim_rerun``)."""
    full_quality_dtype: Optional[str] = None
    """Compute dtype of the full-quality runs: ``bf16``, ``fp16`` or ``fp32``; unset uses the run's own
    (``model.dtype``, so ``auto`` gives bf16 on GPUs and fp32 on CPUs)."""
    full_quality_dir: Optional[str] = None
    """Cache of full-quality outputs, shared by runs; unset means ``$XDG_CACHE_HOME/ditrun/references``
    (``~/.cache/ditrun/references``)."""
    min_ssim_pct: Optional[float] = None
    """Fail the run (exit status 1) when its quality (``metrics.quality``) is below this percentage of the BF16 run's
    own; also the target a sweep report's choice must meet (unset there: ``metrics.quality.DEFAULT_TARGET_PCT``)."""
    quality: str = "auto"
    """What judges quality (``ditrun.metrics.quality.QUALITY_MEASURES``): ``target`` (PSNR against each edit's
    correct result as a share of the full-quality reference's, with no fewer edits beating every naive candidate),
    ``rerun`` (``ssim_pct_of_rerun``), ``bf16`` (SSIM against the BF16 output), or ``auto``: ``target`` when the
    workload names correct results, else ``rerun`` (docs/METRICS.md)."""
    full_quality_steps: Optional[int] = None
    """Denoising steps of the full-quality output every verdict compares against (BF16, no cache); unset: the
    run's own ``workload.steps``, or in a Hydra sweep that varies ``workload.steps``, the sweep's largest."""
    full_quality_true_cfg_scale: Optional[float] = None
    """True CFG scale of the full-quality output; unset: the run's own ``workload.true_cfg_scale``, or in a Hydra
    sweep that varies it, the sweep's largest."""
    reference_dtype: Optional[str] = None
    """The old name of ``full_quality_dtype`` (``RENAMED_KEYS``): read as it, with a one-line notice."""
    reference_dir: Optional[str] = None
    """The old name of ``full_quality_dir``."""
    reference_steps: Optional[int] = None
    """The old name of ``full_quality_steps``."""
    reference_true_cfg_scale: Optional[float] = None
    """The old name of ``full_quality_true_cfg_scale``."""
    report: bool = True
    """Write ``report.md`` and its charts into the run directory when the run ends (and into the sweep
    directory when a multirun ends)."""


@dataclass
class WandbConfig:
    """Weights & Biases logging: one W&B run per ditrun run, written by global rank 0 only."""

    mode: str = "offline"
    """``offline`` (written under the run directory's ``wandb/``, nothing leaves the machine; upload later
    with ``wandb sync``), ``online`` or ``disabled``."""
    project: str = "ditrun"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team); unset uses the account default."""
    group: Optional[str] = None
    """W&B group; unset means the Hydra sweep directory's name in a multirun, and no group otherwise."""
    name: Optional[str] = None
    """W&B run name; unset means ``<layout>-<precision>-<transport>-w<world>`` (plus the sweep job number)."""
    tags: list[str] = field(default_factory=list)
    """Extra tags, added to ``precision:<name>`` and ``transport:<name>``."""
    images: int = 4
    """Log output, reference and SSIM-map images for this many first edits (0 logs none)."""


@dataclass
class WarmConfig:
    """What ``ditrun warm`` compiles into the compile cache: one forward per shape, no edit (docs/COMPILE_CACHE.md)."""

    enabled: bool = False
    """Set by ``ditrun warm``: every rank of the job compiles the shapes below into ``model.compile_cache``'s entries,
    then the job ends (a Slurm job or sweep warms by passing ``warm.enabled=true``)."""
    sizes: list[Any] = field(default_factory=list)
    """Shapes to warm, each ``[width, height]`` (the output's; its reference sized as the workload sizes an edit's:
    ``workload.ref_width``/``ref_height``, else ``workload.ref_resize``) or ``[width, height, ref_width,
    ref_height]``, in pixels, multiples of 16. Empty, with no ``preset``: the shapes of the workload's edits."""
    preset: Optional[str] = None
    """A named list of output sizes warmed besides ``sizes``: ``kontext`` (the resolutions FLUX.1 Kontext was
    trained at, ``workload.images.KONTEXT_RESOLUTIONS``)."""


@dataclass
class RunConfig:
    """A whole ditrun run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    testing: TestingConfig = field(default_factory=TestingConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    device: str = "auto"
    """``auto`` (the local GPU when there is one, else the CPU), ``cuda`` or ``cpu``."""
    output_dir: Optional[str] = None
    """Where results go; unset means Hydra's run directory."""
    progress: bool = True
    """Show progress on rank 0: bars on a terminal; in a log, a line every 30 s while a phase lasts longer."""


def register_configs() -> None:
    """Register the schema so that ``conf/config.yaml`` and every group file are type-checked."""
    cs = ConfigStore.instance()
    cs.store(name="ditrun_schema", node=RunConfig)
    # conf/model/editor.yaml's model.path: the trained editor's folder inside the installed package.
    OmegaConf.register_new_resolver("ditrun.editor_folder", lambda: str(EDITOR_FOLDER), replace=True)


def precision_presets() -> list[str]:
    """The names ``precision=`` takes: the option files of ``conf/precision/``."""
    return sorted(f.stem for f in (CONF_DIR / "precision").glob("*.yaml"))


def precision_preset(name: str) -> Optional[dict]:
    """The ``precision.*`` keys that preset ``name`` sets (None if there is no such preset). A preset that sets
    keys of other groups too is in the global package, its precision keys under ``precision:``."""
    file = CONF_DIR / "precision" / f"{name}.yaml"
    if not file.is_file():
        return None
    preset = yaml.safe_load(file.read_text())
    return preset.get("precision", preset)
