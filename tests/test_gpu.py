"""GPU paths (skipped without a CUDA/ROCm GPU): loading onto the device and bf16 against fp32."""

import pytest
import torch

from ditrun.model import from_pretrained, random_model, save_pretrained
from ditrun.model.presets import PRESETS

pytestmark = pytest.mark.gpu


def _inputs(device, dtype):
    # t=0.5 and guidance=4.0 stay exact when Flux casts t*1000 to bf16 (3.5*1000 would round to 3504
    # and move the high-frequency timestep features: a property of Flux in bf16, diffusers' too).
    gen = torch.Generator().manual_seed(0)
    geo = PRESETS["tiny"]
    n = 64
    ids = torch.stack([torch.zeros(n), torch.arange(n) // 8, torch.arange(n) % 8], dim=1)
    kw = dict(
        hidden_states=torch.randn(1, n, 64, generator=gen),
        encoder_hidden_states=torch.randn(1, 16, geo.joint_attention_dim, generator=gen),
        pooled_projections=torch.randn(1, geo.pooled_projection_dim, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=ids,
        txt_ids=torch.zeros(16, 3),
        guidance=torch.tensor([4.0]),
    )
    return {
        k: v.to(device, dtype if v.is_floating_point() and k not in ("timestep", "guidance") else v.dtype)
        for k, v in kw.items()
    }


def test_from_pretrained_onto_gpu_in_bf16_matches_cpu_fp32(tmp_path):
    save_pretrained(random_model(PRESETS["tiny"], seed=0), tmp_path)
    cpu = from_pretrained(tmp_path)
    gpu = from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in gpu.parameters())
    with torch.no_grad():
        ref = cpu(**_inputs("cpu", torch.float32))
        out = gpu(**_inputs("cuda", torch.bfloat16)).float().cpu()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel
