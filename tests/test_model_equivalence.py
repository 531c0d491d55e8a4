"""ditrun's FluxDiT against diffusers' FluxTransformer2DModel with the same random weights."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from launching import relative_error  # noqa: E402

from ditrun.model import FluxDiT, from_pretrained, random_model, save_pretrained  # noqa: E402
from ditrun.model.dit import DiTGeometry  # noqa: E402

CONFIGS = [
    dict(
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=48,
        pooled_projection_dim=24,
        guidance_embeds=True,
        axes_dims_rope=[8, 12, 12],
    ),
    dict(
        num_layers=1,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=6,
        joint_attention_dim=40,
        pooled_projection_dim=20,
        guidance_embeds=False,
        axes_dims_rope=[4, 6, 6],
    ),
]


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _inputs(cfg: dict, seed: int, n_img: int = 24, n_txt: int = 7):
    gen = torch.Generator().manual_seed(seed)
    img_ids = torch.stack([torch.zeros(n_img), torch.arange(n_img) // 6, torch.arange(n_img) % 6], dim=1)
    img_ids[n_img // 2 :, 0] = 1  # half the tokens play the Kontext reference image
    return dict(
        hidden_states=torch.randn(2, n_img, 64, generator=gen),
        encoder_hidden_states=torch.randn(2, n_txt, cfg["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(2, cfg["pooled_projection_dim"], generator=gen),
        timestep=torch.tensor([0.7, 0.2]),
        img_ids=img_ids,
        txt_ids=torch.zeros(n_txt, 3),
        guidance=torch.tensor([3.5, 2.0]) if cfg["guidance_embeds"] else None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=["guidance", "no-guidance"])
@pytest.mark.parametrize("shard", [None, 40_000], ids=["single-file", "sharded"])
def test_from_pretrained_matches_diffusers(cfg, shard, tmp_path):
    reference = diffusers.FluxTransformer2DModel(**cfg).eval()
    _randomise(reference, seed=1)
    reference.save_pretrained(tmp_path, max_shard_size=shard or "10GB", safe_serialization=True)
    if shard:
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = from_pretrained(tmp_path)
    inputs = _inputs(cfg, seed=2)
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
        got = ours(**inputs)
    assert got.shape == expected.shape
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.slow
def test_random_model_roundtrips_through_diffusers(tmp_path):
    """Our writer's folders load in diffusers too (same names, same numbers)."""
    geo = DiTGeometry(**{**CONFIGS[0], "axes_dims_rope": tuple(CONFIGS[0]["axes_dims_rope"])})
    ours = random_model(geo, seed=3)
    save_pretrained(ours, tmp_path)
    theirs = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path).eval()
    inputs = _inputs(CONFIGS[0], seed=4)
    with torch.no_grad():
        assert relative_error(ours(**inputs), theirs(**inputs, return_dict=False)[0]) <= 1e-5


@pytest.mark.slow
def test_krea3_variant_roundtrips_and_differs(tmp_path):
    base = DiTGeometry(**{**CONFIGS[0], "axes_dims_rope": tuple(CONFIGS[0]["axes_dims_rope"])})
    krea = DiTGeometry(**{**base.__dict__, "mlp": "swiglu", "attention_gate": True, "modulation_norm": "rms"})
    model = random_model(krea, seed=5)
    assert not krea.is_diffusers_flux
    names = dict(model.named_parameters())
    assert "transformer_blocks.0.attn.to_gate.weight" in names
    assert names["transformer_blocks.0.ff.net.0.proj.weight"].shape[0] == 2 * krea.mlp_hidden_dim
    save_pretrained(model, tmp_path, max_shard_bytes=50_000)
    loaded = from_pretrained(tmp_path)
    inputs = _inputs(CONFIGS[0], seed=6)
    with torch.no_grad():
        out = model(**inputs)
        assert torch.equal(loaded(**inputs), out)
        flux_out = random_model(base, seed=5)(**inputs)
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, flux_out)


def test_model_file_has_no_distributed_code():
    import ditrun.model.dit as dit

    source = open(dit.__file__).read()
    assert "torch.distributed" not in source.replace("nothing here imports ``torch.distributed``", "")
    assert isinstance(FluxDiT, type)
