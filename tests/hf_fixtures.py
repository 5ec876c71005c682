"""Shared helpers for tests over the tiny Hugging Face checkpoints in `tests/data/hf`."""

import os

import numpy as np

from jaxrl.models.safetensors_io import read_header, read_tensor

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "hf")


def tensors_of(directory) -> dict[str, np.ndarray]:
    """Every tensor of every `*.safetensors` file in `directory`, by name."""
    out = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            for name, info in read_header(os.path.join(directory, file))[0].items():
                out[name] = read_tensor(info)
    return out
