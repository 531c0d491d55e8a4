"""Every GPU test (``-m gpu``, across tests/) file by file, each file in its own pytest process, and one table of
passed / failed / skipped per file.

A kernel that stops the device (an illegal instruction, an illegal address) leaves its process's CUDA context
unusable, so every later test of that process fails with the same error; one process per file keeps such a crash
in the file that caused it, where the table shows it.

    python3 benchmarks/gpu_tests.py [--out DIR] [--jobs N] [--budget-s S] [FILE ...]

Writes ``gpu_tests.md`` (the table, each skip reason once per file) and ``gpu_tests.log`` (every file's pytest
output, one after another) under ``--out``. ``--jobs`` runs that many files at once on the same GPUs (the
compiling tests are bound by the CPU); ``--budget-s`` starts no file past that many seconds, so that the table
comes back from a command with a time limit (the files not started are listed as such).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FileResult:
    """One test file's outcome; ``note`` says why there are no counts (crashed, timed out, not started)."""

    path: str
    collected: int
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    skip_reasons: list[str] = field(default_factory=list)
    note: str = ""
    log: str = ""


def gpu_test_files(paths: list[str]) -> dict[str, int]:
    """The files holding ``gpu`` tests under ``paths``, each with its number of such tests (pytest's collection)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *paths]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    counts: dict[str, int] = defaultdict(int)
    for line in proc.stdout.splitlines():
        if "::" in line:
            counts[line.split("::", 1)[0]] += 1
    if not counts:
        sys.exit(
            f"gpu_tests: no gpu tests collected under {' '.join(paths)}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return dict(counts)


def junit_counts(xml_path: Path, result: FileResult) -> None:
    """``result``'s counts and skip reasons from pytest's JUnit XML."""
    reasons: list[str] = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            result.failed += 1
        elif (skip := case.find("skipped")) is not None:
            result.skipped += 1
            reason = (skip.get("message") or "").removeprefix("Skipped: ")
            if reason not in reasons:
                reasons.append(reason)
        else:
            result.passed += 1
    result.skip_reasons = reasons


def run_file(path: str, collected: int, timeout_s: float) -> FileResult:
    """One file's GPU tests in a fresh interpreter."""
    result = FileResult(path, collected)
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "-rs",
            f"--junitxml={xml_path}",
            path,
        ]
        start = time.monotonic()
        try:
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
            result.log, returncode = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as expired:
            result.log = (
                (expired.stdout or b"").decode(errors="replace")
                if isinstance(expired.stdout, bytes)
                else (expired.stdout or "")
            )
            result.note, returncode = f"timed out after {timeout_s:.0f} s", None
        result.seconds = time.monotonic() - start
        if xml_path.exists():
            junit_counts(xml_path, result)
        elif returncode is not None:
            result.note = f"no result: the process ended with {returncode}"  # killed before pytest reported
    if result.note:  # the tests that did not report count as failed
        result.failed = max(result.failed, collected - result.passed - result.skipped)
    return result


def table(results: list[FileResult], header: str) -> str:
    lines = [
        header,
        "",
        "| file | passed | failed | skipped | s | skipped because |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        why = "; ".join(filter(None, [r.note, *r.skip_reasons]))
        lines.append(f"| {r.path} | {r.passed} | {r.failed} | {r.skipped} | {r.seconds:.0f} | {why} |")
    total = [sum(getattr(r, name) for r in results) for name in ("passed", "failed", "skipped")]
    lines.append(
        f"| all {len(results)} files | {total[0]} | {total[1]} | {total[2]} | {sum(r.seconds for r in results):.0f} | |"
    )
    return "\n".join(lines)


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return f"{torch.cuda.device_count()} x {', '.join(names)}, torch {torch.__version__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["tests"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/gpu")))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--timeout-s", type=float, default=900.0, help="one file's limit")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    files = gpu_test_files(args.paths)
    deadline = time.monotonic() + args.budget_s

    def one(item: tuple[str, int]) -> FileResult:
        path, collected = item
        left = deadline - time.monotonic()
        if left <= 0:
            return FileResult(path, collected, note="not started: --budget-s spent")
        result = run_file(path, collected, min(args.timeout_s, left))
        print(
            f"{path}: {result.passed} passed, {result.failed} failed, {result.skipped} skipped "
            f"({result.seconds:.0f} s) {result.note}",
            flush=True,
        )
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, files.items()))  # collection order: conftest puts the longest files first
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = table(results, f"GPU tests, {stamp}, {device_line()}, {args.jobs} file(s) at a time")
    (args.out / "gpu_tests.md").write_text(text + "\n")
    (args.out / "gpu_tests.log").write_text("".join(f"==== {r.path}\n{r.log}\n" for r in results))
    print(text)
    return 1 if any(r.failed or r.note for r in results) else 0  # a file not started is not a pass


if __name__ == "__main__":
    sys.exit(main())
