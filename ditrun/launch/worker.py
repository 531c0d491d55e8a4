"""One worker: build the model once, then run this replica's share of the edits.

The order matters: every check a user's config can fail (workload, layout, precision) runs
before the model is built, so a mistake costs seconds, not a 12B-parameter load.

Loading runs in phases that each rank works through alone (``Run.solo``: encoding the prompts,
the reference pass, building the model, and each compilation inside the first steps), separated
by barriers at which every rank waits for the others (``job.barrier``). A stop signal ends a
solo phase at once and a barrier with the same outcome on every rank, so no rank enters a
collective that a stopped peer will never join; the run then ends as a stopped edit loop does.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import subprocess
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ditrun.launch import env, faults, rendezvous
from ditrun.launch.job import LocalJob, job_of_process_group
from ditrun.launch.stop import RunStopped
from ditrun import cache, metrics
from ditrun.metrics import full_quality, quality, reference, results, rundir, timing
from ditrun.metrics import target as targets
from ditrun.metrics import wandb as wandb_log
from ditrun.metrics.progress import Progress
from ditrun.metrics.timing import ExposedTransfer, Interval, StepTimer, peak_memory_bytes, reset_peak_memory
from ditrun.model.compile import plan_compile
from ditrun.model.build import (build_model, compute_dtype, device_kind, inexact_repack_rows, model_geometry,
                                 plan_precision, precision_label, select_placement)
from ditrun.model import compile_cache, text
from ditrun.model.graphs import capture_seconds
from ditrun.model.latents import VAE_SCALE, make_latent_codec, unpack
from ditrun.model.sampler import denoise
from ditrun.parallel.cfg import check_true_cfg, layout_velocity, prepare_transports
from ditrun.parallel.layout import LayoutPlan, build_layout, plan_layout
from ditrun.transport.registry import check_transport, make_transport
from ditrun.model.memory import check_memory
from ditrun.workload import (Edit, check_inputs, declared_edits, edit_inputs, edit_tokens, resolve_edits,
                             resolve_text_len)
from ditrun.workload import check_config as check_workload_config
from ditrun.errors import UserError



def _check_memory(edits: list[Edit], cfg, geometry, plan: LayoutPlan, placement) -> None:
    """``model.memory.check_memory`` with this run's inputs: the edits' token counts, the widest dtype the model is
    built in (its own, or the SSIM references'), and the ranks that share this machine."""
    dtypes = [placement.dtype]
    if cfg.metrics.ssim and cfg.metrics.reference_dtype:
        dtypes.append(reference.REFERENCE_DTYPES[cfg.metrics.reference_dtype])
    element = max(torch.empty(0, dtype=d).element_size() for d in dtypes)
    info = env.discover()
    tokens = {edit.id: edit_tokens(edit, cfg.workload.text_len) for edit in edits}
    check_memory(edits, tokens, element, geometry, plan, placement, info.local_world if info is not None else 1)


def check_config(cfg, world: Optional[int] = None) -> LayoutPlan:
    """Config errors that are not type errors, raised before anything expensive; returns the layout plan.

    ``world`` is the number of ranks that will run (default: ``launcher.world``), so a launcher
    can call this before it spawns anything.
    """
    resolve_text_len(cfg)  # the model's when unset: every later check and rank reads the number
    device = device_kind(cfg.device)
    compute_dtype(device, cfg.model.dtype)  # a bad model.dtype fails here, before any rank starts
    plan_precision(cfg.precision, device)
    compile_cache.check_config(cfg.model, plan_compile(cfg.model, device))
    check_transport(cfg.transport)
    check_workload_config(cfg.workload)
    check_true_cfg(cfg.layout.name, cfg.workload.true_cfg_scale)
    metrics.check_config(cfg)
    world = cfg.launcher.world if world is None else world
    geometry = model_geometry(cfg.model)
    text.check_components(cfg.model.path, cfg.workload.vae_path)
    cache.check_config(cfg.cache, cfg.workload.steps, geometry.num_layers + geometry.num_single_layers)
    check_inputs(resolve_edits(cfg.workload), geometry)
    return plan_layout(cfg.layout, world, geometry.num_attention_heads)


def git_revision(where: Path = Path(__file__).parent) -> str:
    """The commit of the checkout holding ``where`` (ditrun's own, by default), with "+modified" where tracked files
    differ from it (the code that ran is not the commit's), or "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=5).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = commit and git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) or "unknown"


def _source(image: str) -> str:
    """An edit's picture as its record names it: ``skimage:<name>``, or the file's absolute path."""
    return image if image.startswith("skimage:") else str(Path(image).resolve())


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


class Run:
    """State of one worker's run: placement, layout, model, codec and output directory.

    Built in two stages: the constructor makes every check and the process groups (seconds);
    ``load`` makes the references and builds the model (minutes for a large one), once the
    results directory has been claimed.
    """

    def __init__(self, cfg, out_dir: Path, nodes: Sequence[str] = ()):
        self.cfg = cfg
        self.out_dir = out_dir
        # Under a launcher the process group is the truth; alone, launcher.world must say 1.
        plan = check_config(cfg, dist.get_world_size() if dist.is_initialized() else None)
        self.edits = resolve_edits(cfg.workload)  # check_config has checked their sources and embeddings
        self.geometry = model_geometry(cfg.model)
        self.placement = select_placement(cfg.device, cfg.model.dtype)
        self.precision = plan_precision(cfg.precision, self.placement.device)
        self.precision_label = precision_label(self.precision, self.placement.dtype_name)
        self.speed = plan_compile(cfg.model, self.placement.device)
        self.settings = {edit.id: self._result_settings(edit) for edit in self.edits}
        self.directory_edits = [edit.id for edit in self.edits]  # global rank 0 learns the directory's in ``_claim``
        _check_memory(self.edits, cfg, self.geometry, plan, self.placement)
        self.layout = build_layout(plan, timedelta(seconds=cfg.launcher.collective_timeout_s), nodes)
        self.references: Optional[reference.References] = None
        self.built = None
        self.compile_cache: Optional[compile_cache.CompileCache] = None  # once the model is built (``load``)
        self.run_id: Optional[str] = None  # global rank 0's, once it claims the directory (``_claim``)
        # Names the process that writes this replica's records: a resumed run's first edits are its own warm-up.
        self.session = uuid.uuid4().hex[:12]

    @contextmanager
    def solo(self, job: LocalJob, phase: str) -> Iterator[None]:
        """Work of this rank alone, with no collective until the next stop point: a stop signal ends it at once
        (``RunStopped``). ``launcher.fault.pause_in`` holds a rank here, for the tests."""
        with job.stop.raising():
            faults.pause(self.cfg.launcher.fault, phase, self.layout.rank)
            yield

    def compile_guarded(self, job: LocalJob, compile_region: Callable[[], Callable]) -> Optional[Callable]:
        """``compile_region()`` inside ``solo("compile")``; None when a stop signal ended it (``CompilePlan.guard``:
        the model knows nothing of stops)."""
        try:
            with self.solo(job, "compile"), timing.STARTUP.adding("compile_s"):
                return compile_region()
        except RunStopped:
            return None

    def load(self, job: LocalJob) -> None:
        cfg = self.cfg
        # Prompts first: a pipeline folder's text encoders are freed before any DiT is built.
        self.edits = self._prompts(job)
        # References next: their model is freed before the measured one is built.
        if cfg.metrics.ssim:
            timing.STARTUP.begin("references_s")
            self.references = self._references(job)
            timing.STARTUP.end("references_s")
        # Seeded random weights make structured noise: scored against a correct edit, that is drift, not quality.
        self.targets = {e.id: targets.edit_target(e) for e in self.edits if e.target is not None and cfg.model.path}
        reset_peak_memory(self.placement.device)
        # A transport times every wait of the compute stream here; ``single`` has none, so 0.
        self.exposed = ExposedTransfer(self.placement.device)
        self.transports = {axis: make_transport(cfg.transport, self.layout.groups[axis], self.exposed,
                                                self.placement.device, cfg.launcher.collective_timeout_s,
                                                self.layout.nodes)
                           for axis in ("sp", "cfg")}
        # Compiling happens inside the first steps, each region alone between the step's exchanges.
        speed = dataclasses.replace(self.speed, guard=functools.partial(self.compile_guarded, job))
        with self.solo(job, "build"):
            timing.STARTUP.begin("build_s")
            self.built = build_model(cfg.model, self.placement, self.precision, announce=self.layout.rank == 0,
                                     speed=speed)
            self.model = self.built.model
            self.codec = make_latent_codec(text.vae_folder(cfg.model.path, cfg.workload.vae_path),
                                           self.placement.device, self.placement.dtype)
            timing.STARTUP.end("build_s")
        self._open_compile_cache()
        job.barrier("loaded")

    def _open_compile_cache(self) -> None:
        """This run's compile-cache entry, loaded before the first compiled forward (``model/compile_cache.py``)."""
        self.compile_cache = compile_cache.for_run(self.cfg, self.speed, self.placement, self.geometry, self.precision,
                                                   self.built.details, self.layout.plan, self.edits, self.layout.rank)
        if self.compile_cache.folder is not None:
            with timing.STARTUP.adding("compile_cache_s"):
                timing.STARTUP.notes["compile_cache"] = self.compile_cache.load()

    def after_edit(self) -> None:
        """Global rank 0 writes the compile-cache entry when the edit compiled what it lacks; every rank notes the
        time its CUDA graphs took to record."""
        if self.compile_cache.writer and self.compile_cache.folder is not None:
            with timing.STARTUP.adding("compile_cache_s"):
                self.compile_cache.save()
        if self.speed.graphs:
            parts = self.built.parts
            timing.STARTUP.fields["graphs_s"] = capture_seconds(self.built.forward, parts.head, parts.tail)

    def _prompts(self, job: LocalJob) -> list[Edit]:
        """The edits with their prompts' embeddings files: global rank 0 encodes, then every rank gets them."""
        cache = text.prompt_cache(self.edits, self.cfg)
        if cache is None:
            return self.edits
        if self.layout.rank == 0:
            with self.solo(job, "prompts"):
                text.encode_missing(cache, self.edits, self.cfg, self.placement.device, self.placement.dtype)
        job.barrier("prompts")
        return text.with_embeddings(cache, self.edits, self.cfg, self.layout.control)

    def _result_settings(self, edit: Edit) -> dict:
        """Everything that changes this edit's result (not the layout, transport or world size)."""
        _, described = reference.reference_key(self.cfg, self.geometry, edit, self.placement.dtype,
                                               self.placement.device.type)
        described.pop("format")
        # The key's sampling settings are the reference's; the edit's own are the run's, and its scores are against
        # that reference. The backend is left out, like the layout: fast kernels match the exact emulation.
        settings = {**described, **reference.sampling(self.cfg.workload), "reference": reference.sampling(
            full_quality.reference_workload(self.cfg)),
            "precision": {**self.precision.formats(), "scale_mode": self.precision.scale_mode}}
        if self.cfg.cache.name != "none":  # absent without a cache: an uncached edit names no cache keys
            settings["cache"] = OmegaConf.to_container(self.cfg.cache, resolve=True)
        return settings

    def run_settings(self) -> dict:
        """What every run of the results directory must share (``rundir.run_settings``)."""
        described = self.settings[self.edits[0].id]
        resolved = {"device": described["device"], "model.dtype": described["dtype"], "workload.vae": described["vae"]}
        if self.cfg.model.path:  # the weights' files (seeded weights are model.weights_seed)
            resolved["model.weights"] = described["weights"]
        config = OmegaConf.to_container(self.cfg, resolve=True)
        if self.cfg.cache.name == "none":  # a run that caches nothing: no other cache key changes it (as per edit)
            config["cache"] = {"name": "none"}
        return rundir.run_settings(config, resolved, declared_edits(self.cfg.workload))

    def _references(self, job: LocalJob) -> reference.References:
        """Each replica's writer makes the missing references of its edits; every rank then waits for
        them (``job.barrier``: no deadline that a long reference pass could trip, but a rank whose
        heartbeat stops is named)."""
        cfg, placement = self.cfg, self.placement
        dtype = reference.REFERENCE_DTYPES[cfg.metrics.reference_dtype] if cfg.metrics.reference_dtype \
            else placement.dtype
        references = reference.reference_set(cfg, self.geometry, self.edits, dtype, placement.device.type)
        if self.layout.writes_records:
            share = self.layout.edit_share(self.edits)
            rank0 = self.layout.rank == 0
            with Progress(cfg.progress and rank0, len(share), desc="references") as progress, \
                    self.solo(job, "references"):
                references.make_missing(share, cfg, self.geometry, placement.device,
                                        lambda d: build_model(cfg.model, dataclasses.replace(placement, dtype=d)).model,
                                        progress, announce=rank0, stop_point=job.stop.check)
        job.barrier("references")
        return references

    def run_edit(self, edit: Edit, job: LocalJob, progress=None) -> Optional[dict]:
        """Run one edit on this rank; the rank that writes its replica's results gets the record.

        Raises ``RunStopped`` at a step boundary when the replica's ranks agree to stop.
        """
        cfg, placement = self.cfg, self.placement
        with Interval(placement.device) as encode:
            inputs = edit_inputs(edit, self.codec, self.geometry, cfg.workload, placement.device, placement.dtype)
        guidance = cfg.workload.guidance_scale if self.geometry.guidance_embeds else None
        step_cache = cache.make_step_cache(cfg.cache, cfg.workload.steps, self.built, self.layout.sp_sum)
        velocity = layout_velocity(
            self.layout, self.transports, step_cache, inputs, cfg.workload.true_cfg_scale, guidance,
            placement.dtype, inner_attention=self.built.attention,
        )
        # Buffers are sized and mapped here, outside the timed steps (a no-op once they fit).
        prepare_transports(self.layout, self.transports, inputs, self.geometry, placement.dtype)
        timer = StepTimer(placement.device)
        self.exposed.take()  # start the edit's count from zero

        def on_step(i: int) -> None:
            timer.step(i)
            timing.STARTUP.at_age("startup_s")
            faults.inject(cfg.launcher.fault, i)
            if progress is not None:
                progress.update(1)
            job.beat(f"edit {edit.id!r}, denoising step {i}")
            _stop_if_asked(job, self.layout)

        timer.start()
        with torch.inference_mode():
            latents = denoise(velocity, inputs.noise, cfg.workload.steps, on_step=on_step)
        step_s = timer.step_seconds()
        exposed = self.exposed.take()
        if not self.layout.writes_records:
            return None
        h, w = edit.height // VAE_SCALE, edit.width // VAE_SCALE  # the output's latent size (not the reference's)
        with Interval(placement.device) as decode:
            image = results.to_rgb8(self.codec.decode(unpack(latents, h, w)))
        outputs = results.edit_outputs(edit.id)
        # Both files are on disk (and their checksums known) before the record that names them is written.
        sha256 = {"image": results.save_png(image, results.output_path(self.out_dir, outputs["image"])),
                  "latents": results.save_latents(latents, results.output_path(self.out_dir, outputs["latents"]))}
        ref = self.references.get(edit.id) if self.references is not None else None
        measured = quality.quality_fields(image, ref, self.targets.get(edit.id))
        if ref is not None:
            self.references.check_measured(edit.id, measured)
        return self._record(edit, step_s, exposed, sha256, {
            **measured, "encode_s": encode.seconds, "decode_s": decode.seconds, **step_cache.record_fields()})

    def _record(self, edit: Edit, step_s: list[float], exposed: dict, sha256: dict[str, str],
                measured: Optional[dict] = None) -> dict:
        """One line of edits.jsonl: DESIGN.md's fields in its order, then the extras."""
        cfg, plan, measured = self.cfg, self.layout.plan, dict(measured or {})
        quality_fields = {key: measured.pop(key, None) for key in quality.QUALITY_FIELDS}
        outputs = results.edit_outputs(edit.id)
        return {
            "edit": edit.id, "seed": edit.seed, "width": edit.width, "height": edit.height,
            "steps": cfg.workload.steps, "layout": plan.name, "precision": self.precision_label,
            "transport": cfg.transport.name, "world": plan.world,
            **timing.edit_timing(step_s, exposed, cfg.metrics.transfer_breakdown),
            **quality_fields, "image": outputs["image"], "replica": self.layout.replica, "session": self.session,
            "head_groups": plan.head_groups, "latents": outputs["latents"], "sha256": sha256,
            "precision_map": self.precision.formats(), "reference": _source(edit.image), "target": edit.target,
            **measured,
            "fingerprint": rundir.fingerprint(self.settings[edit.id]), "settings": self.settings[edit.id],
        }

    def summary(self, records: list[dict], wall_s: float, stopped: Optional[RunStopped] = None,
                startup: Optional[list[dict]] = None) -> dict:
        scores = quality.quality_summary(records)
        return {
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "run_id": self.run_id,
            "edits": len(records),
            "complete": len(records) == len(self.directory_edits),
            "stopped": str(stopped) if stopped else None,
            "world": self.layout.plan.world,
            **timing.timing_summary(records, self.cfg.metrics.warmup_edits, self.layout.plan.replicas),
            **scores,
            "reference": reference.sampling(full_quality.reference_workload(self.cfg)),
            "quality_measure": quality.measure_name(self.cfg.metrics.quality, [scores]),
            **cache.cache_summary(records),
            "wall_s": wall_s,
            **timing.startup_summary(startup or []),
            "compile_cache": self.compile_cache.fields() if self.compile_cache is not None else None,
            "peak_memory_bytes": peak_memory_bytes(self.placement.device),
            "device": device_name(self.placement.device),
            "dtype": self.placement.dtype_note,
            "precision": self.precision_label,
            "precision_detail": self.built.details if self.built is not None else None,
            "mx_repack_inexact_rows": inexact_repack_rows(self.model) if self.built is not None else 0,
            "torch": torch.__version__,
            "git": git_revision(),
        }


def run(cfg, out_dir: Path, job: Optional[LocalJob] = None, nodes: Sequence[str] = (),
        hydra_files: Optional[rundir.HydraFiles] = None) -> Optional[dict]:
    """Run this rank's part of the workload; returns the summary on global rank 0, None elsewhere.

    Global rank 0 claims the results directory (``rundir``: lock, recovery, which edits are
    done with the same settings) before any model is built, and every rank receives its
    decision through ``job``. Each replica's writer appends its own records; once every rank
    has finished, global rank 0 merges them, logs to W&B, writes the summary and the report,
    and applies the quality gate. A stop signal ends loading at once (``Run.solo``, ``job.barrier``)
    or the edit loop at a step boundary; the run then ends the same way and raises ``RunStopped``.
    ``nodes`` is every rank's node, as the rendezvous found them (empty: all on one node). ``hydra_files`` are
    written once the directory is claimed.
    """
    job = job or job_of_process_group(cfg.launcher.collective_timeout_s)
    rundir.make_run_dir(out_dir)
    start = time.perf_counter()
    state = Run(cfg, out_dir, nodes)
    layout = state.layout
    lock = rundir.RunLock(out_dir) if layout.rank == 0 else None
    try:
        done = set(job.share("done", lambda: _claim(lock, state, out_dir, hydra_files)))
        stopped, logger = _load_and_run_edits(state, job, done, out_dir)
        faults.hang(cfg.launcher.fault)
        job.post("startup", timing.STARTUP.report(job.rank))
        job.end_of_run()  # rank 0: every replica's records are written
        if layout.rank == 0:
            rundir.merge_replica_files(out_dir)
            summary = _finish(state, logger, out_dir, time.perf_counter() - start, stopped, job.collect("startup"))
    finally:
        if lock is not None:
            lock.release()
    if stopped is not None:
        raise stopped
    return summary if layout.rank == 0 else None


def _claim(lock: rundir.RunLock, state: Run, out_dir: Path, hydra_files: Optional[rundir.HydraFiles]) -> list[str]:
    """Global rank 0: lock the directory and check that it is this run's (a refused run writes nothing there),
    then recover its records, say which edits are done and record the run's settings and Hydra's files."""
    lock.acquire()
    settings = state.run_settings()
    state.directory_edits = rundir.claim(out_dir, settings, state.settings)
    done = rundir.resumable(rundir.recover(out_dir), state.settings, out_dir)
    state.run_id = uuid.uuid4().hex
    rundir.record_run(out_dir, settings, state.directory_edits, state.run_id)
    if hydra_files is not None:
        hydra_files.write(out_dir)
    _print_start(state, out_dir, len(done))
    return done


def _load_and_run_edits(state: Run, job: LocalJob, done: set, out_dir: Path) -> tuple[Optional[RunStopped], object]:
    """Load, then run this replica's edits; the stop that ended either early, if any, and the run's logger."""
    logger = wandb_log.NullLogger()
    try:
        timing.STARTUP.begin("load_s")
        state.load(job)
        timing.STARTUP.end("load_s")
        logger = wandb_log.start(state.cfg, out_dir, state.layout.rank == 0)  # its start-up stays out of timed regions
    except RunStopped as stopped:
        return stopped, logger
    return _run_edits(state, job, done, out_dir, logger), logger


def _run_edits(state: Run, job: LocalJob, done: set, out_dir: Path, logger) -> Optional[RunStopped]:
    """This replica's edits not yet done, in order; the stop that ended them early, if any."""
    cfg, layout = state.cfg, state.layout
    # Every writer appends to its own file: concurrent appends from several nodes are not atomic.
    records_file = rundir.records_file(out_dir, layout.replica)
    todo = [edit for edit in layout.edit_share(state.edits) if edit.id not in done]
    with Progress(cfg.progress and layout.rank == 0, len(todo)) as progress:
        for edit in todo:
            bar = progress.edit(edit.id, cfg.workload.steps)
            try:
                _stop_if_asked(job, layout)
                record = state.run_edit(edit, job, bar)
            except RunStopped as stopped:
                return stopped
            finally:
                bar.close()
            if record is not None:
                results.append_record(records_file, record)
                logger.log_edit(record)
            state.after_edit()
            progress.advance()
    return None


def _stop_if_asked(job: LocalJob, layout) -> None:
    signum = job.should_stop(layout.agree_max)
    if signum is not None:
        raise RunStopped(signum, f" ({job.stop.reason})" if job.stop.reason else "")


def _finish(state: Run, logger, out_dir: Path, wall_s: float, stopped: Optional[RunStopped],
            startup: list[dict]) -> dict:
    """Global rank 0: summary.json, the W&B run's table and summary, the report; then the quality gate.

    A stopped run writes its summary (``complete: false``) and closes its W&B run, but leaves the
    report and the quality gate to the run that completes the workload.
    """
    cfg = state.cfg
    done = results.finished_edits(out_dir)
    records = [done[edit] for edit in state.directory_edits if edit in done]  # the directory's, not only this run's
    summary = state.summary(records, wall_s, stopped, startup)
    gate = quality.gate_failure(summary, cfg.metrics.min_ssim_pct, cfg.metrics.quality) if stopped is None else None
    summary.update(wandb=str(logger.location) if logger.location else None, wandb_init_s=logger.init_s,
                   failure=gate)
    results.write_json(out_dir / results.SUMMARY_FILE, summary)
    logger.finish(records, summary, out_dir, state.references, failed=gate is not None or stopped is not None)
    if stopped is not None:
        print(f"ditrun: {stopped}; {len(records)} of {len(state.directory_edits)} edits are in "
              f"{out_dir / results.EDITS_FILE}; rerun the same command to resume", flush=True)
        return summary
    report_file = _write_report(out_dir) if cfg.metrics.report else None
    print_table(records, summary)
    print_locations(cfg, summary, out_dir, report_file)
    if summary["failure"]:
        raise quality.QualityGateError(summary["failure"])
    return summary


def _print_start(state: Run, out_dir: Path, n_done: int) -> None:
    plan = state.layout.plan
    print(f"ditrun: {len(state.edits)} edits on {device_name(state.placement.device)}, "
          f"{state.placement.dtype_note}, precision {state.precision_label}, layout {plan.name} "
          f"({plan.replicas} replica(s) x {plan.workers} worker(s)), results in {out_dir}", flush=True)
    if n_done:
        print(f"ditrun: resuming, {n_done} edits already in {results.EDITS_FILE} are skipped", flush=True)


def _write_report(out_dir: Path) -> Path:
    from ditrun.metrics.report import write_report

    return write_report(out_dir)[1]


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _margin_cell(record: dict) -> str:
    return "= input" if record.get("target_equals_input") else _cell(record.get("margin_db"), "+.2f")


def print_table(records: list[dict], summary: dict) -> None:
    """The run's edits, one row each; the headline quality is against the correct edit (PSNR, its margin over
    doing nothing and every wrong edit, the colour error), beside SSIM against the BF16 reference."""
    rows = [("edit", "size", "steps", "DiT s", "s/step", "exposed %", "SSIM", "% of rerun", "PSNR target",
             "margin dB", "dE00", "(BF16)", "image")]
    for r in records:
        steps = f"{r['steps_computed']}/{r['steps']}" if r.get("steps_cached") else str(r["steps"])  # computed/all
        rows.append((r["edit"], f"{r['width']}x{r['height']}", steps, f"{r['dit_s']:.3f}",
                     f"{r['dit_s'] / max(r['steps'], 1):.3f}", f"{r['exposed_transfer_pct']:.1f}",
                     _cell(r.get("ssim"), ".4f"), _cell(r.get("ssim_pct_of_rerun"), ".2f"),
                     _cell(r.get("psnr_target"), ".2f"), _margin_cell(r), _cell(r.get("delta_e_target"), ".1f"),
                     _cell(r.get("psnr_target_bf16"), ".2f"), r["image"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"median DiT s/edit (after warm-up): {_cell(summary['dit_s_median'], '.3f')}   "
          f"images/s: {summary['images_per_s']:.3f}   "
          f"exposed transfer: {_cell(summary['exposed_transfer_pct_median'], '.1f')}%   "
          f"SSIM: {_cell(summary['ssim_median'], '.4f')} ({_cell(summary['ssim_pct_of_rerun_median'], '.2f')}% of rerun)   "
          f"device: {summary['device']} ({summary['dtype']})")
    if summary.get("edits_right_share") is not None:
        print(targets.describe(summary))


def print_locations(cfg, summary: dict, out_dir: Path, report_file: Optional[Path]) -> None:
    if summary.get("wandb"):
        sync = f"   (upload later: wandb sync {summary['wandb']})" if cfg.wandb.mode == "offline" else ""
        print(f"W&B {cfg.wandb.mode} run: {summary['wandb']}{sync}")
    if report_file is not None:
        print(f"report: {report_file}   (compare runs: ditrun report <run or multirun dir>)")
    if summary.get("failure"):
        print(f"FAILED: {summary['failure']}")
    print(f"results: {out_dir}", flush=True)
