"""Start-up at scale: process start -> first denoising step, per rank, on 1, 2, 4 ... emulated nodes.

For each node count this starts a Slurm cluster of that many emulated nodes on this machine
(``slurm/local-cluster.sh start DIR CPUS NODES``: one slurmd per node, each in its own UTS
namespace, so the ranks see their node's host name), runs ``srun -N<nodes>`` ditrun with the tiny
model, one edit per rank (so that every rank reaches a first step), and reads every rank's
start-up from the run's ``summary.json`` (``startup_by_rank``, see ditrun/timers.py):

- ``imports_s``: process start (the kernel's start time) to ditrun's launch: interpreter, imports,
  Hydra's config;
- ``rendezvous_s``: ditrun's rendezvous (every rank signs in at rank 0's TCPStore) and the process
  group's set-up on that store: the part that grows with the node count;
- ``load_s``: prompts, references, model build;
- ``startup_s``: process start to the first denoising step.

It prints a table and writes ``benchmarks/results/startup.json`` (read by ``benchmarks/scaling.py``,
with the fitted rendezvous cost per rank). Needs root and Debian's slurm-wlm; runs on the CPU.

    python benchmarks/startup.py                       # 1, 2 and 4 nodes x 2 ranks, then the fit
    python benchmarks/startup.py --nodes 1 2 4 8 --tasks-per-node 2 --repeats 3

How it extrapolates. The rendezvous is one TCPStore served by rank 0: each rank makes a constant
number of store requests to sign in (``set`` of its host name, one ``add``, one ``wait``), and
gloo's or NCCL's set-up adds O(1) requests per rank for its own address exchange; rank 0 then
polls one counter. So the store serves O(ranks) requests, one at a time, and the rendezvous costs
``a + b * ranks``. A second table measures ditrun's rendezvous alone with threads of this process
as ranks (each its own connection), up to 512 ranks, which no machine here can start processes for.

Measured on the 2-core development machine (``benchmarks/results/startup.json``; 2 ranks per
emulated node, median of 2 runs):

    nodes  ranks  imports s med/max  rendezvous s min/med/max  load s med  start-up s med/max
        1      2        3.26 / 3.69     0.018 / 0.443 / 0.869        0.86         5.04 / 5.04
        2      4        7.85 / 8.08     0.167 / 0.283 / 0.390        1.81       11.18 / 11.32
        4      8      14.61 / 15.18     0.070 / 0.392 / 1.080        2.98       19.40 / 19.94
    rendezvous alone (threads as ranks): 8: 0.055 s, 64: 0.060 s, 256: 0.153 s, 512: 0.308 s
      -> 0.036 s + 0.52 ms x ranks: 0.30 s at 512 ranks (64 nodes x 8 GPUs)

Reading it: imports, load and so start-up grow with the node count here only because every rank
of every emulated node shares the same two cores (8 ranks take 4x the CPU time of 2); on a real
cluster each node brings its own cores, so they stay at the one-node value, except what a shared
file system serves to all nodes at once (the Python packages, the weights), which this does not
model. The rendezvous of the last rank to arrive (min) is the protocol's own cost, tens to a few
hundred ms here, noisy because of the same contention; the slowest rank (max) also waits for the
last one to start, so its growth is the spread of the ranks' start, not the store. The store
itself costs about 0.5 ms per rank, 0.3 s at 512 ranks: the rendezvous is not what limits
start-up at 64 nodes; stragglers are, and ``launcher.rendezvous_timeout_s`` (120 s) bounds them.
One in three meetings of 64 thread-ranks took 10 s instead of 0.06 s: clients connecting in one
burst that find the listen queue full retry with back-off (the medians leave it out; at 512
processes starting at once, expect such seconds-long outliers, well inside the timeout). Not
measured: gloo's or NCCL's own communicator set-up at 512 ranks, and the heartbeats' load (2 store
increments per rank per second: about 1000/s at 512 ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import socket

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns once per connection it cannot name
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ditrun.launch.env import RankInfo, free_port
from ditrun.launch.rendezvous import meet

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "slurm" / "local-cluster.sh"
RESULT = REPO / "benchmarks" / "results" / "startup.json"
TINY = [
    "model.num_attention_heads=8",
    "workload.width=32",
    "workload.height=48",
    "workload.steps=2",
    "workload.text_len=7",
    "wandb.mode=disabled",
    "progress=false",
    "device=cpu",
    "metrics.ssim=false",
    "metrics.report=false",
    "layout=single",
]
PHASES = ("imports_s", "rendezvous_s", "load_s", "startup_s")
TARGET_RANKS = 512  # 64 nodes x 8 GPUs: the scale docs/SCALING.md models


def job_env(conf: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_"))}
    env.update(SLURM_CONF=str(conf), PYTHONUNBUFFERED="1", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    return env


def run_once(nodes: int, tasks_per_node: int, work: Path) -> list[dict]:
    """Every rank's start-up split, from one ditrun run on a fresh cluster of ``nodes`` nodes."""
    state, out = work / "cluster", work / "run"
    state.mkdir(parents=True)
    subprocess.run(
        [str(CLUSTER), "start", str(state), str(tasks_per_node), str(nodes)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        world = nodes * tasks_per_node
        proc = subprocess.run(
            [
                "srun",
                f"-N{nodes}",
                f"--ntasks-per-node={tasks_per_node}",
                "--kill-on-bad-exit=1",
                sys.executable,
                "-m",
                "ditrun",
                f"hydra.run.dir={out}",
                *TINY,
                f"layout.replicas={world}",
                f"workload.limit={world}",
            ],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=600,
            env=job_env(state / "slurm.conf"),
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ditrun on {nodes} node(s) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads((out / "summary.json").read_text())["startup_by_rank"]
    finally:
        subprocess.run([str(CLUSTER), "stop", str(state)], capture_output=True, timeout=120)


def row(nodes: int, by_rank: list[dict]) -> dict:
    """Median and slowest rank of each phase, for one run."""
    out = {"nodes": nodes, "ranks": len(by_rank), "hosts": sorted({r["host"] for r in by_rank})}
    for phase in PHASES:
        values = [r[phase] for r in by_rank if r.get(phase) is not None]
        out[f"{phase}_min"] = min(values) if values else None
        out[f"{phase}_median"] = statistics.median(values) if values else None
        out[f"{phase}_max"] = max(values) if values else None
    return out


def fit(rows: list[dict], key: str) -> tuple[float, float]:
    """Least squares ``key = a + b * ranks`` over the runs: (a, b)."""
    xs, ys = [r["ranks"] for r in rows], [r[key] for r in rows]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


# What is fitted against the rank count: the last rank to arrive waits for nobody, so its
# rendezvous is the protocol's own cost (sign-in, rank 0's verdict, the process group's set-up);
# the first to arrive also waits for the last one, so the slowest is the cost plus the skew of
# the ranks' start (on this machine: imports competing for two cores).
FITS = {
    "rendezvous_s_min": "rendezvous, protocol (last rank to arrive)",
    "rendezvous_s_max": "rendezvous, slowest rank (protocol + arrival skew)",
}


def extrapolate(rows: list[dict], key: str, label: str) -> dict:
    fixed, per_rank = fit(rows, key) if len(rows) > 1 else (rows[0][key], 0.0)
    predicted = fixed + per_rank * TARGET_RANKS
    print(f"{label}: {fixed:.3f} s + {per_rank * 1e3:.2f} ms x ranks -> {predicted:.2f} s at {TARGET_RANKS} ranks")
    return {"fixed_s": fixed, "per_rank_s": per_rank, "ranks": TARGET_RANKS, "predicted_s": predicted}


def store_meeting_s(ranks: int) -> float:
    """Wall seconds for ``ranks`` threads of this process, each a rank with its own connection, to
    meet through ditrun's rendezvous (rank 0 serving the TCPStore): the protocol's own cost at a
    rank count no machine here can start processes for. The clock starts once rank 0 listens, as
    on a cluster where it started first (a client that finds no server backs off for seconds,
    which would measure the back-off instead)."""
    port = free_port()
    infos = [RankInfo("benchmark", r, r, ranks, ranks, 1, "127.0.0.1", port) for r in range(ranks)]
    listening = threading.Event()
    meetings = [None] * ranks  # kept until every rank is through: rank 0's store serves them all

    def rank(info: RankInfo) -> None:
        if info.rank:
            listening.wait()
        meetings[info.rank] = meet(info, 300, {"out_dir": "unused"})

    threads = [threading.Thread(target=rank, args=(info,)) for info in infos]
    for thread in threads:
        thread.start()
    while not _listens(port):
        time.sleep(0.001)
    began = time.perf_counter()
    listening.set()
    for thread in threads:
        thread.join()
    assert all(meetings), "a rank did not meet"
    return time.perf_counter() - began


def _listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def print_table(rows: list[dict]) -> None:
    header = ("nodes", "ranks", "imports s med/max", "rendezvous s min/med/max", "load s med", "start-up s med/max")
    lines = [header]
    for r in rows:
        lines.append(
            (
                str(r["nodes"]),
                str(r["ranks"]),
                f"{r['imports_s_median']:.2f} / {r['imports_s_max']:.2f}",
                f"{r['rendezvous_s_min']:.3f} / {r['rendezvous_s_median']:.3f} / {r['rendezvous_s_max']:.3f}",
                f"{r['load_s_median']:.2f}",
                f"{r['startup_s_median']:.2f} / {r['startup_s_max']:.2f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tasks-per-node", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs per node count; the median run is kept")
    parser.add_argument(
        "--store-ranks",
        type=int,
        nargs="*",
        default=[8, 64, 256, 512],
        help="rank counts for the rendezvous alone, threads as ranks",
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    store = [
        {"ranks": n, "meeting_s": statistics.median(store_meeting_s(n) for _ in range(3))} for n in args.store_ranks
    ]
    rows = []
    for nodes in args.nodes:
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix=f"startup-{nodes}n-") as work:
                runs.append(row(nodes, run_once(nodes, args.tasks_per_node, Path(work))))
        rows.append(sorted(runs, key=lambda r: r["startup_s_max"])[len(runs) // 2])
    print_table(rows)
    fits = {key: extrapolate(rows, key, label) for key, label in FITS.items()}
    print("\nditrun's rendezvous alone (threads of one process as ranks, one TCPStore):")
    for entry in store:
        print(f"  {entry['ranks']:4d} ranks: {entry['meeting_s']:.3f} s")
    if len(store) > 1:
        fits["store_meeting_s"] = extrapolate(
            [{"ranks": e["ranks"], "meeting_s": e["meeting_s"]} for e in store], "meeting_s", "rendezvous alone"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": f"{os.cpu_count()} CPU cores, emulated nodes (slurm/local-cluster.sh), "
                "tiny model on the CPU",
                "measured": time.strftime("%Y-%m-%d", time.gmtime()),
                "tasks_per_node": args.tasks_per_node,
                "rows": rows,
                "store_meeting": store,
                "fits": fits,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
