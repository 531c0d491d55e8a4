"""Each edit's outputs belong to it: no edit id names one of the run's own files, a resumed run redoes an
edit whose PNG or latents are missing or damaged, outputs are on disk before their record, and a results
directory or an input file that cannot be used is one sentence. Every case is the real ``ditrun`` command
on the CPU, with a fault injected from outside: files changed between runs, a file size limit, a
read-only mount, pictures that are not pictures.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import yaml
from ditrun_cli import TINY, ditrun, ditrun_batch, full_quality_dir
from skimage import io

from ditrun.results.files import TEMPORARY_PREFIX, edit_outputs

pytestmark = pytest.mark.slow

COMMON = [*TINY, "wandb.mode=disabled", "progress=false"]
QUICK = [*COMMON, "metrics.ssim=false", "metrics.report=false"]
# Ids that were the names of the run's own files (the report's charts, summary, records), or of a temporary.
CLASHING_IDS = ["dit_time", "ssim", "report", "summary", "edits", "x.tmp.1"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "edits.jsonl").read_text().splitlines()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_outputs_match(out: Path, record: dict) -> None:
    """The record's PNG and latents are in their folders and are the bytes it was written with."""
    assert {field: record[field] for field in ("image", "latents")} == edit_outputs(record["edit"])
    for field in ("image", "latents"):
        assert sha256(out / record[field]) == record["sha256"][field], record[field]


def contents(out: Path) -> dict[str, bytes]:
    """Every result file's bytes (not the lock, which names its last holder, nor Hydra's files and log)."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in out.rglob("*")
        if p.is_file() and p.name not in (".ditrun.lock", "__main__.log") and ".hydra" not in p.relative_to(out).parts
    }


def manifest(folder: Path, ids: list[str], image: str = "skimage:astronaut") -> str:
    path = folder / "edits.yaml"
    path.write_text(yaml.safe_dump([{"id": edit_id, "image": image} for edit_id in ids]))
    return f"workload.manifest={path}"


def test_edit_ids_named_like_the_runs_own_files_keep_their_outputs(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    args = [
        *COMMON,
        "workload.limit=null",
        manifest(tmp_path, CLASHING_IDS),
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
        f"hydra.run.dir={out}",
    ]
    first = ditrun(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (out / "dit_time.png").is_file() and (out / "ssim.png").is_file()  # the report's charts, beside them
    for record in records(out):
        assert_outputs_match(out, record)
        assert io.imread(out / record["image"]).shape == (32, 32, 3)
    # An interrupted write's temporary is removed by the rerun; a user's file that only looks like one is not.
    (out / "images" / f"{TEMPORARY_PREFIX}99.x.png").write_bytes(b"half a picture")
    (out / "notes.tmp.txt").write_text("mine")
    second = ditrun(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"resuming, {len(CLASHING_IDS)} edits already in edits.jsonl are skipped" in second.stdout
    assert sorted(r["edit"] for r in records(out)) == sorted(CLASHING_IDS)
    for record in records(out):
        assert_outputs_match(out, record)
    assert not list(out.rglob(f"{TEMPORARY_PREFIX}*")) and (out / "notes.tmp.txt").read_text() == "mine"
    assert json.loads((out / "summary.json").read_text())["complete"] is True


@pytest.fixture(scope="module")
def three_edits(tmp_path_factory) -> Path:
    """A finished run of three edits, which each test copies and then rewrites or damages."""
    out = tmp_path_factory.mktemp("three") / "run"
    result = ditrun(*QUICK, "workload.limit=3", f"hydra.run.dir={out}", cwd=out.parent)
    assert result.returncode == 0, result.stderr
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_missing_truncated_or_changed_outputs_are_redone_on_resume(tmp_path, three_edits):
    out = copy_of(three_edits, tmp_path)
    args = [*QUICK, "workload.limit=3", f"hydra.run.dir={out}"]
    first = {r["edit"]: r for r in records(out)}
    png = out / first["astronaut"]["image"]
    png.write_bytes(png.read_bytes()[:100])  # truncated
    (out / first["coffee"]["latents"]).unlink()  # deleted
    latents = out / first["chelsea"]["latents"]
    data = bytearray(latents.read_bytes())
    data[-1] ^= 1  # one bit of the last value
    latents.write_bytes(bytes(data))
    rerun = ditrun(*args, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    warnings = [line for line in rerun.stderr.splitlines() if line.startswith("ditrun: warning: edit ")]
    assert sorted(warnings) == sorted(
        [
            "ditrun: warning: edit 'astronaut': images/astronaut.png is damaged (its sha256 differs from the record's); "
            "its record is moved to edits.rejected.jsonl and the edit runs again",
            "ditrun: warning: edit 'chelsea': latents/chelsea.latents.safetensors is damaged (its sha256 differs from "
            "the record's); its record is moved to edits.rejected.jsonl and the edit runs again",
            "ditrun: warning: edit 'coffee': latents/coffee.latents.safetensors is missing; its record is moved to "
            "edits.rejected.jsonl and the edit runs again",
        ]
    )
    assert "resuming" not in rerun.stdout
    redone = {r["edit"]: r for r in records(out)}
    assert sorted(redone) == sorted(first) and len(records(out)) == 3
    for edit, record in redone.items():
        assert_outputs_match(out, record)
        assert record["sha256"] == first[edit]["sha256"]  # the CPU redoes an edit bit for bit
    rejected = [json.loads(line)["edit"] for line in (out / "edits.rejected.jsonl").read_text().splitlines()]
    assert sorted(rejected) == ["astronaut", "chelsea", "coffee"]
    assert json.loads((out / "summary.json").read_text())["complete"] is True


def _strace(log: Path) -> tuple[str, ...]:
    """A prefix recording file syscalls with the paths of their descriptors, or a skip where strace cannot."""
    command = ("strace", "-f", "-qq", "-y", "-e", "trace=fsync,rename,renameat,renameat2,write", "-o", str(log))
    try:
        ok = subprocess.run([*command[:-2], "-o", "/dev/null", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("strace is not available or may not trace here")
    return command


def test_outputs_and_their_folders_are_flushed_before_their_record(tmp_path):
    out, log = tmp_path / "run", tmp_path / "strace.log"
    result = ditrun(*QUICK, "workload.limit=1", f"hydra.run.dir={out}", cwd=tmp_path, prefix=_strace(log))
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()

    def first(pattern: str, after: int = -1) -> int:
        found = next((i for i, call in enumerate(calls) if i > after and re.search(pattern, call)), None)
        assert found is not None, f"no call matching {pattern!r} after line {after}"
        return found

    record = first(r'write\(\d+<[^>]*/edits\.jsonl>, "\{\\"edit\\": \\"astronaut\\"')
    for name in [*edit_outputs("astronaut").values(), "summary.json"]:
        folder, file = (out / name).parent, re.escape(Path(name).name)
        flushed = first(rf"fsync\(\d+<{re.escape(str(folder))}/{re.escape(TEMPORARY_PREFIX)}[0-9a-f]+\.{file}>\)")
        renamed = first(rf'rename[a-z0-9]*\(.*"{re.escape(str(out / name))}"', flushed)
        first(rf"fsync\(\d+<{re.escape(str(folder))}>\)", renamed)  # the folder's entry, after the rename
        if name != "summary.json":
            assert renamed < record, f"{name} was renamed into place after its record was written"


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_a_record_cut_short_by_a_full_disk_is_taken_back_fails_naming_the_file_and_is_redone(tmp_path):
    """A file size limit makes the second record's ``write`` short (then refused): what a full disk does."""
    out = tmp_path / "run"
    # Long prompts (in each record's settings) make a record several times the size of a 32x32 PNG.
    edits = tmp_path / "edits.yaml"
    edits.write_text(
        yaml.safe_dump(
            [{"id": name, "image": f"skimage:{name}", "prompt": f"{name} " * 1000} for name in ("astronaut", "coffee")]
        )
    )
    args = [*QUICK, f"workload.manifest={edits}", "hydra.output_subdir=null", f"hydra.run.dir={out}"]
    assert ditrun(*args, "workload.limit=1", cwd=tmp_path).returncode == 0  # (Hydra's own files are above the limit)
    recorded = (out / "edits.jsonl").stat().st_size
    # run.json (every declared edit's prompt) is rewritten by the rerun with one more edit in its list: let it through.
    limit = max(recorded + 100, (out / "run.json").stat().st_size + 100)
    largest_output = max(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.parent != out)
    assert 2 * largest_output < limit, "the test's limit must let the PNG and latents through"
    assert limit - recorded < recorded, "the test's limit must cut the second record short"
    full = ditrun(*args, cwd=tmp_path, prefix=("prlimit", f"--fsize={limit}"))
    assert full.returncode == 1
    cut = rf"File too large: wrote {limit - recorded} of \d+ bytes to {re.escape(str(out / 'edits.jsonl'))}"
    assert re.search(cut, full.stderr), full.stderr
    # The short write is taken back: no torn record stays, and the space it took is free for the summary.
    assert (out / "edits.jsonl").stat().st_size == recorded
    assert not list(out.glob("coffee*")), "an edit whose record was refused leaves no file"
    rerun = ditrun(*args, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert "line(s) of" not in rerun.stderr and "resuming, 1 edits" in rerun.stdout
    assert [r["edit"] for r in records(out)] == ["astronaut", "coffee"]
    for record in records(out):
        assert_outputs_match(out, record)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` RGB pixels, with (almost) none of them in it."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"\0"))
        + _png_chunk(b"IEND", b"")
    )


def test_an_image_or_a_results_directory_that_cannot_be_used_is_one_sentence(tmp_path):
    """Pictures that cannot be read (too large to decode, a directory, a device) and a file where the results
    directory goes (as hydra.run.dir, below it, as output_dir): each case one sentence, exit 2, nothing written;
    the cases run through the command's entry point in one interpreter."""
    huge = tmp_path / "huge.png"
    huge.write_bytes(_png_header(20000, 20000))
    (tmp_path / "folder.png").mkdir()
    images = [
        (huge, f"image file '{huge}' is too large to decode safely (Image size (400000000 pixels) exceeds limit"),
        (tmp_path / "folder.png", f"image file '{tmp_path / 'folder.png'}' is a directory; give a file."),
        (Path("/dev/zero"), "image file '/dev/zero' is not a regular file (a device, pipe or socket); give a file."),
    ]
    file = tmp_path / "results.txt"
    file.write_text("a file")
    results_dirs = [("hydra.run.dir", file), ("hydra.run.dir", file / "run"), ("output_dir", file)]
    # The directory cases first: a case whose job started leaves the entry point's state of a started job behind.
    cases = [[*QUICK, f"{key}={out}"] for key, out in results_dirs]
    for i, (image, _) in enumerate(images):
        (tmp_path / str(i)).mkdir()
        cases.append(
            [*QUICK, manifest(tmp_path / str(i), ["x"], str(image)), f"hydra.run.dir={tmp_path / str(i) / 'run'}"]
        )
    results = ditrun_batch(cases, tmp_path, timeout=120)
    for i, (result, (_, sentence)) in enumerate(zip(results[len(results_dirs) :], images)):
        assert result.returncode == 2, result.stderr
        assert f"ditrun: error: edit 'x': {sentence}" in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / str(i) / "run" / "edits.jsonl").exists()
    for result, (_, out) in zip(results, results_dirs):
        assert result.returncode == 2, result.stderr
        assert (
            f"ditrun: error: the results directory {out} cannot be made: it, or a folder above it, is a file; set "
            "hydra.run.dir (or output_dir) to a directory."
        ) in result.stderr
        assert "Traceback" not in result.stderr and file.read_text() == "a file"


def _read_only(folder: Path) -> tuple[str, ...]:
    """A prefix under which ``folder`` cannot be written: its mode for a user, a read-only mount for root
    (whom modes do not stop), or a skip where neither can be had."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return ()
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    try:
        ok = (
            subprocess.run(
                ["unshare", "-m", "sh", "-c", script, str(folder), "true"], capture_output=True, timeout=10
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("as root, a read-only directory needs a mount namespace (unshare -m), not allowed here")
    return ("unshare", "-m", "sh", "-c", script, str(folder))


def test_a_read_only_results_directory_is_one_sentence(tmp_path):
    """Given as hydra.run.dir and as output_dir, both through the command's entry point in one interpreter."""
    out = tmp_path / "run"
    out.mkdir()
    for result in ditrun_batch(
        [[*QUICK, f"{key}={out}"] for key in ("hydra.run.dir", "output_dir")], tmp_path, prefix=_read_only(out)
    ):
        assert result.returncode == 2, result.stderr
        assert re.search(
            rf"ditrun: error: the results directory cannot be written \((Read-only file system|Permission "
            rf"denied): {re.escape(str(out))}/\S+\); set hydra.run.dir \(or output_dir\) to a directory this "
            "user can write.",
            result.stderr,
        ), result.stderr
        assert "Traceback" not in result.stderr


def test_images_per_s_counts_only_replicas_that_had_an_edit(tmp_path):
    out = tmp_path / "run"
    result = ditrun(
        *QUICK, "workload.limit=1", "launcher.world=2", "layout.replicas=2", f"hydra.run.dir={out}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world"] == 2 and summary["edits"] == 1
    assert summary["images_per_s"] == pytest.approx(1 / summary["dit_s_median"])  # replica 1 had no edit
