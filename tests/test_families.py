"""The real backend against plain transformers, for every model family tested here.

For each family (a tiny random-weight checkpoint with its family's processor files and published chat template, built
by icl_select/tiny.py) and an OK-VQA-format folder whose images mix wide, tall, tiny, grayscale, palette and CMYK
files, an independent reference is computed per prompt alone, with nothing of lvlm.py but the chat it lays out
(`LVLMBackend.messages`):

- inputs: the family's stock processor on the rendered prompt and its images (RGB), tokenized as the processor's own
  apply_chat_template does (no second BOS where the template writes one);
- answer: model.generate(), plain greedy from a fresh GenerationConfig, new tokens decoded without special tokens;
- P(reply): ONE forward pass over the prompt plus the reply as the chat template renders the assistant turn, scoring
  its tokens up to and including the first stop token (the generation config's eos ids).

The kit must give the same inputs, the same answers and log P(reply) within 1e-4, at batch sizes 1 and 4 (left
padding, prompts of 0-4 demonstrations with different image token counts in one batch).
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from conftest import FAMILIES
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
)
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from icl_select.lvlm import LVLMBackend

pytestmark = [
    # llava-v1.6-mistral's published template writes "<\s>", which jinja reads as an invalid escape.
    pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning"),
]

MAX_NEW = 4
TOL = 1e-4  # on log P(reply), float32
REPLIES = ["black", "Yes", "fire hydrant"]  # an annotator answer, a capitalised one, two words


@pytest.fixture(scope="module")
def examples(mixed_items) -> list[tuple[dict, list[dict]]]:
    """8 prompts of 0-4 ICDs; the 7 image kinds cycle through the folder, so every kind occurs in several prompts."""
    train, val = mixed_items["train"], mixed_items["val"]
    return [(val[i], [train[(3 * i + j) % len(train)] for j in range(i % 5)]) for i in range(8)]


@pytest.fixture(scope="module")
def replies(examples) -> list[list[str]]:
    """2-3 replies per prompt: an annotator answer, then REPLIES in turn."""
    return [
        [query["answers"][0], *(REPLIES[(i + j) % 3] for j in range(1 + i % 2))]
        for i, (query, _) in enumerate(examples)
    ]


def image_only(cls: type) -> type:
    """`cls` with no video_processor in its __init__, so it builds without torchvision: ProcessorMixin loads and checks
    one sub-processor per __init__ parameter. Image and text processing are `cls`'s own."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, video_processor=None, **kwargs)

    # ProcessorMixin finds the sub-processors in the signature.
    signature = inspect.signature(cls.__init__)
    params = [p for name, p in signature.parameters.items() if name != "video_processor"]
    __init__.__signature__ = signature.replace(parameters=params)
    return type(f"ImageOnly{cls.__name__}", (cls,), {"__init__": __init__})


def stock_processor(folder: Path):
    """The folder's processor: AutoProcessor, or where that needs torchvision for video, the family's processor class
    without the video part."""
    try:
        return AutoProcessor.from_pretrained(folder)
    except ImportError:
        cls = image_only(getattr(transformers, PROCESSOR_MAPPING_NAMES[AutoConfig.from_pretrained(folder).model_type]))
        saved = folder / "processor_config.json"
        kwargs = json.loads(saved.read_text()) if saved.exists() else {}
        kwargs.pop("processor_class", None)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        image_processor = AutoImageProcessor.from_pretrained(folder)
        return cls(image_processor, tokenizer, chat_template=tokenizer.chat_template, **kwargs)


class Reference:
    """Plain transformers on one prompt at a time."""

    def __init__(self, folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.processor = stock_processor(folder)
        self.tokenizer = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(device).eval()
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        self.stop_ids = [eos] if isinstance(eos, int) else list(eos)
        self.model.generation_config = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=MAX_NEW,
            eos_token_id=self.stop_ids,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0],
        )

    def render(self, chat: list[dict], add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode(self, text: str, images: list[Image.Image]):
        # As the processor's apply_chat_template tokenizes: no second BOS where the template writes one.
        bos = self.tokenizer.bos_token
        special = not (bos is not None and text.startswith(bos))
        inputs = self.processor(text=[text], images=[images], add_special_tokens=special, return_tensors="pt")
        return inputs.to(self.model.device, dtype=self.model.dtype)  # casts only the pixels

    @torch.no_grad()
    def answer(self, chat: list[dict], images: list[Image.Image]) -> str:
        inputs = self.encode(self.render(chat, True), images)
        out = self.model.generate(**inputs)[0, inputs["input_ids"].shape[1] :]
        return self.tokenizer.decode(out, skip_special_tokens=True)

    def reply_text(self, chat: list[dict], reply: str) -> tuple[str, str]:
        """(prompt, continuation): the text the model must produce after the prompt to give `reply`, as the template
        renders the assistant turn, ending with a stop token."""
        prompt = self.render(chat, True)
        turn = [*chat, {"role": "assistant", "content": [{"type": "text", "text": reply}]}]
        full = self.render(turn, False)
        if full.startswith(prompt):
            rest = full[len(prompt) :]
        else:  # the template's assistant header differs from its generation prompt: the reply starts where it does
            rest = full[full.index(reply, len(self.render(chat, False))) :]
        stops = [self.tokenizer.convert_ids_to_tokens(i) for i in self.stop_ids]
        ends = [rest.index(s) + len(s) for s in stops if s in rest]
        if ends:
            return prompt, rest[: min(ends)]
        # A template that closes the turn without a stop token (LLaVA's "ASSISTANT: black "): the reply, then the
        # stop token, as generation would end it.
        return prompt, rest[: rest.index(reply) + len(reply)] + stops[0]

    def log_prob(self, chat: list[dict], images: list[Image.Image], reply: str) -> float:
        """log P(reply) from ONE forward pass over prompt + reply."""
        return sum(self.token_log_probs(chat, images, reply))

    @torch.no_grad()
    def token_log_probs(self, chat: list[dict], images: list[Image.Image], reply: str) -> list[float]:
        """log P of each token of the reply (its stop token included), from ONE forward pass over prompt + reply."""
        prompt, rest = self.reply_text(chat, reply)
        prompt_ids = self.encode(prompt, images)["input_ids"][0]
        inputs = self.encode(prompt + rest, images)
        ids = inputs["input_ids"][0]
        n = len(prompt_ids)
        assert torch.equal(ids[:n], prompt_ids), "the prompt's tokens must be a prefix of prompt + reply's"
        reply_ids = ids[n:].tolist()
        stop_at = [j for j, t in enumerate(reply_ids) if t in self.stop_ids]
        assert stop_at, "the reply must end with a stop token"
        reply_ids = reply_ids[: stop_at[0] + 1]
        logits = self.model(**inputs).logits[0, n - 1 : n - 1 + len(reply_ids)]  # (L, V)
        logp = torch.log_softmax(logits.double(), dim=-1)
        return [logp[j, t].item() for j, t in enumerate(reply_ids)]


def rgb_images(query: dict, icds: list[dict]) -> list[Image.Image]:
    images = []
    for item in (*icds, query):
        with Image.open(item["image"]) as img:
            images.append(img.convert("RGB"))
    return images


def n_images(chat: list[dict]) -> int:
    return sum(1 for m in chat if isinstance(m["content"], list) for c in m["content"] if c.get("type") == "image")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_models, mixed_items, examples, replies) -> dict:
    """A family's folder and the reference answers and log P(reply) of every example (computed once)."""
    folder = Path(family_models[request.param])
    ref = Reference(folder)
    # The kit lays the prompt out (its messages()); everything after that is the reference's.
    layout = LVLMBackend(str(folder), mixed_items, batch_size=1, max_new_tokens=MAX_NEW, device="cpu")
    chats = [layout.messages(query, icds) for query, icds in examples]
    images = [rgb_images(query, icds) for query, icds in examples]
    assert all(n_images(c) == len(icds) + 1 for c, (_, icds) in zip(chats, examples))
    answers = [ref.answer(c, im) for c, im in zip(chats, images)]
    logps = [[ref.log_prob(c, im, r) for r in rs] for c, im, rs in zip(chats, images, replies)]
    return {
        "name": request.param,
        "folder": folder,
        "ref": ref,
        "kit": {1: layout},
        "chats": chats,
        "images": images,
        "answers": answers,
        "logps": logps,
    }


def kit(family: dict, mixed_items: dict, batch_size: int) -> LVLMBackend:
    if batch_size not in family["kit"]:
        family["kit"][batch_size] = LVLMBackend(
            str(family["folder"]), mixed_items, batch_size=batch_size, max_new_tokens=MAX_NEW, device="cpu"
        )
    return family["kit"][batch_size]


def test_fixture_bites(family, examples):
    """The reference's answers vary, and the prompts are long enough for Gemma3's sliding window to matter."""
    assert len(set(family["answers"])) > 2, family["answers"]
    ref = family["ref"]
    lengths = [
        ref.encode(ref.render(c, True), im)["input_ids"].shape[1] for c, im in zip(family["chats"], family["images"])
    ]
    window = getattr(ref.model.config.get_text_config(), "sliding_window", None)
    if family["name"] == "gemma3":
        assert window is not None and max(lengths) > 2 * window
    assert max(lengths) < 600


def test_inputs_are_the_stock_processors(family, mixed_items, examples):
    ref = family["ref"]
    backend = kit(family, mixed_items, 1)
    for (query, icds), chat, images in zip(examples, family["chats"], family["images"]):
        got = backend.encode([(query, icds)])
        want = ref.encode(ref.render(chat, True), images)
        assert set(got.keys()) == set(want.keys())
        for key in want:
            a, b = torch.as_tensor(got[key]).cpu(), torch.as_tensor(want[key])
            assert a.shape == b.shape and torch.equal(a.to(b.dtype), b), (key, len(icds))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_answers_and_reply_probs_are_plain_transformers(family, mixed_items, examples, replies, batch_size):
    backend = kit(family, mixed_items, batch_size)
    answers, probs = backend.run(examples, replies)
    wrong = [(i, a, w) for i, (a, w) in enumerate(zip(answers, family["answers"])) if a != w]
    assert not wrong, f"{len(wrong)} of {len(answers)} answers differ (prompt, kit, reference): {wrong}"
    got = [[math.log(p) if p > 0 else -math.inf for p in ps.tolist()] for ps in probs]
    diff = max(abs(g - w) for gs, ws in zip(got, family["logps"]) for g, w in zip(gs, ws))
    assert diff <= TOL, f"max |log P(reply) - reference| = {diff:.3g}; kit {got}, reference {family['logps']}"
    # gt_prob's path: the replies alone, no answer decoded from the cache first.
    _, alone = backend.run(examples, replies, answer=False)
    assert all(torch.allclose(a, p, rtol=1e-4, atol=0) for a, p in zip(alone, probs))
    # evaluate.py's path: the answers alone, the cache left as decoding made it.
    assert backend.run(examples)[0] == family["answers"]


def test_each_demonstration_keeps_its_image(family, examples):
    """In the rendered prompt, image k comes before demonstration k's question and no other image comes between
    them: templates that write every image first (LLaVA-style) would leave the pairing to chance."""
    ref = family["ref"]
    token = ref.processor.image_token
    for chat, (query, icds) in zip(family["chats"], examples):
        text, at = ref.render(chat, True), 0
        for item in (*icds, query):
            image = text.index(token, at)
            at = text.index(item["question"], image)
            assert token not in text[image + len(token) : at], (family["name"], len(icds), text)
