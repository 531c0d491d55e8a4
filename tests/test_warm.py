"""``ditrun warm`` (``run/warm.py``) and the compile cache's entries per shape (``run/compile_cache.py``): a
warm job fills the entry of every size it is given, a later run of those sizes loads them, and a user's mistake is
one sentence before any work.

The job is the real command through Hydra's submitit launcher (a job of its own), compiling with Inductor's CPU code
generation: a model of one block of each kind, whose two shapes take tens of seconds on 2 cores. The later run
shares the warm job's Inductor folder (the node that warmed), so its C++ kernels are not built again: what it shows
is that it finds the entries the warm job wrote, under the keys its own edits name.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launching import TINY, run, tiny_config

from ditrun.errors import UserError
from ditrun.run import checks, compile_cache, warm
from ditrun.run.compile_cache import CompileCache, RunCompileCache, kernel_folders, shape_of
from ditrun.workload.images import KONTEXT_RESOLUTIONS
from ditrun.workload.manifest import resolve_edits

WARM = ["model.compile=on", "model.num_layers=1", "model.num_single_layers=1"]
JOB_TIMEOUT_S = 200


def _warm_sizes(*overrides: str) -> list[tuple]:
    cfg = tiny_config(*overrides)
    return [(e.width, e.height, e.ref_width, e.ref_height) for e in warm.warm_edits(cfg, resolve_edits(cfg.workload))]


def test_the_sizes_to_warm_are_the_workloads_or_the_ones_given():
    # The workload's edits (one of each size), as the run would size them: 32x48 with its reference at the output's.
    assert _warm_sizes("workload.limit=3") == [(32, 48, 32, 48)]
    # Given sizes, in order and each once; a reference sized by the workload's rule unless the size gives it.
    assert _warm_sizes("warm.sizes=[[64,32],[32,32,64,64],[64,32]]") == [(64, 32, 64, 32), (32, 32, 64, 64)]
    assert _warm_sizes("warm.sizes=[[64,32]]", "workload.ref_width=16", "workload.ref_height=16") == [(64, 32, 16, 16)]
    kontext = _warm_sizes("warm.preset=kontext")
    assert kontext == [(w, h, w, h) for w, h in KONTEXT_RESOLUTIONS] and len(kontext) == 17


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (["model.compile=auto"], "model.compile=auto compiles nothing on cpu, so ditrun warm has nothing to warm"),
        (["model.compile_backend=aot_eager"], "model.compile_backend='aot_eager' keeps no compiled code"),
        (["model.compile_cache=off"], "model.compile_cache=off keeps no entries"),
        (["warm.sizes=[[1000,512]]"], "warm.sizes[0]=[1000, 512] has a size that is not a positive multiple of 16"),
        (["warm.sizes=[[512,512,512]]"], "warm.sizes[0]=[512, 512, 512] is not [width, height] or"),
        (["warm.sizes=[1024,1024]"], "warm.sizes[0]=1024 is not [width, height] or"),
        (["warm.preset=sdxl"], "warm.preset='sdxl' is unknown; allowed: kontext."),
        (["warm.enabled=false", "warm.sizes=[[32,32]]"], "warm.sizes is read by ditrun warm only"),
    ],
    ids=[
        "compile off",
        "aot_eager",
        "no cache",
        "off the grid",
        "three numbers",
        "flat",
        "unknown preset",
        "not warming",
    ],
)
def test_a_warm_that_cannot_work_is_one_sentence(overrides, sentence):
    with pytest.raises(UserError, match=sentence.replace("[", r"\[").replace("(", r"\(").replace("]", r"\]")):
        checks.check_run_config(tiny_config(*WARM, "warm.enabled=true", *overrides))


def _entries(tmp_path: Path, *shapes: tuple, node: str = "node") -> RunCompileCache:
    """A run's entries of ``shapes`` in one shared folder, this process their writer, with Triton's cache folder
    ``node`` (the edits' prompts: 7 tokens)."""
    entries = {
        shape: CompileCache(
            tmp_path / "shared", {"shape": list(shape)}, writer=True, kernels_dir=tmp_path / node, label=str(shape)
        )
        for shape in shapes
    }
    return RunCompileCache(entries, text_len=7)


def test_an_entry_of_another_shape_is_discarded_and_the_others_load(tmp_path, capsys):
    """A run's entries are one file per shape: one holding another shape's entry (a foreign part) is discarded with
    the warning, the others load, and the run's status says so."""
    one, two = (7, 12), (7, 18)
    writer = _entries(tmp_path, one, two)
    assert writer.load() == "miss"
    for entry in writer.entries.values():
        compile_cache.write_entry(entry.path, entry.key, entry.described, compile_cache.Entry(b""))
    assert _entries(tmp_path, one, two).load() == "hit"
    first, second = writer.entries[one].path, writer.entries[two].path
    second.write_bytes(first.read_bytes())  # shape one's entry where shape two's belongs
    reader = _entries(tmp_path, one, two)
    assert reader.load() == "discarded" and [e.status for e in reader.entries.values()] == ["hit", "discarded"]
    assert f"compile cache entry {second} discarded: it belongs to another key" in capsys.readouterr().out
    second.unlink()
    assert _entries(tmp_path, one, two).load() == "partial"
    fields = _entries(tmp_path, one).fields()
    assert [(e["shape"], e["entry"]) for e in fields["entries"]] == [([7, 12], str(first))]


def test_each_shapes_entry_carries_the_triton_kernels_of_the_whole_job(tmp_path, monkeypatch):
    """Kernels compiled (or unpacked from another shape's entry) anywhere in the job go into the entry an edit writes:
    a later job of that shape alone finds them all; the node's kernels from before the job stay out."""
    from test_compile_cache import _triton_kernel

    node = tmp_path / "node"
    older = _triton_kernel(node, monkeypatch, "node_kernel")
    first = _entries(tmp_path, (7, 12))
    first.load()
    shared = _triton_kernel(node, monkeypatch, "quantizer_kernel")  # compiled in the first shape's edit
    with first.recording(_edit(7, 12)):
        pass
    assert kernel_folders(node) == {older, shared}

    job = _entries(tmp_path, (7, 12), (7, 18), node="fresh")  # on another node
    assert job.load() == "partial" and kernel_folders(tmp_path / "fresh") == {shared}
    attention = _triton_kernel(tmp_path / "fresh", monkeypatch, "attention_kernel")
    with job.recording(_edit(7, 18)):
        pass
    assert job.entries[(7, 18)].kernels_stored == {shared, attention}
    alone = _entries(tmp_path, (7, 18), node="another")
    assert alone.load() == "hit" and kernel_folders(tmp_path / "another") == {shared, attention}


def _edit(text: int, image: int):
    """An edit of ``text`` prompt tokens (an embeddings-free edit's ``text_len``) and ``image`` image tokens."""
    from ditrun.workload.edit import Edit

    edit = Edit(0, "e", "skimage:astronaut", "", 0, 16, 16 * (image // 2), 16, 16 * (image // 2))
    assert shape_of(edit, text) == (text, image)
    return edit


def _ditrun(folder: Path, *arguments: str) -> subprocess.CompletedProcess:
    """``python -m ditrun <arguments>`` with the compile cache and Inductor's folder (the node's) under ``folder``."""
    proc = run(
        [sys.executable, "-m", "ditrun", *arguments, f"model.compile_cache={folder / 'compile-cache'}"],
        JOB_TIMEOUT_S,
        folder,
        TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Three sizes of two shapes warmed by one job through Hydra's submitit launcher (the config carries
    ``warm.enabled`` to the job's process); the folder and ``warm.json``'s sizes."""
    folder = tmp_path_factory.mktemp("warm")
    sizes = "warm.sizes=[[32,48],[48,32],[48,48]]"
    _ditrun(
        folder, "warm", "-m", *TINY, *WARM, sizes, "hydra/launcher=submitit_local", f"hydra.sweep.dir={folder}/sweep"
    )
    return folder, json.loads((folder / "sweep" / "0" / warm.WARM_FILE).read_text())["sizes"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_warm_job_fills_the_entry_of_every_shape_and_says_so(warmed):
    folder, sizes = warmed
    # 32x48 and 48x32 have the same tokens, so the same graphs and one entry.
    assert [(s["size"], s["shape"], s["done"]) for s in sizes] == [
        ("32x48 output, 32x48 reference", [7, 12], "filled"),
        ("48x32 output, 48x32 reference", [7, 12], "filled"),
        ("48x48 output, 48x48 reference", [7, 18], "filled"),
    ]
    assert sorted(p.name for p in (folder / "compile-cache").iterdir()) == sorted(
        {Path(s["entry"]).name for s in sizes}
    )
    log = "".join(p.read_text() for p in (folder / "sweep" / ".submitit").rglob("*_log.out"))
    line = f"ditrun: warm: 48x48 output, 48x48 reference (7 text + 18 image tokens): filled ({sizes[2]['entry']})"
    assert line in log
    assert not (folder / "sweep" / "report.md").exists()  # a warm sweep runs no edit to report


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S)
def test_a_later_run_of_those_sizes_loads_their_entries(warmed, tmp_path):
    folder, sizes = warmed
    manifest = tmp_path / "edits.yaml"
    wide, square = {"image": "skimage:astronaut", "width": 48, "height": 32}, {"image": "skimage:camera", "width": 48}
    manifest.write_text(yaml.safe_dump([{"id": "wide", **wide}, {"id": "square", **square, "height": 48}]))
    out = tmp_path / "run"
    overrides = [f"workload.manifest={manifest}", "workload.limit=null", "workload.steps=1", "metrics.ssim=false"]
    proc = _ditrun(folder, *TINY, *WARM, *overrides, "metrics.report=false", f"hydra.run.dir={out}")
    summary = json.loads((out / "summary.json").read_text())["compile_cache"]
    assert summary["status"] == "hit" and summary["written"] == 0
    assert [(e["shape"], e["status"], e["entry"]) for e in summary["entries"]] == [
        ([7, 12], "hit", sizes[1]["entry"]),
        ([7, 18], "hit", sizes[2]["entry"]),
    ]
    assert summary["fx_graph_cache"]["miss"] == 0 and summary["fx_graph_cache"]["hit"] >= 2
    for entry in summary["entries"]:
        assert f"ditrun: compile cache: loaded {entry['entry']} for 7 text + " in proc.stdout
        header = json.loads(Path(entry["entry"]).read_bytes().partition(b"\n")[0])
        assert header["described"]["inputs"]["shape"] == entry["shape"]  # what the entry's key describes
