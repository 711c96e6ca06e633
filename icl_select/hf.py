"""Loading a Hugging Face image-text-to-text model and its processor, and the two things transformers has no public
route for, each with one named home here (checked by tests/test_transformers_routes.py): generate()'s positions
(`generation_positions`) and a processor without its video sub-processor (`image_only`, as torchvision may be missing).

    folder, revision = resolve_model("Qwen/Qwen2.5-VL-3B-Instruct")   # a local folder or the local Hub cache only
    model, processor, info = load_lvlm(folder)                          # eval mode, left padding, bf16 on CUDA

Models load only from a local folder or the local Hugging Face cache, the snapshot's commit hash (or a folder's digest
of its files) recorded as the revision.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
import transformers
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from torch import Tensor
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    BatchFeature,
    PretrainedConfig,
    ProcessorMixin,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

from icl_select.files import folder_digest


def resolve_device(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """Device and dtype; "auto" = this process's CUDA device (LOCAL_RANK under torchrun) in bf16, else CPU float32."""
    if device == "auto":
        cuda = torch.cuda.is_available()
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    else:
        dev = torch.device(device)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return dev, torch_dtype


def resolve_model(model: str, cache_dir: str | Path | None = None) -> tuple[Path, str]:
    """The local folder of a model given as a path or a hub id, and its revision: the commit hash of a hub snapshot,
    or for a folder of your own a digest of its files (`files.folder_digest`), so that changed weights under the same
    path are another model. Hub ids are looked up in the local cache only."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve(), folder_digest(path)
    # Only "org/name" can be a hub id: an absolute, ~, ./ or deeper path is a missing folder, and a download
    # command would not help.
    if model.startswith(("/", "~", ".")) or model.count("/") != 1:
        raise ValueError(f"model folder {model} does not exist")
    try:
        snapshot = Path(snapshot_download(repo_id=model, cache_dir=cache_dir, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError) as e:
        raise ValueError(
            f"model {model!r} is neither a local folder nor in the local Hugging Face cache; download it first "
            f"with `hf download {model}` or pass a local path"
        ) from e
    # The hub cache stores each revision under snapshots/<commit hash>/.
    return snapshot, snapshot.name


def _load_config(model: str, folder: Path) -> PretrainedConfig:
    """The transformers config in `folder`, or a ValueError saying why it cannot be read."""
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model}: {folder} does not hold a loadable transformers model config: {e}") from e


def generation_positions(model, inputs: BatchFeature) -> Tensor:
    """The position ids generate() gives a prompt, (B, T) or (3 | 4, B, T): left padding skipped, and Qwen's 3-d rope
    from the image grids. generate() builds them with a private method and transformers offers no public route, so
    this is the kit's one call of it (tests/test_transformers_routes.py fails when the pinned release changes)."""
    return model._prepare_position_ids_for_generation(inputs["input_ids"], dict(inputs))


def image_only(cls: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """`cls` without its video processor, so that it builds without torchvision (only its video half needs it): the
    subclass leaves video_processor out of get_attributes() and hands the family's __init__ video_processor=None.
    Everything else is the family's own, so one mechanism serves every family; videos are unsupported."""

    class ImageOnly(cls):
        @classmethod
        def get_attributes(klass) -> list[str]:
            return [name for name in super().get_attributes() if name != "video_processor"]

        @classmethod
        def get_processor_dict(klass, *args, **kwargs) -> tuple[dict, dict]:
            processor_dict, rest = super().get_processor_dict(*args, **kwargs)
            return {**processor_dict, "video_processor": None}, rest

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"ImageOnly{cls.__name__}"
    return ImageOnly


def _processor_class(folder: Path, config: PretrainedConfig) -> type[ProcessorMixin] | None:
    """The processor class a folder names (processor_config.json), else the one AutoProcessor maps its config to."""
    saved = folder / "processor_config.json"
    name = json.loads(saved.read_text()).get("processor_class") if saved.is_file() else None
    if name:
        return getattr(transformers, name, None)
    return PROCESSOR_MAPPING.get(type(config), None)


def _load_processor(folder: Path, config: PretrainedConfig) -> ProcessorMixin:
    """The model's image+text processor with left padding (batched generation appends on the right): AutoProcessor, else
    the folder's processor class without its video processor (image_only), for processors whose video half needs
    torchvision or that were saved without one. Anything else is one ValueError naming each loader's reason."""
    cls = _processor_class(folder, config)
    video = cls is not None and "video_processor" in cls.get_attributes()
    loaders = [AutoProcessor] + ([image_only(cls)] if video else [])
    reasons = []
    for loader in loaders:
        try:
            processor = loader.from_pretrained(folder)
        except (ImportError, OSError, ValueError, KeyError, TypeError) as e:
            first = (str(e).strip() or type(e).__name__).splitlines()[0].split(". ")[0]  # transformers' hints: noise
            reasons.append(f"{loader.__name__}: {first}")
            continue
        if getattr(processor, "image_processor", None) is not None and getattr(processor, "tokenizer", None):
            processor.tokenizer.padding_side = "left"
            return processor
        reasons.append(f"{loader.__name__} built a {type(processor).__name__}, not an image+text processor")
    raise ValueError(f"{folder}: no image+text processor loads ({'; '.join(reasons)})")


# The Qwen encoders attend within each window or picture of a packed sequence: transformers runs its sdpa path as one
# call per window (hundreds per picture), its flash path as one call over the whole sequence given its boundaries. A
# name with "flash" in it takes that path; PyTorch's varlen attention computes it, where its CUDA kernels exist.
VARLEN_ATTENTION = "icl_select_flash_varlen"
VARLEN_ENCODERS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention within each packed sequence of query/key/value (1, H, T, D), bounded by cu_seq_lens_q/k:
    returns ((1, T, H, D), None), as transformers' attention functions do."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    cu_q, cu_k = kwargs["cu_seq_lens_q"].int(), kwargs["cu_seq_lens_k"].int()
    out = varlen_attn(q, k, v, cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), scale=scaling)
    return out[None], None


def cuda_half(model: torch.nn.Module) -> bool:
    """Whether `model` runs on CUDA in half precision, where the kit's own kernels and compiled regions apply."""
    return model.device.type == "cuda" and model.dtype in (torch.float16, torch.bfloat16)


def varlen_runs(model: torch.nn.Module) -> bool:
    """Whether `model` has a Qwen vision encoder and PyTorch runs varlen attention for it (CUDA, half precision)."""
    kernel = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return model.config.model_type in VARLEN_ENCODERS and cuda_half(model) and kernel


def vision_attention(model: torch.nn.Module, varlen: bool) -> None:
    """The Qwen vision encoder's attention: varlen (one call per sequence) or transformers' sdpa (one per window)."""
    transformers.AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    model.set_attn_implementation({"vision_config": VARLEN_ATTENTION if varlen else "sdpa"})


# Regional compilation on CUDA: the modules whose class names end so (the outermost where they nest) run through
# torch.compile, which fuses the elementwise work that eager runs kernel by kernel (RMSNorm in float32, the vision
# rotary embedding, gated activations, residual adds). Every layer of a kind shares one graph, shapes left dynamic.
# Norms inside an attention module (Gemma3's and Qwen3's per-head q_norm, k_norm) stay eager: their per-head shapes
# would add specialisations past dynamo's limit for the one forward they share with the layer norms.
COMPILED = ("VisionBlock", "RMSNorm", "MLP")


def compile_regions(model: torch.nn.Module) -> list[str]:
    """torch.compile the modules of `model` that COMPILED names, in place; returns their names."""
    compiled: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(c + ".") for c in compiled) or any("attn" in part for part in name.split(".")[:-1])
        if type(module).__name__.endswith(COMPILED) and not inside:
            module.compile(dynamic=True)
            compiled.append(name)
    return compiled


def load_lvlm(
    model: str, device: str = "auto", dtype: str = "auto", cache_dir: str | Path | None = None
) -> tuple[torch.nn.Module, ProcessorMixin, dict]:
    """An image-text-to-text model and its processor from a local path or the local hub cache: (model in eval mode on
    `device`, processor with left padding, info: "lvlm", "revision", "path", "model_class", "processor_class", "device",
    "dtype")."""
    folder, revision = resolve_model(model, cache_dir)
    config = _load_config(model, folder)
    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        arch = ", ".join(config.architectures or []) or type(config).__name__
        raise ValueError(
            f"{model} is a {arch} model (model_type {config.model_type!r}), not an image-text-to-text model that "
            "AutoModelForImageTextToText can load; pass a vision-language model such as Qwen/Qwen2.5-VL-3B-Instruct"
        )
    dev, torch_dtype = resolve_device(device, dtype)
    processor = _load_processor(folder, config)
    if processor.chat_template is None:
        raise ValueError(
            f"{model} has no chat template (a base checkpoint, such as PaliGemma's): icl-select builds every prompt "
            f"with the model's chat template, so use the instruct or chat version of the model, or add a "
            f"chat_template.jinja to {folder}"
        )
    lvlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch_dtype).to(dev).eval()
    if varlen_runs(lvlm):
        vision_attention(lvlm, varlen=True)
    info = {
        "lvlm": model,
        "revision": revision,
        "path": str(folder),
        "model_class": type(lvlm).__name__,
        "processor_class": type(processor).__name__,
        "device": str(dev),
        "dtype": str(torch_dtype).removeprefix("torch."),
    }
    return lvlm, processor, info
