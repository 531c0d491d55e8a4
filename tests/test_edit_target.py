"""Is the edit right? (``metrics/target.py``): PSNR, CIEDE2000 and the margin over the naive candidates rank a
correct edit above doing nothing and above a wrong edit, where SSIM against the correct edit ranks doing nothing
first; an edit whose correct result is its input is not scored; the quality gate fails a run that does nothing."""

import dataclasses

import numpy as np
import pytest
import torch

from ditrun.editor.transforms import EDITS, apply
from ditrun.metrics import quality
from ditrun.metrics.target import PSNR_CAP_DB, delta_e, edit_target, make_target, psnr, target_fields, target_summary
from ditrun.results.files import to_rgb8
from ditrun.workload.edit import Edit
from ditrun.workload.images import load_image

SIZE = 96


def _edit(picture: str, target: str) -> Edit:
    return Edit(
        index=0,
        id="e",
        image=picture,
        prompt="",
        seed=0,
        width=SIZE,
        height=SIZE,
        ref_width=SIZE,
        ref_height=SIZE,
        target=target,
    )


def _picture(name: str = "skimage:astronaut") -> torch.Tensor:
    return load_image(_edit(name, "grayscale"))


def _nudged(rgb8: np.ndarray, tint=(0.0, 0.0, 0.0), sigma: float = 0.0, seed: int = 0) -> np.ndarray:
    """A picture with a colour cast and noise: an imperfect output."""
    noise = np.random.default_rng(seed).normal(0.0, sigma, rgb8.shape)
    return (np.clip(rgb8 / 255.0 + np.array(tint) + noise, 0, 1) * 255).round().astype(np.uint8)


@pytest.mark.parametrize("name", ["grayscale", "sepia", "brighten", "invert", "blue", "mirror", "posterize"])
def test_a_correct_edit_beats_doing_nothing_and_every_wrong_edit(name):
    target = edit_target(_edit("skimage:astronaut", name))
    assert set(target.naive) == {"input", *(n for n in EDITS if n != name)} and not target.equals_input
    imperfect = _nudged(target.image, tint=(0.0, 0.0, 0.06), sigma=0.04)  # off in colour, noisy, but this edit
    fields = target_fields(imperfect, target, None)
    assert fields["margin_db"] > 0 and fields["psnr_target"] < PSNR_CAP_DB
    unchanged = target_fields(target.naive["input"], target, None)
    assert unchanged["margin_db"] <= 0 and unchanged["naive_best"] is not None
    for wrong in (n for n in target.naive if n != "input"):
        assert target_fields(target.naive[wrong], target, None)["margin_db"] <= 0, wrong
    assert fields["delta_e_target"] < delta_e(target.naive["input"], target.image)


def test_posterize_keeps_two_levels_per_channel():
    """Each channel 0 or 1, split at mid-grey: every pixel one of the RGB cube's 8 corners (coffee: black, red,
    yellow and white)."""
    picture = _picture("skimage:coffee")
    posterized = apply("posterize", picture)
    assert torch.equal(posterized, (picture >= 0.5).to(picture.dtype))
    assert len(posterized[0].flatten(1).T.unique(dim=0)) == 4


def test_ssim_against_the_correct_edit_prefers_doing_nothing_where_the_margin_does_not():
    """A grayscale output with a slight blue-grey cast, as the editor makes (docs/METRICS.md): SSIM ranks the input
    unchanged above it, PSNR and the margin rank it first."""
    target = edit_target(_edit("skimage:astronaut", "grayscale"))
    output = _nudged(target.image, tint=(-0.03, 0.0, 0.08), sigma=0.08)
    unchanged = target.naive["input"]
    assert quality.ssim(unchanged, target.image) > quality.ssim(output, target.image)
    assert psnr(output, target.image) > psnr(unchanged, target.image)
    assert target_fields(output, target, None)["margin_db"] > 0 >= target_fields(unchanged, target, None)["margin_db"]


def test_an_edit_whose_correct_result_is_its_input_is_marked_not_scored():
    target = edit_target(_edit("skimage:camera", "grayscale"))  # a grey picture
    assert target.equals_input and "input" not in target.naive
    fields = target_fields(target.image, target, target.image)
    assert fields["target_equals_input"] is True
    assert all(fields[k] is None for k in fields if k != "target_equals_input")
    summary = target_summary([fields, {**fields, "target_equals_input": False, "margin_db": 1.0, "psnr_target": 30.0}])
    assert summary["edits_target_equals_input"] == 1 and summary["edits_right_share"] == 1.0


def test_a_candidate_equal_to_the_correct_result_is_no_candidate():
    """A left-right symmetric picture: its mirror is itself, so the input is the correct result of ``mirror``, and
    a picture symmetric both ways turned upside down is the mirror too, which is then no wrong edit."""
    half = np.random.default_rng(1).integers(0, 256, (SIZE, SIZE // 2, 3), dtype=np.uint8)
    symmetric = np.concatenate([half, half[:, ::-1]], axis=1)
    as_tensor = torch.from_numpy(symmetric).permute(2, 0, 1)[None].float() / 255
    edits = {n: to_rgb8(apply(n, as_tensor)) for n in EDITS}
    mirror = make_target(edits["mirror"], symmetric, {n: p for n, p in edits.items() if n != "mirror"})
    assert mirror.equals_input
    flip = make_target(edits["upside_down"], symmetric, {n: p for n, p in edits.items() if n != "upside_down"})
    assert not flip.equals_input and "mirror" in flip.naive
    both = np.concatenate([symmetric, symmetric[::-1]], axis=0)[:SIZE, :]
    both = np.concatenate([both[: SIZE // 2], both[: SIZE // 2][::-1]], axis=0)
    four = {n: to_rgb8(apply(n, torch.from_numpy(both).permute(2, 0, 1)[None].float() / 255)) for n in EDITS}
    turned = make_target(four["upside_down"], both, {n: p for n, p in four.items() if n != "upside_down"})
    assert turned.equals_input and "mirror" not in turned.naive


def test_psnr_and_colour_error_of_identical_pictures():
    picture = to_rgb8(_picture())
    assert psnr(picture, picture) == PSNR_CAP_DB and delta_e(picture, picture) == 0.0
    assert psnr(_nudged(picture, sigma=0.1), picture) < psnr(_nudged(picture, sigma=0.01), picture)


def test_the_gate_fails_a_run_that_does_nothing_and_passes_a_correct_one():
    """Records of a run whose outputs are its inputs unchanged, beside the full-quality reference's correct edits:
    the margin is at most 0 on every edit, so the target gate fails whatever the PSNR percentage says."""
    records, correct = [], []
    for picture in ("skimage:astronaut", "skimage:coffee", "skimage:chelsea"):
        target = edit_target(_edit(picture, "sepia"))
        good = _nudged(target.image, sigma=0.03)
        records.append(target_fields(target.naive["input"], target, good))
        correct.append(target_fields(good, target, good))
    nothing = {**quality.quality_summary(records), "psnr_target_bf16_median": 1.0}  # a PSNR share far above 100%
    assert all(r["margin_db"] <= 0 < r["margin_db_bf16"] for r in records)
    message = quality.gate_failure(nothing, 98.0, "target")
    assert message == (
        "quality gate failed: 0% of its edits beat doing nothing and every wrong edit (margin above "
        "0 dB), against 100% for the full-quality reference (metrics.quality=target)."
    )
    assert quality.gate_failure(quality.quality_summary(correct), 98.0, "target") is None
    assert quality.gate_failure(quality.quality_summary(correct), 98.0, "auto") is None
    assert quality.measure_name("auto", [quality.quality_summary(correct)]) == "target"
    assert quality.measure_name("auto", [{"ssim_median": 1.0}]) == "rerun"


def test_a_file_target_is_scored_against_the_input_and_every_known_edit(tmp_path):
    from PIL import Image

    picture = to_rgb8(_picture("skimage:coffee"))
    path = tmp_path / "correct.png"
    Image.fromarray(to_rgb8(apply("sepia", torch.from_numpy(picture).permute(2, 0, 1)[None] / 255.0))).save(path)
    target = edit_target(dataclasses.replace(_edit("skimage:coffee", str(path))))
    assert set(target.naive) == {"input", *(n for n in EDITS if n != "sepia")}  # sepia equals the file: no candidate
