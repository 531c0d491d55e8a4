"""The results directory's writer protocol: one run at a time, one writer per file, every record
whole, and a rerun resumes only what the same settings produced.

- **Lock.** Global rank 0 holds an exclusive ``fcntl`` lock on ``.ditrun.lock`` for the whole run.
  POSIX record locks are what NFS (v3 through lockd, v4 natively), Lustre (mounted with
  ``flock``), GPFS and BeeGFS implement across nodes, and the kernel drops the lock when its
  holder dies, SIGKILL included, so a crashed run never blocks the next one. On a file system
  without locks (ENOLCK), a lease file that the holder refreshes every few seconds takes its
  place; a lease left unrefreshed for ``LEASE_STALE_S`` belongs to a dead run.
- **One writer per file.** Replica 0's writer (rank 0) appends to ``edits.jsonl``; replica ``r``'s
  to ``edits.replica<r>.jsonl``. Concurrent ``O_APPEND`` writes from several nodes are not atomic
  on NFS, so no file ever has two writers; rank 0 merges the replica files into ``edits.jsonl``
  when every rank has finished (and when a rerun starts, after a crash).
- **Whole records.** Each record is one ``write`` of one line, then ``fsync``. A line that does not
  parse, lacks the record's fields or repeats an edit (a torn write, a foreign line, a raced
  run) is moved to ``edits.rejected.jsonl`` with a warning when the next run starts, and its edit
  runs again.
- **Outputs checked.** Each record carries the ``sha256`` of its PNG and latents, written (and
  flushed, with their directory) before the record. When a run starts, a record whose files are
  missing or differ from their checksums (deleted, truncated, lost to a power cut) is moved to
  ``edits.rejected.jsonl`` with a warning naming the edit and the file, and its edit runs again.
  Only files named with ``files.TEMPORARY_PREFIX`` are removed as leftovers of interrupted writes.
- **One run per directory.** A directory belongs to the settings of the first run that recorded an
  edit in it, kept in ``run.json``: the whole resolved config (model, precision, layout, transport,
  world, sampling settings, metrics) with the resolved device and dtype, the weights' and VAE's
  fingerprints, and every edit the workload declares, less ``MAY_DIFFER`` (where and how a run
  reports, how long it waits, which prefix of the workload it runs). Another run is refused
  naming the differences, before anything in the directory is written (Hydra's ``.hydra/``
  included: ``HydraFiles``). The directory's edits are those its runs asked for; a rerun of a
  prefix appends and its summary still covers them all.
- **Resume only what matches.** Each record carries ``settings`` (everything that changes the
  edit's result: model and weights, dtype, precision, sampling settings, the edit's size, seed
  and inputs, an image file's content hash included) and their ``fingerprint``. A rerun whose
  settings differ for an edit already recorded fails before any model is built, naming what
  differs.
- **Nothing planted is followed.** A results directory, and every entry of it that a run writes, locks or
  reads (``WRITTEN``, the replica files, the output folders), must be real and this user's: a symbolic link
  or an entry of another user is refused in one sentence before anything is written (``check_run_dir``),
  and every file is opened ``O_NOFOLLOW`` all the same (``files.open_nofollow``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import stat
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from ditrun.config import take_renamed_keys
from ditrun.errors import UserError
from ditrun.results import files
from ditrun.results.files import EDITS_FILE, RUN_FILE, append_line

LOCK_FILE = ".ditrun.lock"
LEASE_FILE = ".ditrun.lease"
REJECTED_FILE = "edits.rejected.jsonl"
REPLICA_FILE = "edits.replica{}.jsonl"
HYDRA_DIR = ".hydra"  # where ``HydraFiles`` go
CACHE_DIR = "cache"  # a run's own caches, where the user's cannot be written (``launch.folders``)
# What a run writes, locks or reads at the top of its directory (and the replica files, found by name): checked
# to be real and this user's before anything is written.
WRITTEN = (
    LOCK_FILE,
    LEASE_FILE,
    files.EDITS_FILE,
    REJECTED_FILE,
    files.RUN_FILE,
    files.SUMMARY_FILE,
    files.IMAGES_DIR,
    files.LATENTS_DIR,
    HYDRA_DIR,
    files.WANDB_DIR,
    CACHE_DIR,
)
FOLDERS = (files.IMAGES_DIR, files.LATENTS_DIR, HYDRA_DIR, files.WANDB_DIR, CACHE_DIR)  # of WRITTEN; others: files
# Config keys a rerun may change (a dotted key covers everything under it): where and how the run reports, how
# long it waits for what, which prefix of the workload it runs (the edits themselves are compared as declared,
# not by the manifest's path), labels, where the text length came from (the length itself is compared), the
# tests' own settings (``testing``) and what ``ditrun warm`` compiles (``warm``).
MAY_DIFFER = (
    "workload.limit",
    "workload.manifest",
    "workload.prompt_cache_dir",
    "workload.text_len_from",
    "wandb",
    "progress",
    "output_dir",
    "launcher.name",
    "launcher.rendezvous_timeout_s",
    "launcher.collective_timeout_s",
    "launcher.stop_timeout_s",
    "launcher.master_port",
    "testing",
    "transport.timeout_s",
    "metrics.report",
    "metrics.min_ssim_pct",
    "metrics.quality",
    "metrics.warmup_edits",
    "metrics.full_quality_dir",
    "metrics.reference_dir",
    "precision.name",
    "precision.tuning_file",
    "layout.allow_cross_node_sp",
    "model.compile_cache",
    "model.compile_cache_trust",
    "warm",
)
_ABSENT = object()
LEASE_REFRESH_S = 5.0
LEASE_STALE_S = 60.0
# Every record has these; a line without them is not one of ours.
RECORD_KEYS = ("edit", "seed", "width", "height", "steps", "dit_s", "image", "sha256", "fingerprint", "settings")


class DirectoryBusy(UserError):
    """Another run holds the results directory."""


class SettingsChanged(UserError):
    """The directory's records were made with other settings than this run's."""


# What a user fixes by choosing another results directory: unwritable, read-only, or a file in its place.
_UNUSABLE_DIR_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST, errno.ENOTDIR)


def unusable_dir_sentence(err: OSError) -> Optional[str]:
    """The sentence for an error making or writing the results directory; None for any other error."""
    if err.errno not in _UNUSABLE_DIR_ERRNOS:
        return None
    if err.errno in (errno.EEXIST, errno.ENOTDIR):
        return (
            f"the results directory {err.filename} cannot be made: it, or a folder above it, is a file; set "
            "hydra.run.dir (or output_dir) to a directory."
        )
    return (
        f"the results directory cannot be written ({err.strerror}: {err.filename}); set hydra.run.dir (or "
        "output_dir) to a directory this user can write."
    )


def _as_user_error(err: OSError) -> Exception:
    sentence = unusable_dir_sentence(err)
    return UserError(sentence) if sentence else err


def make_run_dir(out_dir: Path) -> None:
    """The results directory, made if needed and checked (``check_run_dir``); a path that cannot be one is the
    user's mistake."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _as_user_error(err) from None
    check_run_dir(out_dir)


def check_run_dir(out_dir: Path) -> None:
    """Refuse (``UserError``, one sentence) a results directory that is a symbolic link or another user's, or
    in which an entry that a run writes, locks or reads is."""
    files.owned_folder(out_dir)
    for name in (*WRITTEN, *(path.name for path in out_dir.glob(REPLICA_FILE.format("*")))):
        status = files.check_owned(out_dir / name)
        if status is not None and name not in FOLDERS:
            files.check_regular(out_dir / name, status)  # a FIFO would hang the run's read of it


def records_file(out_dir: Path, replica: int) -> Path:
    return out_dir / (EDITS_FILE if replica == 0 else REPLICA_FILE.format(replica))


def fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RunLock:
    """The exclusive right to write into a results directory, held by global rank 0."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self._fd: Optional[int] = None
        self._lease_stop: Optional[threading.Event] = None

    def acquire(self) -> "RunLock":
        try:
            fd = files.open_nofollow(self.out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        except OSError as err:  # the first file a run writes: a read-only directory shows here
            raise _as_user_error(err) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):
                raise self._busy(_written_holder(self.out_dir / LOCK_FILE)) from None
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return self._take_lease()
            raise
        os.ftruncate(fd, 0)
        os.write(fd, _holder().encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None
        if self._lease_stop is not None:
            self._lease_stop.set()
            (self.out_dir / LEASE_FILE).unlink(missing_ok=True)
            self._lease_stop = None

    def _busy(self, holder: str) -> DirectoryBusy:
        return DirectoryBusy(
            f"results directory {self.out_dir} is in use by another ditrun run ({holder or 'holder unknown'}); "
            "wait for it to end, or give this run another directory (hydra.run.dir=... or output_dir=...)."
        )

    def _take_lease(self) -> "RunLock":
        """No locks on this file system: an exclusively created lease file, refreshed while we run."""
        path = self.out_dir / LEASE_FILE
        for _ in range(2):
            try:
                fd = files.open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                if time.time() - _mtime(path) < LEASE_STALE_S:
                    raise self._busy(files.read_text(path).strip()) from None
                path.unlink(missing_ok=True)  # its holder stopped refreshing it: a dead run
                continue
            os.write(fd, _holder().encode())
            os.close(fd)
            self._lease_stop = threading.Event()
            threading.Thread(
                target=self._refresh, args=(path, self._lease_stop), daemon=True, name="ditrun-lease"
            ).start()
            return self
        raise self._busy(files.read_text(path).strip())

    @staticmethod
    def _refresh(path: Path, stop: threading.Event) -> None:
        while not stop.wait(LEASE_REFRESH_S):
            try:
                os.utime(path)
            except OSError as err:
                print(
                    f"ditrun: warning: the lease {path} cannot be refreshed ({err}); another run may take the "
                    "directory once it is stale",
                    file=sys.stderr,
                    flush=True,
                )
                return


def _written_holder(path: Path, wait_s: float = 2.0) -> str:
    """The holder a locked file names. Its holder writes it just after taking the lock, so a run refused in between
    reads it empty: read again for up to ``wait_s`` (a holder that died in between stays unknown)."""
    deadline = time.monotonic() + wait_s
    while not (holder := files.read_text(path).strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return holder


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _holder() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return (
        f"host {socket.gethostname()}, pid {os.getpid()}"
        + (f", Slurm job {job}" if job else "")
        + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )


def recover(out_dir: Path) -> list[dict]:
    """The directory's good records (rank 0, holding the lock, before any rank runs an edit).

    Replica files left by an interrupted run are merged into ``edits.jsonl`` first; bad lines, and records whose
    outputs are damaged, are moved aside; temporary files of interrupted writes are removed.
    """
    merge_replica_files(out_dir)
    text = files.read_text(out_dir / EDITS_FILE)
    lines = text.splitlines()
    good, rejected, damaged, seen = [], [], [], set()
    for line in lines:
        record = _parse(line)
        if record is None or record["edit"] in seen:
            rejected.append(line)
            continue
        seen.add(record["edit"])
        problem = output_problem(out_dir, record)
        if problem:
            damaged.append(line)
            _warn(f"edit {record['edit']!r}: {problem}; its record is moved to {REJECTED_FILE} and the edit runs again")
        else:
            good.append(record)
    if rejected or damaged or (text and not text.endswith("\n")):
        _set_aside(out_dir, rejected + damaged, good)
    if rejected:
        _warn(
            f"{len(rejected)} line(s) of {out_dir / EDITS_FILE} were torn, foreign or repeated; moved to "
            f"{REJECTED_FILE}, and their edits run again"
        )
    _remove_temporaries(out_dir)
    return good


def output_problem(out_dir: Path, record: dict) -> Optional[str]:
    """What is wrong with a record's output files (missing, not a file, not what was written), or None. A symbolic
    link is not a file (it is never followed, and rewriting the output replaces it)."""
    checksums = record["sha256"] if isinstance(record["sha256"], dict) else {}
    for field, name in files.edit_outputs(str(record["edit"])).items():
        path = out_dir / name
        if record.get(field) != name or not isinstance(checksums.get(field), str):
            return f"its record names no checked {field} file at {name}"
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return f"{name} is missing"
        if not stat.S_ISREG(mode):
            return f"{name} is not a file"
        if files.file_sha256(path) != checksums[field]:
            return f"{name} is damaged (its sha256 differs from the record's)"
    return None


def _remove_temporaries(out_dir: Path) -> None:
    """Leftovers of interrupted writes: only names with the temporary prefix, which no edit id can produce (a
    symbolic link among them is removed itself; a folder that is one is not looked into). Other ranks may be
    probing the results directory meanwhile, their probes coming and going under that prefix."""
    for folder in (out_dir, out_dir / files.IMAGES_DIR, out_dir / files.LATENTS_DIR, out_dir / HYDRA_DIR):
        if folder.is_symlink():
            continue
        for tmp in folder.glob(files.TEMPORARY_PREFIX + "*"):
            try:
                mode = tmp.lstat().st_mode
            except FileNotFoundError:  # gone meanwhile: another rank's probe of the folder (run/folders.py)
                continue
            if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                tmp.unlink(missing_ok=True)


def _warn(message: str) -> None:
    print(f"ditrun: warning: {message}", file=sys.stderr, flush=True)


def _parse(line: str) -> Optional[dict]:
    record = files.parse_json(line)
    if not isinstance(record, dict) or any(key not in record for key in RECORD_KEYS):
        return None
    return record


def _set_aside(out_dir: Path, rejected: list[str], good: list[dict]) -> None:
    """Move ``rejected`` lines to edits.rejected.jsonl and rewrite edits.jsonl with ``good`` only."""
    for line in rejected:
        append_line(out_dir / REJECTED_FILE, line)
    files.write_file(out_dir / EDITS_FILE, "".join(json.dumps(record) + "\n" for record in good).encode())


def merge_replica_files(out_dir: Path) -> int:
    """Append every replica file's records to ``edits.jsonl`` (each edit once), then remove them."""
    merged = 0
    replica_files = sorted(out_dir.glob(REPLICA_FILE.format("*")))
    present = {r["edit"] for r in _records_in(out_dir / EDITS_FILE)} if replica_files else set()
    for replica_file in replica_files:
        for line in files.read_text(replica_file).splitlines():
            record = _parse(line)
            if record is not None and record["edit"] not in present:
                append_line(out_dir / EDITS_FILE, json.dumps(record))
                present.add(record["edit"])
                merged += 1
        replica_file.unlink()
    return merged


def _records_in(path: Path) -> Iterable[dict]:
    return [r for r in map(_parse, files.read_text(path).splitlines()) if r is not None]


def run_settings(config: dict, resolved: dict, declared_edits: list) -> dict:
    """What every run of a directory shares: ``config`` (the resolved config as plain data) less ``MAY_DIFFER``,
    ``resolved`` (dotted key -> value: what ``auto`` settings and file paths stand for here) set into it, and the
    workload's declared edits by id under ``workload.edits``."""
    settings = json.loads(json.dumps(config, default=str))  # a copy, as it reads back from run.json
    for key in MAY_DIFFER:
        *parents, leaf = key.split(".")
        _node(settings, parents).pop(leaf, None)
    edits = {
        str(entry.get("id") or f"edit{i:04d}"): {k: v for k, v in entry.items() if v is not None}
        for i, entry in enumerate(declared_edits)
        if isinstance(entry, dict)
    }
    for key, value in {**resolved, "workload.edits": edits}.items():
        *parents, leaf = key.split(".")
        _node(settings, parents)[leaf] = json.loads(json.dumps(value, default=str))
    return settings


def _node(settings: dict, parents: list[str]) -> dict:
    """The mapping at ``parents`` (made where missing)."""
    for parent in parents:
        settings = settings.setdefault(parent, {})
    return settings


def claim(out_dir: Path, settings: dict, edit_settings: dict[str, dict]) -> list[str]:
    """The directory's edits, once this run is known to be its own (global rank 0, holding the lock; nothing in the
    directory is written here).

    A directory whose records were made by a run with other ``settings`` (``run_settings``) is refused naming the
    differences, as is one holding an edit of this run made with other ``edit_settings``. A directory without
    records is anyone's; one with records but no readable ``run.json`` is adopted. This run's edits join
    the directory's, so a rerun of a prefix of the workload keeps the others.
    """
    found = found_records(out_dir)
    recorded = _read_run_file(out_dir) if found else None
    if recorded is not None:
        take_renamed_keys(recorded["settings"])  # a run recorded before a key's rename: its settings as named now
        changes = differences(recorded["settings"], settings)
        if changes:
            raise SettingsChanged(_foreign_message(out_dir, changes))
    resumable(found, edit_settings, out_dir)
    known = list(recorded["edits"]) if recorded is not None else list(dict.fromkeys(r["edit"] for r in found))
    return known + [edit for edit in edit_settings if edit not in known]


def record_run(
    out_dir: Path, settings: dict, edits: list[str], run_id: Optional[str] = None, attempt: Optional[dict] = None
) -> None:
    """``run.json``: the settings the directory belongs to, its edits (after ``claim``), the id of the run that
    claimed it last, which its summary repeats once written (a summary with another id is an earlier run's), and
    that run's ``attempt`` (``attempt_of``)."""
    run = {"fingerprint": fingerprint(settings), "settings": settings, "edits": edits, "run_id": run_id}
    run.update(attempt or {})
    files.write_file(out_dir / RUN_FILE, json.dumps(run, indent=2, default=str).encode())


# The launchers' counts of how often they restarted this job (Slurm's requeue, torchrun's restarts).
RESTART_COUNT_VARS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def attempt_of(out_dir: Path, settings: dict, environ=os.environ) -> dict:
    """Which start of this directory's run this is: ``attempt`` counts the runs that claimed the directory with the
    same settings (a requeued job and a rerun alike), ``wandb_id`` is the first one's W&B run id, which every later
    attempt continues, and ``restarts`` the launcher's own counts where it keeps them."""
    recorded = _read_run_file(out_dir) if (out_dir / RUN_FILE).is_file() else None
    if recorded is None or recorded.get("fingerprint") != fingerprint(settings):
        recorded = {}
    restarts = {name: int(environ[name]) for name in RESTART_COUNT_VARS if environ.get(name, "").isdigit()}
    return {
        "attempt": int(recorded.get("attempt") or 0) + 1,
        "wandb_id": recorded.get("wandb_id") or uuid.uuid4().hex[:16],
        "restarts": restarts,
    }


def found_records(out_dir: Path) -> list[dict]:
    """Every parseable record of ``edits.jsonl`` and the replica files, read without writing anything."""
    paths = [out_dir / EDITS_FILE, *sorted(out_dir.glob(REPLICA_FILE.format("*")))]
    return [record for path in paths for record in _records_in(path)]


def _read_run_file(out_dir: Path) -> Optional[dict]:
    path = out_dir / RUN_FILE
    if not path.is_symlink() and not path.exists():
        return None
    try:
        run = files.parse_json(files.read_bytes(path))
    except OSError:
        run = None
    if not (isinstance(run, dict) and isinstance(run.get("settings"), dict) and isinstance(run.get("edits"), list)):
        print(
            f"ditrun: warning: {path} is unreadable; the directory's records are adopted by this run's settings",
            file=sys.stderr,
            flush=True,
        )
        return None
    return run


def _telling_first(changes: list[tuple[str, object, object]]) -> list[tuple[str, object, object]]:
    """A config group's choice first (``cache.name``, ``layout.name``, ``model.preset``: it explains the group's other
    keys that differ, which would otherwise fill the list and push it behind "(and N more)"), then broad keys."""
    return sorted(
        changes,
        key=lambda change: (change[0].rsplit(".", 1)[-1] not in ("name", "preset"), change[0].count("."), change[0]),
    )


def _foreign_message(out_dir: Path, changes: list[tuple[str, object, object]]) -> str:
    changes = _telling_first(changes)
    return (
        f"results directory {out_dir} belongs to a run with other settings ({_listed(changes)}); rerun with "
        f"the settings in its {RUN_FILE} to resume it, or give this run another directory (hydra.run.dir=... "
        "or output_dir=...)."
    )


def _listed(changes: list[tuple[str, object, object]], shown: int = 4) -> str:
    listed = "; ".join(f"{key}: {_shown(old)} recorded, {_shown(new)} now" for key, old, new in changes[:shown])
    return listed + (f" (and {len(changes) - shown} more)" if len(changes) > shown else "")


def _shown(value: object, width: int = 60) -> str:
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def resumable(records: list[dict], settings: dict[str, dict], out_dir: Path) -> list[str]:
    """Ids of this run's edits that ``records`` already hold with the same settings.

    ``settings`` maps each edit of this run to its result settings. A record of one of them made
    with other settings is an error that names the first difference.
    """
    done = []
    for record in records:
        wanted = settings.get(record["edit"])
        if wanted is None:
            continue  # an edit this run does not ask for: kept, not touched
        if record["fingerprint"] != fingerprint(wanted):
            raise SettingsChanged(_changed_message(record, wanted, out_dir))
        done.append(record["edit"])
    return done


def _changed_message(record: dict, wanted: dict, out_dir: Path) -> str:
    changes = _telling_first(differences(record["settings"], wanted))
    return (
        f"{out_dir / EDITS_FILE} holds edit {record['edit']!r} made with other settings ({_listed(changes, 3)}); "
        "rerun with the recorded settings to resume, or give this run another directory "
        "(hydra.run.dir=... or output_dir=...)."
    )


def differences(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) of every leaf that differs; a key one side lacks has ``_ABSENT`` there."""
    found = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, f"{prefix}{key}.")
        elif json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
            found.append((f"{prefix}{key}", a, b))
    return found


@dataclass(frozen=True)
class HydraFiles:
    """Hydra's record of a run (``config.yaml``, ``hydra.yaml``, ``overrides.yaml`` under ``subdir``), as text.

    Hydra would write them into the directory before ditrun's lock and checks, so a refused run would rewrite
    another run's; ditrun's config turns that off (``hydra.output_subdir: null``) and global rank 0 writes them
    once the directory is this run's (``claim``)."""

    subdir: str
    texts: dict

    def write(self, out_dir: Path) -> None:
        files.owned_folder(out_dir / self.subdir)
        for name, text in self.texts.items():
            files.write_file(out_dir / self.subdir / name, text.encode())
