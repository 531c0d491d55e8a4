"""A real offline W&B run, read back from the record file W&B wrote (no mocks, no network)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ditrun_cli import PLAIN, TINY, ditrun, full_quality_dir, strace_prefix, without_network
from wandb_files import _items, read_records

from ditrun.metrics.wandb import SERVER_CHECK_S

pytestmark = pytest.mark.slow

NET_AUDIT = Path(__file__).parent / "netaudit"

SECRET = "0123456789abcdef0123456789abcdef01234567"  # looks like an API key; must never be written


def run_contents(run_dir):
    """(run record, config, history rows, final summary, exit code) of the one W&B run under ``run_dir``."""
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    by_type = {}
    for record in read_records(files[0]):
        by_type.setdefault(record.WhichOneof("record_type"), []).append(record)
    run = by_type["run"][0].run
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    history = [_items(r.history.item) for r in by_type["history"]]
    summary = {}
    for r in by_type.get("summary", []):
        summary.update(_items(r.summary.update))
    return run, config, history, summary, by_type["exit"][0].exit.exit_code


@pytest.mark.timeout(300)
def test_offline_run_holds_config_history_table_images_and_summary(tmp_path, tmp_path_factory):
    # Where the machine allows it, with no network at all: offline must not need one.
    out = tmp_path / "run"
    proc = ditrun(
        *TINY,
        "wandb.images=1",
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        env={"WANDB_API_KEY": SECRET},
        prefix=without_network(),
    )
    assert proc.returncode == 0, proc.stderr
    summary_json = json.loads((out / "summary.json").read_text())
    assert f"W&B offline run: {summary_json['wandb']}" in proc.stdout and f"report: {out / 'report.md'}" in proc.stdout
    records = [json.loads(line) for line in (out / "edits.jsonl").read_text().splitlines()]

    run, config, history, summary, exit_code = run_contents(out)
    assert (run.project, run.job_type, run.display_name) == ("ditrun", "single", f"single-{PLAIN}-collective-w1")
    assert set(run.tags) == {f"precision:{PLAIN}", "transport:collective"}
    assert config["model"]["preset"] == "tiny" and config["workload"]["steps"] == 2
    assert config["wandb"]["mode"] == "offline" and config["metrics"]["ssim"] is True

    per_edit = [row for row in history if "dit_s" in row]
    assert [row["dit_s"] for row in per_edit] == [r["dit_s"] for r in records]
    assert [row["ssim_pct_of_rerun"] for row in per_edit] == [r["ssim_pct_of_rerun"] for r in records]
    media = next(row for row in history if "edits/_type" in row)
    assert media["edits/_type"] == "table-file" and media["edits/nrows"] == len(records)
    assert media["images/astronaut/captions"] == [
        "output",
        f"full-quality reference ({PLAIN})",
        "SSIM map (1.0000): identical everywhere",
    ]
    assert not any(key.startswith("images/coffee") for key in media)  # wandb.images=1: the first edit only
    table = next(out.glob("wandb/offline-run-*/files/media/table/edits_*.table.json"))
    assert [row[0] for row in json.loads(table.read_text())["data"]] == [r["edit"] for r in records]

    assert summary["dit_s_median"] == summary_json["dit_s_median"]
    assert summary["ssim_median"] == 1.0 and summary["exposed_transfer_pct_median"] == 0.0
    assert exit_code == 0

    for path in out.rglob("*"):  # the key is in the environment, and nowhere in the results
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.timeout(300)
def test_disabled_mode_writes_no_wandb_directory(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    proc = ditrun(
        *TINY,
        "workload.limit=1",
        "wandb.mode=disabled",
        "metrics.report=false",
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (out / "wandb").exists() and "W&B" not in proc.stdout
    assert json.loads((out / "summary.json").read_text())["wandb"] is None


def _audit_env(log) -> dict:
    """Every Python process of the run (ranks, W&B's helpers) loads tests/netaudit/sitecustomize.py, whose
    audit hook writes each non-loopback, non-Unix-socket name lookup, connect or send to ``log``."""
    path = os.pathsep.join(p for p in (str(NET_AUDIT), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "DITRUN_NET_AUDIT": str(log)}


def test_the_network_audit_hook_sees_an_attempt(tmp_path):
    log = tmp_path / "audit.jsonl"
    code = "import socket\ntry: socket.getaddrinfo('api.wandb.ai', 443)\nexcept OSError: pass"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **_audit_env(log)}, timeout=60, check=True)
    assert [json.loads(line)["host"] for line in log.read_text().splitlines()] == ["api.wandb.ai"]


# A connect/send system call to an IPv4/IPv6 address that is not loopback, or to any DNS server (port 53,
# a local stub resolver included: a name lookup is an attempt to reach another machine).
_REMOTE_SYSCALL = re.compile(
    r"sa_family=AF_INET6?, .*?(inet_addr|inet_pton)\((AF_INET6, )?\"(?!127\.|::1\"|::ffff:127\.)"
    r"|sa_family=AF_INET6?, sin6?_port=htons\(53\)"
)


@pytest.mark.timeout(300)
def test_default_offline_run_makes_no_network_attempt(tmp_path):
    """The default settings, with no WANDB_* variable set: no name lookup, connect or send to another
    machine from any Python process (audit hook) nor, where strace runs, from any process at all
    (wandb-core included), under a network namespace with no interfaces where the machine allows one."""
    audit, trace = tmp_path / "audit.jsonl", tmp_path / "strace.txt"
    out = tmp_path / "run"
    proc = ditrun(
        *TINY,
        "workload.limit=1",
        "workload.steps=1",
        "metrics.ssim=false",
        "metrics.report=false",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        env=_audit_env(audit),
        unset=("WANDB_",),
        prefix=(*without_network(), *strace_prefix(trace)),
    )
    assert proc.returncode == 0, proc.stderr
    assert list(out.glob("wandb/offline-run-*/run-*.wandb")), "the offline W&B run was not written"
    attempts = audit.read_text().splitlines() if audit.exists() else []
    assert attempts == [], attempts
    if trace.exists():
        remote = [line for line in trace.read_text().splitlines() if _REMOTE_SYSCALL.search(line)]
        assert remote == [], remote


@pytest.mark.timeout(300)
def test_online_without_a_key_logs_offline_and_a_rerun_with_nothing_left_adds_no_run(tmp_path, tmp_path_factory):
    out = tmp_path / "run"

    def run():
        return ditrun(
            *TINY,
            "wandb.mode=online",
            f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
            f"hydra.run.dir={out}",
            cwd=tmp_path,
            env={"HOME": str(tmp_path), "NETRC": str(tmp_path / "no-netrc")},
            unset=("WANDB_API_KEY",),
            prefix=without_network(),
        )

    proc = run()
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "wandb.mode=online" in line]
    assert len(warnings) == 1 and "there is no W&B API key here" in warnings[0] and "wandb sync" in warnings[0]
    assert json.loads((out / "summary.json").read_text())["wandb_mode"] == "offline"
    assert len(list(out.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    again = run()  # every edit done and in the offline run, which ended: nothing to add
    assert again.returncode == 0, again.stderr
    assert "resuming, 2 edits already in edits.jsonl are skipped" in again.stdout
    assert len(list(out.glob("wandb/offline-run-*"))) == 1
    assert json.loads((out / "summary.json").read_text())["attempt"] == 2


@pytest.mark.timeout(300)
def test_a_stop_signal_while_waiting_for_a_silent_wandb_server_stops_the_run(tmp_path):
    """A server that takes the connection and never answers: SIGTERM during the wait ends the run at once (143),
    before the directory is claimed."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: the client connects and waits for an answer that never comes
    out = tmp_path / "run"
    command = [sys.executable, "-m", "ditrun", *TINY, "wandb.mode=online", f"hydra.run.dir={out}"]
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_API_KEY": SECRET}
    environ["WANDB_BASE_URL"] = f"http://127.0.0.1:{silent.getsockname()[1]}"
    run = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
    )
    try:
        for line in run.stdout:
            if line.startswith("ditrun: asking W&B's server"):
                break
        time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        code = run.wait(timeout=30)
        waited = time.monotonic() - asked
    finally:
        run.kill()
        silent.close()
    assert code == 128 + signal.SIGTERM, run.stderr.read()
    assert waited < SERVER_CHECK_S, waited  # not the server's timeout: the signal ended the wait
    assert not (out / "run.json").exists()  # stopped before the directory was claimed
