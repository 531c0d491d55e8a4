"""A scaling model to 64 nodes x 8 GPUs, fed by measured numbers: latency per edit, throughput, makespan.

    python3 benchmarks/scaling.py                       # print the tables (markdown)
    python3 benchmarks/scaling.py RUN_DIR ... --write-docs   # add run directories, regenerate docs/SCALING.md
    python3 benchmarks/scaling.py --json model.json     # every cell as JSON too (the tests read it)
    python3 benchmarks/scaling.py --measure DIR         # GPU: run the published shape first, then compare

Inputs, all files (nothing here is a number typed into code except the stated fallbacks):

- ``benchmarks/results/measured.json``: points that exist only in docs/PERFORMANCE.md, each with
  its source (device, command and the PERFORMANCE.md section that tables it), the FLUX.1-dev
  geometry, the all-to-all times per message size, the GEMM and attention kernel times per
  precision, the first-edit warm-up per precision and the weights' load time.
- ditrun run directories (``summary.json`` + ``edits.jsonl``) named on the command line or found
  under ``benchmarks/results/runs/``: each gives one point (device, edit shape, layout, GPUs per
  edit, head groups, precision, DiT s per step, exposed transfer s per step). A run directory's
  point replaces a measured.json point with the same key.
- ``benchmarks/results/startup.json`` (written by ``benchmarks/startup.py``): start-up seconds
  against node count. Read as ``{"points": [{"nodes": N, "startup_s_max": s, ...}, ...]}`` (other
  accepted names: ``STARTUP_*`` below); the job waits for its slowest rank, so the maximum is read
  first. Missing: a stated assumption, said on stderr.

The model's rules and every assumption are printed above the tables (``assumptions``) and in
docs/SCALING.md; cells marked M are measured points, the others are modelled.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ditrun.parallel.layout import LAYOUTS as ALL_LAYOUTS
from ditrun.parallel.layout import layout_kind

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MEASURED_FILE = RESULTS / "measured.json"
STARTUP_FILE = RESULTS / "startup.json"
GPUS_PER_NODE = 8
RUNS_DIR = RESULTS / "runs"
DOC_FILE = ROOT / "docs" / "SCALING.md"
BEGIN_MARK = "<!-- scaling.py: begin generated tables -->"
END_MARK = "<!-- scaling.py: end generated tables -->"

NODES = (1, 2, 4, 8, 16, 32, 64)
GPUS_PER_EDIT = (1, 2, 4, 8)
WORKLOADS = (23, 10_000)
# Stated fallbacks, used only when their file is missing (the output says so).
FALLBACK_STARTUP_S = 20.0
BF16_BYTES = 2
BF16_EXCHANGE = "+bf16x"
"""Suffix of a precision whose quantized attention exchanged (or is modelled exchanging) Q, K and V in the model
dtype (``precision.quantized_exchange=false``): the comparison with the default quantized exchange."""


def qkv_ratio(attention: str, head_dim: int, element_bytes: int) -> float:
    """The qkv exchange's bytes against the model dtype's when ``attention``'s codes and scales cross it: the
    record of its payload (``kernels/attention_payload.py``; what the transports count, as
    ``tests/test_quantized_exchange.py`` checks) over 3 values a channel. 1 for an unquantized attention."""
    import torch

    from ditrun.kernels.attention_payload import payload_for

    payload = payload_for(attention, "emulation")
    if payload is None:
        return 1.0
    dtype = torch.float32 if element_bytes == 4 else torch.bfloat16
    return payload.layout(head_dim, dtype).nbytes / (3 * head_dim * element_bytes)


def base_precision(precision: str) -> str:
    """The precision's formats (``krea+bf16x`` is ``krea``'s, exchanged in the model dtype)."""
    return precision.removesuffix(BF16_EXCHANGE)


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Shape:
    """One edit's token counts: what an edit costs depends on these alone (docs/WORKLOAD.md)."""

    out_tokens: int
    ref_tokens: int
    text_tokens: int
    true_cfg: bool

    @property
    def tokens(self) -> int:
        """S: the joint sequence of one forward."""
        return self.out_tokens + self.ref_tokens + self.text_tokens

    @property
    def forwards(self) -> int:
        """DiT forwards per denoising step: 2 with true CFG (cond and uncond), else 1."""
        return 2 if self.true_cfg else 1

    def label(self) -> str:
        cfg = "true CFG on" if self.true_cfg else "true CFG off"
        return f"{self.out_tokens} output + {self.ref_tokens} reference + {self.text_tokens} text tokens, {cfg}"


def image_tokens(width: int, height: int) -> int:
    """Flux packs 2x2 latent pixels of an 8x-downsampled image into one token."""
    return (width // 16) * (height // 16)


@dataclass(frozen=True)
class Geometry:
    """What the transfer and precision models need of the DiT."""

    blocks: int
    heads: int
    hidden: int
    linears: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Point:
    """One measured configuration: seconds per denoising step and exposed transfer per step."""

    device: str
    shape: Shape
    layout: str
    gpus: int
    head_groups: int
    precision: str
    transport: str
    step_s: float
    exposed_step_s: float
    steps: int
    source: str
    geometry: Optional[Geometry] = None
    element_bytes: int = BF16_BYTES
    fixed_s: Optional[float] = None  # encode + decode seconds per edit, when real VAE weights ran
    qkv_ratio: float = 1.0
    """Bytes of its qkv exchange against the model dtype's: from the bytes its transports counted (a run's record),
    else 1 (every measured.json point exchanged BF16)."""

    @property
    def key(self) -> tuple:
        return (self.device, self.shape, self.layout, self.gpus, self.head_groups, self.precision)

    @property
    def modelled_transport(self) -> bool:
        """The transfer model is fitted to the collective library's all-to-all; one GPU has no transport."""
        return self.gpus == 1 or self.transport == "collective"


def point_shape(entry: dict) -> Shape:
    """The shape of a measured.json entry: output and reference [width, height], text tokens, true CFG."""
    return Shape(
        image_tokens(*entry["out"]), image_tokens(*entry["ref"]), int(entry["text_tokens"]), bool(entry["true_cfg"])
    )


def point_from_measured(entry: dict) -> Point:
    """A measured.json point: DiT s per edit and exposed % as the doc gives them, turned per step."""
    dit_s, steps = float(entry["dit_s"]), int(entry["steps"])
    shape = point_shape(entry)
    exposed_s = dit_s * float(entry["exposed_transfer_pct"]) / 100.0
    return Point(
        entry["device"],
        shape,
        entry["layout"],
        int(entry["gpus"]),
        int(entry["head_groups"]),
        entry["precision"],
        entry["transport"],
        dit_s / steps,
        exposed_s / steps,
        steps,
        entry["source"],
    )


def point_from_run(run_dir: Path) -> Point:
    """A ditrun run directory's point: the summary's medians after warm-up, the edit shape of its records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    record = json.loads((run_dir / "edits.jsonl").read_text().splitlines()[0])
    config, settings = summary["config"], record["settings"]
    edit, geometry = settings["edit"], settings["geometry"]
    replicas = int(config["layout"]["replicas"])
    shape = Shape(
        image_tokens(edit["width"], edit["height"]),
        image_tokens(edit["ref_width"], edit["ref_height"]),
        int(settings["text_len"]),
        float(settings["true_cfg_scale"]) > 1.0,
    )
    steps = int(record["steps"])
    heads = int(geometry["num_attention_heads"])
    # Without VAE weights the encode and decode are a linear stand-in: not a cost a real edit has.
    fixed_s = (
        (summary.get("encode_s_median") or 0.0) + (summary.get("decode_s_median") or 0.0)
        if settings.get("vae")
        else None
    )
    return Point(
        summary["device"],
        shape,
        config["layout"]["name"],
        int(summary["world"]) // replicas,
        int(config["layout"]["head_groups"]),
        summary["precision"] + ("" if record.get("quantized_exchange", True) else exchanged_values(config)),
        config["transport"]["name"],
        summary["dit_s_median"] / steps,
        (summary.get("exposed_transfer_s_median") or 0.0) / steps,
        steps,
        f"run directory {run_dir} (git {summary.get('git')}, torch {summary.get('torch')})",
        Geometry(
            int(geometry["num_layers"]) + int(geometry["num_single_layers"]),
            heads,
            heads * int(geometry["attention_head_dim"]),
        ),
        4 if settings["dtype"] == "fp32" else BF16_BYTES,
        fixed_s,
        measured_qkv_ratio(record),
    )


def exchanged_values(config: dict) -> str:
    """``BF16_EXCHANGE`` for a run whose quantized attention exchanged values (its own precision row), else ''."""
    return BF16_EXCHANGE if config["precision"].get("attention", "bf16") != "bf16" else ""


def measured_qkv_ratio(record: dict) -> float:
    """The qkv exchange's bytes against the model dtype's, from the bytes the run's transports counted: its qkv
    exchange against three times its attention output's, which always crosses in the model dtype (exact with
    shards of one size; 1 for a record from before the count, or without an exchange)."""
    sent = record.get("exchange_bytes") or {}
    if not sent.get("qkv") or not sent.get("attention_out"):
        return 1.0
    return sent["qkv"] / (3 * sent["attention_out"])


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """Every directory holding a ``summary.json`` at or below each path."""
    found = []
    for path in paths:
        found += sorted(p.parent for p in path.rglob("summary.json")) if path.is_dir() else []
    return found


@dataclass(frozen=True)
class LinkFit:
    """Time of one all-to-all exchange = latency_ms + MB to peers / (GB/s): a least-squares line.

    Without a measurement for a device the line is ``volume only`` (no latency, unit bandwidth):
    exposed transfer then scales with bytes alone, which is all the ratio below needs.
    """

    latency_ms: float
    gb_per_s: float
    source: str

    def exchange_ms(self, megabytes: float) -> float:
        return self.latency_ms + megabytes / self.gb_per_s


def fit_link(alltoall: dict) -> LinkFit:
    rows = alltoall["rows"]
    latency_ms, ms_per_mb = _line([row["to_peer_mb"] for row in rows], [row["ms"] for row in rows])
    return LinkFit(latency_ms, 1.0 / ms_per_mb, alltoall["source"])


VOLUME_ONLY = LinkFit(0.0, 1.0, "no all-to-all measured on this device: exposed transfer scales with bytes only")


@dataclass(frozen=True)
class Startup:
    """Start-up seconds (process start to first step, slowest rank) = a + b x nodes, fitted to the points."""

    base_s: float
    per_node_s: float
    measured: dict
    source: str

    def seconds(self, nodes: int) -> float:
        return self.base_s + self.per_node_s * nodes


# startup.json's field names, first found wins: the job waits for its slowest rank, so max before median.
STARTUP_LISTS = ("points", "rows", "results", "runs")
STARTUP_NODES = ("nodes", "num_nodes", "n_nodes")
STARTUP_SECONDS = (
    "startup_s_max",
    "max_startup_s",
    "startup_max_s",
    "startup_s",
    "startup_s_median",
    "median_startup_s",
)


def load_startup(path: Path) -> Startup:
    if not path.is_file():
        return Startup(
            FALLBACK_STARTUP_S,
            0.0,
            {},
            f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} is missing: assumed "
            f"{FALLBACK_STARTUP_S:.0f} s at every node count (process start, imports, device "
            "initialisation and rendezvous; not measured)",
        )
    data = json.loads(path.read_text())
    rows = data if isinstance(data, list) else next((data[k] for k in STARTUP_LISTS if k in data), [])
    measured = {}
    for row in rows:
        nodes, seconds = _first(row, STARTUP_NODES), _first(row, STARTUP_SECONDS)
        if isinstance(seconds, dict):  # {"max": s, "median": s}
            seconds = _first(seconds, ("max", "median"))
        if nodes is not None and seconds is not None:
            measured[int(nodes)] = float(seconds)
    if not measured:
        raise ValueError(
            f"{path}: no point with one of {STARTUP_NODES} and one of {STARTUP_SECONDS} under one of "
            f"{STARTUP_LISTS} (docs/SCALING.md, 'startup.json, as read here')"
        )
    about = data.get("device", "") if isinstance(data, dict) else ""
    meeting = data.get("fits", {}).get("store_meeting_s") if isinstance(data, dict) else None
    if meeting and 1 in measured and data.get("machine", "").find("emulated") >= 0:
        return _startup_from_one_node(measured, meeting, path.name)
    base, slope = _line(list(measured), list(measured.values()))
    return Startup(
        base,
        slope,
        measured,
        f"{path.name} ({about or 'device not stated'}): points at nodes "
        f"{sorted(measured)}, fitted as {base:.2f} s + {slope:.3f} s x nodes",
    )


def _startup_from_one_node(measured: dict, meeting: dict, name: str) -> Startup:
    """Emulated nodes share one machine's cores, so their start-up grows with the node count for a reason
    a real cluster does not have (each node imports and loads on its own cores). What does grow there is
    the rendezvous: one store, a fixed number of requests per rank. So: one node's measured start-up,
    plus the store meeting's measured cost per rank for the other nodes' ranks."""
    per_node = meeting["per_rank_s"] * GPUS_PER_NODE
    return Startup(
        measured[1] - per_node,
        per_node,
        measured,
        f"{name}: one node's measured start-up {measured[1]:.2f} s (process start to first step, slowest "
        f"rank) + {meeting['per_rank_s'] * 1e3:.2f} ms per rank of ditrun's store meeting (measured with "
        f"up to {meeting.get('ranks', '?')} ranks) x {GPUS_PER_NODE} ranks per node; the emulated "
        f"2- and 4-node points ({', '.join(f'{measured[n]:.1f} s' for n in sorted(measured) if n > 1)}) "
        "share two cores, so their growth is that machine's, not the protocol's",
    )


def _first(row: dict, keys: tuple):
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line; a flat line through one point."""
    if len(set(xs)) < 2:
        return statistics.fmean(ys), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


@dataclass
class Inputs:
    points: dict
    published: dict
    geometry: Geometry
    link: dict
    kernels: dict
    precisions: dict
    first_edit_extra: dict
    weights_load: dict
    startup: Startup


def load_inputs(measured_file: Path, run_dirs: list[Path], startup_file: Path) -> Inputs:
    data = json.loads(measured_file.read_text())
    geo = data["geometry"]
    points = {p.key: p for p in map(point_from_measured, data["points"])}
    for run_dir in run_dirs:
        point = point_from_run(run_dir)
        if not point.modelled_transport:
            print(
                f"scaling: {run_dir} left out: transport={point.transport} (the model's all-to-all is the "
                "collective's)",
                file=sys.stderr,
            )
            continue
        points[point.key] = point  # a run directory replaces a doc-only number of the same configuration
    geometry = Geometry(
        geo["num_layers"] + geo["num_single_layers"],
        geo["num_attention_heads"],
        geo["num_attention_heads"] * geo["attention_head_dim"],
        geo["linears_per_forward"],
    )
    link = {data["alltoall"]["device"]: fit_link(data["alltoall"])}
    return Inputs(
        points,
        data.get("published", {}),
        geometry,
        link,
        data["kernels"],
        data["precisions"],
        data["first_edit_extra_s"],
        data["weights_load_s"],
        load_startup(startup_file),
    )


# ---------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class Scenario:
    """A workload to predict: one edit shape on one device, at a number of steps."""

    name: str
    device: str
    shape: Shape
    steps: int
    precisions: tuple
    geometry: Geometry
    element_bytes: int = BF16_BYTES
    weights_load_s: float = 0.0


@dataclass(frozen=True)
class Cell:
    """One layout x GPUs per edit x precision: seconds per step, and whether that is a measured point."""

    layout: str
    gpus: int
    sp_degree: int
    head_groups: int
    precision: str
    step_s: float
    exposed_step_s: float
    measured: bool


def exchange_plan(layout: str, gpus: int, shape: Shape) -> tuple[int, int, int]:
    """(SP degree P, passes of the sharded model per step, batch per pass) of ``layout`` on ``gpus``, from the
    layout's own rules (``ditrun.parallel.layout.LAYOUTS``)."""
    kind = layout_kind(layout)
    if kind.one_worker:
        return 1, 0, 0
    batch = shape.forwards if kind.batched_cfg else 1
    passes = max(1, shape.forwards // (batch * kind.cfg_degree))
    return gpus // kind.cfg_degree, passes, batch


def transfer_step_ms(
    link: LinkFit,
    scenario_geometry: Geometry,
    element_bytes: int,
    shape: Shape,
    layout: str,
    gpus: int,
    head_groups: int,
    qkv_ratio: float = 1.0,
) -> float:
    """All-to-all milliseconds of one denoising step on one rank, if nothing overlapped them.

    Per attention each rank sends (P-1)/P of its shard of S/P tokens twice: Q, K, V (3 x hidden
    values a token, times ``qkv_ratio`` when they cross as codes) before and the attention output
    (1 x hidden) after; with G head groups each exchange is split into G messages of 1/G of the bytes.
    A quantized exchange (``qkv_ratio`` < 1) first gathers every rank's statistics: one more message
    a block, of (P-1) x heads x (head dim + 3) fp64 values a batch row.
    """
    sp, passes, batch = exchange_plan(layout, gpus, shape)
    if sp <= 1:
        return 0.0
    shard_mb = shape.tokens / sp * (sp - 1) / sp * scenario_geometry.hidden * element_bytes * batch / 1e6
    message_mb = shard_mb / head_groups
    per_attention = head_groups * (link.exchange_ms(3 * message_mb * qkv_ratio) + link.exchange_ms(message_mb))
    if qkv_ratio < 1.0:
        heads = scenario_geometry.heads
        statistics_mb = (sp - 1) * batch * heads * (scenario_geometry.hidden // heads + 3) * 8 / 1e6
        per_attention += link.exchange_ms(statistics_mb)
    return passes * scenario_geometry.blocks * per_attention


def valid_head_groups(wanted: int, heads: int, sp: int) -> int:
    """The smallest number of head groups >= ``wanted`` that divides the heads per rank (layout validation)."""
    per_rank = heads // max(sp, 1)
    if wanted >= per_rank:
        return per_rank
    return next(g for g in range(max(wanted, 1), per_rank + 1) if per_rank % g == 0)


class Model:
    """Predicts a cell from the measured points; ``assumptions`` states the rules, in order."""

    def __init__(self, inputs: Inputs):
        self.inputs = inputs

    # One GPU ---------------------------------------------------------------------------------

    def one_gpu(self, scenario: Scenario, shape: Shape, precision: str) -> Optional[tuple[float, bool]]:
        """(seconds per step on one GPU, measured?) for ``shape``: a measured point, else bf16 + kernel deltas."""
        point = self.inputs.points.get((scenario.device, shape, "single", 1, 1, precision))
        if point is not None:
            return point.step_s, True
        if precision == "bf16" or precision not in self.inputs.precisions:
            return None
        base = self.one_gpu(scenario, shape, "bf16")
        delta = self.precision_delta_s(scenario, shape, precision)
        return None if base is None or delta is None else (base[0] + delta, False)

    def precision_delta_s(self, scenario: Scenario, shape: Shape, precision: str) -> Optional[float]:
        """Seconds a step gains (negative) from ``precision``'s kernels against bf16, from the kernel tables."""
        kernels = self.inputs.kernels
        if kernels["device"] != scenario.device:
            return None
        formats = self.inputs.precisions[precision]
        delta_ms = 0.0
        for linear, count in scenario.geometry.linears.items():
            ms = [gemm_ms(kernels["gemm_ms"], linear, fmt, shape.tokens) for fmt in (formats[linear], "bf16")]
            delta_ms += count * (ms[0] - ms[1])
        if formats["attention"] != "bf16":
            table = kernels["attention_ms"].get(str(shape.tokens), {})
            if formats["attention"] not in table:
                return None  # attention is quadratic in S: no interpolation, only a measured length
            delta_ms += scenario.geometry.blocks * (table[formats["attention"]] - table["bf16"])
        return shape.forwards * delta_ms / 1e3

    # Several GPUs ----------------------------------------------------------------------------

    def reference(self, device: str, layout: str, shape: Shape) -> Optional[tuple[Point, float]]:
        """The measured multi-GPU point of ``layout`` with the best speedup (of ``shape`` if there is one), and
        the one-GPU step of its shape and precision."""
        found = []
        for point in self.inputs.points.values():
            base = self.inputs.points.get((device, point.shape, "single", 1, 1, point.precision))
            if (point.device, point.layout) == (device, layout) and point.gpus >= 2 and base is not None:
                found.append((point.shape != shape, point.step_s / base.step_s, point, base.step_s))
        return min(found, key=lambda f: f[:2])[2:] if found else None

    def geometry_of(self, point: Point) -> Geometry:
        return point.geometry or self.inputs.geometry

    def link(self, device: str) -> LinkFit:
        return self.inputs.link.get(device, VOLUME_ONLY)

    def exposed_fraction(self, ref: Point) -> float:
        """Exposed / modelled all-to-all time of the reference point (0 when it has no all-to-all)."""
        total = (
            transfer_step_ms(
                self.link(ref.device),
                self.geometry_of(ref),
                ref.element_bytes,
                ref.shape,
                ref.layout,
                ref.gpus,
                ref.head_groups,
                ref.qkv_ratio,
            )
            / 1e3
        )
        return ref.exposed_step_s / total if total > 0 else 0.0

    def exchange_ratio(self, scenario: Scenario, precision: str) -> float:
        """``qkv_ratio`` of ``precision`` in ``scenario``: its attention's codes (the default exchange), or 1 for a
        ``+bf16x`` precision or one whose formats are unknown here."""
        formats = self.inputs.precisions.get(precision)
        if formats is None:
            return 1.0
        head_dim = scenario.geometry.hidden // scenario.geometry.heads
        return qkv_ratio(formats["attention"], head_dim, scenario.element_bytes)

    def efficiency(self, ref: Point, one_gpu_s: float) -> float:
        """Compute efficiency of the reference point: one-GPU step / (GPUs x its step without exposed transfer)."""
        return one_gpu_s / (ref.gpus * (ref.step_s - ref.exposed_step_s))

    def sp_efficiency(self, device: str, shape: Shape, sp: int) -> float:
        """Ulysses' measured compute efficiency for P >= 2 (held for every P), 1 for P = 1."""
        ref = self.reference(device, "ulysses", shape)
        return self.efficiency(*ref) if sp >= 2 and ref is not None else 1.0

    def cell(self, scenario: Scenario, layout: str, gpus: int, precision: str) -> Optional[Cell]:
        one = self.one_gpu(scenario, scenario.shape, base_precision(precision))
        if one is None or (precision != base_precision(precision) and layout == "single"):
            return None
        if layout == "single":
            return Cell("single", 1, 1, 1, precision, one[0], 0.0, one[1])
        ref = self.reference(scenario.device, layout, scenario.shape)
        if ref is None:
            return None
        point, ref_one_gpu = ref
        sp = exchange_plan(layout, gpus, scenario.shape)[0]
        head_groups = valid_head_groups(point.head_groups, scenario.geometry.heads, sp)
        measured = self.inputs.points.get((scenario.device, scenario.shape, layout, gpus, head_groups, precision))
        if measured is not None:
            return Cell(layout, gpus, sp, head_groups, precision, measured.step_s, measured.exposed_step_s, True)
        compute = one[0] / (gpus * self.compute_efficiency(scenario, point, ref_one_gpu, sp))
        exposed = self.exposed_s(scenario, point, layout, gpus, head_groups, self.exchange_ratio(scenario, precision))
        return Cell(layout, gpus, sp, head_groups, precision, compute + exposed, exposed, False)

    def compute_efficiency(self, scenario: Scenario, point: Point, ref_one_gpu: float, sp: int) -> float:
        """cfg_split: the measured CFG efficiency times Ulysses' for the SP inside each branch's group."""
        measured = self.efficiency(point, ref_one_gpu)
        if point.layout != "cfg_split":
            return measured
        ref_sp = exchange_plan(point.layout, point.gpus, point.shape)[0]
        return (
            measured
            / self.sp_efficiency(point.device, point.shape, ref_sp)
            * self.sp_efficiency(point.device, scenario.shape, sp)
        )

    def exposed_s(
        self, scenario: Scenario, point: Point, layout: str, gpus: int, head_groups: int, ratio: float = 1.0
    ) -> float:
        """Exposed transfer per step: the reference's exposed fraction of the modelled all-to-all time (``ratio``:
        the qkv exchange's bytes against the model dtype's, ``exchange_ratio``).

        cfg_split's reference (P = 1 on 2 GPUs) has no all-to-all: its exposed time is the
        prediction swap and velocity gather, scaled by output tokens; its all-to-all part borrows
        Ulysses' exposed fraction.
        """
        link = self.link(scenario.device)
        modelled = (
            transfer_step_ms(
                link, scenario.geometry, scenario.element_bytes, scenario.shape, layout, gpus, head_groups, ratio
            )
            / 1e3
        )
        if layout != "cfg_split":
            return self.exposed_fraction(point) * modelled
        ulysses = self.reference(scenario.device, "ulysses", scenario.shape)
        fraction = self.exposed_fraction(ulysses[0]) if ulysses is not None else 0.0
        ref_modelled = (
            transfer_step_ms(
                link,
                self.geometry_of(point),
                point.element_bytes,
                point.shape,
                layout,
                point.gpus,
                point.head_groups,
                point.qkv_ratio,
            )
            / 1e3
        )
        fixed = max(0.0, point.exposed_step_s - fraction * ref_modelled)
        return fixed * scenario.shape.out_tokens / point.shape.out_tokens + fraction * modelled

    # Time per edit, throughput, makespan ------------------------------------------------------

    def fixed_s(self, scenario: Scenario) -> Optional[float]:
        """Encode + decode seconds per edit measured with real VAE weights at this shape; None: not measured."""
        found = [
            p.fixed_s
            for p in self.inputs.points.values()
            if (p.device, p.shape) == (scenario.device, scenario.shape) and p.fixed_s is not None
        ]
        return min(found) if found else None

    def latency_s(self, scenario: Scenario, cell: Cell) -> float:
        """Seconds per edit: steps x seconds per step, + encode and decode where measured (else excluded)."""
        return scenario.steps * cell.step_s + (self.fixed_s(scenario) or 0.0)

    @staticmethod
    def replicas(nodes: int, gpus: int, gpus_per_node: int = GPUS_PER_NODE) -> int:
        return nodes * gpus_per_node // gpus

    def throughput(self, scenario: Scenario, cell: Cell, nodes: int) -> float:
        """Edits per second in steady state (start-up excluded): every replica finishing one edit per latency."""
        return self.replicas(nodes, cell.gpus) / self.latency_s(scenario, cell)

    def startup_s(self, scenario: Scenario, precision: str, nodes: int) -> float:
        extra = self.inputs.first_edit_extra.get(base_precision(precision), {}).get("s", 0.0)
        return self.inputs.startup.seconds(nodes) + scenario.weights_load_s + extra

    def makespan_s(self, scenario: Scenario, cell: Cell, nodes: int, edits: int, startup: bool = True) -> float:
        """Start-up + rounds of edits: replica r takes edits r, r + R, ... so the last round may be partial."""
        rounds = math.ceil(edits / self.replicas(nodes, cell.gpus))
        fixed = self.startup_s(scenario, cell.precision, nodes) if startup else 0.0
        return fixed + rounds * self.latency_s(scenario, cell)


def gemm_ms(table: dict, linear: str, fmt: str, rows: int) -> float:
    """A GEMM's milliseconds at ``rows`` tokens: linear between the measured M, proportional outside them."""
    measured = sorted((int(m), by_linear[linear][fmt]) for m, by_linear in table.items())
    for (m0, t0), (m1, t1) in zip(measured, measured[1:]):
        if m0 <= rows <= m1:
            return t0 + (t1 - t0) * (rows - m0) / (m1 - m0)
    m, t = measured[0] if rows < measured[0][0] else measured[-1]
    return t * rows / m


# ---------------------------------------------------------------------------------------------
# Scenarios, tables, the doc

PUBLISHED = Shape(image_tokens(2048, 2048), image_tokens(1024, 1024), 512, False)
ONE_MP_CFG = Shape(image_tokens(1024, 1024), image_tokens(1024, 1024), 512, True)
LAYOUTS = tuple(ALL_LAYOUTS.names())


def builtin_scenarios(inputs: Inputs) -> list[Scenario]:
    load = inputs.weights_load["s"]
    return [
        Scenario(
            "published Kontext workload (conf/workload/benchmark.yaml): 2048x2048 output, 1024x1024 reference, "
            "28 steps",
            "NVIDIA H200",
            PUBLISHED,
            28,
            ("bf16", "fp8", "krea", "krea" + BF16_EXCHANGE),
            inputs.geometry,
            BF16_BYTES,
            load,
        ),
        Scenario(
            "1 MP Kontext edit with true CFG (the shape of the 2-GPU measurements), 28 steps",
            "NVIDIA H200",
            ONE_MP_CFG,
            28,
            ("bf16", "fp8"),
            inputs.geometry,
            BF16_BYTES,
            load,
        ),
    ]


def run_scenarios(inputs: Inputs, builtin: list[Scenario]) -> list[Scenario]:
    """One scenario per (device, shape) that the inputs measured and no built-in scenario covers."""
    covered = {(s.device, s.shape) for s in builtin}
    found: dict = {}
    for point in inputs.points.values():
        if point.geometry is not None and (point.device, point.shape) not in covered:
            found.setdefault((point.device, point.shape), []).append(point)
    scenarios = []
    for (device, shape), points in found.items():
        precisions = tuple(sorted({p.precision for p in points}))
        # A built-in shape on another device (an MI355X run of the published workload) keeps its steps and load.
        like = next((s for s in builtin if s.shape == shape), None)
        steps, load = (like.steps, like.weights_load_s) if like else (points[0].steps, 0.0)
        scenarios.append(
            Scenario(
                f"measured runs on {device}: {shape.label()}, {steps} steps",
                device,
                shape,
                steps,
                precisions,
                points[0].geometry,
                points[0].element_bytes,
                load,
            )
        )
    return scenarios


def rows_of(scenario: Scenario) -> list[tuple[str, int]]:
    """(layout, GPUs per edit) rows; without true CFG cfg_batch is ulysses and cfg_split is refused."""
    layouts = LAYOUTS if scenario.shape.true_cfg else ("single", "ulysses")
    return [(layout, g) for layout in layouts for g in GPUS_PER_EDIT if (layout == "single") == (g == 1)]


def model_cells(model: Model, scenario: Scenario) -> list[Cell]:
    cells = []
    for precision in scenario.precisions:
        for layout, gpus in rows_of(scenario):
            cell = model.cell(scenario, layout, gpus, precision)
            if cell is not None:
                cells.append(cell)
    return cells


def as_json(model: Model, scenarios: list[Scenario]) -> dict:
    out = {"assumptions": assumptions(model), "scenarios": []}
    for scenario in scenarios:
        cells = []
        for cell in model_cells(model, scenario):
            by_nodes = {
                n: {
                    "replicas": model.replicas(n, cell.gpus),
                    "throughput": model.throughput(scenario, cell, n),
                    "round_s": model.makespan_s(scenario, cell, n, model.replicas(n, cell.gpus), startup=False),
                    "startup_s": model.startup_s(scenario, cell.precision, n),
                    "makespan_s": {e: model.makespan_s(scenario, cell, n, e) for e in WORKLOADS},
                    "makespan_compute_s": {e: model.makespan_s(scenario, cell, n, e, startup=False) for e in WORKLOADS},
                }
                for n in NODES
            }
            cells.append({**cell.__dict__, "latency_s": model.latency_s(scenario, cell), "nodes": by_nodes})
        out["scenarios"].append(
            {
                "name": scenario.name,
                "device": scenario.device,
                "steps": scenario.steps,
                "shape": scenario.shape.__dict__,
                "cells": cells,
            }
        )
    return out


def assumptions(model: Model) -> list[str]:
    inputs = model.inputs
    lines = [
        "Latency per edit = steps x (one-GPU step / (GPUs per edit x compute efficiency) + exposed transfer per step) "
        "+ encode and decode (image load, VAE, prompt embeddings: the encode_s + decode_s medians of a run directory "
        "of the same shape with real VAE weights, not divided by SP); without such a run they are excluded, as for "
        "every input so far (random weights, the linear latent map, stand-in prompt embeddings).",
        "One-GPU step: a measured point of the same device, shape and precision (M); else the bf16 step plus, per "
        "forward, the measured kernel-time differences of the precision's GEMMs (linear in M between the measured M) "
        "and attention (measured sequence lengths only), counted per layer. The fp8 GEMMs include their activation "
        "quantizer; their speedup at M = S is assumed to hold at the per-rank M = S/P.",
        "Compute efficiency: taken from the measured multi-GPU point of each layout with the best speedup, and held "
        "for every GPU count (optimistic for P = 4, 8: smaller per-rank GEMMs are less efficient); cfg_split on g "
        "GPUs = its measured CFG efficiency x Ulysses' efficiency for P = g/2 >= 2. Without true CFG, cfg_batch "
        "runs as ulysses and cfg_split is refused (docs/WORKLOAD.md).",
        "All-to-all per exchange = latency + MB to peers / bandwidth, a least-squares line through the measured "
        "2-GPU messages; per attention each rank sends (P-1)/P of its S/P-token shard twice (Q, K, V: 3 x hidden; "
        "output: 1 x hidden; bf16), as G head-group messages; per step x blocks x passes (ulysses: one per CFG "
        "branch; cfg_batch: one of batch 2; cfg_split: one branch per group of g/2). The per-rank bandwidth "
        "measured between 2 GPUs is held at P = 4 and 8 (an NVSwitch or full-mesh node).",
        "Quantized exchange (krea, the default precision.quantized_exchange): Q, K and V cross as their attention "
        "format's codes and scales, the qkv message "
        + qkv_ratio_text(inputs)
        + " of the bf16 one's (the payload's record, what the transports count), after one more message per block "
        "(every rank's fp64 statistics); krea+bf16x is krea exchanging bf16 (quantized_exchange=false), for "
        "comparison. A run directory's own ratio is the bytes its transports counted.",
        "Exposed transfer per step = the reference point's exposed fraction of that modelled all-to-all time, at the "
        "new P and size; cfg_split's prediction swap and velocity gather keep their measured seconds, scaled by "
        "output tokens. Head groups: the reference's, raised to the next divisor of the heads per rank (24 heads: "
        "3 per rank at P = 8).",
        "SP and CFG groups never span nodes (8 GPUs per node), so latency per edit does not depend on the node "
        "count; replicas = nodes x 8 / GPUs per edit; steady throughput = replicas / latency (exactly linear in "
        "nodes).",
        "Makespan of N edits = start-up(nodes) + weights load + first-edit warm-up of the precision + ceil(N / "
        "replicas) x latency: edits are dealt to replicas round robin, so the last round may be partial (the tail); "
        "past N replicas more nodes cannot lower it, only more GPUs per edit can.",
        f"Start-up: {inputs.startup.source}.",
        f"Weights load (built-in FLUX.1-dev scenarios): {inputs.weights_load['s']} s, {inputs.weights_load['source']}; "
        "assumed the same on every node (each node reads its own copy at that speed).",
        "First-edit warm-up per precision (once per run, replicas warm up in parallel): "
        + "; ".join(f"{p} {v['s']} s ({v['source']})" for p, v in inputs.first_edit_extra.items())
        + ".",
    ]
    for device, link in inputs.link.items():
        lines.append(
            f"All-to-all on {device}: {link.latency_ms * 1e3:.0f} us + MB / {link.gb_per_s:.0f} GB/s, "
            f"fitted to {link.source}."
        )
    return lines


def qkv_ratio_text(inputs: Inputs) -> str:
    """'x 0.51 (int8qk_mxfp6v)' for each quantized attention of the committed precisions, head dim 128, bf16."""
    head_dim = inputs.geometry.hidden // inputs.geometry.heads
    formats = sorted({f["attention"] for f in inputs.precisions.values() if f["attention"] != "bf16"})
    return ", ".join(f"x {qkv_ratio(a, head_dim, BF16_BYTES):.3f} ({a}, head dim {head_dim})" for a in formats)


def fmt_s(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def mark(text: str, measured: bool) -> str:
    return f"**{text} M**" if measured else text


def row_label(cell: Cell) -> str:
    groups = f", G={cell.head_groups}" if cell.sp_degree > 1 else ""
    if cell.layout == "cfg_split":
        return f"cfg_split ({cell.gpus} GPUs: 2 x P={cell.sp_degree}{groups})"
    if cell.layout == "single":
        return "single (1 GPU)"
    return f"{cell.layout} (P={cell.sp_degree}{groups})"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def per_edit_table(model: Model, scenario: Scenario, cells: list[Cell]) -> str:
    rows = []
    for cell in cells:
        latency = model.latency_s(scenario, cell)
        exposed_pct = 100.0 * cell.exposed_step_s / cell.step_s
        rows.append(
            [
                row_label(cell),
                cell.precision,
                mark(f"{cell.step_s:.4f}", cell.measured),
                mark(fmt_s(latency), cell.measured),
                f"{exposed_pct:.1f}%",
                f"{model.throughput(scenario, cell, 1):.3f}",
            ]
        )
    return md_table(
        ["layout", "precision", "s / step", "latency s / edit", "exposed", "edits/s per node (x nodes)"], rows
    )


def makespan_table(model: Model, scenario: Scenario, cells: list[Cell], edits: int) -> str:
    rows = []
    for cell in cells:
        values = []
        for n in NODES:
            seconds = model.makespan_s(scenario, cell, n, edits)
            rate = f" ({edits / seconds:.2f}/s)" if edits >= 1000 else ""
            values.append(fmt_s(seconds) + rate + (" *" if model.replicas(n, cell.gpus) >= edits else ""))
        rows.append([f"{row_label(cell)}, {cell.precision}"] + values)
    return md_table(["layout, precision"] + [f"{n} node{'s' if n > 1 else ''}" for n in NODES], rows)


def published_line(model: Model, scenario: Scenario) -> str:
    """The published figures of this shape, if any, for comparison (they feed no cell)."""
    published = model.inputs.published
    if not published or point_shape(published) != scenario.shape:
        return ""
    rows = "; ".join(f"{r['what']}: {r['dit_s']} s per edit on {r['gpus']} {r['device']}" for r in published["rows"])
    return f" For comparison, not an input: {rows} ({published['steps']} steps; {published['source']})."


def derived_table(model: Model, scenarios: list[Scenario]) -> str:
    """What the model takes from each layout's reference point: compute efficiency e and exposed fraction f."""
    rows = []
    for scenario in scenarios:
        for layout in dict.fromkeys(layout for layout, gpus in rows_of(scenario) if gpus > 1):
            ref = model.reference(scenario.device, layout, scenario.shape)
            if ref is None:
                continue
            point, one_gpu = ref
            fraction = model.exposed_fraction(point) if layout != "cfg_split" else None
            rows.append(
                [
                    scenario.name.split(":")[0].split(" (")[0],
                    layout,
                    f"{point.gpus} GPUs, G={point.head_groups}, {point.precision}, {point.shape.tokens} tokens"
                    f"{', true CFG' if point.shape.true_cfg else ''}",
                    f"{one_gpu / point.step_s:.2f}x",
                    f"{model.efficiency(point, one_gpu):.3f}",
                    "-" if fraction is None else f"{fraction:.2f}",
                ]
            )
    return md_table(["scenario", "layout", "reference point (measured)", "speedup", "e", "f"], rows)


def render(model: Model, scenarios: list[Scenario]) -> str:
    parts = [
        "### Assumptions (generated)",
        "",
        *[f"{i}. {a}" for i, a in enumerate(assumptions(model), 1)],
        "",
        "Cells in **bold with M** are measured points (s / step as measured; latency = steps x that, + encode and "
        "decode where measured); every "
        "other cell is modelled. Makespans include start-up, weights load and warm-up; throughput per node "
        "excludes them. A makespan marked * is one round: there are at least as many replicas as edits, "
        "so more nodes cannot shorten it.",
        "",
        "Taken from each layout's reference point (e: compute efficiency; f: exposed share of the modelled "
        "all-to-all time, which can exceed 1 since the exposed time also holds the velocity gather and waits "
        "for a slower peer; cfg_split's reference has no all-to-all: its exposed seconds are kept, and its "
        "all-to-all at P = g/2 takes Ulysses' f):",
        "",
        derived_table(model, scenarios),
        "",
    ]
    for scenario in scenarios:
        cells = model_cells(model, scenario)
        fixed = model.fixed_s(scenario)
        fixed_text = "excluded (not measured)" if fixed is None else f"{fixed:.3f} s, measured"
        parts += [
            f"### {scenario.name}",
            "",
            f"{scenario.device}; {scenario.shape.label()} (S = "
            f"{scenario.shape.tokens} per forward); VAE and text encoders per edit: {fixed_text}."
            + (
                ""
                if scenario.shape.true_cfg
                else " True CFG off: `cfg_batch` runs as `ulysses` (one branch, "
                "batch 1) and `cfg_split` is refused, so neither has rows."
            )
            + published_line(model, scenario),
            "",
            "Per edit (does not depend on the node count):",
            "",
            per_edit_table(model, scenario, cells),
            "",
        ]
        if not cells:
            continue
        for edits in WORKLOADS:
            what = "makespan s" + (" (edits/s over the whole run)" if edits >= 1000 else "")
            parts += [
                f"{edits:,} edits, {what}, nodes x 8 GPUs:",
                "",
                makespan_table(model, scenario, cells, edits),
                "",
            ]
    return "\n".join(parts)


def write_docs(text: str, doc: Path = DOC_FILE) -> None:
    """Replace what lies between the markers of ``doc`` with ``text``: the doc's tables are never hand-edited."""
    current = doc.read_text()
    pattern = re.compile(re.escape(BEGIN_MARK) + ".*?" + re.escape(END_MARK), re.S)
    if not pattern.search(current):
        raise SystemExit(f"{doc} has no '{BEGIN_MARK}' ... '{END_MARK}' markers")
    doc.write_text(pattern.sub(lambda _: f"{BEGIN_MARK}\n{text}\n{END_MARK}", current))


def build(
    measured: Path = MEASURED_FILE, run_dirs: Optional[list[Path]] = None, startup: Path = STARTUP_FILE
) -> tuple[Model, list[Scenario]]:
    """The model of these inputs and its scenarios: the built-in ones, then one per other measured shape."""
    inputs = load_inputs(measured, find_run_dirs([RUNS_DIR]) if run_dirs is None else run_dirs, startup)
    builtin = builtin_scenarios(inputs)
    return Model(inputs), builtin + run_scenarios(inputs, builtin)


# ---------------------------------------------------------------------------------------------
# GPU runs that feed the model, each beside what the model predicted without it

# (folder name, GPUs per edit, ditrun overrides): the published shape (true CFG off), run with every
# configuration the visible GPUs allow; P = 4 and 8 only where 4 or 8 GPUs are visible.
MEASURE_RUNS = (
    ("single-bf16", 1, ()),
    ("single-fp8", 1, ("precision=fp8",)),
    ("ulysses-p2-g1-bf16", 2, ("layout=ulysses",)),
    ("ulysses-p2-g2-bf16", 2, ("layout=ulysses", "layout.head_groups=2")),
    ("ulysses-p4-g2-bf16", 4, ("layout=ulysses", "layout.head_groups=2")),
    ("ulysses-p8-g3-bf16", 8, ("layout=ulysses", "layout.head_groups=3")),
)
MEASURE_BASE = (
    "workload=benchmark",
    "model=flux-dev",
    "workload.limit=2",
    "metrics.ssim=false",
    "metrics.report=false",
    "wandb.mode=disabled",
    "progress=false",
)
RUN_FILES = ("summary.json", "edits.jsonl")


def measure(out: Path, steps: int, only: list[str], timeout_s: float) -> list[Path]:
    """Run each configuration of ``MEASURE_RUNS`` that fits the visible GPUs; keep its two files under ``out``."""
    import os
    import shutil
    import subprocess
    import tempfile

    import torch

    visible = torch.cuda.device_count()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1"}
    kept = []
    for name, gpus, overrides in MEASURE_RUNS:
        if only and name not in only:
            continue
        if gpus > visible:
            print(f"scaling: {name} not run ({gpus} GPUs needed, {visible} visible)", file=sys.stderr)
            continue
        run_dir = Path(tempfile.mkdtemp(prefix=f"scaling-{name}-"))
        command = [
            sys.executable,
            "-m",
            "ditrun",
            *MEASURE_BASE,
            f"workload.steps={steps}",
            f"launcher.world={gpus}",
            *overrides,
            f"hydra.run.dir={run_dir}",
        ]
        print("$", " ".join(command), file=sys.stderr, flush=True)
        try:
            done = subprocess.run(command, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"scaling: {name} ran past {timeout_s:.0f} s; left out", file=sys.stderr)
            continue
        if done.returncode != 0 or not (run_dir / "summary.json").is_file():
            print(f"scaling: {name} failed (exit {done.returncode}); left out", file=sys.stderr)
            continue
        device = json.loads((run_dir / "summary.json").read_text())["device"]
        device_slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
        dest = out / f"{time.strftime('%Y-%m-%d')}-{device_slug}-published-{name}"
        dest.mkdir(parents=True, exist_ok=True)
        for file in RUN_FILES:
            shutil.copy(run_dir / file, dest / file)
        kept.append(dest)
    return kept


def prediction_table(before: Model, scenarios: list[Scenario], run_dirs: list[Path]) -> str:
    """Each new run's seconds per step beside the cell the model gave without it (M: it was measured already)."""
    rows = []
    for run_dir in run_dirs:
        point = point_from_run(run_dir)
        scenario = next((s for s in scenarios if (s.device, s.shape) == (point.device, point.shape)), None)
        cell = before.cell(scenario, point.layout, point.gpus, point.precision) if scenario else None
        predicted = "-" if cell is None else mark(f"{cell.step_s:.4f}", cell.measured) + f" (G={cell.head_groups})"
        ratio = "-" if cell is None else f"{point.step_s / cell.step_s:.3f}"
        rows.append(
            [
                run_dir.name,
                f"{point.layout} x{point.gpus}, G={point.head_groups}, {point.precision}",
                predicted,
                f"{point.step_s:.4f}",
                f"{100 * point.exposed_step_s / point.step_s:.1f}%",
                ratio,
            ]
        )
    return md_table(
        ["run", "configuration", "model before it, s / step", "measured s / step", "exposed", "measured / model"], rows
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="ditrun run directories (or folders holding them)")
    parser.add_argument("--measured", type=Path, default=MEASURED_FILE)
    parser.add_argument("--startup", type=Path, default=STARTUP_FILE)
    parser.add_argument("--no-default-runs", action="store_true", help=f"do not read {RUNS_DIR.relative_to(ROOT)}/")
    parser.add_argument("--json", type=Path, help="also write every cell as JSON here")
    parser.add_argument(
        "--write-docs", action="store_true", help=f"regenerate the tables in {DOC_FILE.relative_to(ROOT)}"
    )
    parser.add_argument(
        "--measure",
        type=Path,
        metavar="DIR",
        help="GPU: first run the published shape in every configuration the GPUs allow, keep the run "
        "directories under DIR and print each beside the model's prediction without it",
    )
    parser.add_argument("--steps", type=int, default=6, help="--measure: denoising steps per edit (2 edits a run)")
    parser.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="--measure: only these of " + ", ".join(name for name, _, _ in MEASURE_RUNS),
    )
    parser.add_argument("--run-timeout", type=float, default=300.0, help="--measure: seconds per ditrun run")
    args = parser.parse_args(argv)
    run_dirs = find_run_dirs(args.runs + ([] if args.no_default_runs else [RUNS_DIR]))
    if not args.startup.is_file():
        print(
            f"scaling: {args.startup} is missing; start-up assumed {FALLBACK_STARTUP_S:.0f} s at every node count",
            file=sys.stderr,
        )
    new_runs = measure(args.measure, args.steps, args.only, args.run_timeout) if args.measure else []
    model, scenarios = build(args.measured, run_dirs + new_runs, args.startup)
    text = render(model, scenarios)
    print(text)
    if new_runs:
        print("\n### The new runs beside the model without them\n")
        print(prediction_table(build(args.measured, run_dirs, args.startup)[0], scenarios, new_runs))
    if args.json:
        args.json.write_text(json.dumps(as_json(model, scenarios), indent=1))
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
