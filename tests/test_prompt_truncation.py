"""A prompt the text encoders cut is named, edit by edit, on every run that uses it: the warning comes from the
tokenizers alone, before the cache is asked what is missing, so a run that reads a cached encoding says it too."""

from types import SimpleNamespace

import pytest

from ditrun.editor import FOLDER
from ditrun.workload import prompts
from ditrun.workload.edit import Edit

pytest.importorskip("transformers")


def _edit(name: str, prompt: str) -> Edit:
    return Edit(0, name, "skimage:coffee", prompt, seed=0, width=32, height=32, ref_width=32, ref_height=32)


def test_a_cut_prompt_is_named_on_every_run_cached_or_not(tmp_path, capsys, monkeypatch):
    cache = prompts.PromptCache(FOLDER, 32, tmp_path)  # the editor's T5 takes 32 tokens here
    words = "make the cup red " * 20  # 4 words of one token or two each: well past 32 T5 and 77 CLIP tokens
    edits = [_edit("long", words), _edit("short", "make it sepia"), _edit("again", words)]
    cfg = SimpleNamespace(workload=SimpleNamespace(true_cfg_scale=1.0, text_len_from="test"))
    monkeypatch.setattr(prompts.PromptCache, "missing", lambda self, wanted: [])  # every encoding cached
    prompts.encode_missing(cache, edits, cfg, device=None, dtype=None)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("'")[1] for line in lines] == ["long", "again"], lines
    assert all("CLIP keeps 77 of its" in line and "T5 keeps 32 of its" in line for line in lines)
