"""Reading the offline W&B runs that ditrun writes back (``ditrun.metrics.wandb_file`` decodes the file format;
tests/test_wandb.py checks what it reads against the run's own records)."""

from ditrun.metrics.wandb_file import items as _items
from ditrun.metrics.wandb_file import read_records

__all__ = ["_items", "read_records", "wandb_contents"]


def wandb_contents(path):
    """(run record, history rows, final summary) of one ``.wandb`` file."""
    by_type = {}
    for record in read_records(path):
        by_type.setdefault(record.WhichOneof("record_type"), []).append(record)
    history = [_items(r.history.item) for r in by_type.get("history", [])]
    summary = {}
    for r in by_type.get("summary", []):
        summary.update(_items(r.summary.update))
    return by_type["run"][0].run if "run" in by_type else None, history, summary
