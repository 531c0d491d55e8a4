"""A Flux-style multimodal DiT (MMDiT): double-stream blocks, then single-stream blocks.

Parameter names follow diffusers' ``FluxTransformer2DModel`` so its checkpoints load as they are,
and ``forward`` takes the same named inputs. Two things differ on purpose:

* attention is a pluggable function ``attention(q, k, v) -> out`` on ``[B, S, H, D]`` tensors, so a
  parallel layout can exchange sequence shards for head shards around it without this file
  knowing about process groups (nothing here imports ``torch.distributed``);
* the ``krea3`` variant (SwiGLU MLP, sigmoid gate on the attention output, RMSNorm modulation)
  is selected by ``DiTGeometry`` fields instead of a second model class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ditrun.errors import UserError
from ditrun.kernels import epilogue
from ditrun.kernels.linear import quantized_mlp
from ditrun.kernels.sdpa import AttentionFn, sdpa_attention  # noqa: F401  (the model's attention signature)


@dataclass(frozen=True)
class DiTGeometry:
    """Shape of the model. Field names are those of diffusers' ``config.json`` where one exists."""

    num_layers: int = 19
    """Double-stream (text and image streams with their own weights) blocks."""
    num_single_layers: int = 38
    """Single-stream blocks (one weight set over the joint sequence)."""
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    joint_attention_dim: int = 4096
    """Width of the incoming text embeddings."""
    pooled_projection_dim: int = 768
    """Width of the pooled text embedding."""
    guidance_embeds: bool = True
    """Embed a distilled-guidance value beside the timestep (FLUX.1-dev)."""
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    """Rotary channels per position axis (frame/reference index, row, column); sums to the head dim."""
    in_channels: int = 64
    """Channels of a packed latent token (16 latent channels x 2x2 patch)."""
    out_channels: Optional[int] = None
    patch_size: int = 1
    mlp_ratio: float = 4.0
    mlp: str = "gelu"
    """``gelu`` (tanh-approximate GELU, Flux) or ``swiglu`` (Krea 3)."""
    attention_gate: bool = False
    """Multiply the attention output by a learned sigmoid gate before its output projection (Krea 3)."""
    modulation_norm: str = "layer"
    """Normalisation under the AdaLN modulation: ``layer`` (Flux) or ``rms`` (Krea 3)."""

    def __post_init__(self):
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise UserError(
                f"axes_dims_rope {tuple(self.axes_dims_rope)} must sum to attention_head_dim={self.attention_head_dim}."
            )
        if self.mlp not in ("gelu", "swiglu"):
            raise UserError(f"mlp={self.mlp!r} is unknown; allowed: gelu, swiglu.")
        if self.modulation_norm not in ("layer", "rms"):
            raise UserError(f"modulation_norm={self.modulation_norm!r} is unknown; allowed: layer, rms.")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)

    @property
    def is_diffusers_flux(self) -> bool:
        """True when diffusers' FluxTransformer2DModel has exactly this architecture."""
        return self.mlp == "gelu" and not self.attention_gate and self.modulation_norm == "layer"


# ---------------------------------------------------------------------------------------------
# Embeddings


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding, cosines first. t: [B] -> [B, dim] (fp32)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t[:, None].float() * torch.exp(exponent)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    """Linear -> SiLU -> Linear (diffusers' TimestepEmbedding / PixArtAlphaTextProjection)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbedding(nn.Module):
    """Conditioning vector from timestep, optional distilled guidance and the pooled text embedding."""

    def __init__(self, dim: int, pooled_dim: int, guidance: bool):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, dim)
        self.guidance_embedder = MLPEmbedder(256, dim) if guidance else None
        self.text_embedder = MLPEmbedder(pooled_dim, dim)

    def forward(self, timestep, guidance, pooled) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_embedding(timestep).to(pooled.dtype))
        if self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(timestep_embedding(guidance).to(pooled.dtype))
        return emb + self.text_embedder(pooled)


def rope_tables(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float = 10000.0):
    """cos and sin tables for 3-axis rotary embeddings. ids: [S, n_axes] -> two [S, D] fp32 tensors.

    Frequencies are computed in float64 (float32 where the device has no float64) as the
    reference Flux implementation does, then rounded once.
    """
    dtype = torch.float32 if ids.device.type == "mps" else torch.float64
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=dtype, device=ids.device) / dim)
        angles = torch.outer(ids[:, axis].to(dtype), freqs)  # [S, dim/2]
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1). x: [B, S, H, D]; cos, sin: [S, D]."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    out = x.float() * cos[None, :, None] + rotated.float() * sin[None, :, None]
    return out.to(x.dtype)


@dataclass(frozen=True)
class QKNorms:
    """A block's per-head RMSNorm of Q and K, for an attention that normalizes and rotates them itself (one whose
    ``takes_raw_qk`` is true: the quantized exchange's producer writes codes straight from the projections).

    ``stretches``: (tokens, Q's weight, K's weight) in the order of the block's joint sequence: [text, image] in a
    double-stream block (each stream has its own norms), the whole sequence in a single-stream one (tokens None).
    """

    stretches: tuple[tuple[Optional[int], torch.Tensor, torch.Tensor], ...]
    eps: float

    def spans(self, length: int) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
        """Each stretch's token slice of a sequence of ``length`` and its (Q, K) weights."""
        spans, start = [], 0
        for tokens, q_weight, k_weight in self.stretches:
            end = length if tokens is None else start + tokens
            spans.append((slice(start, end), q_weight, k_weight))
            start = end
        return spans

    def apply(self, q: torch.Tensor, k: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """What the block would have handed attention: q, k [B, S, H, D] as projected -> normalized and rotated."""
        normed = [
            (F.rms_norm(q[:, at], (q.shape[-1],), wq, self.eps), F.rms_norm(k[:, at], (k.shape[-1],), wk, self.eps))
            for at, wq, wk in self.spans(q.shape[1])
        ]
        q, k = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*normed))
        return apply_rope(q, *rope), apply_rope(k, *rope)


# ---------------------------------------------------------------------------------------------
# Normalisation and modulation


def _modulation_norm(kind: str, dim: int) -> nn.Module:
    if kind == "rms":
        return nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
    return nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)


class AdaNormZero(nn.Module):
    """Norm, then shift/scale from the conditioning vector; also returns the gates (``chunks`` of them)."""

    def __init__(self, dim: int, chunks: int, norm: str):
        super().__init__()
        self.linear = nn.Linear(dim, chunks * dim)
        self.norm = _modulation_norm(norm, dim)
        self.chunks = chunks

    def forward(self, x: torch.Tensor, emb: torch.Tensor):
        # x: [B, S, C]; emb: [B, C] -> modulated x and the remaining per-channel vectors
        params = self.linear(F.silu(emb)).chunk(self.chunks, dim=1)
        shift, scale = params[0], params[1]
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None], params[2:]


class AdaNormOut(nn.Module):
    """Final norm; note the (scale, shift) order, as in Flux."""

    def __init__(self, dim: int, norm: str):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = _modulation_norm(norm, dim)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(emb).to(x.dtype)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None] + shift[:, None]


# ---------------------------------------------------------------------------------------------
# Attention and MLP


class Attention(nn.Module):
    """QKV projections with per-head RMSNorm; for double blocks also the text stream's own projections."""

    def __init__(self, geo: DiTGeometry, dual: bool, has_out: bool):
        super().__init__()
        dim, heads, head_dim = geo.inner_dim, geo.num_attention_heads, geo.attention_head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        if has_out:
            self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Identity()])
        self.to_gate = nn.Linear(dim, dim) if geo.attention_gate else None
        if dual:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
            self.norm_added_q = nn.RMSNorm(head_dim, eps=1e-6)
            self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6)
            self.to_add_out = nn.Linear(dim, dim)
            self.add_gate = nn.Linear(dim, dim) if geo.attention_gate else None

        # Set when the projections are quantized: per stream ("image", "text"), one module computing
        # Q, K, V (and the gate) in one GEMM from one quantized input (see model/components.py).
        self.stacked = nn.ModuleDict()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.head_dim))  # [B, S, C] -> [B, S, H, D]

    def linears(self, text: bool) -> list[Optional[nn.Linear]]:
        """The stream's Q, K, V and gate (or None) linears, in that order."""
        if text:
            return [self.add_q_proj, self.add_k_proj, self.add_v_proj, self.add_gate]
        return [self.to_q, self.to_k, self.to_v, self.to_gate]

    def project(self, x: torch.Tensor, text: bool = False, raw: bool = False):
        """Q, K (normalised per head; as projected if ``raw``), V and the sigmoid gate (None without one) for one
        stream.

        x: [B, S, C] -> 3 x [B, S, H, D] and [B, S, C] or None.
        """
        stream = "text" if text else "image"
        if stream in self.stacked:
            return self.heads_of(self.stacked[stream](x), text, raw)
        return self.heads_of([linear(x) for linear in self.linears(text) if linear is not None], text, raw)

    def norms(self, text: bool = False) -> tuple[nn.RMSNorm, nn.RMSNorm]:
        """The stream's per-head norms of Q and K."""
        return (self.norm_added_q, self.norm_added_k) if text else (self.norm_q, self.norm_k)

    def heads_of(self, projected, text: bool = False, raw: bool = False):
        """The projections' outputs (Q, K, V and the gate if any; [B, S, C] each) -> what ``project`` returns."""
        q, k, v, *gate = projected
        gate = torch.sigmoid(gate[0]) if gate else None
        q, k = self._heads(q), self._heads(k)
        if not raw:
            norm_q, norm_k = self.norms(text)
            q, k = norm_q(q), norm_k(k)
        return q, k, self._heads(v), gate

    @staticmethod
    def gated(out: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        return out if gate is None else out * gate


class FeedForward(nn.Module):
    """GELU(tanh) or SwiGLU MLP; submodule names match diffusers' ``FeedForward`` (net.0.proj, net.2)."""

    def __init__(self, geo: DiTGeometry):
        super().__init__()
        dim, hidden = geo.inner_dim, geo.mlp_hidden_dim
        self.swiglu = geo.mlp == "swiglu"
        proj = nn.Module()
        proj.proj = nn.Linear(dim, 2 * hidden if self.swiglu else hidden)
        self.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(hidden, dim)])
        self.activation = mlp_activation(self.swiglu)
        self.epilogue = mlp_epilogue(self.swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.net[0].proj, self.net[2]
        if isinstance(down, nn.Linear):
            return down(self.activation(up(x)))
        fused = quantized_mlp(up, down, x, self.epilogue)  # MX on ditrun's GEMM: the hidden state never written
        if fused is not None:
            return fused
        # A quantized down projection takes the hidden state and the activation, so that the
        # activation's output is quantized as it is computed (one fused pass on GPUs).
        return down(up(x), activation=self.activation)


GELU_TANH_COEFF = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_activation(h: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: 0.5 h (1 + tanh(u)), u = sqrt(2 / pi) (h + 0.044715 h^3).

    Inside ``torch.compile`` it is written as the same function h * sigmoid(2u) (0.5 (1 + tanh u) =
    sigmoid(2u)): inductor computes sigmoid with the hardware exp, tanh with libdevice's longer
    routine, and the FP8 row quantizer of the down projection's input evaluates the activation twice
    (once for the row's amax, once for the codes), enough arithmetic to bound that kernel. The two
    forms differ by fp32 rounding only; eager code keeps ``F.gelu``, bitwise diffusers'."""
    if torch.compiler.is_compiling():
        x = h.float()  # as inductor computes the tanh form (and free inside its fused kernel)
        return (x * torch.sigmoid((2.0 * SQRT_2_OVER_PI) * (x + GELU_TANH_COEFF * x * x * x))).to(h.dtype)
    return F.gelu(h, approximate="tanh")


gelu_activation.kernel_name = "gelu_tanh"  # what the FP8 down projection's Triton quantizer calls it (quantize_triton)


def swiglu_activation(h: torch.Tensor) -> torch.Tensor:
    # h: [..., 2 * hidden] -> [..., hidden]
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def mlp_activation(swiglu_mlp: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation function: module-level, so the same object in every block (quantizers are shared by it)."""
    return swiglu_activation if swiglu_mlp else gelu_activation


def mlp_epilogue(swiglu_mlp: bool) -> str:
    """The MLP's activation as a fused up projection names it (``mx_gemm_triton.ACTIVATIONS``)."""
    return "swiglu" if swiglu_mlp else "gelu_tanh"


class StackedLinear(nn.Module):
    """Linears that read the same input, as one GEMM: returns one output per original linear.

    Made from unquantized linears by ``model/compile.py``'s fusion; quantized ones are stacked by
    ``model/quantize.py`` as one ``QuantizedLinear`` with ``splits``.
    """

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.splits = [linear.out_features for linear in linears]
        self.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
        biases = [linear.bias for linear in linears]
        self.bias = None if any(b is None for b in biases) else nn.Parameter(torch.cat(biases), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x: [..., K] -> one [..., N_i] view per stacked linear
        return F.linear(x, self.weight, self.bias).split(self.splits, dim=-1)


def no_activation(h: torch.Tensor) -> torch.Tensor:
    """The MLP's activation once its input projection applies it (``GeluLinear``)."""
    return h


class GeluLinear(nn.Module):
    """A linear and the GELU(tanh) after it as one GEMM (``kernels/epilogue.py``); made from an MLP's plain input
    projection by ``model/compile.py``'s fusion, which sets the MLP's ``activation`` to ``no_activation``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return epilogue.linear_gelu(x, self.weight, self.bias)


class JoinedLinear(nn.Module):
    """A single-stream block's output projection of [attention output, activation(hidden)] as two GEMMs into one
    output (``kernels/epilogue.py``), never writing the joined input; called as a quantized ``proj_out`` is."""

    def __init__(self, linear: nn.Linear, prefix_features: int):
        super().__init__()
        self.prefix_weight = nn.Parameter(linear.weight[:, :prefix_features].contiguous(), requires_grad=False)
        self.weight = nn.Parameter(linear.weight[:, prefix_features:].contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor, activation: Callable, prefix: torch.Tensor) -> torch.Tensor:
        return epilogue.joined_linear(prefix, activation(hidden), self.prefix_weight, self.weight, self.bias)


@dataclass(frozen=True)
class Regions:
    """How a block runs: its two halves around the attention call (eager methods, or their compiled
    versions), and optionally the whole block compiled with one attention function inside."""

    pre: Callable
    post: Callable
    whole: Optional[Callable] = None
    """``block.joint`` compiled with ``attention`` in its graph; used when a call passes that function."""
    attention: Optional[Callable] = None

    def run(self, inputs: tuple, attention: AttentionFn, residuals: int, norms: Callable[[], QKNorms]):
        """The block on ``inputs`` (``pre``'s arguments, RoPE's tables last); the first ``residuals`` of them go to
        ``post`` too. An attention that ``takes_raw_qk`` gets Q and K as projected, with the block's ``norms``."""
        if self.whole is not None and attention is self.attention:
            return self.whole(*inputs, attention)
        if getattr(attention, "takes_raw_qk", False):
            q, k, v, state = self.pre(*inputs, raw=True)
            return self.post(attention.from_raw(q, k, v, norms(), inputs[-1]), *inputs[:residuals], state)
        q, k, v, state = self.pre(*inputs)
        return self.post(attention(q, k, v), *inputs[:residuals], state)


def regions_of(block: nn.Module) -> Regions:
    """The halves a block runs: ``block.compiled_regions`` when ``model/compile.py`` set it, else eager.

    A layout's attention (all-to-all exchanges, transports: Python objects and other streams) stays
    outside any compiled graph, between the compiled halves; only the run's own attention function
    (SDPA or a custom-op kernel, no exchange) is compiled into the whole block.
    """
    compiled = block.__dict__.get("compiled_regions")
    return compiled if compiled is not None else Regions(block.pre_attention, block.post_attention)


# ---------------------------------------------------------------------------------------------
# Blocks


class DoubleStreamBlock(nn.Module):
    """Text and image streams with their own weights, one joint attention over both."""

    def __init__(self, geo: DiTGeometry):
        super().__init__()
        self.norm1 = AdaNormZero(geo.inner_dim, 6, geo.modulation_norm)
        self.norm1_context = AdaNormZero(geo.inner_dim, 6, geo.modulation_norm)
        self.attn = Attention(geo, dual=True, has_out=True)
        self.norm2 = _modulation_norm(geo.modulation_norm, geo.inner_dim)
        self.ff = FeedForward(geo)
        self.norm2_context = _modulation_norm(geo.modulation_norm, geo.inner_dim)
        self.ff_context = FeedForward(geo)

    def forward(self, img, txt, temb, rope, attention: AttentionFn):
        # img: [B, S_img, C], txt: [B, S_txt, C]; the joint sequence is [txt, img]
        return regions_of(self).run((img, txt, temb, rope), attention, 2, lambda: self.qk_norms(txt.shape[1]))

    def qk_norms(self, text_tokens: int) -> QKNorms:
        """The per-head norms of the joint sequence [text, image]: each stream's own."""
        (tq, tk), (iq, ik) = self.attn.norms(text=True), self.attn.norms()
        return QKNorms(((text_tokens, tq.weight, tk.weight), (None, iq.weight, ik.weight)), tq.eps)

    def joint(self, img, txt, temb, rope, attention: AttentionFn):
        """The block in one piece (what the whole-block compilation traces)."""
        q, k, v, state = self.pre_attention(img, txt, temb, rope)
        return self.post_attention(attention(q, k, v), img, txt, state)

    def pre_attention(self, img, txt, temb, rope, raw: bool = False):
        """Everything before the attention: modulation, projections, per-head norms, RoPE (the last two not if
        ``raw``: see ``QKNorms``).

        -> q, k, v [B, S_txt + S_img, H, D] and what ``post_attention`` needs (a tuple of tensors).
        """
        img_mod, img_params = self.norm1(img, temb)
        txt_mod, txt_params = self.norm1_context(txt, temb)
        qi, ki, vi, img_gate_attn = self.attn.project(img_mod, raw=raw)
        qt, kt, vt, txt_gate_attn = self.attn.project(txt_mod, text=True, raw=raw)
        q, k, v = (torch.cat(pair, dim=1) for pair in ((qt, qi), (kt, ki), (vt, vi)))
        if not raw:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v, (img_params, txt_params, img_gate_attn, txt_gate_attn)

    def post_attention(self, out, img, txt, state):
        """Everything after the attention: output projections, gated residuals, the MLPs. out: [B, S, H, D]."""
        (img_gate, img_shift2, img_scale2, img_gate2), txt_params, img_gate_attn, txt_gate_attn = state
        txt_gate, txt_shift2, txt_scale2, txt_gate2 = txt_params
        txt_attn, img_attn = out.flatten(2).to(img.dtype).split([txt.shape[1], img.shape[1]], dim=1)
        img_attn = self.attn.to_out[0](self.attn.gated(img_attn, img_gate_attn))
        txt_attn = self.attn.to_add_out(self.attn.gated(txt_attn, txt_gate_attn))
        img = self._mlp_residual(img, img_attn, img_gate, img_shift2, img_scale2, img_gate2, self.norm2, self.ff)
        txt = self._mlp_residual(
            txt, txt_attn, txt_gate, txt_shift2, txt_scale2, txt_gate2, self.norm2_context, self.ff_context
        )
        return img, txt

    @staticmethod
    def _mlp_residual(x, attn_out, gate, shift2, scale2, gate2, norm, ff):
        x = x + gate[:, None] * attn_out
        h = norm(x) * (1 + scale2[:, None]) + shift2[:, None]
        x = x + gate2[:, None] * ff(h)
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class SingleStreamBlock(nn.Module):
    """One weight set over the joint sequence; attention and MLP in parallel, one output projection."""

    def __init__(self, geo: DiTGeometry):
        super().__init__()
        self.norm = AdaNormZero(geo.inner_dim, 3, geo.modulation_norm)
        self.swiglu = geo.mlp == "swiglu"
        mlp_in = 2 * geo.mlp_hidden_dim if self.swiglu else geo.mlp_hidden_dim
        self.activation = mlp_activation(self.swiglu)
        self.proj_mlp = nn.Linear(geo.inner_dim, mlp_in)
        self.proj_out = nn.Linear(geo.inner_dim + geo.mlp_hidden_dim, geo.inner_dim)
        self.attn = Attention(geo, dual=False, has_out=False)

        # Set by ``model/compile.py``'s projection fusion (unquantized models): Q, K, V (and the gate) and
        # the MLP's input projection read the same modulated input, so they run as one GEMM.
        self.fused_in: Optional[StackedLinear] = None

    def forward(self, x, temb, rope, attention: AttentionFn):
        # x: [B, S_txt + S_img, C]
        return regions_of(self).run((x, temb, rope), attention, 1, self.qk_norms)

    def qk_norms(self) -> QKNorms:
        norm_q, norm_k = self.attn.norms()
        return QKNorms(((None, norm_q.weight, norm_k.weight),), norm_q.eps)

    def joint(self, x, temb, rope, attention: AttentionFn):
        """The block in one piece (what the whole-block compilation traces)."""
        q, k, v, state = self.pre_attention(x, temb, rope)
        return self.post_attention(attention(q, k, v), x, state)

    def pre_attention(self, x, temb, rope, raw: bool = False):
        """Modulation, projections, per-head norms, RoPE (the last two not if ``raw``: see ``QKNorms``) -> q, k, v
        [B, S, H, D] and the state for after."""
        h, (gate,) = self.norm(x, temb)
        if self.fused_in is not None:
            *projected, mlp_in = self.fused_in(h)  # mlp_in: the MLP's hidden state, already projected
            q, k, v, attn_gate = self.attn.heads_of(projected, raw=raw)
        else:
            q, k, v, attn_gate = self.attn.project(h, raw=raw)
            mlp_in = h
        if not raw:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v, (gate, attn_gate, mlp_in)

    def post_attention(self, out, x, state):
        """The MLP, the joint output projection and the gated residual. out: [B, S, H, D]."""
        gate, attn_gate, mlp_in = state
        attn_out = self.attn.gated(out.flatten(2).to(x.dtype), attn_gate)
        # MX on ditrun's GEMM (quantized linears; fused_in is for plain ones): the hidden state never written, the
        # attention output quantized into the down projection's operand
        projected = quantized_mlp(self.proj_mlp, self.proj_out, mlp_in, mlp_epilogue(self.swiglu), prefix=attn_out)
        if projected is None:
            hidden = mlp_in if self.fused_in is not None else self.proj_mlp(mlp_in)
            if isinstance(self.proj_out, nn.Linear):
                projected = self.proj_out(torch.cat([attn_out, self.activation(hidden)], dim=2))
            else:  # quantized: it joins and activates its input inside the quantizer (one fused pass on GPUs)
                projected = self.proj_out(hidden, activation=self.activation, prefix=attn_out)
        x = x + gate[:, None] * projected
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


# ---------------------------------------------------------------------------------------------
# The model


class FluxDiT(nn.Module):
    """Flux-style MMDiT. ``forward`` takes diffusers' named inputs and returns the velocity."""

    def __init__(self, geo: DiTGeometry):
        super().__init__()
        self.geometry = geo
        dim = geo.inner_dim
        self.time_text_embed = TimeTextEmbedding(dim, geo.pooled_projection_dim, geo.guidance_embeds)
        self.context_embedder = nn.Linear(geo.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(geo.in_channels, dim)
        self.transformer_blocks = nn.ModuleList(DoubleStreamBlock(geo) for _ in range(geo.num_layers))
        self.single_transformer_blocks = nn.ModuleList(SingleStreamBlock(geo) for _ in range(geo.num_single_layers))
        self.norm_out = AdaNormOut(dim, geo.modulation_norm)
        out_channels = geo.out_channels or geo.in_channels
        self.proj_out = nn.Linear(dim, geo.patch_size**2 * out_channels)

    @property
    def num_blocks(self) -> int:
        """Double-stream then single-stream blocks, counted as one sequence (what ``run_blocks`` indexes)."""
        return len(self.transformer_blocks) + len(self.single_transformer_blocks)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: Optional[torch.Tensor] = None,
        attention: AttentionFn = sdpa_attention,
    ) -> torch.Tensor:
        # hidden_states: [B, S_img, in_channels], encoder_hidden_states: [B, S_txt, joint_dim]
        # img_ids: [S_img, 3], txt_ids: [S_txt, 3]; timestep, guidance: [B] in [0, 1]
        stream = self.embed(
            hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance
        )
        stream = self.run_blocks(stream, 0, self.num_blocks, attention)
        return self.finish(stream.img, stream.temb)

    def embed(
        self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance=None
    ) -> "Stream":
        """The blocks' inputs: embedded image and text tokens, the conditioning vector and the RoPE tables."""
        img = self.x_embedder(hidden_states)
        dtype = img.dtype
        guidance = None if guidance is None else guidance.to(dtype) * 1000
        if self.time_text_embed.guidance_embedder is not None and guidance is None:
            raise ValueError("this model embeds distilled guidance: pass `guidance` (a [B] tensor).")
        temb = self.time_text_embed(timestep.to(dtype) * 1000, guidance, pooled_projections)
        txt = self.context_embedder(encoder_hidden_states)
        rope = rope_tables(torch.cat([txt_ids, img_ids], dim=0), self.geometry.axes_dims_rope)
        return Stream(img, txt, temb, rope)

    def run_blocks(self, stream: "Stream", start: int, stop: int, attention: AttentionFn) -> "Stream":
        """Blocks ``start`` to ``stop`` (exclusive) of ``num_blocks``: double-stream ones on the two streams, then
        single-stream ones on the joint sequence [txt, img], joined once and split back once."""
        img, txt, temb, rope = stream
        doubles = len(self.transformer_blocks)
        for block in self.transformer_blocks[start : min(stop, doubles)]:
            img, txt = block(img, txt, temb, rope, attention)
        singles = self.single_transformer_blocks[max(start - doubles, 0) : max(stop - doubles, 0)]
        if len(singles):
            x = torch.cat([txt, img], dim=1)
            for block in singles:
                x = block(x, temb, rope, attention)
            txt, img = x[:, : txt.shape[1]], x[:, txt.shape[1] :]
        return Stream(img, txt, temb, rope)

    def finish(self, img: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The output projection of the image tokens. img: [B, S_img, C] -> [B, S_img, out_channels]."""
        return self.proj_out(self.norm_out(img, temb))

    # A step cache (``ditrun/cache``) runs the forward in two parts: ``head`` every step, ``tail`` only on the
    # steps it computes; on the others it adds the tail's last residual to the head's output and ``finish``es.

    def head(self, *, blocks: int, attention: AttentionFn = sdpa_attention, **inputs):
        """``embed`` and the first ``blocks`` blocks -> (stream, their residual on the image tokens)."""
        embedded = self.embed(**inputs)
        stream = self.run_blocks(embedded, 0, blocks, attention)
        return stream, stream.img - embedded.img

    def tail(self, *, stream: "Stream", blocks: int, attention: AttentionFn = sdpa_attention):
        """The blocks after the first ``blocks`` and ``finish`` -> (output, their residual on the image tokens)."""
        done = self.run_blocks(stream, blocks, self.num_blocks, attention)
        return self.finish(done.img, done.temb), done.img - stream.img


class Stream(NamedTuple):
    """What flows between blocks: image and text tokens ([B, S_img, C], [B, S_txt, C]), the conditioning
    vector [B, C] and the RoPE tables (cos, sin: [S_txt + S_img, D])."""

    img: torch.Tensor
    txt: torch.Tensor
    temb: torch.Tensor
    rope: tuple
