"""ditrun's own trained editor: a small FLUX.1 Kontext pipeline that performs a closed set of edits
whose correct output is a known function of the input picture (``transforms.EDITS``).

``transforms`` is the edits' registry (what each instruction does, and its phrasings), ``pictures``
the photographs it was trained and judged on (all shipped inside installed packages), ``folder``
the pipeline folder's parts (text encoders, tokenizers, VAE, scheduler) and ``train`` the script
that trains the VAE and the DiT (docs/EDITOR.md).
"""

from pathlib import Path

# The trained pipeline folder shipped with the package (``model=editor``, the default model).
FOLDER = Path(__file__).resolve().parent / "pipeline"
