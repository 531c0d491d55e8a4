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

import contextlib
import dataclasses
import functools
import sys
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ditrun import cache
from ditrun.config import take_renamed_keys
from ditrun.devices import DTYPES
from ditrun.launch import faults
from ditrun.launch.job import LocalJob, job_of_process_group
from ditrun.launch.stop import FAULT, NodeFault, RunStopped, stop_of
from ditrun.metrics import full_quality_images as reference
from ditrun.metrics import quality
from ditrun.metrics import target as targets
from ditrun.metrics import wandb as wandb_log
from ditrun.metrics.progress import ACTIVITY, PHASES, Progress
from ditrun.model.build import build_model, model_geometry, select_device_dtype
from ditrun.model.compile import claim_compiler_caches, plan_compile
from ditrun.model.folders import vae_folder
from ditrun.model.graphs import capture_seconds
from ditrun.model.latents import VAE_SCALE, make_latent_codec, unpack
from ditrun.model.precision import plan_precision, precision_label
from ditrun.model.sampler import denoise
from ditrun.parallel.cfg import exchange_fields, layout_velocity, prepare_transports
from ditrun.parallel.placement import Placement, build_layout
from ditrun.results import files, rundir
from ditrun.run import compile_cache, folders, warm
from ditrun.run.checks import check_run_config, check_run_memory
from ditrun.run.console import print_locations, print_start, print_table
from ditrun.run.records import edit_record, result_settings, run_settings, run_summary
from ditrun.timers import STARTUP, ExposedTransfer, Interval, StepTimer, reset_peak_memory
from ditrun.transport.registry import make_transport
from ditrun.workload import prompts
from ditrun.workload.edit import Edit
from ditrun.workload.inputs import edit_inputs
from ditrun.workload.manifest import resolve_edits


class Run:
    """State of one worker's run: device_dtype, layout, model, codec and output directory.

    Built in two stages: the constructor makes every check and the process groups (seconds);
    ``load`` makes the references and builds the model (minutes for a large one), once the
    results directory has been claimed.
    """

    def __init__(self, cfg, out_dir: Path, nodes: Sequence[str] = (), edits: Optional[list[Edit]] = None):
        self.cfg = cfg
        self.out_dir = out_dir
        # Under a launcher the process group is the truth; alone, launcher.world must say 1.
        plan = check_run_config(cfg, dist.get_world_size() if dist.is_initialized() else None)
        # check_config has checked their sources and embeddings; ``edits``: others (``ditrun warm``'s shapes)
        self.edits = resolve_edits(cfg.workload) if edits is None else edits
        self.geometry = model_geometry(cfg.model)
        self.device_dtype = select_device_dtype(cfg.device, cfg.model.dtype)
        self.precision = plan_precision(cfg.precision, self.device_dtype.device)
        self.precision_label = precision_label(self.precision, self.device_dtype.dtype_name)
        self.compile_plan = plan_compile(cfg.model, self.device_dtype.device)
        claim_compiler_caches()  # before anything compiles (the references' model included), in every rank
        self.settings = {edit.id: result_settings(self, edit) for edit in self.edits}
        self.directory_edits = [edit.id for edit in self.edits]  # global rank 0 learns the directory's in ``_claim``
        check_run_memory(self.edits, cfg, self.geometry, plan, self.device_dtype)
        placement = Placement(plan, tuple(nodes)) if nodes else Placement.on_one_node(plan)
        self.layout = build_layout(placement, timedelta(seconds=cfg.launcher.collective_timeout_s))
        self.references: Optional[reference.References] = None
        self.targets: dict = {}
        self.built = None
        self.compile_cache: Optional[compile_cache.RunCompileCache] = None  # once the model is built (``load``)
        self.run_id: Optional[str] = None  # global rank 0's, once it claims the directory (``_claim``)
        self.attempt: dict = {}  # global rank 0's too: ``rundir.attempt_of``
        self.wandb_mode = cfg.wandb.mode  # what global rank 0 logs in (``wandb.mode_to_run``)
        self.logger = wandb_log.NullLogger()  # global rank 0's W&B run, once loaded
        # Names the process that writes this replica's records: a resumed run's first edits are its own warm-up.
        self.session = uuid.uuid4().hex[:12]

    @contextmanager
    def solo(self, job: LocalJob, phase: str) -> Iterator[None]:
        """Work of this rank alone, with no collective until the next stop point: a stop signal ends it at once
        (``RunStopped``). ``testing.fault.pause_in`` holds a rank here, for the tests. In a log, rank 0 says what
        runs every half minute while a phase lasts longer (``metrics/progress.py``)."""
        logged = self.cfg.progress and self.layout.rank == 0
        with job.stop.raising(), ACTIVITY.phase(PHASES.get(phase, phase), enabled=logged):
            faults.pause(self.cfg.testing.fault, phase, self.layout.rank)
            yield

    def compile_guarded(self, job: LocalJob, compile_region: Callable[[], Callable]) -> Optional[Callable]:
        """``compile_region()`` inside ``solo("compile")``; None when a stop signal ended it (``CompilePlan.guard``:
        the model knows nothing of stops)."""
        try:
            with self.solo(job, "compile"), STARTUP.adding("compile_s"):
                return compile_region()
        except RunStopped:
            return None

    def load(self, job: LocalJob, done: frozenset = frozenset()) -> None:
        """Everything before the first edit, each phase a stop point; ``done``: the edits earlier attempts finished."""
        cfg = self.cfg
        # Prompts first: a pipeline folder's text encoders are freed before any DiT is built.
        self.edits = self.encode_prompts(job)
        # References next: their model is freed before the measured one is built.
        if cfg.metrics.ssim:
            STARTUP.begin("references_s")
            self.references = self._references(job)
            STARTUP.end("references_s")
        # Seeded random weights make structured noise: scored against a correct edit, that is drift, not quality.
        self.targets = {e.id: targets.edit_target(e) for e in self.edits if e.target is not None and cfg.model.path}
        self.build(job)
        # W&B's start-up (up to its init timeout online) is a phase too: a stop signal ends it at once, and the
        # barrier then stops every rank together; its time stays out of every timed region.
        with self.solo(job, "wandb"):
            self.logger = _start_logger(self, self.out_dir, done)
        job.barrier("loaded")

    def build(self, job: LocalJob) -> None:
        """The transports, the model and the latent codec; the compile cache's entries loaded."""
        cfg = self.cfg
        reset_peak_memory(self.device_dtype.device)
        # A transport times every wait of the compute stream here; ``single`` has none, so 0.
        self.exposed = ExposedTransfer(self.device_dtype.device)
        self.transports = {
            axis: make_transport(
                cfg.transport,
                self.layout.groups[axis],
                self.exposed,
                self.device_dtype.device,
                cfg.launcher.collective_timeout_s,
                self.layout.nodes,
                cfg.testing.chaos_s,
            )
            for axis in ("sp", "cfg")
        }
        # Compiling happens inside the first steps, each region alone between the step's exchanges.
        compile_plan = dataclasses.replace(self.compile_plan, guard=functools.partial(self.compile_guarded, job))
        with self.solo(job, "build"):
            STARTUP.begin("build_s")
            self.built = build_model(
                cfg.model, self.device_dtype, self.precision, announce=self.layout.rank == 0, compile_plan=compile_plan
            )
            self.model = self.built.model
            self.codec = make_latent_codec(
                vae_folder(cfg.model.path, cfg.workload.vae_path), self.device_dtype.device, self.device_dtype.dtype
            )
            STARTUP.end("build_s")
        self._open_compile_cache()

    def _open_compile_cache(self) -> None:
        """This run's compile-cache entries, loaded before the first compiled forward
        (``run/compile_cache.py``)."""
        self.compile_cache = compile_cache.for_run(
            self.cfg,
            self.compile_plan,
            self.device_dtype,
            self.geometry,
            self.precision,
            self.built.details,
            self.layout.plan,
            self.edits,
            self.layout.rank,
        )
        if self.compile_cache.entries:
            with STARTUP.adding("compile_cache_s"):
                STARTUP.notes["compile_cache"] = self.compile_cache.load()

    def after_edit(self) -> None:
        """Every rank notes the time its CUDA graphs took to record (global rank 0 wrote the compile-cache entry of the
        edit's shape at its end: ``RunCompileCache.recording``)."""
        if self.compile_plan.graphs:
            parts = self.built.parts
            STARTUP.fields["graphs_s"] = capture_seconds(self.built.forward, parts.head, parts.tail)

    def encode_prompts(self, job: LocalJob) -> list[Edit]:
        """The edits with their prompts' embeddings files: global rank 0 encodes, then every rank gets them."""
        cache = prompts.prompt_cache(self.edits, self.cfg, self.out_dir / rundir.CACHE_DIR / "prompts")
        if cache is None:
            return self.edits
        if self.layout.rank == 0:
            with self.solo(job, "prompts"):
                prompts.encode_missing(cache, self.edits, self.cfg, self.device_dtype.device, self.device_dtype.dtype)
        job.barrier("prompts")
        return prompts.with_embeddings(cache, self.edits, self.cfg, self.layout.control)

    def _references(self, job: LocalJob) -> reference.References:
        """Each replica's writer makes the missing references of its edits; every rank then waits for
        them (``job.barrier``: no deadline that a long reference pass could trip, but a rank whose
        heartbeat stops is named)."""
        cfg, device_dtype = self.cfg, self.device_dtype
        dtype = DTYPES[cfg.metrics.full_quality_dtype] if cfg.metrics.full_quality_dtype else device_dtype.dtype
        references = reference.reference_set(cfg, self.geometry, self.edits, dtype, device_dtype.device.type)
        if self.layout.writes_records:
            share = self.layout.edit_share(self.edits)
            rank0 = self.layout.rank == 0
            with (
                Progress(cfg.progress and rank0, len(share), desc="references") as progress,
                self.solo(job, "references"),
            ):
                references.make_missing(
                    share,
                    cfg,
                    self.geometry,
                    device_dtype.device,
                    lambda d: build_model(cfg.model, dataclasses.replace(device_dtype, dtype=d)).model,
                    progress,
                    announce=rank0,
                    stop_point=job.stop.check,
                )
        job.barrier("references")
        return references

    def inputs(self, edit: Edit):
        """The model's inputs for ``edit`` (``workload.inputs.edit_inputs``)."""
        cfg, device_dtype = self.cfg, self.device_dtype
        return edit_inputs(edit, self.codec, self.geometry, cfg.workload, device_dtype.device, device_dtype.dtype)

    def velocity(self, inputs) -> tuple:
        """The step cache and the guided velocity of the edit whose ``inputs`` these are, under this run's layout, with
        the transports' buffers sized and mapped for it (outside any timed step; a no-op once they fit)."""
        cfg, dtype = self.cfg, self.device_dtype.dtype
        guidance = cfg.workload.guidance_scale if self.geometry.guidance_embeds else None
        step_cache = cache.make_step_cache(cfg.cache, cfg.workload.steps, self.built, self.layout.sp_sum)
        velocity = layout_velocity(
            self.layout,
            self.transports,
            step_cache,
            inputs,
            cfg.workload.true_cfg_scale,
            guidance,
            dtype,
            inner_attention=self.built.attention,
            payload=self.built.payload,
        )
        prepare_transports(self.layout, self.transports, inputs, self.geometry, dtype, self.built.payload)
        return step_cache, velocity

    def run_edit(self, edit: Edit, job: LocalJob, progress=None) -> Optional[dict]:
        """Run one edit on this rank; the rank that writes its replica's results gets the record.

        Raises ``RunStopped`` at a step boundary when the replica's ranks agree to stop.
        """
        cfg, device_dtype = self.cfg, self.device_dtype
        with Interval(device_dtype.device) as encode:
            inputs = self.inputs(edit)
        step_cache, velocity = self.velocity(inputs)
        timer = StepTimer(device_dtype.device)
        self.exposed.take()  # start the edit's count from zero
        exchange_fields(self.transports, 0, None)  # and the bytes its exchanges move

        def on_step(i: int) -> None:
            timer.step(i)
            STARTUP.at_age("startup_s")
            faults.inject(cfg.testing.fault, i)
            if progress is not None:
                progress.update(1)
            job.beat(f"edit {edit.id!r}, denoising step {i}")
            stop_if_asked(job, self.layout)

        timer.start()
        with torch.inference_mode(), self.compile_cache.recording(edit):
            latents = denoise(velocity, inputs.noise, cfg.workload.steps, on_step=on_step)
        step_s = timer.step_seconds()
        exposed = self.exposed.take()
        moved = exchange_fields(self.transports, step_cache.forwards, self.built.payload)
        if not self.layout.writes_records:
            return None
        h, w = edit.height // VAE_SCALE, edit.width // VAE_SCALE  # the output's latent size (not the reference's)
        with Interval(device_dtype.device) as decode:
            image = files.to_rgb8(self.codec.decode(unpack(latents, h, w)))
        # Both files are on disk (and their checksums known) before the record that names them is written.
        sha256 = files.save_outputs(self.out_dir, edit.id, image, latents)
        ref = self.references.get(edit.id) if self.references is not None else None
        measured = quality.quality_fields(image, ref, self.targets.get(edit.id))
        if ref is not None:
            self.references.check_measured(edit.id, measured)
        return edit_record(
            self,
            edit,
            step_s,
            exposed,
            sha256,
            {**measured, "encode_s": encode.seconds, "decode_s": decode.seconds, **step_cache.record_fields(), **moved},
        )


def run(
    cfg,
    out_dir: Path,
    job: Optional[LocalJob] = None,
    nodes: Sequence[str] = (),
    hydra_files: Optional[rundir.HydraFiles] = None,
) -> Optional[dict]:
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
    take_renamed_keys(cfg)  # the keys as named now, whoever called (a rank, a test, a script)
    job = job or job_of_process_group(cfg.launcher.collective_timeout_s)
    rundir.make_run_dir(out_dir)
    if cfg.warm.enabled:  # ``ditrun warm``: the shapes compiled into the compile cache, no edit
        state = Run(cfg, out_dir, nodes, edits=warm.warm_edits(cfg, resolve_edits(cfg.workload)))
        return warm.run(state, job, lambda: stop_if_asked(job, state.layout))
    start = time.perf_counter()
    state = Run(cfg, out_dir, nodes)
    layout = state.layout
    lock = rundir.RunLock(out_dir) if layout.rank == 0 else None
    try:
        # Every rank: a cache that moves into the run directory moves for all of them.
        wandb_on = layout.rank == 0 and cfg.wandb.mode != "disabled"
        folders.check_run_folders(cfg, out_dir, wandb_on, announce=layout.rank == 0)  # before the claim
        if layout.rank == 0:
            # Before the directory is claimed; alone, a stop signal ends the wait for W&B's server at once. With other
            # ranks (waiting for this one's claim) it is bounded instead (wandb.SERVER_CHECK_S): the next stop point
            # then stops them all.
            with job.stop.raising() if job.world == 1 else contextlib.nullcontext():
                state.wandb_mode = wandb_log.mode_to_run(cfg, out_dir)
        done = set(job.share("done", lambda: _claim(lock, state, out_dir, hydra_files)))
        stopped, logger = _load_and_run_edits(state, job, done, out_dir)
        faults.hang(cfg.testing.fault)
        job.post("startup", STARTUP.report(job.rank))
        job.post("fault", stopped.why if isinstance(stopped, NodeFault) and stopped.found_here else None)
        job.end_of_run()  # rank 0: every replica's records are written
        if layout.rank == 0:
            stopped = _with_peer_fault(stopped, job.collect("fault"))
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
    try:
        return _claim_locked(state, out_dir, hydra_files)
    except OSError as err:  # the directory is this run's now: it ends as a stop does
        raise _as_stop(err) from None


def _claim_locked(state: Run, out_dir: Path, hydra_files: Optional[rundir.HydraFiles]) -> list[str]:
    settings = run_settings(state)
    state.directory_edits = rundir.claim(out_dir, settings, state.settings)
    done = rundir.resumable(rundir.recover(out_dir), state.settings, out_dir)
    state.run_id = uuid.uuid4().hex
    state.attempt = rundir.attempt_of(out_dir, settings)
    rundir.record_run(out_dir, settings, state.directory_edits, state.run_id, state.attempt)
    if hydra_files is not None:
        hydra_files.write(out_dir)
    print_start(state, out_dir, len(done))
    return done


def _load_and_run_edits(state: Run, job: LocalJob, done: set, out_dir: Path) -> tuple[Optional[RunStopped], object]:
    """Load, then run this replica's edits; the stop that ended either early, if any, and the run's logger."""
    logger = wandb_log.NullLogger()
    try:
        STARTUP.begin("load_s")
        state.load(job, done)
        STARTUP.end("load_s")
        logger = state.logger
    except RunStopped as stopped:
        return stopped, logger
    except OSError as err:  # the run's own files refused (a cache the disk refused is a warning where it is written)
        fault = _as_stop(err)
        job.stop.fault(fault)  # the other ranks stop at their next stop point (a barrier of loading)
        return fault, logger
    return _run_edits(state, job, done, out_dir, logger), logger


def _as_stop(err: OSError) -> NodeFault:
    """A node's fault (a full disk), which ends the run as a stop does; any other error is raised again."""
    if not folders.is_node_fault(err):
        raise err
    return folders.node_fault(err)


def _with_peer_fault(stopped: Optional[RunStopped], found: list) -> Optional[RunStopped]:
    """Global rank 0's stop once every rank has ended: a node fault another rank found (``found``: each rank's, or
    None) ends the run as one, whatever ended this rank's share."""
    if isinstance(stopped, NodeFault) and stopped.found_here:
        return stopped
    rank, why = next(((rank, why) for rank, why in enumerate(found) if why), (None, None))
    return stopped if why is None else NodeFault(f"rank {rank} could not write ({why})", found_here=False)


def _start_logger(state: Run, out_dir: Path, done: set):
    """Global rank 0's W&B run, which continues that of the directory's earlier attempts; a logger that does nothing
    on the other ranks."""
    if state.layout.rank != 0:
        return wandb_log.NullLogger()
    finished = files.finished_edits(out_dir)
    earlier = [finished[edit] for edit in state.directory_edits if edit in done and edit in finished]
    return wandb_log.start(state.cfg, out_dir, True, state.attempt, state.directory_edits, earlier, state.wandb_mode)


def _run_edits(state: Run, job: LocalJob, done: set, out_dir: Path, logger) -> Optional[RunStopped]:
    """This replica's edits not yet done, in order; the stop that ended them early, if any."""
    cfg, layout = state.cfg, state.layout
    # Every writer appends to its own file: concurrent appends from several nodes are not atomic.
    records_file = rundir.records_file(out_dir, layout.replica)
    todo = [edit for edit in layout.edit_share(state.edits) if edit.id not in done]
    with Progress(cfg.progress and layout.rank == 0, len(todo)) as progress:
        for edit in todo:
            bar = progress.edit(edit.id, cfg.workload.steps)
            record = None
            try:
                stop_if_asked(job, layout)
                record = state.run_edit(edit, job, bar)
                if record is not None:
                    _append_record(records_file, record, out_dir)
            except RunStopped as stopped:
                return stopped
            except OSError as err:
                # This rank writes the replica's results and the disk refused them: the edit left no file. Its
                # ranks go on to the next stop point together (the next edit's start), where every rank stops.
                job.stop.fault(_as_stop(err))
                record = None
            finally:
                bar.close()
            if record is not None:
                logger.log_edit(record)
            state.after_edit()
            progress.advance()
    return job.stop.stopped() if job.stop.signum == FAULT else None  # a fault in the last edit


def _append_record(records_file: Path, record: dict, out_dir: Path) -> None:
    """The edit's record after its files; where the disk refuses the record, its files go too (nothing points at
    them, and their space may hold the summary)."""
    try:
        files.append_record(records_file, record)
    except OSError:
        files.remove_outputs(out_dir, record["edit"])
        raise


def stop_if_asked(job: LocalJob, layout) -> None:
    signum = job.should_stop(layout.agree_max)
    if signum is not None:
        raise job.stop.stopped() if signum == job.stop.signum else stop_of(signum)


def _finish(
    state: Run, logger, out_dir: Path, wall_s: float, stopped: Optional[RunStopped], startup: list[dict]
) -> dict:
    """Global rank 0: summary.json, the W&B run's table and summary, the report; then the quality gate.

    A stopped run writes its summary (``complete: false``) and closes its W&B run, but leaves the
    report and the quality gate to the run that completes the workload.
    """
    cfg = state.cfg
    done = files.finished_edits(out_dir)
    records = [done[edit] for edit in state.directory_edits if edit in done]  # the directory's, not only this run's
    summary = run_summary(state, records, wall_s, stopped, startup)
    gate = quality.gate_failure(summary, cfg.metrics.min_ssim_pct, cfg.metrics.quality) if stopped is None else None
    summary.update(wandb=str(logger.location) if logger.location else None, wandb_init_s=logger.init_s, failure=gate)
    summary.update(
        attempt=state.attempt.get("attempt"), restarts=state.attempt.get("restarts"), wandb_mode=state.wandb_mode
    )
    fault = _node_fault(files.SUMMARY_FILE, files.write_json, out_dir / files.SUMMARY_FILE, summary)
    logger.log_others(records)  # the other replicas' edits of this attempt reach the history too
    failed = gate is not None or stopped is not None or fault is not None
    fault = fault or _node_fault(
        "the W&B run", logger.finish, records, summary, out_dir, state.references, failed=failed
    )
    stopped = stopped or (folders.node_fault(fault) if fault else None)
    if stopped is not None:
        print(
            f"ditrun: {stopped}; {len(records)} of {len(state.directory_edits)} edits are in "
            f"{out_dir / files.EDITS_FILE}; rerun the same command to resume",
            flush=True,
        )
        if fault is not None:
            raise stopped  # the records are whole; what the disk refused is said, and the exit status is 1
        return summary
    report_file = _write_report(out_dir) if cfg.metrics.report else None
    print_table(records, summary)
    print_locations(cfg, summary, out_dir, report_file)
    if summary["failure"]:
        raise quality.QualityGateError(summary["failure"])
    return summary


def _node_fault(what: str, write: Callable, *args, **kwargs) -> Optional[OSError]:
    """``write(*args, **kwargs)``; a node's fault there (a full disk) is one line and returned, not raised."""
    try:
        write(*args, **kwargs)
    except OSError as err:
        if not folders.is_node_fault(err):
            raise
        print(f"ditrun: warning: {what} was not written ({err})", file=sys.stderr, flush=True)
        return err
    return None


def _write_report(out_dir: Path) -> Optional[Path]:
    """The run's report; one that cannot be written (a full disk) is a warning: the run's results are whole."""
    from ditrun.metrics.report import write_report

    try:
        return write_report(out_dir)[1]
    except OSError as err:
        if not folders.is_node_fault(err):
            raise
        print(f"ditrun: warning: the report was not written ({err})", file=sys.stderr, flush=True)
        return None
