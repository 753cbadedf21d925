"""Output types that hold tensors without being pytrees, registered so that torch.export can return them.

A VAE's ``encode`` returns a distribution over latents (diffusers' ``DiagonalGaussianDistribution``) whose every
tensor is computed from one: its ``parameters`` (mean and log-variance stacked along channels). It is flattened to
that tensor, so the traced graph returns it, and rebuilt from it after each call, its constructor deriving the
rest on the caller's side exactly as the model would have. Registered once, when diffusers is installed.

A ``transformers`` decoder (Llama, Qwen2, Gemma, Mistral: the text encoders of HunyuanVideo, Qwen-Image, Sana,
Lumina2) returns its key/value cache (a ``DynamicCache``) unless the call passes ``use_cache=False``, and some models
take one as an input. transformers' own export support registers it as a pytree of its keys and values, so the
partition returns (and takes) the cache exactly as the model does; registered when transformers is loaded.
"""

from __future__ import annotations

import functools
import sys

import torch.utils._pytree as pytree


def register_output_types() -> None:
    _register_diffusers_types()
    if "transformers" in sys.modules:  # (a transformers model is traced only once transformers is loaded)
        _register_transformers_cache()


@functools.cache
def _register_transformers_cache() -> None:
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:
        return
    register_dynamic_cache_export_support()


@functools.cache
def _register_diffusers_types() -> None:
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
