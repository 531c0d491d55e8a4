"""ditrun's own trained editor: a small FLUX.1 Kontext pipeline that performs a closed set of edits
whose correct output is a known function of the input picture (``transforms.EDITS``).

``transforms`` is the edits' registry (what each instruction does, and its phrasings) and ``pipeline/``
the trained folder. The recipe that trains it lives outside the package, in ``recipes/editor/``
(docs/EDITOR.md): it imports the package, never the reverse.
"""

from pathlib import Path

# The trained pipeline folder shipped with the package (``model=editor``, the default model).
FOLDER = Path(__file__).resolve().parent / "pipeline"
