"""Offline stand-ins for the real backend's inputs: tiny random-weight models and a tiny OKVQA-format dataset.

Every builder writes into a folder it is given and returns the path to pass on, so tests (or any other script) can
build them once per session. Nothing is downloaded: the models are built from configs with random weights, and the
tokenizers are trained in-process with the `tokenizers` library on a small corpus. The model folders are written in
the layout of the real checkpoints on the Hugging Face hub (config.json, generation_config.json, model.safetensors,
preprocessor_config.json, tokenizer files, chat_template.json) and are reloaded through the same `from_pretrained`
calls, so they exercise the loading path of a real checkpoint, including Qwen2.5-VL's processor failing to build
without torchvision.

    build_tiny_qwen(folder)      random Qwen2.5-VL (hidden 64, 2 layers, 7-pixel patches) + Qwen chat template
    build_tiny_clip(folder)      random CLIPModel + CLIP processor
    build_tiny_text_lm(folder)   random text-only Qwen2ForCausalLM (not an image-text-to-text model)
    build_okvqa_fixture(root)    pillow-drawn COCO-named images + OKVQA questions/annotations in the official layout
"""

from __future__ import annotations

import json
import random
from itertools import product
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

# The special tokens of Qwen2.5-VL's chat template, in the order they get ids 0..6 in the tiny vocabulary.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2.5-VL-Instruct's chat template (as published with the checkpoint): a default system turn when none is given,
# one <|vision_start|><|image_pad|><|vision_end|> block per image, and "<|im_start|>assistant\n" as generation prompt.
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 30),
    "purple": (140, 40, 170),
    "orange": (240, 140, 20),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "gray": (128, 128, 128),
}

# The tokenizers' training text: the chat-template scaffolding, the prompt wording and the fixture's vocabulary, so
# the learned merges cover what the tests actually tokenize (anything else still encodes, byte by byte).
CORPUS: tuple[str, ...] = (
    "system user assistant You are a helpful assistant.",
    "Question: What color is the shape? Short answer: red",
    "Question: What shape is in the picture? Short answer: circle",
    "Question: What color is the background? Short answer: white",
    "Question: How many shapes are there? Short answer: one",
    "a photo of a dark red square on a light gray background, maybe crimson or maroon",
    " ".join(COLORS) + " " + " ".join(SHAPES) + " " + " ".join(BACKGROUNDS),
)

IMAGE_SIZES = ((56, 56), (70, 56), (56, 42))
TRAIN_IMAGES, VAL_IMAGES = 16, 8


def _train_bpe(base: Tokenizer, special_tokens: list[str], vocab_size: int) -> dict:
    """Train a BPE model with `base`'s normalizer and pre-tokenizer on CORPUS; returns {"vocab", "merges"}.

    Deterministic: the byte alphabet (and, with an end-of-word suffix, every byte + suffix) gets fixed ids up front.
    Otherwise the trainer numbers suffixed bytes in hash-map order, and since it breaks ties between equally frequent
    pairs by id, the merges would differ from run to run.
    """
    suffix = base.model.end_of_word_suffix or ""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # every byte encodes, so no unknown tokens
    fixed = [c + suffix for c in alphabet] if suffix else []
    tok = Tokenizer(models.BPE(end_of_word_suffix=suffix))
    tok.normalizer = base.normalizer
    tok.pre_tokenizer = base.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + len(fixed),
        special_tokens=special_tokens + fixed,
        initial_alphabet=alphabet,
        end_of_word_suffix=suffix,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    return {"vocab": model["vocab"], "merges": [tuple(m) for m in model["merges"]]}


def build_tiny_qwen(folder: Path, seed: int = 0) -> Path:
    """A random-weight Qwen2.5-VL checkpoint in `folder` (about 0.2M parameters), loadable like a real one."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Train with the real Qwen2 tokenizer's normalizer and pre-tokenizer (taken from an empty instance) so the merges
    # match how the saved tokenizer splits text.
    bpe = _train_bpe(Qwen2Tokenizer().backend_tokenizer, list(QWEN_SPECIAL_TOKENS), vocab_size=400)
    tokenizer = Qwen2Tokenizer(**bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIAL_TOKENS])
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    ids = dict(zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS))))

    # 7-pixel patches merged 2x2: one LLM token per 14x14 pixels; the pixel bounds keep every image at 4..16 tokens.
    patch, merge = 7, 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=merge, temporal_patch_size=2, min_pixels=28 * 28, max_pixels=56 * 56
    )
    head_dim = 16
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 4 * head_dim,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            # The multimodal rotary split (temporal, height, width) must sum to head_dim / 2.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": patch,
            "spatial_merge_size": merge,
            "temporal_patch_size": 2,
            "window_size": 2 * patch * merge,  # windows of 2x2 merged tokens
            "fullatt_block_indexes": [1],
            "out_hidden_size": 4 * head_dim,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    # The published generation config samples (with a near-greedy top_k=1 and a repetition penalty); mirrored here
    # so that the backend's explicit plain greedy decoding is what gets tested.
    gen = model.generation_config
    gen.do_sample, gen.top_k, gen.top_p, gen.temperature, gen.repetition_penalty = True, 1, 0.001, 0.1, 1.05
    gen.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    gen.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE}, indent=2))
    return folder


def build_tiny_clip(folder: Path, seed: int = 0) -> Path:
    """A random-weight CLIPModel (32-pixel images, 16-d embeddings) with its processor, loadable like a real one."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = ["<|startoftext|>", "<|endoftext|>"]
    bpe = _train_bpe(CLIPTokenizer().backend_tokenizer, special, vocab_size=400)
    tokenizer = CLIPTokenizer(**bpe)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "image_size": 32,
            "patch_size": 8,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
        },
        projection_dim=16,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(folder)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def build_tiny_text_lm(folder: Path, seed: int = 0) -> Path:
    """A random-weight text-only Qwen2ForCausalLM: a valid checkpoint that is not an image-text-to-text model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return Path(folder)


def _draw(shape: str, color: str, background: str, size: tuple[int, int]) -> Image.Image:
    """One small picture: a colored shape on a plain background."""
    w, h = size
    img = Image.new("RGB", (w, h), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:
        draw.polygon([(w // 2, h // 4), (3 * w // 4, 3 * h // 4), (w // 4, 3 * h // 4)], fill=COLORS[color])
    return img


def _annotators(rng: random.Random, truth: str, distractors: list[str]) -> list[str]:
    """Ten annotator answers: mostly the truth, a few distractors, so answer counts (and VQA weights) vary."""
    n_truth = rng.randint(4, 10)
    answers = [truth] * n_truth + [rng.choice(distractors) for _ in range(10 - n_truth)]
    rng.shuffle(answers)
    return answers


def build_okvqa_fixture(root: Path, seed: int = 0) -> Path:
    """An OK-VQA-format dataset under `root` with the official file names and JSON layout; returns `root`.

    train: TRAIN_IMAGES images with two questions each (several questions share an image); val: VAL_IMAGES images
    with one question each. Question ids follow OK-VQA's image_id * 10 + index convention.
    """
    root = Path(root)
    rng = random.Random(seed)
    questions = [
        ("What color is the shape?", lambda s, c, b: c, list(COLORS)),
        ("What shape is in the picture?", lambda s, c, b: s, list(SHAPES)),
        ("What color is the background?", lambda s, c, b: b, list(BACKGROUNDS)),
    ]
    # Every image is a distinct (shape, color, background, size); the sizes differ so image token counts do too.
    scenes = rng.sample(list(product(SHAPES, COLORS, BACKGROUNDS, IMAGE_SIZES)), TRAIN_IMAGES + VAL_IMAGES)
    for split, n_images, per_image, first_id in (("train", TRAIN_IMAGES, 2, 9000), ("val", VAL_IMAGES, 1, 500)):
        (root / f"{split}2014").mkdir(parents=True, exist_ok=True)
        qs, anns = [], []
        for i in range(n_images):
            image_id = first_id + 7 * i
            shape, color, background, size = scenes.pop()
            path = root / f"{split}2014" / f"COCO_{split}2014_{image_id:012d}.jpg"
            _draw(shape, color, background, size).save(path, quality=95)
            for j, (text, truth_of, choices) in enumerate(rng.sample(questions, per_image)):
                truth = truth_of(shape, color, background)
                answers = _annotators(rng, truth, [c for c in choices if c != truth])
                qid = image_id * 10 + j
                qs.append({"image_id": image_id, "question": text, "question_id": qid})
                anns.append(
                    {
                        "image_id": image_id,
                        "question_id": qid,
                        "question_type": "other",
                        "answer_type": "other",
                        "confidence": 3,
                        "answers": [
                            {"answer_id": k + 1, "raw_answer": a, "answer_confidence": "yes", "answer": a}
                            for k, a in enumerate(answers)
                        ],
                    }
                )
        (root / f"OpenEnded_mscoco_{split}2014_questions.json").write_text(json.dumps({"questions": qs}))
        (root / f"mscoco_{split}2014_annotations.json").write_text(json.dumps({"annotations": anns}))
    return root
