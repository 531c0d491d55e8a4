"""The Triton activation quantizers (kernels/quantize_triton.py) equal the torch quantizers of the
FP8 backends: their arithmetic in Triton's CPU interpreter (where Triton is installed), bit for
bit with the FP8 cast and the inexact-row count on a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ditrun.kernels import formats
from ditrun.kernels import linear as L

ELEMENTS = ["fp8_e4m3", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"]


def activation(device: str = "cpu") -> torch.Tensor:
    """[8, 320] bf16 spanning six decades across K, with a zero row, a zero block and a ragged last tile."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 320, generator=g) * torch.logspace(-3, 3, 320)
    x[1], x[2, :64] = 0, 0
    x[3, :32] *= 2.0**24  # a block far above the rest of its row: the row's repack is inexact
    return x.to(torch.bfloat16).to(device)


def check_arithmetic(store_dtype=torch.float32) -> None:
    """Every quantizer's values before the FP8 cast, cast by torch, equal the torch reference's codes."""
    from ditrun.kernels import quantize_triton as T

    x = activation()
    got, scale = T.rowwise_fp8(x, torch.float8_e4m3fn, store_dtype)
    want, want_scale = L.quantize_rowwise_fp8(x, torch.float8_e4m3fn)
    assert torch.equal(scale, want_scale) and torch.equal(got.to(torch.float8_e4m3fn).float(), want.float())
    for element in ELEMENTS:
        for mode in formats.SCALE_MODES:
            headroom = L.repack_headroom(formats.FORMATS[element])
            got, scale, _ = T.mx_repack_fp8(x, element, 32, mode, headroom, store_dtype)
            want, want_scale, _ = L.mx_repack_fp8(x, element, 32, mode)
            assert torch.equal(scale, want_scale), (element, mode)
            assert torch.equal(got.to(torch.float8_e4m3fn).float(), want.float()), (element, mode)


@pytest.mark.timeout(240)
def test_triton_quantizer_arithmetic_in_the_cpu_interpreter():
    pytest.importorskip("triton")
    # TRITON_INTERPRET is read when kernels are defined: a fresh process. Its FP8 casts are not exact
    # (they flush E4M3 subnormals), so it checks the values before the cast; the GPU test checks the cast.
    code = "import test_quantize_triton as t; t.check_arithmetic()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                         capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
def test_triton_quantizers_equal_the_torch_quantizers_on_the_gpu():
    from ditrun.kernels import quantize_triton as T

    x = activation("cuda")
    dtype = L.fp8_dtype()
    got, scale = T.rowwise_fp8(x, dtype)
    want, want_scale = L.quantize_rowwise_fp8(x, dtype)
    assert torch.equal(scale, want_scale) and torch.equal(got.float(), want.float())
    for element in ELEMENTS:
        for mode in formats.SCALE_MODES:
            got = L.mx_repack_fp8_op(x, element, 32, mode)
            want = L.mx_repack_fp8(x, element, 32, mode)
            assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1]), (element, mode)
            assert int(got[2]) == int(want[2]), (element, mode)
