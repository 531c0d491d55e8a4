"""Nothing lost, nothing doubled, nothing escapes: stop signals, dead parents, concurrent runs,
torn records, changed settings, unsafe ids, a stuck rank, and a soak of random faults.

Every run is the real ``ditrun`` command in its own session (so that every process it starts can
be found and none can hide), with real spawned gloo ranks on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from launching import SIX, assert_same_latents, ditrun_command, quiet_env, records, run, single_reference, six_edits
from skimage import io as iio

from ditrun.results import rundir
from ditrun.results.files import TEMPORARY_PREFIX

pytestmark = pytest.mark.slow

FAST = ["metrics.ssim=false", "metrics.report=false", "launcher.stop_timeout_s=10"]
# Six edits large enough that a run is still busy when a signal arrives.
SIX_EDITS = ["workload.limit=null", "workload.width=64", "workload.height=64", "workload.steps=6"]
SPAWNED = ["launcher.world=2", "layout=ulysses", *SIX_EDITS]


@pytest.fixture(scope="module")
def six_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("six")
    return single_reference(folder / "single", f"workload.manifest={six_edits(folder)}", *SIX_EDITS, *FAST)


def start(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    """``ditrun`` in a session of its own, output to files."""
    log = open(tmp_path / f"log-{time.monotonic_ns()}.txt", "w")
    return subprocess.Popen(
        ditrun_command(*FAST, *overrides),
        cwd=tmp_path,
        env=quiet_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def session_processes(sid: int) -> list[int]:
    """Pids of every live process of session ``sid`` (zombies are dead: their parent reaps them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_until_gone(sid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while session_processes(sid):
        if time.monotonic() > deadline:
            left = session_processes(sid)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"processes {left} of the run outlived it by {timeout:g} s")
        time.sleep(0.1)


def count_lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def wait_for_records(process: subprocess.Popen, path: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while process.poll() is None and count_lines(path) < n:
        assert time.monotonic() < deadline, f"fewer than {n} records in {path} after {timeout:g} s"
        time.sleep(0.05)


def ranks_of(parent: int) -> list[int]:
    """The spawned ranks: children of ``parent`` started by multiprocessing's spawn."""
    ranks = []
    for pid in session_processes(parent):  # the parent leads its own session
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            ranks.append(pid)
    return ranks


@pytest.mark.timeout(240)
def test_sigterm_to_the_parent_stops_every_rank_and_a_rerun_completes(tmp_path, six_reference):
    out = tmp_path / "run"
    args = [f"workload.manifest={six_edits(tmp_path)}", f"hydra.run.dir={out}", *SPAWNED]
    first = start(tmp_path, *args)
    wait_for_records(first, out / "edits.jsonl", 1)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 128 + signal.SIGTERM
    wait_until_gone(first.pid, 15)  # no rank outlives the parent
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"].startswith("stopped by SIGTERM") and summary["complete"] is False
    assert not list(out.rglob(f"{TEMPORARY_PREFIX}*"))
    second = run(ditrun_command(*FAST, *args), 180, tmp_path)
    assert second.returncode == 0, second.stderr
    assert_same_latents(out, six_reference, "ulysses", 2)


@pytest.mark.timeout(240)
def test_ranks_of_a_killed_parent_stop_within_seconds(tmp_path):
    out = tmp_path / "run"
    first = start(tmp_path, f"workload.manifest={six_edits(tmp_path)}", f"hydra.run.dir={out}", *SPAWNED)
    wait_for_records(first, out / "edits.jsonl", 1)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    wait_until_gone(first.pid, 30)


@pytest.mark.timeout(120)
def test_a_held_directory_is_refused_before_any_work(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock = rundir.RunLock(out).acquire()
    try:
        busy = run(ditrun_command(*FAST, f"hydra.run.dir={out}"), 90, tmp_path)
    finally:
        lock.release()
    assert busy.returncode == 2
    assert f"results directory {out} is in use by another ditrun run (host " in busy.stderr
    assert not (out / "edits.jsonl").exists()
    again = run(ditrun_command(*FAST, f"hydra.run.dir={out}"), 90, tmp_path)
    assert again.returncode == 0, again.stderr


@pytest.mark.timeout(60)
def test_a_run_refused_before_the_holder_names_itself_still_names_it(tmp_path):
    """The holder writes its name into the lock file just after taking the lock; a run refused in between waits
    for the name instead of reporting an unknown holder (seen once with two jobs on two Slurm nodes)."""
    lock_file = str(tmp_path / rundir.LOCK_FILE)
    holder = (
        f"import fcntl, os, time; fd = os.open({lock_file!r}, os.O_RDWR | os.O_CREAT);"
        "fcntl.lockf(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); print('locked', flush=True); time.sleep(0.3);"
        "os.write(fd, b'host elsewhere pid 1'); time.sleep(30)"
    )
    other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        with pytest.raises(rundir.DirectoryBusy, match=r"in use by another ditrun run \(host elsewhere pid 1\)"):
            rundir.RunLock(tmp_path).acquire()
    finally:
        other.kill()
        other.wait(timeout=10)


@pytest.mark.timeout(240)
def test_runs_started_at_once_in_one_directory_never_record_an_edit_twice(tmp_path):
    out = tmp_path / "run"
    args = [f"workload.manifest={six_edits(tmp_path)}", "workload.limit=null", f"hydra.run.dir={out}"]
    both = [start(tmp_path, *args, "launcher.world=2", "layout=ulysses"), start(tmp_path, *args)]
    codes = [p.wait(timeout=200) for p in both]
    assert sorted(codes) in ([0, 0], [0, 2]), codes  # one waits its turn (and finds all done) or is refused
    assert sorted(r["edit"] for r in records(out)) == sorted(SIX)


@pytest.fixture(scope="module")
def two_edits(tmp_path_factory) -> Path:
    """A finished run of two edits, which each test copies and then damages or reruns."""
    out = tmp_path_factory.mktemp("two") / "run"
    result = run(ditrun_command(*FAST, "workload.limit=2", f"hydra.run.dir={out}"), 120, out.parent)
    assert result.returncode == 0, result.stderr
    return out


def test_torn_and_foreign_lines_are_set_aside_and_their_edits_redone(tmp_path, two_edits):
    out = tmp_path / "run"
    shutil.copytree(two_edits, out)
    args = ["workload.limit=2", f"hydra.run.dir={out}"]
    edits = out / "edits.jsonl"
    text = edits.read_text()
    edits.write_text('{"not": "a record"}\n' + text[:-60])  # a foreign line, and a crash mid-write
    rerun = run(ditrun_command(*FAST, *args), 120, tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert "2 line(s) of" in rerun.stderr and "moved to edits.rejected.jsonl" in rerun.stderr
    assert "resuming, 1 edits already in edits.jsonl are skipped" in rerun.stdout
    assert len(records(out)) == 2 and len({r["edit"] for r in records(out)}) == 2
    rejected = (out / rundir.REJECTED_FILE).read_text().splitlines()
    assert rejected[0] == '{"not": "a record"}' and len(rejected) == 2
    assert json.loads((out / "summary.json").read_text())["complete"] is True


def test_a_rerun_with_other_settings_is_refused_naming_them(tmp_path, two_edits):
    out = tmp_path / "run"
    shutil.copytree(two_edits, out)
    changed = run(ditrun_command(*FAST, f"hydra.run.dir={out}", "workload.steps=3", "workload.seed=5"), 90, tmp_path)
    assert changed.returncode == 2
    assert (
        "belongs to a run with other settings (workload.seed: 0 recorded, 5 now; workload.steps: 2 recorded, 3 now)"
    ) in changed.stderr
    assert "Traceback" not in changed.stderr


def test_an_image_file_changed_under_its_recorded_path_is_refused_naming_it(tmp_path):
    """The directory's settings name an image file by its path; each record holds its content's hash."""
    image, out = tmp_path / "photo.png", tmp_path / "run"
    iio.imsave(image, np.zeros((32, 32, 3), np.uint8), check_contrast=False)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump([{"id": "photo", "image": str(image)}]))
    args = [*FAST, f"workload.manifest={manifest}", f"hydra.run.dir={out}"]
    assert run(ditrun_command(*args), 120, tmp_path).returncode == 0
    iio.imsave(image, np.full((32, 32, 3), 200, np.uint8), check_contrast=False)
    changed = run(ditrun_command(*args), 90, tmp_path)
    assert changed.returncode == 2
    assert "edits.jsonl holds edit 'photo' made with other settings (edit.image: " in changed.stderr


UNSAFE_IDS = ["../../escape", "sub/x", ".hidden"]


def test_an_edit_id_that_is_not_a_file_stem_is_refused(tmp_path):
    """The command refuses the id that climbs out, writing nothing; every other kind of unsafe id meets the same
    check, which the resolution of the workload (what the command runs first) shows for each."""
    from omegaconf import OmegaConf

    from ditrun.config import WorkloadConfig
    from ditrun.workload.edit import WorkloadError
    from ditrun.workload.manifest import resolve_edits

    for edit_id in UNSAFE_IDS:
        workload = OmegaConf.merge(
            OmegaConf.structured(WorkloadConfig), {"edits": [{"id": edit_id, "image": "skimage:astronaut"}]}
        )
        with pytest.raises(WorkloadError, match=f"edit id {re.escape(repr(edit_id))} is not a file stem"):
            resolve_edits(workload)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump([{"id": UNSAFE_IDS[0], "image": "skimage:astronaut"}]))
    out = tmp_path / "a" / "b" / "run"
    result = run(ditrun_command(*FAST, f"workload.manifest={manifest}", f"hydra.run.dir={out}"), 90, tmp_path)
    assert result.returncode == 2
    assert f"edit id {UNSAFE_IDS[0]!r} is not a file stem" in result.stderr
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("*.safetensors"))


@pytest.mark.timeout(120)
def test_a_rank_stuck_at_the_end_fails_the_job_naming_it(tmp_path):
    result = run(
        ditrun_command(
            *FAST,
            "launcher.world=2",
            "layout.replicas=2",
            "workload.limit=2",
            "testing.fault.hang_rank=1",
            "launcher.collective_timeout_s=3",
            f"hydra.run.dir={tmp_path / 'run'}",
        ),
        100,
        tmp_path,
    )
    assert result.returncode == 1
    assert "rank 1 made no progress for 3 s (launcher.collective_timeout_s) while rank 0 had finished" in result.stderr


@pytest.mark.timeout(120)
def test_a_stop_signal_while_the_ranks_still_import_stops_the_run(tmp_path, delay_s=0.5):
    """Ctrl-C half a second after the ranks exist: they are still importing torch, so the supervisor
    holds the signal until each rank has its handlers (``rank_entry``), and the run ends stopped, not
    failed (a signal that interrupted an import would end the rank with a traceback and exit 1)."""
    out = tmp_path / "run"
    process = start(tmp_path, *SPAWNED, "launcher.stop_timeout_s=60", f"hydra.run.dir={out}")
    deadline = time.monotonic() + 60
    while process.poll() is None and len(ranks_of(process.pid)) < 2:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.01)
    time.sleep(delay_s)
    os.kill(process.pid, signal.SIGINT)
    assert process.wait(timeout=100) == 128 + signal.SIGINT
    log = next(tmp_path.glob("log-*.txt")).read_text()
    assert "stopped by SIGINT" in log and "Traceback" not in log and "KeyboardInterrupt" not in log


SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGKILL]


@pytest.mark.timeout(400)
def test_soak_random_faults_then_reruns_give_every_edit_once_and_exact(tmp_path, six_reference):
    """Rounds of one random signal to the parent or a random rank at a random moment of a run,
    each followed by a rerun, until a run completes the workload: then every edit is recorded
    once, with the latents of the uninterrupted single-process run."""
    chance = random.Random(8)
    out = tmp_path / "run"
    args = [f"workload.manifest={six_edits(tmp_path)}", f"hydra.run.dir={out}", *SPAWNED]
    for round_ in range(3):
        process = start(tmp_path, *args)
        ranks = wait_for_ranks(process)
        wait_for_records(process, out / "edits.jsonl", count_lines(out / "edits.jsonl") + chance.randint(0, 2))
        time.sleep(chance.uniform(0, 1.5))
        target, sig = chance.choice([process.pid, *ranks]), chance.choice(SIGNALS)
        if process.poll() is None:
            os.kill(target, sig)
        code = process.wait(timeout=120)
        wait_until_gone(process.pid, 30)
        print(f"round {round_}: {sig.name} to {'the parent' if target == process.pid else 'a rank'}: exit {code}")
        found = [r["edit"] for r in records(out)] if (out / "edits.jsonl").exists() else []
        assert len(found) == len(set(found)), f"an edit recorded twice after round {round_}: {found}"
        if code == 0:
            break
    final = run(ditrun_command(*FAST, *args), 180, tmp_path)
    assert final.returncode == 0, final.stderr
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert_same_latents(out, six_reference, "ulysses", 2)


def wait_for_ranks(process: subprocess.Popen, timeout: float = 60) -> list[int]:
    """The ranks' pids once both are running (or [] if the run ended first)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and len(ranks_of(process.pid)) < 2:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    return ranks_of(process.pid)
