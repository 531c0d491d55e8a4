"""Unquantized GEMMs that take their neighbours with them, so the activations between them are never written.

Two ops, used by ``model/compile.py``'s fusion of a GELU MLP's projections (plain, unquantized
linears; the quantized ones fuse their activation into the down projection's quantizer instead):

* ``ditrun::linear_gelu``: GELU(tanh)(x W^T + b) as one cuBLASLt GEMM with the bias and the
  activation in its epilogue (``torch._addmm_activation``). The GELU is applied to the fp32
  accumulator, so the hidden state is rounded to BF16 once, where the unfused GEMM and
  activation round it twice; and the [S, 12288] hidden state is read and written one time fewer.
* ``ditrun::joined_linear``: a single-stream block's output projection of the joined
  [attention output, MLP hidden state] as two GEMMs, the second accumulating into the first's
  output (``addmm_``, beta = 1), so the joined [S, 3072 + 12288] tensor is never written. The
  partial sum is rounded to the output's dtype once more than in one GEMM over the joined input.

Both are ``torch.library.custom_op``s: inductor sees one opaque call each, rather than decomposing
``_addmm_activation`` into a GEMM and a GELU kernel, or splitting the accumulating GEMM's
addition into a pointwise kernel of its own. Off GPUs, and wherever the BLAS library has no
GELU epilogue, PyTorch computes the same function in two steps (on the CPU with the tanh
approximation here too, which ``_addmm_activation`` would not use). On ROCm, PyTorch takes
hipBLASLt's epilogue where it has one; that path has not run on AMD hardware.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@torch.library.custom_op("ditrun::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(tanh)(x W^T + b): x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if x.is_cuda:
        out = torch._addmm_activation(bias, _rows(x), weight.t(), use_gelu=True)
    else:
        out = F.gelu(F.linear(_rows(x), weight, bias), approximate="tanh")
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_gelu.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("ditrun::joined_linear", mutates_args=())
def joined_linear(
    prefix: torch.Tensor,
    hidden: torch.Tensor,
    prefix_weight: torch.Tensor,
    hidden_weight: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """[prefix, hidden] W^T + b without joining them: prefix [..., P], hidden [..., K], prefix_weight [N, P],
    hidden_weight [N, K] (W's columns split at P), bias [N] -> [..., N]."""
    out = torch.addmm(bias, _rows(prefix), prefix_weight.t())
    out.addmm_(_rows(hidden), hidden_weight.t())
    return out.view(*prefix.shape[:-1], out.shape[-1])


@joined_linear.register_fake
def _(prefix, hidden, prefix_weight, hidden_weight, bias):
    return prefix.new_empty(*prefix.shape[:-1], prefix_weight.shape[0])
