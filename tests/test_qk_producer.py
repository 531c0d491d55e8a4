"""The fused Q/K producer (``kernels/qk_producer_triton.py``: RMSNorm + RoPE + INT8 quantization into the send
rows) and the fp64 token sum (``token_sum_triton.token_sum_fp64``) against the unfused composition the CPU runs (``nn.RMSNorm``, ``dit.apply_rope``, ``attention.smooth_k``,
``quantize_int8_rows``), on fresh random inputs: in Triton's CPU interpreter, and on a GPU where there is one.

The kernel's mean square is a tree sum and its rsqrt the device's, so a normalized value may differ from torch's in
its last bit: a scale within a few ulps, and a code off by one only where its value sits on a rounding boundary
(a handful in 10^4); K's token sums are fp64 sums of the same values (exact for BF16, ``token_statistics.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ditrun.kernels.attention import quantize_int8_rows, smooth_k
from ditrun.kernels.attention_payload import Field, RowLayout
from ditrun.kernels.token_statistics import token_mean, token_sum
from ditrun.model.dit import apply_rope, rope_tables


def unfused(x, weight, cos, sin, mean=None):
    """The composition the CPU runs: x [B, L, H, D] -> (int8 codes [B, L, H, D], fp32 scales [B, L, H])."""
    y = apply_rope(F.rms_norm(x, (x.shape[-1],), weight, eps=1e-6), cos, sin)
    return quantize_int8_rows(y if mean is None else smooth_k(y, 1, mean[:, None]))


def check_producer(device: str = "cpu", dtype=torch.float32) -> None:
    """Q without and K with smoothing, written into the send rows' fields (strided views) of a three-rank
    destination-major slot; L not a multiple of the tile; the statistics pass against fp64 sums of the unfused
    normalized, rotated K."""
    from ditrun.kernels.qk_producer_triton import norm_rope_quantize, norm_rope_statistics

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))  # fresh inputs each run
    b, length, h, d = 2, 45, 3, 32
    x = (torch.randn(b, length, h, d, generator=g) * 3 + torch.randn(1, 1, h, d, generator=g)).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    ids = torch.stack([torch.zeros(length), torch.arange(length) // 9, torch.arange(length) % 9], dim=1)
    cos, sin = (t.to(device) for t in rope_tables(ids, (8, 12, 12)))
    rotated = apply_rope(F.rms_norm(x, (d,), weight, eps=1e-6), cos, sin)

    k_sum, amax = norm_rope_statistics(x, weight, cos, sin)
    torch.testing.assert_close(k_sum, token_sum(rotated, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(amax, rotated.abs().amax(dim=(1, 3)).float(), rtol=1e-6, atol=0)

    # K's token sums without an fp64 copy (what ``token_sum`` runs on GPUs), of a strided view of some heads
    from ditrun.kernels.token_sum_triton import token_sum_fp64

    heads = x.to(torch.bfloat16).to(dtype)[:, :, 1:]  # BF16 values: exact fp64 sums, whichever order
    assert torch.equal(token_sum_fp64(heads, block_l=16), heads.sum(dim=1, dtype=torch.float64))

    layout = RowLayout((Field("k", torch.int8, d), Field("k_scale", torch.float32, 1)))
    mean = token_mean(token_sum(rotated, 1), length, dtype)
    for smoothed in (None, mean):
        # the send slot [P, L, B, H/P, record], destination-major, one head per destination: fields [B, L, P, 1, w]
        slot = torch.zeros(h, length, b, 1, layout.nbytes, dtype=torch.uint8, device=device)
        fields = {n: t.permute(2, 1, 0, 3, 4) for n, t in layout.views(slot).items()}
        norm_rope_quantize(x, weight, cos, sin, fields["k"], fields["k_scale"][..., 0], smoothed)
        codes, scales = unfused(x, weight, cos, sin, smoothed)
        # a few ulps, as below
        torch.testing.assert_close(fields["k_scale"][..., 0].flatten(2), scales, rtol=1e-6, atol=0)
        off = (fields["k"].flatten(2, 3).int() - codes.int()).abs()
        assert off.max() <= 1 and (off > 0).float().mean() < 2e-3, (off.max(), (off > 0).sum())
        # and into a [B, L, H, D] tensor of one destination
        one = torch.zeros(b, length, h, d, dtype=torch.int8, device=device)
        one_scale = torch.zeros(b, length, h, device=device)
        norm_rope_quantize(x, weight, cos, sin, one, one_scale, smoothed)
        assert torch.equal(one, fields["k"].flatten(2, 3)) and torch.equal(
            one_scale, fields["k_scale"][..., 0].flatten(2)
        )


def check_payload_producer(device: str = "cpu", dtype=torch.float32) -> None:
    """The INT8 payload's GPU path (``statistics_from_raw``, ``write_qk``: what ``UlyssesAttention.from_raw`` runs)
    against its CPU path (the block's norms and RoPE, ``Statistics.of``, ``encode``), from Q and K as projected: a
    text stretch and an image stretch with their own norms, two destination ranks, the slot's fields as
    ``UlyssesAttention`` views them. The statistics agree to fp64 rounding (Q's amax is not measured); the codes
    within one as in ``check_producer``; V's fields are the same function's."""
    from ditrun.kernels.attention_payload import Int8QKPayload, Statistics
    from ditrun.model.dit import QKNorms

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    b, length, h, d, p, text = 1, 40, 4, 32, 2, 11
    q, k, v = (torch.randn(b, length, h, d, generator=g).to(device, dtype) * 2 for _ in range(3))
    k = k + torch.randn(1, 1, h, d, generator=g).to(device, dtype)
    weights = [(1 + 0.2 * torch.randn(d, generator=g)).to(device, dtype) for _ in range(4)]
    norms = QKNorms(((text, weights[0], weights[1]), (None, weights[2], weights[3])), 1e-6)
    ids = torch.stack([torch.zeros(length), torch.arange(length) // 8, torch.arange(length) % 8], dim=1)
    rope = tuple(t.to(device) for t in rope_tables(ids, (8, 12, 12)))
    payload = Int8QKPayload("int8qk_fp8v", "fp8", "emulation")

    fused = payload.statistics_from_raw(q, k, v, norms, rope)
    qn, kn = norms.apply(q, k, rope)
    composed = Statistics.of(qn, kn, v)
    torch.testing.assert_close(fused.k_sum, composed.k_sum, rtol=1e-5, atol=1e-5)  # last-bit norms (see above)
    torch.testing.assert_close(fused.amax[..., 1], composed.amax[..., 1], rtol=1e-6, atol=0)
    assert torch.equal(fused.amax[..., 2], composed.amax[..., 2]) and fused.amax[..., 0].isnan().all()

    layout = payload.layout(d, dtype)
    slot = torch.zeros(p, length, b, h // p, layout.nbytes, dtype=torch.uint8, device=device)
    fields = {n: t.permute(2, 1, 0, 3, 4) for n, t in layout.views(slot).items()}  # [B, L, P, H/P, w]
    mean = token_mean(composed.k_sum, length, dtype)
    payload.write_qk(q, k, norms, rope, mean, fields)
    want = payload.encode(qn, kn, v, composed, p)
    for name in ("q", "k"):
        off = (fields[name].flatten(2, 3).int() - want[name].int()).abs()
        assert off.max() <= 1 and (off > 0).float().mean() < 2e-3, (name, off.max(), (off > 0).sum())
        got_scale = fields[f"{name}_scale"].flatten(2, 3)
        torch.testing.assert_close(got_scale, want[f"{name}_scale"], rtol=1e-6, atol=0)  # a few ulps
    assert fields["v"].abs().sum() == 0  # V's fields are not the producer's

    # MXFP6 V of some heads by the Triton quantizer: the codec's codes and scales, bit for bit
    from ditrun.kernels import formats
    from ditrun.kernels.attention_payload import mx_rows

    heads = v.to(torch.bfloat16)[:, :, 1:3]  # a head slice, as a head group's
    got = mx_rows(heads, "fp6_e2m3", by_kernel=True)
    for a, b_ in zip(got, formats.quantize_mx(heads, "fp6_e2m3"), strict=True):
        assert torch.equal(a, b_)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fused_producer_in_the_cpu_interpreter():
    pytest.importorskip("triton")
    # TRITON_INTERPRET is read when kernels are defined: a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", "import test_qk_producer as t; t.check_producer(); t.check_payload_producer()"],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
def test_fused_producer_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    check_producer("cuda", torch.bfloat16)
    check_payload_producer("cuda", torch.bfloat16)
