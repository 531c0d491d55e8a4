"""A compile cache that a cluster shares (``model.compile_cache``): what Inductor compiled, one file per key.

Inductor keeps the code it compiles on the node (``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_<user>``), so every job that lands on a fresh node compiles the DiT's blocks again, inside
its first edit. PyTorch carries those caches between processes: ``torch.compiler.save_cache_artifacts()``
serialises every artifact this process compiled or found in its caches (Inductor's FX graphs, AOT autograd's,
autotuning results), and ``torch.compiler.load_cache_artifacts`` puts them into another process's local caches
before it compiles; Inductor then finds its graphs there and compiles none of them.

An entry is one file, ``<model.compile_cache>/<key>.ditrun-compile``: a line of JSON (the format, the key, what
the key describes, the torch version, the size and sha256 of the rest), then PyTorch's serialised artifacts.

* **Key**: the sha256 of everything that changes the compiled code (``describe_run``): the torch, Triton,
  CUDA/HIP and Python versions; the device (name, capability and multiprocessors, or the CPU's architecture and
  vector ISA); the compile backend, tuning, fusion and CUDA graphs; the geometry, dtype and what the precision
  plan built (formats, backends, attention kernel, scale rule); the inputs' shapes (every edit's sizes and
  tokens, the layout's degrees, CFG, the step cache). Inductor's own keys still guard every graph, so an entry
  of another key could only miss, never run code compiled for something else; the key picks the one file
  that holds this run's graphs.
* **Readers**: every rank, on any node, loads the entry before its first compiled forward.
* **Writer**: global rank 0, after each of its edits in which it compiled something the entry lacks (its
  first edit; later ones only when a new shape compiled more). The other ranks of a job compile the graphs
  rank 0 does wherever their inputs have its shapes; a graph only another rank compiles is not in the entry.
  The file is written under a temporary name in its folder, flushed and renamed over the entry
  (``results.write_file``): a reader sees an old entry or a new one, whole, and two jobs writing at once leave
  the one that renamed last.
* **Bad entries**: a file that does not parse, whose size or checksum differs, whose header names another key
  or torch version, or whose artifacts PyTorch cannot read, is discarded with a warning (left in place, and
  replaced by the writer's entry after its first edit); the run compiles as if there were none.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ditrun.errors import UserError
from ditrun.results.files import write_file
from ditrun.model.compile import CompilePlan
from ditrun.user_cache import user_cache_dir
from ditrun.workload.inputs import edit_tokens

FORMAT = "ditrun-compile-cache/1"
ENTRY_SUFFIX = ".ditrun-compile"
AUTO, OFF = "auto", "off"
STATUSES = {
    "off": "no compile cache (model.compile_cache=off, or nothing compiles)",
    "miss": "no entry for this key: compiled here",
    "discarded": "a bad entry was set aside: compiled here",
    "hit": "loaded the entry: Inductor compiles only what it lacks",
}


def cache_dir(value: Optional[str]) -> Optional[Path]:
    """The folder ``model.compile_cache`` names (``auto``: ditrun's user cache); None when it is off."""
    if value is None or str(value) == OFF:
        return None
    return user_cache_dir() / "compile" if str(value) == AUTO else Path(str(value)).expanduser()


def check_config(model_cfg, plan: CompilePlan) -> None:
    """One sentence naming the key when its folder cannot hold entries; nothing to check when nothing compiles."""
    value = getattr(model_cfg, "compile_cache", AUTO)
    folder = cache_dir(value)
    if folder is None or not plan.compile:
        return
    folder = folder.absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    said = f"model.compile_cache={value!r}" + (f" ({folder})" if str(folder) != str(value) else "")
    if not existing.is_dir():
        where = "is not a folder" if existing == folder else f"cannot be made: {existing} is not a folder"
        raise UserError(f"{said} {where}; give a folder (made when missing), or off.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{said} is not writable here ({existing}); give a folder this user may write (on a "
                        "cluster, shared storage), or off.")


# ---------------------------------------------------------------------------------------------
# The key


def _version_of(*distributions: str) -> Optional[str]:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def toolchain() -> dict:
    """The versions that change compiled code (Triton's from its package metadata: importing it costs seconds)."""
    return {"torch": torch.__version__, "triton": _version_of("triton", "pytorch-triton", "pytorch-triton-rocm"),
            "cuda": torch.version.cuda, "hip": torch.version.hip, "python": platform.python_version()}


def device_description(device: torch.device) -> dict:
    """What Inductor generates code for: the GPU's model, or the CPU's architecture and vector ISA."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "capability": list(torch.cuda.get_device_capability(device)),
                "multiprocessors": props.multi_processor_count, "arch": getattr(props, "gcnArchName", None)}
    return {"type": device.type, "machine": platform.machine(), "isa": torch.backends.cpu.get_cpu_capability()}


def describe_run(cfg, plan: CompilePlan, device_dtype, geometry, precision, details: dict, layout, edits) -> dict:
    """Everything of a run that changes its compiled code (see the module doc). ``precision``: the run's
    ``PrecisionPlan``; ``details``: what ``build_model`` built (``BuiltModel.details``); ``layout``: the
    ``LayoutPlan``; ``edits``: every edit of the run (so every rank names the same key)."""
    text_len = cfg.workload.text_len
    shapes = sorted({(e.width, e.height, e.ref_width, e.ref_height, edit_tokens(e, text_len)) for e in edits})
    return {
        **toolchain(), "device": device_description(device_dtype.device),
        "compile": {"backend": plan.backend, "tuning": plan.tuning, "fuse": plan.fuse, "graphs": plan.graphs},
        "model": {"geometry": dataclasses.asdict(geometry), "dtype": device_dtype.dtype_name, "built": details,
                  "precision": {"formats": precision.formats(), "scale_mode": precision.scale_mode,
                                "backend": precision.backend}},
        "inputs": {"shapes": [list(s) for s in shapes], "true_cfg": cfg.workload.true_cfg_scale > 1,
                   "layout": layout.name, "cfg_degree": layout.cfg_degree, "sp_degree": layout.sp_degree,
                   "head_groups": layout.head_groups, "step_cache": cfg.cache.name},
    }


def for_run(cfg, plan: CompilePlan, device_dtype, geometry, precision, details: dict, layout, edits,
            rank: int) -> CompileCache:
    """The run's entry (``describe_run``'s arguments); global rank 0 writes it and says what it did."""
    folder = cache_dir(getattr(cfg.model, "compile_cache", AUTO)) if plan.compile else None
    described = describe_run(cfg, plan, device_dtype, geometry, precision, details, layout, edits) if folder is not None else {}
    return CompileCache(folder, described, writer=rank == 0, announce=rank == 0)


def entry_key(described: dict) -> str:
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Entries


class BadEntry(Exception):
    """An entry that cannot be used; the message says why, in a few words."""


def write_entry(path: Path, key: str, described: dict, artifacts: bytes) -> None:
    """The entry, whole, at ``path`` (a temporary file in its folder, flushed, renamed over it)."""
    header = {"format": FORMAT, "key": key, "torch": torch.__version__, "bytes": len(artifacts),
              "sha256": hashlib.sha256(artifacts).hexdigest(), "described": described}
    write_file(path, json.dumps(header, sort_keys=True, default=str).encode() + b"\n" + artifacts)


def read_entry(path: Path, key: str) -> bytes:
    """The artifacts of the entry at ``path``; ``BadEntry`` when it is not a whole entry of ``key``."""
    data = path.read_bytes()
    line, newline, artifacts = data.partition(b"\n")
    try:
        header = json.loads(line) if newline else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BadEntry("not a ditrun compile-cache entry")
    if header.get("key") != key or header.get("torch") != torch.__version__:
        raise BadEntry(f"it belongs to another key or torch version ({header.get('torch')})")
    if header.get("bytes") != len(artifacts) or header.get("sha256") != hashlib.sha256(artifacts).hexdigest():
        raise BadEntry(f"truncated or corrupt ({len(artifacts)} of {header.get('bytes')} bytes, checksum differs)")
    return artifacts


def graph_cache_lookups() -> dict[str, int]:
    """Inductor's FX-graph cache lookups in this process (``hit``, ``miss``, ``bypass``: a graph it cannot cache);
    empty where nothing compiled (Dynamo never imported)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    return {what: int(counters["inductor"][f"fxgraph_cache_{what}"]) for what in ("hit", "miss", "bypass")}


def _artifact_keys(info) -> frozenset:
    """The artifacts a ``torch.compiler`` ``CacheInfo`` names, as (type, key) pairs."""
    return frozenset((kind, key) for kind, keys in info.artifacts.items() for key in keys)


@dataclass
class CompileCache:
    """One run's entry: ``load`` before the first compiled forward, ``save`` after each edit (see the module doc).
    ``folder`` None: off, and both do nothing."""

    folder: Optional[Path]
    described: dict
    writer: bool = False
    """Whether this process writes the entry (global rank 0)."""
    announce: bool = True
    """Whether this process says what it did on the console (global rank 0; every rank warns)."""
    status: str = "off"
    """One of ``STATUSES``: what ``load`` found."""
    stored: frozenset = field(default_factory=frozenset)
    """The artifacts of the entry as this process last loaded or wrote it."""
    written: int = 0
    """Times this process wrote the entry."""

    @functools.cached_property
    def key(self) -> str:
        return entry_key(self.described)

    @property
    def path(self) -> Optional[Path]:
        return None if self.folder is None else self.folder / f"{self.key}{ENTRY_SUFFIX}"

    def load(self) -> str:
        """Put the entry's artifacts into this process's local caches; returns ``status``."""
        if self.path is None:
            return self.status
        try:
            info = self._load()
        except FileNotFoundError:
            self.status = "miss"
            self._say(f"no entry {self.path}; compiling, and writing it after the first edit")
        except (OSError, BadEntry) as why:
            self.status = "discarded"
            print(f"ditrun: warning: compile cache entry {self.path} discarded: {why}; compiling as without one",
                  flush=True)
        else:
            self.status, self.stored = "hit", _artifact_keys(info)
            self._say(f"loaded {self.path} ({len(self.stored)} artifacts)")
        return self.status

    def _load(self):
        artifacts = read_entry(self.path, self.key)
        try:
            info = torch.compiler.load_cache_artifacts(artifacts)
        except Exception as err:  # noqa: BLE001 - whatever PyTorch fails on, the run compiles without the entry
            raise BadEntry(f"PyTorch could not load its artifacts ({type(err).__name__}: {err})") from err
        if info is None:
            raise BadEntry("PyTorch could not read its artifacts")
        return info

    def save(self) -> bool:
        """Write the entry when this process is its writer and compiled (or found) artifacts it lacks; whether it
        wrote. Cheap when there is nothing new: PyTorch serialises each artifact once per process."""
        if self.path is None or not self.writer:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None or _artifact_keys(saved[1]) <= self.stored:
            return False
        artifacts, info = saved
        try:
            write_entry(self.path, self.key, self.described, artifacts)
        except OSError as err:  # a full or read-only shared folder costs later jobs their compile, not this run
            print(f"ditrun: warning: compile cache entry {self.path} not written: {err}", flush=True)
            return False
        self.stored, self.written = _artifact_keys(info), self.written + 1
        self._say(f"wrote {self.path} ({len(self.stored)} artifacts, {len(artifacts) / 2**20:.1f} MiB)")
        return True

    def fields(self) -> dict:
        """The summary's ``compile_cache``: what happened, the entry's key and path, and what Inductor's graph cache
        found (a hit for every graph compiled after a load, where the entry held it)."""
        return {"status": self.status, "written": self.written, "artifacts": len(self.stored),
                "key": self.key if self.path is not None else None,
                "entry": str(self.path) if self.path is not None else None, "fx_graph_cache": graph_cache_lookups()}

    def _say(self, what: str) -> None:
        if self.announce:
            print(f"ditrun: compile cache: {what}", flush=True)
