"""CLIP embeddings of questions and pictures, as a selector of each task reads them.

clip_embed(items) -> {"image", "text", "fused"}: (N, d) L2-normalised CLIP embeddings
task_embed(items, task, encoder) -> the same, a picture to caption read alone
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm
from transformers import AutoModel, AutoProcessor, ProcessorMixin

from icl_select.hf import resolve_device, resolve_model
from icl_select.pictures import picture_id, rgb


@functools.lru_cache(maxsize=2)
def clip_encoder(folder: Path, revision: str, device: torch.device) -> tuple[torch.nn.Module, ProcessorMixin]:
    """The CLIP-style model (float32, eval mode, on `device`) and processor in `folder` at `revision` (`resolve_model`),
    loaded once per process while its files stay the same: picking demonstrations for new questions embeds them batch
    after batch."""
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    if not hasattr(model, "get_image_features") or not hasattr(model, "get_text_features"):
        raise ValueError(f"{folder} holds a {type(model).__name__}, not a CLIP-style image+text encoder")
    return model, AutoProcessor.from_pretrained(folder)


@torch.inference_mode()
def clip_embed(
    items: list[dict],
    encoder: str = "openai/clip-vit-base-patch32",
    batch_size: int = 64,
    device: str = "auto",
    cache_dir: str | Path | None = None,
) -> dict[str, Tensor]:
    """CLIP embeddings of each item's image (a file path or a PIL image) and question, (N, d) float32 unit norm:
    "image", "text" and "fused" = normalize(normalize(image) + normalize(text)). Each distinct image (file, or PIL
    object) is embedded once, in float32 on any device, so embeddings do not depend on the GPU."""
    if not items:
        raise ValueError("clip_embed needs at least one item")
    folder, revision = resolve_model(encoder, cache_dir)
    dev, _ = resolve_device(device)
    model, processor = clip_encoder(folder, revision, dev)
    max_length = model.config.text_config.max_position_embeddings
    pictures = {picture_id(item["image"]): item["image"] for item in items}  # distinct, in order of first use
    paths = list(pictures)
    image_steps, text_steps = list(range(0, len(paths), batch_size)), list(range(0, len(items), batch_size))
    bar = tqdm(total=len(image_steps) + len(text_steps), desc=f"CLIP {encoder}", unit="batch")
    images, texts = [], []
    for start in image_steps:
        batch = [rgb(pictures[p]) for p in paths[start : start + batch_size]]
        pixels = processor(images=batch, return_tensors="pt")["pixel_values"].to(dev)  # (B, 3, H, W)
        images.append(model.get_image_features(pixel_values=pixels).pooler_output.float().cpu())  # (B, d)
        bar.update()
    for start in text_steps:
        questions = [item["question"] for item in items[start : start + batch_size]]
        tokens = processor(
            text=questions, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        ).to(dev)
        texts.append(model.get_text_features(**tokens).pooler_output.float().cpu())  # (B, d)
        bar.update()
    bar.close()
    row = {p: i for i, p in enumerate(paths)}
    image = F.normalize(torch.cat(images)[[row[picture_id(item["image"])] for item in items]], dim=-1)  # (N, d)
    text = F.normalize(torch.cat(texts), dim=-1)  # (N, d)
    return {"image": image, "text": text, "fused": F.normalize(image + text, dim=-1)}


def task_embed(items: list[dict], task: str, encoder: str, device: str = "auto") -> dict[str, Tensor]:
    """`clip_embed` of items as a selector of `task` reads them. A picture to caption comes with no text, so a
    captioning selector reads the picture alone ("fused" is the image view), queries and demonstrations alike; a
    demonstration's text view is the caption it shows (its first reference), what a caption sampler compares."""
    if task != "caption":
        return clip_embed(items, encoder, device=device)
    emb = clip_embed([{**it, "question": (it.get("answers") or [""])[0]} for it in items], encoder, device=device)
    return emb | {"fused": emb["image"].clone()}  # a tensor of its own in a file
