"""The DiT's forward replayed from CUDA graphs (``model.cuda_graphs``).

A compiled forward still launches every kernel from Python: per block, two compiled regions, the
attention's quantizer and kernel, a few hundred launches per forward. The GPU waits wherever the
launches fall behind, or between two kernels that each start when the last one ends. A CUDA graph
records the forward's launches once and replays them as one.

``GraphedForward(model, attention)`` stands where the model is called (``BuiltModel.forward``):

* one graph per input signature (names, shapes and dtypes of the tensors; the other arguments by
  value), captured at the signature's first call after two warm-up forwards on a side stream
  (compilation, cuDNN graph builds, cuBLAS workspaces happen there, not under capture); all
  graphs share one memory pool, since they replay one at a time;
* a call copies its tensors into the graph's inputs, replays it, and returns a copy of the output
  (the next replay overwrites it);
* only calls whose attention is ``attention``, the run's own kernel, which exchanges nothing, are
  graphed. A layout that exchanges inside the forward (Ulysses all-to-alls, the copy-engine
  transport's waits on peers) runs the model as it is;
* where capturing fails it says why once and runs the model without graphs from then on; past
  ``MAX_GRAPHS`` signatures, new ones run without graphs.

The graph's results are those of the forward it recorded: the same kernels on the same inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch.utils import _pytree as pytree

from ditrun.kernels.sdpa import sdpa_attention
from ditrun.model.compile import RECOMPILE_LIMIT

WARMUP_FORWARDS = 2
MAX_GRAPHS = RECOMPILE_LIMIT
"""Input signatures graphed per model (as many as compiled shapes are kept); a workload of more sizes runs the
rest without graphs."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    """The static tensors of the inputs, in ``pytree`` order."""
    output: Any
    """The static output: a tensor, or tuples of tensors (a step cache's model parts, ``FluxDiT.head``)."""


def _tensors(inputs: dict) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]


def signature(inputs: dict) -> tuple:
    """What a graph is recorded for: each tensor's place in ``inputs`` (tuples included), shape, dtype and device;
    other values as they are."""
    leaves, spec = pytree.tree_flatten(inputs)
    key = [str(spec)]
    for value in leaves:
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), value.dtype, value.device))
        else:
            key.append(value if isinstance(value, Hashable) else id(value))
    return tuple(key)


def _clone_tensors(tree):
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, tree)


class GraphedForward:
    """``model(**inputs)``, replayed from one CUDA graph per input signature (see the module doc). ``model`` is the
    DiT, or one of the parts a step cache runs (``FluxDiT.head``, ``tail``, ``finish``)."""

    def __init__(self, model: Callable, attention: Callable):
        self.model, self.attention = model, attention
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        self.failed = False
        self.capture_s = 0.0
        """Seconds spent recording graphs (the capture itself; the warm-up forwards before it compile)."""

    def __call__(self, **inputs) -> torch.Tensor:
        inputs = dict(sorted(inputs.items()))  # one order of the leaves, whatever the caller's order of keywords
        if not self._graphable(inputs):
            return self.model(**inputs)
        key = signature(inputs)
        entry = self.graphs.get(key)
        if entry is None and len(self.graphs) >= MAX_GRAPHS:
            return self.model(**inputs)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(inputs)
            except Exception as err:  # noqa: BLE001 - any capture failure: the model runs as it is
                self.failed = True
                print(
                    f"ditrun: capturing the DiT forward in a CUDA graph failed ({type(err).__name__}: {err}); "
                    "running it without CUDA graphs.",
                    flush=True,
                )
                return self.model(**inputs)
        for static, value in zip(entry.inputs, _tensors(inputs)):
            static.copy_(value)
        entry.graph.replay()
        return _clone_tensors(entry.output)

    def _graphable(self, inputs: dict) -> bool:
        tensors = _tensors(inputs)
        return (
            not self.failed
            and bool(tensors)
            and all(t.is_cuda for t in tensors)
            and inputs.get("attention", sdpa_attention) is self.attention
            and not torch.cuda.is_current_stream_capturing()
        )

    def _capture(self, inputs: dict) -> _Graph:
        call = _clone_tensors(inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_FORWARDS):
                self.model(**call)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # the heartbeat thread runs on
            output = self.model(**call)
        torch.cuda.empty_cache()  # the warm-ups' blocks: the graph's pool holds what replays need
        self.capture_s += time.perf_counter() - start
        return _Graph(graph, _tensors(call), output)


def capture_seconds(*forwards: Callable) -> float:
    """Seconds the ``GraphedForward``s among ``forwards`` spent recording graphs."""
    return sum(forward.capture_s for forward in forwards if isinstance(forward, GraphedForward))
