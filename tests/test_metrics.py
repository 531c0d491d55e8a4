"""Timing fields, exposed transfer, SSIM, the BF16 reference cache and the quality gate."""

import fcntl
import json
import os
import select
import struct
import termios
import threading

import numpy as np
import pytest
import torch
from ditrun_cli import TINY, ditrun, full_quality_dir
from omegaconf import OmegaConf
from skimage import data, transform

from ditrun import metrics, timers
from ditrun.config import RunConfig
from ditrun.metrics import quality, timing
from ditrun.metrics.full_quality_images import Reference, reference_key
from ditrun.metrics.progress import Progress
from ditrun.metrics.target import make_target, psnr
from ditrun.model.presets import geometry_from_config
from ditrun.workload.manifest import resolve_edits


def photo(size=64) -> np.ndarray:
    img = transform.resize(data.astronaut(), (size, size), anti_aliasing=True)
    return (img * 255).round().astype(np.uint8)


def with_noise(img: np.ndarray, sigma: float, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0, sigma * 255, img.shape)
    return np.clip(img + noise, 0, 255).round().astype(np.uint8)


def test_ssim_of_an_image_with_itself_is_one_and_drops_with_noise():
    img = photo()
    assert quality.ssim(img, img) == pytest.approx(1.0, abs=1e-12)
    scores = [quality.ssim(with_noise(img, sigma), img) for sigma in (0.01, 0.05, 0.2)]
    assert scores[0] < 1.0
    assert scores == sorted(scores, reverse=True) and scores[-1] < 0.6


def test_ssim_map_is_one_where_images_agree():
    img = photo()
    damaged = img.copy()
    damaged[:, 32:] = with_noise(img, 0.3)[:, 32:]  # the right half only
    local = quality.ssim_map(damaged, img)
    assert local.shape == (64, 64)
    assert local[:, :20].mean() == pytest.approx(1.0, abs=1e-9)
    assert local[:, 40:].mean() < 0.5


def test_quality_fields_relate_ssim_to_the_rerun():
    img = photo()
    rerun = with_noise(img, 0.01, seed=1)
    fields = quality.quality_fields(with_noise(img, 0.05), Reference(image=img, rerun=rerun))
    assert fields["ssim"] < fields["ssim_rerun"] < 1.0
    assert fields["ssim_pct_of_rerun"] == pytest.approx(100 * fields["ssim"] / fields["ssim_rerun"])
    assert quality.quality_fields(img, None) == dict.fromkeys(quality.QUALITY_FIELDS)
    # Against a correct result: the run's image and the BF16 reference's, with SSIM on or off.
    correct = with_noise(img, 0.02, seed=2)
    target = make_target(correct, with_noise(img, 0.3, seed=3), {})
    fields = quality.quality_fields(img, Reference(image=rerun, rerun=rerun), target)
    assert fields["ssim_target"] == pytest.approx(quality.ssim(img, correct))
    assert fields["ssim_target_bf16"] == pytest.approx(quality.ssim(rerun, correct))
    assert fields["psnr_target_bf16"] == pytest.approx(psnr(rerun, correct))
    without_reference = quality.quality_fields(img, None, target)
    assert without_reference["ssim_target_bf16"] is None and without_reference["psnr_target_bf16"] is None
    assert without_reference["psnr_target"] == pytest.approx(psnr(img, correct))


def test_gate_passes_at_or_above_the_threshold_and_says_why_it_fails():
    summary = {"ssim_median": 0.95, "ssim_rerun_median": 1.0, "ssim_pct_of_rerun_median": 95.0}
    assert quality.gate_failure(summary, None) is None
    assert quality.gate_failure(summary, 95.0) is None
    message = quality.gate_failure(summary, 97.5)
    assert message == (
        "quality gate failed: median SSIM 0.9500 is 95.00% of the full-quality rerun's SSIM 1.0000, "
        "below metrics.min_ssim_pct=97.5."
    )


def test_a_layout_without_transport_has_zero_exposed_transfer_not_missing():
    fields = timing.edit_timing([0.5, 0.25], timers.ExposedTransfer(torch.device("cpu")).take())
    assert fields == {"dit_s": 0.75, "step_s": [0.5, 0.25], "exposed_transfer_s": 0.0, "exposed_transfer_pct": 0.0}


def test_exposed_transfer_is_split_by_layer_kind_and_head_group():
    exposed = timers.ExposedTransfer(torch.device("cpu"))
    for kind, group in (("double", 0), ("double", 1), ("single", 0)):
        arrived = threading.Event()
        sender = threading.Timer(0.01, arrived.set)  # a peer whose data arrives a little later
        sender.start()
        with exposed.timed(kind, group):
            assert arrived.wait(timeout=10)
        sender.join(timeout=10)
    taken = exposed.take()
    fields = timing.edit_timing([1.0], taken, breakdown=True)
    assert set(fields["exposed_transfer_by_kind"]) == {"double", "single"}
    assert set(fields["exposed_transfer_by_group"]) == {"0", "1"}
    assert sum(fields["exposed_transfer_by_kind"].values()) == pytest.approx(fields["exposed_transfer_s"])
    assert sum(fields["exposed_transfer_by_group"].values()) == pytest.approx(fields["exposed_transfer_s"])
    assert fields["exposed_transfer_pct"] == pytest.approx(100 * fields["exposed_transfer_s"])
    assert exposed.take()["total_s"] == 0.0  # take() starts the next edit from zero


def _run_worker(rank, world, cfg, out_dir):
    from ditrun.run import worker

    return worker.run(cfg, out_dir)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_rank_ulysses_records_its_exposed_transfer_by_kind_and_head_group(tmp_path):
    from hydra import compose, initialize_config_module
    from ranks import run_ranks

    from ditrun.config import register_configs

    register_configs()
    with initialize_config_module("ditrun.conf", version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                *TINY,
                "workload.limit=1",
                "layout=ulysses",
                "layout.head_groups=2",
                "launcher.world=2",
                "metrics.transfer_breakdown=true",
                "metrics.ssim=false",
                "metrics.report=false",
                "wandb.mode=disabled",
                "progress=false",
            ],
        )
    summaries = run_ranks(_run_worker, 2, (cfg, tmp_path), timeout=90)
    [record] = _records(tmp_path)
    by_kind, by_group = record["exposed_transfer_by_kind"], record["exposed_transfer_by_group"]
    assert {"qkv", "attention_out"} <= set(by_kind) and {"0", "1"} <= set(by_group)
    assert sum(by_kind.values()) == pytest.approx(record["exposed_transfer_s"])
    assert record["exposed_transfer_pct"] == pytest.approx(100 * record["exposed_transfer_s"] / record["dit_s"])
    assert summaries[0]["exposed_transfer_pct_median"] == record["exposed_transfer_pct"] and summaries[1] is None


def test_medians_leave_out_each_replicas_warmup_edits():
    records = [
        {"replica": rep, "dit_s": dit, "step_s": [dit], "exposed_transfer_s": 0.0, "exposed_transfer_pct": 0.0}
        for rep, dit in ((0, 9.0), (1, 8.0), (0, 1.0), (1, 2.0), (0, 3.0))
    ]
    summary = timing.timing_summary(records, warmup=1, replicas=2)
    assert summary["dit_s_median"] == 2.0  # of 1, 2, 3: the first edit of each replica is warm-up
    assert summary["images_per_s"] == 1.0  # two replicas each finishing an edit every 2 s
    assert summary["encode_s_median"] is None  # not recorded, not invented


def test_startup_summary_takes_median_and_slowest_rank_and_keeps_every_rank():
    by_rank = [
        {"rank": 2, "host": "n2", "startup_s": None, "rendezvous_s": 0.5},  # no edit left to run
        {"rank": 1, "host": "n1", "startup_s": 3.0, "rendezvous_s": 0.5},
        {"rank": 0, "host": "n1", "startup_s": 2.0, "rendezvous_s": 0.25},
    ]
    summary = timing.startup_summary(by_rank)
    assert (summary["startup_s_median"], summary["startup_s_max"], summary["rendezvous_s_max"]) == (2.5, 3.0, 0.5)
    assert [r["rank"] for r in summary["startup_by_rank"]] == [0, 1, 2]
    assert timing.startup_summary([])["startup_s_max"] is None


def test_startup_phases_are_recorded_once_from_the_process_start():
    startup = timers.Startup()
    startup.begin("load_s")
    startup.end("load_s")
    startup.at_age("startup_s")
    first = startup.fields["startup_s"]
    startup.at_age("startup_s")  # a later step does not move the first step's time
    report = startup.report(rank=3)
    assert report["rank"] == 3 and report["startup_s"] == first and first >= report["load_s"] >= 0
    assert report["imports_s"] is None and report["rendezvous_s"] is None  # not reached in this process


def _cfg(*overrides):
    edits = {
        "workload": {
            "edits": [
                {"id": "a", "image": "skimage:astronaut", "prompt": "p"},
                {"id": "b", "image": "skimage:astronaut", "prompt": "p", "seed": 0},
            ]
        }
    }
    return OmegaConf.merge(OmegaConf.structured(RunConfig), edits, OmegaConf.from_dotlist(list(overrides)))


def _key(cfg, index=0, dtype=torch.float32):
    edit = resolve_edits(cfg.workload)[index]
    return reference_key(cfg, geometry_from_config(cfg.model), edit, dtype, "cpu")[0]


def test_reference_key_names_what_decides_the_image_and_nothing_else():
    base = _key(_cfg())
    assert _key(_cfg(), index=1) == base  # another id, same image, prompt and seed
    assert _key(_cfg("layout.name=ulysses", "precision.name=mxfp4", "transport.name=copy_engine")) == base
    for changed in (
        "workload.steps=3",
        "workload.width=128",
        "workload.seed=5",
        "model.weights_seed=1",
        "workload.true_cfg_scale=4.0",
        "workload.ref_resize=none",
        "model.num_layers=1",
    ):
        assert _key(_cfg(changed)) != base, changed
    assert _key(_cfg(), dtype=torch.bfloat16) != base


@pytest.mark.parametrize(
    "override, message",
    [
        ("metrics.full_quality_dtype=fp64", "metrics.full_quality_dtype='fp64' is unknown; allowed: bf16, fp16, fp32"),
        ("wandb.mode=cloud", "wandb.mode='cloud' is unknown; allowed: offline, online, disabled."),
        ("metrics.min_ssim_pct=0", "metrics.min_ssim_pct=0 must be a percentage above 0."),
        ("metrics.warmup_edits=-1", "metrics.warmup_edits=-1 must be 0 or more."),
    ],
)
def test_metrics_config_mistakes_are_one_sentence(override, message):
    with pytest.raises(ValueError) as err:
        metrics.check_config(_cfg(override))
    assert message in str(err.value)


def test_an_old_key_and_its_new_name_given_different_values_is_one_sentence():
    from ditrun.config import take_renamed_keys

    cfg = _cfg("metrics.reference_steps=4", "metrics.full_quality_steps=8")
    with pytest.raises(ValueError, match=r"^metrics.reference_steps=4 and metrics.full_quality_steps=8 disagree"):
        take_renamed_keys(cfg)
    agreed = _cfg("metrics.reference_steps=4", "metrics.full_quality_steps=4")
    take_renamed_keys(agreed)
    assert (agreed.metrics.full_quality_steps, agreed.metrics.reference_steps) == (4, None)
    recorded = {"metrics": "not a mapping"}  # a damaged run.json's settings are left to the comparison
    take_renamed_keys(recorded)
    assert recorded == {"metrics": "not a mapping"}


def test_gate_without_ssim_is_refused():
    with pytest.raises(ValueError, match=r"metrics.min_ssim_pct=90 needs metrics.ssim=true."):
        metrics.check_config(_cfg("metrics.min_ssim_pct=90", "metrics.ssim=false"))


def _read_available(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode(errors="replace")


def test_progress_bars_draw_on_a_terminal_and_stay_silent_elsewhere(tmp_path):
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    with os.fdopen(secondary, "w") as terminal, open(tmp_path / "log", "w") as log_file:
        for stream in (terminal, log_file):
            with Progress(True, 2, stream=stream) as progress:
                bar = progress.edit("astronaut", 3)
                for _ in range(3):
                    bar.update(1)
                bar.close()
                progress.advance()
            stream.flush()
        drawn = _read_available(primary)
    os.close(primary)
    assert "astronaut" in drawn and "edits" in drawn
    assert (tmp_path / "log").read_text() == ""


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "edits.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ssim_gate_fails_a_run_below_its_threshold(tmp_path, tmp_path_factory):
    # fp32 DiT against a bf16 reference: a real, small loss of quality (on a CPU two runs agree exactly).
    refs = full_quality_dir(tmp_path_factory)
    common = [
        *TINY,
        "wandb.mode=disabled",
        f"metrics.full_quality_dir={refs}",
        "metrics.full_quality_dtype=bf16",
        "model.dtype=fp32",
    ]
    failed = ditrun(*common, "metrics.min_ssim_pct=99.99", f"hydra.run.dir={tmp_path / 'strict'}", cwd=tmp_path)
    assert failed.returncode == 1, failed.stderr
    records = _records(tmp_path / "strict")
    for r in records:
        assert r["ssim_rerun"] == 1.0 and r["ssim"] < 1.0 and r["ssim_pct_of_rerun"] == pytest.approx(100 * r["ssim"])
    summary = json.loads((tmp_path / "strict" / "summary.json").read_text())
    assert summary["ssim_pct_of_rerun_median"] < 99.99
    expected = quality.gate_failure(summary, 99.99)
    assert summary["failure"] == expected and f"ditrun: error: {expected}" in failed.stderr
    assert "Traceback" not in failed.stderr

    # In a sweep every job runs; the command exits 1 at the end and names the jobs that failed.
    sweep = tmp_path / "sweep"
    proc = ditrun("-m", *common, "metrics.min_ssim_pct=50,99.99", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "the references of all 2 edits come from" in proc.stdout  # made once, by the first run
    lenient, strict = (json.loads((sweep / job / "summary.json").read_text()) for job in ("0", "1"))
    assert lenient["failure"] is None and strict["failure"] == expected
    assert f"ditrun: error: 1 run(s) of the sweep failed the quality gate:\n  {sweep / '1'}: {expected}" in proc.stderr
    assert [r["ssim"] for r in _records(sweep / "0")] == [r["ssim"] for r in records]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_run_against_its_reference_and_ssim_off(tmp_path, tmp_path_factory):
    refs = full_quality_dir(tmp_path_factory)
    proc = ditrun(
        *TINY,
        "wandb.mode=disabled",
        f"metrics.full_quality_dir={refs}",
        "metrics.report=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    for r in _records(tmp_path / "run"):
        # Same computation as the reference on a CPU: identical images, SSIM exactly 1.
        assert (r["ssim"], r["ssim_rerun"], r["ssim_pct_of_rerun"]) == (1.0, 1.0, 100.0)
        assert r["encode_s"] >= 0 and r["decode_s"] >= 0 and r["exposed_transfer_s"] == 0.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ssim_median"] == 1.0 and summary["step_s_median"] > 0
    assert not (tmp_path / "run" / "report.md").exists()

    # A run recorded under the keys' old names (metrics.reference_*) resumes under them, each read with one notice.
    run_file = tmp_path / "run" / "run.json"
    run = json.loads(run_file.read_text())
    recorded = run["settings"]["metrics"]
    for new_name in [name for name in recorded if name.startswith("full_quality_")]:
        recorded[new_name.replace("full_quality_", "reference_")] = recorded.pop(new_name)
    assert "reference_dtype" in recorded
    run_file.write_text(json.dumps(run))
    old_names = ditrun(
        *TINY,
        "wandb.mode=disabled",
        f"metrics.reference_dir={refs}",
        "metrics.report=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert old_names.returncode == 0, old_names.stderr
    notices = [line for line in old_names.stderr.splitlines() if " is now metrics.full_quality_" in line]
    assert notices == [
        "ditrun: metrics.reference_dir is now metrics.full_quality_dir; read as it (rename it where you set it).",
    ]
    assert "2 edits already in edits.jsonl are skipped" in old_names.stdout

    off = ditrun(
        *TINY,
        "wandb.mode=disabled",
        "metrics.ssim=false",
        f"metrics.full_quality_dir={tmp_path / 'none'}",
        f"hydra.run.dir={tmp_path / 'off'}",
        cwd=tmp_path,
    )
    assert off.returncode == 0, off.stderr
    assert all(r["ssim"] is None for r in _records(tmp_path / "off"))
    assert not (tmp_path / "none").exists()  # no reference was made


@pytest.mark.slow
def test_records_name_the_commit_and_whether_tracked_files_differ_from_it(tmp_path):
    """``git_revision``: the short commit of a clean checkout, "+modified" once a tracked file changes (an untracked
    one does not count), "unknown" outside a checkout."""
    import subprocess

    from ditrun.run.records import git_revision

    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()

    assert git_revision(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    commit = git("rev-parse", "--short", "HEAD")
    (tmp_path / "untracked.txt").write_text("scratch\n")
    assert git_revision(tmp_path) == commit
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_revision(tmp_path) == commit + "+modified"
