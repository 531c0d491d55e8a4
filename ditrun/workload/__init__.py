"""Workloads: which edits to run (``manifest.py``, each an ``edit.Edit``), their pictures (``images.py``), their
prompts encoded by a pipeline folder's text encoders (``prompts.py``), and each turned into model inputs
(``inputs.py``). Sizes, seeds and noise follow diffusers' ``FluxKontextPipeline`` (docs/WORKLOAD.md)."""
