"""ditrun: run and measure diffusion-transformer image-editing inference across GPUs and nodes."""

__version__ = "0.1.0"
