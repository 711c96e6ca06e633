"""Tests for the real-model backend (lvlm.py), fully offline.

Tiny random-weight Qwen2.5-VL / CLIP checkpoints and an OK-VQA-format dataset are built once per session by
icl_select/tiny.py and loaded through the same from_pretrained path as real checkpoints. Expected values are
computed independently of lvlm.py where it matters: prompt text by hand, gt_prob from one explicit forward pass.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import types
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch import Tensor
from transformers import Qwen2_5_VLProcessor

from icl_select import clip, hf, lvlm, pictures
from icl_select.clip import clip_embed
from icl_select.files import folder_digest
from icl_select.hf import image_only, load_lvlm
from icl_select.lvlm import LVLMBackend, PromptTemplate, credited_replies, memory_batch_tokens, prefetched
from icl_select.pictures import ByteLRU, load_image
from icl_select.vqa import answer_rel, normalize_answer, postprocess, vqa_score
from icl_select.vqa_data import load_vqa_split

VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
MIB = 2**20


@pytest.fixture(scope="session")
def items(assets) -> dict[str, list[dict]]:
    return {split: load_vqa_split("okvqa", assets["okvqa"], split) for split in ("train", "val")}


@pytest.fixture(scope="session")
def backend(assets, items) -> LVLMBackend:
    return LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)


def majority(item: dict) -> str:
    return Counter(item["answers"]).most_common(1)[0][0]


# ---------------------------------------------------------------------------------------------------------------
# prompt
# ---------------------------------------------------------------------------------------------------------------


def test_prompt_has_icds_in_order_then_query(backend, items):
    icds = [items["train"][i] for i in (5, 0, 9)]
    query = items["val"][2]
    text, images = backend.render(query, icds)
    user = "".join(f"{VISION_BLOCK}Question: {it['question']} Short answer: {majority(it)}" for it in icds)
    user += f"{VISION_BLOCK}Question: {query['question']} Short answer:"
    # The model's own default system turn when no system prompt is given, then ONE user turn, then the reply prompt.
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected
    assert images == [load_image(it["image"]) for it in [*icds, query]]
    assert all(a is load_image(it["image"]) for a, it in zip(images, [*icds, query]))  # decoded once, cached


def test_each_image_preprocessed_once(backend, items):
    cached = backend.processor.image_processor
    cached.cache.clear()
    before = cached.misses
    examples = [
        (items["val"][0], [items["train"][i] for i in (1, 2)]),
        (items["val"][1], [items["train"][i] for i in (2, 1)]),
    ]
    inputs = backend.encode(examples)
    backend.gt_prob(examples)  # one more pass per distinct annotator answer, same images
    assert cached.misses - before == 4  # 2 ICD images + 2 query images, whatever the number of prompts and passes
    images = [load_image(it["image"]) for query, icds in examples for it in (*icds, query)]
    stock = cached.inner(images=images, return_tensors="pt")  # the uncached image processor on the whole batch
    assert torch.equal(inputs["image_grid_thw"], stock["image_grid_thw"])
    assert torch.equal(inputs["pixel_values"], stock["pixel_values"].to(inputs["pixel_values"].dtype))


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40)), max_size=60), st.integers(1, 100))
def test_byte_lru_stays_within_budget_and_evicts_the_least_recently_used(ops, budget):
    cache, made, order = ByteLRU(budget, sizeof=lambda v: v[1]), [], []
    for key, size in ops:
        value = cache.get(key, lambda k=key, s=size: made.append(k) or (k, s))  # noqa: B023
        assert value[0] == key
        order = [k for k in order if k != key] + [key]  # recency, oldest first
        assert list(cache.entries) == order[-len(cache.entries) :]  # what is kept: the most recently used
        assert cache.bytes == sum(size for _, size in cache.entries.values())
        assert cache.bytes <= budget or len(cache.entries) == 1  # the newest entry alone may exceed it
        order = list(cache.entries)
    assert cache.misses == len(made)


@given(st.integers(0, 2**31 - 1))
@settings(max_examples=10, deadline=None)
def test_byte_lru_shared_by_threads_keeps_exact_bytes(seed):
    """The threads that prepare batches share the picture caches: a key made by two threads at once is held once,
    and the byte count stays the sum of what is held."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 12, (8, 40), generator=g).tolist()  # 8 threads, 40 lookups each, over 12 keys
    cache = ByteLRU(int(torch.randint(10, 200, (), generator=g)), sizeof=lambda v: v[1])

    def work(row: list[int]) -> None:
        for key in row:
            assert cache.get(key, lambda k=key: (k, 5 + k))[0] == key

    threads = [threading.Thread(target=work, args=(row,)) for row in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.bytes == sum(size for _, size in cache.entries.values())
    assert cache.bytes <= cache.budget or len(cache.entries) == 1


def test_prefetched_hands_over_items_errors_and_stops_when_left():
    def items(fail_at: int | None):
        for i in range(10):
            if i == fail_at:
                raise ValueError(f"picture {i}: not a readable image")
            yield i

    assert list(prefetched(items(None), 2)) == list(range(10))
    seen = []
    with pytest.raises(ValueError, match="picture 3"):  # the worker's own error, raised where the items are used
        for i in prefetched(items(3), 2):
            seen.append(i)
    assert seen == [0, 1, 2]
    before = threading.active_count()
    for i in prefetched(items(None), 2):
        if i == 1:
            break  # leaving early stops the worker instead of leaving it blocked on a full queue
    assert threading.active_count() == before


def test_batches_are_longest_first_within_the_token_budget(assets, items, backend):
    """Prompts of 0-4 demonstrations go in batches of similar length, none over --lvlm-batch-tokens padded tokens
    (unless it holds one prompt), and each prompt's answer and P(reply) are those of unbudgeted batches."""
    examples = [(items["val"][q % 8], items["train"][q : q + q % 5]) for q in range(20)]
    replies = [[r for r, _ in credited_replies(query["answers"])] for query, _ in examples]
    lengths = [int(backend.process([ex])["attention_mask"].sum()) for ex in examples]
    budget = 3 * max(lengths)
    tight = LVLMBackend(str(assets["qwen"]), items, batch_size=8, max_new_tokens=4, batch_tokens=budget)
    formed = [prep.rows for prep in tight.batches(examples, None)]
    assert sorted(i for rows in formed for i in rows) == list(range(len(examples)))  # each prompt once
    assert all(len(rows) * max(lengths[i] for i in rows) <= budget for rows in formed)
    assert len(formed[0]) == 3 and max(len(rows) for rows in formed) > 3  # shorter prompts fit more
    pictures = [len(examples[i][1]) for rows in formed for i in rows]
    assert pictures == sorted(pictures, reverse=True)  # the most pictures first: similar lengths share a batch
    loose = LVLMBackend(str(assets["qwen"]), items, batch_size=20, max_new_tokens=4)
    a, b = tight.run(examples, replies), loose.run(examples, replies)
    assert a[0] == b[0]
    assert all(torch.allclose(p, q, rtol=1e-5, atol=0) for p, q in zip(a[1], b[1]))


def test_the_batch_is_left_to_the_kit_by_default(assets, items):
    """--lvlm-batch-size 0 (the default) is 8 prompts on the CPU, with no token bound; on a GPU, 64 bounded by what
    half its free memory holds, at each token's keys and values (twice: the prompt's cache and decoding's copy) and
    the widest layer's activations, counted here by hand for Qwen2.5-VL-3B's published shape in bfloat16."""
    kit = LVLMBackend(str(assets["qwen"]), items, max_new_tokens=4)
    assert (kit.batch_size, kit.batch_tokens) == (8, 0)
    text = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16)
    config = transformers.Qwen2Config(**text, num_key_value_heads=2)
    model = types.SimpleNamespace(config=config, dtype=torch.bfloat16)
    per_token = (2 * 2 * 36 * 2 * 128 + 4 * 2048 + 3 * 11008) * 2  # bytes: keys and values twice, MLP and residuals
    assert memory_batch_tokens(model, 40 * 2**30) == 40 * 2**30 // per_token == 275_036


def test_image_caches_follow_the_budget_flag(assets, items):
    small = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4, image_cache_mib=1)
    patches = small.processor.image_processor.cache
    assert pictures.DECODED_IMAGES.budget == patches.budget == MIB // 2
    examples = [(items["val"][q], items["train"][3 * q : 3 * q + 3]) for q in range(6)]
    small.encode(examples)  # about 0.9 MiB of patches at the fixture's sizes: some must go
    assert 0 < patches.bytes <= MIB // 2 and patches.misses > len(patches.entries)
    big = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)  # the default: 4 GiB
    assert pictures.DECODED_IMAGES.budget == 2048 * MIB
    a, b = small.encode(examples), big.encode(examples)  # eviction changes memory, never the inputs
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_picture_is_encoded_once_and_changes_nothing(assets, items, monkeypatch):
    """The vision encoder's output of a picture that recurs across prompts (a group's query, a pool's ICDs) is
    computed once while it stays cached, and answers and P(reply) are those of the pixels path, also when the cache is
    too small to keep more than the newest picture."""
    pool = [items["train"][i] for i in (1, 2, 4)]  # three pictures (train items 2k and 2k + 1 share one)
    examples = [(items["val"][q], [pool[(q + j) % 3] for j in range(2)]) for q in range(2) for _ in range(3)]
    replies = [[query["answers"][0], "Yes"] for query, _ in examples]
    pixels = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4, encoder_cache_mib=0)
    assert pixels.encoder_cache is None
    want = pixels.run(examples, replies)
    for budget in (None, 1):  # the default, then 1 byte: every new picture evicts the last
        kit = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)
        if budget is not None:
            kit.encoder_cache.cache.budget = budget
        encoded, inner = [], kit.model.get_image_features

        def counted(pixels, grid, encoded=encoded, inner=inner, **kwargs):
            encoded.append(len(grid))  # pictures in this encoder pass
            return inner(pixels, grid, **kwargs)

        monkeypatch.setattr(kit.model, "get_image_features", counted)
        answers, probs = kit.run(examples, replies)
        assert answers == want[0]
        assert all(torch.allclose(p, q, rtol=1e-5, atol=0) for p, q in zip(probs, want[1]))
        # 5 distinct pictures, all in the first batch of 4 prompts; the second (2 prompts) finds its 3 cached, or with
        # 1 byte only the first batch's last (the query's), so it encodes the 2 ICD pictures again
        assert encoded == ([5] if budget is None else [5, 2]), encoded
        held = kit.encoder_cache.cache
        assert held.bytes == sum(size for _, size in held.entries.values())  # hits are not counted twice
        assert len(held.entries) == (5 if budget is None else 1)


def test_a_picture_the_encoder_holds_is_not_preprocessed_again(assets, items):
    """Each picture goes through the image processor once while the encoder holds its output, however few pictures'
    patches the cache keeps (a run's pictures recur in thousands of prompts, and their patches are the bulkiest thing
    it keeps); answers and P(reply) are the pixels path's."""
    pool = [items["train"][i] for i in range(0, 16, 2)]  # eight pictures
    examples = [(items["val"][q % 2], [pool[(3 * q + j) % 8] for j in range(3)]) for q in range(8)]
    replies = [[query["answers"][0], "Yes"] for query, _ in examples]
    pixels = LVLMBackend(str(assets["qwen"]), items, batch_size=1, max_new_tokens=4, encoder_cache_mib=0)
    want = pixels.run(examples, replies)
    kit = LVLMBackend(str(assets["qwen"]), items, batch_size=1, max_new_tokens=4)
    kit.prefetch = 0  # each prompt prepared once the one before has run
    cached, paths = kit.processor.image_processor, {it["image"] for query, icds in examples for it in (*icds, query)}
    sizes = sorted(cached.cache.sizeof(cached.inner([load_image(p)], return_tensors="pt")) for p in paths)
    cached.cache.budget = sum(sizes[-4:])  # one prompt's pictures, not the ten
    made = []

    class Counted:  # the image processor, each picture it preprocesses noted
        def __call__(self, images, **kwargs):
            made.extend(image.info[pictures.IMAGE_KEY][0] for image in images)
            return inner(images, **kwargs)

        def __getattr__(self, name):
            return getattr(inner, name)

    inner, cached.inner = cached.inner, Counted()
    answers, probs = kit.run(examples, replies)
    assert sorted(made) == sorted(paths)
    assert answers == want[0]
    assert all(torch.allclose(p, q, rtol=1e-5, atol=0) for p, q in zip(probs, want[1]))


def test_a_picture_changed_in_place_is_read_again(assets, items, tmp_path):
    """Every picture cache (decoded pictures, preprocessed patches, the encoder's outputs) knows a file by its path,
    size, modification time and inode: a picture rewritten in place under the same name is decoded, preprocessed and
    encoded anew, and the prompt scores as it does for a process that never saw the old one."""
    path = tmp_path / "picture.jpg"
    Image.new("RGB", (56, 42), (220, 30, 30)).save(path, quality=95)
    query = dict(items["val"][0], image=str(path))
    examples, replies = [(query, items["train"][2:4])], [["red", "blue"]]
    kit = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)
    before = kit.run(examples, replies)
    old = path.stat()
    Image.new("RGB", (56, 42), (30, 60, 220)).save(path, quality=95)  # the same name and pixel size
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns + 10**9))  # a later time, whatever the clock's resolution
    with Image.open(path) as img:
        drawn = img.convert("RGB")
    assert load_image(str(path)).tobytes() == drawn.tobytes()
    stock = kit.processor.image_processor.inner(images=[drawn], return_tensors="pt")
    assert torch.equal(kit.encode([(query, [])])["pixel_values"], stock["pixel_values"])
    after = kit.run(examples, replies)
    pictures.DECODED_IMAGES.clear()
    fresh = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4).run(examples, replies)
    assert after[0] == fresh[0] and torch.equal(after[1][0], fresh[1][0])
    assert not torch.equal(before[1][0], after[1][0])  # the picture matters to the model: a stale one would show


def test_pictures_preprocessed_in_worker_processes_are_the_same_bits(assets, items):
    """Picture workers are processes (the GIL stays with the thread that drives the model); what they return is the
    image processor's output on the same picture, bit for bit."""
    kit = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4, workers=2, worker_processes=True)
    assert isinstance(kit.picture_pool, ProcessPoolExecutor)
    cached = kit.processor.image_processor
    cached.cache.clear()
    examples = [(items["val"][q], items["train"][4 * q : 4 * q + 3]) for q in range(4)]
    got = kit.encode(examples)
    assert cached.misses >= len({it["image"] for query, icds in examples for it in (*icds, query)})
    pictures = []
    for query, icds in examples:
        for it in (*icds, query):
            with Image.open(it["image"]) as img:
                pictures.append(img.convert("RGB"))
    stock = cached.inner(images=pictures, return_tensors="pt")
    assert torch.equal(got["pixel_values"], stock["pixel_values"])
    assert torch.equal(got["image_grid_thw"], stock["image_grid_thw"])


def test_the_encoder_gets_only_unseen_pictures_and_one_evicted_meanwhile(assets, items):
    """A prepared batch carries the pixels of the pictures the encoder cache lacks, not the others, and keeps the
    others' outputs: a picture evicted between preparing and running a batch is still the stock encoder's output."""
    kit = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)
    kit.run([(items["val"][0], [items["train"][0], items["train"][2]])])  # three pictures encoded
    batch = [(items["val"][0], [items["train"][2], items["train"][4]])]  # two of them, and a new one
    prep = kit.prepare([0], batch, None)
    new = items["train"][4]["image"]
    assert [key[0] for key in prep.ahead] == [new]
    with Image.open(new) as img:
        rows = kit.processor.image_processor.inner(images=[img.convert("RGB")], return_tensors="pt")["pixel_values"]
    assert torch.equal(prep.inputs["pixel_values"], rows)  # only the unseen picture's patch rows
    kit.encoder_cache.cache.clear()  # every picture evicted before the batch runs
    encoded = kit.encoder_cache(prep, prep.inputs)["mm_encoder_outputs"]["image"].pooler_output
    pictures = []
    for it in (items["train"][2], items["train"][4], items["val"][0]):
        with Image.open(it["image"]) as img:
            pictures.append(img.convert("RGB"))
    stock = kit.processor.image_processor.inner(images=pictures, return_tensors="pt")
    with torch.no_grad():
        want = kit.model.get_image_features(**stock).pooler_output
    torch.testing.assert_close(torch.cat(encoded), torch.cat(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "idefics3", "llava_next", "gemma3"])
def test_decoding_over_a_static_cache_answers_as_generate(name, family_models, mixed_items):
    """static_decode: decoding runs over a StaticCache (fixed shapes: what CUDA graphs replay; compiled on CUDA only),
    giving generate()'s answers on each prompt alone and P(reply) from the prompt's own cache, untouched; a family
    with a sliding window decodes as before."""
    from test_families import MAX_NEW, Reference, rgb_images

    train, val = mixed_items["train"], mixed_items["val"]
    examples = [(val[i % len(val)], [train[(3 * i + j) % len(train)] for j in range(i % 5)]) for i in range(10)]
    replies = [[query["answers"][0], "Yes"] for query, _ in examples]
    folder = str(family_models[name])
    static = LVLMBackend(folder, mixed_items, batch_size=4, max_new_tokens=MAX_NEW, static_decode="inductor")
    answers, probs = static.run(examples, replies)
    assert bool(static.static_caches) == (name != "gemma3")
    ref = Reference(family_models[name])
    chats = [static.messages(query, icds) for query, icds in examples]
    assert answers == [ref.answer(c, rgb_images(*ex)) for c, ex in zip(chats, examples)]
    for ps, chat, ex, rs in zip(probs, chats, examples, replies):
        want = [ref.log_prob(chat, rgb_images(*ex), r) for r in rs]
        assert ps.log().tolist() == pytest.approx(want, abs=1e-4)


def test_processor_gets_images_in_prompt_order(backend, items):
    icds = [items["train"][i] for i in (5, 0, 9)]
    query = items["val"][2]
    inputs = backend.encode([(query, icds)])
    per_image = [backend.processor.image_processor(images=[load_image(it["image"])]) for it in [*icds, query]]
    grids = torch.cat([torch.as_tensor(p["image_grid_thw"]) for p in per_image])  # (k + 1, 3)
    assert torch.equal(inputs["image_grid_thw"], grids)
    assert torch.allclose(inputs["pixel_values"], torch.cat([torch.as_tensor(p["pixel_values"]) for p in per_image]))
    # Each vision block holds as many image tokens as its own image's merged grid (the fixture's sizes differ).
    ids = inputs["input_ids"][0].tolist()
    tok = backend.tokenizer
    starts = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<|vision_start|>")]
    ends = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<|vision_end|>")]
    assert [e - s - 1 for s, e in zip(starts, ends)] == (grids.prod(-1) // 4).tolist()
    assert len(set(grids.prod(-1).tolist())) > 1, "fixture images should differ in size for this test to bite"


def test_system_prompt_and_template_are_used_and_described(assets, items):
    template = PromptTemplate(icd="Q: {question} A: {answer}\n", query="Q: {question} A:")
    custom = LVLMBackend(
        str(assets["qwen"]), items, max_new_tokens=3, system_prompt="Answer briefly.", template=template
    )
    icd, query = items["train"][1], items["val"][0]
    text, _ = custom.render(query, [icd])
    assert text == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
        f"{VISION_BLOCK}Q: {icd['question']} A: {majority(icd)}\n{VISION_BLOCK}Q: {query['question']} A:<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert custom.describe() == {
        "lvlm": str(assets["qwen"]),
        "revision": folder_digest(assets["qwen"]),  # a model folder of your own: who its files are
        "prompt_template": {"icd": template.icd, "query": template.query, "style": "single-turn"},
        "system_prompt": "Answer briefly.",
        "generation": {"max_new_tokens": 3, "do_sample": False},
        "gt_prob": "sum of VQA credit x P(reply) over normalised annotator answers and their raw spellings",
        "simulation": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------


def test_turn_per_demo_style_gives_each_icd_its_own_turn_pair(assets, items):
    style = PromptTemplate(style="turn-per-demo")
    turns = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=3, template=style)
    icds = [items["train"][i] for i in (5, 0)]
    query = items["val"][2]
    text, images = turns.render(query, icds)
    pairs = "".join(
        f"<|im_start|>user\n{VISION_BLOCK}Question: {it['question']} Short answer:<|im_end|>\n"
        f"<|im_start|>assistant\n{majority(it)}<|im_end|>\n"
        for it in icds
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        + pairs
        + f"<|im_start|>user\n{VISION_BLOCK}Question: {query['question']} Short answer:<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert images == [load_image(it["image"]) for it in [*icds, query]]
    assert turns.describe()["prompt_template"]["style"] == "turn-per-demo"
    # it scores like the single-turn layout does: answers and gt_prob for the same examples, in a batch
    out = turns.score_examples([(query, icds), (items["val"][0], [])])
    assert len(out["prediction"]) == 2 and ((out["gt_prob"] > 0) & (out["gt_prob"] <= 1)).all()


def test_batched_generation_equals_one_by_one(backend, items):
    train = items["train"]
    # 0..3 shots mixed in each batch of 4, plus different image sizes: prompts of many lengths.
    examples = [(items["val"][i], [train[(5 * i + j) % len(train)] for j in range(i % 4)]) for i in range(8)]
    assert (backend.encode(examples[:4])["attention_mask"][:, 0] == 0).any(), "expected left padding in the batch"
    batched = backend.generate(examples)
    single = [backend.generate([ex])[0] for ex in examples]
    assert batched == single
    assert any(batched), "the tiny model should generate some visible text"
    # decoding from the prompt's KV cache gives what transformers' own greedy generate() gives
    inputs = backend.encode(examples[:4])
    reference = backend.model.generate(**inputs)[:, inputs["input_ids"].shape[1] :]  # (4, new)
    assert batched[:4] == backend.tokenizer.batch_decode(reference, skip_special_tokens=True)


def test_generation_is_plain_greedy(backend, items):
    # The fixture's checkpoint asks for sampling with a repetition penalty, like Qwen2.5-VL-Instruct's.
    gen = backend.model.generation_config
    assert gen.do_sample is False and gen.repetition_penalty in (None, 1.0) and gen.max_new_tokens == 4
    inputs = backend.encode([(items["val"][4], items["train"][:2])])
    out = backend.model.generate(**inputs)  # (1, T + new)
    prompt_len = inputs["input_ids"].shape[1]
    # Teacher-force the generated continuation: every new token is the argmax at the position before it.
    full = {**inputs, "input_ids": out, "attention_mask": torch.ones_like(out)}
    full["mm_token_type_ids"] = F.pad(inputs["mm_token_type_ids"], (0, out.shape[1] - prompt_len))
    logits = backend.model(**full).logits[0, prompt_len - 1 : -1]  # (new, V)
    assert torch.equal(logits.argmax(-1), out[0, prompt_len:])


# ---------------------------------------------------------------------------------------------------------------
# gt_prob
# ---------------------------------------------------------------------------------------------------------------


def reply_prob_by_hand(backend: LVLMBackend, query: dict, icds: list[dict], answer: str) -> float:
    """P(reply == answer) from ONE forward pass over prompt + answer + <|im_end|>, no padding, no lvlm internals."""
    text, images = backend.render(query, icds)
    inputs = backend.processor(text=[text], images=[images], return_tensors="pt")
    tok = backend.tokenizer
    reply = tok(answer, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    prompt_len = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([reply])], dim=1)  # (1, T + L)
    with torch.no_grad():
        logits = backend.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=F.pad(inputs["mm_token_type_ids"], (0, len(reply))),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
        ).logits[0]  # (T + L, V)
    probs = torch.softmax(logits[prompt_len - 1 : prompt_len - 1 + len(reply)].double(), dim=-1)  # (L, V)
    return math.prod(probs[j, t].item() for j, t in enumerate(reply))


def test_gt_prob_single_answer_is_product_of_answer_token_probs(backend, items):
    query = dict(items["val"][1], answers=["red"] * 10)
    icds = items["train"][3:5]
    expected = reply_prob_by_hand(backend, query, icds, "red")
    assert 0 < expected < 1
    assert backend.gt_prob([(query, icds)]).item() == pytest.approx(expected, rel=1e-4)
    # Also inside a left-padded batch of longer and shorter prompts with several answers each.
    batch = [(items["val"][0], items["train"][:3]), (query, icds), (items["val"][2], [])]
    assert backend.gt_prob(batch)[1].item() == pytest.approx(expected, rel=1e-4)


def test_info_prob_is_the_geometric_mean_of_the_most_common_answers_tokens(backend, items):
    """InfoScore's P(y | ICDs, x), Lever-LM's: exp of the mean log-probability of the reply tokens of the query's most
    common answer (its stop token included), from one plain forward pass per prompt; with 0 and 1 demonstrations, and
    for three prompts of 2 demonstrations each asked together (one left-padded batch)."""
    tok = backend.tokenizer

    def by_hand(q: int, icds: list[int]) -> float:
        query, demos = items["val"][q], [items["train"][j] for j in icds]
        y = Counter(query["answers"]).most_common(1)[0][0]
        tokens = len(tok(y, add_special_tokens=False)["input_ids"]) + 1  # + <|im_end|>
        return reply_prob_by_hand(backend, query, demos, y) ** (1 / tokens)

    for q, icds in ((0, []), (1, [3])):
        got = backend.info_prob("val", torch.tensor([q]), torch.tensor([icds], dtype=torch.long).view(1, len(icds)))
        assert got.item() == pytest.approx(by_hand(q, icds), rel=1e-4)
    shots = [[4, 5], [6, 0], [1, 7]]
    want = [by_hand(q, icds) for q, icds in zip((0, 1, 2), shots)]
    assert backend.info_prob("val", torch.tensor([0, 1, 2]), torch.tensor(shots)).tolist() == pytest.approx(
        want, rel=1e-4
    )
    assert 0 < min(want) < max(want) < 1


def test_gt_prob_weights_distinct_answers_by_vqa_credit(backend, items):
    # Single-character answers are single byte-level tokens, so their probabilities under the random model are of
    # similar size and a wrong weight or grouping changes the sum visibly. "X" normalises to "x": one answer given 4
    # times, scored under both spellings; credits are the official leave-one-out ones (4+: 1.0, 3: 0.9, 2: 0.6, 1: 0.3).
    answers = ["x", "X", "y", "x", "w", "z", "y", "w", "x", "w"]
    query = dict(items["val"][3], answers=answers)
    icds = items["train"][6:7]
    p = {a: reply_prob_by_hand(backend, query, icds, a) for a in ("x", "y", "z", "w", "X")}
    assert max(p.values()) < 3 * min(p.values())
    expected = p["x"] + p["X"] + 0.6 * p["y"] + 0.3 * p["z"] + 0.9 * p["w"]
    other = (items["val"][5], items["train"][:2])
    got = backend.gt_prob([other, (query, icds)])
    assert got[1].item() == pytest.approx(expected, rel=1e-4)
    assert got[0].item() == pytest.approx(backend.gt_prob([other]).item(), rel=1e-4)
    assert ((got >= 0) & (got <= 1)).all()


SPELLINGS = ["yes", "Yes", "YES.", "no", "No", "red", "a red", "2", "two", "the"]


@given(st.lists(st.sampled_from(SPELLINGS), min_size=10, max_size=10), st.randoms(use_true_random=False))
def test_credited_replies_are_what_the_metric_credits_in_any_annotator_order(answers, rnd):
    replies = credited_replies(answers)
    shuffled = rnd.sample(answers, len(answers))
    assert credited_replies(shuffled) == replies
    assert {r for r, _ in replies} >= set(answers)  # every raw spelling, plus each normalised form
    assert {normalize_answer(r) for r, _ in replies} == {normalize_answer(a) for a in answers}
    for reply, credit in replies:
        assert credit == vqa_score(reply, answers) and credit in (0.3, 0.6, 0.9, 1.0)
    assert len({r for r, _ in replies}) == len(replies)  # distinct replies: exclusive events


@pytest.fixture(scope="module")
def biased(assets, items) -> LVLMBackend:
    """The tiny Qwen made to answer (almost) the same distribution at every position, biased towards the tokens of
    "yes" and, 50x less, of "Yes": a huge value bias in the last attention layer adds one constant vector to every
    position's residual stream, so the final norm's output is the same everywhere, and the head's rows of the chosen
    tokens are set to give them fixed logits along it."""
    b = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)
    tok, model = b.tokenizer, b.model
    yes, cap = (tok(w, add_special_tokens=False)["input_ids"] for w in ("yes", "Yes"))
    seen = []
    with torch.no_grad():
        v = model.model.language_model.layers[-1].self_attn.v_proj
        v.bias.copy_(1e3 * torch.randn(v.bias.shape, generator=torch.Generator().manual_seed(0)))
        hook = model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
        b.gt_prob([(items["val"][0], items["train"][:2])])
        hook.remove()
        x = seen[0].reshape(-1, seen[0].shape[-1])  # (T, d) the head's input at every position
        assert F.cosine_similarity(x, x.mean(0, keepdim=True)).min() > 0.999
        u = x.mean(0)  # (d,)
        for ids, logit in ((set(yes) | {tok.convert_tokens_to_ids("<|im_end|>")}, 8.0), (set(cap) - set(yes), 4.0)):
            model.lm_head.weight[sorted(ids)] = logit * u / u.dot(u)
    return b


def test_gt_prob_credits_every_spelling_whatever_the_annotators_order(biased, items):
    icds = items["train"][3:5]
    lower_first, upper_first = (
        dict(items["val"][1], answers=a) for a in (["yes"] * 5 + ["Yes"] * 5, ["Yes"] * 5 + ["yes"] * 5)
    )
    p = {a: reply_prob_by_hand(biased, lower_first, icds, a) for a in ("yes", "Yes", "blue")}
    assert p["yes"] > 1e-3 and p["yes"] > 20 * p["Yes"] > 0  # the bias works: far from the random model's ~1e-9
    got = biased.gt_prob([(lower_first, icds), (upper_first, icds)])
    assert got.tolist() == pytest.approx([p["yes"] + p["Yes"]] * 2, rel=1e-4)
    # Two of 10 annotators (in two spellings) give 0.6 credit, 8 give 1.0: weights are the metric's, not count / 3.
    mixed = dict(items["val"][1], answers=["Yes", "blue", "blue", "yes", *["blue"] * 6])
    expected = 0.6 * (p["yes"] + p["Yes"]) + p["blue"]
    assert biased.gt_prob([(mixed, icds)]).item() == pytest.approx(expected, rel=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# score
# ---------------------------------------------------------------------------------------------------------------


def test_score_outputs_match_the_vqa_metrics(backend, items):
    for k in (0, 2):
        queries = torch.tensor([0, 3, 5])
        icds = torch.arange(3 * k).reshape(3, k)
        out = backend.score("val", queries, icds)
        assert set(out) == {"prediction", "acc", "correct", "gt_prob", "rel"}
        examples = [
            (items["val"][q], [items["train"][j] for j in row]) for q, row in zip(queries.tolist(), icds.tolist())
        ]
        assert out["prediction"] == [postprocess(t) for t in backend.generate(examples)]
        gts = [items["val"][q]["answers"] for q in queries.tolist()]
        assert out["acc"].tolist() == pytest.approx([vqa_score(p, a) for p, a in zip(out["prediction"], gts)])
        assert out["rel"].tolist() == pytest.approx([answer_rel(p, a) for p, a in zip(out["prediction"], gts)])
        assert torch.equal(out["correct"], out["acc"] > 0) and out["correct"].dtype == torch.bool
        assert torch.allclose(out["gt_prob"], backend.gt_prob(examples))
        assert all(v.shape == (3,) for key, v in out.items() if key != "prediction")


def test_each_prompt_runs_once_for_its_answer_and_all_its_replies(backend, items):
    examples = [(items["val"][q], items["train"][q : q + 2]) for q in range(5)]
    lengths = [int(backend.encode([ex])["attention_mask"].sum()) for ex in examples]
    replies = [len(credited_replies(query["answers"])) for query, _ in examples]
    assert sum(replies) >= 2 * len(examples)  # without sharing: 1 + R passes per prompt, here >= 3x the tokens
    before = backend.counts["prompt_tokens"]
    out = backend.score_examples(examples)
    assert backend.counts["prompt_tokens"] - before == sum(lengths)
    assert torch.allclose(out["gt_prob"], backend.gt_prob(examples), rtol=1e-5, atol=0)


def test_lvlm_bench_shares_prompts_at_least_3x_with_identical_results(assets):
    import bench

    args = bench.Args(only="lvlm", lvlm=str(assets["qwen"]), vqa_root=assets["okvqa"], device="cpu", queries=2)
    got = bench.bench_lvlm(replace(args, repeats=1))
    assert got["token_ratio"] >= 3 and got["same_answers"] and got["max_diff"] <= 1e-5
    assert "no-encoder-cache" in got["rates"]  # Qwen: with and without it
    # every phase of a scoring pass is timed, and the model's FLOPs are counted for the language model and the encoder
    assert set(got["phases"]) == {"preprocess", "copy", "vision", "prefill", "decode", "gt_prob", "other"}
    assert got["flops"]["lm"] > 0 and got["flops"]["vision"] > 0 and got["flops"]["matmul"] > 0


def test_lvlm_bench_recurring_pictures_are_encoded_once_per_pass(assets, items):
    """The recurring-pictures line: online steps whose pools draw from the same train questions, the caches kept from
    step to step within a pass, so each distinct picture is encoded once a pass: the encoder sees the patch rows of the
    distinct pictures (counted here with the stock image processor), however often they recur."""
    import bench

    args = bench.Args(only="lvlm", lvlm=str(assets["qwen"]), vqa_root=assets["okvqa"], device="cpu", repeats=1)
    args = replace(args, queries=2, group_size=4, shots=2, pool_size=6, lvlm_steps=3, lvlm_reference=False)
    got = bench.bench_lvlm(replace(args, lvlm_passes=["default"]))
    pictures = {it["image"] for step in bench.lvlm_steps(items, args) for q, icds in step for it in (*icds, q)}
    assert got["pictures"] == {"slots": 3 * 2 * 4 * 3, "distinct": len(pictures)} and len(pictures) < 3 * 2 * 4 * 3
    inner = LVLMBackend(str(assets["qwen"]), items).processor.image_processor.inner
    patches = 0
    for path in pictures:
        with Image.open(path) as img:
            patches += int(inner(images=[img.convert("RGB")], return_tensors="pt")["image_grid_thw"].prod())
    assert got["encoded_per_sequence"] * 3 * 2 * 4 == patches


@pytest.mark.slow
def test_the_gpu_report_runs_end_to_end_in_its_smoke_form(tmp_path):
    """gpu_report.py --smoke: every step of the GPU run (the bench lines, CLIP, each stage as its own
    command, the rates they record) with the tiny models on the CPU, and the pipeline's hours from those rates; the
    models and data it built are removed (a full-shape run builds gigabytes)."""
    import bench

    root, scratch = Path(__file__).resolve().parent.parent, tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TMPDIR": str(scratch)}
    argv = [sys.executable, "gpu_report.py", "--smoke", "--report-dir", str(tmp_path / "report")]
    subprocess.run(argv, check=True, cwd=root, env=env, capture_output=True)
    assert list(scratch.iterdir()) == []
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    steps = doc["steps"]
    assert [name for name, r in steps.items() if "error" in r] == []
    stages = ("gen_rl_data.py", "grpo.py --online", "evaluate.py selector", "evaluate.py zero-shot")
    assert set(steps) == {"build", "bench", "bench batch 16", "bench recurring", "bench levers", "clip", *stages}
    assert all(steps[name]["rate"] > 0 for name in stages)  # each stage's own record, read back
    assert set(steps["bench levers"]["rates"]) == {"default", "no-encoder-cache", "picture-processes", "inline"}  # CPU
    assert set(steps["bench recurring"]["rates"]) == {"default", "preprocess-held"}
    assert steps["bench batch 16"]["batch"]["prompts"] == 16
    clip, data = steps["clip"]["items_per_s"], steps["gen_rl_data.py"]["rate"]
    online = steps["grpo.py --online"]["rate"]
    selector, zero = steps["evaluate.py selector"]["rate"], steps["evaluate.py zero-shot"]["rate"]

    def start_up(name: str) -> float:  # a process's wall time less its scoring
        return steps[name]["process_seconds"] - steps[name]["sequences"] / steps[name]["rate"]

    median = sorted(start_up(n) for n in ("gen_rl_data.py", "evaluate.py selector", "evaluate.py zero-shot"))[1]
    rce = 11 * 200 * 4 + 2 * 200 * 5  # every epoch's validation, then the cross-fitting (rce.py --can-stop --val-lvlm)
    hours = (9_009 + 5_046) / clip + 800 * 17 / data + rce / selector + 35_000 / online + 3 * 3_200 / selector
    hours += 800 / zero + 6 * median
    assert doc["hours"]["total"] == pytest.approx(hours / 3600, rel=1e-9)
    again = rce / selector + 35_000 / online + 2 * 3_200 / selector + 3 * median
    assert doc["hours"]["replicate"]["total"] == pytest.approx(again / 3600, rel=1e-9)
    text = (tmp_path / "report" / "report.md").read_text()
    assert text.startswith("# Scoring throughput report (SMOKE RUN") and f"**{doc['hours']['total']:.2f}**" in text
    assert all(f"`{name}`" in text for name in stages) and bench.LVLM_PASSES["picture-processes"][0] in text


def test_score_postprocesses_generations(backend, items, monkeypatch):
    queries, icds = torch.tensor([0, 1, 2]), torch.tensor([[0], [1], [2]])
    truths = [majority(items["val"][q]) for q in queries.tolist()]
    raw = [f"{truths[0].upper()}.", "Short answer: zebra\nred", f'"{truths[2]}"\nmore text']
    real = backend.run  # the model's real reply probabilities, with the raw generations above as its answers
    monkeypatch.setattr(backend, "run", lambda ex, replies=None: (raw[: len(ex)], real(ex, replies, answer=False)[1]))
    out = backend.score("val", queries, icds)
    assert out["prediction"] == [truths[0].upper(), "zebra", truths[2]]
    assert out["correct"].tolist() == [True, False, True]
    assert out["acc"][0].item() == vqa_score(truths[0], items["val"][0]["answers"])


def test_score_rejects_bad_shapes(backend):
    with pytest.raises(ValueError, match=r"\bqueries\b.*\bicds\b.*\(2,\), \(1, 1\)$"):
        backend.score("val", torch.tensor([0, 1]), torch.tensor([[0]]))


# ---------------------------------------------------------------------------------------------------------------
# clip_embed
# ---------------------------------------------------------------------------------------------------------------


def test_clip_embed(assets, items):
    train = items["train"]
    emb = clip_embed(train, str(assets["clip"]), batch_size=5, device="cpu")
    for key in ("image", "text", "fused"):
        assert emb[key].shape == (len(train), 16) and emb[key].dtype == torch.float32
        assert torch.allclose(emb[key].norm(dim=-1), torch.ones(len(train)), atol=1e-5)
    assert torch.allclose(emb["fused"], F.normalize(emb["image"] + emb["text"], dim=-1), atol=1e-6)
    again = clip_embed(train, str(assets["clip"]), batch_size=64, device="cpu")
    assert all(torch.allclose(emb[k], again[k], atol=1e-6) for k in emb)
    # Rows follow the items: same image -> same image row, same question -> same text row, and otherwise different.
    for i in range(len(train)):
        for j in range(i):
            same_image = train[i]["image"] == train[j]["image"]
            assert torch.allclose(emb["image"][i], emb["image"][j], atol=1e-6) == same_image
            same_text = train[i]["question"] == train[j]["question"]
            assert torch.allclose(emb["text"][i], emb["text"][j], atol=1e-6) == same_text


def test_clip_embed_matches_the_model(assets, items):
    from transformers import AutoProcessor, CLIPModel

    item = items["train"][7]
    model, processor = CLIPModel.from_pretrained(assets["clip"]), AutoProcessor.from_pretrained(assets["clip"])
    with torch.no_grad():
        image = model.get_image_features(**processor(images=[load_image(item["image"])], return_tensors="pt"))
        text = model.get_text_features(**processor(text=[item["question"]], return_tensors="pt"))
    emb = clip_embed(items["train"], str(assets["clip"]), device="cpu")
    assert torch.allclose(emb["image"][7], F.normalize(image.pooler_output[0], dim=-1), atol=1e-5)
    assert torch.allclose(emb["text"][7], F.normalize(text.pooler_output[0], dim=-1), atol=1e-5)


def test_clip_embed_loads_the_encoder_once_and_takes_pil_images(assets, items, monkeypatch):
    clip.clip_encoder.cache_clear()
    loads, load = [], clip.AutoModel.from_pretrained
    monkeypatch.setattr(clip.AutoModel, "from_pretrained", lambda *a, **k: loads.append(a) or load(*a, **k))
    train = items["train"][:6]
    by_path = clip_embed(train, str(assets["clip"]), device="cpu")
    pictures = []  # PIL images: RGB, and every other one grey (mode "L")
    for it in train:
        with Image.open(it["image"]) as img:
            pictures.append(dict(it, image=img.convert("L" if len(pictures) % 2 else "RGB")))
    by_image = clip_embed(pictures, str(assets["clip"]), device="cpu")
    assert len(loads) == 1  # the second call reuses the loaded encoder
    for key in by_path:
        torch.testing.assert_close(by_image[key][::2], by_path[key][::2], atol=1e-6, rtol=0)
    grey = [dict(p, image=p["image"].convert("RGB")) for p in pictures[1::2]]  # what a grey picture is embedded as
    torch.testing.assert_close(
        by_image["image"][1::2], clip_embed(grey, str(assets["clip"]), device="cpu")["image"], atol=1e-6, rtol=0
    )
    assert len(loads) == 1


def test_a_demonstrations_answer_needs_no_transformers():
    """answer_counts lives with the VQA metric: the library's demonstrations show their answer without loading the
    LVLM backend (and transformers with it)."""
    code = (
        "import sys, types; from icl_select.library import Demo; "
        "got = Demo.answer.fget(types.SimpleNamespace(answers=['red', 'Blue', 'blue', 'blue', 'Red'], task='vqa')); "
        "assert got == 'blue', got; assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


# ---------------------------------------------------------------------------------------------------------------
# load_lvlm
# ---------------------------------------------------------------------------------------------------------------


def test_load_lvlm_unknown_model(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ValueError, match=re.escape(str(missing))) as e:
        load_lvlm(str(missing))
    assert "\n" not in str(e.value) and "hf download" not in str(e.value)  # a path: no download would help
    with pytest.raises(ValueError, match=r"'no-such-org/no-such-model'.*`hf download no-such-org/no-such-model`"):
        load_lvlm("no-such-org/no-such-model", cache_dir=tmp_path)


def saved_processor_folder(assets, tmp_path, processor_class: str | None) -> Path:
    """The tiny Qwen with its processor saved by transformers 5 (one nested processor_config.json, no video
    processor), naming `processor_class` (None: no processor_config.json and no preprocessor config at all)."""
    folder = tmp_path / f"qwen-{processor_class}"
    shutil.copytree(assets["qwen"], folder)
    processor = image_only(Qwen2_5_VLProcessor).from_pretrained(assets["qwen"])
    (folder / "preprocessor_config.json").unlink()
    if processor_class is not None:
        processor.save_pretrained(folder)
        config = json.loads((folder / "processor_config.json").read_text())
        assert "image_processor" in config and not (folder / "video_preprocessor_config.json").exists()
        (folder / "processor_config.json").write_text(json.dumps(config | {"processor_class": processor_class}))
    return folder


def test_processor_folders_saved_by_transformers_5_load_and_encode_alike(assets, items, tmp_path):
    folder = saved_processor_folder(assets, tmp_path, "Qwen2_5_VLProcessor")
    stock = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)
    saved = LVLMBackend(str(folder), items, batch_size=4, max_new_tokens=4)
    examples = [(items["val"][0], items["train"][1:3]), (items["val"][1], [])]
    a, b = stock.encode(examples), saved.encode(examples)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_processor_folder_that_nothing_loads_is_one_line(assets, tmp_path):
    folder = saved_processor_folder(assets, tmp_path, None)
    loaders = r"\bAutoProcessor\b.*\bImageOnlyQwen2_5_VLProcessor\b.*$"  # each loader's reason, on the one line
    with pytest.raises(ValueError, match=rf"^{re.escape(str(folder))}\b.*" + loaders):
        load_lvlm(str(folder), device="cpu")


def test_load_lvlm_rejects_other_models(assets):
    with pytest.raises(ValueError, match=r"\bQwen2ForCausalLM\b.*\bAutoModelForImageTextToText\b"):
        load_lvlm(str(assets["text_lm"]))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(assets['okvqa']))}: .*\bconfig\b"):
        load_lvlm(str(assets["okvqa"]))


def test_load_lvlm_from_hub_cache_records_revision(assets, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny-org--tiny-qwen"
    shutil.copytree(assets["qwen"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model, processor, info = load_lvlm("tiny-org/tiny-qwen", device="cpu", cache_dir=tmp_path)
    assert info["revision"] == commit and info["lvlm"] == "tiny-org/tiny-qwen"
    assert info["model_class"] == "Qwen2_5_VLForConditionalGeneration" and not model.training
    assert processor.tokenizer.padding_side == "left"
    if importlib.util.find_spec("torchvision") is None:
        assert type(processor).__name__ == "ImageOnlyQwen2_5_VLProcessor"


# ---------------------------------------------------------------------------------------------------------------
# self-check
# ---------------------------------------------------------------------------------------------------------------


def test_self_check_passes_on_a_family_the_kit_scores_exactly(backend):
    report = backend.self_check()
    assert report["prompts"] == 8 and report["answers_differ"] == 0
    assert report["max_abs_logp_diff"] < report["tolerance"] == 1e-3


def test_self_check_stops_a_fast_path_that_disagrees(assets, items, monkeypatch):
    """A fast path numbering left-padded rows from their pad slots (what a forward without position ids does) is
    caught before any long run, in one line."""
    b = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4, device="cpu")
    naive = lambda ids, kwargs: torch.arange(ids.shape[1]).expand(3, *ids.shape)  # noqa: E731
    monkeypatch.setattr(b.model, "_prepare_position_ids_for_generation", naive)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(assets['qwen']))}: .*\b8\b.*--skip-self-check\b"):
        b.self_check()


def test_model_without_chat_template_is_one_line(assets, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(assets["qwen"], folder)
    (folder / "chat_template.json").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    for extra in folder.glob("chat_template.jinja"):
        extra.unlink()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(folder))} .*\bchat_template\.jinja\b"):
        load_lvlm(str(folder), device="cpu")


@pytest.mark.parametrize("name", hf.VARLEN_ENCODERS)
def test_varlen_vision_attention_gives_the_per_window_features(name, family_models, mixed_items, monkeypatch):
    """The Qwen encoders' varlen attention (its kernel runs on CUDA only; here attention computed window by window in
    its place) gives the picture features of transformers' sdpa path: the windows' bounds reach it, in its layout."""
    from torch.nn.attention import varlen

    def per_window(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):  # (T, H, D) each
        calls.append(len(cu_q) - 1)
        bounds = cu_q.tolist()
        parts = [[x[i:j].transpose(0, 1) for x in (q, k, v)] for i, j in zip(bounds, bounds[1:])]
        return torch.cat([F.scaled_dot_product_attention(*p, scale=scale).transpose(0, 1) for p in parts])

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", per_window)
    model, processor, _ = hf.load_lvlm(str(family_models[name]), device="cpu")
    assert not hf.varlen_runs(model)  # on the CPU the kit keeps transformers' path
    pictures = [Image.open(it["image"]).convert("RGB") for it in mixed_items["train"][:3]]
    inputs = processor.image_processor(pictures, return_tensors="pt")

    def features() -> Tensor:
        out = model.get_image_features(**inputs).pooler_output
        return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out

    with torch.no_grad():
        reference = features()
        hf.vision_attention(model, varlen=True)
        fast = features()
        hf.vision_attention(model, varlen=False)
        back = features()
    assert calls and max(calls) > 1  # one call a layer, over several pictures or windows at once
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(back, reference) and model.config.text_config._attn_implementation == "sdpa"


def test_self_check_compares_with_transformers_own_vision_attention(backend, monkeypatch):
    """Where the kit runs the Qwen encoder's varlen attention (CUDA), the self-check's reference runs transformers'
    attention instead, and the batched path gets the varlen attention back."""
    events = []
    monkeypatch.setattr(lvlm, "varlen_runs", lambda model: True)
    monkeypatch.setattr(lvlm, "vision_attention", lambda model, varlen: events.append(varlen))
    plain, run = backend.plain, backend.run
    monkeypatch.setattr(backend, "plain", lambda *a: events.append("plain") or plain(*a))
    monkeypatch.setattr(backend, "run", lambda *a: events.append("run") or run(*a))
    backend.self_check()
    assert events[0] == "run" and events[1] is False and events[-1] is True
    assert set(events[2:-1]) == {"plain"}


def test_compiled_regions_are_the_outermost_norms_mlps_and_vision_blocks(assets, items):
    """Regional compilation takes each vision block whole and, elsewhere, every RMSNorm and MLP, never a module inside
    one already compiled; on the CPU (float32) the backend compiles nothing."""
    backend = LVLMBackend(str(assets["qwen"]), items, batch_size=4)
    assert backend.compiled == []
    model = backend.model
    names = hf.compile_regions(model)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    blocks = [n for n, k in kinds.items() if k.endswith("VisionBlock")]
    assert blocks and set(blocks) <= set(names)
    assert not any(a != b and a.startswith(b + ".") for a in names for b in names)
    outside = [n for n, k in kinds.items() if k.endswith(("RMSNorm", "MLP")) and not n.startswith(tuple(blocks))]
    assert outside and set(names) == set(blocks) | set(outside)


def test_norms_inside_attention_stay_eager(family_models):
    """Gemma3's per-head q_norm and k_norm would push the one RMSNorm forward past dynamo's specialisation limit."""
    model, _, _ = hf.load_lvlm(str(family_models["gemma3"]), device="cpu")
    names = hf.compile_regions(model)
    heads = [n for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))]
    assert heads and not set(heads) & set(names)
    assert any(n.endswith("input_layernorm") for n in names)


def test_self_check_reference_runs_eager(backend, monkeypatch):
    """The self-check's plain-transformers reference runs with torch.compile's regions off (what a user's own
    transformers code would run), so it checks the compiled path too."""
    events, set_stance = [], torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda stance: events.append(stance) or set_stance(stance))
    plain = backend.plain
    monkeypatch.setattr(backend, "plain", lambda *a: events.append("plain") or plain(*a))
    backend.self_check()
    assert events[0] == "force_eager" and set(events[1:]) == {"plain"}


@pytest.mark.slow
def test_compiled_regions_score_as_eager(assets, items):
    """torch.compile's regions (on the CPU here, float32) give eager's answers and P(reply) to rounding."""
    backend = LVLMBackend(str(assets["qwen"]), items, batch_size=4, max_new_tokens=4)
    rng = random.Random(0)
    examples = [(items["val"][i % len(items["val"])], rng.sample(items["train"], i % 5)) for i in range(9)]
    replies = [[q["answers"][0], "yes"] for q, _ in examples]
    eager = backend.run(examples, replies)
    assert hf.compile_regions(backend.model)
    compiled = backend.run(examples, replies)
    assert compiled[0] == eager[0]
    for got, want in zip(compiled[1], eager[1]):
        torch.testing.assert_close(got.log(), want.log(), atol=1e-4, rtol=0)
    with torch.compiler.set_stance("force_eager"):
        again = backend.run(examples, replies)
    assert again[0] == eager[0] and all(torch.equal(a, b) for a, b in zip(again[1], eager[1]))


def test_prompts_of_several_lengths_in_one_batch_score_as_each_alone(backend, items):
    """Rows with -1 after their last demonstration (none at all included) go through the model in one left-padded
    batch and score as each prompt alone: the same answers, gt_prob within float32 rounding."""
    queries, icds = torch.tensor([0, 1, 2, 3]), torch.tensor([[-1, -1, -1], [4, -1, -1], [5, 6, 7], [8, 9, -1]])
    together = backend.score("val", queries, icds)
    for i in range(4):
        row = icds[i][icds[i] >= 0][None]  # (1, n)
        alone = backend.score("val", queries[i : i + 1], row)
        assert together["prediction"][i] == alone["prediction"][0]
        assert together["gt_prob"][i].item() == pytest.approx(alone["gt_prob"][0].item(), rel=1e-4)
