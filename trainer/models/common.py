"""Functions every adapter shares: dtypes, LoRA / full / IP-Adapter fine-tuning set-up, the reference
network, saving and loading trainable weights, the text path (per-prompt embeddings, computed or read from a
precomputed store), the VAE posteriors of image inputs (per distinct input, computed or read from a
precomputed store), CFG arithmetic and the validation of per-item image inputs.

Adapters compose these functions instead of inheriting from a base class, so each adapter file still reads
top to bottom as one model family's story.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeInt, PositiveInt
from trainer.models.base import ImageInputs

if TYPE_CHECKING:
    from trainer.models.ip_adapter import IPAdapter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

LORA_WEIGHTS = "adapter_model.safetensors"
LORA_CONFIG = "adapter_config.json"


@dataclass
class LoraSettings:
    """LoRA on the attention projections (peft); the disabled adapter is the reference policy."""

    rank: PositiveInt = 32
    """Adapter rank: capacity of the update; 32-64 is common for SD3/FLUX RL."""
    alpha: PositiveInt = 64
    """Scale numerator: the update is scaled by alpha / rank."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module names that get adapters; attention projections as in Flow-GRPO."""


@dataclass
class DiffusersModelConfig:
    """Fields every adapter's config has; each adapter's config subclasses it, setting its own ``name``
    and defaults and adding its own fields."""

    name: str = ""
    """Registry name of the adapter (``trainer.models.MODELS``)."""
    path: str = ""
    """Local diffusers-format directory of the weights (model_index.json and one folder per component)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and forward dtype of the denoiser, encoders and VAE; sampler math is float32 regardless. Trained
    LoRA / IP-Adapter weights stay float32 (the optimizer's precision); full fine-tuning in bf16/fp16 needs
    float32 master weights from the backend (zero2/zero3, or float32 here with fsdp2's param_dtype). fp16
    backward passes are loss-scaled."""
    resolution: NonNegativeInt = 0
    """Image side in pixels; 0 takes the model's default (its sample size times the VAE factor)."""
    lora: LoraSettings | None = None
    """LoRA settings; None trains the full denoiser (and a frozen copy serves as reference), or nothing of it
    when a trainable IP-Adapter (``ip_adapter.trainable``) is the policy."""
    gradient_checkpointing: bool = False
    """Recompute block activations in backward: less memory, about 30% more compute."""
    cudnn_attention: bool = False
    """Let PyTorch run attention with cuDNN's fused kernels on CUDA (its default there). Off by default: their
    backward gave NaN gradients for FLUX models (bench/RESULTS_GPU.md); flash and memory-efficient attention
    remain."""
    negative_prompt: str = ""
    """The prompt of CFG's unconditional branch (the pipelines' default: the empty prompt)."""
    text_embeddings: str = ""
    """Directory written by ``python -m trainer.precompute``: prompt embeddings are read from it and the text
    encoders and tokenizers are not loaded at all (FLUX's T5 and Qwen-Image's Qwen2.5-VL take 9-16 GB).
    "" encodes prompts with the model's own text encoders."""
    image_latents: str = ""
    """Directory written by ``python -m trainer.precompute --latents DIR``: the VAE posteriors of the dataset's
    image inputs (flux_fill's and sd15_inpaint's masked image, flux_kontext's reference), read instead of
    VAE-encoding the same images at every rollout; an input not in it is encoded (the VAE stays loaded:
    rollouts decode with it). Adapters that VAE-encode no image input refuse it. "" encodes every input."""


def denoiser_config(cls: type, config: Any, subfolder: str, label: str) -> dict[str, Any]:
    """The config diffusers saved for the denoiser in ``model.path``'s ``subfolder``, once it is known to be a
    ``cls``'s: a directory of no diffusers model, or of another model, fails with a message naming the fix
    (diffusers would report a weight of the wrong shape instead, or load it). Read before any weight, so that
    an adapter can check what it will feed the denoiser without loading billions of parameters first."""
    file = Path(config.path) / subfolder / "config.json"
    if not file.is_file():
        raise ValueError(f"model.path={config.path!r} is not a diffusers {label} directory (no {subfolder}/config.json); "
                         "point model.path at a local copy of the weights")
    saved = json.loads(file.read_text())
    if saved.get("_class_name") != cls.__name__:
        raise ValueError(f"model.path={config.path!r} holds a {saved.get('_class_name')} in {subfolder}/, and "
                         f"model.name={config.name} loads a {cls.__name__}: point model.path at a {label} directory, "
                         "or set model.name to the adapter of the model there")
    return saved


def load_denoiser(cls: type, config: Any, subfolder: str, label: str, **load: Any) -> nn.Module:
    """``cls.from_pretrained(model.path, subfolder=...)`` once ``denoiser_config`` accepts the directory."""
    denoiser_config(cls, config, subfolder, label)
    return cls.from_pretrained(Path(config.path), subfolder=subfolder, **load)


def freeze(*modules: nn.Module | None) -> None:
    """No gradients and eval mode (dropout off) for frozen encoders and VAEs; ``None`` entries are skipped."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False).eval()


def _trains_ip(ip_adapter: IPAdapter | None) -> bool:
    return ip_adapter is not None and ip_adapter.settings.trainable


def prepare_denoiser(denoiser: nn.Module, lora: LoraSettings | None, gradient_checkpointing: bool,
                     ip_adapter: IPAdapter | None = None) -> None:
    """Make ``denoiser`` trainable as configured: LoRA adapters on a frozen base, or every weight (full
    fine-tuning), or no base weight when a trainable IP-Adapter is the policy. The IP-Adapter's own weights
    train exactly when its settings say so."""
    denoiser.requires_grad_(lora is None and not _trains_ip(ip_adapter))
    if lora is not None:
        from peft import LoraConfig

        denoiser.add_adapter(LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, init_lora_weights="gaussian", target_modules=lora.target_modules,
        ))
    if ip_adapter is not None:
        for p in ip_adapter.parameters():
            p.requires_grad_(ip_adapter.settings.trainable)
    if lora is not None or _trains_ip(ip_adapter):
        _train_in_float32(denoiser, ip_adapter)
    if gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _train_in_float32(denoiser: nn.Module, ip_adapter: IPAdapter | None) -> None:
    """Store the trainable LoRA / IP-Adapter weights in float32 when ``model.dtype`` is bf16 or fp16, the base
    staying in that dtype (what peft's ``autocast_adapter_dtype`` does). An optimizer updates a weight in its
    own dtype: in bf16, Adam steps below 1/256 of the weight round away (most of LoRA's A at lr 1e-4); in
    fp16, Adam's eps underflows to 0 and the first step turns every weight NaN. LoRA layers cast their input
    to their weights' dtype and their output back (peft); the IP-Adapter's trainable layers get the same."""
    trainable = [p for p in denoiser.parameters() if p.requires_grad and p.dtype in LOW_PRECISION]
    if not trainable:
        return
    for p in trainable:
        p.data = p.data.float()
    if _trains_ip(ip_adapter):
        for layer in ip_adapter.trainable_layers():
            ComputeInWeightDtype(layer)


class ComputeInWeightDtype:
    """Forward hooks on ``layer``: its floating inputs cast to its weights' dtype at call time (float32 here;
    bf16 where a parallel engine casts the weights for compute), its output back to the first input's dtype."""

    def __init__(self, layer: nn.Module):
        self.activation_dtype: torch.dtype | None = None
        layer.register_forward_pre_hook(self.cast_inputs)
        layer.register_forward_hook(self.cast_output)

    def cast_inputs(self, layer: nn.Module, args: tuple) -> tuple:
        self.activation_dtype = args[0].dtype
        dtype = next(layer.parameters()).dtype
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    def cast_output(self, layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.activation_dtype)


def frozen_copy(denoiser: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy (one process; a parallel backend passes its own ``frozen_copy``, which
    can gather sharded weights)."""
    return copy.deepcopy(denoiser).requires_grad_(False).eval()


Shards = Callable[[list[nn.Parameter]], list[torch.Tensor]] | None
"""A backend's ``local_shards``: the tensors holding this rank's part of each parameter."""


def reference_network(denoiser: nn.Module, lora: LoraSettings | None, ip_adapter: IPAdapter | None = None,
                      copy_fn: Callable[[nn.Module], nn.Module] = frozen_copy,
                      shards: Shards = None) -> nn.Module:
    """The policy as it is now, frozen. LoRA: the same network with its adapter disabled (no extra memory).
    A trainable IP-Adapter: its weights copied now and swapped in at every call (costs only their memory; with
    ``shards``, the backend's ``local_shards`` where its forward gathers the weights from its own shards, the
    copy is of this rank's shards and is written into them). Full fine-tuning: ``copy_fn(denoiser)``, a frozen
    copy of the weights (costs one more denoiser)."""
    if lora is None and not _trains_ip(ip_adapter):
        return copy_fn(denoiser)
    names = set(ip_adapter.parameter_names) if _trains_ip(ip_adapter) else set()
    named = [(name, p) for name, p in denoiser.named_parameters() if name in names]
    if not named:
        return FrozenView(denoiser, lora is not None, {})
    values = shards([p for _, p in named]) if shards is not None else [p.detach() for _, p in named]
    frozen = {name: value.clone() for (name, _), value in zip(named, values, strict=True)}
    return FrozenView(denoiser, lora is not None, frozen, shards)


class FrozenView(nn.Module):
    """Calls ``net`` with its LoRA adapters switched off (``lora``) and the parameters named in ``frozen``
    replaced by those tensors: through ``torch.func.functional_call``, or, with ``shards`` (the backend's
    ``local_shards``: FSDP2 and ZeRO-3 compute with weights gathered from each rank's shards, which a
    functional call cannot replace), by writing them into this rank's shards for the call and back after it."""

    def __init__(self, net: nn.Module, lora: bool, frozen: dict[str, torch.Tensor], shards: Shards = None):
        super().__init__()
        self.net, self.lora, self.shards = net, lora, shards
        self.frozen = frozen
        """Parameter name -> the tensor swapped in for it (this rank's shard of it with ``shards``): the
        reference's own state, which checkpoints keep."""
        if shards is not None:  # the same parameter objects for the whole run (their shards are updated in place)
            params = dict(net.named_parameters())
            self._swapped = [params[name] for name in frozen]

    def forward(self, *args, **kwargs):
        if self.lora:
            self.net.disable_adapters()
        try:
            if not self.frozen:
                return self.net(*args, **kwargs)
            if self.shards is None:
                return torch.func.functional_call(self.net, self.frozen, args, kwargs, strict=False)
            with self._written_into_shards():
                return self.net(*args, **kwargs)
        finally:
            if self.lora:
                self.net.enable_adapters()

    @contextlib.contextmanager
    def _written_into_shards(self) -> Iterator[None]:
        # The policy's forward computed with gathered copies of its weights (FSDP2's unsharded parameters,
        # ZeRO-3's gathered ones), and its backward gathers them again: the shards may change in between.
        with torch.no_grad():
            targets = self.shards(self._swapped)
            live = [t.clone() for t in targets]
            for target, value in zip(targets, self.frozen.values(), strict=True):
                target.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for target, value in zip(targets, live, strict=True):
                    target.copy_(value)


def save_trainable(denoiser: nn.Module, lora: bool, directory: str, ip_adapter: IPAdapter | None = None) -> None:
    """LoRA: ``adapter_model.safetensors`` + ``adapter_config.json`` (peft format); a trainable IP-Adapter:
    ``ip_adapter.safetensors`` (see ``trainer.models.ip_adapter``); otherwise the whole denoiser with
    ``save_pretrained``."""
    os.makedirs(directory, exist_ok=True)
    if _trains_ip(ip_adapter):
        ip_adapter.save(directory)
    if not lora:
        if not _trains_ip(ip_adapter):
            denoiser.save_pretrained(directory)
        return
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(denoiser).items()}
    save_file(state, os.path.join(directory, LORA_WEIGHTS))
    peft_config = denoiser.peft_config["default"].to_dict()
    peft_config["target_modules"] = sorted(peft_config["target_modules"])
    with open(os.path.join(directory, LORA_CONFIG), "w") as f:
        json.dump(peft_config, f, indent=2, default=str)


def load_trainable(denoiser: nn.Module, lora: bool, directory: str, ip_adapter: IPAdapter | None = None) -> None:
    """Load what ``save_trainable`` wrote into ``denoiser`` in place; a mismatch raises a ValueError."""
    if _trains_ip(ip_adapter):
        ip_adapter.load(directory)
    if not lora:
        if not _trains_ip(ip_adapter):
            _load_full(denoiser, directory, ip_adapter)
        return
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = os.path.join(directory, LORA_WEIGHTS)
    if not os.path.isfile(path):
        raise ValueError(f"{directory!r} holds no LoRA weights ({LORA_WEIGHTS}); was it saved with LoRA on?")
    state = load_file(path)
    expected = get_peft_model_state_dict(denoiser)
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in state):
        raise ValueError(f"LoRA weights in {directory!r} do not match this model's adapter (different "
                         "target_modules or rank than model.lora)")
    set_peft_model_state_dict(denoiser, state)


def _load_full(denoiser: nn.Module, directory: str, ip_adapter: IPAdapter | None) -> None:
    """The whole denoiser from ``save_pretrained`` output; a frozen IP-Adapter keeps its loaded weights."""
    loaded = type(denoiser).from_pretrained(directory, torch_dtype=denoiser.dtype)
    missing, unexpected = denoiser.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) != set(ip_adapter.parameter_names if ip_adapter else ()):
        raise ValueError(f"the denoiser saved in {directory!r} is another architecture than model.path's")


# --- the text path ---------------------------------------------------------------------------------------
TEXT_INDEX = "index.json"
PRECOMPUTE = "python -m trainer.precompute --config CONFIG.yaml --out DIR"


def load_text_components(adapter_class: type, config: DiffusersModelConfig, device: torch.device) -> dict[str, Any]:
    """The adapter's text encoders and tokenizers (``adapter_class.text_components``: subfolder -> class)
    from ``config.path``, encoders frozen on ``device``; all None when ``config.text_embeddings`` is set.
    Subfolders in ``adapter_class.optional_text`` may be absent (None)."""
    if config.text_embeddings:
        return dict.fromkeys(adapter_class.text_components)
    path = Path(config.path)
    components: dict[str, Any] = {}
    for sub, cls in adapter_class.text_components.items():
        if not (path / sub).is_dir():
            if sub in adapter_class.optional_text:
                components[sub] = None
                continue
            raise ValueError(f"model.path={config.path!r} has no {sub}/ (a diffusers directory of this model)")
        if issubclass(cls, nn.Module):
            components[sub] = cls.from_pretrained(path, subfolder=sub, torch_dtype=DTYPES[config.dtype]).to(device)
            freeze(components[sub])
        else:
            components[sub] = cls.from_pretrained(path, subfolder=sub)
    return components


def text_pipeline(adapter_class: type, config: DiffusersModelConfig, device: torch.device, **extra: Any):
    """``adapter_class.pipeline_class`` holding only the text encoders, tokenizers and ``extra``; every other
    component None (``encode_prompt`` needs no more). What ``trainer.precompute`` encodes with."""
    params = inspect.signature(adapter_class.pipeline_class.__init__).parameters
    required = [n for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty]
    text = load_text_components(adapter_class, config, device)
    return adapter_class.pipeline_class(**{**dict.fromkeys(required), **text, **extra})


def prompt_encoder(adapter_class: type, config: DiffusersModelConfig, device: torch.device | str,
                   **extra: Any) -> Callable[[str], dict[str, torch.Tensor]]:
    """The adapter's text path alone (text encoders and tokenizers; no denoiser or VAE is loaded) as a
    function: prompt -> the tensors its ``encode_prompts`` caches for that prompt. Adapters expose it as the
    classmethod ``prompt_encoder(config, device)``; ``trainer.precompute`` runs it."""
    device = torch.device(device)
    pipeline = text_pipeline(adapter_class, replace(config, text_embeddings=""), device, **extra)
    return functools.partial(adapter_class.encode_text, pipeline, config, device)


def text_fingerprint(adapter_class: type, config: DiffusersModelConfig) -> str:
    """sha256 over what decides the text embeddings without loading a text encoder: the text component
    classes, the config fields ``adapter_class.text_settings`` (dtype, max_sequence_length), and per file of
    the text subfolders its name, size and the sha256 of its last MiB (whole configs and tokenizers; weight
    files by a tail of their tensor data, cheap for a 9 GB T5)."""
    digest = hashlib.sha256(json.dumps({
        "components": {sub: cls.__name__ for sub, cls in adapter_class.text_components.items()},
        "settings": {name: getattr(config, name) for name in adapter_class.text_settings},
    }, sort_keys=True).encode())
    _hash_files(digest, Path(config.path), adapter_class.text_components)
    return digest.hexdigest()


def _hash_files(digest, root: Path, subfolders: Iterable[str]) -> None:
    """Add each file of ``root / sub`` to ``digest``: its name, size and the sha256 of its last MiB."""
    for sub in sorted(subfolders):
        for file in sorted(p for p in (root / sub).rglob("*") if p.is_file()):
            size = file.stat().st_size
            with open(file, "rb") as f:
                f.seek(max(0, size - 2**20))
                tail = hashlib.sha256(f.read()).hexdigest()
            digest.update(f"{file.relative_to(root)}:{size}:{tail}".encode())


def read_index(setting: str, index_file: Path, fingerprint: str, other: str, covers: str, command: str) -> dict:
    """A precomputed store's index, or a ValueError naming ``setting`` and the ``command`` that writes it when
    the index is missing or was made for ``other`` (a fingerprint over ``covers``) than this model."""
    if not index_file.is_file():
        raise ValueError(f"{setting} holds no {index_file.name}; write it with {command}")
    index = json.loads(index_file.read_text())
    if index["fingerprint"] != fingerprint:
        raise ValueError(f"{setting} was computed for {other} or settings (its fingerprint {index['fingerprint'][:12]}, "
                         f"this model's {fingerprint[:12]}: {covers}); recompute it for this model.path with {command}")
    return index


INDEX_SAVE_EVERY = 256
"""Entries a precomputing store adds between two writes of its index: what a killed ``trainer.precompute``
recomputes at most (an exception saves the index as it unwinds)."""


def index_to_extend(directory: str, name: str, fingerprint: str, refusal: str) -> dict | None:
    """The index ``name`` of a store being written in ``directory`` (created when missing), None for a new
    store; a ValueError with ``refusal`` when it was written for another ``fingerprint``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / name).is_file():
        return None
    index = json.loads((out / name).read_text())
    if index["fingerprint"] != fingerprint:
        raise ValueError(refusal)
    return index


def write_index(file: Path, index: dict) -> None:
    """Write a store's index atomically: a reader sees the old index or the new one, never a part."""
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(json.dumps(index, indent=0, ensure_ascii=False))
    os.replace(tmp, file)


class TextEmbeddingStore:
    """Precomputed text embeddings (``python -m trainer.precompute``) in one directory: ``index.json``
    = {"fingerprint": ``text_fingerprint`` of the model, "prompts": {prompt: file}}, and per prompt a
    safetensors file named by the sha256 of the prompt, holding the tensors the adapter caches for it by name.
    ``open`` reads a store for training; ``create`` starts or extends one for ``trainer.precompute``."""

    save_every = INDEX_SAVE_EVERY

    def __init__(self, directory: str, fingerprint: str, files: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.files: dict[str, str] = dict(files or {})
        self._unsaved = 0

    @classmethod
    def open(cls, directory: str, fingerprint: str) -> TextEmbeddingStore:
        """The store in ``directory`` for training; a missing index or another fingerprint is refused."""
        index = read_index(f"model.text_embeddings={directory!r}", Path(directory) / TEXT_INDEX, fingerprint,
                           "other text encoders", "text encoder files, dtype, max_sequence_length", PRECOMPUTE)
        return cls(directory, fingerprint, index["prompts"])

    @classmethod
    def create(cls, directory: str, fingerprint: str) -> TextEmbeddingStore:
        """The store in ``directory`` (created when missing); one of another fingerprint is refused."""
        index = index_to_extend(directory, TEXT_INDEX, fingerprint, f"--out {directory!r} holds embeddings of other "
                                "text encoders or settings; choose another directory")
        return cls(directory, fingerprint, index["prompts"] if index else None)

    def missing(self, prompts: Iterable[str]) -> list[str]:
        """The distinct prompts of ``prompts`` that the store lacks, in order."""
        return [p for p in dict.fromkeys(prompts) if p not in self.files]

    def load(self, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if prompt not in self.files:
            raise ValueError(f"prompt {prompt!r} is not in model.text_embeddings={str(self.directory)!r} "
                             f"({len(self.files)} prompts); add it to the dataset and rerun {PRECOMPUTE}")
        return load_file(self.directory / self.files[prompt], device=str(device))

    def add(self, prompt: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write the tensors of ``prompt``; the index lists it from the next ``save`` (one every ``save_every``
        additions)."""
        from safetensors.torch import save_file

        name = hashlib.sha256(prompt.encode()).hexdigest() + ".safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, self.directory / name)
        self.files[prompt] = name
        self._unsaved += 1
        if self._unsaved >= self.save_every:
            self.save()

    def save(self) -> None:
        write_index(self.directory / TEXT_INDEX, {"fingerprint": self.fingerprint, "prompts": self.files})
        self._unsaved = 0


class PromptEmbeddings:
    """Text embeddings per prompt (tensor name -> tensor), cached by prompt text: computed by ``encode`` one
    prompt per forward (an embedding must not depend on which prompts it was batched with: the rounding of
    batched matmuls does, and a resumed run would drift from the uninterrupted one), or read from a
    ``TextEmbeddingStore`` when the adapter runs without text encoders."""

    def __init__(self, encode: Callable[[str], dict[str, torch.Tensor]] | None, store: TextEmbeddingStore | None,
                 device: torch.device):
        assert (encode is None) != (store is None)
        self.encode, self.store, self.device = encode, store, device
        self.cache: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, adapter, config: DiffusersModelConfig) -> PromptEmbeddings:
        """From ``config.text_embeddings`` when set (checked against the model's fingerprint), else encoded with
        ``type(adapter).encode_text`` on the adapter's pipeline."""
        if config.text_embeddings:
            store = TextEmbeddingStore.open(config.text_embeddings, text_fingerprint(type(adapter), config))
            return cls(None, store, adapter.device)
        return cls(lambda p: type(adapter).encode_text(adapter.pipeline, config, adapter.device, p), None,
                   adapter.device)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        for p in sorted({p for p in prompts if p not in self.cache}):
            self.cache[p] = self.store.load(p, self.device) if self.store is not None else self.encode(p)
        return [self.cache[p] for p in prompts]

    def missing(self, prompts: Iterable[str]) -> list[str]:
        """The distinct prompts of ``prompts`` that cannot be encoded: those not in the store read; none when
        the text encoders encode."""
        return self.store.missing(prompts) if self.store is not None else []

    def cat(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Every tensor of ``prompts`` concatenated along the batch dimension."""
        embeds = self(prompts)
        return {name: torch.cat([e[name] for e in embeds]) for name in embeds[0]}

    def clear(self) -> None:
        self.cache.clear()


# --- VAE latents of image inputs ---------------------------------------------------------------------
LATENT_INDEX = "index.json"
PRECOMPUTE_LATENTS = "python -m trainer.precompute --config CONFIG.yaml --latents DIR"
logger = logging.getLogger("rewardflow.latents")


def vae_fingerprint(config: DiffusersModelConfig) -> str:
    """sha256 over what decides a VAE posterior besides the VAE input itself (which keys the store): the
    files of ``vae/`` (its class and config included; hashed as ``text_fingerprint`` hashes files), ``dtype``
    and ``resolution``. The resolution changes only the inputs, so a store of another resolution would just
    miss every input; it is in the fingerprint to refuse such a store instead."""
    digest = hashlib.sha256(json.dumps({"dtype": config.dtype, "resolution": config.resolution}).encode())
    _hash_files(digest, Path(config.path), ["vae"])
    return digest.hexdigest()


def vae_input_key(x: torch.Tensor) -> str:
    """sha256 of one VAE input (a CPU tensor): its dtype, shape and bytes."""
    digest = hashlib.sha256(f"{x.dtype}{tuple(x.shape)}".encode())
    digest.update(x.contiguous().flatten().view(torch.uint8).numpy())
    return digest.hexdigest()


class LatentStore:
    """Precomputed VAE posteriors (``python -m trainer.precompute --latents DIR``) in one directory:
    ``index.json`` = {"fingerprint": ``vae_fingerprint`` of the model, "keys": [...]}, and per VAE input a
    safetensors file named by its ``vae_input_key``, holding ``parameters``: the posterior's mean and
    log-variance as the VAE returns them, so that its mode and a sample of it both equal the live ones.
    ``open`` reads a store for training; ``create`` starts or extends one for ``trainer.precompute``."""

    save_every = INDEX_SAVE_EVERY

    def __init__(self, directory: str, fingerprint: str, keys: Iterable[str] = ()):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.keys = set(keys)
        self._unsaved = 0

    @classmethod
    def open(cls, directory: str, fingerprint: str) -> LatentStore:
        """The store in ``directory`` for training; a missing index or another fingerprint is refused."""
        index = read_index(f"model.image_latents={directory!r}", Path(directory) / LATENT_INDEX, fingerprint,
                           "another VAE", "VAE files, dtype, resolution", PRECOMPUTE_LATENTS)
        return cls(directory, fingerprint, index["keys"])

    @classmethod
    def create(cls, directory: str, fingerprint: str) -> LatentStore:
        """The store in ``directory`` (created when missing); one of another fingerprint is refused."""
        index = index_to_extend(directory, LATENT_INDEX, fingerprint, f"--latents {directory!r} holds latents of "
                                "another VAE or settings; choose another directory")
        return cls(directory, fingerprint, index["keys"] if index else ())

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def load(self, key: str, device: torch.device) -> torch.Tensor:
        """The parameters of input ``key``, [1, 2C, ...] on ``device``."""
        from safetensors.torch import load_file

        return load_file(self.directory / f"{key}.safetensors", device=str(device))["parameters"][None]

    def add(self, key: str, parameters: torch.Tensor) -> None:
        """Write the parameters [1, 2C, ...] of input ``key``; the index lists it from the next ``save`` (one
        every ``save_every`` additions)."""
        from safetensors.torch import save_file

        save_file({"parameters": parameters[0].detach().cpu().contiguous()}, self.directory / f"{key}.safetensors")
        self.keys.add(key)
        self._unsaved += 1
        if self._unsaved >= self.save_every:
            self.save()

    def save(self) -> None:
        write_index(self.directory / LATENT_INDEX, {"fingerprint": self.fingerprint, "keys": sorted(self.keys)})
        self._unsaved = 0


def refuse_image_latents(model: str, config: DiffusersModelConfig) -> None:
    """ValueError when ``model.image_latents`` is set for an adapter that VAE-encodes no image input."""
    if config.image_latents:
        raise ValueError(f"model.image_latents is set, but the {model} adapter VAE-encodes no image input "
                         "(flux_fill, flux_kontext and sd15_inpaint do); unset it")


class ImageLatents:
    """VAE posteriors of image inputs: for a batch ``x`` of VAE inputs, what ``vae.encode(x).latent_dist``
    gives, but computed per distinct input, each in its own forward. A group's repeats of an item are
    encoded once, and an input's latents do not depend on its batch-mates (the rounding of batched
    convolutions can), so a store hit equals the live encode bit for bit and a resumed run the uninterrupted
    one. Inputs in ``store`` are read from it, the others encoded, and with ``record`` added to it (what
    ``trainer.precompute`` does). ``hits`` and ``misses`` count the inputs read and encoded (a repeat
    within a call counts once); a training run's first miss logs a warning."""

    def __init__(self, vae: nn.Module, store: LatentStore | None, record: bool = False):
        assert store is not None or not record
        self.vae, self.store, self.record = vae, store, record
        self.hits = self.misses = 0

    @classmethod
    def of(cls, vae: nn.Module, config: DiffusersModelConfig) -> ImageLatents:
        """Reading ``config.image_latents`` when set (checked against the model's ``vae_fingerprint``)."""
        if not config.image_latents:
            return cls(vae, None)
        return cls(vae, LatentStore.open(config.image_latents, vae_fingerprint(config)))

    @torch.no_grad()
    def __call__(self, x: torch.Tensor):
        """The posterior (a diffusers ``DiagonalGaussianDistribution``) of VAE inputs ``x`` [B, ...] (on the
        VAE's device, in its dtype)."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        keys = [vae_input_key(row) for row in x.detach().cpu()]
        parameters: dict[str, torch.Tensor] = {}
        for key, row in zip(keys, x, strict=True):
            if key in parameters:
                continue
            if self.store is not None and key in self.store:
                parameters[key] = self.store.load(key, x.device)
                self.hits += 1
                continue
            parameters[key] = self.vae.encode(row[None]).latent_dist.parameters
            self.misses += 1
            if self.record:
                self.store.add(key, parameters[key])
            elif self.store is not None and self.misses == 1:
                logger.warning("an image input is not in model.image_latents=%s: VAE-encoding it (and any other "
                               "missing one); rerun %s to include the dataset's current images",
                               self.store.directory, PRECOMPUTE_LATENTS)
        return DiagonalGaussianDistribution(torch.cat([parameters[key] for key in keys]))


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond), in float32: one ``lerp`` (its backward two multiplies), where the
    written-out form runs three kernels forward and three backward. Rounding differs from the pipelines'
    written-out form by an ulp or so of the result."""
    return torch.lerp(uncond.float(), cond.float(), scale)


def reject_image_inputs(model: str, inputs: ImageInputs | None, allowed: Sequence[str] = ()) -> None:
    """ValueError when ``inputs`` carries a field that ``model`` does not use."""
    if inputs is None:
        return
    extra = [f.name for f in fields(inputs) if f.name not in allowed and getattr(inputs, f.name) is not None]
    if extra:
        raise ValueError(f"the {model} adapter takes no ImageInputs.{', .'.join(extra)}"
                         + (f" (it uses {', '.join(allowed)})" if allowed else " (it is a text-to-image model)"))


def require_image_input(
    model: str, inputs: ImageInputs | None, name: str, batch_size: int, channels: int,
    size: tuple[int, int] | None = None, multiple_of: int = 1, because: str = "",
) -> torch.Tensor:
    """``inputs.<name>`` checked to be [batch_size, channels, H, W] (H, W = ``size`` if given, else
    multiples of ``multiple_of``), or a ValueError that names the input, what was expected and ``because``."""
    value = None if inputs is None else getattr(inputs, name)
    what = f"ImageInputs.{name}"
    if value is None:
        raise ValueError(f"the {model} adapter needs {what} ([B, {channels}, H, W] in [0, 1])"
                         f"{' because ' + because if because else ''}; none was given")
    if value.ndim != 4 or value.shape[0] != batch_size or value.shape[1] != channels:
        raise ValueError(f"{what} has shape {tuple(value.shape)}; the {model} adapter expects "
                         f"[{batch_size}, {channels}, H, W] (one per prompt)")
    if size is not None and tuple(value.shape[-2:]) != tuple(size):
        raise ValueError(f"{what} is {tuple(value.shape[-2:])} pixels; the {model} adapter generates "
                         f"{tuple(size)} (model.resolution): set data.image_size to model.resolution")
    if value.shape[-2] % multiple_of or value.shape[-1] % multiple_of:
        raise ValueError(f"{what} sides {tuple(value.shape[-2:])} must be multiples of {multiple_of}")
    return value


def rectified_flow_target(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_sigma = (1 - sigma) x0 + sigma noise and the velocity target noise - x0 (flow models)."""
    s = sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise, noise - x0


def dynamic_shift_mu(scheduler, image_seq_len: int, default_max_shift: float = 1.15) -> float:
    """The pipelines' mu = calculate_shift(image_seq_len) from the scheduler's config, where a key it lacks
    takes the pipeline's default (max_shift: 1.15 for FLUX and Qwen-Image, 1.16 for SD3)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", default_max_shift),
    )


def shifted_flow_sigmas(scheduler, num_steps: int, image_seq_len: int, device: torch.device) -> torch.Tensor:
    """FLUX / Qwen-Image schedule, set as their pipelines set it: sigmas linspace(1, 1/T, T) shifted by
    mu = calculate_shift(image_seq_len) under the scheduler's dynamic shifting; returns sigmas[0..T]."""
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

    retrieve_timesteps(scheduler, num_steps, device, sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
                       mu=dynamic_shift_mu(scheduler, image_seq_len))
    return scheduler.sigmas.to(torch.float32)
