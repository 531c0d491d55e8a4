"""What a run's timings are summed and summarised into: an edit's record fields, and the run's medians.

DiT time of an edit = the sum of its denoising steps (both CFG branches, every layer, the
transport's waits); preparing the inputs (image load, VAE encode, prompt embeddings) and the
VAE decode are timed apart as ``encode_s`` and ``decode_s``. The clocks are ``ditrun/timers.py``'s.

Start-up: each rank's split (``timers.Startup``: phases and the parts a user asks about) summarised over ranks.
"""

from __future__ import annotations

import statistics
from typing import Optional

from ditrun.timers import Startup


def edit_timing(step_s: list[float], exposed: dict, breakdown: bool = False) -> dict:
    """The timing fields of one edit's record; ``exposed`` is ``ExposedTransfer.take()`` of that edit.

    A layout without a transport never waits, so its exposed transfer is 0, not missing.
    """
    dit_s = float(sum(step_s))
    exposed_s = float(exposed.get("total_s", 0.0))
    fields = {
        "dit_s": dit_s,
        "step_s": [float(s) for s in step_s],
        "exposed_transfer_s": exposed_s,
        "exposed_transfer_pct": 100.0 * exposed_s / dit_s if dit_s > 0 else 0.0,
    }
    if breakdown:
        fields["exposed_transfer_by_kind"] = {str(k): float(v) for k, v in exposed.get("by_kind", {}).items()}
        fields["exposed_transfer_by_group"] = {str(k): float(v) for k, v in exposed.get("by_group", {}).items()}
    return fields


def after_warmup(records: list[dict], warmup: int) -> list[dict]:
    """The records left after the first ``warmup`` edits of each replica in each process that wrote some (all of
    them if none would be left): a resumed run compiles and warms up again, so its first edits are warm-up too."""
    seen: dict[tuple, int] = {}
    kept = []
    for record in records:
        writer = (record.get("session"), record.get("replica", 0))
        seen[writer] = seen.get(writer, 0) + 1
        if seen[writer] > warmup:
            kept.append(record)
    return kept or list(records)


def median_of(records: list[dict], key: str) -> Optional[float]:
    """Median of ``key`` over the records that have it; None when none has."""
    values = [r[key] for r in records if r.get(key) is not None]
    return float(statistics.median(values)) if values else None


def timing_summary(records: list[dict], warmup: int, replicas: int) -> dict:
    """Medians over the edits after warm-up; images/s counts the replicas that ran an edit, in parallel
    (a replica with no edit of its own adds nothing)."""
    kept = after_warmup(records, warmup)
    busy = min(replicas, len({r.get("replica", 0) for r in records}))
    dit = median_of(kept, "dit_s")
    steps = [s for r in kept for s in r.get("step_s", [])]
    step = float(statistics.median(steps)) if steps else None
    return {
        "dit_s_median": dit,
        "step_s_median": step,
        "warmup_excess_s": warmup_excess([r for r in records if not any(r is k for k in kept)], step),
        "images_per_s": busy / dit if dit else float("nan"),
        "exposed_transfer_s_median": median_of(kept, "exposed_transfer_s"),
        "exposed_transfer_pct_median": median_of(kept, "exposed_transfer_pct"),
        "exchange_bytes_per_forward_median": median_of(kept, "exchange_bytes_per_forward"),
        "encode_s_median": median_of(kept, "encode_s"),
        "decode_s_median": median_of(kept, "decode_s"),
    }


def warmup_excess(warmup_records: list[dict], step_s: Optional[float]) -> Optional[float]:
    """Seconds the warm-up edits' steps took beyond the steady step median: what compiling, autotuning
    and first-use allocation cost (``model.compile``'s time, reported apart from DiT time). None
    without both warm-up and steady edits."""
    warm = [s for r in warmup_records for s in r.get("step_s", [])]
    if not warm or step_s is None:
        return None
    return max(0.0, sum(warm) - step_s * len(warm))


def _median_and_max(by_rank: list[dict], field: str) -> dict:
    values = [r[field] for r in by_rank if r.get(field) is not None]
    return {
        f"{field}_median": float(statistics.median(values)) if values else None,
        f"{field}_max": max(values) if values else None,
    }


def startup_summary(by_rank: list[dict]) -> dict:
    """The run summary's start-up fields: median and slowest rank of the start-up and of each of its parts
    (``Startup.PARTS``; None where no rank had the part), and every rank's split."""
    met = [r["rendezvous_s"] for r in by_rank if r.get("rendezvous_s") is not None]
    parts = {name: value for part in Startup.PARTS for name, value in _median_and_max(by_rank, part).items()}
    return {
        **_median_and_max(by_rank, "startup_s"),
        "rendezvous_s_max": max(met) if met else None,
        **parts,
        "startup_by_rank": sorted(by_rank, key=lambda r: r["rank"]),
    }


def cache_summary(records: list[dict]) -> dict:
    """Medians of steps computed and cached per edit (None without records that have them)."""
    return {f"{key}_median": median_of(records, key) for key in ("steps_computed", "steps_cached")}
