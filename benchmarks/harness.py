"""What every benchmark script here shares, so that every table is measured the same way and no script imports
another. Run the scripts from the repository's root with ditrun importable (the venv, or ``PYTHONPATH=$PWD`` as
``gpu_suite.sh`` sets); ``python3 benchmarks/<script>.py`` finds this module beside it.

Timing:

* ``time_ms``: median ms per call after a warm-up call (CUDA events on GPUs; what ``ditrun tune`` times with);
* ``graph_ms``: back-to-back calls replayed as one CUDA graph, the GPU's time alone;
* ``interleaved_ms`` / ``interleaved_graph_ms``: several cases timed in turns (``in_turns``), so that the GPU's
  clock and temperature, which drift while it works, weigh on every case alike;
* ``cuda_time``: seconds per call of a long call (a whole forward), one CUDA-event pair each;
* ``gpu_and_backlog_s``: one call's GPU time and how long the GPU still worked once the host had issued it.

Tables and errors: ``print_table``, ``relative_error``. Inputs: ``edit_inputs`` (a Kontext edit's), ``LayoutArgs``
(the ``layout.*`` keys without a run config). The peer: ``diffusers_flux_dev`` (diffusers' model of
FLUX.1-dev's geometry), ``forward_flops``, and ``nothing_to_measure`` (no GPU, or no diffusers).
"""

from __future__ import annotations

import statistics
import time

import torch

from ditrun.model.presets import PRESETS
from ditrun.tune import REPEATS, events_ms, time_ms  # noqa: F401  (the dispatch table's own timing)

CUDA = torch.device("cuda")
FLUX_DEV = PRESETS["flux-dev"]


def cuda_time(fn, warmup: int, repeats: int) -> list[float]:
    """Seconds per call, one CUDA-event pair per call, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    return [events_ms(fn) / 1e3 for _ in range(repeats)]


def gpu_and_backlog_s(fn) -> tuple[float, float]:
    """(GPU seconds, backlog seconds) of one call: the backlog is how long the GPU still ran after the host had
    issued everything (about 0: the GPU was waiting for the host)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    issued = time.perf_counter()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, time.perf_counter() - issued


def graph_of(fn, calls: int) -> "torch.cuda.CUDAGraph":
    """``calls`` back-to-back calls of ``fn`` captured as one CUDA graph, after warm-up calls outside it."""
    fn()  # compilation, autotuning, the allocator
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(fn, repeats: int = REPEATS, calls: int = 10) -> float:
    """Median milliseconds per call of ``calls`` back-to-back calls replayed as one CUDA graph: the GPU's time
    alone, as a graphed model (``model.cuda_graphs``) runs them, without the host's launch costs."""
    return time_ms(graph_of(fn, calls).replay, torch.device("cuda"), repeats) / calls


def in_turns(names: list, repeats: int):
    """``repeats`` rounds of ``names`` (any items), each round every name once, starting one later than the round
    before: the GPU's clock and temperature, which drift while it works, then weigh on every case alike rather than
    on whichever ran first."""
    for round_ in range(repeats):
        yield from names[round_ % len(names) :] + names[: round_ % len(names)]


def interleaved_graph_ms(fns: dict, repeats: int = REPEATS, calls: int = 10) -> dict:
    """``graph_ms`` of each of ``fns`` (name -> function), timed in turns (``in_turns``): every round replays each
    graph once."""
    graphs = {name: graph_of(fn, calls) for name, fn in fns.items()}
    times = {name: [] for name in graphs}
    for graph in graphs.values():
        graph.replay()
    for name in in_turns(list(graphs), repeats):
        times[name].append(events_ms(graphs[name].replay) / calls)
    return {name: statistics.median(ms) for name, ms in times.items()}


def interleaved_ms(fns: dict, repeats: int = REPEATS, calls: int = 10) -> dict:
    """Median milliseconds per call of each of ``fns`` (name -> function) on the current GPU, timed in turns
    (``in_turns``): every round gives each one untimed call, then times ``calls`` back-to-back calls (functions
    that cannot be captured in a CUDA graph; else ``interleaved_graph_ms``)."""
    times = {name: [] for name in fns}
    for name in in_turns(list(fns), repeats):
        fns[name]()  # the stream's untimed call
        times[name].append(events_ms(fns[name], calls) / calls)
    return {name: statistics.median(ms) for name, ms in times.items()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def print_table(rows: list[dict[str, str]]) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    widths = {c: max(len(c), *(len(row.get(c, "")) for row in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(row.get(c, "-").ljust(widths[c]) for c in columns), flush=True)


def forward_flops(n_img: int, n_txt: int) -> float:
    """Matmul FLOPs of one forward (linears + attention scores and values)."""
    g = FLUX_DEV
    d, s = g.inner_dim, n_img + n_txt
    mlp = g.mlp_hidden_dim
    double = 2 * s * (4 * d * d + 2 * d * mlp)  # per token: its stream's qkv + out + mlp (AdaLN is per image)
    single = 2 * s * (3 * d * d + d * mlp + (d + mlp) * d)
    attention = 4 * s * s * d
    return g.num_layers * (double + attention) + g.num_single_layers * (single + attention)


def diffusers_flux_dev():
    """diffusers' FluxTransformer2DModel of FLUX.1-dev's geometry on the GPU, seeded random BF16 weights."""
    from diffusers import FluxTransformer2DModel

    g = FLUX_DEV
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(
            num_layers=g.num_layers,
            num_single_layers=g.num_single_layers,
            attention_head_dim=g.attention_head_dim,
            num_attention_heads=g.num_attention_heads,
            joint_attention_dim=g.joint_attention_dim,
            pooled_projection_dim=g.pooled_projection_dim,
            guidance_embeds=True,
            axes_dims_rope=g.axes_dims_rope,
        )
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def nothing_to_measure(script: str) -> bool:
    """True, after saying why, when ``script`` cannot measure here: no GPU, or no diffusers (the peer)."""
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA/ROCm GPU visible; nothing to measure.")
        return True
    try:
        import diffusers  # noqa: F401
    except ImportError:
        print(f"{script}: diffusers is not installed; it is the peer this benchmark compares with.")
        return True
    return False


class LayoutArgs:
    """The three ``layout.*`` keys, without composing a whole run config."""

    def __init__(self, name: str, head_groups: int):
        self.name, self.replicas, self.head_groups = name, 1, head_groups


def edit_inputs(width: int, height: int, text_len: int, device: torch.device = CUDA):
    """A Kontext-style edit's inputs (output tokens, as many reference tokens, text), seeded random, on ``device``."""
    from ditrun.model.latents import token_ids
    from ditrun.model.sampler import EditInputs

    h, w = height // 8, width // 8
    n = (h // 2) * (w // 2)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    return EditInputs(
        noise=randn(1, n, 64),
        ref_latents=randn(1, n, 64),
        img_ids=token_ids(h, w, 0, device),
        ref_ids=token_ids(h, w, 1, device),
        prompt=randn(1, text_len, FLUX_DEV.joint_attention_dim),
        pooled=randn(1, FLUX_DEV.pooled_projection_dim),
        neg_prompt=randn(1, text_len, FLUX_DEV.joint_attention_dim),
        neg_pooled=randn(1, FLUX_DEV.pooled_projection_dim),
        txt_ids=torch.zeros(text_len, 3, device=device),
    )
