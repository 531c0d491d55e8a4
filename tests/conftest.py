import os
import signal
import time
from pathlib import Path

import pytest
import torch

# One intra-op thread per process, for the tests and, through OMP_NUM_THREADS, every process they start (ditrun
# commands, ranks, Slurm jobs): `make test` runs two files at once on 2 cores, each starting processes of its own, and
# threads beyond the cores spin against each other (a tiny ditrun run beside another: 4.0 s of CPU with one thread,
# 5.8-7.5 s with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Seconds each file's tests take on 2 cores (`make test --durations=0`; files under 10 s left out). `make
# test` runs two xdist workers with `--dist loadfile --no-loadscope-reorder`: workers take whole files in
# collection order, so the collection puts the longest files first and the short ones fill in at the
# end (longest first). xdist's own order, by number of tests, could leave a long file for last.
FILE_SECONDS = {
    "test_slurm.py": 140,
    "test_stop_phases.py": 127,
    "test_launchers.py": 119,
    "test_slurm_nodes.py": 116,
    "test_run_directory.py": 93,
    "test_reliability.py": 92,
    "test_verdicts.py": 62,
    "test_node_faults.py": 56,
    "test_editor_recipe.py": 55,
    "test_compile_cache.py": 53,
    "test_first_hour.py": 51,
    "test_kernel_builds.py": 50,
    "test_copy_engine.py": 49,
    "test_layouts.py": 44,
    "test_trust.py": 43,
    "test_run_outputs.py": 40,
    "test_warm.py": 37,
    "test_compile.py": 36,
    "test_multinode_launchers.py": 36,
    "test_bad_inputs.py": 29,
    "test_wandb.py": 25,
    "test_step_cache.py": 22,
    "test_editor.py": 22,
    "test_precision_layouts.py": 20,
    "test_sweep_failures.py": 19,
    "test_metrics.py": 18,
    "test_launch_ranks.py": 17,
    "test_report.py": 12,
    "test_store_trust.py": 11,
    "test_cli.py": 11,
    "test_choice.py": 11,
    "test_quantized_exchange.py": 11,
}  # its tests one by one, summed


def pytest_terminal_summary(terminalreporter):
    """One line per tier that did not run (``tiers.missing``), and how to get it."""
    from tiers import NOT_RUN

    for tier, reason in NOT_RUN.items():
        terminalreporter.write_line(f"the {tier} tier did not run: {reason}")


def pytest_collection_modifyitems(config, items):
    # a stable sort: the tests of a file stay together and in their order
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """BF16 reference images (ditrun's cache, under $XDG_CACHE_HOME) go to this pytest run's temporary
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
