"""The recipe that trains ditrun's editor (docs/EDITOR.md): ``python -m recipes.editor.train`` from the repo root.

``config`` holds the settings and their checks, ``pictures`` the photographs it trains and judges on, ``data`` the
crops, dead-leaves pictures and edit batches, ``vae`` and ``dit`` the two models and their training steps,
``checkpoint`` the resumable state, ``evaluate`` the held-out measures, ``folder`` the pipeline folder's text parts
and ``output`` its safe writing. What a run needs (the edits' transforms, the committed folder) stays in
``ditrun.editor``.
"""
