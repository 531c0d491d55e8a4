"""Workload manifests, defaults and the errors a user can cause."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from ditrun.config import WorkloadConfig
from ditrun.model.latents import LinearLatentMap
from ditrun.model.presets import PRESETS
from ditrun.workload.edit import WorkloadError
from ditrun.workload.images import check_sources, load_image
from ditrun.workload.inputs import edit_inputs
from ditrun.workload.manifest import resolve_edits


def _cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(WorkloadConfig), kw)


def test_inline_edits_get_defaults():
    edits = resolve_edits(
        _cfg(
            edits=[{"id": "a", "image": "skimage:coffee"}, {"image": "skimage:rocket", "seed": 9, "width": 64}], seed=5
        )
    )
    assert [e.id for e in edits] == ["a", "edit0001"]
    assert (edits[0].seed, edits[1].seed) == (5, 9)
    assert (edits[1].width, edits[1].height) == (64, 256)


def test_yaml_and_jsonl_manifests(tmp_path):
    (tmp_path / "w.yaml").write_text("edits:\n  - {id: cat, image: 'skimage:chelsea', prompt: hat}\n")
    (tmp_path / "w.jsonl").write_text(json.dumps({"id": "cat", "image": "skimage:chelsea"}) + "\n\n")
    for name in ("w.yaml", "w.jsonl"):
        edits = resolve_edits(_cfg(manifest=str(tmp_path / name)))
        assert [e.id for e in edits] == ["cat"]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"id": "x"}, "edit 'x' names no image"),
        ({"id": "x", "image": "skimage:coffee", "width": 100}, "edit 'x' has width=100"),
        ({"id": "x", "image": "skimage:coffee", "colour": 1}, "edit 'x' has unknown key 'colour'"),
    ],
)
def test_bad_manifest_entries_name_the_edit(entry, message, tmp_path):
    (tmp_path / "w.jsonl").write_text(json.dumps(entry) + "\n")
    with pytest.raises(WorkloadError, match=message):
        resolve_edits(_cfg(manifest=str(tmp_path / "w.jsonl")))


def test_inline_typo_is_a_config_error():
    from omegaconf.errors import ConfigKeyError

    with pytest.raises(ConfigKeyError, match="colour"):
        _cfg(edits=[{"id": "x", "image": "skimage:coffee", "colour": 1}])


def test_missing_sources_name_the_edit(tmp_path):
    with pytest.raises(WorkloadError, match="edit 'gone': image file"):
        check_sources(resolve_edits(_cfg(edits=[{"id": "gone", "image": str(tmp_path / "no.png")}])))
    with pytest.raises(WorkloadError, match="edit 'fake': scikit-image ships no image named 'nothing'"):
        check_sources(resolve_edits(_cfg(edits=[{"id": "fake", "image": "skimage:nothing"}])))
    with pytest.raises(WorkloadError, match="edit 'm': matplotlib ships no sample picture named 'nothing.jpg'"):
        check_sources(resolve_edits(_cfg(edits=[{"id": "m", "image": "matplotlib:nothing.jpg"}])))


def test_unreadable_manifest_line(tmp_path):
    (tmp_path / "w.jsonl").write_text('{"id": "a", "image": "skimage:coffee"}\n{oops\n')
    with pytest.raises(WorkloadError, match="line 2 is not valid JSON"):
        resolve_edits(_cfg(manifest=str(tmp_path / "w.jsonl")))
    with pytest.raises(WorkloadError, match="cannot be read"):
        resolve_edits(_cfg(manifest=str(tmp_path / "none.yaml")))


def test_images_are_real_photographs_resized():
    edit = resolve_edits(_cfg(edits=[{"id": "a", "image": "skimage:camera", "width": 48, "height": 32}]))[0]
    img = load_image(edit)
    assert img.shape == (1, 3, 32, 48)
    assert 0 <= img.min() and img.max() <= 1 and img.std() > 0.05  # grey photo promoted to RGB, not flat


def test_pictures_shipped_in_packages_are_named_as_the_editor_recipe_names_them(tmp_path):
    """matplotlib:<file>, sklearn:<file> and a skimage stereo pair (its left view) load as references, each the same
    picture as the editor's held-out and training sets read (recipes/editor/pictures.py), and the same as the
    package's file named by its path; a record names the picture by its name."""
    from ditrun.run.records import _source
    from ditrun.workload.images import package_file
    from recipes.editor import evaluate, pictures

    names = ["matplotlib:grace_hopper.jpg", "sklearn:china.jpg", "skimage:stereo_motorcycle"]
    entries = [{"id": str(i), "image": n, "width": 64, "height": 64} for i, n in enumerate(names)]
    edits = resolve_edits(_cfg(edits=entries, ref_resize="output"))
    check_sources(edits)
    loaded = torch.cat([load_image(e) for e in edits])
    assert torch.equal(loaded, evaluate.reference_pictures(64, "cpu", names))
    by_path = resolve_edits(_cfg(edits=[{"id": "p", "image": package_file(names[0]), "width": 64, "height": 64}]))
    assert torch.equal(load_image(by_path[0]), loaded[:1])
    assert all(pictures.exists(n) for n in names) and _source(names[0]) == names[0]


def test_prompt_embeds_file_and_standin(tmp_path):
    geo = PRESETS["tiny"]
    file = tmp_path / "p.safetensors"
    save_file(
        {
            "prompt_embeds": torch.ones(3, geo.joint_attention_dim),
            "pooled_prompt_embeds": torch.ones(geo.pooled_projection_dim),
        },
        file,
    )
    edits = resolve_edits(
        _cfg(
            edits=[
                {"id": "f", "image": "skimage:coffee", "prompt_embeds": str(file), "width": 32, "height": 32},
                {"id": "s", "image": "skimage:coffee", "prompt": "p", "width": 32, "height": 32},
                {"id": "t", "image": "skimage:coffee", "prompt": "p", "width": 32, "height": 32},
            ]
        )
    )
    codec = LinearLatentMap()
    f, s, t = (edit_inputs(e, codec, geo, _cfg(text_len=8), torch.device("cpu")) for e in edits)
    assert torch.equal(f.prompt, torch.ones(1, 3, geo.joint_attention_dim))
    assert f.neg_prompt.shape == f.prompt.shape
    assert s.prompt.shape == (1, 8, geo.joint_attention_dim)
    assert torch.equal(s.prompt, t.prompt) and not torch.equal(s.noise, t.noise)  # same text, other seed

    save_file({"prompt_embeds": torch.ones(3, 7), "pooled_prompt_embeds": torch.ones(2)}, file)
    with pytest.raises(WorkloadError, match="joint_attention_dim"):
        edit_inputs(edits[0], codec, geo, _cfg(text_len=8), torch.device("cpu"))
