"""Start-up of the compiled blocks: Inductor's just-in-time path against AOTInductor packages, each in a fresh process.

    python3 benchmarks/aoti_startup.py                                  # CPU: model=small, 256x256, 64 text tokens
    python3 benchmarks/aoti_startup.py --preset flux-dev --width 1024 --height 1024 --text-len 512 --device cuda

ditrun compiles every block's two halves around the attention (``model/compile.py``, ``compile_regions``): one
graph per block class and input shape, which Dynamo traces and Inductor compiles in the first edit of every process;
with Inductor's caches full (a warm node, or one loading the compile cache's entry) Inductor's work is a cache hit
but Dynamo still traces every graph and builds its guards. AOTInductor instead compiles each half once
(``torch.export`` + ``aoti_compile_and_package``) into a package without the weights
(``aot_inductor.package_constants_in_so=False``); a process loads the package once per block and binds that block's
own weight tensors to it (``load_constants(..., user_managed=True)``: no copy), so nothing is traced at start-up.

Each way runs in a process of its own, with its own Inductor and Triton caches under one temporary folder:

* ``eager``: the reference output and the steady time of the uncompiled model;
* ``jit cold``: ``compile_regions`` on empty caches (a fresh node without the compile cache);
* ``jit warm``: the same on the caches ``jit cold`` filled (a warm node; a fresh node that loaded the entry);
* ``aoti build``: export and package the four halves (double and single block, before and after the attention);
  the work ``ditrun warm`` would do once per shape;
* ``aoti load``: a fresh process loading those packages for every block.

Columns: seconds from the model built to the compiled code ready (``prepare s``: ``compile_regions``, which
compiles nothing yet, or the packages built and loaded) and to the end of its first forward (``first s``), the
first forward's excess over a steady one and Dynamo's share of it (tracing and guards: ``timers.dynamo_trace_s``,
the summary's ``trace_s``), the steady forward (median of ``--repeats``), the seconds of the four
packages' first loads, the milliseconds of a later one (another block of the class: the same package bound to its
weights), and the output's relative error against eager (same seeded weights and inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import print_table, relative_error

WAYS = ("eager", "jit cold", "jit warm", "aoti build", "aoti load")


def build(args):
    """The seeded model and one Kontext-style forward's inputs (output and reference tokens, text), on the device."""
    from ditrun.model.dit import FluxDiT
    from ditrun.model.latents import token_ids
    from ditrun.model.presets import PRESETS

    geo = PRESETS[args.preset]
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = FluxDiT(geo).to(device, dtype).eval()
    h, w = args.height // 8, args.width // 8
    n = (h // 2) * (w // 2)
    gen = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    inputs = dict(
        hidden_states=randn(1, 2 * n, geo.in_channels),
        encoder_hidden_states=randn(1, args.text_len, geo.joint_attention_dim),
        pooled_projections=randn(1, geo.pooled_projection_dim),
        timestep=torch.full((1,), 0.5, device=device),
        img_ids=torch.cat([token_ids(h, w, 0, device), token_ids(h, w, 1, device)]),
        txt_ids=torch.zeros(args.text_len, 3, device=device),
        guidance=torch.full((1,), 3.5, device=device) if geo.guidance_embeds else None,
    )
    return model, inputs


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Half(torch.nn.Module):
    """One half of a block as a module of its own (what ``torch.export`` takes): ``pre_attention`` or
    ``post_attention`` with RoPE's tables as two tensors."""

    def __init__(self, block, name: str):
        super().__init__()
        self.block, self.name = block, name

    def forward(self, *args):
        if self.name == "pre":
            *inputs, cos, sin = args
            return self.block.pre_attention(*inputs, (cos, sin))
        return self.block.post_attention(*args)


def block_inputs(model, inputs) -> dict[str, tuple]:
    """The arguments each half of the first double and single block is called with, from one eager forward."""
    from ditrun.model.dit import Regions, regions_of

    seen: dict[str, tuple] = {}

    def recorder(block, kind):
        eager = regions_of(block)

        def pre(*args, **kwargs):
            *rest, rope = args
            seen.setdefault(f"{kind}.pre", (*rest, *rope))
            return eager.pre(*args, **kwargs)

        def post(*args):
            seen.setdefault(f"{kind}.post", args)
            return eager.post(*args)

        return Regions(pre, post)

    firsts = {"double": model.transformer_blocks[0], "single": model.single_transformer_blocks[0]}
    for kind, block in firsts.items():
        block.__dict__["compiled_regions"] = recorder(block, kind)
    with torch.no_grad():
        model(**inputs)
    for block in firsts.values():
        del block.__dict__["compiled_regions"]
    return seen


def package_paths(folder: Path) -> dict[str, Path]:
    halves = [(kind, half) for kind in ("double", "single") for half in ("pre", "post")]
    return {f"{kind}.{half}": folder / f"{kind}_{half}.pt2" for kind, half in halves}


def aoti_build(model, inputs, folder: Path) -> None:
    """Export and package the four halves, without their weights."""
    examples = block_inputs(model, inputs)
    blocks = {"double": model.transformer_blocks[0], "single": model.single_transformer_blocks[0]}
    for key, path in package_paths(folder).items():
        kind, half = key.split(".")
        exported = torch.export.export(Half(blocks[kind], half), examples[key])
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(path), inductor_configs={"aot_inductor.package_constants_in_so": False}
        )


def aoti_load(model, folder: Path) -> tuple[float, list[float]]:
    """Every block runs the packaged halves of its class, bound to its own weights; -> seconds of each package's
    first load and of every later one (``aoti_load_package`` and ``load_constants`` alone)."""
    from ditrun.model.dit import Regions

    paths, first, later = package_paths(folder), {}, []
    for kind, blocks in (("double", model.transformer_blocks), ("single", model.single_transformer_blocks)):
        for block in blocks:
            halves = {}
            for half in ("pre", "post"):
                weights = Half(block, half).state_dict()
                start = time.perf_counter()
                loaded = torch._inductor.aoti_load_package(str(paths[f"{kind}.{half}"]))
                names = set(loaded.get_constant_fqns())
                loaded.load_constants({k: weights[k] for k in names}, check_full_update=True, user_managed=True)
                seconds, key = time.perf_counter() - start, f"{kind}.{half}"
                later.append(seconds) if key in first else first.setdefault(key, seconds)
                halves[half] = loaded

            def pre(*args, _run=halves["pre"], **kwargs):
                *rest, rope = args
                return _run(*rest, *rope)

            block.__dict__["compiled_regions"] = Regions(pre, halves["post"])
    return sum(first.values()), later


def one_way(args) -> dict:
    """This process's way: build, prepare, time the first and the steady forwards; the output to ``args.output``."""
    from ditrun.model.compile import compile_regions
    from ditrun.timers import dynamo_trace_s

    model, inputs = build(args)
    folder = Path(args.folder)
    loads = (0.0, [])
    start = time.perf_counter()
    if args.way.startswith("jit"):
        compile_regions(model)
    elif args.way == "aoti build":
        aoti_build(model, inputs, folder)
        loads = aoti_load(model, folder)
    elif args.way == "aoti load":
        loads = aoti_load(model, folder)
    prepared = time.perf_counter() - start
    with torch.no_grad():
        out = model(**inputs)
        sync(args.device)
        first = time.perf_counter() - start
        traced = dynamo_trace_s()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            model(**inputs)
            sync(args.device)
            times.append(time.perf_counter() - start)
    torch.save(out.float().cpu(), args.output)
    steady = statistics.median(times)
    timings = {"prepare_s": prepared, "first_s": first, "steady_s": steady, "excess_s": first - steady}
    timings["trace_s"] = traced
    later = statistics.median(loads[1]) if loads[1] else None
    return {"way": args.way, "first_loads_s": loads[0], "later_load_s": later, **timings}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--text-len", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPUs, float32 on CPUs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in this process
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.way:
        print(json.dumps(one_way(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="ditrun-aoti-") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "TRITON_CACHE_DIR": f"{tmp}/triton"}
        common = ["--preset", args.preset, "--width", str(args.width), "--height", str(args.height)]
        common += ["--text-len", str(args.text_len), "--device", args.device, "--dtype", args.dtype]
        common += ["--repeats", str(args.repeats), "--folder", tmp]
        rows, outputs = [], {}
        for way in WAYS:
            outputs[way] = f"{tmp}/{way.replace(' ', '_')}.pt"
            command = [sys.executable, __file__, *common, "--way", way, "--output", outputs[way]]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            error = relative_error(torch.load(outputs[way]), torch.load(outputs["eager"]))
            rows.append(
                {
                    "way": way,
                    "prepare s": f"{result['prepare_s']:.2f}",
                    "first s": f"{result['first_s']:.2f}",
                    "excess s": f"{result['excess_s']:.2f}",
                    "of it Dynamo s": f"{result['trace_s']:.2f}",
                    "steady ms": f"{1000 * result['steady_s']:.1f}",
                    "first loads s": f"{result['first_loads_s']:.2f}" if result["later_load_s"] else "-",
                    "ms a later load": f"{1000 * result['later_load_s']:.1f}" if result["later_load_s"] else "-",
                    "error vs eager": f"{error:.1e}",
                }
            )
    print(
        f"{args.preset}, {args.width}x{args.height} + reference, {args.text_len} text tokens, {args.device} "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else ''}, {args.dtype}, torch {torch.__version__}"
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
