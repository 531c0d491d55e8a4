"""``fp8_pv`` attention: Q, K, V and the probabilities P in FP8 E4M3, on the vendors' fused kernels.

The recipe of cuDNN's FP8 flash attention (and of AITER's per-tensor FP8 kernel on AMD GPUs):

* Q, K smoothed by its mean over the tokens (in fp32), and V are
  quantized to E4M3 with one power-of-two scale per tensor (``rceil``: the tensor's amax lands at or
  below 448);
* the scores are an FP8 dot times both scales and the softmax scale; the softmax runs in fp32;
* the unnormalized probabilities exp(s - running max), in [0, 1], are multiplied by ``P_SCALE`` and
  rounded to E4M3 for the P @ V dot (an FP8 dot too), and the fp32 row sums of the unrounded
  probabilities divide the result at the end;
* the output is written in E4M3 too, with the power-of-two scale 1 / (2 * V's scale) (an output row
  is a weighted mean of V's rows, so it stays below V's amax, with room for P's rounding), and
  widened to the compute dtype outside the op (``dequantize_output``: a compiled block fuses it
  into the next kernel). cuDNN writes an FP8 SDPA's output in BF16 only on Blackwell
  (cuDNN 9.13+); on Hopper it writes FP8, so the recipe does everywhere.

Both dots then run at FP8's tensor-core rate, twice BF16's on Hopper. The price is the rounding of
P and of the output (3 mantissa bits each), which the ``int8qk*`` recipes do not pay (P in BF16; the Hopper
kernel's FP8 P @ V of ``int8qk_fp8v`` rounds P, not its output). (AITER's kernel writes BF16; its output is rounded
to the recipe's E4M3 here.)

"Per tensor" means per call. In a parallel layout a call holds the heads of one rank (Ulysses) or
one CFG branch, so the scales are those of what the call holds, and a layout's output is close to
the single process's but not bitwise equal (the per-token scales of ``attention.py`` give every layout the same
operands).

Backends: cuDNN's FP8 SDPA (NVIDIA sm_90 and newer, through the ``nvidia-cudnn-frontend`` Python
package: ``pip install ditrun[cudnn]``), AITER's ``flash_attn_fp8_pertensor_func`` (ROCm with OCP
E4M3, gfx950; written and guarded, not run on AMD hardware), elsewhere ``fp8_pv_emulation``, the
recipe in torch.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ditrun.kernels import formats
from ditrun.kernels.linear import CompiledOnGpu, aiter_function, fp8_dtype
from ditrun.kernels.token_statistics import token_mean, token_sum

P_SCALE = 256.0
"""P in [0, 1] times this before rounding to E4M3 (a power of two, so the emulation's rounding is exact
arithmetic): probabilities down to 2^-14 stay normal numbers."""

# ---------------------------------------------------------------------------------------------
# Operands


def fp8_pv_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, S, H, D] -> their E4M3 codes [B, S, H, D] and the scales as one fp32 tensor [4]: Q's, K's,
    V's and the output's (1 / (2 * V's)), powers of two.

    K is smoothed in fp32, not rounded back to its dtype first: compiled and eager code then quantize the same values
    (inductor would skip an intermediate BF16 rounding that eager code makes). Its mean is
    ``token_statistics.token_mean`` of an fp64 sum, which a sequence-parallel rank can be given for the whole
    sequence (``attention_payload.py``). Its scale comes from amax|k| + amax|mean|, a bound on amax|k - mean| of at
    most twice it, read in the same pass as the mean: a scale one octave too large makes values below about 2^-14
    of the largest (instead of 2^-15) subnormal, and saves a pass over K."""
    mean = token_mean(token_sum(k, 1, keepdim=True), k.shape[1], torch.float32)
    scales = fp8_pv_scales(q.abs().amax().float(), k.abs().amax().float(), mean.abs().amax(), v.abs().amax().float())
    return (*fp8_pv_codes(q, k, v, mean, scales[0], scales[1], scales[2]), scales)


def fp8_pv_scales(amax_q, amax_k, amax_mean, amax_v) -> torch.Tensor:
    """The four fp32 scales of ``fp8_pv_operands`` from the amaxes (fp32, any matching shapes) -> [..., 4]."""
    scales = formats.fp8_power_of_two_scale(torch.stack([amax_q, amax_k + amax_mean, amax_v], dim=-1))
    return torch.cat([scales, 0.5 / scales[..., 2:]], dim=-1)


def fp8_pv_codes(q, k, v, mean, q_scale, k_scale, v_scale) -> tuple[torch.Tensor, ...]:
    """q, k - mean, v (any shape; ``mean`` fp32, the scales fp32, each broadcastable to them) -> E4M3 codes."""
    # every |t / s| <= 448 (rceil scales), where the cast rounds to nearest even as ``round_to_grid`` does;
    # the clamp only keeps a NaN-free cast should a bound be off
    return tuple(
        (t * (1 / s)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        for t, s in ((q.float(), q_scale), (k.float() - mean, k_scale), (v.float(), v_scale))
    )


def dequantize_output(o8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The E4M3 output codes -> values in ``dtype`` (outside the op, so a compiled graph fuses it into
    what reads the attention output)."""
    return (o8.float() / scales[3]).to(dtype)


# ---------------------------------------------------------------------------------------------
# The emulation


def fp8_pv_emulation(q8, k8, v8, scales: torch.Tensor, sm_scale: float, chunk: int = 1024) -> torch.Tensor:
    """The recipe in torch, query chunk by chunk: [B, S, H, D] codes -> the E4M3 output codes [B, S, H, D].

    P is rounded after subtracting each row's final maximum; a flash kernel subtracts the running
    maximum of the keys it has seen, so its P values (and their rounding) differ slightly."""
    q, k, v = (t.float().transpose(1, 2) for t in (q8, k8, v8))  # [B, H, S, D]
    s_scale = (scales[0] * scales[1] * sm_scale).float()
    chunks = []  # joined at the end: Inductor cannot fill an uninitialised FP8 buffer that slices are written into
    for start in range(0, q.shape[2], chunk):
        rows = slice(start, start + chunk)
        scores = (q[:, :, rows] @ k.transpose(-1, -2)) * s_scale
        p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        p8 = formats.round_to_grid(p * P_SCALE, "fp8_e4m3") / P_SCALE
        o = (p8 @ v) * (scales[2] * scales[3] / p.sum(dim=-1, keepdim=True))  # in units of the output's scale
        chunks.append(formats.round_to_grid(o, "fp8_e4m3").transpose(1, 2).to(torch.float8_e4m3fn))
    return torch.cat(chunks, dim=1)  # [B, S, H, D]


# ---------------------------------------------------------------------------------------------
# The fast backends


def cudnn_module():
    """cuDNN's Python frontend, or None when it is not installed."""
    try:
        import cudnn
    except (ImportError, OSError):
        return None
    return cudnn


@functools.lru_cache(maxsize=None)
def unavailable(device: torch.device) -> Optional[str]:
    """None when a fused FP8 attention kernel runs on ``device``, else why not (one clause). Cached: the
    op asks on every call, and a missing package's import is not cached by Python."""
    if device.type != "cuda":
        return "needs a GPU (cuDNN's FP8 SDPA on NVIDIA sm_90+, AITER on AMD gfx950)"
    if torch.version.hip:
        if fp8_dtype() != torch.float8_e4m3fn:
            return "needs OCP E4M3 (AMD gfx950; MI300 has the FNUZ variant)"
        if aiter_function(AITER_ATTENTION) is None:
            return "needs AITER's flash_attn_fp8_pertensor_func (the aiter package)"
        return None
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "needs cuDNN's FP8 SDPA, which runs on NVIDIA sm_90 (Hopper) and newer"
    if cudnn_module() is None:
        return "needs cuDNN's Python frontend (pip install nvidia-cudnn-frontend, or ditrun[cudnn])"
    return None


BACKEND = "aiter" if torch.version.hip else "cudnn"
"""The library that runs ``fp8_pv`` on this build of PyTorch's GPUs."""


AITER_ATTENTION = "flash_attn_fp8_pertensor_func"


SCALAR = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1]}


def _bhsd(shape: tuple) -> dict:
    """A contiguous [B, S, H, D] tensor as cuDNN's [B, H, S, D] dims and strides."""
    b, s, h, d = shape
    return {"dim": [b, h, s, d], "stride": [s * h * d, d, h * d, 1]}


class CudnnGraph:
    """One built cuDNN FP8 SDPA graph for one shape: [B, S, H, D] E4M3 operands (read as cuDNN's
    [B, H, S, D] through their strides, so nothing is transposed), an output of the same layout.

    ``every_plan``: build every execution plan cuDNN's heuristics (modes A, B and the fallback) offer, named in
    ``plans``, to run one by index (``benchmarks/attention.py --cudnn-plans`` times them); otherwise the plan the
    heuristics rank first runs."""

    _handles: dict[int, int] = {}

    def __init__(
        self, q_shape: tuple, kv_shape: tuple, sm_scale: float, device: torch.device, every_plan: bool = False
    ):
        cudnn = cudnn_module()
        self.device = device
        handle = self._handles.get(device.index)
        if handle is None:
            with torch.cuda.device(device):
                handle = self._handles[device.index] = cudnn.create_handle()
        self.handle = handle
        fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)

        def operand(name, shape):
            return graph.tensor(name=name, **_bhsd(shape), data_type=fp8)

        def scalar(name):
            return graph.tensor(name=name, **SCALAR, data_type=fp32)

        self.q, self.k, self.v = operand("q", q_shape), operand("k", kv_shape), operand("v", kv_shape)
        self.scalars = [scalar(n) for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            self.q, self.k, self.v, *self.scalars, generate_stats=False, attn_scale=sm_scale, name="ditrun_fp8_pv"
        )
        layout = _bhsd(q_shape)
        o.set_output(True).set_dim(layout["dim"]).set_stride(layout["stride"]).set_data_type(fp8)
        for t in (amax_s, amax_o):
            t.set_output(True).set_dim(SCALAR["dim"]).set_stride(SCALAR["stride"]).set_data_type(fp32)
        self.o, self.amax = o, (amax_s, amax_o)
        graph.validate()
        graph.build_operation_graph()
        more = getattr(cudnn.heur_mode, "B", None) if every_plan else None  # mode B: a frontend may lack it
        modes = [cudnn.heur_mode.A, *([more] if more is not None else []), cudnn.heur_mode.FALLBACK]
        graph.create_execution_plans(modes)
        graph.check_support()
        self.plans: list[tuple[int, str]] = []
        """(index, name) of each plan built, with ``every_plan``."""
        if every_plan:
            for index in range(graph.get_execution_plan_count()):
                try:
                    graph.build_plan_at_index(index)
                except Exception:  # noqa: BLE001 - a plan this GPU cannot build is left out of the list
                    continue
                self.plans.append((index, graph.get_plan_name_at_index(index)))
            self.workspace_size = max(graph.get_workspace_size_plan_at_index(i) for i, _ in self.plans)
        else:
            graph.build_plans()
            self.workspace_size = graph.get_workspace_size()
        self.graph = graph
        self.p_scales = torch.tensor([1.0 / P_SCALE, P_SCALE], device=device)  # descale_s, scale_s

    def __call__(self, q8, k8, v8, scales: torch.Tensor, plan: Optional[int] = None) -> torch.Tensor:
        """-> the E4M3 output codes [B, S, H, D] (``fp8_pv_operands``' scales); ``plan``: the index of one of
        ``plans`` to run."""
        cudnn = cudnn_module()
        out = torch.empty(q8.shape, dtype=torch.float8_e4m3fn, device=self.device)
        scratch = torch.empty(2 * 4 + self.workspace_size, dtype=torch.uint8, device=self.device)
        buffers = {
            self.q: q8,
            self.k: k8,
            self.v: v8,
            self.o: out,
            self.amax[0]: scratch[0:4],
            self.amax[1]: scratch[4:8],
        }
        values = [scales[0:1], scales[1:2], scales[2:3], self.p_scales[0:1], self.p_scales[1:2], scales[3:4]]
        buffers.update(zip(self.scalars, values))
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(self.device).cuda_stream)
        if plan is None:
            self.graph.execute(buffers, scratch[8:], handle=self.handle)
        else:
            self.graph.execute_plan_at_index(buffers, scratch[8:], plan, handle=self.handle)
        return out


_graphs: dict[tuple, CudnnGraph] = {}


def cudnn_fp8_sdpa(q8, k8, v8, scales, sm_scale: float) -> torch.Tensor:
    key = (q8.device, tuple(q8.shape), tuple(k8.shape), sm_scale)
    graph = _graphs.get(key)
    if graph is None:
        graph = _graphs[key] = CudnnGraph(tuple(q8.shape), tuple(k8.shape), sm_scale, q8.device)
    return graph(q8, k8, v8, scales)


@torch.library.custom_op("ditrun::fp8_sdpa", mutates_args=())
def fp8_sdpa_op(
    q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Attention of E4M3 [B, S, H, D] codes with ``fp8_pv_operands``' scales [4] -> the E4M3 output codes
    [B, S, H, D]: the vendor's fused kernel where ``unavailable`` says one runs, else the emulation."""
    if unavailable(q8.device) is None:
        q8, k8, v8 = q8.contiguous(), k8.contiguous(), v8.contiguous()
        if torch.version.hip:  # AITER writes BF16: rounded to the recipe's E4M3 output here
            out = aiter_function(AITER_ATTENTION)(
                q8, k8, v8, scales[0:1], scales[1:2], scales[2:3], causal=False, softmax_scale=sm_scale
            )
            return formats.round_to_grid(out.float() * scales[3], "fp8_e4m3").to(torch.float8_e4m3fn)
        return cudnn_fp8_sdpa(q8, k8, v8, scales, sm_scale)
    return fp8_pv_emulation(q8, k8, v8, scales, sm_scale)


@fp8_sdpa_op.register_fake
def _(q8, k8, v8, scales, sm_scale):
    return torch.empty(q8.shape, dtype=torch.float8_e4m3fn, device=q8.device)


def fp8_pv_attention(implementation: str):
    """The ``fp8_pv`` attention function: q, k, v [B, S, H, D] -> [B, S, H, D] in v's dtype. ``implementation``:
    ``emulation`` (the recipe in torch), else the vendor's kernel (``BACKEND``)."""
    fast = implementation != "emulation"
    quantize = CompiledOnGpu(fp8_pv_operands) if fast else fp8_pv_operands

    def attention(q, k, v):
        return attend_fp8_pv(*quantize(q, k, v), implementation, v.dtype)

    return attention


def attend_fp8_pv(q8, k8, v8, scales: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """Attention of E4M3 [B, S, H, D] codes with ``fp8_pv_operands``' scales -> [B, S, H, D] in ``dtype``; also what
    a quantized exchange's receiver runs on the codes it received (``attention_payload.py``)."""
    sm_scale = 1.0 / math.sqrt(q8.shape[-1])
    o8 = (fp8_pv_emulation if implementation == "emulation" else fp8_sdpa_op)(q8, k8, v8, scales, sm_scale)
    return dequantize_output(o8, scales, dtype)
