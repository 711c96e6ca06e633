"""Offline stand-ins for the real backend's inputs: tiny random-weight models and a tiny OKVQA-format dataset, which the
tests and bench.py build (and random weights in real checkpoints' shapes, for timing a GPU without downloading them).

Every builder writes into a folder it is given and returns the path to pass on, so tests (or any other script) can
build them once per session. Nothing is downloaded: the models are built from configs with random weights, and the
tokenizers are trained in-process with the `tokenizers` library on a small corpus. The model folders are written in
the layout of the real checkpoints on the Hugging Face hub (config.json, generation_config.json, model.safetensors,
preprocessor_config.json, tokenizer files, chat_template.json) and are reloaded through the same `from_pretrained`
calls, so they exercise the loading path of a real checkpoint, including Qwen2.5-VL's processor failing to build
without torchvision.

    build_tiny_qwen(folder)      random Qwen2.5-VL (hidden 64, 2 layers, 7-pixel patches) + Qwen chat template
    build_tiny_qwen_3b_pixels(folder)  the same tiny model with Qwen2.5-VL-3B's image processing (COCO-sized cost)
    build_tiny_qwen2_vl(folder)  random Qwen2-VL (Qwen2-VL-2B-Instruct's files; AutoProcessor needs torchvision)
    build_tiny_qwen3_vl(folder)  random Qwen3-VL (Qwen3-VL-2B-Instruct's files and template, video preprocessor config)
    build_tiny_idefics3(folder)  random Idefics3 as SmolVLM-256M-Instruct (2x2 tiles + global view, byte-level BPE)
    build_tiny_llava(folder)     random LLaVA-1.5 as llava-1.5-7b-hf (CLIP crop, Llama tokenizer, USER/ASSISTANT)
    build_tiny_llava_next(folder)  random LLaVA-NeXT as llava-v1.6-mistral-7b-hf (anyres tiles, [INST] template)
    build_tiny_llava_onevision(folder)  random LLaVA-OneVision as llava-onevision-qwen2-0.5b-ov-hf (anyres_max_9)
    build_tiny_gemma3(folder)    random Gemma3 as gemma-3-4b-it (one sliding-window layer shorter than a prompt)
    build_tiny_clip(folder)      random CLIPModel + CLIP processor
    build_clip_b32_shape(folder)  random CLIP in clip-vit-base-patch32's shape (what embedding a dataset costs)
    build_tiny_text_lm(folder)   random text-only Qwen2ForCausalLM (not an image-text-to-text model)
    build_okvqa_fixture(root)    pillow-drawn COCO-named images + OKVQA questions/annotations in the official layout
    build_okvqa_fixture(root, mixed=True)  the same with wide, tall, tiny, grayscale, palette and CMYK image files
"""

from __future__ import annotations

import json
import random
from itertools import product
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

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
# build_okvqa_fixture(mixed=True): images as a COCO download has them, cycled: (width, height), PIL mode, file format.
MIXED_IMAGES = (
    ((96, 32), "RGB", "JPEG"),  # wide, 3:1
    ((30, 84), "RGB", "JPEG"),  # tall
    ((9, 13), "RGB", "JPEG"),  # tiny
    ((64, 48), "L", "JPEG"),  # grayscale
    ((50, 40), "P", "PNG"),  # palette (PNG bytes under COCO's .jpg name)
    ((40, 56), "CMYK", "JPEG"),
    ((56, 42), "RGB", "JPEG"),
)
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


def _qwen_tokenizer(special_tokens: tuple[str, ...], chat_template: str):
    """A Qwen2 byte-level BPE tokenizer trained on CORPUS, with `special_tokens` as added special tokens."""
    from transformers import Qwen2Tokenizer

    # Train with the real Qwen2 tokenizer's normalizer and pre-tokenizer (taken from an empty instance) so the merges
    # match how the saved tokenizer splits text.
    bpe = _train_bpe(Qwen2Tokenizer().backend_tokenizer, list(special_tokens), vocab_size=400)
    tokenizer = Qwen2Tokenizer(**bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_tokens([AddedToken(t, special=True) for t in special_tokens])
    tokenizer.chat_template = chat_template
    return tokenizer


def _build_qwen2_5_vl(folder: Path, seed: int, text: dict, vision: dict, pixels: dict, dtype: torch.dtype) -> Path:
    """A random-weight Qwen2.5-VL checkpoint in `folder`, loadable like a real one: this file's tokenizer and the
    published chat template, the text and vision sizes given (config entries), an image processor with 2x2 merged
    patches and `pixels` (patch_size, min_pixels, max_pixels)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _qwen_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_CHAT_TEMPLATE)
    ids = dict(zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS))))
    image_processor = Qwen2VLImageProcessorPil(merge_size=2, temporal_patch_size=2, **pixels)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            **text,
        },
        vision_config={
            "patch_size": pixels["patch_size"],
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": text["hidden_size"],
            **vision,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    with torch.device("cuda" if dtype != torch.float32 and torch.cuda.is_available() else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
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


def build_tiny_qwen(folder: Path, seed: int = 0) -> Path:
    """A random-weight Qwen2.5-VL checkpoint in `folder` (about 0.2M parameters), loadable like a real one."""
    head_dim, patch = 16, 7
    text = {
        "hidden_size": 4 * head_dim,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        # The multimodal rotary split (temporal, height, width) must sum to head_dim / 2.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "window_size": 2 * patch * 2,  # windows of 2x2 merged tokens
        "fullatt_block_indexes": [1],
    }
    # 7-pixel patches merged 2x2: one LLM token per 14x14 pixels; the pixel bounds keep every image at 4..16 tokens.
    pixels = {"patch_size": patch, "min_pixels": 28 * 28, "max_pixels": 56 * 56}
    return _build_qwen2_5_vl(folder, seed, text, vision, pixels, torch.float32)


def build_tiny_qwen_3b_pixels(folder: Path, seed: int = 0) -> Path:
    """build_tiny_qwen's tiny model with Qwen2.5-VL-3B-Instruct's image processing (14-pixel patches merged 2x2, the
    default pixel bounds): a 640 x 480 picture becomes 391 prompt tokens and its preprocessing costs what the real
    checkpoint's does, while the model stays small enough for the CPU (the CPU side of scoring, measured there)."""
    head_dim, patch = 16, 14
    text = {
        "hidden_size": 4 * head_dim,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    }
    pixels = {"patch_size": patch, "min_pixels": 3136, "max_pixels": 12845056}
    return _build_qwen2_5_vl(folder, seed, text, vision, pixels, torch.float32)


def build_qwen2_5_vl_3b_shape(folder: Path, seed: int = 0) -> Path:
    """Random weights in Qwen2.5-VL-3B-Instruct's published shape (text: 36 layers of width 2048, 16 query and 2
    key/value heads; vision: 32 blocks of width 1280, 14-pixel patches merged 2x2) with its image processor's defaults,
    in bfloat16 (built on the GPU where there is one): what scoring costs on a GPU, without the checkpoint. Only the
    vocabulary is this file's tiny one (the real head's 151,936 rows are 311M of the model's 3.75B parameters, and a
    prompt pass computes them for its last position only), and the answers are noise: a random model rarely stops
    before max_new_tokens, where real short answers do."""
    text = {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    }
    vision = {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    }
    pixels = {"patch_size": 14, "min_pixels": 3136, "max_pixels": 12845056}
    return _build_qwen2_5_vl(folder, seed, text, vision, pixels, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# One tiny checkpoint per model family: each with its family's processor files and the chat template published with
# its instruct checkpoint (named per builder), so that what the kit does with a family's template, special tokens,
# image token expansion and stop tokens is what it would do with the real one.
# ---------------------------------------------------------------------------------------------------------------

# Qwen3-VL-2B-Instruct's chat template: no default system turn, vision blocks inline, the assistant turn rendered as
# "<|im_start|>assistant\n" + reply + "<|im_end|>\n" (tool calls left out: the kit never sends tools).
QWEN3_VL_CHAT_TEMPLATE = """{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                <|vision_start|><|image_pad|><|vision_end|>
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                <|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content, false) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, True) %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# HuggingFaceTB/SmolVLM-256M-Instruct (Idefics3): "User:" directly followed by the first image, ": " before text, a
# reply rendered after "Assistant:" as " " + reply + "<end_of_utterance>".
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# llava-hf/llava-1.5-7b-hf: every image of a turn first, then every text + " "; "ASSISTANT:" as generation prompt and
# the reply rendered as "ASSISTANT: " + reply + " " (no stop token in the template).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# llava-hf/llava-v1.6-mistral-7b-hf: "[INST] " + images + texts + " [/INST]", no generation prompt, the reply rendered
# as " " + reply + "<\\s> " (a literal backslash: the published template never emits the real "</s>").
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\n' + message['content'][0]['text'] + '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' }}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'][0]['text'] + '<\\s> '}}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# llava-hf/llava-onevision-qwen2-0.5b-ov-hf: "<|im_start|>" + role + " ", the turn's images, then "\n" + each text,
# "<|im_end|>" without a newline; the generation prompt "<|im_start|>assistant\n" is NOT how the template renders an
# assistant turn ("<|im_start|>assistant \n" + reply + "<|im_end|>").
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}{{'<|im_end|>'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# google/gemma-3-4b-it: "<bos>" in the template, a system turn folded into the first user turn, every text trimmed,
# the assistant role named "model", turns closed by "<end_of_turn>\n".
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

HEAD_STD = 0.3  # output-head weights: logits of std ~2.4 at hidden 64, so greedy answers vary and rarely tie


def _train_sentencepiece_bpe(special_tokens: list[str], vocab_size: int, prepend: bool) -> dict:
    """A SentencePiece-style BPE (words start with "▁", unknown characters fall back to <0xNN> byte tokens), as
    Llama, Mistral and Gemma tokenizers are, trained on CORPUS; returns {"vocab", "merges"} for their transformers 5
    classes. `prepend`: a "▁" is put before the text (Llama / Mistral), not for Gemma. Merges stay within words."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prepend else "never")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + len(byte_tokens),
        special_tokens=special_tokens + byte_tokens,
        initial_alphabet=sorted(set("".join(CORPUS).replace(" ", "▁")) | {"▁"}),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    return {"vocab": model["vocab"], "merges": [tuple(m) for m in model["merges"]]}


def _sharpen_head(model) -> None:
    """Scale the output head (shared with the input embeddings where tied) so the random model's logits are far from
    flat: greedy answers then differ between prompts, and a wrong input changes them."""
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(HEAD_STD / head.std())


def _write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _save_checkpoint(folder: Path, model, tokenizer, generation: dict, files: dict[str, dict]) -> Path:
    """Weights, the generation config (`generation` replaces the model's defaults), the tokenizer and the processor
    files (name -> JSON), in the layout of a hub checkpoint; the chat template goes to chat_template.json."""
    gen = model.generation_config
    for key, value in generation.items():
        setattr(gen, key, value)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name, doc in files.items():
        _write_json(folder / name, doc)
    _write_json(folder / "chat_template.json", {"chat_template": tokenizer.chat_template})
    return folder


def _image_processor_json(image_processor, processor_class: str, type_name: str) -> dict:
    """preprocessor_config.json as hub checkpoints have it: the image processor type and processor class named."""
    doc = image_processor.to_dict()
    doc.pop("_processor_class", None)
    return doc | {"image_processor_type": type_name, "processor_class": processor_class}


def _text_config(tokenizer, ids: dict, **extra) -> dict:
    """A 2-layer, 64-wide decoder (4 heads of 16, 2 key-value heads) for the tokenizer's vocabulary."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        **ids,
        **extra,
    }


def build_tiny_qwen2_vl(folder: Path, seed: int = 0) -> Path:
    """A random-weight Qwen2-VL (Qwen2-VL-2B-Instruct's files and chat template: that of Qwen2.5-VL)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _qwen_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_CHAT_TEMPLATE)
    ids = dict(zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS))))
    # 7-pixel patches merged 2x2: one LLM token per 14x14 pixels, 4..16 tokens per image.
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=7, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28, max_pixels=56 * 56
    )
    text = _text_config(
        tokenizer,
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": None},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2, "patch_size": 7}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    _sharpen_head(model)
    generation = {
        "do_sample": True,
        "top_k": 1,
        "top_p": 0.001,
        "temperature": 0.01,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    preprocessor = _image_processor_json(image_processor, "Qwen2VLProcessor", "Qwen2VLImageProcessor")
    return _save_checkpoint(folder, model, tokenizer, generation, {"preprocessor_config.json": preprocessor})


def build_tiny_qwen3_vl(folder: Path, seed: int = 0) -> Path:
    """A random-weight Qwen3-VL (Qwen3-VL-2B-Instruct's files: 16-pixel patches, a video preprocessor config)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _qwen_tokenizer(QWEN_SPECIAL_TOKENS, QWEN3_VL_CHAT_TEMPLATE)
    ids = dict(zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS))))
    # 8-pixel patches merged 2x2 (the real ones: 16 pixels), 4..16 tokens per image; mean and std 0.5 as published.
    bounds = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, size=bounds, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    text = _text_config(
        tokenizer,
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": None},
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    _sharpen_head(model)
    generation = {
        "do_sample": True,
        "top_k": 20,
        "top_p": 0.8,
        "temperature": 0.7,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    preprocessor = _image_processor_json(image_processor, "Qwen3VLProcessor", "Qwen2VLImageProcessorFast")
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "patch_size": 8,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    }
    files = {"preprocessor_config.json": preprocessor, "video_preprocessor_config.json": video}
    return _save_checkpoint(folder, model, tokenizer, generation, files)


def build_tiny_idefics3(folder: Path, seed: int = 0) -> Path:
    """A random-weight Idefics3 in SmolVLM-256M-Instruct's layout: images split into up to 2x2 tiles of 32 pixels
    plus a global view, 4 tokens per tile, a byte-level BPE tokenizer, <end_of_utterance> as the stop token."""
    from transformers import GPT2Tokenizer, Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    image_tokens = ["<global-img>", *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
    image_tokens += ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
    bpe = _train_bpe(GPT2Tokenizer().backend_tokenizer, special, vocab_size=400)
    tokenizer = GPT2Tokenizer(
        **bpe,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        add_prefix_space=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in image_tokens])
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    eou, start = tokenizer.convert_tokens_to_ids(["<end_of_utterance>", "<|im_start|>"])
    text = _text_config(tokenizer, {"bos_token_id": start, "eos_token_id": eou, "pad_token_id": tokenizer.pad_token_id})
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    config = Idefics3Config(
        text_config={"model_type": "llama", **text},
        vision_config=vision,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    _sharpen_head(model)
    generation = {"eos_token_id": eou, "bos_token_id": start, "pad_token_id": tokenizer.pad_token_id}
    files = {
        "preprocessor_config.json": _image_processor_json(
            image_processor, "Idefics3Processor", "Idefics3ImageProcessor"
        ),
        # (32 / 8)^2 patches, pixel-shuffled by scale_factor 2: 4 image tokens per tile.
        "processor_config.json": {"image_seq_len": 4, "processor_class": "Idefics3Processor"},
    }
    return _save_checkpoint(folder, model, tokenizer, generation, files)


def _llama_tokenizer(chat_template: str):
    """A Llama / Mistral SentencePiece-style tokenizer with <image> and <pad> added after the vocabulary, as the
    llava-hf checkpoints have them (ids 32000 and 32001 there)."""
    from transformers import LlamaTokenizer

    bpe = _train_sentencepiece_bpe(["<unk>", "<s>", "</s>"], vocab_size=400, prepend=True)
    tokenizer = LlamaTokenizer(**bpe, legacy=False, add_bos_token=True)  # prompts start with <s>
    tokenizer.add_tokens([AddedToken("<image>", special=True, normalized=False)])
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    tokenizer.chat_template = chat_template
    return tokenizer


def _clip_vision() -> dict:
    """A 2-layer CLIP vision tower on 28-pixel images of 7-pixel patches: 16 patch tokens plus CLS."""
    return {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "projection_dim": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 7,
    }


def _llama_ids(tokenizer) -> dict:
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": tokenizer.pad_token_id}


def build_tiny_llava(folder: Path, seed: int = 0) -> Path:
    """A random-weight LLaVA-1.5 (llava-1.5-7b-hf's layout): CLIP image processor (shortest edge resized, center
    crop), 16 image tokens per image, a Llama tokenizer, "USER: ... ASSISTANT:" template."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _llama_tokenizer(LLAVA_CHAT_TEMPLATE)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    config = LlavaConfig(
        vision_config=_clip_vision(),
        text_config={"model_type": "llama", **_text_config(tokenizer, _llama_ids(tokenizer))},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _sharpen_head(model)
    files = {
        "preprocessor_config.json": _image_processor_json(image_processor, "LlavaProcessor", "CLIPImageProcessor"),
        "processor_config.json": {
            "num_additional_image_tokens": 1,
            "patch_size": 7,
            "processor_class": "LlavaProcessor",
            "vision_feature_select_strategy": "default",
        },
    }
    return _save_checkpoint(folder, model, tokenizer, _llama_ids(tokenizer), files)


# llava-v1.6's five anyres grids (2x1, 1x2, 2x2, 3x1, 1x3 tiles), at the tiny 28-pixel tile.
LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]


def build_tiny_llava_next(folder: Path, seed: int = 0) -> Path:
    """A random-weight LLaVA-NeXT (llava-v1.6-mistral-7b-hf's layout): anyres tiling on 28-pixel tiles, a Mistral
    decoder and tokenizer, "[INST] ... [/INST]" template."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _llama_tokenizer(LLAVA_NEXT_CHAT_TEMPLATE)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS
    )
    config = LlavaNextConfig(
        vision_config=_clip_vision(),
        text_config={"model_type": "mistral", **_text_config(tokenizer, _llama_ids(tokenizer), sliding_window=None)},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    _sharpen_head(model)
    files = {
        "preprocessor_config.json": _image_processor_json(
            image_processor, "LlavaNextProcessor", "LlavaNextImageProcessor"
        ),
        "processor_config.json": {
            "num_additional_image_tokens": 1,
            "patch_size": 7,
            "processor_class": "LlavaNextProcessor",
            "vision_feature_select_strategy": "default",
        },
    }
    return _save_checkpoint(folder, model, tokenizer, _llama_ids(tokenizer), files)


def build_tiny_llava_onevision(folder: Path, seed: int = 0) -> Path:
    """A random-weight LLaVA-OneVision (llava-onevision-qwen2-0.5b-ov-hf's layout): SigLIP tower on 28-pixel tiles,
    anyres_max_9 on grids up to 6x6 tiles for one-image prompts, a Qwen2 decoder and tokenizer, and the video
    processor config the real checkpoint ships."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
    tokenizer = _qwen_tokenizer(special, LLAVA_ONEVISION_CHAT_TEMPLATE)
    ids = dict(zip(special, tokenizer.convert_tokens_to_ids(list(special))))
    pinpoints = [[28 * i, 28 * j] for i in range(1, 7) for j in range(1, 7)]
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 7,
    }
    text_ids = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": None}
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config={"model_type": "qwen2", **_text_config(tokenizer, text_ids)},
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
    )
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config)
    _sharpen_head(model)
    generation = {
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    video = {
        "video_processor_type": "LlavaOnevisionVideoProcessor",
        "processor_class": "LlavaOnevisionProcessor",
        "size": {"height": 28, "width": 28},
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "resample": 3,
    }
    files = {
        "preprocessor_config.json": _image_processor_json(
            image_processor, "LlavaOnevisionProcessor", "LlavaOnevisionImageProcessor"
        ),
        "video_preprocessor_config.json": video,
        "processor_config.json": {
            "num_image_tokens": 16,
            "processor_class": "LlavaOnevisionProcessor",
            "vision_aspect_ratio": "anyres_max_9",
            "vision_feature_select_strategy": "full",
        },
    }
    return _save_checkpoint(folder, model, tokenizer, generation, files)


# Gemma3's sliding-window layers see this many tokens, fewer than a prompt with a few images (the real 1024 is fewer
# than a several-image prompt at 256 tokens per image).
GEMMA3_SLIDING_WINDOW = 24


def build_tiny_gemma3(folder: Path, seed: int = 0) -> Path:
    """A random-weight Gemma3 (gemma-3-4b-it's layout): one sliding-window layer then one full-attention layer,
    32-pixel images pooled to 4 tokens, a Gemma tokenizer, <end_of_turn> and <eos> as stop tokens."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    bpe = _train_sentencepiece_bpe(special, vocab_size=400, prepend=False)
    image_tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    # Adds <bos> as the real one does: with the template writing one too, tokenizing a rendered chat as it is gives two.
    tokenizer = GemmaTokenizer(**bpe, add_bos_token=True, extra_special_tokens=image_tokens)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special[5:]])
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in [*special, *image_tokens.values()]}
    image_processor = Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    text = _text_config(
        tokenizer,
        {"bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"], "pad_token_id": ids["<pad>"]},
        query_pre_attn_scalar=16,
        sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,  # (32 / 8)^2 = 16 patches average-pooled 2x2
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        # Untied (the real model ties them): a tied random head makes each position predict its own input token.
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    # transformers initialises the image projection to zeros (a pretrained model's weights replace it): images would
    # not matter at all.
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 32**-0.5)
    _sharpen_head(model)
    generation = {
        "do_sample": True,
        "top_k": 64,
        "top_p": 0.95,
        "cache_implementation": "hybrid",
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "bos_token_id": ids["<bos>"],
        "pad_token_id": ids["<pad>"],
    }
    files = {
        "preprocessor_config.json": _image_processor_json(image_processor, "Gemma3Processor", "Gemma3ImageProcessor")
        | {"image_seq_length": 4},
        "processor_config.json": {"image_seq_length": 4, "processor_class": "Gemma3Processor"},
    }
    return _save_checkpoint(folder, model, tokenizer, generation, files)


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


def build_clip_b32_shape(folder: Path, seed: int = 0) -> Path:
    """Random weights in openai/clip-vit-base-patch32's shape (vision: 12 layers of width 768, 32-pixel patches of
    224 x 224 crops; text: 12 layers of width 512; 512-d embeddings) with its image processing and this file's tiny
    vocabulary: what embedding a dataset costs, without the checkpoint."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bpe = _train_bpe(CLIPTokenizer().backend_tokenizer, ["<|startoftext|>", "<|endoftext|>"], vocab_size=400)
    tokenizer = CLIPTokenizer(**bpe)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = CLIPConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 512, "intermediate_size": 2048, **ids},
        vision_config={"image_size": 224, "patch_size": 32, "hidden_size": 768, "intermediate_size": 3072},
        projection_dim=512,
    )
    config.text_config.pad_token_id = tokenizer.pad_token_id
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


def build_okvqa_fixture(
    root: Path,
    seed: int = 0,
    mixed: bool = False,
    image_size: tuple[int, int] | None = None,
    train_images: int = TRAIN_IMAGES,
    val_images: int = VAL_IMAGES,
) -> Path:
    """An OK-VQA-format dataset under `root` with the official file names and JSON layout; returns `root`.

    train: `train_images` images with two questions each (several questions share an image); val: `val_images` images
    with one question each. Question ids follow OK-VQA's image_id * 10 + index convention. `mixed`: the images cycle
    through MIXED_IMAGES' sizes, modes and formats (wide, tall, tiny, grayscale, palette, CMYK) instead of RGB JPEGs
    of IMAGE_SIZES; `image_size` (width, height): every image that size instead (COCO's are about 640 x 480).
    Questions and answers are the same either way. `train_images` beyond the distinct scenes repeat scenes in files of
    their own (a benchmark's pools need many pictures, not many different ones).
    """
    root = Path(root)
    rng = random.Random(seed)
    questions = [
        ("What color is the shape?", lambda s, c, b: c, list(COLORS)),
        ("What shape is in the picture?", lambda s, c, b: s, list(SHAPES)),
        ("What color is the background?", lambda s, c, b: b, list(BACKGROUNDS)),
    ]
    # Every image is a distinct (shape, color, background, size); the sizes differ so image token counts do too.
    every, n = list(product(SHAPES, COLORS, BACKGROUNDS, IMAGE_SIZES)), train_images + val_images
    scenes = rng.sample(every, n) if n <= len(every) else rng.choices(every, k=n)
    for split, n_images, per_image, first_id in (("train", train_images, 2, 9000), ("val", val_images, 1, 500)):
        (root / f"{split}2014").mkdir(parents=True, exist_ok=True)
        qs, anns = [], []
        for i in range(n_images):
            image_id = first_id + 7 * i
            shape, color, background, size = scenes.pop()
            path = root / f"{split}2014" / f"COCO_{split}2014_{image_id:012d}.jpg"
            if mixed:
                size, mode, fmt = MIXED_IMAGES[(i if split == "train" else TRAIN_IMAGES + i) % len(MIXED_IMAGES)]
                _draw(shape, color, background, size).convert(mode).save(path, format=fmt, quality=95)
            else:
                _draw(shape, color, background, image_size or size).save(path, quality=95)
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


def build_coco_captions_fixture(root: Path, seed: int = 0, train_images: int = TRAIN_IMAGES) -> Path:
    """A COCO-captions-format dataset (2014 layout: captions_{train,val}2014.json and the train2014/, val2014/ folders)
    under `root`, five captions per picture of what it shows; returns `root`."""
    root = Path(root)
    rng = random.Random(seed)
    every = list(product(SHAPES, COLORS, BACKGROUNDS, IMAGE_SIZES))
    scenes = rng.sample(every, train_images + VAL_IMAGES)
    words = ("a {c} {s} on a {b} background", "{c} {s} in front of {b}", "the {s} is {c}", "a {s} that is {c}")
    for split, n_images, first_id in (("train", train_images, 9000), ("val", VAL_IMAGES, 500)):
        (root / f"{split}2014").mkdir(parents=True, exist_ok=True)
        images, annotations = [], []
        for i in range(n_images):
            image_id = first_id + 7 * i
            shape, color, background, size = scenes.pop()
            name = f"COCO_{split}2014_{image_id:012d}.jpg"
            _draw(shape, color, background, size).save(root / f"{split}2014" / name, quality=95)
            images.append({"id": image_id, "file_name": name, "width": size[0], "height": size[1]})
            for j in range(5):
                caption = rng.choice(words).format(c=color, s=shape, b=background)
                annotations.append({"image_id": image_id, "id": image_id * 10 + j, "caption": caption.capitalize()})
        doc = {"images": images, "annotations": annotations}
        (root / f"captions_{split}2014.json").write_text(json.dumps(doc))
    return root
