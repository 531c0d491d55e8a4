"""Running the ``ditrun`` command as a user does, for the metrics, W&B and report tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# What the default precision is called in records: the compute dtype (bf16 on a GPU, fp32 on a CPU).
PLAIN = "bf16" if torch.cuda.is_available() else "fp32"
# A run small enough for a busy 2-core machine: 2 edits of 32x32, 2 denoising steps.
TINY = ["model=tiny", "workload.width=32", "workload.height=32", "workload.steps=2", "workload.limit=2"]


def ditrun(*args, cwd, env=None, timeout=200, prefix=(), unset=()):
    """Run the command; ``env`` adds variables, ``unset`` removes those whose names start with one of its prefixes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env = {k: v for k, v in env.items() if not k.startswith(tuple(unset))}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "ditrun", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def without_network() -> tuple[str, ...]:
    """A command prefix that runs in a network namespace with no interfaces, where this machine allows it
    (root, or unprivileged user namespaces); empty elsewhere."""
    try:
        ok = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return ("unshare", "-n") if ok else ()


def full_quality_dir(tmp_path_factory) -> str:
    """One cache of full-quality outputs for the whole test session, so each is made once."""
    return str(tmp_path_factory.getbasetemp() / "references")


def strace_prefix(log) -> tuple[str, ...]:
    """A command prefix recording every connect/send system call of the command and its children (Python
    or not: W&B's wandb-core is a Go binary) into ``log``, where strace exists and may trace; empty elsewhere."""
    try:
        ok = (
            subprocess.run(
                ["strace", "-f", "-qq", "-e", "trace=connect", "true"], capture_output=True, timeout=10
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        ok = False
    return ("strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(log)) if ok else ()


def ditrun_batch(cases: list[list[str]], cwd, timeout=200, prefix=()) -> list[subprocess.CompletedProcess]:
    """Each argument list of ``cases`` through the command's entry point, all in one interpreter
    (``cli_batch.py``): a table of refusals costs one start-up. One result per case, as ``ditrun`` gives."""
    cases_file = Path(cwd) / "cli-cases.json"
    cases_file.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [*prefix, sys.executable, str(Path(__file__).with_name("cli_batch.py")), str(cases_file)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [result["args"] for result in results] == cases, proc.stdout[-3000:]
    return [subprocess.CompletedProcess(r["args"], r["exit"], r["stdout"], r["stderr"]) for r in results]
