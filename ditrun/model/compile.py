"""Making the built model fast on GPUs: fusion, regional compilation (``model.compile``), CUDA graphs.

Three transforms, applied after the weights are loaded and quantized (``model/build.py``); the first two are
``model.fuse``:

* **GEMM epilogues** (``fuse_epilogues``, first): a GELU MLP of plain linears applies its
  activation in its input projection's GEMM (``GeluLinear``, cuBLASLt's GELU epilogue), and a
  single-stream block's output projection runs as two GEMMs into one output (``JoinedLinear``),
  so neither the activation's input nor the joined [attention, MLP] tensor is written
  (``kernels/epilogue.py``). Measured on a 20992-token Flux forward:
  docs/PERFORMANCE.md#ditrun-against-diffusers-one-forward.
* **stacking** (``fuse_projections``): linears that read the same input become one GEMM. Per
  attention stream, Q, K, V (and the gate) -> one ``StackedLinear`` (quantized models already
  stack them, ``model/quantize.py``); in a single-stream block whose MLP kept its activation
  (SwiGLU), Q, K, V and the MLP's input projection -> one GEMM reading the modulated input once.
  Only unquantized linears are fused here: a quantized stack is quantized once already, and
  fusing an MLP of one format with projections of another would need one format for both.
* **regional compilation** (``compile_regions``): every block's two halves around the attention
  call (``pre_attention``: modulation, projections, QK-norm, RoPE; ``post_attention``: output
  projection, residuals, MLP) go through ``torch.compile(fullgraph=True)``. Inductor then fuses
  what the profile says is the memory-bound rest (norm + modulation, RoPE + QK-norm, GELU +
  the down projection's input quantization, the quantizers into their producers). One code
  object per block class, so the 19 double and 38 single blocks share one graph each (per
  input shape). The attention call stays eager between the halves, so every layout and
  transport (their all-to-alls, copy engines and streams) runs unchanged inside a compiled
  model, and the custom attention kernels are ``torch.library.custom_op``s either way.

``model.cuda_graphs`` is decided here too (``CompilePlan.graphs``) and applied where the model is
called: ``model/graphs.py`` replays the forward from CUDA graphs (``BuiltModel.forward``).

Compiled code is checked against the eager model in tests (CPU inductor) and in
``benchmarks/vs_diffusers.py`` (GPU). Inductor's FX-graph and autotuning caches persist across
processes (``TORCHINDUCTOR_CACHE_DIR``, and Triton's kernels in ``TRITON_CACHE_DIR``), so only the first
process on a node pays the full compile, and ``model.compile_cache`` (``run/compile_cache.py``)
carries them to every node. Both folders hold code that runs as the user, so ``claim_compiler_caches`` puts
them under the user's own cache before anything compiles (not Inductor's default ``/tmp/torchinductor_<user>``,
a fixed name that another user may make first), or checks the ones the user set. The warm-up edits
(``metrics.warmup_edits``) carry the compile, and the summary reports it apart (``warmup_excess_s``, and
``compile_s`` among the start-up's parts).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ditrun.errors import UserError
from ditrun.model.dit import (
    DoubleStreamBlock,
    FluxDiT,
    GeluLinear,
    JoinedLinear,
    Regions,
    SingleStreamBlock,
    StackedLinear,
    gelu_activation,
    no_activation,
)
from ditrun.trust import Untrusted, private_folder
from ditrun.user_cache import user_cache_dir

COMPILE_MODES = {
    "auto": "on for GPUs, off on CPUs (where compiling costs more than it saves at test sizes)",
    "on": "compile the blocks' regions (inductor); on CPUs too",
    "off": "eager PyTorch",
}
GRAPH_MODES = {
    "auto": "on for compiled models on GPUs",
    "on": "on (needs a GPU)",
    "off": "launch every kernel from Python",
}
FUSE_MODES = {
    "auto": "fuse when the model is compiled",
    "on": "fuse (also in eager mode)",
    "off": "keep every linear separate (bitwise diffusers' eager computation)",
}
RECOMPILE_LIMIT = 64
"""Compiled graphs kept per block class: one per distinct input shape (an edit's output and reference
sizes), so a workload of many sizes never falls back to eager silently (PyTorch's default is 8)."""


@dataclass(frozen=True)
class CompilePlan:
    """The checked ``model.compile`` / ``model.fuse`` keys for this device."""

    compile: bool
    fuse: bool
    backend: str = "inductor"
    """``torch.compile``'s backend (``model.compile_backend``)."""
    tuning: bool = False
    """Inductor's coordinate-descent tuning of its kernels (``model.compile_tuning``)."""
    graphs: bool = False
    """The forward replayed from CUDA graphs (``model.cuda_graphs``, ``model/graphs.py``)."""
    guard: Optional[Callable[[Callable[[], Callable]], Optional[Callable]]] = field(
        default=None, compare=False, repr=False
    )
    """What runs each compilation (given as a function of no arguments): the run's ``Run.compile_guarded``
    (``run/worker.py``), which compiles inside ``solo("compile")`` and gives None when a stop signal ended it;
    None compiles unguarded."""

    @property
    def label(self) -> str:
        if self.compile:
            label = "compiled" if self.backend == "inductor" else f"compiled ({self.backend})"
            label = f"{label}, tuned" if self.tuning else label
        else:
            label = "eager+fused" if self.fuse else "eager"
        return f"{label}, CUDA graphs" if self.graphs else label


INDUCTOR_CACHE_ENV, TRITON_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"


def claim_compiler_caches() -> dict[str, Path]:
    """Inductor's and Triton's cache folders for this process, only this user's to write (``trust.private_folder``):
    the ones ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` name, else ``<user cache>/inductor`` and its
    ``triton`` (made 0700), set in the environment so that both compilers (and this process's ranks) use them. Runs
    before anything compiles, in every process that does. One sentence naming the variable when a folder another
    user could have written would hold the code: refused rather than replaced, since the user named it."""
    inductor = Path(os.environ.get(INDUCTOR_CACHE_ENV) or _default_inductor_folder())
    folders = {
        INDUCTOR_CACHE_ENV: inductor,
        TRITON_CACHE_ENV: Path(os.environ.get(TRITON_CACHE_ENV) or inductor / "triton"),
    }
    for variable, folder in folders.items():
        said = f"{variable}={os.environ[variable]}" if os.environ.get(variable) else f"ditrun's {variable} ({folder})"
        try:
            folders[variable] = private_folder(folder)
        except Untrusted as why:
            raise UserError(
                f"{said} is a folder another user could have written ({why}), and the compilers run the code they "
                f"find there as you; name a folder only you can write, or remove or chmod go-w this one."
            ) from None
        except OSError as err:
            raise UserError(f"{said} cannot be made or read ({err}); name a folder only you can write.") from None
        os.environ[variable] = str(folders[variable])
    _guard_inductor_default_folder()
    return folders


def _default_inductor_folder() -> Path:
    """``<user cache>/inductor``; where that cannot be written (a full or read-only disk, a HOME that is unset or not
    this user's), a private temporary folder removed at exit, with one warning: compiled code is then not kept."""
    try:
        folder = user_cache_dir() / "inductor"
        private_folder(folder)  # made 0700 where missing
        if os.access(folder, os.W_OK | os.X_OK):
            return folder
        problem = f"{folder} is not writable"
    except Untrusted:
        return folder  # refused in one sentence by the caller, never replaced
    except (OSError, RuntimeError) as err:  # RuntimeError: no HOME and no home in the password database
        problem = str(err)
    temporary = Path(tempfile.mkdtemp(prefix="ditrun-inductor-"))
    atexit.register(shutil.rmtree, temporary, True)
    print(
        f"ditrun: warning: the compilers' cache cannot be kept in the user's cache ({problem}); this process uses "
        f"{temporary} (set {INDUCTOR_CACHE_ENV} or XDG_CACHE_HOME to keep compiled code between runs)",
        file=sys.stderr,
        flush=True,
    )
    return temporary


def _guard_inductor_default_folder() -> None:
    """Inductor keeps its precompiled C++ headers (included in every CPU kernel it builds) in its default folder,
    ``/tmp/torchinductor_<user>``, whatever ``TORCHINDUCTOR_CACHE_DIR`` says: that folder is made this user's (0700)
    where missing, and where another user could have written it, the headers are off for this process (one
    warning naming it, its owner and its mode) rather than read from there."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    try:
        private_folder(Path(default_cache_dir()))
    except (Untrusted, OSError) as why:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_cache_precompile_headers = False
        inductor_config.aot_inductor.precompile_headers = False
        print(
            f"ditrun: warning: Inductor's precompiled C++ headers are off: it keeps them in {why}, whatever "
            f"{INDUCTOR_CACHE_ENV} says",
            flush=True,
        )


def _mode(model_cfg, key: str, modes: dict[str, str]) -> str:
    """``model.<key>`` (default ``auto``), one of ``modes``; one sentence naming the key when it is not."""
    value = str(getattr(model_cfg, key, "auto"))
    if value not in modes:
        raise UserError(f"model.{key}={value!r} is unknown; allowed: {', '.join(modes)}.")
    return value


def plan_compile(model_cfg, device: torch.device) -> CompilePlan:
    """One sentence naming the key when a value is unknown; ``auto`` resolved for ``device``."""
    compile_key = _mode(model_cfg, "compile", COMPILE_MODES)
    fuse_key = _mode(model_cfg, "fuse", FUSE_MODES)
    compiled = compile_key == "on" or (compile_key == "auto" and device.type == "cuda")
    fused = fuse_key == "on" or (fuse_key == "auto" and compiled)
    backend = str(getattr(model_cfg, "compile_backend", "inductor"))
    if compiled and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UserError(
            f"model.compile_backend={backend!r} is not a torch.compile backend here; allowed: "
            f"{', '.join(torch._dynamo.list_backends())} (and debugging ones such as aot_eager)."
        )
    # Coordinate descent tunes inductor's Triton kernels: GPUs only.
    tuning = bool(getattr(model_cfg, "compile_tuning", False)) and backend == "inductor" and device.type == "cuda"
    graphs_key = _mode(model_cfg, "cuda_graphs", GRAPH_MODES)
    if graphs_key == "on" and device.type != "cuda":
        raise UserError(f"model.cuda_graphs=on needs a GPU, and device is {device.type}; allowed here: auto, off.")
    graphs = graphs_key == "on" or (graphs_key == "auto" and compiled and device.type == "cuda")
    return CompilePlan(compiled, fused, backend, tuning, graphs)


def apply_plan(model: FluxDiT, plan: CompilePlan, attention: Optional[Callable] = None) -> dict[str, int]:
    """Fuse and compile ``model`` in place as ``plan`` says (``attention``: see ``compile_regions``);
    returns what was done, for the records."""
    done = {"gelu_epilogues": fuse_epilogues(model) if plan.fuse else 0}
    done |= {"fused_linears": fuse_projections(model) if plan.fuse else 0, "compiled_blocks": 0}
    if plan.compile:
        done["compiled_blocks"] = compile_regions(model, attention, plan.backend, plan.tuning, plan.guard)
    return done


# ---------------------------------------------------------------------------------------------
# Fusion


def _plain(linears: list[Optional[nn.Module]]) -> Optional[list[nn.Linear]]:
    """The present linears, when every one is an unquantized ``nn.Linear`` with a bias; else None."""
    present = [linear for linear in linears if linear is not None]
    if not present or any(type(linear) is not nn.Linear or linear.bias is None for linear in present):
        return None
    return present


def _stack_attention(block: nn.Module) -> int:
    """Q, K, V (and gate) of each stream -> ``attn.stacked[stream]``; returns the linears stacked."""
    attn, count = block.attn, 0
    for stream, text in (("image", False), ("text", True)):
        if stream in attn.stacked or (text and not hasattr(attn, "add_q_proj")):
            continue
        linears = _plain(attn.linears(text))
        if linears is None:
            continue
        attn.stacked[stream] = StackedLinear(linears)
        for name in (
            ("add_q_proj", "add_k_proj", "add_v_proj", "add_gate") if text else ("to_q", "to_k", "to_v", "to_gate")
        ):
            setattr(attn, name, None)
        count += len(linears)
    return count


def _fuse_single(block: SingleStreamBlock) -> int:
    """Q, K, V (and gate) and ``proj_mlp`` of a single-stream block -> ``block.fused_in``."""
    if block.fused_in is not None or "image" in block.attn.stacked:
        return 0
    linears = _plain([*block.attn.linears(text=False), block.proj_mlp])
    if linears is None or linears[-1] is not block.proj_mlp:
        return 0
    block.fused_in = StackedLinear(linears)
    for name in ("to_q", "to_k", "to_v", "to_gate"):
        setattr(block.attn, name, None)
    block.proj_mlp = None
    return len(linears)


def fuse_epilogues(model: FluxDiT) -> int:
    """GELU MLPs of plain linears -> ``GeluLinear`` input projections, and ``JoinedLinear`` output projections in
    single-stream blocks (see the module doc); returns the MLPs changed. SwiGLU MLPs are left as they are."""
    count = 0
    for block in model.single_transformer_blocks:
        if block.activation is gelu_activation and block.fused_in is None and _plain([block.proj_mlp, block.proj_out]):
            hidden = block.proj_mlp.out_features
            block.proj_mlp = GeluLinear(block.proj_mlp)
            block.proj_out = JoinedLinear(block.proj_out, block.proj_out.in_features - hidden)
            block.activation, count = no_activation, count + 1
    for block in model.transformer_blocks:
        for ff in (block.ff, block.ff_context):
            if ff.activation is gelu_activation and _plain([ff.net[0].proj, ff.net[2]]):
                ff.net[0].proj = GeluLinear(ff.net[0].proj)
                ff.activation, count = no_activation, count + 1
    return count


def fuse_projections(model: FluxDiT) -> int:
    """Stack the linears that read one input (see the module doc); returns how many were stacked."""
    count = 0
    for block in model.single_transformer_blocks:
        count += _fuse_single(block) or _stack_attention(block)
    for block in model.transformer_blocks:
        count += _stack_attention(block)
    return count


# ---------------------------------------------------------------------------------------------
# Regional compilation


def compile_regions(
    model: FluxDiT,
    attention: Optional[Callable] = None,
    backend: str = "inductor",
    tuning: bool = False,
    guard: Optional[Callable[[Callable[[], Callable]], Optional[Callable]]] = None,
) -> int:
    """Compile every block's halves (see the module doc); returns the number of blocks.

    ``attention``: the run's own attention function (SDPA or a custom-op kernel: no exchange in it).
    A call that passes it runs the whole block as one graph, attention included, so that the
    layout changes around it ([B, S, H, D] <-> [B, H, S, D]) fuse into the projections and norms;
    a layout's attention, which exchanges, keeps running between the compiled halves.
    ``guard``: see ``CompilePlan.guard`` and ``_guarded``.
    """
    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, RECOMPILE_LIMIT)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    # Static shapes: the dispatch table picks a backend per row count, and an edit has few shapes.
    # Bound methods of one class share their code object; with one backend for all of them (Dynamo
    # checks the backend too), every block of a class reuses the graph the first one compiled.
    options = {"coordinate_descent_tuning": True} if tuning else None
    if guard is None:
        compiled = functools.partial(torch.compile, fullgraph=True, dynamic=False, backend=backend, options=options)
    else:
        compiled = functools.partial(
            torch.compile, fullgraph=True, dynamic=False, backend=_guarded(backend, options, guard)
        )
    for block in blocks:
        assert isinstance(block, (DoubleStreamBlock, SingleStreamBlock))
        regions = Regions(
            compiled(block.pre_attention),
            compiled(block.post_attention),
            compiled(block.joint) if attention is not None else None,
            attention,
        )
        block.__dict__["compiled_regions"] = regions  # not a submodule: kept out of state_dict and .to()
    return len(blocks)


def _guarded(
    backend: str, options: Optional[dict], guard: Callable[[Callable[[], Callable]], Optional[Callable]]
) -> Callable:
    """``backend`` (with inductor's ``options``) compiling through ``guard`` (``CompilePlan.guard``).

    A compilation runs inside a denoising step, between the step's exchanges with the other ranks, so a
    stop must not leave the step: a stopped compilation hands the region back uncompiled (the graph
    runs eagerly), the step ends, and every rank of the replica stops at that step's boundary.
    """
    compile_graph = torch._dynamo.lookup_backend(backend)
    patches = {"config_patches": options} if options else {}

    def compiler(graph: torch.fx.GraphModule, example_inputs):
        compiled = guard(lambda: compile_graph(graph, example_inputs, **patches))
        return graph.forward if compiled is None else compiled  # None: a stop ended it; the region runs eagerly

    return compiler
