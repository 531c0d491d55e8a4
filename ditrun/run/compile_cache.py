"""A compile cache that a cluster shares (``model.compile_cache``): what Inductor compiled, one file per key.

Inductor keeps the code it compiles in its own cache folder (``TORCHINDUCTOR_CACHE_DIR``; ditrun's default
``~/.cache/ditrun/inductor``, ``model.compile.claim_compiler_caches``), so every job that lands on a fresh node
compiles the DiT's blocks again, inside its first edit. PyTorch carries those caches between processes:
``torch.compiler.save_cache_artifacts()`` serialises every artifact this process compiled or found in its caches
(Inductor's FX graphs, AOT autograd's, autotuning results), and ``torch.compiler.load_cache_artifacts`` puts them
into another process's local caches before it compiles; Inductor then finds its graphs there and compiles none
of them.

PyTorch's artifacts do not hold every Triton kernel a job compiles (the variants Inductor's coordinate-descent
tuning compiles, the kernels ditrun's custom ops launch): Triton compiles those at their first run into its
cache folder, which Inductor points into the node's Inductor cache (``<TORCHINDUCTOR_CACHE_DIR>/triton/<device>``)
unless ``TRITON_CACHE_DIR`` is set. On a GPU an entry therefore also carries the Triton kernels this job compiled or
loaded: every kernel folder of that cache folder (one per kernel and specialisation, named by Triton's hash of
its source, options and target) that was not there before the job, unpacked into the reader's Triton cache
folder where missing, its file list (``__grp__*.json``) pointed at the new place. Kernels the node already had
before the job are not carried.

An entry is one file, ``<model.compile_cache>/<key>.ditrun-compile``: a line of JSON (the format, the key, what
the key describes, the torch version, the size and sha256 of the rest, the artifacts' size), then PyTorch's
serialised artifacts, then the Triton kernels (a gzip'd tar of kernel folders; empty on a CPU).

* **Key**: the sha256 of everything that changes the compiled code of one input shape (``describe_run`` and
  ``describe_shape``): the torch, Triton, CUDA/HIP and Python versions; the device (name, capability and
  multiprocessors, or the CPU's architecture and vector ISA); the compile backend, tuning, fusion and CUDA
  graphs; the geometry, dtype and what the precision plan built (formats, backends, attention kernel, scale
  rule); the layout's degrees, CFG, the step cache; and the shape (an edit's text tokens and image tokens,
  output and reference latents: what the graphs are specialised for, so 32x48 and 48x32 share an entry). A run
  has one entry per distinct shape of its edits, so a job of any mix of sizes finds each size's entry whichever
  job wrote it (``ditrun warm`` fills them ahead: ``run/warm.py``). Inductor's own keys still guard every
  graph, so an entry of another key could only miss, never run code compiled for something else.
* **Readers**: every rank, on any node, loads the entry of each of its shapes before its first compiled forward.
* **Writer**: global rank 0, after each of its edits in which it compiled something the entry of that edit's
  shape lacks (the artifacts Inductor compiled or looked up during that edit: ``RunCompileCache.recording``).
  The other ranks of a job compile the graphs rank 0 does wherever their inputs have its shapes; a graph only
  another rank compiles is not in the entry.
  The file is written under a temporary name in its folder (``O_EXCL``, unpredictable), flushed and renamed over
  the entry (``trust.write_for``): a reader sees an old entry or a new one, whole, and two jobs writing at once
  leave the one that renamed last. Its mode is for the readers the trust key names (0600; 0640 and the group's).
* **Trust**: an entry is Inductor's generated code and Triton's kernels, run as whoever loads it, so it is read
  only when no user but the reader, root and those ``model.compile_cache_trust`` names could have written it or
  the cache folder (``ditrun/trust.py``: checked on the opened file). Any other is set aside with one warning
  naming the file, its owner and its mode (status ``discarded``), and nothing of it is read or unpacked.
* **Bad entries**: a file that does not parse, whose size or checksum differs, whose header names another
  format, key or torch version, whose Triton part holds anything but kernel files, or whose artifacts PyTorch
  cannot read, is discarded with a warning (left in place, and replaced by the writer's entry after its first
  edit); the run compiles as if there were none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from ditrun.errors import UserError
from ditrun.model.compile import CompilePlan
from ditrun.timers import STARTUP
from ditrun.trust import Trust, Untrusted, read_trusted, write_for
from ditrun.user_cache import user_cache_dir
from ditrun.workload.inputs import edit_tokens, image_tokens

FORMAT = "ditrun-compile-cache/2"
ENTRY_SUFFIX = ".ditrun-compile"
AUTO, OFF = "auto", "off"
TRUST_KEY = "model.compile_cache_trust"
STATUSES = {
    "off": "no compile cache (model.compile_cache=off, or nothing compiles)",
    "miss": "no entry for this key: compiled here",
    "discarded": "a bad or untrusted entry was set aside: compiled here",
    "hit": "loaded the entry: Inductor compiles only what it lacks",
    "partial": "loaded the entries of some of the run's shapes; the others compiled here",
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
    trust_of(model_cfg)
    folder = folder.absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    said = f"model.compile_cache={value!r}" + (f" ({folder})" if str(folder) != str(value) else "")
    if not existing.is_dir():
        where = "is not a folder" if existing == folder else f"cannot be made: {existing} is not a folder"
        raise UserError(f"{said} {where}; give a folder (made when missing), or off.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"{said} is not writable here ({existing}); give a folder this user may write (on a "
            "cluster, shared storage), or off."
        )


def trust_of(model_cfg) -> Trust:
    """Whom ``model.compile_cache_trust`` trusts besides the reader and root; one sentence naming it when a name is
    unknown here."""
    return Trust.parse(getattr(model_cfg, "compile_cache_trust", None), TRUST_KEY)


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
    return {
        "torch": torch.__version__,
        "triton": _version_of("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "python": platform.python_version(),
    }


def device_description(device: torch.device) -> dict:
    """What Inductor generates code for: the GPU's model, or the CPU's architecture and vector ISA."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "capability": list(torch.cuda.get_device_capability(device)),
            "multiprocessors": props.multi_processor_count,
            "arch": getattr(props, "gcnArchName", None),
        }
    return {"type": device.type, "machine": platform.machine(), "isa": torch.backends.cpu.get_cpu_capability()}


def shape_of(edit, text_len: Optional[int]) -> tuple[int, int]:
    """What an edit's compiled graphs are specialised for: its text tokens and its image tokens (output and
    reference latents). Sizes of equal token counts (32x48 and 48x32) run the same graphs."""
    image = image_tokens(edit)
    return (edit_tokens(edit, text_len) - image, image)


def shape_label(shape: tuple) -> str:
    text, image = shape
    return f"{text} text + {image} image tokens"


def describe_shape(described: dict, shape: tuple) -> dict:
    """``describe_run``'s description with one input shape (``shape_of``): what one entry's key describes."""
    return {**described, "inputs": {**described["inputs"], "shape": list(shape)}}


def describe_run(cfg, plan: CompilePlan, device_dtype, geometry, precision, details: dict, layout) -> dict:
    """Everything of a run that changes its compiled code but its inputs' shapes (see the module doc).
    ``precision``: the run's ``PrecisionPlan``; ``details``: what ``build_model`` built (``BuiltModel.details``);
    ``layout``: the ``LayoutPlan``."""
    return {
        **toolchain(),
        "device": device_description(device_dtype.device),
        "compile": {"backend": plan.backend, "tuning": plan.tuning, "fuse": plan.fuse, "graphs": plan.graphs},
        "model": {
            "geometry": dataclasses.asdict(geometry),
            "dtype": device_dtype.dtype_name,
            "built": details,
            "precision": {
                "formats": precision.formats(),
                "scale_mode": precision.scale_mode,
                "backend": precision.backend,
            },
        },
        "inputs": {
            "true_cfg": cfg.workload.true_cfg_scale > 1,
            "layout": layout.name,
            "cfg_degree": layout.cfg_degree,
            "sp_degree": layout.sp_degree,
            "head_groups": layout.head_groups,
            "step_cache": cfg.cache.name,
        },
    }


def for_run(
    cfg, plan: CompilePlan, device_dtype, geometry, precision, details: dict, layout, edits, rank: int
) -> RunCompileCache:
    """The run's entries, one per distinct shape of ``edits`` (``describe_run``'s arguments; every edit of the run,
    so that every rank names the same keys); global rank 0 writes them and says what it did."""
    folder = cache_dir(getattr(cfg.model, "compile_cache", AUTO)) if plan.compile else None
    if folder is None:
        return RunCompileCache({})
    described = describe_run(cfg, plan, device_dtype, geometry, precision, details, layout)
    kernels_dir = claim_triton_cache_dir(device_dtype.device)
    trust = trust_of(cfg.model)  # check_config has read it before any work
    shapes = dict.fromkeys(shape_of(edit, cfg.workload.text_len) for edit in edits)
    entries = {
        shape: CompileCache(
            folder,
            describe_shape(described, shape),
            writer=rank == 0,
            announce=rank == 0,
            kernels_dir=kernels_dir,
            trust=trust,
            label=shape_label(shape),
        )
        for shape in shapes
    }
    return RunCompileCache(entries, cfg.workload.text_len)


def entry_key(described: dict) -> str:
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Entries


class BadEntry(Exception):
    """An entry that cannot be used; the message says why, in a few words."""


@dataclass(frozen=True)
class Entry:
    artifacts: bytes
    """PyTorch's serialised cache artifacts (``torch.compiler.save_cache_artifacts``)."""
    kernels: bytes = b""
    """Triton kernel folders, a gzip'd tar (``pack_kernels``); empty when there are none."""


def write_entry(path: Path, key: str, described: dict, entry: Entry, trust: Optional[Trust] = None) -> None:
    """The entry, whole, at ``path`` (a temporary file in its folder, flushed, renamed over it), for the readers
    ``trust`` names (``trust.write_for``)."""
    payload = entry.artifacts + entry.kernels
    header = {
        "format": FORMAT,
        "key": key,
        "torch": torch.__version__,
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "artifacts_bytes": len(entry.artifacts),
        "described": described,
    }
    write_for(path, json.dumps(header, sort_keys=True, default=str).encode() + b"\n" + payload, trust or Trust())


def read_entry(path: Path, key: str, trust: Optional[Trust] = None) -> Entry:
    """The entry at ``path``; ``Untrusted`` when a user ``trust`` does not name could have written it or its folder
    (nothing of it is read), ``BadEntry`` when it is not a whole entry of ``key``."""
    data = read_trusted(path, path.parent, trust or Trust())
    line, newline, payload = data.partition(b"\n")
    try:
        header = json.loads(line) if newline else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or not str(header.get("format", "")).startswith("ditrun-compile-cache/"):
        raise BadEntry("not a ditrun compile-cache entry")
    if header["format"] != FORMAT:
        raise BadEntry(f"it is of another format ({header['format']}; this ditrun reads {FORMAT})")
    if header.get("key") != key or header.get("torch") != torch.__version__:
        raise BadEntry(f"it belongs to another key or torch version ({header.get('torch')})")
    if header.get("bytes") != len(payload) or header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise BadEntry(f"truncated or corrupt ({len(payload)} of {header.get('bytes')} bytes, checksum differs)")
    split = header.get("artifacts_bytes")
    if not isinstance(split, int) or not 0 <= split <= len(payload):
        raise BadEntry("its header does not say where the artifacts end")
    return Entry(payload[:split], payload[split:])


# ---------------------------------------------------------------------------------------------
# Triton's kernels

_KERNEL_FOLDER = re.compile(r"[A-Za-z0-9_-]{8,128}")
"""A kernel folder's name in Triton's cache (its hash, base32 or hex)."""


def claim_triton_cache_dir(device: torch.device) -> Optional[Path]:
    """Triton's cache folder for this process on ``device`` (a GPU; None otherwise): ``TRITON_CACHE_DIR`` when set,
    else the one Inductor would set on its first compiled kernel, set now so that the kernels ditrun's custom ops
    compile before that land there too."""
    if device.type != "cuda":
        return None
    if not os.environ.get("TRITON_CACHE_DIR"):
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        index = device.index if device.index is not None else torch.cuda.current_device()
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(index)
    return Path(os.environ["TRITON_CACHE_DIR"])


def _whole_kernel_folder(path: Path) -> bool:
    """Whether ``path`` is a kernel folder with its file list (``__grp__*.json``, which Triton writes last)."""
    return (
        _KERNEL_FOLDER.fullmatch(path.name) is not None
        and path.is_dir()
        and any(child.name.startswith("__grp__") for child in path.iterdir())
    )


def kernel_folders(root: Optional[Path]) -> frozenset:
    """The names of the whole kernel folders under ``root``."""
    if root is None or not root.is_dir():
        return frozenset()
    return frozenset(p.name for p in root.iterdir() if _whole_kernel_folder(p))


def _pointed_at(group: bytes, folder: Path) -> bytes:
    """A Triton file list (``__grp__*.json``: absolute paths of a kernel's files) pointed at ``folder``."""
    listed = json.loads(group).get("child_paths", {})
    pointed = {child: str(folder / Path(path).name) for child, path in listed.items()}
    return json.dumps({"child_paths": pointed}).encode()


def pack_kernels(root: Path, names) -> bytes:
    """The kernel folders ``names`` under ``root`` (their files, not Triton's temporary folders), a gzip'd tar;
    empty for no folders."""
    if not names:
        return b""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for name in sorted(names):
            for file in sorted((root / name).iterdir()):
                if file.is_file() and not file.is_symlink() and file.name != "lock":
                    tar.add(file, arcname=f"{name}/{file.name}", recursive=False)
    return buffer.getvalue()


def unpack_kernels(data: bytes, root: Path) -> frozenset:
    """Put the kernel folders of ``data`` (``pack_kernels``) under ``root`` where missing, each whole (written
    under a temporary name, renamed into place) and its file lists pointed at ``root``; returns every folder
    ``data`` holds. ``BadEntry`` when it is not such a tar."""
    if not data:
        return frozenset()
    folders: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                folder, _, name = member.name.partition("/")
                if not (
                    member.isfile()
                    and _KERNEL_FOLDER.fullmatch(folder)
                    and name
                    and re.fullmatch(r"[^/\\]+", name)
                    and name not in (".", "..")
                ):
                    raise BadEntry(f"its Triton kernels hold {member.name!r}, not a kernel's file")
                content = tar.extractfile(member).read()
                if name.startswith("__grp__"):
                    content = _pointed_at(content, root / folder)
                folders.setdefault(folder, {})[name] = content
    except (tarfile.TarError, OSError, EOFError, ValueError, AttributeError) as err:
        raise BadEntry(f"its Triton kernels cannot be read ({type(err).__name__}: {err})") from err
    root.mkdir(parents=True, exist_ok=True)
    for folder, files in folders.items():
        if _whole_kernel_folder(root / folder):
            continue
        temporary = root / f"tmp.ditrun.{os.getpid()}.{folder}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        for name, content in files.items():
            (temporary / name).write_bytes(content)
        shutil.rmtree(root / folder, ignore_errors=True)  # a folder without its file list: Triton would recompile
        try:
            temporary.rename(root / folder)
        except OSError:  # another process put it there meanwhile
            shutil.rmtree(temporary, ignore_errors=True)
    return frozenset(folders)


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
    kernels_dir: Optional[Path] = None
    """Triton's cache folder of this process (``claim_triton_cache_dir``); None carries no Triton kernels."""
    kernels_before: Optional[frozenset] = None
    """The kernel folders that were there before ``load`` (before the first entry of the run loaded): the node's, not
    this job's."""
    kernels_stored: frozenset = field(default_factory=frozenset)
    """The kernel folders of the entry as this process last loaded or wrote it."""
    trust: Trust = field(default_factory=Trust)
    """Who besides this user and root may have written an entry this process loads (``model.compile_cache_trust``);
    what it writes is for them."""
    label: str = ""
    """What the entry holds, for the console (its shape: ``shape_label``)."""

    @functools.cached_property
    def key(self) -> str:
        return entry_key(self.described)

    @property
    def path(self) -> Optional[Path]:
        return None if self.folder is None else self.folder / f"{self.key}{ENTRY_SUFFIX}"

    def load(self) -> str:
        """Put the entry's artifacts into this process's local caches (its Triton kernels into Triton's cache
        folder); returns ``status``."""
        if self.path is None:
            return self.status
        if self.kernels_before is None:
            self.kernels_before = kernel_folders(self.kernels_dir)
        try:
            info = self._load()
        except FileNotFoundError:
            self.status = "miss"
            self._say(f"no entry {self.path}{self._for}; compiling, and writing it after the first edit of its shape")
        except Untrusted as why:
            self.status = "discarded"
            print(
                f"ditrun: warning: compile cache entry {self.path} set aside: {why}; compiling as without it "
                f"(this user, root and those {TRUST_KEY} names are trusted)",
                flush=True,
            )
        except (OSError, BadEntry) as why:
            self.status = "discarded"
            print(
                f"ditrun: warning: compile cache entry {self.path} discarded: {why}; compiling as without one",
                flush=True,
            )
        else:
            self.status, self.stored = "hit", _artifact_keys(info) if info is not None else frozenset()
            kernels = f", {len(self.kernels_stored)} Triton kernels" if self.kernels_stored else ""
            self._say(f"loaded {self.path}{self._for} ({len(self.stored)} artifacts{kernels})")
        return self.status

    def _load(self):
        entry = read_entry(self.path, self.key, self.trust)
        if self.kernels_dir is not None:
            self.kernels_stored = unpack_kernels(entry.kernels, self.kernels_dir)
        if not entry.artifacts:  # only Triton kernels (nothing PyTorch caches compiled)
            return None
        try:
            info = torch.compiler.load_cache_artifacts(entry.artifacts)
        except Exception as err:  # noqa: BLE001 - whatever PyTorch fails on, the run compiles without the entry
            raise BadEntry(f"PyTorch could not load its artifacts ({type(err).__name__}: {err})") from err
        if info is None:
            raise BadEntry("PyTorch could not read its artifacts")
        return info

    def save(self) -> bool:
        """Write the entry when this process is its writer and compiled (or found) artifacts or Triton kernels it
        lacks; whether it wrote. Cheap when there is nothing new: PyTorch serialises each artifact once per
        process."""
        if self.path is None or not self.writer:
            return False
        saved = torch.compiler.save_cache_artifacts()
        kernels = (kernel_folders(self.kernels_dir) - (self.kernels_before or frozenset())) | self.kernels_stored
        new_artifacts = saved is not None and not _artifact_keys(saved[1]) <= self.stored
        if not new_artifacts and kernels <= self.kernels_stored:
            return False
        artifacts, info = saved if saved is not None else (b"", None)
        kernels = {name for name in kernels if (self.kernels_dir / name).is_dir()}
        try:
            entry = Entry(artifacts, pack_kernels(self.kernels_dir, kernels))
            write_entry(self.path, self.key, self.described, entry, self.trust)
        except OSError as err:  # a full or read-only shared folder costs later jobs their compile, not this run
            print(f"ditrun: warning: compile cache entry {self.path} not written: {err}", flush=True)
            return False
        self.stored = _artifact_keys(info) if info is not None else frozenset()
        self.kernels_stored, self.written = frozenset(kernels), self.written + 1
        size = (len(entry.artifacts) + len(entry.kernels)) / 2**20
        carried = f", {len(kernels)} Triton kernels" if kernels else ""
        self._say(f"wrote {self.path}{self._for} ({len(self.stored)} artifacts{carried}, {size:.1f} MiB)")
        return True

    def fields(self) -> dict:
        """The summary's ``compile_cache``: what happened, the entry's key and path, and what Inductor's graph cache
        found (a hit for every graph compiled after a load, where the entry held it)."""
        return {
            "status": self.status,
            "written": self.written,
            "artifacts": len(self.stored),
            "triton_kernels": len(self.kernels_stored),
            "key": self.key if self.path is not None else None,
            "entry": str(self.path) if self.path is not None else None,
            "fx_graph_cache": graph_cache_lookups(),
        }

    @property
    def _for(self) -> str:
        return f" for {self.label}" if self.label else ""

    def _say(self, what: str) -> None:
        if self.announce:
            print(f"ditrun: compile cache: {what}", flush=True)


@dataclass
class RunCompileCache:
    """A run's entries, one per distinct shape of its edits (``for_run``): ``load`` them all before the first
    compiled forward, and run each edit's forwards inside ``recording(edit)``, after which global rank 0 writes
    the entry of the edit's shape where the edit compiled what it lacks. No entries: off, and both do nothing."""

    entries: dict[tuple, CompileCache]
    """Shape (``shape_of``) -> its entry."""
    text_len: Optional[int] = None
    """``workload.text_len``, for an edit's tokens (``shape_of``)."""

    @property
    def status(self) -> str:
        """One of ``STATUSES``: ``hit`` or ``miss`` where every entry's load says so, ``discarded`` where one was set
        aside, ``partial`` for a mix of hits and misses."""
        found = {entry.status for entry in self.entries.values()}
        if not found:
            return "off"
        if len(found) == 1 or "discarded" in found:
            return "discarded" if "discarded" in found else found.pop()
        return "partial"

    def load(self) -> str:
        """Every entry's artifacts into this process's local caches; returns ``status``. Each entry carries the Triton
        kernels the job compiled or loaded from any entry (the node's before the first load are left out)."""
        if self.entries:
            before = kernel_folders(next(iter(self.entries.values())).kernels_dir)
            for entry in self.entries.values():
                entry.kernels_before = before
                entry.load()
        return self.status

    def entry_of(self, edit) -> Optional[CompileCache]:
        return self.entries.get(shape_of(edit, self.text_len)) if self.entries else None

    @contextlib.contextmanager
    def recording(self, edit) -> Iterator[None]:
        """Around the forwards of ``edit``: what Inductor compiles or finds in its caches there is recorded apart
        from the rest of the process (PyTorch's cache-artifact record, fresh for the edit), and the writer then
        writes it as the entry of the edit's shape, where the entry lacks it. An edit that raises writes nothing."""
        entry = self.entry_of(edit)
        if entry is None or not entry.writer:
            yield
            return
        from torch.compiler._cache import CacheArtifactManager

        with CacheArtifactManager.with_fresh_cache():
            yield
            with STARTUP.adding("compile_cache_s"):
                entry.save()

    def fields(self) -> dict:
        """The summary's ``compile_cache``: what happened overall and per entry, and what Inductor's graph cache found
        (a hit for every graph compiled after a load, where the entry held it)."""
        entries = self.entries.values()
        return {
            "status": self.status,
            "written": sum(entry.written for entry in entries),
            "artifacts": sum(len(entry.stored) for entry in entries),
            "triton_kernels": len(frozenset().union(*(entry.kernels_stored for entry in entries))),
            "entries": [
                {"shape": list(shape), "status": entry.status, "written": entry.written, "entry": str(entry.path)}
                for shape, entry in self.entries.items()
            ],
            "fx_graph_cache": graph_cache_lookups(),
        }
