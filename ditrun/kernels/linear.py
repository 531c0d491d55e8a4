"""Quantized linears: the formats a linear can run in, the backends that run them, and the module.

Weights are converted once, when the model is built (``QuantizedLinear.__init__``); activations
are quantized on every call, on GPUs with Triton in one kernel (``kernels/quantize_triton.py``). Which backend
runs a call is the dispatch table's choice (``kernels/tuning.py``); every backend computes the same quantized
product as ``emulation`` (the reference: dequantize, then an ordinary matmul in the compute dtype), up to the GEMM's
accumulation order, and is tested against it.

Backends, by device:

* ``emulation`` — everywhere (CPU included); exact quantization, the matmul in the compute dtype;
* ``fp8_rowwise`` — FP8 E4M3 with one fp32 scale per token and per output channel on
  ``torch._scaled_mm`` (Hopper sm90+/Ada sm89; MI300+ on ROCm);
* ``mx_repack_fp8`` — MX formats on Hopper, which has no MX hardware: each row's blocks are
  re-expressed exactly as FP8 E4M3 values under one power-of-two scale per row, then the FP8
  GEMM runs. It is exact unless a row's block exponents spread further than E4M3's range allows;
  such rows are counted (``inexact_rows``) and reported;
* ``mx_scaled_mm`` — MXFP8/MXFP4 on ``torch._scaled_mm`` with E8M0 block scales, on gfx950
  (MI355X) and Blackwell. Not yet run on either: see docs/PRECISION.md#not-run-yet. MXFP6 has no library
  GEMM there;
* ``mx_triton`` — MXFP8, MXFP6 and MXFP4 on ditrun's own Triton GEMM (``kernels/mx_gemm_triton.py``: the scaled
  MFMA, MXFP6 carried as E4M3) on gfx950, its activations quantized by one Triton kernel, and an MLP whose two
  linears both run it fused (``quantized_mlp``). Unrun there: its gfx950 builds are checked in CI
  (``kernels/builds.py``), its numerics in Triton's CPU interpreter;
* ``aiter_fp8`` — FP8 through AITER's CK GEMM on ROCm when AITER is installed (unrun; tuned in only).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ditrun.kernels import formats
from ditrun.registry import Registry


@dataclass(frozen=True)
class LinearFormat:
    """How a linear's weights and input activations are quantized."""

    name: str
    element: Optional[str]
    """Element format (``kernels/formats.py``); None: not quantized (the compute dtype)."""
    block: Optional[int]
    """MX block size along K (one E8M0 scale per block); None: one fp32 scale per row (FP8)."""
    doc: str

    @property
    def quantized(self) -> bool:
        return self.element is not None

    def fake_quantize(self, x: torch.Tensor, scale_mode: str) -> torch.Tensor:
        """The exact reference: x quantized along its last dim and dequantized, in x's dtype."""
        if not self.quantized:
            return x
        if self.block is None:
            return formats.fake_quantize_fp8(x, self.element, rowwise=True)
        return formats.fake_quantize(x, self.element, self.block, scale_mode)


LINEAR_FORMATS: Registry[LinearFormat] = Registry("linear format", "precision.mlp")
for _format in (
    LinearFormat("bf16", None, None, "not quantized: the model's compute dtype (bf16 on GPUs, fp32 on CPUs)"),
    LinearFormat("fp8", "fp8_e4m3", None, "FP8 E4M3, one fp32 scale per output channel and per token"),
    LinearFormat("mxfp8", "fp8_e4m3", 32, "MXFP8: E4M3 elements, one E8M0 scale per 32 along K"),
    LinearFormat("mxfp6", "fp6_e2m3", 32, "MXFP6: E2M3 elements, one E8M0 scale per 32 along K"),
    LinearFormat("mxfp6_e3m2", "fp6_e3m2", 32, "MXFP6 with E3M2 elements (more range, less precision)"),
    LinearFormat("mxfp4", "fp4_e2m1", 32, "MXFP4: E2M1 elements, one E8M0 scale per 32 along K"),
):
    LINEAR_FORMATS.register(_format.name, _format)


# ---------------------------------------------------------------------------------------------
# Fast quantizers (plain tensor arithmetic: fused by torch.compile, no table lookups)


def fp8_dtype() -> torch.dtype:
    """The E4M3 type of this GPU: MI300 (gfx942) has the FNUZ variant (max 240); everything else OCP "fn"."""
    if torch.version.hip and torch.cuda.is_available() and "gfx94" in torch.cuda.get_device_properties(0).gcnArchName:
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def quantize_rowwise_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (fp8 [R, K], fp32 scale [R, 1]) with x ~ fp8 * scale."""
    top = torch.finfo(dtype).max
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # A tensor divisor: PyTorch's CUDA kernels multiply by the reciprocal of a Python-number divisor,
    # which can differ from the division in the last bit (and from the Triton kernel's, which divides).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, top), torch.ones_like(amax))
    return (x.float() / scale).clamp(-top, top).to(dtype), scale


class CompiledOnGpu:
    """``fn`` through ``torch.compile`` on GPU tensors (one fused kernel instead of several passes over
    the activation), eager on the CPU; where compiling fails it says why once and stays eager."""

    def __init__(self, fn):
        self.fn, self.compiled = fn, None

    def __call__(self, *args):
        if not args[0].is_cuda or self.compiled is self.fn or torch.compiler.is_compiling():
            return self.fn(*args)  # inside a compiled region, inductor fuses fn with what surrounds it
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure: the eager function is exact too
            print(
                f"ditrun: torch.compile of {self.fn.__name__} failed ({type(err).__name__}: {err}); running eager.",
                flush=True,
            )
            self.compiled = self.fn
            return self.fn(*args)


def repack_headroom(element: formats.ElementFormat) -> int:
    """Binades by which a block's largest element can grow and still fit FP8 E4M3 (max 448)."""
    return int(math.floor(math.log2(448.0 / element.max_value)))


def mx_repack_fp8(x: torch.Tensor, element_name: str, block: int, scale_mode: str):
    """MX-quantize x [R, K] and re-express each row as E4M3 values under one power-of-two scale.

    Returns (fp8 [R, K], fp32 row scale [R, 1], inexact rows: a 0-dim int64 tensor). A block b of
    a row with top block exponent e_max holds q * 2^e_b = (q * 2^(e_b - e_row)) * 2^e_row, with
    e_row = e_max - headroom; the E4M3 value is exact unless it falls below E4M3's subnormals.
    """
    element = formats.element_format(element_name)
    blocks = x.float().unflatten(-1, (-1, block))  # [R, K/block, block]
    amax = blocks.abs().amax(dim=-1)
    exponent = formats.shared_exponents(amax, element, scale_mode)  # [R, K/block]
    grid = formats.round_to_grid(torch.ldexp(blocks, -exponent[..., None].float()), element)
    row_exponent = exponent.amax(dim=-1, keepdim=True) - repack_headroom(element)  # [R, 1]
    shifted = torch.ldexp(grid, (exponent - row_exponent)[..., None].float()).flatten(-2)
    fp8 = shifted.to(torch.float8_e4m3fn)
    inexact = (fp8.float() != shifted).any(dim=-1).sum()
    return fp8, torch.ldexp(torch.ones_like(row_exponent, dtype=torch.float32), row_exponent.float()), inexact


def triton_available(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device`` (a GPU, with Triton importable)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def mx_kernel_for(x: torch.Tensor) -> bool:
    """Whether the MX repack of GPU tensor ``x`` runs its Triton kernel (``ditrun::mx_repack_fp8``), in compiled
    regions too, as an opaque node: inductor's code for the per-block exponents and grid rounding costs more than
    writing the activation once and reading it back (measured on the H200; the kernel's GEMM times:
    docs/PERFORMANCE.md#gemms-per-format)."""
    return x.is_cuda and TRITON


def eager_triton(device: torch.device) -> bool:
    """Whether an activation quantizer should be its Triton kernel: on GPUs, outside compiled regions.

    Inside one (``model.compile``), the torch arithmetic is traced instead, and inductor fuses it into
    the kernel that produces the activation (norm + modulation, GELU, ...): the activation is then
    never read back from memory just to be quantized, which no separate kernel can match.
    """
    return not torch.compiler.is_compiling() and triton_available(device)


# The Triton activation quantizers (one kernel each, ``kernels/quantize_triton.py``) as custom ops, so a
# torch.compile'd quantizer that applies an activation first traces through them.
@torch.library.custom_op("ditrun::rowwise_fp8", mutates_args=())
def rowwise_fp8_op(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from ditrun.kernels import quantize_triton

    return quantize_triton.rowwise_fp8(x.contiguous(), dtype)


@rowwise_fp8_op.register_fake
def _(x, dtype):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("ditrun::rowwise_fp8_joined", mutates_args=())
def rowwise_fp8_joined_op(
    x: torch.Tensor, prefix: Optional[torch.Tensor], activation: Optional[str], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """[prefix | activation(x)] row-wise to FP8 in one kernel (``quantize_triton.rowwise_fp8``): a compiled block's
    down projection input under ``precision.quantizer=kernel``, never written in the compute dtype."""
    from ditrun.kernels import quantize_triton

    x = x if x.stride(-1) == 1 else x.contiguous()
    prefix = prefix if prefix is None or prefix.stride(-1) == 1 else prefix.contiguous()
    return quantize_triton.rowwise_fp8(x, dtype, activation=activation, prefix=prefix)


@rowwise_fp8_joined_op.register_fake
def _(x, prefix, activation, dtype):
    width = x.shape[1] + (0 if prefix is None else prefix.shape[1])
    return x.new_empty((x.shape[0], width), dtype=dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32)


QUANTIZERS = {
    "compiled": "in a compiled block, each activation's quantization is torch arithmetic traced into the block's "
    "graph, which Inductor fuses into the kernel that makes the activation",
    "kernel": "in a compiled block, an FP8 down projection's input [attention output | activation(hidden)] is "
    "quantized by ditrun's Triton kernel (the activation, each row's amax and the codes in one kernel); the rest "
    "as compiled",
}
"""``precision.quantizer``: how a compiled block quantizes the FP8 linears' activations."""


@torch.library.custom_op("ditrun::mx_repack_fp8", mutates_args=())
def mx_repack_fp8_op(
    x: torch.Tensor, element_name: str, block: int, scale_mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ditrun.kernels import quantize_triton

    headroom = repack_headroom(formats.element_format(element_name))
    return quantize_triton.mx_repack_fp8(x.contiguous(), element_name, block, scale_mode, headroom)


@mx_repack_fp8_op.register_fake
def _(x, element_name, block, scale_mode):
    return (
        x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
        x.new_empty((x.shape[0], 1), dtype=torch.float32),
        x.new_empty((), dtype=torch.int64),
    )


@torch.library.custom_op("ditrun::mx_repack_fp8_counted", mutates_args=("count",))
def mx_repack_fp8_counted_op(
    x: torch.Tensor, element_name: str, block: int, scale_mode: str, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mx_repack_fp8_op`` that adds its inexact rows to ``count`` (a running 0-dim int64 count on x's device) in the
    kernel: no count to allocate, sum or add per call."""
    from ditrun.kernels import quantize_triton

    headroom = repack_headroom(formats.element_format(element_name))
    fp8, scale, _ = quantize_triton.mx_repack_fp8(
        x.contiguous(), element_name, block, scale_mode, headroom, count=count
    )
    return fp8, scale


@mx_repack_fp8_counted_op.register_fake
def _(x, element_name, block, scale_mode, count):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32)


TRITON = importlib.util.find_spec("triton") is not None
"""Whether Triton is installed (a constant, so compiled regions read it without tracing an import)."""


def joined(prefix: Optional[torch.Tensor], x: torch.Tensor, activation: Optional[Callable]) -> torch.Tensor:
    """A linear's input [prefix | activation(x)] along the last dim."""
    x = x if activation is None else activation(x)
    return x if prefix is None else torch.cat([prefix, x], dim=-1)


# ---------------------------------------------------------------------------------------------
# Backends


class LinearBackend(Protocol):
    name: str

    def unavailable(self, fmt: LinearFormat, device: torch.device) -> Optional[str]:
        """None when this backend runs ``fmt`` on ``device``, else why not (one phrase)."""

    def prepare(self, weight: torch.Tensor, fmt: LinearFormat, scale_mode: str) -> dict[str, torch.Tensor]:
        """The weight [N, K] as this backend keeps it (done once, at load)."""

    @staticmethod
    def quantize(x: torch.Tensor, fmt: LinearFormat, scale_mode: str) -> tuple[torch.Tensor, ...]:
        """x [M, K] -> the GEMM's activation operand (pure: compiled with the activation before it, on GPUs)."""

    def gemm(self, operand: tuple, weights: dict, fmt: LinearFormat, out_dtype: torch.dtype) -> torch.Tensor:
        """The operand times the prepared weight -> [M, N] in ``out_dtype``, bias not included."""


class Emulation:
    """Dequantized weights, exactly fake-quantized activations, an ordinary matmul: the reference."""

    name = "emulation"

    def unavailable(self, fmt, device):
        return None

    def prepare(self, weight, fmt, scale_mode):
        return {"weight": fmt.fake_quantize(weight, scale_mode)}

    @staticmethod
    def quantize(x, fmt, scale_mode):
        return (fmt.fake_quantize(x, scale_mode),)

    def gemm(self, operand, weights, fmt, out_dtype):
        return F.linear(operand[0], weights["weight"]).to(out_dtype)


def _has_rowwise_fp8(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return "gfx94" in arch or "gfx95" in arch
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm(a8, b8, scale_a, scale_b, out_dtype, fast_accum: bool = False, bias=None):
    # a8: [M, K] row-major, b8: [N, K] row-major (so b8.t() is the column-major [K, N] it wants);
    # scale_a: [M, 1], scale_b: [N, 1] -> [1, N]. K and N must be multiples of 16.
    # Row-wise scaled FP8 GEMMs on GPUs write bf16 only: an fp32 model gets its output cast. A bias of the GEMM's
    # dtype is added in its epilogue, to the fp32 accumulator (one rounding, and no pass over the output).
    gemm_dtype = torch.bfloat16 if a8.is_cuda and out_dtype == torch.float32 else out_dtype
    inside = bias if bias is not None and bias.dtype == gemm_dtype else None
    out = torch._scaled_mm(
        a8, b8.t(), scale_a=scale_a, scale_b=scale_b.t(), bias=inside, out_dtype=gemm_dtype, use_fast_accum=fast_accum
    ).to(out_dtype)
    return out if bias is None or inside is not None else out + bias


class Fp8Rowwise:
    """FP8 E4M3 with per-token and per-channel fp32 scales on ``torch._scaled_mm``."""

    name = "fp8_rowwise"

    def unavailable(self, fmt, device):
        if fmt.name != "fp8":
            return "runs fp8 only"
        return None if _has_rowwise_fp8(device) else "needs torch._scaled_mm rowwise FP8 (sm89+, MI300+)"

    def prepare(self, weight, fmt, scale_mode):
        w8, scale = quantize_rowwise_fp8(weight, fp8_dtype())
        return {"w8": w8, "scale": scale}

    triton_quantizer = True
    """Its activation quantizer is one Triton kernel on GPUs with Triton (nothing to compile around it)."""

    @staticmethod
    def quantize(x, fmt, scale_mode):
        # Inside compiled regions the torch arithmetic is traced: inductor fuses it into the kernel that
        # produces the activation (norm + modulation, GELU), which measured faster than the Triton kernel.
        if x.is_cuda and TRITON and not torch.compiler.is_compiling():
            return rowwise_fp8_op(x, fp8_dtype())
        return quantize_rowwise_fp8(x, fp8_dtype())

    adds_bias = not torch.version.hip
    """Its ``gemm`` takes the bias (added in the GEMM's epilogue): on CUDA, where it ran; ROCm's row-wise
    ``_scaled_mm`` with a bias has not run here, so there the bias is added after the GEMM."""

    def gemm(self, operand, weights, fmt, out_dtype, bias=None):
        x8, x_scale = operand
        return _scaled_mm(x8, weights["w8"], x_scale, weights["scale"], out_dtype, bias=bias)


class Fp8RowwiseFastAccum(Fp8Rowwise):
    """``fp8_rowwise`` with Hopper's fast FP8 accumulation (``use_fast_accum``): the tensor cores' partial
    sums are promoted to fp32 less often, which is faster (torchao's inference default) and less exact.
    After ``fp8_rowwise`` in the preference: it runs where ``ditrun tune`` measured it faster and within
    tolerance of the emulation, or where ``precision.backend`` names it."""

    name = "fp8_rowwise_fast"

    def unavailable(self, fmt, device):
        why = super().unavailable(fmt, device)
        if why is None and torch.version.hip:
            return "is CUDA's fast-accumulation mode (ROCm's FP8 GEMMs accumulate in fp32)"
        return why

    def gemm(self, operand, weights, fmt, out_dtype, bias=None):
        x8, x_scale = operand
        return _scaled_mm(x8, weights["w8"], x_scale, weights["scale"], out_dtype, fast_accum=True, bias=bias)


class MxRepackFp8:
    """MX formats as an exact repack to FP8 with one power-of-two scale per row (Hopper)."""

    name = "mx_repack_fp8"

    def __init__(self):
        self.inexact_rows = {"weight": 0, "activation": None}
        """Rows whose repack was inexact: weights counted at load; activations summed on the device."""

    def unavailable(self, fmt, device):
        if fmt.block is None or fmt.element == "fp8_e5m2":
            return "runs MX formats with E4M3/FP6/FP4 elements only"
        if torch.version.hip:
            return "is for GPUs without MX hardware on CUDA (use mx_scaled_mm on gfx950)"
        return None if _has_rowwise_fp8(device) else "needs torch._scaled_mm rowwise FP8 (sm89+)"

    def prepare(self, weight, fmt, scale_mode):
        w8, scale, inexact = mx_repack_fp8(weight, fmt.element, fmt.block, scale_mode)
        self.inexact_rows["weight"] += int(inexact)
        if self.inexact_rows["activation"] is None:  # on the device, added to in place: graph replays add too
            self.inexact_rows["activation"] = torch.zeros((), dtype=torch.int64, device=weight.device)
        return {"w8": w8, "scale": scale}

    triton_quantizer = True

    @staticmethod
    def quantize(x, fmt, scale_mode):
        if mx_kernel_for(x):
            return mx_repack_fp8_op(x, fmt.element, fmt.block, scale_mode)
        return mx_repack_fp8(x, fmt.element, fmt.block, scale_mode)

    def quantize_counted(self, x, fmt, scale_mode):
        """``quantize`` for eager calls on GPUs with Triton: the kernel adds the inexact rows to this backend's count
        itself (the operand's count is None)."""
        if self.inexact_rows["activation"].device != x.device:  # prepared on another device, then moved
            self.inexact_rows["activation"] = self.inexact_rows["activation"].to(x.device)
        return (*mx_repack_fp8_counted_op(x, fmt.element, fmt.block, scale_mode, self.inexact_rows["activation"]), None)

    def gemm(self, operand, weights, fmt, out_dtype):
        x8, x_scale, inexact = operand
        if inexact is not None:
            self.inexact_rows["activation"].add_(inexact)  # no host sync
        return _scaled_mm(x8, weights["w8"], x_scale, weights["scale"], out_dtype)


class MxScaledMm:
    """MXFP8 / MXFP4 on ``torch._scaled_mm`` with E8M0 block scales (gfx950, Blackwell). Unrun: guarded."""

    name = "mx_scaled_mm"
    ELEMENTS = {"fp8_e4m3": "float8_e4m3fn", "fp4_e2m1": "float4_e2m1fn_x2"}

    def unavailable(self, fmt, device):
        if fmt.block != 32 or fmt.element not in self.ELEMENTS:
            return "runs MXFP8 and MXFP4 only (no library MXFP6 GEMM)"
        if device.type != "cuda" or not hasattr(torch, "float8_e8m0fnu"):
            return "needs a GPU and torch.float8_e8m0fnu"
        if torch.version.hip:
            ok = "gfx950" in torch.cuda.get_device_properties(device).gcnArchName
            return None if ok else "needs gfx950 (MI350/MI355X)"
        return None if torch.cuda.get_device_capability(device) >= (10, 0) else "needs Blackwell (sm100) or gfx950"

    @staticmethod
    def quantize(x, fmt, scale_mode):
        codes, scales = formats.quantize_mx(x, fmt.element, fmt.block, scale_mode)
        return codes.view(getattr(torch, MxScaledMm.ELEMENTS[fmt.element])), scales.view(torch.float8_e8m0fnu)

    def prepare(self, weight, fmt, scale_mode):
        codes, scales = self.quantize(weight, fmt, scale_mode)
        return {"codes": codes, "scales": scales}

    def gemm(self, operand, weights, fmt, out_dtype):
        codes, scales = operand
        return torch._scaled_mm(
            codes, weights["codes"].t(), scale_a=scales, scale_b=weights["scales"], out_dtype=out_dtype
        )


class MxTriton:
    """MX formats on ditrun's own Triton GEMM (``kernels/mx_gemm_triton.py``), gfx950 only. Unrun: guarded."""

    name = "mx_triton"
    ELEMENTS = ("fp8_e4m3", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1")
    """The element formats the kernel reads (``mx_gemm_triton.ELEMENTS``)."""

    def unavailable(self, fmt, device):
        if fmt.block != 32 or fmt.element not in self.ELEMENTS:
            return "runs MXFP8, MXFP6 and MXFP4 (blocks of 32) only"
        if device.type != "cuda" or not torch.version.hip or not TRITON:
            return "needs ROCm and Triton on gfx950 (MI350/MI355X)"
        ok = "gfx950" in torch.cuda.get_device_properties(device).gcnArchName
        return None if ok else "needs gfx950 (MI350/MI355X): the scaled MFMA"

    triton_quantizer = True
    """Its activation quantizer is one Triton kernel (``mx_gemm_triton.mx_quantize``), opaque to torch.compile."""

    @staticmethod
    def quantize(x, fmt, scale_mode):
        return mx_quantize_op(x, fmt.element, scale_mode)  # packed codes, E8M0 scales: formats.quantize_mx's

    def prepare(self, weight, fmt, scale_mode):
        codes, scales = formats.quantize_mx(weight, fmt.element, fmt.block, scale_mode)  # once, on any device
        return {"codes": codes, "scales": scales}

    def gemm(self, operand, weights, fmt, out_dtype):
        from ditrun.kernels.mx_gemm_triton import mx_gemm

        return mx_gemm(*operand, weights["codes"], weights["scales"], fmt.element, out_dtype)


# ditrun's MX kernels as custom ops: opaque nodes in compiled regions (no Triton launch for dynamo to trace).
@torch.library.custom_op("ditrun::mx_quantize", mutates_args=())
def mx_quantize_op(x: torch.Tensor, element: str, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    from ditrun.kernels.mx_gemm_triton import mx_quantize

    return mx_quantize(x.contiguous(), element, scale_mode)


@mx_quantize_op.register_fake
def _(x, element, scale_mode):
    bits = formats.element_format(element).bits
    return x.new_empty((x.shape[0], x.shape[1] * bits // 8), dtype=torch.uint8), x.new_empty(
        (x.shape[0], x.shape[1] // 32), dtype=torch.uint8
    )


@torch.library.custom_op("ditrun::mx_mlp", mutates_args=())
def mx_mlp_op(
    x: torch.Tensor,
    prefix: Optional[torch.Tensor],
    up_codes: torch.Tensor,
    up_scales: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_codes: torch.Tensor,
    down_scales: torch.Tensor,
    element: str,
    activation: str,
    scale_mode: str,
) -> torch.Tensor:
    """down([prefix | activation(x up^T + up_bias)]) -> [M, N_down] in x's dtype, down's bias not included: x (and
    the prefix) quantized once each into one MX operand, whose hidden columns the up projection's epilogue writes
    (``mx_gemm_act``); the hidden state and the activation are never written in the compute dtype."""
    from ditrun.kernels import mx_gemm_triton as G

    m, hidden = x.shape[0], up_codes.shape[0] // (2 if activation == "swiglu" else 1)
    width = 0 if prefix is None else prefix.shape[1]
    bits = formats.element_format(element).bits
    codes = torch.empty(m, (width + hidden) * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, (width + hidden) // G.BLOCK, dtype=torch.uint8, device=x.device)
    split = width * bits // 8
    if prefix is not None:  # the attention output's blocks, first along K
        G.mx_quantize(prefix.contiguous(), element, scale_mode, codes[:, :split], scales[:, : width // G.BLOCK])
    x_codes, x_scales = G.mx_quantize(x.contiguous(), element, scale_mode)
    G.mx_gemm_act(x_codes, x_scales, up_codes, up_scales, up_bias, element, activation, scale_mode,
                  codes[:, split:], scales[:, width // G.BLOCK :])  # fmt: skip
    return G.mx_gemm(codes, scales, down_codes, down_scales, element, x.dtype)


@mx_mlp_op.register_fake
def _(x, prefix, up_codes, up_scales, up_bias, down_codes, down_scales, element, activation, scale_mode):
    return x.new_empty((x.shape[0], down_codes.shape[0]))


def aiter_function(name: str):
    """AITER's function ``name`` when AITER is installed and has it; None otherwise."""
    try:
        import aiter
    except ImportError:
        return None
    return getattr(aiter, name, None)


class AiterFp8:
    """FP8 per-token x per-channel through AITER's CK GEMM (ROCm). Unrun: used only where ``ditrun tune``
    measured it faster than ``fp8_rowwise`` and equal to the emulation (its API differs across versions)."""

    name = "aiter_fp8"

    def unavailable(self, fmt, device):
        if fmt.name != "fp8":
            return "runs fp8 only"
        if not torch.version.hip or device.type != "cuda":
            return "needs ROCm"
        return None if aiter_function("gemm_a8w8_CK") is not None else "needs AITER (aiter.gemm_a8w8_CK)"

    def prepare(self, weight, fmt, scale_mode):
        w8, scale = quantize_rowwise_fp8(weight, fp8_dtype())
        return {"w8": w8, "scale": scale}

    quantize = staticmethod(Fp8Rowwise.quantize)
    triton_quantizer = True

    def gemm(self, operand, weights, fmt, out_dtype):
        x8, x_scale = operand
        gemm_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
        out = aiter_function("gemm_a8w8_CK")(x8, weights["w8"], x_scale, weights["scale"], None, gemm_dtype)
        return out.to(out_dtype)


LINEAR_BACKENDS: Registry[Callable[[], LinearBackend]] = Registry("linear backend", "precision.backend")
for _backend in (Emulation, Fp8Rowwise, Fp8RowwiseFastAccum, MxRepackFp8, MxScaledMm, MxTriton, AiterFp8):
    LINEAR_BACKENDS.register(_backend.name, _backend)
# Order of preference where nothing was tuned: the most specific hardware path first (on gfx950 the library's MX GEMM,
# then ditrun's, which alone runs MXFP6); AITER's API is not pinned, so it comes after torch's own GEMM and runs
# first only where tuning chose it.
DEFAULT_PREFERENCE = (
    "mx_scaled_mm",
    "mx_triton",
    "mx_repack_fp8",
    "fp8_rowwise",
    "fp8_rowwise_fast",
    "aiter_fp8",
    "emulation",
)


def fast_backends(fmt: LinearFormat, device: torch.device) -> list[str]:
    """Backends other than emulation that run ``fmt`` on ``device``, most preferred first."""
    return [
        name
        for name in DEFAULT_PREFERENCE
        if name != "emulation" and LINEAR_BACKENDS.get(name, "backend")().unavailable(fmt, device) is None
    ]


# ---------------------------------------------------------------------------------------------
# The module


@functools.cache
def shared_quantizer(backend: type, fmt: LinearFormat, scale_mode: str, activation: Optional[Callable]) -> Callable:
    """The input quantizer of ``backend`` (after ``activation`` when given) as one compiled function.

    One per (backend, format, scale rule, activation), shared by every linear that uses it: torch.compile
    then compiles it once instead of once per module (and never hits its recompilation limit).
    """

    def quantize(x):
        return backend.quantize(x if activation is None else activation(x), fmt, scale_mode)

    quantize.__name__ = f"{backend.name}_{fmt.name}_quantize"
    if activation is None and getattr(backend, "triton_quantizer", False):
        # Already one kernel on GPUs: compiling would only add dynamo's guards to every call.
        return quantize
    return CompiledOnGpu(quantize)


class QuantizedLinear(nn.Module):
    """A linear (or several stacked ones) with quantized weights and per-call quantized activations.

    ``splits`` is set for stacked projections (Q, K, V and the gate read the same input): the
    input is quantized once and the output is returned split, one tensor per original linear.
    ``choose(M)`` names the backend for a call with M rows (the dispatch table's answer).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        fmt: LinearFormat,
        scale_mode: str,
        backends: dict[str, LinearBackend],
        choose: Callable[[int], str],
        splits: Optional[list[int]] = None,
        quantizer: str = "compiled",
    ):
        super().__init__()
        self.fmt, self.scale_mode, self.splits, self.choose = fmt, scale_mode, splits, choose
        self.quantizer = quantizer
        """``precision.quantizer`` (``QUANTIZERS``)."""
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.backends = backends
        self.weights = {name: backend.prepare(weight, fmt, scale_mode) for name, backend in backends.items()}
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, activation: Optional[Callable] = None, prefix: Optional[torch.Tensor] = None):
        """The linear of [prefix | activation(x)] (joined along the last dim). ``activation``: applied inside the
        quantizer, so that a quantized down projection takes the MLP's hidden state and its activation's
        output is quantized as it is made; ``prefix`` (the single block's attention output beside its MLP's)
        is joined there too, so that neither is written whole in the compute dtype."""
        # x: [..., K] (K before the activation) -> [..., N] (or a tuple split along N)
        rows = x.reshape(-1, x.shape[-1])  # made contiguous by the quantizer where it needs that
        prefix_rows = None if prefix is None else prefix.reshape(-1, prefix.shape[-1])
        out = self.matmul(rows, self.choose(rows.shape[0]), activation, prefix_rows, self.bias)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.splits is None else out.split(self.splits, dim=-1)

    def matmul(
        self,
        rows: torch.Tensor,
        name: str,
        activation: Optional[Callable] = None,
        prefix: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """[prefix | activation(rows)] [M, K] through backend ``name``, plus ``bias`` -> [M, N]."""
        backend = self.backends[name]
        if self.joined_kernel(backend, rows, activation, prefix):
            operand = rowwise_fp8_joined_op(rows, prefix, getattr(activation, "kernel_name", None), fp8_dtype())
            return self.product(backend, operand, name, rows.dtype, bias)
        rows = rows.contiguous()  # FP8 GEMMs want a row-major activation
        prefix = None if prefix is None else prefix.contiguous()
        if prefix is not None:
            rows, activation = joined(prefix, rows, activation), None
        if torch.compiler.is_compiling():  # traced into the region's graph: inductor fuses it with its producer
            operand = backend.quantize(rows if activation is None else activation(rows), self.fmt, self.scale_mode)
        elif activation is None and hasattr(backend, "quantize_counted") and eager_triton(rows.device):
            operand = backend.quantize_counted(rows, self.fmt, self.scale_mode)
        else:
            operand = shared_quantizer(type(backend), self.fmt, self.scale_mode, activation)(rows)
        return self.product(backend, operand, name, rows.dtype, bias)

    def product(self, backend, operand: tuple, name: str, dtype: torch.dtype, bias: Optional[torch.Tensor]):
        """The backend's GEMM of ``operand`` plus ``bias``: inside the GEMM where the backend ``adds_bias``."""
        if bias is not None and getattr(backend, "adds_bias", False):
            return backend.gemm(operand, self.weights[name], self.fmt, dtype, bias=bias)
        out = backend.gemm(operand, self.weights[name], self.fmt, dtype)
        return out if bias is None else out + bias

    def joined_kernel(self, backend, rows, activation: Optional[Callable], prefix: Optional[torch.Tensor]) -> bool:
        """Whether a compiled block's call quantizes [prefix | activation(rows)] with ``rowwise_fp8_joined_op``
        (``precision.quantizer=kernel``): an FP8 row-wise backend on a GPU with Triton, a down projection's input
        (an activation the kernel has, by its ``kernel_name``, or a prefix)."""
        if self.quantizer != "kernel" or not torch.compiler.is_compiling() or not isinstance(backend, Fp8Rowwise):
            return False
        if activation is None and prefix is None:
            return False  # a norm's output: Inductor fuses its quantization into the norm
        named = activation is None or getattr(activation, "kernel_name", None) is not None
        return named and rows.is_cuda and TRITON

    @classmethod
    def with_backend(cls, weight: torch.Tensor, fmt: LinearFormat, name: str, scale_mode: str = "rceil"):
        """A bias-free linear that always runs backend ``name`` (tests, benchmarks)."""
        return cls(weight, None, fmt, scale_mode, {name: LINEAR_BACKENDS.get(name, "backend")()}, lambda m: name)

    def runs_mx_triton(self, rows: int) -> bool:
        """Whether a call with ``rows`` rows runs ``mx_triton`` (the dispatch table's choice)."""
        return self.choose(rows) == MxTriton.name

    def _apply(self, fn, recurse=True):
        # Prepared weights are plain tensors in dicts (one per backend); move them with the module.
        self.weights = {b: {k: fn(v) for k, v in w.items()} for b, w in self.weights.items()}
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, format={self.fmt.name}, "
            f"backends={list(self.backends)}" + (f", splits={self.splits}" if self.splits else "")
        )


def quantized_mlp(
    up: nn.Module, down: nn.Module, x: torch.Tensor, activation: str, prefix: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """An MLP's down projection of [prefix | activation(up(x))] (``activation``: one of
    ``mx_gemm_triton.ACTIVATIONS``) as ``mx_mlp_op``: the up projection's epilogue applies the activation and
    writes the down projection's MX operand, where both are ``QuantizedLinear``s of one MX format that the dispatch
    runs on ``mx_triton`` for these rows. None elsewhere: the caller runs them one by one.

    x: [..., K], prefix: [..., P] -> [..., N_down]."""
    if not (isinstance(up, QuantizedLinear) and isinstance(down, QuantizedLinear)):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if (up.fmt, up.scale_mode) != (down.fmt, down.scale_mode) or up.splits is not None:
        return None
    if not (up.runs_mx_triton(rows.shape[0]) and down.runs_mx_triton(rows.shape[0])):
        return None
    prefix_rows = None if prefix is None else prefix.reshape(-1, prefix.shape[-1])
    w_up, w_down = up.weights[MxTriton.name], down.weights[MxTriton.name]
    out = mx_mlp_op(rows, prefix_rows, w_up["codes"], w_up["scales"], up.bias, w_down["codes"], w_down["scales"],
                    up.fmt.element, activation, up.scale_mode)  # fmt: skip
    if down.bias is not None:
        out = out + down.bias
    return out.reshape(*x.shape[:-1], down.out_features)
