"""A picture through an LVLM's image processor and vision encoder once per run, not once per prompt: demonstration
pictures recur across thousands of prompts.

    CachedImageProcessor(processor.image_processor, budget, pool)   # preprocessed pictures, by file key, in a ByteLRU
    EncoderCache(model, budget, counts)                             # vision-encoder outputs (Qwen family), on the GPU
    picture_processes(workers)                                      # forked workers that preprocess the misses
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from transformers import BatchFeature
from transformers.image_utils import make_flat_list_of_images

from icl_select.pictures import DEFAULT_IMAGE_CACHE_MIB, IMAGE_KEY, MIB, ByteLRU, PictureKey

if TYPE_CHECKING:  # a batch as LVLMBackend prepares it
    from icl_select.lvlm import Prepared


def _feature_bytes(feature: BatchFeature) -> int:
    return sum(v.nbytes for v in feature.values() if torch.is_tensor(v) or isinstance(v, np.ndarray))


def _preprocess(inner, image: Image.Image, kwargs: dict) -> BatchFeature:
    """One picture through the image processor `inner` (a worker's task: top-level, so a process can run it)."""
    return inner([image], **kwargs)


def _no_rows(value: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """(0, D) of the same dtype, holding none of `value`'s memory."""
    return value[:0].clone() if torch.is_tensor(value) else value[:0].copy()


def _owned(feature: BatchFeature) -> BatchFeature:
    """A feature received from a worker process with its tensors copied out of the shared memory they came in (each
    shared block holds a file descriptor open while it lives, and a cache holds thousands of them)."""
    return BatchFeature({k: v.clone() if torch.is_tensor(v) else v for k, v in feature.items()})


def worker_count(workers: int) -> int:
    """The picture workers of this process: `workers`, or 0 = one per core this process may use, shared among the
    torchrun ranks of the machine."""
    if workers:
        return workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


@functools.cache
def picture_processes(workers: int) -> ProcessPoolExecutor:
    """The process's pool of `workers` picture-preprocessing processes, shared by every backend as the picture caches
    are. They are forked (as DataLoader's workers are: a spawned process would import the caller's main script again)
    at once, from the thread that builds the backend, before its batch threads exist; they never touch CUDA."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    pool.submit(int).result()  # a fork pool starts all its processes at the first task
    return pool


class CachedImageProcessor:
    """A processor's image processor that preprocesses each picture (by picture_key) once while it stays in a ByteLRU
    of `budget` bytes: ICD pictures recur across thousands of prompts. Misses run in `pool` when one is given: worker
    processes (their results are the same function's on the same inputs, so the same bits) or threads."""

    def __init__(self, inner, budget: int = DEFAULT_IMAGE_CACHE_MIB * MIB // 2, pool: Executor | None = None):
        self.inner, self.pool = inner, pool
        self.cache = ByteLRU(budget, _feature_bytes)
        self.grids: dict[tuple[PictureKey, str], BatchFeature] = {}  # each picture's features less its pixels
        self.local = threading.local()  # .apart, .held: see pictures_apart

    @property
    def misses(self) -> int:
        return self.cache.misses

    def __getattr__(self, name: str):  # merge_size, patch_size, ... as the processor expects
        return getattr(self.inner, name)

    @contextmanager
    def pictures_apart(self, held: Collection[PictureKey] = ()) -> Iterator[list[BatchFeature]]:
        """Within the block, this thread's calls return an empty pixel_values and put each picture's own features in
        the list yielded: a caller that needs only some pictures' pixels takes them without copying the others. The
        pictures `held` (whose encoder outputs the caller holds) are not preprocessed again: their parts have no pixel
        rows, only the grid the prompt's tokens are laid out by, once it is known."""
        self.local.apart, self.local.held = [], held
        try:
            yield self.local.apart
        finally:
            self.local.apart, self.local.held = None, ()

    def one(self, image: Image.Image, kwargs: dict) -> BatchFeature:
        key = (image.info.get(IMAGE_KEY), repr(sorted(kwargs.items())))  # the same key as __call__'s
        if key[0] is None:  # not loaded through load_image: nothing to key the cache on
            return self.inner([image], **kwargs)
        if self.skips(key):
            return self.grids[key]
        feature = self.cache.get(key, lambda: self.inner([image], **kwargs))
        if key not in self.grids:  # a grid (3 numbers) per picture: kept for the whole run
            self.grids[key] = BatchFeature({k: _no_rows(v) if k == "pixel_values" else v for k, v in feature.items()})
        return feature

    def skips(self, key: tuple[PictureKey, str]) -> bool:
        """Whether this thread's call serves picture `key` without pixels (pictures_apart's `held`)."""
        return key[0] in getattr(self.local, "held", ()) and key in self.grids

    def __call__(self, images, **kwargs) -> BatchFeature:
        images = make_flat_list_of_images(images)
        if self.pool is not None:  # the misses in parallel, so that one() finds them all cached
            settings = repr(sorted(kwargs.items()))
            missing = {
                key: image
                for image in images
                if (key := image.info.get(IMAGE_KEY)) is not None
                and (key, settings) not in self.cache
                and not self.skips((key, settings))
            }
            if len(missing) > 1:
                n = len(missing)
                made = self.pool.map(_preprocess, [self.inner] * n, missing.values(), [kwargs] * n)
                owned = _owned if isinstance(self.pool, ProcessPoolExecutor) else lambda feature: feature
                for key, feature in zip(missing, made):
                    self.cache.put((key, settings), owned(feature))
        parts = [self.one(image, kwargs) for image in images]
        apart = getattr(self.local, "apart", None)
        if apart is not None:
            apart += parts
        merged = {}
        for key in parts[0]:
            values = [p[key] for p in parts]
            if apart is not None and key == "pixel_values":
                merged[key] = values[0][:0]  # (0, D): the caller takes the pixels it needs from `apart`
            elif torch.is_tensor(values[0]):
                merged[key] = torch.cat(values)
            elif isinstance(values[0], np.ndarray):
                merged[key] = np.concatenate(values)
            else:
                merged[key] = [v for vs in values for v in vs]
        return BatchFeature(merged)


class EncoderCache:
    """Each picture's vision-encoder output by picture_key, on the model's device, for the families whose encoder sees
    every picture alone (Qwen2/2.5/3-VL): a picture that recurs across prompts is encoded once while cached, and the
    model takes the outputs through its own `mm_encoder_outputs` input in place of the pixels. Only the pixels of the
    pictures it lacks go to the device."""

    def __init__(self, model, budget: int, counts: Counter):
        self.model, self.counts = model, counts
        self.cache = ByteLRU(budget, lambda parts: sum(t.nbytes for t in parts))
        self.output_type = None  # the model's encoder output class (Qwen3-VL's carries its deepstack features)

    def holding(self, keys: Iterable[PictureKey]) -> dict[PictureKey, tuple[Tensor, ...]]:
        """The outputs cached for `keys` now: a batch prepared ahead keeps them, so it needs no pixels for them."""
        return {k: v for k in dict.fromkeys(keys) if (v := self.cache.lookup(k)) is not None}

    def __call__(self, prep: Prepared, inputs: BatchFeature) -> dict:
        """The model's inputs for the batch `prep`, the pixels replaced by the encoder's outputs: those the batch held
        when it was prepared, those cached since, and the others from one encoder pass over their patch rows, which
        `inputs["pixel_values"]` holds (the pictures `prep.ahead`). Nothing here waits for the GPU: the grids it splits
        by are the CPU's."""
        keys, grid = prep.keys, prep.grid
        found = {k: v for k in dict.fromkeys(keys) if (v := prep.held.get(k) or self.cache.lookup(k)) is not None}
        first: dict[PictureKey, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        new = [k for k in first if k not in found]
        if new:
            index = [first[k] for k in new]
            self.counts["vision_patches"] += int(grid[index].prod(-1).sum())
            sizes = [int(grid[first[k]].prod()) for k in prep.ahead]
            sent = dict(zip(prep.ahead, inputs["pixel_values"].split(sizes)))  # patch rows on the device
            pixels = torch.cat([sent[k] for k in new])
            new_grid = torch.cat([inputs["image_grid_thw"][i : i + 1] for i in index])
            out = self.model.get_image_features(pixels, new_grid, return_dict=True)
            self.output_type = type(out)
            deep = getattr(out, "deepstack_features", None) or []  # per layer, per picture
            for j, key in enumerate(new):
                found[key] = (out.pooler_output[j], *(layer[j] for layer in deep))
                self.cache.put(key, found[key])
        parts = [found[k] for k in keys]
        deep = {"deepstack_features": [tuple(x[k] for x in parts) for k in range(1, len(parts[0]))]}
        out = self.output_type(pooler_output=tuple(x[0] for x in parts), **(deep if len(parts[0]) > 1 else {}))
        return {**{k: v for k, v in inputs.items() if k != "pixel_values"}, "mm_encoder_outputs": {"image": out}}
