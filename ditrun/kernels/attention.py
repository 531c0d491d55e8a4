"""Attention kernels, by name: PyTorch SDPA, FP8 Q/K/V/P (``fp8_pv``, ``fp8_sdpa.py``), and INT8-QK attention with V
in BF16/FP8/MXFP6.

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

``int8qk_emulation`` is the torch emulation (runs anywhere, in query chunks so that memory
stays O(S * chunk)); on GPUs the same quantized operands go to a flash-attention kernel behind
``ditrun::int8qk_attention`` (a ``torch.library.custom_op`` with a fake implementation, so
``torch.compile`` traces through it): the Hopper Gluon kernel (``attention_gluon.py``; with FP8 V its P @ V
is an FP8 product) or the Triton kernel (``attention_triton.py``), the one chosen once when the model is
built (``choose_implementation``). The op runs the emulation's math off GPUs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ditrun.kernels import formats, fp8_sdpa
from ditrun.kernels.linear import CompiledOnGpu, triton_available
from ditrun.kernels.sdpa import AttentionFn, sdpa_attention
from ditrun.kernels.token_statistics import token_mean, token_sum
from ditrun.registry import Registry

V_FORMATS = ("bf16", "fp8", "mxfp6")


# ---------------------------------------------------------------------------------------------
# Quantizing the operands (shared by the emulation and the kernel)


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


def smooth_k(k: torch.Tensor, dim: int, mean: Optional[torch.Tensor] = None) -> torch.Tensor:
    """K minus its mean over the tokens (``dim``): the scores of a query row move by one constant,
    which softmax ignores, and what is left to quantize is the part that differs between keys. The mean is
    ``token_statistics.token_mean`` of an fp64 sum, so that a rank holding part of the tokens can be given the
    whole sequence's (``mean``, broadcastable to k, in k's dtype) and smooth its keys as one process does."""
    if mean is None:
        mean = token_mean(token_sum(k, dim, keepdim=True), k.shape[dim], k.dtype)
    return k - mean


@dataclass
class Int8QK:
    """The quantized operands of one attention call, in [B, H, S, D] layout."""

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: Optional[torch.Tensor] = None
    """With it, ``v`` holds FP8 V as the Gluon kernel's FP8 P @ V operand (``fp8_v_codes``), this its scale per head."""


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
    exponent = fp8_head_exponents(v)  # [B, H]
    values = formats.round_to_grid(torch.ldexp(v.float(), -exponent[..., None, None]), "fp8_e4m3")
    codes = gluon_key_order(values).to(torch.float8_e4m3fn)
    return codes, torch.ldexp(torch.ones_like(exponent), exponent).flatten()


def gluon_key_order(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] (values, or E4M3 codes as bytes) -> x^T [B * H * D, S rounded up to 32], the keys reordered
    within each 32 as the Gluon kernel's FP8 P @ V reads them (``attention_gluon.fp8_v_operand``), zeros past S."""
    b, h, s, d = x.shape
    padded = -(-s // 32) * 32
    x = F.pad(x, (0, 0, 0, padded - s)).view(b, h, padded // 32, 2, 2, 4, 2, d)
    # [B, H, S'/32, h, w, t, e, D] -> [B, H, D, S'/32, h, t, w, e]:
    # stored key 16h + 4t + 2w + e is key 16h + 8w + 2t + e
    return x.permute(0, 1, 7, 2, 3, 5, 4, 6).reshape(b * h * d, padded)


@torch.library.custom_op("ditrun::fp8_v_codes", mutates_args=())
def fp8_v_codes_op(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_v_codes`` of V [B, S, H, D] (the model's layout) by two Triton passes (``attention_triton.fp8_v_codes``:
    the heads' amax, then the codes). On one H200 at 20992 tokens, 24 heads, the torch statement compiled by
    inductor took 1.2 ms per call."""
    from ditrun.kernels.attention_triton import fp8_v_codes as triton_fp8_v_codes

    return triton_fp8_v_codes(v)


@fp8_v_codes_op.register_fake
def _(v):
    b, s, h, d = v.shape
    return (
        v.new_empty((b * h * d, (s + 31) // 32 * 32), dtype=torch.float8_e4m3fn),
        v.new_empty((b * h,), dtype=torch.float32),
    )


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
# The emulation


def int8qk_emulation(ops: Int8QK, sm_scale: float, chunk: int = 1024) -> torch.Tensor:
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
# The GPU kernels behind a custom op


@functools.cache
def _gluon_kernels():
    """The Gluon kernel module, or None where this Triton lacks the API it is written against."""
    try:
        from ditrun.kernels import attention_gluon
    except (ImportError, AttributeError):
        return None
    return attention_gluon


def gluon_compile_errors() -> tuple[type[Exception], ...]:
    """What a Triton whose Gluon API moved raises compiling the Gluon kernel."""
    from triton.compiler.errors import CompilationError

    return CompilationError, AttributeError, TypeError, ValueError, AssertionError


@functools.cache
def gluon_unavailable(device: torch.device, v_fp8: bool) -> Optional[str]:
    """None where the Hopper Gluon kernel runs on ``device`` (``v_fp8``: with its FP8 P @ V), else why not. Asked
    once per process, when the model is built: the kernel is compiled and run on one tile, so that a Triton whose
    experimental Gluon API moved is found there, not in the middle of a run."""
    if device.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(device) != (9, 0):
        return "needs an NVIDIA Hopper GPU (sm_90)"
    if _gluon_kernels() is None:
        return "needs Triton's Gluon API for Hopper"
    q = torch.zeros(1, 1, 128, 128, dtype=torch.int8, device=device)
    scale = torch.ones(1, 1, 128, device=device)
    v = torch.zeros(1, 1, 128, 128, dtype=torch.bfloat16, device=device)
    try:
        _gluon_kernels().int8qk_gluon(q, scale, q, scale, v, 1.0, v_fp8=v_fp8)
    except gluon_compile_errors() as failure:
        return f"does not compile with this Triton ({type(failure).__name__})"
    return None


def _fits_gluon(q, k, q_scale, k_scale, v) -> bool:
    """This call's operands fit the Gluon kernel's tiles: INT8 per-token Q/K, head dim 128, 16-byte aligned rows,
    at least one tile of query rows (smaller calls run the Triton kernel)."""
    b, h, s, d = q.shape
    return (
        q.dtype == torch.int8
        and d == 128
        and v.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
        and b * h * s >= 128
        and all(t.data_ptr() % 16 == 0 for t in (q, k, q_scale, k_scale, v))
    )


@torch.library.custom_op("ditrun::int8qk_attention", mutates_args=())
def int8qk_attention_op(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    implementation: str = "triton",
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of quantized [B, H, S, D] operands -> [B, H, S, D] in V's dtype: INT8 q, k with per-token
    fp32 scales [B, H, S]. ``implementation`` (chosen once, when the model is built): ``gluon`` (the Hopper
    kernel) or ``triton`` on GPUs; the torch emulation runs off GPUs whatever it says.

    ``v_scale``: v holds ``fp8_v_codes``' codes, the Gluon kernel's FP8 P @ V operand (2^8 P rounded to E4M3 too);
    the output is then BF16, and the Triton kernel and the emulation take ``fp8_v_values`` of them."""
    if q.is_cuda:
        q, k, q_scale, k_scale, v = (t.contiguous() for t in (q, k, q_scale, k_scale, v))
        if implementation == "gluon" and _fits_gluon(q, k, q_scale, k_scale, v):
            return _gluon_kernels().int8qk_gluon(q, q_scale, k, k_scale, v, sm_scale, v_scale=v_scale)
    if v_scale is not None:
        v = fp8_v_values(v, v_scale, q.shape)
    if triton_available(q.device):
        from ditrun.kernels.attention_triton import flash_attention

        return flash_attention(q, q_scale, k, k_scale, v, sm_scale)
    return int8qk_emulation(Int8QK(q, q_scale, k, k_scale, v), sm_scale)


@int8qk_attention_op.register_fake
def _(q, q_scale, k, k_scale, v, sm_scale, implementation="triton", v_scale=None):
    return torch.empty_like(v) if v_scale is None else q.new_empty(q.shape, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The registry


def _triton_unavailable(device: torch.device) -> Optional[str]:
    if not triton_available(device):
        return "the flash-attention Triton kernel needs a GPU with Triton"
    return None


EMULATION = "emulation"
"""The implementation name of every quantized kernel's exact emulation in torch (any device): what the fast kernels
are checked against and what runs where none does."""


@dataclass(frozen=True)
class AttentionKernel:
    """One ``precision.attention`` choice: how to make the ``attention(q, k, v)`` function."""

    name: str
    doc: str
    make: Callable[[str], AttentionFn]
    """implementation (``implementation``'s answer, or ``EMULATION``) -> the function."""
    quantized: bool = True
    unavailable: Callable[[torch.device], Optional[str]] = _triton_unavailable
    """device -> None where a fast implementation runs, else why not (a clause for error messages)."""
    implementation: Callable[[torch.device, int], str] = lambda device, head_dim: "triton"
    """(device, head dim) -> the fast implementation that runs there (asked once, where ``unavailable`` is None)."""


def int8qk_attention(v_format: str, implementation: str) -> AttentionFn:
    emulated = implementation == EMULATION
    quantize = operand_tensors if emulated else CompiledOnGpu(operand_tensors)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [B, S, H, D] -> [B, S, H, D]
        # The Gluon kernel's FP8 P @ V takes V as codes, written by the operand quantization.
        codes = implementation == "gluon" and v_format == "fp8" and v.dtype == torch.bfloat16
        return attend_int8qk(Int8QK(*quantize(q, k, v, v_format, codes)), implementation)

    return attention


def attend_int8qk(ops: Int8QK, implementation: str) -> torch.Tensor:
    """Attention of quantized [B, H, S, D] operands -> [B, S, H, D]: the torch emulation (``EMULATION``) or the
    GPU op. Also what a quantized exchange's receiver runs on the codes it received (``attention_payload.py``)."""
    sm_scale = 1.0 / math.sqrt(ops.q.shape[-1])
    if implementation == EMULATION:
        out = int8qk_emulation(ops, sm_scale)
    else:
        out = int8qk_attention_op(ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, sm_scale, implementation, ops.v_scale)
    return out.transpose(1, 2)


def _int8qk_implementation(v_format: str) -> Callable[[torch.device, int], str]:
    """The Hopper Gluon kernel where it runs (head dim 128, its trial compile passed), else the Triton kernel;
    a Gluon kernel that does not compile is said once."""

    def choose(device: torch.device, head_dim: int) -> str:
        if head_dim != 128 or device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
            return "triton"
        why = gluon_unavailable(device, v_format == "fp8")
        if why is not None:
            _say_once(
                f"ditrun: the Hopper INT8-QK attention kernel {why}; INT8-QK attention runs on the Triton kernel."
            )
            return "triton"
        return "gluon"

    return choose


@functools.cache
def _say_once(line: str) -> None:
    """Print ``line`` the first time it is asked for in this process (a process may build several models)."""
    print(line, flush=True)


ATTENTION_KERNELS: Registry[AttentionKernel] = Registry("attention kernel", "precision.attention")
ATTENTION_KERNELS.register(
    "bf16",
    AttentionKernel(
        "bf16",
        "PyTorch SDPA in the compute dtype (not quantized)",
        lambda implementation: sdpa_attention,
        quantized=False,
        implementation=lambda device, head_dim: "sdpa",
    ),
)
ATTENTION_KERNELS.register(
    "fp8_pv",
    AttentionKernel(
        "fp8_pv",
        "Q, smoothed K, V and P in FP8 E4M3 (a power-of-two scale per tensor), FP8 Q.K^T and P.V, fp32 "
        "softmax: the vendors' fused FP8 attention (cuDNN, AITER)",
        fp8_sdpa.fp8_pv_attention,
        unavailable=fp8_sdpa.unavailable,
        implementation=lambda device, head_dim: fp8_sdpa.BACKEND,
    ),
)
for _v in V_FORMATS:
    _name = "int8qk" if _v == "bf16" else f"int8qk_{_v}v"
    ATTENTION_KERNELS.register(
        _name,
        AttentionKernel(
            _name,
            f"INT8 Q and K (smoothed K, a scale per token), fp32 softmax, V in {_v.upper()}",
            lambda implementation, _v=_v: int8qk_attention(_v, implementation),
            implementation=_int8qk_implementation(_v),
        ),
    )


def fast_attention_available(kernel: AttentionKernel, device: torch.device) -> Optional[str]:
    """None when ``kernel`` has a fast implementation on ``device``, else why not."""
    return kernel.unavailable(device) if kernel.quantized else None


def choose_implementation(kernel: AttentionKernel, device: torch.device, head_dim: int, fast: bool) -> str:
    """The implementation a model built for ``device`` runs, decided once: the kernel's fast one where it runs and
    ``fast`` allows it, else ``EMULATION`` (unquantized SDPA is always ``sdpa``)."""
    if not kernel.quantized:
        return kernel.implementation(device, head_dim)
    if not fast or fast_attention_available(kernel, device) is not None:
        return EMULATION
    return kernel.implementation(device, head_dim)
