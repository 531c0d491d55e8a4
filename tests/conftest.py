import os
import signal
import time
from pathlib import Path

import pytest
import torch

# Keep CPU tests deterministic and light on a 2-core machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """BF16 reference images (ditrun's cache, under $XDG_CACHE_HOME) go to this session's temporary
    folder, not the user's ~/.cache; ditrun subprocesses inherit the setting."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous


# Every process a test starts inherits this mark; one still alive after the test (a rank that
# outlived its run, say) is a leak: it would slow every later test down, so the test fails.
LEAK_MARK = "DITRUN_TEST_PROCESS"
LEAK_GRACE_S = 10.0
DAEMONS = (b"slurmctld", b"slurmd", b"slurmstepd", b"munged")
# Helpers that multiprocessing (and inductor's pool of compile workers, on GPUs) start once for the
# test process itself and keep for the session.
SESSION_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"_inductor/compile_worker")


@pytest.fixture(autouse=True)
def _no_leaked_processes(request):
    mark = f"{os.getpid()}-{request.node.nodeid}".encode()
    os.environ[LEAK_MARK] = mark.decode()
    yield
    del os.environ[LEAK_MARK]
    leaked = _marked_processes(mark, time.monotonic() + LEAK_GRACE_S)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leaked, f"processes outlived the test: {leaked}"


def _marked_processes(mark: bytes, deadline: float) -> dict[int, str]:
    """Live processes other than this one whose environment carries ``mark``, waited for until ``deadline``."""
    needle = LEAK_MARK.encode() + b"=" + mark + b"\0"
    while True:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle not in (entry / "environ").read_bytes() + b"\0":
                    continue
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            program = os.path.basename(cmdline.split(b"\0")[0])
            if state != "Z" and not program.startswith(DAEMONS) and not any(h in cmdline for h in SESSION_HELPERS):
                found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
