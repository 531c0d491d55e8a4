"""ditrun's Hydra launchers (``hydra/launcher=local``, ``slurm``: ``launchers.py``). Hydra finds launcher classes only
inside the ``hydra_plugins`` namespace package, which therefore has no ``__init__.py`` of its own."""
