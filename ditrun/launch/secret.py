"""The job's secret: what a rank presents with every key it writes to the rendezvous store.

A TCPStore has no authentication: anyone who reaches its port (every user of the node, for a store on
loopback) can read, set and list keys. So every value ditrun's ranks write carries a tag made with a
secret that only the job's ranks hold (``launch.sealed``), and a value without a valid tag is ignored.
Where the secret comes from, first match wins:

* ``DITRUN_JOB_SECRET`` (64 hex digits) in the rank's environment: ditrun's local spawner makes a fresh
  one per run and hands it to its ranks; a Slurm job submitted by ditrun (submitit) gets one in the job's
  environment, which only its owner and Slurm can read.
* Under MPI, rank 0 makes one and broadcasts it over MPI, a channel the job already owns
  (``env.from_mpi4py`` callers, see ``mpi_secret``).
* Otherwise (``srun``, torchrun, a user's own sbatch script) it is derived from the job's identity
  and the user's own secret file, ``$XDG_CONFIG_HOME/ditrun/secret`` (``~/.config/ditrun/secret``),
  made once with mode 0600 and read only when it is a regular file of this user's that no one else can
  read or write. Every node of a cluster whose home folders are shared computes the same secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Mapping, Optional

from ditrun.errors import UserError
from ditrun.trust import Untrusted, private_folder

ENV = "DITRUN_JOB_SECRET"
SECRET_BYTES = 32
# What tells one job (step) of a launcher from another: all of these that are set take part.
JOB_IDENTITY_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "TORCHELASTIC_RUN_ID",
    "PMIX_NAMESPACE",
    "OMPI_MCA_ess_base_jobid",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def new_secret() -> str:
    """A fresh secret, as ``DITRUN_JOB_SECRET`` holds it."""
    return secrets.token_hex(SECRET_BYTES)


def job_secret(environ: Mapping[str, str] = os.environ, address: Optional[str] = None) -> bytes:
    """This rank's job secret (see the module's docstring); ``address`` is the store's host:port."""
    if environ.get(ENV):
        return _parse(environ[ENV])
    identity = "\n".join(f"{name}={environ.get(name, '')}" for name in JOB_IDENTITY_VARS)
    return hmac.new(user_secret(environ), f"ditrun job\n{identity}\n{address}".encode(), hashlib.sha256).digest()


def _parse(text: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != SECRET_BYTES:
        raise UserError(f"{ENV} must be {2 * SECRET_BYTES} hex digits (as `python -m ditrun.launch.secret` prints).")
    return value


def secret_file(environ: Mapping[str, str] = os.environ) -> Path:
    config = environ.get("XDG_CONFIG_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".config")
    return Path(config) / "ditrun" / "secret"


def user_secret(environ: Mapping[str, str] = os.environ) -> bytes:
    """The user's own secret, made on first use; refused when anyone else could have read or written it."""
    path = secret_file(environ)
    try:
        return _read_private(path)
    except FileNotFoundError:
        pass
    try:
        private_folder(path.parent)  # made 0700, or refused where another user could have written it
        _create_private(path)
        return _read_private(path)
    except Untrusted as why:
        raise UserError(
            f"the job secret's folder {path.parent} is not only yours ({why}); set {ENV} for the job's "
            "ranks or remove that folder."
        ) from None
    except OSError as err:
        raise UserError(
            f"cannot make the job secret file {path} ({err.strerror}); set {ENV} for the job's ranks "
            f"(`python -m ditrun.launch.secret` prints one) or make {path.parent} writable."
        ) from None


def _read_private(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise UserError(
                f"the job secret file {path} is owned by uid {info.st_uid} with mode {stat.filemode(info.st_mode)}; "
                f"it must be a regular file of yours (uid {os.geteuid()}) that only you can read (chmod 600), "
                "or remove it and ditrun makes a new one."
            )
        value = os.read(fd, 4 * SECRET_BYTES)
    finally:
        os.close(fd)
    return _parse(value.decode(errors="replace").strip())


def _create_private(path: Path) -> None:
    """Write the secret under an unpredictable name, then link it into place: two nodes that make it at once
    (a shared home) keep whichever linked first, and every rank reads that one."""
    temporary = path.with_name(f".secret.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (new_secret() + "\n").encode())
        os.fsync(fd)
        os.close(fd)
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
    finally:
        temporary.unlink(missing_ok=True)


def mpi_secret() -> Optional[str]:
    """Under MPI without ``DITRUN_JOB_SECRET``: rank 0's fresh secret, broadcast to every rank over MPI
    (None without mpi4py, on every rank alike: the secret is then derived as under ``srun``)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD.bcast(new_secret() if MPI.COMM_WORLD.Get_rank() == 0 else None, root=0)


if __name__ == "__main__":
    print(new_secret())
