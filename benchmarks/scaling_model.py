"""The scaling model behind ``benchmarks/scaling.py``: its inputs (measured points, run directories, start-up)
and the rules that turn them into seconds per step, per edit and per workload for each layout, GPUs per edit and
node count.

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
"""

from __future__ import annotations

import json
import math
import statistics
import sys
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


def build(
    measured: Path = MEASURED_FILE, run_dirs: Optional[list[Path]] = None, startup: Path = STARTUP_FILE
) -> tuple[Model, list[Scenario]]:
    """The model of these inputs and its scenarios: the built-in ones, then one per other measured shape."""
    inputs = load_inputs(measured, find_run_dirs([RUNS_DIR]) if run_dirs is None else run_dirs, startup)
    builtin = builtin_scenarios(inputs)
    return Model(inputs), builtin + run_scenarios(inputs, builtin)
