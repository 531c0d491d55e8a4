"""Code that runs the model on edits outside the measured loop: the full-quality BF16 reference pass
(``reference.py``)."""
