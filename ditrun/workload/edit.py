"""One edit of a workload, resolved: a reference image at its own size, a prompt (or its embeddings file), a seed and
an output size; and the error that names an edit a run cannot start with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ditrun.errors import UserError


class WorkloadError(UserError):
    """A workload the run cannot start with; the message names the edit."""


@dataclass(frozen=True)
class Edit:
    """One fully resolved edit."""

    index: int
    id: str
    image: str
    prompt: str
    seed: int
    width: int
    height: int
    ref_width: int
    ref_height: int
    prompt_embeds: Optional[str] = None
    target: Optional[str] = None
    """The correct result: an edit name of ``ditrun.editor.transforms.EDITS`` or an image file."""
