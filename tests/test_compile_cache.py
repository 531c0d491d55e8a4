"""``model.compile_cache`` (``run/compile_cache.py``): a later process on a fresh node loads what the first
compiled, a bad entry is discarded with a warning, and writers running at once leave one whole entry.

Each job is a real process (``compile_cache_job.py``: a small model through Inductor's CPU code generation) with
its own empty ``TORCHINDUCTOR_CACHE_DIR``, as a job that lands on a fresh node has.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from launching import ditrun_command, quiet_env, run, tiny_config

from ditrun import timers
from ditrun.errors import UserError
from ditrun.metrics import timing
from ditrun.model.compile import CompilePlan
from ditrun.run import checks, compile_cache
from ditrun.run.compile_cache import (
    BadEntry,
    CompileCache,
    Entry,
    kernel_folders,
    pack_kernels,
    read_entry,
    unpack_kernels,
    write_entry,
)

JOB = Path(__file__).with_name("compile_cache_job.py")
JOB_TIMEOUT_S = 240
COMPILED = CompilePlan(compile=True, fuse=True)


def _start(folder: Path, inductor: Path, *extra: str) -> subprocess.Popen:
    env = quiet_env(TORCHINDUCTOR_CACHE_DIR=str(inductor))
    return subprocess.Popen(
        [sys.executable, str(JOB), str(folder), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(job: subprocess.Popen) -> dict:
    try:
        out, err = job.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        raise
    assert job.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "console": out + err}


def _job(folder: Path, inductor: Path) -> dict:
    return _finish(_start(folder, inductor))


def _only_entry(folder: Path) -> Path:
    files = sorted(folder.iterdir())
    assert [f.suffix for f in files] == [compile_cache.ENTRY_SUFFIX], files  # no temporary file left either
    return files[0]


@pytest.fixture(scope="module")
def first_jobs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two first jobs at once: no entry, so each compiles, and both write the entry at the same moment."""
    folder, ready = tmp_path_factory.mktemp("compile-cache"), tmp_path_factory.mktemp("ready")
    jobs = [_start(folder, tmp_path_factory.mktemp(f"inductor-first-{i}"), "--together", str(ready)) for i in range(2)]
    return folder, [_finish(job) for job in jobs]


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_two_jobs_writing_at_once_leave_one_whole_entry(first_jobs):
    folder, jobs = first_jobs
    assert [(job["status"], job["wrote"]) for job in jobs] == [("miss", True)] * 2
    assert all(job["fxgraph_cache_miss"] >= 1 and "ditrun: compile cache: wrote" in job["console"] for job in jobs)
    assert jobs[0]["output"] == jobs[1]["output"] and jobs[0]["key"] == jobs[1]["key"]
    assert _only_entry(folder) == Path(jobs[0]["entry"])
    assert read_entry(Path(jobs[0]["entry"]), jobs[0]["key"]).artifacts


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_fresh_node_loads_what_the_first_jobs_wrote(first_jobs, tmp_path):
    folder, (first, _) = first_jobs
    later = _job(folder, tmp_path / "inductor")
    assert (later["status"], later["wrote"], later["entry"]) == ("hit", False, first["entry"])
    assert f"ditrun: compile cache: loaded {first['entry']}" in later["console"]
    # Inductor found every graph in what the entry put into its empty cache: it compiled none.
    assert later["fxgraph_cache_hit"] >= 1 and later["fxgraph_cache_miss"] == 0
    assert later["output"] == first["output"]


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_truncated_entry_is_discarded_with_a_warning_and_written_again(first_jobs, tmp_path):
    source, (first, _) = first_jobs
    folder = tmp_path / "cache"
    shutil.copytree(source, folder)
    entry = _only_entry(folder)
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    job = _job(folder, tmp_path / "inductor")
    assert (job["status"], job["wrote"]) == ("discarded", True)
    assert f"ditrun: warning: compile cache entry {entry} discarded: truncated or corrupt" in job["console"]
    assert job["output"] == first["output"]
    assert read_entry(_only_entry(folder), job["key"]).artifacts  # whole again


@pytest.mark.timeout(120)
def test_an_entry_read_while_two_processes_rewrite_it_is_always_whole(tmp_path):
    """Many writes of entries of 1 to 3 MiB from two processes, read meanwhile: every read is one writer's whole
    entry (the rename replaces it at once), and no temporary file is left."""
    entry = tmp_path / f"k{compile_cache.ENTRY_SUFFIX}"
    code = (
        "import sys; from pathlib import Path; from ditrun.run.compile_cache import Entry, write_entry; "
        "me = int(sys.argv[2]); [write_entry(Path(sys.argv[1]), 'k', {'writer': me}, "
        "Entry(bytes([me]) * (i % 3 + 1) * 2**20)) for i in range(40)]"
    )
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(entry), str(me)], env=quiet_env(), stderr=subprocess.PIPE, text=True
        )
        for me in (1, 2)
    ]
    reads, deadline = set(), time.monotonic() + 100
    while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
        try:
            artifacts = read_entry(entry, "k").artifacts
        except FileNotFoundError:
            continue
        assert len(set(artifacts)) == 1 and len(artifacts) % 2**20 == 0
        reads.add((artifacts[0], len(artifacts)))
    for writer in writers:
        assert writer.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, writer.stderr.read()
    assert reads and [p.name for p in tmp_path.iterdir()] == [entry.name]
    assert read_entry(entry, "k").artifacts


def _header(**changes) -> bytes:
    import hashlib

    import torch

    artifacts = b"artifacts"
    header = {
        "format": compile_cache.FORMAT,
        "key": "k",
        "torch": torch.__version__,
        "bytes": len(artifacts),
        "sha256": hashlib.sha256(artifacts).hexdigest(),
        "artifacts_bytes": len(artifacts),
        **changes,
    }
    return json.dumps(header).encode() + b"\n" + artifacts


@pytest.mark.parametrize(
    "data, why",
    [
        (b"\x00\x01 not an entry", "not a ditrun compile-cache entry"),
        (
            _header(format="ditrun-compile-cache/1"),
            "it is of another format (ditrun-compile-cache/1; this ditrun reads",
        ),
        (_header(key="another"), "it belongs to another key or torch version"),
        (_header(torch="0.1"), "it belongs to another key or torch version (0.1)"),
        (_header()[:-1], "truncated or corrupt (8 of 9 bytes"),
        (_header()[:-1] + b"S", "truncated or corrupt (9 of 9 bytes, checksum differs)"),
    ],
    ids=["garbage", "older format", "another key", "another torch", "truncated", "corrupt"],
)
def test_a_bad_entry_is_discarded_with_a_warning(tmp_path, capsys, data, why):
    entry = tmp_path / "k.ditrun-compile"
    entry.write_bytes(data)
    with pytest.raises(BadEntry, match=why.replace("(", r"\(").replace(")", r"\)")):
        read_entry(entry, "k")
    cache = CompileCache(tmp_path, {}, writer=True)
    cache.__dict__["key"] = "k"  # the entry above stands for this run's
    assert cache.load() == "discarded"
    assert f"ditrun: warning: compile cache entry {entry} discarded: {why}" in capsys.readouterr().out


def test_artifacts_pytorch_cannot_read_are_discarded(tmp_path, capsys):
    cache = CompileCache(tmp_path, {"model": "unreadable"}, writer=True)
    write_entry(cache.path, cache.key, cache.described, Entry(b"not PyTorch's serialised artifacts"))
    assert cache.load() == "discarded" and "PyTorch could not" in capsys.readouterr().out


def _triton_kernel(root: Path, monkeypatch, name: str) -> str:
    """A kernel folder as Triton's own cache manager writes one (its files, then their list), under ``root``;
    returns the folder's name."""
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    key = hashlib.sha256(name.encode()).hexdigest()[:52]
    manager = FileCacheManager(key)
    files = {
        f"{name}.{kind}": manager.put(f"{kind} of {name}".encode(), f"{name}.{kind}")
        for kind in ("source", "ttir", "cubin", "json")
    }
    manager.put_group(f"{name}.json", files)
    return key


def _triton_finds(root: Path, monkeypatch, key: str, name: str) -> Optional[dict]:
    """What Triton's cache manager finds of kernel ``name`` in folder ``key`` under ``root`` (None: a miss)."""
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    return FileCacheManager(key).get_group(f"{name}.json")


def test_triton_kernels_compiled_by_the_job_travel_in_the_entry(tmp_path, monkeypatch, capsys):
    """The writer carries the kernel folders that appeared in its Triton cache after it loaded (not the node's
    older ones); a reader on another node gets them, whole, where Triton's own cache manager finds them."""
    node_a, node_b, shared = tmp_path / "a", tmp_path / "b", tmp_path / "shared"
    older = _triton_kernel(node_a, monkeypatch, "older_kernel")
    writer = CompileCache(shared, {"model": "x"}, writer=True, kernels_dir=node_a)
    assert writer.load() == "miss"
    compiled = _triton_kernel(node_a, monkeypatch, "rowwise_fp8_kernel")
    assert writer.save() and writer.fields()["triton_kernels"] == 1
    assert "1 Triton kernels" in capsys.readouterr().out
    assert not writer.save()  # nothing new

    reader = CompileCache(shared, {"model": "x"}, kernels_dir=node_b)
    assert reader.load() == "hit" and kernel_folders(node_b) == {compiled}
    found = _triton_finds(node_b, monkeypatch, compiled, "rowwise_fp8_kernel")
    assert found and all(Path(path).parent == node_b / compiled for path in found.values())
    assert Path(found["rowwise_fp8_kernel.cubin"]).read_bytes() == b"cubin of rowwise_fp8_kernel"
    assert _triton_finds(node_b, monkeypatch, older, "older_kernel") is None
    assert not [p for p in node_b.iterdir() if p.name.startswith("tmp.")]

    # A reader that compiles another kernel and writes: the entry keeps the first job's kernel too.
    reader.writer = True
    extra = _triton_kernel(node_b, monkeypatch, "attention_kernel")
    assert reader.save() and kernel_folders(node_b) == {compiled, extra}
    third = CompileCache(shared, {"model": "x"}, kernels_dir=tmp_path / "c")
    assert third.load() == "hit" and kernel_folders(tmp_path / "c") == {compiled, extra}


def test_an_entry_whose_triton_kernels_are_not_kernel_files_is_discarded(tmp_path, capsys):
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../outside")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    cache = CompileCache(tmp_path / "shared", {"model": "x"}, kernels_dir=tmp_path / "node")
    write_entry(cache.path, cache.key, cache.described, Entry(b"", buffer.getvalue()))
    assert cache.load() == "discarded"
    assert "its Triton kernels hold '../outside', not a kernel's file" in capsys.readouterr().out
    assert not (tmp_path / "outside").exists()
    with pytest.raises(BadEntry, match="cannot be read"):
        unpack_kernels(b"not a tar", tmp_path / "node")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:  # a kernel whose file list is not JSON
        info = tarfile.TarInfo("a" * 52 + "/__grp__kernel.json")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"{x}"))
    with pytest.raises(BadEntry, match="its Triton kernels cannot be read"):
        unpack_kernels(buffer.getvalue(), tmp_path / "node")
    assert not kernel_folders(tmp_path / "node")
    assert pack_kernels(tmp_path, set()) == b""


def test_no_entry_is_a_miss_and_off_does_nothing(tmp_path, capsys):
    assert CompileCache(tmp_path / "none-yet", {"model": "x"}).load() == "miss"
    assert "ditrun: compile cache: no entry" in capsys.readouterr().out
    off = CompileCache(None, {})
    assert (off.load(), off.save(), off.fields()["entry"]) == ("off", False, None)


def test_the_folder_defaults_to_ditruns_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_dir("auto") == tmp_path / "ditrun" / "compile"
    assert compile_cache.cache_dir("off") is None and compile_cache.cache_dir(None) is None
    assert compile_cache.cache_dir("~/cc") == Path.home() / "cc"
    assert tiny_config().model.compile_cache == "auto"


def _refused(value: str) -> str:
    with pytest.raises(UserError) as err:
        checks.check_run_config(tiny_config("model.compile=on", f"model.compile_cache={value}"))
    return str(err.value)


def test_a_folder_that_cannot_hold_entries_is_one_sentence_before_any_work(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    assert _refused(str(file)) == (
        f"model.compile_cache='{file}' is not a folder; give a folder (made when missing), or off."
    )
    assert _refused(f"{file}/sub") == (
        f"model.compile_cache='{file}/sub' cannot be made: {file} is not a folder; "
        "give a folder (made when missing), or off."
    )
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root may write anywhere; /proc/sys refuses even root
        locked = Path("/proc/sys")
    if os.access(locked, os.W_OK):
        pytest.skip("no folder here that this user may not write")
    assert _refused(f"{locked}/cc").startswith(f"model.compile_cache='{locked}/cc' is not writable here ({locked})")
    # Nothing compiles, nothing to check; off checks nothing either.
    compile_cache.check_config(tiny_config(f"model.compile_cache={file}").model, CompilePlan(False, False))
    compile_cache.check_config(tiny_config("model.compile_cache=off").model, COMPILED)
    compile_cache.check_config(tiny_config("model.compile_cache=null").model, COMPILED)


def _key(*overrides: str, details=None) -> str:
    from ditrun.model.build import model_geometry, select_device_dtype
    from ditrun.model.precision import plan_precision
    from ditrun.parallel.layout import plan_layout
    from ditrun.workload.manifest import resolve_edits

    cfg = tiny_config("model.compile=on", *overrides)
    geometry, device_dtype = model_geometry(cfg.model), select_device_dtype("cpu", cfg.model.dtype)
    plan = plan_layout(cfg.layout, cfg.launcher.world, geometry.num_attention_heads)
    cache = compile_cache.for_run(
        cfg,
        COMPILED,
        device_dtype,
        geometry,
        plan_precision(cfg.precision, device_dtype.device),
        details or {},
        plan,
        resolve_edits(cfg.workload),
        rank=0,
    )
    (entry,) = cache.entries.values()  # the tiny workload's edit: one shape
    return entry.key


def test_the_key_follows_what_changes_the_compiled_code():
    key = _key()
    assert _key() == key
    changed = [
        _key("workload.width=48"),
        _key("workload.text_len=16"),
        _key("workload.true_cfg_scale=1"),
        _key("model.num_layers=1"),
        _key("model.dtype=bf16"),
        _key("precision=fp8"),
        _key("layout=cfg_batch"),
        _key(details={"attention": {"format": "int8qk"}}),
    ]
    assert len({key, *changed}) == len(changed) + 1
    assert _key("workload.seed=5", "model.weights_seed=3") == key  # the same shapes and code
    assert _key("workload.width=48", "workload.height=32") == key  # the same tokens: the same graphs


def test_the_summary_has_each_part_of_start_up_per_rank_and_overall():
    by_rank = [
        {"rank": 1, "startup_s": 9.0, "build_s": 2.0, "compile_s": 6.0, "compile_cache": "hit"},
        {"rank": 0, "startup_s": 7.0, "build_s": 1.0, "compile_s": 4.0, "compile_cache": "hit"},
    ]
    summary = timing.startup_summary(by_rank)
    assert (summary["build_s_median"], summary["build_s_max"]) == (1.5, 2.0)
    assert (summary["compile_s_median"], summary["compile_s_max"]) == (5.0, 6.0)
    assert summary["graphs_s_median"] is None and summary["startup_s_max"] == 9.0
    assert [r["compile_cache"] for r in summary["startup_by_rank"]] == ["hit", "hit"]
    startup = timers.Startup()
    for _ in range(2):
        with startup.adding("compile_s"):
            pass
    startup.notes["compile_cache"] = "miss"
    report = startup.report(0)
    assert report["compile_s"] >= 0 and report["compile_cache"] == "miss" and report["graphs_s"] is None

    # Dynamo's tracing is its own part, counted from the job's start: a graph compiled before it is not the job's.
    traced = timers.Startup()
    torch.compile(lambda x: torch.sin(x) + 1, backend="eager", fullgraph=True)(torch.ones(3))
    assert traced.report(0)["trace_s"] > 0
    later = timers.Startup()
    assert later.report(0)["trace_s"] is None  # nothing compiled since it began


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cli_says_what_the_compile_cache_did_and_splits_its_start_up(tmp_path):
    """The worker's hooks through the ``ditrun`` command: the entry named on the console and in the summary, every
    part of the start-up per rank and overall. Inductor's CPU code generation of the tiny model takes minutes on
    2 cores, so this run traces with ``aot_eager``; the processes above load and write entries with Inductor."""
    folder = tmp_path / "compile-cache"
    proc = run(
        ditrun_command(
            "model.compile=on",
            "model.compile_backend=aot_eager",
            f"model.compile_cache={folder}",
            "workload.limit=1",
            "metrics.report=false",
            f"output_dir={tmp_path / 'run'}",
        ),
        timeout=240,
        cwd=tmp_path,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cache = summary["compile_cache"]
    (entry,) = cache["entries"]
    assert cache["status"] == entry["status"] == "miss" and Path(entry["entry"]).parent == folder
    assert f"ditrun: compile cache: no entry {entry['entry']} for 7 text + 12 image tokens" in proc.stdout
    assert cache["fx_graph_cache"] == {"hit": 0, "miss": 0, "bypass": 0}  # aot_eager: no Inductor graph
    rank = summary["startup_by_rank"][0]
    assert rank["compile_cache"] == "miss" and rank["graphs_s"] is None  # no CUDA graphs on a CPU
    for part in ("references_s", "build_s", "compile_s", "trace_s", "compile_cache_s"):
        assert rank[part] > 0 and summary[f"{part}_max"] == rank[part], part
    assert rank["startup_s"] > rank["compile_s"]
