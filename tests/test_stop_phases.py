"""A stop in every phase of a run, and a frozen rank of either index, through the real command.

Each stop lands inside its phase deterministically: ``testing.fault.pause_in=<phase>`` makes a
rank say ``paused in <phase>`` and then sleep there, as a phase of hours would compute, and the
signal is sent once the log says so. A frozen rank is ``testing.fault.freeze_rank`` (the rank
sends itself SIGSTOP mid-edit). Every run is in a session of its own, and every test fails if a
process of it outlives the run (``wait_until_gone``, ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from launching import ditrun_command, quiet_env, run
from PIL import Image
from test_reliability import wait_until_gone

pytestmark = pytest.mark.slow

FAST = ["metrics.report=false", "launcher.stop_timeout_s=60"]
SPAWNED = ["launcher.world=2", "layout=ulysses"]


def start(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """``ditrun`` in a session of its own; its output goes to the returned log file."""
    log = tmp_path / f"log-{time.monotonic_ns()}.txt"
    process = subprocess.Popen(
        ditrun_command(*FAST, f"hydra.run.dir={tmp_path / 'run'}", *overrides),
        cwd=tmp_path,
        env=quiet_env(),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process, log


def wait_for_line(process: subprocess.Popen, log: Path, text: str, timeout: float = 200) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before {text!r}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout:g} s:\n{log.read_text()}"
        time.sleep(0.1)


def assert_stopped(process: subprocess.Popen, log: Path, out: Path, sig: signal.Signals) -> None:
    """The run ended as a stopped run does: exit 128 + N, its summary, the resume sentence, no rank left."""
    assert process.wait(timeout=120) == 128 + sig, log.read_text()
    wait_until_gone(process.pid, 15)
    text = log.read_text()
    assert f"stopped by {sig.name}" in text and "rerun the same command to resume" in text, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"].startswith(f"stopped by {sig.name}") and summary["complete"] is False


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "phase, sig, overrides",
    [
        ("references", signal.SIGINT, []),
        ("references", signal.SIGTERM, ["launcher.world=2", "layout.replicas=2"]),
        ("build", signal.SIGINT, [*SPAWNED, "metrics.ssim=false"]),
        ("compile", signal.SIGTERM, [*SPAWNED, "model.compile=on", "metrics.ssim=false"]),
    ],
    ids=["references-one-process", "references-two-replicas", "build-ulysses", "compile-ulysses"],
)
def test_a_stop_signal_inside_a_phase_stops_the_run(tmp_path, phase, sig, overrides):
    process, log = start(
        tmp_path, f"testing.fault.pause_in={phase}", f"metrics.full_quality_dir={tmp_path / 'refs'}", *overrides
    )
    wait_for_line(process, log, f"paused in {phase}")
    process.send_signal(sig)
    assert_stopped(process, log, tmp_path / "run", sig)


@pytest.mark.timeout(300)
def test_a_stop_signal_while_rank_0_encodes_the_prompts_stops_every_rank(tmp_path):
    """A pipeline folder's text encoders run on rank 0 while rank 1 waits for their output."""
    from test_diffusers_parity import REF, _pipeline_folder, _pipeline_overrides

    _pipeline_folder(tmp_path / "kontext", guidance_embeds=False)
    Image.fromarray((np.random.default_rng(4).random((REF, REF, 3)) * 255).astype(np.uint8)).save(tmp_path / "r.png")
    process, log = start(
        tmp_path, *_pipeline_overrides(tmp_path, tmp_path / "prompts"), *SPAWNED, "testing.fault.pause_in=prompts"
    )
    wait_for_line(process, log, "paused in prompts")
    process.send_signal(signal.SIGTERM)
    assert_stopped(process, log, tmp_path / "run", signal.SIGTERM)
    assert not list((tmp_path / "prompts").glob("*.safetensors"))


@pytest.mark.timeout(300)
def test_a_stop_signal_to_one_rank_ends_the_others_inside_their_phase(tmp_path):
    """SIGTERM to rank 1 alone while both ranks build their model: rank 0 hears of it through the store
    and its build ends too; the parent was sent nothing."""
    process, log = start(tmp_path, *SPAWNED, "metrics.ssim=false", "testing.fault.pause_in=build")
    pids = [paused_pid(process, log, rank, "build") for rank in (0, 1)]
    os.kill(pids[1], signal.SIGTERM)
    assert_stopped(process, log, tmp_path / "run", signal.SIGTERM)


def paused_pid(process: subprocess.Popen, log: Path, rank: int, phase: str) -> int:
    """The pid of ``rank`` once it says it is paused in ``phase``."""
    wait_for_line(process, log, f"rank {rank} (pid ")
    found = re.search(rf"rank {rank} \(pid (\d+)\) paused in {phase}", log.read_text())
    assert found, log.read_text()
    return int(found.group(1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("frozen", [0, 1])
def test_a_frozen_rank_fails_the_job_naming_it(tmp_path, frozen):
    """A rank that stops itself mid-edit (SIGSTOP: alive, silent, its connections open). Rank 0 also
    serves the rendezvous store: the other rank's requests to it go unanswered, and are bounded too."""
    process, log = start(
        tmp_path,
        *SPAWNED,
        "launcher.collective_timeout_s=5",
        "workload.steps=3",
        "metrics.ssim=false",
        f"testing.fault.freeze_rank={frozen}",
        "testing.fault.crash_at_step=1",
    )
    assert process.wait(timeout=200) == 1, log.read_text()
    wait_until_gone(process.pid, 15)
    last = log.read_text().strip().splitlines()[-1]
    other = 1 - frozen
    named = (
        f"rank 0 on {os.uname().nodename}, which serves the rendezvous store, stopped answering"
        if frozen == 0
        else f"lost rank 1 on {os.uname().nodename}"
    )
    assert last.startswith(f"ditrun: rank {other} failed: NodeLost: {named}"), log.read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "frozen, pause_rank",
    [(0, 0), (1, 1), (0, None)],
    ids=["rank-0-frozen-rank-1-waits", "rank-1-frozen-rank-0-waits", "rank-0-frozen-rank-1-works"],
)
def test_a_rank_frozen_between_phases_is_named(tmp_path, frozen, pause_rank):
    """A rank builds its model (paused there, its heartbeat going), then freezes (SIGSTOP). The other rank
    either waits for it at the barrier after the build, which has no deadline of its own (rank 0 watches
    rank 1's heartbeat, rank 1 asks rank 0's store), or is still building alone itself, where only its
    heartbeat, asking rank 0's store, can notice."""
    pause = [] if pause_rank is None else [f"testing.fault.pause_rank={pause_rank}"]
    process, log = start(
        tmp_path,
        *SPAWNED,
        "launcher.collective_timeout_s=5",
        "testing.fault.pause_in=build",
        "metrics.ssim=false",
        *pause,
    )
    pid = paused_pid(process, log, frozen, "build")
    if pause_rank is None:
        paused_pid(process, log, 1 - frozen, "build")
    try:
        os.kill(pid, signal.SIGSTOP)
        assert process.wait(timeout=200) == 1, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the parent has killed it already, unless the test failed
            os.kill(pid, signal.SIGKILL)
    wait_until_gone(process.pid, 15)
    last = log.read_text().strip().splitlines()[-1]
    named = (
        f"rank 0 on {os.uname().nodename}, which serves the rendezvous store, stopped answering"
        if frozen == 0
        else f"lost rank 1 on {os.uname().nodename}: no heartbeat for 5 s"
    )
    assert last.startswith(f"ditrun: rank {1 - frozen} failed: NodeLost: {named}"), log.read_text()


@pytest.mark.timeout(300)
def test_ranks_killed_after_the_stop_timeout_leave_a_stopped_run_never_a_successful_one(tmp_path):
    """A rank that does not stop (hung after its edits, where no stop point is) is killed after
    launcher.stop_timeout_s; the command says so and exits as stopped, never 0."""
    process, log = start(
        tmp_path,
        "launcher.world=2",
        "layout.replicas=2",
        "workload.limit=2",
        "testing.fault.hang_rank=1",
        "launcher.stop_timeout_s=3",
        "metrics.ssim=false",
    )
    deadline = time.monotonic() + 200
    out = tmp_path / "run"
    while not all(
        (out / name).is_file() and (out / name).read_text().count("\n")
        for name in ("edits.jsonl", "edits.replica1.jsonl")
    ):  # each replica's one edit is done: rank 1 hangs
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()
    wait_until_gone(process.pid, 15)
    assert "killed after 3 s, launcher.stop_timeout_s); rerun the same command to resume" in log.read_text()


def test_an_unknown_pause_phase_is_one_sentence_before_any_rank_starts(tmp_path):
    result = run(
        ditrun_command(
            "launcher.world=2", "layout=ulysses", "testing.fault.pause_in=warmup", f"hydra.run.dir={tmp_path / 'run'}"
        ),
        90,
        tmp_path,
    )
    assert result.returncode == 2
    assert (
        "ditrun: error: testing.fault.pause_in=warmup is not a phase; allowed: prompts, references, build, compile."
    ) in result.stderr
    assert not (tmp_path / "run" / "edits.jsonl").exists()
