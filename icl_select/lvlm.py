"""The real LVLM backend: a Hugging Face image-text-to-text model (any family) that answers prompts of demonstrations.

    backend = LVLMBackend("Qwen/Qwen2.5-VL-3B-Instruct", items)   # items: {"train": [...], "val": [...]}
    backend.score("val", queries (N,), icds (N, k)) -> {"prediction", "acc", "correct", "gt_prob", "rel"}
    backend.self_check() -> the fast path against plain transformers on a few prompts of this data (raises if off)
    backend.describe() -> {"lvlm", "revision", "prompt_template", "system_prompt", "generation", "simulation": False}

The contract, for every family and batch size: the greedy answer is model.generate()'s on the prompt alone, and P(reply)
is one full forward pass over the prompt plus the reply as the chat template renders the assistant turn. Each prompt
runs through the model once, its KV cache serving the greedy answer and then every credited reply; docs/real-models.md
says what keeps that exact. Loading the model and its two patches: icl_select/hf.py; pictures: pictures.py (files) and
preprocessing.py (through the processor and the vision encoder once); CLIP: clip.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import queue
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from transformers import (
    BatchFeature,
    CompileConfig,
    GenerationConfig,
)
from transformers.cache_utils import DynamicLayer, StaticCache

from icl_select.cider import CiderD, ptb_tokenize
from icl_select.hf import (
    compile_regions,
    cuda_half,
    generation_positions,
    load_lvlm,
    varlen_runs,
    vision_attention,
)
from icl_select.pictures import (
    DECODED_IMAGES,
    DEFAULT_IMAGE_CACHE_MIB,
    IMAGE_KEY,
    MIB,
    PictureKey,
    decode_ahead,
    load_image,
    picture_key,
    picture_pixels,
)
from icl_select.preprocessing import CachedImageProcessor, EncoderCache, picture_processes, worker_count
from icl_select.vqa import answer_rel, normalize_answer, postprocess, shown_answer, vqa_score

PromptStyle = Literal["single-turn", "turn-per-demo"]

__all__ = ["Example", "LVLMBackend", "PromptTemplate", "credited_replies"]

DEFAULT_ENCODER_CACHE_MIB = 4096
CPU_BATCH, GPU_BATCH = 8, 64  # prompts a forward pass at most, where the batch size is left to the kit (0)


def memory_batch_tokens(model, free: int) -> int:
    """Padded prompt tokens a forward pass may hold in `free` bytes: each token's keys and values in every layer, twice
    (the prompt's cache and decoding's static copy), and the activations of the widest layer (an MLP's projections)."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = 2 * text.num_hidden_layers * (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    widest = 4 * text.hidden_size + 3 * (getattr(text, "intermediate_size", None) or 4 * text.hidden_size)
    return max(1, free // ((2 * kv + widest) * model.dtype.itemsize))


# One prompt to score: (query item, ICD items in prompt order).
Example = tuple[dict, list[dict]]


def assistant_turn(text: str) -> dict:
    """An assistant message in the content-list form every family's template reads (some iterate a string's
    characters)."""
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


@dataclass(frozen=True)
class PromptTemplate:
    """How ICDs and the query become a chat; {question} and {answer} are filled per item."""

    icd: str = "Question: {question} Short answer: {answer}"
    """Text after an ICD's image (single-turn style)."""
    query: str = "Question: {question} Short answer:"
    """Text after the query's image, the last thing in the user turn (and each ICD's question in turn-per-demo)."""
    style: PromptStyle = "single-turn"
    """single-turn: one user turn holding every ICD and the query; turn-per-demo: each ICD is a user turn (its image
    and `query` filled with its question) answered by an assistant turn (its answer), then the query's user turn."""


def credited_replies(answers: list[str]) -> list[tuple[str, float]]:
    """The replies gt_prob adds up, each with its VQA credit: every normalised annotator answer and each raw spelling of
    it the annotators used ("yes", "Yes"), all credited alike since the metric normalises the prediction too. Credit =
    vqa_score(answer, answers), leave-one-out: 0.3 / 0.6 / 0.9 / 1.0 for 1 / 2 / 3 / 4+ of 10 matching annotators."""
    replies = []
    for norm in sorted({normalize_answer(a) for a in answers}):
        credit = vqa_score(norm, answers)
        spellings = {norm} | {a for a in answers if normalize_answer(a) == norm}
        replies += [(s, credit) for s in sorted(spellings)]
    return replies


def credit_sum(credited: list[list[tuple[str, float]]], probs: list[Tensor]) -> Tensor:
    """gt_prob (N,) from each example's credited replies and their probabilities P(reply) (R_i,)."""
    total = torch.stack([(p * torch.tensor([w for _, w in c])).sum() for p, c in zip(probs, credited)])  # (N,)
    # Exclusive replies make the sum at most 1; the clamp only removes float rounding above it.
    return total.clamp_(max=1.0)  # (N,)


@dataclass
class Replies:
    """The credited replies of one batch, tokenised on the CPU: how many each prompt has, and for every reply its
    prompt's row, its tokens (padded) and its length."""

    per_row: list[int]
    rows: Tensor  # (R,)
    tokens: Tensor  # (R, L)
    lengths: Tensor  # (R,)


@dataclass
class Prepared:
    """One batch made ready on the CPU for the model: which examples, the processor's inputs, generate()'s
    positions, the pictures in processor order, Qwen's image grids, the replies, and the unpadded prompt tokens. With an
    encoder cache, inputs["pixel_values"] holds only the patch rows of the pictures `ahead` (those it lacked when the
    batch was prepared), and `held` the others' encoder outputs (kept for the batch, whatever the cache evicts)."""

    rows: list[int]
    inputs: BatchFeature
    positions: Tensor  # (B, T) | (4, B, T)
    keys: list[PictureKey]
    grid: Tensor | None  # (N, 3)
    replies: Replies | None
    tokens: int
    ahead: list[PictureKey] = field(default_factory=list)
    held: dict[PictureKey, tuple[Tensor, ...]] = field(default_factory=dict)


def prefetched(items: Iterator, depth: int) -> Iterator:
    """`items`, made in a background thread up to `depth` ahead of the consumer (the CPU side of batches overlaps
    the model's work). The thread's exception is raised here; leaving early stops the thread at its next item."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def make() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                ready.put(item)
            ready.put(end)
        except BaseException as e:  # noqa: BLE001  (handed to the consumer, which raises it)
            ready.put(e)

    worker = threading.Thread(target=make, daemon=True)
    worker.start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a put on a full queue
            with contextlib.suppress(queue.Empty):
                ready.get_nowait()
            worker.join(0.01)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Watch:
    """Whether every row of a decoding batch has stopped, asked once per step without waiting for the device: on a
    GPU the answer is the flag of an earlier step, copied to pinned memory behind an event; on the CPU it is exact."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.flag = torch.zeros((), dtype=torch.bool, pin_memory=self.cuda)
        self.event = None

    def all(self, done: Tensor) -> bool:
        if not self.cuda:
            return bool(done.all())
        landed = self.event is None or self.event.query()
        seen = landed and self.event is not None and bool(self.flag)
        if landed:  # the last copy has landed: send the current flag
            self.flag.copy_(done.all(), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        return seen


def pinned(value, device: torch.device):
    """A tensor or BatchFeature in page-locked memory when it is bound for a GPU (so its copy does not make the host
    wait), else as it is."""
    if device.type != "cuda":
        return value
    if torch.is_tensor(value):
        return value.pin_memory()
    return BatchFeature({k: v.pin_memory() if torch.is_tensor(v) else v for k, v in value.items()})


def is_per_token(value, inputs: BatchFeature) -> bool:
    """Whether a processor output has one entry per token (same shape as input_ids)."""
    return torch.is_tensor(value) and value.shape == inputs["input_ids"].shape


# Decoding over a static cache (LVLMBackend's static_decode): off, or on CUDA compiled by inductor (CUDA graphs:
# "reduce-overhead") or replayed as CUDA graphs of the eager kernels ("cudagraphs"); on the CPU a static cache alone.
StaticDecode = Literal["off", "inductor", "cudagraphs"]
STATIC_BUCKET = 512  # a static cache's length is rounded up to this: one shape (one graph) serves many prompt lengths


def croppable(cache) -> bool:
    """Whether cache.crop() gives back exactly the states it held before: plain layers only. A sliding-window layer
    has already dropped the states that cutting back past its window would need."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


GT_PROB = {  # what gt_prob is, per task (meta.json records it)
    "vqa": "sum of VQA credit x P(reply) over normalised annotator answers and their raw spellings",
    "caption": "geometric-mean token probability of the query's first reference caption as the reply",
}


class LVLMBackend:
    """A transformers LVLM scoring ICD prompts: greedy short answers, VQA accuracy and teacher-forced gt_prob; for the
    caption task, greedy captions, CIDEr-D and the probability of the query's reference caption.

    Rows of a prompt batch may hold -1 after their last demonstration: prompts of several lengths, none included, go
    through the model together."""

    ragged = True

    def __init__(
        self,
        model: str,
        items: dict[str, list[dict]],
        batch_size: int = 0,
        max_new_tokens: int = 10,
        system_prompt: str | None = None,
        template: PromptTemplate = PromptTemplate(),
        device: str = "auto",
        image_cache_mib: int = DEFAULT_IMAGE_CACHE_MIB,
        encoder_cache_mib: int | None = None,
        batch_tokens: int = 0,
        workers: int = 0,
        compile: bool = True,
        worker_processes: bool = False,
        static_decode: StaticDecode = "off",
        task: str = "vqa",
    ):
        self.model, self.processor, self.info = load_lvlm(model, device=device)
        self.task = task
        # Pictures for the batch the model runs next, in parallel (0 = one worker per core): decoded in threads (PIL
        # releases the GIL) and preprocessed in the same threads or, with worker_processes, in processes, which leave
        # the GIL to the thread that drives the GPU but copy each picture there and its patches back
        # (docs/real-models.md has what each costs).
        workers = worker_count(workers)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="icl-select-images") if workers > 1 else None
        self.picture_pool = picture_processes(workers) if worker_processes and workers > 1 else self.pool
        self.compiled = compile_regions(self.model) if compile and cuda_half(self.model) else []
        self.counts: Counter = Counter()  # tokens and patches run through the model so far (bench.py's FLOP counts)
        self.phases: dict[str, float] | None = None  # bench.py: seconds per phase of run(), when it profiles
        self.prefetch = 2  # batches prepared ahead of the model in a background thread (0 = in line)
        self.reuse_held = True  # pictures whose encoder outputs are cached are not preprocessed (bench.py: off)
        self.static_decode = static_decode  # decoding over a StaticCache, on CUDA compiled with this backend
        self.static_caches: dict[tuple[int, int], StaticCache] = {}
        # The process's image memory: half for decoded images, half for their preprocessed patches.
        DECODED_IMAGES.budget = image_cache_mib * MIB // 2
        probe = self.processor.image_processor([Image.new("RGB", (64, 48))], return_tensors="pt")
        self.encoder_cache = None
        if set(probe) == {"pixel_values", "image_grid_thw"}:
            # Qwen-style processors turn each image into its own rows of patches and concatenate them, and their
            # encoders attend within each image, so per-image results can be cached. Tiling, padding and multi-image
            # processors (Idefics3, LLaVA-NeXT/OneVision) shape an image by the prompt it is in: they always see the
            # whole prompt.
            self.processor.image_processor = CachedImageProcessor(
                self.processor.image_processor, image_cache_mib * MIB // 2, self.picture_pool
            )
            if encoder_cache_mib is None:  # on a GPU, a quarter of its memory left: a run's every picture, often
                cuda_free = torch.cuda.mem_get_info(self.model.device)[0] if self.model.device.type == "cuda" else 0
                encoder_cache_mib = cuda_free // 4 // MIB or DEFAULT_ENCODER_CACHE_MIB
            if encoder_cache_mib > 0:
                self.encoder_cache = EncoderCache(self.model, encoder_cache_mib * MIB, self.counts)
        self.items = items
        cuda = self.model.device.type == "cuda"
        batch_size = batch_size or (GPU_BATCH if cuda else CPU_BATCH)
        if batch_tokens == 0 and cuda:  # half the memory left after the weights and the encoder cache, for the prompts
            free = torch.cuda.mem_get_info(self.model.device)[0]
            free -= self.encoder_cache.cache.budget if self.encoder_cache is not None else 0
            batch_tokens = memory_batch_tokens(self.model, free // 2)
        self.batch_size, self.batch_tokens, self.max_new_tokens = batch_size, batch_tokens, max_new_tokens
        self.system_prompt = system_prompt
        self.tokenizer = self.processor.tokenizer
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.stop_ids: list[int] = [eos] if isinstance(eos, int) else list(eos)
        self.stop_tensor = torch.tensor(self.stop_ids, device=self.model.device)
        self.pad_id: int = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        # Replace the checkpoint's generation defaults outright rather than passing a config to generate(): generate()
        # fills every value left unset from model.generation_config, so Qwen2.5-VL-Instruct's top_k, temperature and
        # repetition_penalty=1.05 would leak into "greedy" decoding.
        self.model.generation_config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            bos_token_id=self.model.generation_config.bos_token_id,
        )
        self.template, self.layout_note = template, None
        if template.style == "single-turn" and not self._interleaves():
            self.template = replace(template, style="turn-per-demo")
            self.layout_note = (
                "the chat template puts every image of a turn before its texts, so each demonstration gets its own "
                "user and assistant turn (turn-per-demo) to keep its image next to its question"
            )
            print(f"note: {self.info['lvlm']}: {self.layout_note}", file=sys.stderr)

    def _chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _interleaves(self) -> bool:
        """Whether the chat template renders a turn's images where its content puts them: LLaVA-style templates
        write every image first, then every text, whatever the order of the content."""
        image, text = {"type": "image"}, {"type": "text", "text": "a"}
        in_order = [{"role": "user", "content": [image, text, image, {**text, "text": "b"}]}]
        images_first = [{"role": "user", "content": [image, image, text, {**text, "text": "b"}]}]
        return self._chat(in_order, True) != self._chat(images_first, True)

    def _special(self, text: str) -> bool:
        """Whether tokenizing a rendered chat adds the tokenizer's special tokens: not when the template wrote the
        BOS itself (the rule of the stock apply_chat_template, so no prompt starts with two)."""
        bos = self.tokenizer.bos_token
        return not (bos is not None and text.startswith(bos))

    def messages(self, query: dict, icds: list[dict]) -> list[dict]:
        """The chat: optional system turn, then the ICDs and the query in the template's style (see PromptTemplate)."""
        t = self.template
        chat = [{"role": "system", "content": [{"type": "text", "text": self.system_prompt}]}]
        chat = chat if self.system_prompt is not None else []
        content = []
        for icd in icds:
            answer = self.shown(icd)
            if t.style == "turn-per-demo":
                asked = [{"type": "image"}, {"type": "text", "text": t.query.format(question=icd["question"])}]
                chat += [{"role": "user", "content": asked}, assistant_turn(answer)]
            else:
                content += [
                    {"type": "image"},
                    {"type": "text", "text": t.icd.format(question=icd["question"], answer=answer)},
                ]
        content += [{"type": "image"}, {"type": "text", "text": t.query.format(question=query["question"])}]
        return [*chat, {"role": "user", "content": content}]

    def render(self, query: dict, icds: list[dict]) -> tuple[str, list[Image.Image]]:
        """The rendered prompt text (with the generation prompt) and its images in prompt order (ICDs, then query)."""
        text = self._chat(self.messages(query, icds), add_generation_prompt=True)
        return text, [load_image(item["image"]) for item in (*icds, query)]

    def process(self, examples: list[Example]) -> BatchFeature:
        """Processor inputs for a batch of prompts, left-padded, on the CPU. Each prompt's images go in as that prompt's
        list, as the stock apply_chat_template passes them: multi-image processors shape an image by how many share its
        prompt."""
        return self._process(examples)[0]

    def _process(self, examples: list[Example]) -> tuple[BatchFeature, list[PictureKey]]:
        """process(), and the batch's pictures (their picture_key) in processor order: ICDs, then query, per prompt."""
        decode_ahead([it["image"] for query, icds in examples for it in (*icds, query)], self.pool)
        texts, images = zip(*(self.render(query, icds) for query, icds in examples))
        inputs = self.processor(
            text=list(texts),
            images=list(images),
            padding=True,
            return_tensors="pt",
            add_special_tokens=self._special(texts[0]),
        )
        return inputs, [image.info[IMAGE_KEY] for prompt in images for image in prompt]

    def encode(self, examples: list[Example]) -> BatchFeature:
        """process() on the model's device (pixels in the model's dtype)."""
        return self.process(examples).to(self.model.device, dtype=self.model.dtype)  # casts only floating tensors

    def reply_ids(self, messages: list[dict], replies: list[str]) -> list[list[int]]:
        """Each reply's tokens as the chat template renders the assistant's turn after `messages`, up to and including
        the first stop token: what the rendered chat adds to the prompt's tokens, never guessed (LLaVA's " black").

        Two template quirks: a reply header that differs from the generation prompt (LLaVA-OneVision: "assistant \n"
        against "assistant\n") gets the text rendered after it; a turn closed without a stop token (LLaVA-1.5:
        "ASSISTANT: black ") ends at the reply's last character plus the model's first stop token, since what follows
        only separates turns."""
        prompt = self._chat(messages, add_generation_prompt=True)
        special = self._special(prompt)

        def tokens(text: str) -> list[int]:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]

        head = tokens(prompt)
        header = None  # the rendered chat up to where a reply starts, found only when needed
        out = []
        for reply in replies:
            text = self._chat([*messages, assistant_turn(reply)], add_generation_prompt=False)
            ids = tokens(text)
            if ids[: len(head)] != head:
                if header is None:
                    a, b = (self._chat([*messages, assistant_turn(x)], add_generation_prompt=False) for x in "ab")
                    header = os.path.commonprefix([a, b])
                text = prompt + text[len(header) :]
                ids = tokens(text)
            end = text.rfind(reply) + len(reply)
            if ids[: len(head)] != head or end < len(prompt) + len(reply):
                raise ValueError(
                    f"{self.info['lvlm']}: the chat template's assistant turn {reply!r} does not continue the "
                    "prompt, so P(reply) is undefined for this model"
                )
            tail = ids[len(head) :]
            stops = [i for i, t in enumerate(tail) if t in self.stop_ids]
            out.append(tail[: stops[0] + 1] if stops else tokens(text[:end])[len(head) :] + self.stop_ids[:1])
        return out

    def prepare(self, rows: list[int], examples: list[Example], replies: list[list[str]] | None) -> Prepared:
        """The CPU side of one batch (it runs ahead of the model, in a background thread): processor inputs,
        generate()'s positions for the prompt (left padding skipped, Qwen's 3-d rope from the image grids) and every
        reply's tokens; bound for a GPU, in page-locked memory, so that copying them does not make the host wait."""
        batch, device = [examples[i] for i in rows], self.model.device
        ahead, held = [], {}
        with self.phase("preprocess"):
            if self.encoder_cache is None:
                inputs, keys = self._process(batch)
            else:  # pictures the encoder holds are not preprocessed; only the others' pixels are copied and sent
                keys = [picture_key(it["image"]) for query, icds in batch for it in (*icds, query)]
                held = self.encoder_cache.holding(keys) if self.reuse_held else {}
                with self.processor.image_processor.pictures_apart(held) as apart:
                    inputs, keys = self._process(batch)
                pixels = {k: part["pixel_values"] for k, part in zip(keys, apart) if k not in held}
                ahead = list(pixels)
                if ahead:
                    inputs["pixel_values"] = torch.cat(list(pixels.values()))
            pos = generation_positions(self.model, inputs)
            wanted = None
            if replies is not None:
                ids = [self.reply_ids(self.messages(*ex), replies[i]) for ex, i in zip(batch, rows)]
                flat = [torch.tensor(r) for rs in ids for r in rs]
                pad = torch.nn.utils.rnn.pad_sequence
                tokens = pad(flat, True, self.pad_id) if flat else torch.zeros(0, 1, dtype=torch.long)  # (R, L)
                owner = torch.tensor([i for i, rs in enumerate(ids) for _ in rs], dtype=torch.long)  # (R,)
                lengths = torch.tensor([len(r) for rs in ids for r in rs], dtype=torch.long)  # (R,)
                wanted = Replies([len(rs) for rs in ids], *(pinned(t, device) for t in (owner, tokens, lengths)))
        real_tokens, grid = int(inputs["attention_mask"].sum()), inputs.get("image_grid_thw")
        return Prepared(rows, pinned(inputs, device), pinned(pos, device), keys, grid, wanted, real_tokens, ahead, held)

    def batches(self, examples: list[Example], replies: list[list[str]] | None) -> Iterator[Prepared]:
        """The examples in batches of similar length (longest first, less padding), each at most batch_size prompts
        and, with batch_tokens, at most that many padded prompt tokens (a batch over it is processed again, smaller;
        the size of the next is guessed from the longest prompt seen with as many pictures)."""

        def length(i: int) -> tuple[int, int, int]:  # pictures, their pixels, question characters
            items = (*examples[i][1], examples[i][0])
            pixels = sum(picture_pixels(it["image"]) for it in items)
            return len(items), pixels, sum(len(it["question"]) for it in items)

        order = sorted(range(len(examples)), key=length, reverse=True)
        longest: dict[int, int] = {}  # pictures per prompt -> the most prompt tokens seen
        start = 0
        while start < len(order):
            pictures = len(examples[order[start]][1]) + 1
            n = self.batch_size
            if self.batch_tokens and pictures in longest:
                n = max(1, min(n, self.batch_tokens // longest[pictures]))
            while True:
                prep = self.prepare(order[start : start + n], examples, replies)
                tokens = prep.inputs["input_ids"].shape[1]
                longest[pictures] = max(longest.get(pictures, 0), tokens)
                if not self.batch_tokens or n == 1 or len(prep.rows) * tokens <= self.batch_tokens:
                    break
                n = max(1, min(n - 1, self.batch_tokens // tokens))
            start += len(prep.rows)
            yield prep

    @contextmanager
    def phase(self, name: str):
        """Adds the wall time of the block to self.phases[name] when profiling (bench.py), the device synchronised
        at both ends so that each phase is charged only its own work."""
        if self.phases is None:
            yield
            return
        synchronize(self.model.device)
        start = time.perf_counter()
        yield
        synchronize(self.model.device)
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    @torch.inference_mode()
    def run(
        self, examples: list[Example], replies: list[list[str]] | None = None, answer: bool = True
    ) -> tuple[list[str], list[Tensor]]:
        """Everything asked of each prompt from ONE pass over it, in batches of similar length (`batches`): with
        `answer`, the greedy answer (raw text, new tokens only) decoded from the prompt's KV cache as generate() would;
        then every reply of replies[i] (`reply_ids`) teacher-forced behind prompt i from that cache in one more forward
        over the reply tokens, P(reply) the product of its tokens' probabilities. Returns (answers or [], [P(reply)
        (R_i,) per example]). The CPU side of each batch is prepared in a background thread, and results come back from
        the device once, at the end."""
        device = self.model.device
        made = []  # (rows, greedy tokens (B, new) | None, P(reply) (R,) | None, replies per row), on the device
        batches = self.batches(examples, replies)
        inline = self.phases is not None or self.prefetch == 0  # profiling charges each phase its own time
        for prep in batches if inline else prefetched(batches, self.prefetch):
            self.counts["prompt_tokens"] += prep.tokens
            with self.phase("copy"):
                inputs = prep.inputs.to(device, dtype=self.model.dtype, non_blocking=True)
                pos = prep.positions.to(device, non_blocking=True)
            if self.encoder_cache is not None:
                with self.phase("vision"):
                    inputs = self.encoder_cache(prep, inputs)
            else:  # the encoder runs inside the prompt pass, over every picture of the batch
                self.counts["vision_patches"] += self._patches(prep)
            with self.phase("prefill"):
                out = self.model(**inputs, position_ids=pos, use_cache=True, logits_to_keep=1)
            cache, last, mask = out.past_key_values, out.logits[:, -1], inputs["attention_mask"]  # last: (B, V)
            after = pos[..., -1:] + 1  # the next token's position: (B, 1) | (4, B, 1)
            wanted, new, p = prep.replies, None, None
            if answer:
                with self.phase("decode"):
                    new = self._greedy(last, cache, mask, after, keep=wanted is not None)
            if wanted is not None:
                with self.phase("gt_prob"):
                    p = self._replies(wanted, last, cache, mask, after)
            made.append((prep.rows, new, p, None if wanted is None else wanted.per_row))
        texts, probs = [""] * len(examples), [torch.zeros(0)] * len(examples)
        for rows, new, p, per_row in made:
            if new is not None:
                for i, text in zip(rows, self.tokenizer.batch_decode(new.cpu(), skip_special_tokens=True)):
                    texts[i] = text
            if p is not None:
                for i, q in zip(rows, p.cpu().split(per_row)):
                    probs[i] = q
        return texts if answer else [], probs

    def _patches(self, prep: Prepared) -> int:
        """Patches the vision encoder sees in a batch: Qwen's patch rows, else pixels over the patch area (tiles
        and padding included), for bench.py's count of the encoder's work."""
        if prep.grid is not None:
            return int(prep.grid.prod(-1).sum())
        pixels, patch = prep.inputs.get("pixel_values"), getattr(self.model.config.vision_config, "patch_size", 0)
        return pixels.numel() // (pixels.shape[-3] * patch * patch) if torch.is_tensor(pixels) and patch else 0

    def _greedy(self, last: Tensor, cache, mask: Tensor, pos: Tensor, keep: bool) -> Tensor:
        """Greedy tokens (B, new) from a prompt's last logits and cache, padded after each row's stop token; it stops
        once every row has, read on a GPU a step late through `Watch`, so the host never waits (at most one padding step
        more). With `keep`, `cache` is left as the prompt left it, for the replies: decoding runs in a static copy
        (static_decode), or in the cache itself cut back afterwards, or, where layers cannot be cut back (a sliding
        window has dropped what cutting back would need), in a copy."""
        B, T = mask.shape
        forward, work, static = self.model, cache, self.static_decode != "off" and croppable(cache)
        if static:  # fixed shapes at every step: what CUDA graphs replay
            length = -(-(T + self.max_new_tokens) // STATIC_BUCKET) * STATIC_BUCKET  # few shapes: few graphs
            work = self._static_cache(cache, B, length)
            mask = torch.cat([mask, mask.new_zeros(B, length - T)], dim=1)  # (B, L)
            forward = self._decode_call()
        elif keep and not croppable(cache):
            work = copy.deepcopy(cache)
        done = torch.zeros(B, dtype=torch.bool, device=last.device)  # (B,)
        stop = self.stop_tensor
        watch = Watch(last.device)
        tokens, nxt = [], last.argmax(-1)  # (B,)
        for step in range(self.max_new_tokens):
            nxt = nxt.masked_fill(done, self.pad_id)
            tokens.append(nxt)
            done |= torch.isin(nxt, stop)
            if step + 1 == self.max_new_tokens or watch.all(done):
                break
            if static:
                mask[:, T + step] = 1  # in place: the graph's input keeps its address
            else:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, T + step + 1)
            out = forward(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos + step, past_key_values=work)
            nxt = out.logits[:, -1].argmax(-1)
        if keep and work is cache and len(tokens) > 1:
            cache.crop(-(len(tokens) - 1))  # the last token was never fed, so the cache holds len(tokens) - 1 more
        self.counts["new_tokens"] += B * len(tokens)
        return torch.stack(tokens, dim=1)  # (B, new)

    def _static_cache(self, cache, batch: int, length: int) -> StaticCache:
        """A StaticCache of `batch` rows and `length` positions holding the prompt states of `cache` (copied). One is
        kept per shape and reused, so that a CUDA graph recorded over it stays valid."""
        static = self.static_caches.get((batch, length))
        if static is None:
            static = self.static_caches[batch, length] = StaticCache(config=self.model.config, max_cache_len=length)
        for layer, prompt in zip(static.layers, cache.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(prompt.keys, prompt.values)
            T = prompt.keys.shape[-2]
            layer.keys[:, :, :T].copy_(prompt.keys)
            layer.values[:, :, :T].copy_(prompt.values)
            layer.keys[:, :, T:].zero_()
            layer.values[:, :, T:].zero_()
            layer.cumulative_length.fill_(T)
        return static

    def _decode_call(self) -> Callable:
        """The model's forward for decoding steps over a static cache: on CUDA compiled by transformers' own
        get_compiled_call (CUDA graphs: "reduce-overhead") with the static_decode backend, elsewhere plain."""
        if self.model.device.type != "cuda":
            return self.model
        config = CompileConfig(fullgraph=False, dynamic=False, backend=self.static_decode, mode="reduce-overhead")
        if self.static_decode == "cudagraphs":  # dynamo's capture replayed as CUDA graphs, no code generation
            config = CompileConfig(fullgraph=False, dynamic=False, backend="cudagraphs", mode=None)
        return self.model.get_compiled_call(config)

    def _replies(self, wanted: Replies, last: Tensor, cache, mask: Tensor, pos: Tensor) -> Tensor:
        """P(reply) (R,) float64 of every reply of the batch, teacher-forced from the prompt's cache (consumed)."""
        device = last.device
        if len(wanted.rows) == 0:
            return torch.zeros(0, dtype=torch.float64, device=device)
        rows = wanted.rows.to(device, non_blocking=True)  # (R,) the prompt of each reply
        reply = wanted.tokens.to(device, non_blocking=True)  # (R, L)
        lengths = wanted.lengths.to(device, non_blocking=True)  # (R,)
        reply_mask = torch.arange(reply.shape[1], device=device) < lengths[:, None]  # (R, L)
        self.counts["reply_tokens"] += int(wanted.lengths.sum())
        cache.batch_select_indices(rows)  # each prompt's keys and values once per reply
        full = torch.cat([mask[rows], reply_mask.to(mask.dtype)], dim=1)  # (R, T + L)
        steps = torch.arange(reply.shape[1], device=device)
        out = self.model(
            input_ids=reply, attention_mask=full, position_ids=pos.index_select(-2, rows) + steps, past_key_values=cache
        )
        # Reply token 0 is predicted by the prompt's last logits, token j > 0 by the reply's column j - 1.
        logits = torch.cat([last[rows][:, None], out.logits[:, :-1]], dim=1)  # (R, L, V)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, reply[..., None]).squeeze(-1)  # (R, L)
        return (logp.double() * reply_mask).sum(1).exp()  # (R,) float64: tiny probabilities stay above 0

    @contextmanager
    def _stock_images(self):
        """The processor with its own image processor, not the per-image cache (for the self-check's plain path)."""
        cached = self.processor.image_processor
        self.processor.image_processor = getattr(cached, "inner", cached)
        try:
            yield
        finally:
            self.processor.image_processor = cached

    @torch.inference_mode()
    def plain(self, example: Example, replies: list[str]) -> tuple[str, list[float]]:
        """The plain computation for one prompt alone, with none of run()'s sharing: the stock processor,
        model.generate() for the answer, and one full forward over prompt + reply for each log P(reply)."""
        messages = self.messages(*example)
        with self._stock_images():
            inputs = self.encode([example])
        prompt_len = inputs["input_ids"].shape[1]
        answer = self.model.generate(**inputs)[0, prompt_len:]
        logps = []
        for ids in self.reply_ids(messages, replies):
            reply = torch.tensor([ids], device=self.model.device)  # (1, L)
            # Per-token inputs (Qwen's mm_token_type_ids, Gemma3's token_type_ids) mark the reply as text: 0.
            full = {
                k: F.pad(v, (0, len(ids))) if k != "input_ids" and is_per_token(v, inputs) else v
                for k, v in inputs.items()
            }
            full["input_ids"] = torch.cat([inputs["input_ids"], reply], dim=1)  # (1, T + L)
            full["attention_mask"] = torch.ones_like(full["input_ids"])
            logits = self.model(**full).logits[0, prompt_len - 1 : -1].float()  # (L, V)
            logps.append(torch.log_softmax(logits, -1).gather(-1, reply[0, :, None]).sum().item())
        return self.tokenizer.decode(answer, skip_special_tokens=True), logps

    def check_examples(self, n: int = 8, max_shots: int = 4, seed: int = 0) -> list[Example]:
        """n prompts of this data for the self-check: validation queries with 0..max_shots random train ICDs (never
        of the query's image), so one batch mixes prompt lengths, image sizes and left padding."""
        rng = random.Random(seed)
        train, queries = self.items["train"], self.items.get("val") or self.items["train"]
        examples = []
        for i in range(n):
            query = queries[rng.randrange(len(queries))]
            others = [it for it in train if it["image"] != query["image"]]
            examples.append((query, rng.sample(others, min(i % (max_shots + 1), len(others)))))
        return examples

    def self_check(self, examples: list[Example] | None = None) -> dict:
        """Compare run() (batched, left-padded, one shared pass per prompt) with plain() on each prompt alone, for the
        greedy answer and every credited reply (check_examples() when no examples are given). Returns {"prompts",
        "answers_differ", "max_abs_logp_diff", "tolerance", "tolerance_rel"}; raises one-line ValueError when an answer
        differs or a log P(reply) is off by more than tolerance + tolerance_rel * |lp|: 1e-3 nats in float32; in half
        precision 0.1 nats + 0.5% of |lp| with one answer in four allowed to flip, since rounding grows with the logits
        and swaps near ties."""
        examples = self.check_examples() if examples is None else examples
        replies = [self.replies(query) for query, _ in examples]
        half = self.model.dtype in (torch.float16, torch.bfloat16)
        tolerance, rel = (0.1, 0.005) if half else (1e-3, 0.0)
        answers, probs = self.run(examples, replies)
        varlen = varlen_runs(self.model)
        if varlen:  # plain transformers: its own attention in the vision encoder too, and no compiled regions
            vision_attention(self.model, varlen=False)
        try:
            with torch.compiler.set_stance("force_eager"):
                plain = [self.plain(example, rs) for example, rs in zip(examples, replies)]
        finally:
            if varlen:
                vision_attention(self.model, varlen=True)
        differ, worst, over = 0, 0.0, False
        for answer, p, (plain_answer, plain_logps) in zip(answers, probs, plain):
            differ += answer != plain_answer
            for q, lp in zip(p.tolist(), plain_logps):
                diff = abs(math.log(q) - lp) if q > 0 else math.inf
                worst, over = max(worst, diff), over or diff > tolerance + rel * abs(lp)
        report = {
            "prompts": len(examples),
            "answers_differ": differ,
            "max_abs_logp_diff": worst,
            "tolerance": tolerance,
            "tolerance_rel": rel,
        }
        if over or differ > (len(examples) // 4 if half else 0):
            bound = f"{tolerance} + {rel:g} x |log P|" if rel else f"{tolerance}"
            raise ValueError(
                f"{self.info['lvlm']}: the fast scoring path disagrees with plain transformers on {len(examples)} "
                f"prompts of this data ({differ} answers differ, log P(reply) off by up to {worst:.3g} nats, "
                f"tolerance {bound}); this model family is not supported exactly. --skip-self-check runs anyway"
            )
        return report

    def generate(self, examples: list[Example]) -> list[str]:
        """Raw greedy generations (new tokens only, special tokens dropped)."""
        return self.run(examples)[0]

    def gt_prob(self, examples: list[Example]) -> Tensor:
        """Probability mass on replies the VQA metric credits, weighted by that credit: (N,) in [0, 1]. Distinct replies
        end with the turn's closing token, so they are exclusive and the sum is the expected VQA accuracy over these
        spellings (a lower bound: spellings no annotator used, like "Yes.", are not scored)."""
        credited = [credited_replies(query["answers"]) for query, _ in examples]
        return credit_sum(credited, self.run(examples, [[r for r, _ in c] for c in credited], answer=False)[1])

    def shown(self, item: dict) -> str:
        """What a demonstration shows of its item (`vqa.shown_answer`)."""
        return shown_answer(item["answers"], self.task)

    def replies(self, query: dict) -> list[str]:
        """The replies whose probability a prompt's soft score adds up: every credited VQA answer, or the caption of
        the query's that a demonstration would show (its first reference)."""
        if self.task == "caption":
            return [self.shown(query)]
        return [r for r, _ in credited_replies(query["answers"])]

    def geometric(self, examples: list[Example], replies: list[str], probs: list[Tensor]) -> Tensor:
        """Each example's one reply probability P(reply) (as `run` gives it) as the geometric mean of its tokens'
        probabilities, its stop token included: (N,) float64."""
        lengths = [len(self.reply_ids(self.messages(*ex), [r])[0]) for ex, r in zip(examples, replies)]
        return torch.stack([p[0] ** (1 / n) for p, n in zip(probs, lengths)])  # (N,)

    def info_prob(self, split: str, queries: Tensor, icds: Tensor) -> Tensor:
        """InfoScore's P(y | ICDs, x) (Lever-LM): the geometric-mean probability of the tokens of y, the query's answer
        as a demonstration would show it (`shown`), teacher-forced as the assistant's reply (its stop token included):
        (N,) float64, from the same pass over each prompt as P(reply)."""
        examples = self.examples(split, queries, icds)
        refs = [self.shown(query) for query, _ in examples]
        return self.geometric(examples, refs, self.run(examples, [[r] for r in refs], answer=False)[1])

    def score_examples(self, examples: list[Example], gt_prob: bool = True) -> dict:
        """score() for explicit (query item, ICD items) prompts, ICD lists of any length; gt_prob=False skips the
        replies (NaN instead): evaluation needs only the answers. A caption's acc is its CIDEr-D against the query's
        references, document frequencies fixed by the train split's (`cider.CiderD`), correct when that reaches 1 (as
        good as a typical reference), and its gt_prob the geometric-mean probability of the query's first reference."""
        replies = [self.replies(query) for query, _ in examples] if gt_prob else None
        texts, probs = self.run(examples, replies)
        predictions = [postprocess(text) for text in texts]
        gts = [query["answers"] for query, _ in examples]
        rel = torch.tensor([answer_rel(p, a) for p, a in zip(predictions, gts)], dtype=torch.float32)  # (N,)
        soft = torch.full((len(examples),), float("nan"))  # (N,) without the replies
        if self.task == "caption":
            refs = [ptb_tokenize(query["answers"]) for query, _ in examples]
            acc = torch.tensor(self.cider.score(ptb_tokenize(predictions), refs), dtype=torch.float32)  # (N,)
            correct = acc >= 1
            if gt_prob:
                soft = self.geometric(examples, [r[0] for r in replies], probs)
        else:
            acc = torch.tensor([vqa_score(p, a) for p, a in zip(predictions, gts)], dtype=torch.float32)  # (N,)
            correct = acc > 0
            if gt_prob:
                soft = credit_sum([credited_replies(a) for a in gts], probs)
        return {"prediction": predictions, "acc": acc, "correct": correct, "gt_prob": soft, "rel": rel}

    @functools.cached_property
    def cider(self) -> CiderD:
        """CIDEr-D whose document frequencies are the train split's references (a caption's reward never depends on
        the other prompts scored with it), built once."""
        return CiderD([ptb_tokenize(it["answers"]) for it in self.items["train"]])

    def score(self, split: str, queries: Tensor, icds: Tensor, gt_prob: bool = True) -> dict:
        """Answer and score each query of `split` given its ICDs (train rows, prompt order): (N,), (N, k) -> (N,)s."""
        return self.score_examples(self.examples(split, queries, icds), gt_prob)

    def examples(self, split: str, queries: Tensor, icds: Tensor) -> list[Example]:
        """The (query item, ICD items) prompts of queries (N,) of `split` and their ICDs (N, k) train rows."""
        if queries.dim() != 1 or icds.dim() != 2 or icds.shape[0] != queries.shape[0]:
            raise ValueError(f"expected queries (N,) and icds (N, k), got {tuple(queries.shape)}, {tuple(icds.shape)}")
        pool, split_items = self.items["train"], self.items[split]
        return [(split_items[q], [pool[j] for j in row if j >= 0]) for q, row in zip(queries.tolist(), icds.tolist())]

    def describe(self) -> dict:
        return {
            "lvlm": self.info["lvlm"],
            "revision": self.info["revision"],
            "prompt_template": asdict(self.template),
            "system_prompt": self.system_prompt,
            "generation": {"max_new_tokens": self.max_new_tokens, "do_sample": False},
            # What gt_prob means, so that a dataset folder never mixes two definitions when it resumes.
            "gt_prob": GT_PROB[self.task],
            "simulation": False,
            **({"prompt_note": self.layout_note} if self.layout_note else {}),
        }
