"""Bad checkpoints fail with one sentence naming the file or the key."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditrun.model import CheckpointError, from_pretrained, random_model, save_pretrained
from ditrun.model.presets import PRESETS

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture()
def checkpoint(tmp_path):
    save_pretrained(random_model(PRESETS["tiny"], seed=0), tmp_path)
    return tmp_path


def _one_sentence(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message.endswith(".")
    return message


def test_good_checkpoint_loads_in_bf16(checkpoint):
    model = from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())


def test_missing_key(checkpoint):
    state = load_file(checkpoint / WEIGHTS)
    del state["single_transformer_blocks.1.proj_out.weight"]
    save_file(state, checkpoint / WEIGHTS)
    with pytest.raises(CheckpointError, match="missing tensor 'single_transformer_blocks.1.proj_out.weight'") as err:
        from_pretrained(checkpoint)
    _one_sentence(err)


def test_wrong_shape(checkpoint):
    state = load_file(checkpoint / WEIGHTS)
    state["x_embedder.weight"] = torch.zeros(128, 32)
    save_file(state, checkpoint / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"'x_embedder.weight'.*shape \(128, 32\).*\(128, 64\)") as err:
        from_pretrained(checkpoint)
    _one_sentence(err)


def test_unexpected_key(checkpoint):
    state = load_file(checkpoint / WEIGHTS)
    state["transformer_blocks.7.attn.to_q.weight"] = torch.zeros(2, 2)
    save_file(state, checkpoint / WEIGHTS)
    with pytest.raises(CheckpointError, match="'transformer_blocks.7.attn.to_q.weight' that this model does not"):
        from_pretrained(checkpoint)


def test_geometry_mismatch(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_attention_heads"] = 2
    config["attention_head_dim"] = 64
    config["axes_dims_rope"] = [16, 24, 24]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="shape"):
        from_pretrained(checkpoint)


def test_truncated_file(checkpoint):
    data = (checkpoint / WEIGHTS).read_bytes()
    (checkpoint / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable") as err:
        from_pretrained(checkpoint)
    assert WEIGHTS in str(err.value)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        from_pretrained(checkpoint)


def test_pickles_are_never_read(checkpoint):
    """A folder with only a PyTorch pickle is refused rather than unpickled."""
    (checkpoint / WEIGHTS).unlink()
    torch.save({"x": torch.zeros(1)}, checkpoint / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        from_pretrained(checkpoint)


def test_not_a_folder(tmp_path):
    with pytest.raises(CheckpointError, match="model.path="):
        from_pretrained(tmp_path / "nope")
