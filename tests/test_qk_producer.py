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
        torch.testing.assert_close(fields["k_scale"][..., 0].flatten(2), scales, rtol=4e-7, atol=0)
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


def e4m3_ordinal(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes -> integers in the order of their values, one apart for neighbours, -0 and +0 both 0."""
    bits = codes.view(torch.uint8).int()
    return torch.where(bits >= 128, 128 - bits, bits)


def check_fp8_pv_producer(device: str = "cpu", dtype=torch.float32) -> None:
    """``fp8_pv``'s operands from Q and K as projected (``fp8_sdpa.fp8_pv_produce`` through its op, what
    ``precision.quantizer=kernel`` runs) against ``fp8_sdpa.fp8_pv_operands`` of the block's norms and RoPE, for one
    stretch of norms and for a text and an image stretch, two batch rows, Q, K and V strided views of one stacked
    projection, L not a multiple of the tile: the same scales, codes within one E4M3 step (a normalized value may
    differ in its last bit, see above) in under 0.2% of them; and the attention of both alike. Then a tiny model's
    blocks, eager and as their compiled ``joint`` traces them, take the producer's path and match the plain one."""
    from ditrun.kernels.fp8_sdpa import Fp8PvFromProjections, fp8_pv_attention, fp8_pv_from_raw_op, fp8_pv_operands
    from ditrun.model.dit import QKNorms

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    b, length, h, d, text = 2, 45, 3, 32, 11
    stacked = torch.randn(b, length, 3 * h * d + 8, generator=g).to(device, dtype) * 2
    q, k, v = (stacked[..., i * h * d : (i + 1) * h * d].unflatten(-1, (h, d)) for i in range(3))
    k = k + torch.randn(1, 1, h, d, generator=g).to(device, dtype)  # a mean for the smoothing to take off
    weights = [(1 + 0.2 * torch.randn(d, generator=g)).to(device, dtype) for _ in range(4)]
    ids = torch.stack([torch.zeros(length), torch.arange(length) // 9, torch.arange(length) % 9], dim=1)
    rope = tuple(t.to(device) for t in rope_tables(ids, (8, 12, 12)))
    produced = Fp8PvFromProjections("emulation")
    for norms in (  # one part (a single-stream block), two (text and image) read where they are
        QKNorms(((None, weights[0], weights[1]),), 1e-6),
        QKNorms(((text, weights[0], weights[1]), (None, weights[2], weights[3])), 1e-6),
    ):
        qn, kn = norms.apply(q, k, rope)
        want = fp8_pv_operands(qn, kn, v)
        spans = norms.spans(length)
        parts = [[t[:, at] for at, _, _ in spans] for t in (q, k, v)]
        weights = [[wq for _, wq, _ in spans], [wk for _, _, wk in spans]]
        got = fp8_pv_from_raw_op(*parts, *weights, norms.eps, *rope)
        assert torch.equal(got[3], want[3]), (got[3], want[3])
        for name, a, w in zip("qkv", got[:3], want[:3], strict=True):
            assert a.shape == w.shape and a.is_contiguous()
            off = (e4m3_ordinal(a) - e4m3_ordinal(w)).abs()
            assert off.max() <= 1 and (off > 0).float().mean() < 2e-3, (name, off.max(), (off > 0).sum())
        plain = fp8_pv_attention("emulation")(qn, kn, v)
        torch.testing.assert_close(produced.from_raw(q, k, v, norms, rope), plain, rtol=0.1, atol=0.05)

    # a tiny model's blocks: the eager path (``Regions.run``) and ``joint`` hand Q and K as projected with the norms
    from ditrun.model import dit, presets

    class Counted(Fp8PvFromProjections):
        calls = 0

        def from_raw(self, *args):
            Counted.calls += 1
            return super().from_raw(*args)

    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    geo = presets.PRESETS["tiny"]
    model = dit.FluxDiT(geo).to(device, dtype)
    for module in model.modules():  # norms that are not identities: a stream given the other's would show
        if isinstance(module, torch.nn.RMSNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.5)
    img = torch.randn(1, 36, geo.inner_dim, device=device, dtype=dtype)
    txt = torch.randn(1, 7, geo.inner_dim, device=device, dtype=dtype)
    temb = torch.randn(1, geo.inner_dim, device=device, dtype=dtype)
    ids = torch.cat([torch.zeros(7, 3), torch.stack([torch.zeros(36), torch.arange(36) // 6, torch.arange(36) % 6], 1)])
    rope = tuple(t.to(device) for t in rope_tables(ids, geo.axes_dims_rope))
    produced, plain = Counted("emulation"), fp8_pv_attention("emulation")
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    x = torch.cat([txt, img], dim=1)
    for run in (lambda blk, *a: blk(*a), lambda blk, *a: blk.joint(*a)):
        for a, w in zip(run(double, img, txt, temb, rope, produced), run(double, img, txt, temb, rope, plain)):
            torch.testing.assert_close(a, w, rtol=0.02, atol=0.02 * w.abs().max().item())
        a, w = run(single, x, temb, rope, produced), run(single, x, temb, rope, plain)
        torch.testing.assert_close(a, w, rtol=0.02, atol=0.02 * w.abs().max().item())
    assert Counted.calls == 4


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fused_producer_in_the_cpu_interpreter():
    pytest.importorskip("triton")
    # TRITON_INTERPRET is read when kernels are defined: a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import test_qk_producer as t; t.check_producer(); t.check_payload_producer(); t.check_fp8_pv_producer()",
        ],
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
    check_fp8_pv_producer("cuda", torch.bfloat16)
