"""Attention kernels, by name: PyTorch SDPA, FP8 Q/K/V, and INT8-QK attention with V in BF16/FP8/MXFP6.

INT8-QK attention (after SageAttention's recipe): K is smoothed by subtracting its mean over the
tokens (softmax(q.k_j - q.m) = softmax(q.k_j): a constant per query row cancels), then Q and K are
quantized to INT8 with one scale per token and head (scale = amax / 127 over the head's channels);
the scores are the INT8 dot products (exact in int32) times the outer product of the scales, the
softmax runs in fp32, and P @ V in the compute dtype with V optionally quantized (FP8 E4M3 with
one power-of-two scale per head, or MXFP6 E2M3 in blocks of 32 channels of a token, both exactly
representable in BF16).

Scales are per token rather than per block of tokens on purpose: a parallel layout gathers the
sequence in another order (``parallel/ulysses.py``), and a scale shared by a block of tokens
would then change with the layout; per token, every layout gives the single process's result.
The kernel pays one multiply per score for the key scales.

FP8 attention (``fp8``) quantizes Q, smoothed K and V to E4M3 with one power-of-two scale per
(batch, head), over the whole sequence (which every layout holds for the heads it computes):
Q.K^T is then an FP8 tensor-core dot and one scalar scales the scores.

``int8qk_reference`` is the torch reference (runs anywhere, in query chunks so that memory
stays O(S * chunk)); on a GPU with Triton the same quantized operands go to a flash-attention
kernel (``ditrun::int8qk_attention``, a ``torch.library.custom_op`` with a fake implementation,
so ``torch.compile`` traces through it), for both INT8 and FP8 operands. The op runs the reference
math on other devices.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ditrun.kernels import formats, fp8_sdpa
from ditrun.kernels.linear import CompiledOnGpu, _has_rowwise_fp8, fp8_dtype, triton_available
from ditrun.model.dit import AttentionFn, sdpa_attention
from ditrun.registry import Registry

V_FORMATS = ("bf16", "fp8", "mxfp6")


# ---------------------------------------------------------------------------------------------
# Quantizing the operands (shared by the reference and the kernel)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] -> (int8 [B, H, S, D], fp32 scale [B, H, S]) with x ~ int8 * scale, per token."""
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 127.0), torch.ones_like(amax))  # divided: see
    # linear.quantize_rowwise_fp8
    return torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def quantize_v(v: torch.Tensor, v_format: str) -> torch.Tensor:
    """V [B, H, S, D] fake-quantized in its own dtype (every value exact in BF16)."""
    if v_format == "bf16":
        return v
    if v_format == "fp8":
        # One power-of-two scale per head keeps every E4M3 value exact in BF16.
        exponent = fp8_head_exponents(v)[..., None, None]
        return torch.ldexp(formats.round_to_grid(torch.ldexp(v.float(), -exponent), "fp8_e4m3"), exponent).to(v.dtype)
    # MXFP6 blocks run along each token's channels, so no block mixes tokens (see the module doc).
    return formats.fake_quantize(v, "fp6_e2m3").to(v.dtype)


def fp8_head_exponents(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] -> the exponent [B, H] (fp32) of each head's power-of-two E4M3 scale (``rceil``: the
    head's amax lands at or below 448)."""
    amax = x.float().abs().amax(dim=(-2, -1))
    return formats.shared_exponents(amax, formats.FORMATS["fp8_e4m3"], "rceil").float()


def quantize_fp8_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] -> (E4M3 codes, fp32 power-of-two scale [B, H]): ``quantize_v(x, "fp8")`` as codes and
    scale (codes * scale equals it exactly), the operands of the FP8 attention kernel."""
    scale = formats.fp8_power_of_two_scale(x.float().abs().amax(dim=(-2, -1)))
    codes = formats.round_to_grid(x.float() / scale[..., None, None], "fp8_e4m3").to(torch.float8_e4m3fn)
    return codes, scale


def smooth_k(k: torch.Tensor, dim: int) -> torch.Tensor:
    """K minus its mean over the tokens (``dim``): the scores of a query row move by one constant,
    which softmax ignores, and what is left to quantize is the part that differs between keys."""
    return k - k.mean(dim=dim, keepdim=True, dtype=torch.float32).to(k.dtype)  # fp32 sums, no fp32 copy of k


@dataclass
class Int8QK:
    """The quantized operands of one attention call, in [B, H, S, D] layout."""

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: Optional[torch.Tensor] = None
    """With it, ``v`` holds FP8 V as the Gluon FP8 P @ V's operand (``fp8_v_codes``), this its scale per head."""


@torch.library.custom_op("ditrun::quantize_qk", mutates_args=())
def quantize_qk_op(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of ``quantize_qk`` (one pass: smoothing, per-token scale, rounding, transpose)."""
    from ditrun.kernels.attention_triton import quantize_qk

    return quantize_qk(x, smooth)


@quantize_qk_op.register_fake
def _(x, smooth):
    b, s, h, d = x.shape
    return x.new_empty((b, h, s, d), dtype=torch.int8), x.new_empty((b, h, s), dtype=torch.float32)


def quantize_qk(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Q or K [B, S, H, D] -> (int8 [B, H, S, D], fp32 scale [B, H, S]); K (``smooth``) minus its token mean."""
    if triton_available(x.device):
        return quantize_qk_op(x, smooth)
    return quantize_int8_rows((smooth_k(x, dim=1) if smooth else x).transpose(1, 2))


def fp8_v_codes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V [B, H, S, D] -> ``quantize_v(v, "fp8")`` as the Hopper kernel's FP8 P @ V operand: (E4M3 codes of V^T,
    [B * H * D, S rounded up to 32], keys reordered within each 32 as ``attention_gluon.fp8_v_operand`` says, zeros
    past S; the power-of-two scale per head, [B * H]). The torch statement, run off GPUs; on GPUs the operand
    quantization calls ``fp8_v_codes_op``, which writes the same codes (``fp8_v_values`` undoes them)."""
    b, h, s, d = v.shape
    exponent = fp8_head_exponents(v)  # [B, H]
    values = formats.round_to_grid(torch.ldexp(v.float(), -exponent[..., None, None]), "fp8_e4m3")
    padded = -(-s // 32) * 32
    values = F.pad(values, (0, 0, 0, padded - s)).view(b, h, padded // 32, 2, 2, 4, 2, d)
    # [B, H, S'/32, h, w, t, e, D] -> [B, H, D, S'/32, h, t, w, e]:
    # stored key 16h + 4t + 2w + e is key 16h + 8w + 2t + e
    codes = values.permute(0, 1, 7, 2, 3, 5, 4, 6).reshape(b * h * d, padded).to(torch.float8_e4m3fn)
    return codes, torch.ldexp(torch.ones_like(exponent), exponent).flatten()


@torch.library.custom_op("ditrun::fp8_v_codes", mutates_args=())
def fp8_v_codes_op(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_v_codes`` of V [B, S, H, D] (the model's layout) by two Triton passes (``attention_triton.fp8_v_codes``:
    the heads' amax, then the codes). On one H200 at 20992 tokens, 24 heads, the torch statement compiled by
    inductor took 1.2 ms per call (docs/PERFORMANCE.md, session 6)."""
    from ditrun.kernels.attention_triton import fp8_v_codes as triton_fp8_v_codes

    return triton_fp8_v_codes(v)


@fp8_v_codes_op.register_fake
def _(v):
    b, s, h, d = v.shape
    return (v.new_empty((b * h * d, (s + 31) // 32 * 32), dtype=torch.float8_e4m3fn),
            v.new_empty((b * h,), dtype=torch.float32))


def fp8_v_values(codes: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``fp8_v_codes``' output -> V [B, H, S, D] (``shape``) in BF16: ``quantize_v(v, "fp8")`` again, exactly."""
    b, h, s, d = shape
    padded = codes.shape[1]
    values = codes.float().view(b, h, d, padded // 32, 2, 4, 2, 2).permute(0, 1, 3, 4, 6, 5, 7, 2)
    return (values.reshape(b, h, padded, d)[:, :, :s] * scale.view(b, h, 1, 1)).to(torch.bfloat16)


def operand_tensors(q, k, v, v_format: str, v_codes: bool = False) -> tuple[torch.Tensor, ...]:
    """The fields of ``Int8QK``, as a tuple (what torch.compile returns best). ``v_codes`` (FP8 V): V as the
    Hopper kernel's FP8 P @ V operand and its scale (``fp8_v_codes``)."""
    # q, k, v: [B, S, H, D] -> [B, H, S, D] operands
    q8, q_scale = quantize_qk(q, smooth=False)
    k8, k_scale = quantize_qk(k, smooth=True)
    if v_codes:
        codes = fp8_v_codes_op(v) if triton_available(v.device) else fp8_v_codes(v.transpose(1, 2))
        return (q8, q_scale, k8, k_scale, *codes)
    return q8, q_scale, k8, k_scale, quantize_v(v.transpose(1, 2), v_format).contiguous()


def quantize_operands(q, k, v, v_format: str) -> Int8QK:
    return Int8QK(*operand_tensors(q, k, v, v_format))


# ---------------------------------------------------------------------------------------------
# The reference


def int8qk_reference(ops: Int8QK, sm_scale: float, chunk: int = 1024) -> torch.Tensor:
    """Attention of quantized operands in torch, query chunk by chunk. -> [B, H, S, D] in V's dtype."""
    q_scale, k_scale, k = ops.q_scale, ops.k_scale, ops.k.float()  # scales: [B, H, S]
    out = torch.empty_like(ops.v)
    for start in range(0, ops.q.shape[2], chunk):
        rows = slice(start, start + chunk)
        # int8 x int8 sums over D <= 256 stay below 2^24: exact in fp32
        scores = ops.q[:, :, rows].float() @ k.transpose(-1, -2)  # [B, H, c, S]
        scores = scores * (q_scale[:, :, rows, None] * k_scale[:, :, None, :] * sm_scale)
        p = torch.softmax(scores, dim=-1)
        out[:, :, rows] = (p @ ops.v.float()).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# The Triton kernel (GPU) behind a custom op


FP8_PV_DOT = False
"""Whether ``int8qk_fp8v`` runs P @ V as an FP8 tensor-core dot (P rounded to E4M3). Off: on one H200 with
Triton 3.6 the FP8 dot made the kernel slower, not faster (11.3 against 9.2 ms at S = 20992: P's
conversion and its trip to the dot's operand layout cost more than the dot saves; docs/PERFORMANCE.md),
so the FP8-exact V values run the BF16 dot, exactly as the reference computes them."""


GLUON_INT8QK = True
"""Whether INT8-QK attention runs the Hopper Gluon kernel (``attention_gluon.py``) where it can: sm_90, head
dim 128, V in BF16/FP16, Triton with Gluon's Hopper API. On one H200 it ran 1.12-1.16x faster than the
Triton kernel at 4608-20992 tokens (docs/PERFORMANCE.md); elsewhere the Triton kernel runs."""

GLUON_FP8_PV = True
"""Whether ``int8qk_fp8v`` on the Gluon kernel runs P @ V as an FP8 product (2^8 P rounded to E4M3; V as E4M3 codes
written by the operand quantization, ``fp8_v_codes_op``), at the price of P's rounding (3 mantissa bits; a few %
max-norm against the reference, which does not round P). On one H200 at 20992 tokens the kernel is 1.32-1.33x
cuDNN's BF16 SDPA (1.2x the BF16 product) and ``int8qk_fp8v`` 1.30x end to end; its GPU tests, the compiled and
CUDA-graphed worker's among them, pass (docs/PERFORMANCE.md, 2026-11-30 sessions 4-6)."""


@functools.cache
def _gluon_kernels():
    """The Gluon kernel module, or None where this Triton lacks the API it is written against."""
    try:
        from ditrun.kernels import attention_gluon
    except (ImportError, AttributeError):
        return None
    return attention_gluon


def gluon_int8qk_available(device: torch.device) -> bool:
    """Whether ``device`` runs the Gluon INT8-QK kernel (an NVIDIA Hopper GPU, the kernel importable)."""
    if not GLUON_INT8QK or device.type != "cuda" or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and _gluon_kernels() is not None


def _runs_gluon(q, k, q_scale, k_scale, v) -> bool:
    """This call's operands fit the Gluon kernel: INT8 per-token Q/K, head dim 128, 16-byte aligned rows."""
    b, h, s, d = q.shape
    return (q.dtype == torch.int8 and d == 128 and v.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
            and b * h * s >= 128 and all(t.data_ptr() % 16 == 0 for t in (q, k, q_scale, k_scale, v))
            and gluon_int8qk_available(q.device))


def gluon_compile_errors() -> tuple[type[Exception], ...]:
    """What a Triton whose Gluon API moved raises compiling the Gluon kernel: the op then falls back."""
    from triton.compiler.errors import CompilationError

    return CompilationError, AttributeError, TypeError, ValueError, AssertionError


def gluon_fp8_pv_runs(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``int8qk_fp8v`` on these [B, S, H, D] inputs runs the Hopper kernel's FP8 P @ V (``GLUON_FP8_PV``):
    its quantization then writes V as that product's operand (``fp8_v_codes``)."""
    return GLUON_FP8_PV and v.dtype == torch.bfloat16 and q.shape[-1] == 128 and _fp8_pv_on()(q.device)


def _fp8_pv_device(device: torch.device) -> bool:
    """The device half of ``gluon_fp8_pv_runs`` (it asks CUDA and imports)."""
    return gluon_int8qk_available(device)


_FP8_PV_DEVICE_CONSTANT: Optional[Callable[[torch.device], bool]] = None


def _fp8_pv_on() -> Callable[[torch.device], bool]:
    """``_fp8_pv_device`` as one constant per compiled graph (``torch.compiler.assume_constant_result``), made on
    first use: the decorator imports torch._dynamo, 2.4 s of every process that imports this module, which ranks
    that never compile should not pay. ``int8qk_attention`` makes it eagerly, before any graph is traced."""
    global _FP8_PV_DEVICE_CONSTANT
    if _FP8_PV_DEVICE_CONSTANT is None:
        _FP8_PV_DEVICE_CONSTANT = torch.compiler.assume_constant_result(_fp8_pv_device)
    return _FP8_PV_DEVICE_CONSTANT


def _gluon_call(q, q_scale, k, k_scale, v, sm_scale: float, v_fp8: bool,
                v_scale: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The Gluon kernel's output, or None (after one sentence, and for the rest of the process) when this
    Triton cannot compile it: the kernel is written against Triton 3.6's Gluon API, which is experimental."""
    global GLUON_INT8QK
    try:
        return _gluon_kernels().int8qk_gluon(q, q_scale, k, k_scale, v, sm_scale, v_fp8=v_fp8, v_scale=v_scale)
    except gluon_compile_errors() as failure:
        GLUON_INT8QK = False
        print(f"ditrun: the Gluon INT8-QK kernel does not compile with Triton here ({type(failure).__name__}); "
              "INT8-QK attention runs on the Triton kernel.", flush=True)
        return None


@torch.library.custom_op("ditrun::int8qk_attention", mutates_args=())
def int8qk_attention_op(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                        v: torch.Tensor, sm_scale: float, v_fp8: bool = False,
                        v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of quantized [B, H, S, D] operands -> [B, H, S, D] in V's dtype: INT8 q, k with per-token
    fp32 scales [B, H, S], or E4M3 q, k with one scale per head [B, H] (``fp8`` attention). On Hopper the INT8
    case runs the Gluon kernel (``GLUON_INT8QK``), elsewhere on GPUs the Triton kernel.

    ``v_fp8``: V holds FP8-exact values (``quantize_v(v, "fp8")``); the Gluon kernel (``GLUON_FP8_PV``, BF16 V)
    and, with ``FP8_PV_DOT``, the Triton kernel then run P @ V as an FP8 dot (2^8 P rounded to E4M3 too). The
    reference off GPUs ignores it. ``v_scale``: v holds ``fp8_v_codes``' codes, made for the Gluon kernel's FP8
    P @ V (where that cannot run, the other paths take ``fp8_v_values`` of them); the output is then BF16."""
    gpu = triton_available(q.device)
    if gpu:
        q, k, q_scale, k_scale, v = (t.contiguous() for t in (q, k, q_scale, k_scale, v))
        if _runs_gluon(q, k, q_scale, k_scale, v):
            out = _gluon_call(q, q_scale, k, k_scale, v, sm_scale,
                              GLUON_FP8_PV and v_fp8 and v.dtype == torch.bfloat16, v_scale)
            if out is not None:
                return out
    if v_scale is not None:  # codes for the Gluon kernel, which did not run them: the other paths take the values
        v = fp8_v_values(v, v_scale, q.shape)
    if gpu:
        from ditrun.kernels.attention_triton import flash_attention

        fp8_dot = FP8_PV_DOT and v_fp8 and fp8_dtype() == torch.float8_e4m3fn
        return flash_attention(q, q_scale, k, k_scale, v, sm_scale, fp8_dot)
    if q.dtype != torch.int8:
        return fp8_reference(q, q_scale, k, k_scale, v, sm_scale)
    return int8qk_reference(Int8QK(q, q_scale, k, k_scale, v), sm_scale)


@int8qk_attention_op.register_fake
def _(q, q_scale, k, k_scale, v, sm_scale, v_fp8=False, v_scale=None):
    return torch.empty_like(v) if v_scale is None else q.new_empty(q.shape, dtype=torch.bfloat16)


def fp8_reference(q8, q_scale, k8, k_scale, v, sm_scale: float) -> torch.Tensor:
    """Attention of E4M3 q, k with per-head scales [B, H]: SDPA on the dequantized values, in V's dtype."""
    q, k = (t.float() * s[..., None, None] for t, s in ((q8, q_scale), (k8, k_scale)))
    return F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, scale=sm_scale)


# ---------------------------------------------------------------------------------------------
# The registry


def _triton_unavailable(device: torch.device) -> Optional[str]:
    if not triton_available(device):
        return "the flash-attention Triton kernel needs a GPU with Triton"
    return None


def _fp8_triton_unavailable(device: torch.device) -> Optional[str]:
    if not (_has_rowwise_fp8(device) and fp8_dtype() == torch.float8_e4m3fn):
        return "FP8 Q.K^T needs OCP E4M3 tensor cores (NVIDIA sm_89+, AMD gfx950)"
    return _triton_unavailable(device)


@dataclass(frozen=True)
class AttentionKernel:
    """One ``precision.attention`` choice: how to make the ``attention(q, k, v)`` function."""

    name: str
    doc: str
    make: Callable[[bool], AttentionFn]
    """fast -> the function (fast: the custom op / fused kernel; else the torch reference)."""
    quantized: bool = True
    unavailable: Callable[[torch.device], Optional[str]] = _triton_unavailable
    """device -> None where the fast implementation runs, else why not (a clause for error messages)."""
    backend: str | Callable[[torch.device], str] = "triton"
    """What the fast implementation runs on, for records (or device -> that)."""

    def backend_on(self, device: torch.device) -> str:
        return self.backend(device) if callable(self.backend) else self.backend


def int8qk_attention(v_format: str, fast: bool) -> AttentionFn:
    quantize = CompiledOnGpu(operand_tensors) if fast else operand_tensors
    if fast and v_format == "fp8":
        _fp8_pv_on()  # made here, eagerly: the function below may be traced

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [B, S, H, D] -> [B, S, H, D]
        codes = fast and v_format == "fp8" and gluon_fp8_pv_runs(q, v)
        ops = Int8QK(*quantize(q, k, v, v_format, codes))
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
        if fast:
            out = int8qk_attention_op(ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, sm_scale, v_format == "fp8",
                                      ops.v_scale)
        else:
            out = int8qk_reference(ops, sm_scale)
        return out.transpose(1, 2)

    return attention


def fp8_operands(q, k, v) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, S, H, D] -> E4M3 q, k [B, H, S, D] with scales [B, H], and V (FP8-exact values) [B, H, S, D].
    K is smoothed in fp32 (not rounded back to its dtype first): compiled and eager code then quantize
    the same values (inductor would skip an intermediate BF16 rounding that eager code makes)."""
    q8, q_scale = quantize_fp8_heads(q.transpose(1, 2))
    k = k.float()
    k8, k_scale = quantize_fp8_heads((k - k.mean(dim=1, keepdim=True)).transpose(1, 2))
    return q8, q_scale, k8, k_scale, quantize_v(v.transpose(1, 2), "fp8").contiguous()


def fp8_attention(fast: bool) -> AttentionFn:
    """Q, smoothed K and V quantized to FP8 E4M3 with one power-of-two scale per head (exact in BF16); the
    fast path runs Q.K^T as an FP8 tensor-core dot in the flash kernel, the reference SDPA on the
    dequantized values."""

    quantize = CompiledOnGpu(fp8_operands) if fast else fp8_operands

    def attention(q, k, v):
        # q, k, v: [B, S, H, D] -> [B, S, H, D]
        q8, q_scale, k8, k_scale, v8 = quantize(q, k, v)
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
        if fast:
            out = int8qk_attention_op(q8, q_scale, k8, k_scale, v8, sm_scale, True)
        else:
            out = fp8_reference(q8, q_scale, k8, k_scale, v8, sm_scale)
        return out.transpose(1, 2).to(v.dtype)

    return attention


def _int8qk_backend(device: torch.device) -> str:
    return "gluon" if gluon_int8qk_available(device) else "triton"


ATTENTION_KERNELS: Registry[AttentionKernel] = Registry("attention kernel")
ATTENTION_KERNELS.register("bf16", AttentionKernel(
    "bf16", "PyTorch SDPA in the compute dtype (not quantized)", lambda fast: sdpa_attention, quantized=False))
ATTENTION_KERNELS.register("fp8", AttentionKernel(
    "fp8", "Q, smoothed K and V in FP8 E4M3 (a power-of-two scale per head), FP8 Q.K^T, fp32 softmax",
    fp8_attention, unavailable=_fp8_triton_unavailable))
ATTENTION_KERNELS.register("fp8_pv", AttentionKernel(
    "fp8_pv", "Q, smoothed K, V and P in FP8 E4M3 (a power-of-two scale per tensor), FP8 Q.K^T and P.V, fp32 "
    "softmax: the vendors' fused FP8 attention (cuDNN, AITER)", fp8_sdpa.fp8_pv_attention,
    unavailable=fp8_sdpa.unavailable, backend=fp8_sdpa.BACKEND))
for _v in V_FORMATS:
    _name = "int8qk" if _v == "bf16" else f"int8qk_{_v}v"
    ATTENTION_KERNELS.register(_name, AttentionKernel(
        _name, f"INT8 Q and K (smoothed K, a scale per token), fp32 softmax, V in {_v.upper()}",
        lambda fast, _v=_v: int8qk_attention(_v, fast), backend=_int8qk_backend))


def fast_attention_available(kernel: AttentionKernel, device: torch.device) -> Optional[str]:
    """None when ``kernel`` has a fast implementation on ``device``, else why not."""
    return kernel.unavailable(device) if kernel.quantized else None
