"""One process of ``test_compile_cache.py``, as a job on a fresh node runs: load the compile-cache entry, compile a
small model with Inductor and run it, write the entry; prints what happened as one line of JSON.

    python compile_cache_job.py CACHE_FOLDER [--together READY_FOLDER] [--trust NAME ...] [--load-only]

``--together``: wait, before writing, until two processes are ready (a file each in READY_FOLDER), so that two
jobs write the entry at once. ``--trust``: ``model.compile_cache_trust``'s names. ``--load-only``: stop after
loading the entry (what a job does with an entry it sets aside needs no compile). The caller gives each process
its own empty ``TORCHINDUCTOR_CACHE_DIR``, or none: then the job's, as ditrun's worker claims it.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from ditrun.model.compile import INDUCTOR_CACHE_ENV, claim_compiler_caches
from ditrun.run.compile_cache import TRUST_KEY, CompileCache, device_description, toolchain
from ditrun.trust import Trust

TOGETHER = 2
WAIT_S = 120.0


def _wait_for_the_other(ready: Path) -> None:
    ready.mkdir(parents=True, exist_ok=True)
    (ready / str(time.perf_counter_ns())).touch()
    deadline = time.monotonic() + WAIT_S
    while len(list(ready.iterdir())) < TOGETHER:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other process did not get ready in {WAIT_S:.0f} s")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--together", type=Path)
    parser.add_argument("--trust", nargs="*", default=[])
    parser.add_argument("--load-only", action="store_true")
    args = parser.parse_args()
    inductor = claim_compiler_caches()[INDUCTOR_CACHE_ENV]
    described = {**toolchain(), "device": device_description(torch.device("cpu")), "model": "compile_cache_job"}
    cache = CompileCache(args.folder, described, writer=True, trust=Trust.parse(args.trust, TRUST_KEY))
    status = cache.load()
    if args.load_only:
        print(json.dumps({"status": status, "entry": str(cache.path), "inductor": str(inductor)}), flush=True)
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        output = compiled(torch.linspace(-2.0, 2.0, 64).reshape(4, 16))
    if args.together is not None:
        _wait_for_the_other(args.together)
    wrote = cache.save()
    lookups = cache.fields()["fx_graph_cache"]
    print(
        json.dumps(
            {
                "status": status,
                "wrote": wrote,
                "entry": str(cache.path),
                "key": cache.key,
                "inductor": str(inductor),
                "fxgraph_cache_hit": lookups["hit"],
                "fxgraph_cache_miss": lookups["miss"],
                "output": output.tolist(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
