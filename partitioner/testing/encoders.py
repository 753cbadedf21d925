"""Text encoders that diffusers pipelines carry (``transformers`` models), tiny and random, each called as its
pipelines call it: ``ENCODERS[name]`` names the class, a tiny config and the call (token ids, a padding mask where
the pipeline passes one, ``output_hidden_states`` where it reads a middle layer). ``build(name)`` and
``inputs(name)`` are what the tests, ``benchmarks/models.py`` and the command line use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Encoder:
    name: str
    cls: str  # the transformers class
    config: str  # its config class
    sizes: dict  # a tiny config
    pipelines: str  # which pipelines carry it (for the table)
    masked: bool = True  # the pipeline passes an attention mask
    hidden_states: bool = False  # the pipeline reads hidden_states[-k]
    extra: dict = field(default_factory=dict)  # further call arguments


_T5 = dict(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
_CLIP = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             projection_dim=32, bos_token_id=0, eos_token_id=2, pad_token_id=1)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, head_dim=16)

ENCODERS: dict[str, Encoder] = {e.name: e for e in [
    Encoder("t5", "T5EncoderModel", "T5Config", _T5, "Flux, SD3, Mochi, LTX-Video, CogVideoX, Chroma, PixArt",
            masked=False),
    Encoder("umt5", "UMT5EncoderModel", "UMT5Config", _T5, "Wan, SkyReels-V2, ChronoEdit"),
    Encoder("clip", "CLIPTextModel", "CLIPTextConfig", _CLIP, "Flux, HunyuanVideo, Kandinsky 5", masked=False),
    Encoder("clip_projection", "CLIPTextModelWithProjection", "CLIPTextConfig", _CLIP, "SD3, SDXL",
            masked=False, hidden_states=True),
    Encoder("llama", "LlamaModel", "LlamaConfig", _DECODER, "HunyuanVideo, HiDream", hidden_states=True),
    Encoder("qwen2", "Qwen2Model", "Qwen2Config", _DECODER, "(Qwen2.5-VL's language model: Qwen-Image)",
            hidden_states=True),
    Encoder("qwen3", "Qwen3Model", "Qwen3Config", _DECODER, "Z-Image, Flux2 Klein", hidden_states=True),
    Encoder("gemma2", "Gemma2Model", "Gemma2Config", _DECODER, "Sana, Lumina2", hidden_states=True),
    Encoder("gemma3", "Gemma3TextModel", "Gemma3TextConfig", _DECODER, "(Gemma 3 text encoders)",
            hidden_states=True),
    Encoder("mistral", "MistralModel", "MistralConfig", _DECODER, "(Mistral's language model: Flux2)",
            hidden_states=True),
    Encoder("glm", "GlmModel", "GlmConfig", {**_DECODER, "pad_token_id": 1}, "CogView4", masked=False,
            hidden_states=True),
]}


def build(name: str) -> torch.nn.Module:
    """``ENCODERS[name]``, tiny, random (seed 0), float32, eval mode."""
    import transformers

    encoder = ENCODERS[name]
    config = getattr(transformers, encoder.config)(**encoder.sizes)
    torch.manual_seed(0)
    return getattr(transformers, encoder.cls)(config).eval()


def inputs(name: str, seed: int = 0, *, text: int = 7, pad: int = 2) -> tuple[tuple, dict]:
    """(args, kwargs) as the pipelines call ``ENCODERS[name]``: ``text`` token ids, the last ``pad`` of them padding
    where the pipeline passes a mask."""
    encoder = ENCODERS[name]
    g = torch.Generator().manual_seed(seed)
    kwargs: dict = {"input_ids": torch.randint(3, encoder.sizes["vocab_size"], (1, text), generator=g)}
    if encoder.masked:
        mask = torch.ones(1, text, dtype=torch.long)
        mask[:, text - pad:] = 0
        kwargs["attention_mask"] = mask
    if encoder.hidden_states:
        kwargs["output_hidden_states"] = True
    return (), {**kwargs, **encoder.extra}


def partition_case(rank: int, world: int, name: str, shape: tuple, names: tuple, sizes: dict | None = None) -> dict:
    """Partition encoder ``name`` on a ``shape``/``names`` DeviceMesh of the running ranks and compare every tensor
    of this rank's output (hidden states, the key/value cache a decoder returns) with the unpartitioned model's:
    ``{"status": "exact" | "wrong" | "refused", ...}`` as ``zoo_check.partition_case`` reports."""
    import warnings

    import torch.utils._pytree as pytree
    from torch.distributed.device_mesh import init_device_mesh

    from .. import partition
    from ..errors import PartitionerError

    model, (args, kwargs) = build(name), inputs(name, **(sizes or {}))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            partitioned = partition(model, mesh, (args, kwargs))
        got = partitioned.compile()(*args, **kwargs)
    except PartitionerError as error:
        return dict(status="refused", error_type=type(error).__name__,
                    message=" ".join(str(error).splitlines()[:2])[:500])
    with torch.no_grad():
        expected = model(*args, **kwargs)
    got_leaves, expected_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    if [type(x) for x in got_leaves] != [type(x) for x in expected_leaves]:
        return dict(status="wrong", message=f"{len(got_leaves)} output leaves, the model returns "
                                            f"{len(expected_leaves)}")
    pairs = [(g, e) for g, e in zip(got_leaves, expected_leaves) if isinstance(e, torch.Tensor)]
    error = max((g - e).abs().max().item() / max(e.abs().max().item(), 1.0) for g, e in pairs)
    report = partitioned.report()
    sharded, total = report.attentions_sharded or (0, len(partitioned.ctx.sequence_attention))
    return dict(status="exact" if error <= 1e-5 else "wrong", error=error, tensors=len(pairs),
                output_types=[type(v).__name__ for v in (got.values() if hasattr(got, "values") else [got])],
                replicated=report.replicated_share, attention_sharded=sharded, attentions=total,
                collectives={f"{kind}:{axis}": n for (kind, axis), n in partitioned.collective_counts().items()})
