"""``parallelize(pipe, mesh)``: a whole diffusers pipeline on a mesh in one line, as ``enable_parallelism`` does.

Every denoiser component of the pipeline (``transformer``, and ``transformer_2`` / ``transformer_ref`` where a
pipeline has two experts; ``unet``) is swapped for a ``LazyPartition``: a stand-in for the model that partitions it
at its first call, with that call's inputs as the example (a pipeline's first denoising step), and serves every
later call (``PartitionedModule``: shape specialisations for other steps and requests). A transformer built on the
meta device is filled from ``checkpoint`` (each rank reads only its slices), so no rank ever holds the whole model.
The VAEs' ``decode`` and ``encode`` are partitioned over every rank of the mesh at their first call (``runtime.vae``).

The stand-in answers what pipelines and users read from a diffusers model: ``device`` (where the partition
computes), ``dtype``, ``config``, ``cache_context`` (diffusers' ``CacheMixin``: a no-op, as it is when no cache hook
is enabled), attention processors, the hooks offloading looks for, and every other attribute, from the model before
the first call and from its weightless skeleton (the model rebuilt on the meta device) after it. Methods that change
the weights or structure (fusing projections, LoRA adapters, ``to(dtype)``, ...) run on the model before the first
call; after it they raise ``AlreadyPartitioned`` saying to apply them before ``parallelize``.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import AlreadyPartitioned, InputError, NotFound, PartitionError

# Methods of a diffusers model that only read it: after partitioning they are answered by the model's skeleton. Any
# other method of the model (it may change weights or structure) is refused once the model is partitioned.
_READS = frozenset({
    "active_adapters", "get_memory_footprint", "num_parameters", "save_config", "to_json_file", "to_json_string",
    "_get_no_split_modules",
})
_DENOISER = re.compile(r"(transformer|unet|denoiser)(_\w+)?")
_VAE = re.compile(r"(\w+_)?vae")
_TEXT_ENCODER = re.compile(r"text_encoder(_\w+)?")


class LazyPartition(torch.nn.Module):
    """A stand-in for ``model`` that partitions it over ``mesh`` at its first call (that call's arguments are the
    example), then runs every call on the partitioned module. ``where`` names it in messages (``FluxPipeline
    .transformer``). Attribute reads go to the model until then, to its skeleton after."""

    def __init__(self, model: torch.nn.Module, mesh, *, checkpoint=None, backend: str = "eager",
                 compile_options: dict | None = None, where: str | None = None, call_defaults: dict | None = None,
                 **partition_options):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"parallelize needs a torch.nn.Module, got {type(model).__name__}")
        where = where or type(model).__name__
        if checkpoint is None and any(p.is_meta for p in model.parameters()):
            raise InputError(f"{where} ({type(model).__name__}) is on the meta device: give parallelize(..., "
                             "checkpoint=path) to load each rank's slices")
        state = self.__dict__  # not registered as submodules: the stand-in owns no parameters of its own
        state["_model"], state["_skeleton"], state["_module"] = model, None, None
        self._mesh, self._checkpoint, self._where = mesh, checkpoint, where
        self._backend, self._compile_options, self._options = backend, dict(compile_options or {}), partition_options
        self._model_name = type(model).__name__
        self._call_defaults = dict(call_defaults or {})  # arguments a call leaves out, given these values
        self.training = model.training

        def forward(*args, **kwargs):
            return self._call(*args, **kwargs)

        forward.__signature__ = inspect.signature(model.forward)
        forward.__doc__ = model.forward.__doc__
        self.forward = forward

    # --- what a pipeline reads -----------------------------------------------------------------------------------

    @property
    def partitioned(self):
        """The ``Partitioned`` of the traced shapes (None before the first call)."""
        return self._module.partitioned if self._module is not None else None

    @property
    def specializations(self) -> dict[str, str]:
        """The shape specialisations built for calls other than the traced one, and why (empty before)."""
        return dict(self._module.specializations) if self._module is not None else {}

    @property
    def partitions(self) -> list:
        """The traced shapes' ``Partitioned``, then each shape specialisation kept (empty before the first call)."""
        return self._module.partitions if self._module is not None else []

    @property
    def is_partitioned(self) -> bool:
        return self._module is not None

    @property
    def device(self) -> torch.device:
        """Where the partition computes: the model's device, or the mesh's for a model on the meta device."""
        if self._module is not None:
            return self._module.device
        parameter = next(self._model.parameters(), None)
        if parameter is not None and not parameter.is_meta:
            return parameter.device
        return _mesh_device(self._mesh)

    @property
    def dtype(self) -> torch.dtype:
        if self._module is not None:
            return self._module.dtype
        dtype = getattr(self._model, "dtype", None)  # a diffusers model's own answer (fp32 modules kept aside)
        if isinstance(dtype, torch.dtype):
            return dtype
        return next((p.dtype for p in self._model.parameters() if p.is_floating_point()), torch.float32)

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        """diffusers' ``CacheMixin.cache_context``: names the denoising call (``"cond"``, ``"uncond"``) for cache
        hooks. The partition runs no cache hook, so this is a no-op, as diffusers' is without one; before the first
        call a model with hooks gets its own context."""
        model = self._model
        outer, self.__dict__["_context"] = self.__dict__.get("_context"), name  # the guidance branch a call is in
        try:
            if model is not None and hasattr(model, "_diffusers_hook") and hasattr(model, "cache_context"):
                with model.cache_context(name, **kwargs):
                    yield
                return
            try:
                from diffusers.hooks.hooks import CacheContext
            except ImportError:
                CacheContext = None
            if CacheContext is not None:
                CacheContext(name, **kwargs)  # the same arguments as diffusers accepts
            yield
        finally:
            self.__dict__["_context"] = outer

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        """What a pipeline calls after its loop (``maybe_free_model_hooks``): resets the model's cache hooks, if any."""
        model = self._model
        if model is not None and hasattr(model, "_diffusers_hook") and hasattr(model, "_reset_stateful_cache"):
            model._reset_stateful_cache(recurse)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        state = self.__dict__
        target = state.get("_model")
        partitioned = target is None
        if partitioned:
            target = state.get("_skeleton")
        if target is None or (name.startswith("__") and name.endswith("__")):
            raise NotFound(f"'{type(self).__name__}' object has no attribute '{name}'")
        value = getattr(target, name)  # the model's own AttributeError when it has no such attribute
        if partitioned and inspect.ismethod(value) and value.__self__ is target and name not in _READS:
            return self._refusal(f"{name}()")
        return value

    def extra_repr(self) -> str:
        status = f"partitioned over {self.partitioned.mesh}" if self._module is not None else "partitions at its first call"
        return f"{self._model_name}, {status}"

    # --- what it cannot do once partitioned ----------------------------------------------------------------------

    def _refusal(self, what: str):
        message = (f"{self._where}.{what}: {self._model_name} is already partitioned (this rank holds its shards; "
                   "attribute reads are answered by its weightless skeleton), and this changes or needs the whole "
                   f"model's weights or structure. Apply it to the model before partitioner.parallelize(pipe, mesh) "
                   f"(or before the pipeline's first call, which partitions it)")

        def refuse(*args, **kwargs):
            raise AlreadyPartitioned(message)

        refuse.__name__ = what
        return refuse

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        model = self._model
        if model is not None:
            if any(p.is_meta for p in model.parameters()):  # its weights are loaded onto the mesh's device
                if dtype is not None:
                    model.to(dtype=dtype)
            else:
                model.to(*args, **kwargs)
            return self
        if dtype is not None and dtype != self.dtype:
            self._refusal(f"to({dtype})")()
        if device is not None and not _same_device(device, self.device):
            raise AlreadyPartitioned(
                f"{self._where}.to({device}): the partition's weights and process groups live on {self.device}. Move "
                f"the model before its first call (pipe.to(device) before the first request), or build the mesh on "
                f"{device.type}")
        return self

    def _apply(self, fn, recurse: bool = True):
        """``cuda()``, ``half()``, ``float()``, ...: the model's until the first call."""
        if self._model is None:
            self._refusal("cuda() / cpu() / half() / float() (a change of every tensor)")()
        self._model._apply(fn)
        return self

    def train(self, mode: bool = True):
        if self._model is not None:
            self._model.train(mode)
        elif mode:
            self._refusal("train()")()
        self.training = mode
        return self

    def state_dict(self, *args, **kwargs):
        if self._model is None:
            raise AlreadyPartitioned(f"{self._where}.state_dict(): after partitioning each rank holds only its shards "
                                     f"(pipe.{self._where.rsplit('.', 1)[-1]}.partitioned.state); take the model's "
                                     "state dict before partitioner.parallelize (or before the pipeline's first call)")
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self._model is None:
            self._refusal("load_state_dict() (use .partitioned.load_weights(checkpoint): each rank reads its "
                          "slices)")()
        return self._model.load_state_dict(state_dict, strict=strict, assign=assign)

    def save_pretrained(self, *args, **kwargs):
        model = self._model
        if model is None or any(p.is_meta for p in model.parameters()):
            raise AlreadyPartitioned(f"{self._where}.save_pretrained(): "
                                     + ("the model is partitioned: each rank holds only its shards" if model is None
                                        else "the model is on the meta device (its weights are read shard by shard)")
                                     + "; save it before partitioner.parallelize")
        return model.save_pretrained(*args, **kwargs)

    def holds_whole_model(self) -> bool:
        """Whether the model is still whole here (before the first call, with real weights)."""
        return self._model is not None and not any(p.is_meta for p in self._model.parameters())

    # --- the call ------------------------------------------------------------------------------------------------

    def _call(self, *args, **kwargs):
        if self._call_defaults:
            named = inspect.signature(self.forward).bind_partial(*args, **kwargs).arguments
            kwargs = {**{k: v for k, v in self._call_defaults.items() if k not in named}, **kwargs}
        if self._module is None:
            from ..api import partition

            model = self._model.train(self.training)  # traced in the mode the stand-in was put in
            pairs = self._pairs_guidance_calls(model, args, kwargs)
            options = {**{k: v for k, v in self._options.items() if k != "cfg"}, "cfg": "pairs" if pairs else
                       self._options.get("cfg", "batch")}
            partitioned = partition(model, self._mesh, (args, kwargs), **options)
            if self._checkpoint is not None:
                partitioned.load_weights(self._checkpoint)
            self.__dict__["_module"] = partitioned.compile(self._backend, **self._compile_options)
            if pairs:
                from .guidance_pairs import GuidancePairs

                self.__dict__["_pairs"] = GuidancePairs(self._module, inspect.signature(model.forward), self._where)
            # the partition holds this rank's shards; attribute reads go to the skeleton (the model rebuilt on meta)
            self.__dict__["_skeleton"] = partitioned.skeleton if partitioned.skeleton is not None else model
            self.__dict__["_model"] = None
        module = self._module.train(self.training)  # (another mode than the trace's is refused)
        pairs = self.__dict__.get("_pairs")
        if pairs is not None:
            return pairs.call(args, kwargs, self.__dict__.get("_context"))
        return module(*args, **kwargs)

    @property
    def guidance_pairs(self):
        """How a cfg axis serves a pipeline that calls the denoiser once per guidance branch (``GuidancePairs``:
        ``paired``, ``served``, ``calls``); None when the cfg axis splits each call's batch, or before the first
        call."""
        return self.__dict__.get("_pairs")

    def _pairs_guidance_calls(self, model, args, kwargs) -> bool:
        """Whether a cfg axis runs this denoiser's calls in guidance pairs: the call's batch is smaller than the axis,
        as a pipeline's that runs classifier-free guidance as one call per branch (conditional, then
        unconditional). A batch at least the axis's size splits as data parallelism does; a dp axis over a smaller
        batch is refused before any tracing (its ranks would compute the same rows)."""
        from ..mesh import BATCH_AXES

        sizes = _mesh_sizes(self._mesh)
        axis = next((name for name in sizes if name in BATCH_AXES and sizes[name] > 1), None)
        if self._options.get("cfg") is not None:  # asked for: "pairs", or "batch" (then refused if it cannot split)
            return self._options["cfg"] == "pairs"
        if axis is None:
            return False
        try:
            bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
        except TypeError:
            return False  # the call itself is wrong: partition says how
        name, value = next(((n, v) for n, v in bound.items() if isinstance(v, torch.Tensor) and v.dim() > 0),
                           (None, None))
        if value is None or value.shape[0] >= sizes[axis]:
            return False
        if axis == "cfg" and not isinstance(self._mesh, Mapping):
            return True
        owner = self._where.split(".")[0]
        raise PartitionError(
            f"{self._where}: the mesh's {axis}={sizes[axis]} axis splits the batch of each transformer call, and "
            f"{owner} calls {self._model_name} with a batch of {value.shape[0]} ({name}{list(value.shape)}): the "
            f"{axis} ranks would have no rows of their own. Drop {axis!r} from the mesh and give its devices to tp or "
            "ulysses" + ("; a cfg axis instead runs a pipeline's two guidance calls of a step at once" if axis != "cfg"
                         else ""))


def _mesh_sizes(mesh) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return dict(mesh)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return dict(zip(names, tuple(mesh.mesh.shape)))


def _mesh_device(mesh) -> torch.device:
    device_type = getattr(mesh, "device_type", "cpu")
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _same_device(wanted: torch.device, actual: torch.device) -> bool:
    return wanted.type == actual.type and (wanted.index is None or actual.index is None or wanted.index == actual.index)


# --- the pipeline ---------------------------------------------------------------------------------------------------

def denoisers(pipe) -> list[str]:
    """The pipeline's denoiser components: ``transformer``, ``transformer_2``, ``transformer_ref``, ``unet``, ... that
    hold a module (a pipeline's ``components``, or its attributes)."""
    return [name for name in _components(pipe) if _DENOISER.fullmatch(name) and isinstance(getattr(pipe, name, None),
                                                                            torch.nn.Module)]


def text_encoders(pipe) -> list[str]:
    """The pipeline's text encoders: ``text_encoder``, ``text_encoder_2``, ... that hold a module."""
    return [name for name in _components(pipe) if _TEXT_ENCODER.fullmatch(name)
            and isinstance(getattr(pipe, name, None), torch.nn.Module)]


def autoencoders(pipe) -> list[str]:
    """The pipeline's VAE components: ``vae``, and ``audio_vae`` and the like (H3 decodes video and audio)."""
    return [name for name in _components(pipe) if _VAE.fullmatch(name)
            and isinstance(getattr(pipe, name, None), torch.nn.Module)]


def _components(pipe) -> list[str]:
    components = getattr(pipe, "components", None)
    return list(components) if isinstance(components, Mapping) else list(vars(pipe))


def parallelize(pipe, mesh, *, component: str | list[str] | tuple[str, ...] | None = None, checkpoint=None,
                vae: bool = True, text_encoder: bool = False, **options):
    """Swap every denoiser of ``pipe`` (a ``DiffusionPipeline``, a ``ModularPipeline`` or any object holding the
    modules as attributes) for a ``LazyPartition`` over ``mesh``, and return the pipeline.

    ``component``: the component(s) to partition (default: every ``transformer*`` / ``unet*`` module).
    ``checkpoint``: where a model built on the meta device reads its slices: a model folder (one denoiser), a
    pipeline folder (each component from its subfolder) or ``{component: path}``. ``options`` go to ``partition``
    (``plan``, ``timeout``, ``buckets``, ...) and to ``LazyPartition`` (``backend``, ``compile_options``).
    ``vae``: also partition the decode and encode of ``pipe.vae`` (and ``audio_vae`` and the like) over every rank
    of the mesh, rows split along height (``runtime.vae``; on a DeviceMesh); ``False`` leaves them whole.
    ``text_encoder``: also partition every ``text_encoder*`` component (T5, CLIP, Llama, Qwen2.5-VL, Gemma ...) over
    the same mesh, as the denoisers are (they run once per prompt: whole, each rank holds all their weights).

    Every rank runs the pipeline with the same inputs (its own random state is not shared: seed every rank alike).
    The pipeline's ``config`` keeps naming the models' classes; ``save_pretrained`` saves the pipeline while its
    models are still whole (before the first call) and is refused after, naming the component."""
    names = [component] if isinstance(component, str) else list(component) if component is not None else denoisers(pipe)
    if text_encoder:
        names += [name for name in text_encoders(pipe) if name not in names]
    owner = type(pipe).__name__
    if not names:
        modules = [name for name, value in (pipe.components.items() if isinstance(getattr(pipe, "components", None),
                                                                                 Mapping) else vars(pipe).items())
                   if isinstance(value, torch.nn.Module)]
        raise InputError(f"{owner} has no denoiser component (transformer, transformer_2, unet, ...) holding a module; "
                         f"its modules are {modules}: name the one to parallelize with component=")
    for name in names:
        model = getattr(pipe, name, None)
        if isinstance(model, LazyPartition):
            raise InputError(f"{owner}.{name} is already parallelized; call parallelize once per pipeline")
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"{owner} has no module {name!r} to parallelize (it holds {type(model).__name__}); "
                             f"its denoisers are {denoisers(pipe)}: name one with component=")
    # a pipeline encodes each prompt once and reads no key/value cache: a decoder text encoder is called without one
    # (returning it would keep its keys and values whole on every rank under tp)
    no_cache = {name: {"use_cache": False} for name in names if _TEXT_ENCODER.fullmatch(name)
                and "use_cache" in inspect.signature(getattr(pipe, name).forward).parameters}
    stand_ins = {name: LazyPartition(getattr(pipe, name), mesh, where=f"{owner}.{name}",
                                     checkpoint=_checkpoint_for(checkpoint, name, names, owner),
                                     call_defaults=no_cache.get(name), **options)
                 for name in names}
    for name, lazy in stand_ins.items():
        if isinstance(pipe, torch.nn.Module):
            setattr(pipe, name, lazy)
        else:  # a diffusers pipeline's config keeps the model's class (its setattr would record the stand-in's)
            object.__setattr__(pipe, name, lazy)
    if vae:
        from .vae import partition_vae

        for name in autoencoders(pipe):
            partition_vae(getattr(pipe, name), mesh, f"{owner}.{name}",
                          **{k: v for k, v in options.items() if k in ("backend", "compile_options", "timeout")})
    _guard_save(pipe)
    return pipe


def _checkpoint_for(checkpoint, name: str, names: list[str], owner: str):
    if checkpoint is None:
        return None
    if isinstance(checkpoint, Mapping):
        return checkpoint.get(name)
    path = Path(checkpoint)
    pipeline_folder = any((path / index).exists() for index in ("model_index.json", "modular_model_index.json"))
    if (path / name).is_dir() and (pipeline_folder or len(names) > 1):
        return str(path / name)
    if len(names) > 1:
        raise InputError(f"checkpoint={checkpoint!s} has no subfolder per denoiser of {owner} ({names}): give the "
                         "pipeline's folder or {component: path}")
    return checkpoint


def _guard_save(pipe) -> None:
    """The pipeline's ``save_pretrained`` saves the whole models while every stand-in still holds one; afterwards it
    is refused (diffusers would skip a module of an unknown class and record the component as missing)."""
    original = getattr(pipe, "save_pretrained", None)
    if original is None or isinstance(pipe, torch.nn.Module) or hasattr(original, "__wrapped__"):
        return
    owner = type(pipe).__name__

    def save_pretrained(*args, **kwargs):
        stand_ins = {name: value for name, value in vars(pipe).items() if isinstance(value, LazyPartition)}
        partitioned = [name for name, lazy in stand_ins.items() if not lazy.holds_whole_model()]
        if partitioned:
            raise AlreadyPartitioned(f"{owner}.save_pretrained(): {', '.join(partitioned)} "
                                     f"{'is' if len(partitioned) == 1 else 'are'} partitioned (each rank holds only "
                                     "its shards) or on the meta device; save the pipeline before "
                                     "partitioner.parallelize")
        for name, lazy in stand_ins.items():
            object.__setattr__(pipe, name, lazy._model)
        try:
            return original(*args, **kwargs)
        finally:
            for name, lazy in stand_ins.items():
                object.__setattr__(pipe, name, lazy)

    save_pretrained.__wrapped__ = original
    save_pretrained.__doc__ = original.__doc__
    object.__setattr__(pipe, "save_pretrained", save_pretrained)
