"""The rendezvous store lets no stranger in: values sealed with the job's secret, the secret kept private,
a local run's sockets on loopback, and a second user of the machine unable to stop a running job.

A real TCPStore serves every test here; the stranger is a second real user of this machine (``useradd``)
where the tests run as root."""

import hashlib
import hmac
import os
import pwd
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from ditrun_cli import TINY
from tiers import missing

from ditrun.errors import UserError
from ditrun.launch import env, secret
from ditrun.launch.sealed import NONCE_BYTES, TAG_BYTES, SealedStore, StoreTimeout

STRANGER = "ditrun-stranger"
SECRET = bytes(range(32))


def serve(timeout_s=5.0):
    port = env.free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=timeout_s))
    return server, port


def stranger_connection(port, timeout_s=5.0):
    """What another user gets by connecting: the raw store, no secret."""
    return dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=timeout_s))


def test_a_value_is_the_hmac_of_key_nonce_and_value_under_the_secret():
    server, _ = serve()
    SealedStore(server, SECRET).set("ditrun/x", "hello")
    stored = bytes(server.get("ditrun/x"))
    nonce = stored[TAG_BYTES : TAG_BYTES + NONCE_BYTES]
    # the tag's definition, computed here independently of the store's code
    expected = hmac.new(SECRET, b"ditrun/x\0" + nonce + b"hello", hashlib.sha256).digest()
    assert stored == expected + nonce + b"hello"
    assert SealedStore(server, SECRET).get("ditrun/x") == b"hello"


def test_a_strangers_values_are_absent_to_the_job(capfd):
    server, port = serve(timeout_s=1.0)
    job, stranger = SealedStore(server, SECRET), stranger_connection(port)
    stranger.set("ditrun/stop_requested", "15\tinjected")
    assert not job.check(["ditrun/stop_requested"])
    assert job.forged("ditrun/stop_requested")
    assert "ditrun/stop_requested" in capfd.readouterr().err
    with pytest.raises(StoreTimeout, match="stop_requested"):
        job.get("ditrun/stop_requested")
    with pytest.raises(StoreTimeout):
        job.wait(["ditrun/stop_requested"], timedelta(seconds=0.3))
    # a value sealed with another secret (a rank of another job) is a stranger's too
    SealedStore(server, b"\1" * 32).set("ditrun/other", "x")
    assert not job.check(["ditrun/other"])


def test_a_genuine_write_replaces_a_forgery_and_a_wait_sees_it():
    server, port = serve()
    job, stranger = SealedStore(server, SECRET), stranger_connection(port)
    stranger.set("ditrun/stop", "failed\t1\tinjected")
    later = threading.Timer(0.3, lambda: SealedStore(server.clone(), SECRET).compare_set("ditrun/stop", "", "done"))
    later.start()
    assert job.get("ditrun/stop") == b"done"  # waited past the forgery for the genuine value
    later.join()
    # compare_set against a genuine value follows TCPStore's rule: the current value comes back, unchanged
    assert job.compare_set("ditrun/stop", "", "failed") == b"done"
    assert job.compare_set("ditrun/stop", "done", "again") == b"again"
    stranger.set("ditrun/count", "1000")
    assert job.add("ditrun/count", 2) == 2  # a forged counter counts as absent
    assert job.add("ditrun/count", 0) == 2


def test_adds_from_several_connections_lose_no_increment():
    server, _ = serve()
    stores = [SealedStore(server.clone(), SECRET) for _ in range(3)]

    def bump(store):
        for _ in range(40):
            store.add("ditrun/n", 1)

    threads = [threading.Thread(target=bump, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert SealedStore(server, SECRET).add("ditrun/n", 0) == 120


def test_the_secret_comes_from_the_environment_or_the_users_private_file(tmp_path):
    assert secret.job_secret({secret.ENV: "ab" * 32}) == bytes([0xAB]) * 32
    with pytest.raises(UserError, match="DITRUN_JOB_SECRET must be 64 hex digits"):
        secret.job_secret({secret.ENV: "abc"})
    environ = {"XDG_CONFIG_HOME": str(tmp_path), "SLURM_JOB_ID": "7"}
    first = secret.job_secret(environ, address="node1:29500")
    path = tmp_path / "ditrun" / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    user = bytes.fromhex(path.read_text().strip())
    identity = "\n".join(f"{name}={environ.get(name, '')}" for name in secret.JOB_IDENTITY_VARS)
    assert first == hmac.new(user, f"ditrun job\n{identity}\nnode1:29500".encode(), hashlib.sha256).digest()
    assert secret.job_secret(environ, address="node1:29500") == first  # every rank of the job computes it alike
    assert secret.job_secret({**environ, "SLURM_JOB_ID": "8"}, address="node1:29500") != first


def test_a_secret_file_others_could_read_or_plant_is_refused(tmp_path):
    path = secret.secret_file({"XDG_CONFIG_HOME": str(tmp_path)})
    path.parent.mkdir(parents=True)
    path.write_text("cd" * 32)
    path.chmod(0o644)
    with pytest.raises(UserError, match=r"mode -rw-r--r--.*chmod 600"):
        secret.user_secret({"XDG_CONFIG_HOME": str(tmp_path)})
    path.unlink()
    (tmp_path / "elsewhere").write_text("cd" * 32)
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):  # O_NOFOLLOW: a planted link is never read
        secret.user_secret({"XDG_CONFIG_HOME": str(tmp_path)})


@pytest.fixture(scope="module")
def stranger():
    """A second ordinary user of this machine."""
    if os.geteuid() != 0:
        missing("second-user", "needs root to create a second user (useradd)")
    try:
        pwd.getpwnam(STRANGER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", STRANGER], check=True)
    return pwd.getpwnam(STRANGER)


def test_a_secret_file_of_another_user_is_refused(tmp_path, stranger):
    path = secret.secret_file({"XDG_CONFIG_HOME": str(tmp_path)})
    path.parent.mkdir(parents=True)
    path.write_text("cd" * 32)
    path.chmod(0o600)
    os.chown(path, stranger.pw_uid, stranger.pw_gid)
    with pytest.raises(UserError, match=f"owned by uid {stranger.pw_uid}"):
        secret.user_secret({"XDG_CONFIG_HOME": str(tmp_path)})


ATTACK = r"""
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
port, seconds, uid, gid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([]); os.setgid(gid); os.setuid(uid)  # the interpreter lies in root's home: drop to the stranger once loaded
deadline, store = time.monotonic() + seconds, None
print("ready", flush=True)
while time.monotonic() < deadline:
    try:
        store = store or dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=2))
        keys = store.list_keys()
        store.set("ditrun/stop_requested", "15\tinjected by another user")
        store.compare_set("ditrun/stop", "", "failed\t0\tinjected by another user")
        for key in [k for k in keys if k.startswith("ditrun/alive/")]:
            store.set(key, "999999")
        store.set("ditrun/decided/planted", '{"value": "x"}')
        print("attacked", flush=True)
    except Exception:
        store = None
    time.sleep(0.1)
"""


def listening_addresses(pids: set[int]) -> list[str]:
    """The local addresses of the TCP sockets that ``pids`` listen on, read from /proc."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1]))
    return found


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def process_tree(root: int) -> set[int]:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(root)], capture_output=True, text=True).stdout
    pids = {root}
    for child in map(int, children.split()):
        pids |= process_tree(child)
    return pids


def _is_loopback(address: str) -> bool:
    import ipaddress

    host = address.rsplit(":", 1)[0].strip("[]")
    return ipaddress.ip_address(host).is_loopback


@pytest.mark.slow
def test_a_second_user_cannot_stop_or_feed_a_local_run(tmp_path, stranger):
    port = env.free_port()
    out = tmp_path / "run"
    attack = subprocess.Popen(
        [sys.executable, "-c", ATTACK, str(port), "240", str(stranger.pw_uid), str(stranger.pw_gid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd="/",
    )
    assert attack.stdout.readline().strip() == "ready"  # connecting from before the store exists
    run = subprocess.Popen(
        [sys.executable, "-m", "ditrun", *TINY, "workload.steps=60", "launcher.world=2", "layout=ulysses"]
        + [f"launcher.master_port={port}", f"hydra.run.dir={out}", "wandb.mode=disabled", "metrics.ssim=false"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    listening = []
    try:
        deadline = time.monotonic() + 240
        while run.poll() is None and time.monotonic() < deadline:
            listening += listening_addresses(process_tree(run.pid))
            time.sleep(0.5)
        output = run.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    finally:
        run.kill()
        attack.kill()
    attacks = attack.communicate(timeout=30)[0]
    assert run.returncode == 0, output[-3000:]
    assert "ignored the store key 'ditrun/stop_requested'" in output, output[-3000:]
    assert attacks.count("attacked") >= 3, attacks  # the stranger did reach the store, again and again
    assert len((out / "edits.jsonl").read_text().splitlines()) == 2
    assert f"127.0.0.1:{port}" in listening
    assert listening and all(map(_is_loopback, listening)), listening
