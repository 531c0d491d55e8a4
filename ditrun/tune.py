"""``ditrun tune key=value ...``: time every linear backend on the run's real shapes and data, save the choice.

The model is built as the run would build it (same config), with weights prepared for every
candidate backend; one denoising step of the first edit (both CFG branches) records the first
input each quantized linear sees per (format, M bucket, K, N). Each candidate then runs that
input; the fastest one whose output matches the emulation reference (relative error at most
``TOLERANCE``) is written to the dispatch table (``precision.tuning_file``), which every later
run on this device and torch version loads.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from ditrun.errors import UserError
from ditrun.kernels.linear import QuantizedLinear, joined
from ditrun.kernels.tuning import DispatchTable, device_key, entry_key, m_bucket

TOLERANCE = 2e-2
"""Largest |fast - emulation| / max |emulation| a backend may have on a tuning input."""
REPEATS = 20


def time_ms(fn, device: torch.device, repeats: int = REPEATS, calls: int = 1) -> float:
    """Median milliseconds per call after one warm-up call (CUDA events on GPUs). Each of the ``repeats`` times
    ``calls`` back-to-back calls: with more than one, the stream is first given one untimed call, so that every
    timed call's launch on the host overlaps the GPU work of the one before it, as in a model's stream of calls
    (a host slower than the GPU still shows); with one, the host's launch time counts too."""
    fn()  # warm-up: compilation, allocator, library heuristics
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            if calls > 1:
                fn()  # the GPU works on it while the host launches the timed calls
            times.append(events_ms(fn, calls) / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - begin) * 1e3 / calls)
    return statistics.median(times)


def events_ms(fn, calls: int = 1) -> float:
    """Milliseconds between CUDA events around ``calls`` calls of ``fn`` on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def capture_linear_inputs(model: torch.nn.Module, run_once) -> dict[tuple, tuple[QuantizedLinear, torch.Tensor]]:
    """(format, M bucket, K, N) -> (a linear of that shape, the first input it saw) over one ``run_once()``."""
    seen: dict[tuple, tuple[QuantizedLinear, torch.Tensor]] = {}

    def hook(module: QuantizedLinear, args, kwargs):
        # a down projection gets the pre-activation state (and the single block's proj_out a prefix)
        rows = joined(kwargs.get("prefix"), args[0], kwargs.get("activation")).reshape(-1, module.in_features)
        key = (module.fmt.name, m_bucket(rows.shape[0]), module.in_features, module.out_features)
        if key not in seen:
            seen[key] = (module, rows.detach().clone())

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules() if isinstance(m, QuantizedLinear)
    ]
    try:
        run_once()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def choose_backend(module: QuantizedLinear, x: torch.Tensor, device: torch.device) -> tuple[str, dict[str, str]]:
    """The fastest backend matching the emulation on ``x``, and a note per candidate (ms or why not)."""

    def call(name):
        return lambda: module.matmul(x, name)

    reference = call("emulation")().float() if "emulation" in module.backends else None
    notes, timings = {}, {}
    for name in module.backends:
        out = call(name)().float()
        if reference is not None:
            error = ((out - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()
            if not error <= TOLERANCE:
                notes[name] = f"rejected (error {error:.1e})"
                continue
        timings[name] = time_ms(call(name), device)
        notes[name] = f"{timings[name]:.3f} ms"
    return min(timings, key=timings.get), notes


def tune(cfg) -> DispatchTable:
    """Tune the linears of ``cfg``'s model and precision on this device; returns the saved table."""
    from ditrun.model.build import build_model, model_geometry, select_device_dtype
    from ditrun.model.compile import claim_compiler_caches
    from ditrun.model.folders import vae_folder
    from ditrun.model.latents import make_latent_codec
    from ditrun.model.precision import plan_precision
    from ditrun.model.sampler import sequential_cfg_velocity
    from ditrun.workload.inputs import edit_inputs
    from ditrun.workload.manifest import resolve_edits, resolve_text_len

    resolve_text_len(cfg)
    device_dtype = select_device_dtype(cfg.device, cfg.model.dtype)
    claim_compiler_caches()  # before anything compiles: Triton's kernels and a compiled model's
    plan = plan_precision(cfg.precision, device_dtype.device)
    table = DispatchTable.load(plan.tuning_file, device_dtype.device, plan.backend, announce=False)
    candidates = DispatchTable(device_dtype.device, plan.backend, announce=False, prepare_all=True)
    built = build_model(cfg.model, device_dtype, plan, announce=False, table=candidates)
    geometry = model_geometry(cfg.model)
    edit = resolve_edits(cfg.workload)[0]
    codec = make_latent_codec(
        vae_folder(cfg.model.path, cfg.workload.vae_path), device_dtype.device, device_dtype.dtype
    )
    inputs = edit_inputs(edit, codec, geometry, cfg.workload, device_dtype.device, device_dtype.dtype)
    guidance = cfg.workload.guidance_scale if geometry.guidance_embeds else None
    velocity = sequential_cfg_velocity(
        built.model, inputs, cfg.workload.true_cfg_scale, guidance, device_dtype.dtype, attention=built.attention
    )
    with torch.inference_mode():
        captured = capture_linear_inputs(built.model, lambda: velocity(inputs.noise, 1.0))
        for (fmt, bucket, k, n), (module, x) in sorted(captured.items()):
            chosen, notes = choose_backend(module, x, device_dtype.device)
            table.entries[entry_key(fmt, bucket, k, n, device_key(device_dtype.device))] = chosen
            print(
                f"{fmt:<10} M~{bucket:<6} K={k:<6} N={n:<6} -> {chosen:<14} "
                + "  ".join(f"{name}: {note}" for name, note in notes.items()),
                flush=True,
            )
    table.save(plan.tuning_file)
    print(f"dispatch table: {plan.tuning_file} ({len(captured)} shapes tuned)", flush=True)
    return table


def main(argv: list[str]) -> int:
    """``ditrun tune`` with Hydra overrides, e.g. ``ditrun tune model=flux-dev precision=krea``."""
    from hydra import compose, initialize_config_module

    from ditrun.config import register_configs

    register_configs()
    try:
        with initialize_config_module("ditrun.conf", version_base="1.3"):
            cfg = compose("config", overrides=argv)
        tune(cfg)
    except UserError as err:
        print(f"ditrun: error: {err}", file=sys.stderr)
        return 2
    return 0
