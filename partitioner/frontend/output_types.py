"""Output types that hold tensors without being pytrees, registered so that torch.export can return them.

A VAE's ``encode`` returns a distribution over latents (diffusers' ``DiagonalGaussianDistribution``) whose every
tensor is computed from one: its ``parameters`` (mean and log-variance stacked along channels). It is flattened to
that tensor, so the traced graph returns it, and rebuilt from it after each call, its constructor deriving the
rest on the caller's side exactly as the model would have. Registered once, when diffusers is installed.
"""

from __future__ import annotations

import functools

import torch.utils._pytree as pytree


@functools.cache
def register_output_types() -> None:
    try:
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    except ImportError:
        return
    if DiagonalGaussianDistribution in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        DiagonalGaussianDistribution,
        lambda distribution: ([distribution.parameters], distribution.deterministic),
        lambda values, deterministic: DiagonalGaussianDistribution(values[0], deterministic),
        serialized_type_name="diffusers.DiagonalGaussianDistribution")
