"""A seeded, deterministic simulated "LVLM + COCO-style captioning dataset" with a planted, known optimum.

Beside `sim.Simulator` (VQA), this world is image captioning, scored as the captioning literature scores it: CIDEr-D
(cider.py) of the model's greedy caption against the image's 5 reference captions, with document frequencies fixed by
the train split's references. It mirrors what is published about captioning in context (docs/worlds.md, "Captioning
worlds"): the model imitates its demonstrations' captions (their style, their length and their words, right or wrong), a
demonstration's caption quality matters more than its image's similarity, similar images with poor captions hurt, and
a base model without demonstrations captions in its own web style and length, far below few-shot.

Per image: a topic (scene) of sim.py's 40 in 8 supertopics, a main object (topic-typical), a count, a colour, a verb,
two more objects and how many of them are salient; 5 reference captions, each by a careful or a careless writer (the
careless get words wrong), in a style, naming some of the optional details, worded in the writer's own way. A
demonstration shows its item's first reference. Per query: an ability, a sensitivity to demonstrations, a threshold
per caption slot and the wrong word it says for a slot it does not see. Equations: docs/worlds.md, "Captioning worlds".

What a selector sees: the fused view is the image view alone for every item (train anchors and val queries alike: a
query has no caption at test time); "train_text" is a demonstration's caption embedding (its words, style and length:
what a demonstration shows), "val_text" the caption instruction, the same for every query. Image similarity finds the
topic and main object but is blind to caption quality, style and length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from icl_select import pools
from icl_select.cider import CiderD, ptb_tokenize
from icl_select.sim import (
    COLORS,
    NUM_TOPICS,
    OBJECTS_PER_SUPERTOPIC,
    SCENES_PER_SUPERTOPIC,
    SPLITS,
    SUPERTOPICS,
    SimConfig,
    _directions,
    _lda,
    _plural,
    _ridge,
    _unit,
    _with_article,
    check_config,
    parse_settings,
)

__all__ = [
    "CaptionConfig",
    "CaptionSimulator",
    "CaptionProbes",
    "CAPTION_WORLDS",
    "caption_world_config",
    "parse_caption_settings",
    "calibrate_caption",
    "caption_calibration_table",
    "SLOTS",
    "STYLES",
]

# Caption slots. Every caption names a count and the main object; the optional ones come in SALIENCE order, so a
# caption of length L (optional slots named) from the model names the first L of them.
SLOTS: tuple[str, ...] = ("count", "color", "object", "verb", "scene", "object2", "object3")
COUNT, COLOR, OBJECT, VERB, SCENE, OBJECT2, OBJECT3 = range(len(SLOTS))
SALIENCE: tuple[int, ...] = (SCENE, VERB, OBJECT2, COLOR, OBJECT3)
MAX_LENGTH = len(SALIENCE)
STYLES: tuple[str, ...] = ("plain", "photo", "verbose", "web")
PREFIX: tuple[str, ...] = ("", "a photo of ", "in this image we can see ", "stock photo of ")
COUNT_WORDS: tuple[str, ...] = ("one", "two", "three")
VERBS: tuple[str, ...] = ("sitting", "standing", "parked", "resting", "lying", "placed", "shown", "displayed")
OBJECT_WORDS: tuple[str, ...] = tuple(dict.fromkeys(o for _, objects in SUPERTOPICS for o in objects))
SCENE_WORDS: tuple[str, ...] = tuple(s for scenes, _ in SUPERTOPICS for s in scenes)  # index = topic
# Word id of object i of supertopic s: (8, 10). The same word in two supertopics ("dog", "bench") is one word.
SUPER_OBJECTS = torch.tensor([[OBJECT_WORDS.index(o) for o in objects] for _, objects in SUPERTOPICS])
SUPER_OF_OBJECT: tuple[int, ...] = tuple(  # the first supertopic that has each object
    next(i for i, (_, objects) in enumerate(SUPERTOPICS) if o in objects) for o in OBJECT_WORDS
)
WORDS: tuple[tuple[str, ...], ...] = (COUNT_WORDS, COLORS, OBJECT_WORDS, VERBS, SCENE_WORDS, OBJECT_WORDS, OBJECT_WORDS)
VOCAB_SIZES = torch.tensor([len(w) for w in WORDS], dtype=torch.float64)  # (J,)
# How many values a slot takes within an image's supertopic (a wrong word is another of them).
CHOICES: tuple[int, ...] = (
    len(COUNT_WORDS),
    len(COLORS),
    OBJECTS_PER_SUPERTOPIC,
    len(VERBS),
    SCENES_PER_SUPERTOPIC,
    OBJECTS_PER_SUPERTOPIC,
    OBJECTS_PER_SUPERTOPIC,
)
NUM_REFERENCES = 5
# How writers word a caption: per phrase, its variants, the first the usual one (and the model's). The count phrases
# are for two and three; a verb phrase is (singular, plural).
PHRASES: tuple[tuple, ...] = (
    ("two", "a pair of"),
    ("three", "some"),
    ("", "small", "large", "big", "old", "little"),  # an adjective, or none
    (("{}", "{}"), ("that is {}", "that are {}")),
    ("in the", "in a", "at the", "on the"),
    ("next to", "near", "beside", "with"),
    ("and", "as well as", "and also"),
    ("subject first", "scene first", "object2 before the scene", "there is"),  # word order
    ("", "on a sunny day", "during the day", "in the background", "with people around", "at night", "up close"),
    ("specific", "generic object", "generic scene", "both generic"),
)
TWO, THREE, ADJECTIVE, VERB_PHRASE, SCENE_PHRASE, OBJECT2_PHRASE, OBJECT3_PHRASE, ORDER, EXTRA, GENERIC = range(
    len(PHRASES)
)
# A writer may name a supertopic's object or scene by a generic word ("an animal", "in the room") instead.
GENERIC_OBJECTS: tuple[str, ...] = ("dish", "vehicle", "item", "animal", "object", "thing", "machine", "product")
GENERIC_SCENES: tuple[str, ...] = ("room", "road", "field", "countryside", "house", "outdoors", "station", "town")
WRONG_WORD_FACTOR = 0.6  # the search's estimate of what a wrong word leaves of a caption's CIDEr-D (a heuristic)


@dataclass(frozen=True)
class CaptionConfig:
    """Every parameter of the caption world (embedding lengths unit-free, effects in logit units); a world is a set of
    their values (`caption_world_config`). Position weights, the shot cost and the help terms mean what they mean in
    sim.SimConfig."""

    world: str = "base"
    """The CAPTION_WORLDS preset these values started from (a label: the values alone decide the captions)."""
    seed: int = 0
    """Seed of the one torch.Generator behind every draw (same seed -> bitwise identical simulator)."""
    dim: int = 512
    """Embedding size (CLIP ViT-B/32 is 512)."""
    num_train: int = 5000
    """Train images: the ICD source and the RL anchor queries."""
    num_val: int = 1200
    """Val images: the evaluation queries."""
    supertopic_share: float = 0.35
    """Share of a topic direction (in squared norm) that is its supertopic's direction."""
    image_topic: float = 1.0
    """Norm of the topic direction in the image view."""
    image_object: float = 0.7
    """Norm of the main object's direction in the image view."""
    image_noise: float = 1.6
    """Norm of the isotropic per-image noise in the image view."""
    text_words: float = 1.0
    """Norm of a caption's words (the sum of their directions, normalised) in its text view."""
    text_style: float = 0.6
    """Norm of the caption's style direction in its text view."""
    text_length: float = 0.25
    """Scale of the caption's length (optional slots named, centred) along a fixed direction of the text view."""
    text_noise: float = 0.8
    """Norm of the isotropic per-caption noise in the text view."""
    count_probs: tuple[float, ...] = (0.6, 0.25, 0.15)
    """Probability that the main object appears once, twice, three times."""
    salient_probs: tuple[float, ...] = (0.3, 0.4, 0.3)
    """Probability that 1, 2 or 3 objects are salient (writers name object2 only from 2, object3 only at 3)."""
    signature_object: float = 0.6
    """Probability that the main object is one of its topic's two typical ones (else any of its supertopic)."""
    signature_verb: float = 0.5
    """Probability that the verb is its topic's typical one."""
    mention_probs: tuple[float, ...] = (0.75, 0.6, 0.6, 0.45, 0.5)
    """Probability that a reference names each optional slot, in SALIENCE order (scene, verb, object2, color, object3;
    object3 only with object2)."""
    reference_style_probs: tuple[float, ...] = (0.9, 0.05, 0.05, 0.0)
    """Probability of each style (STYLES: plain, photo, verbose, web) for a reference caption."""
    phrasing_variety: float = 0.6
    """Probability that a writer words a phrase (count, verb, scene, object2, object3) other than the usual way."""
    adjective_frac: float = 0.4
    """Probability that a writer adds a size or age adjective to the main object."""
    extra_frac: float = 0.4
    """Probability that a writer adds a phrase about the circumstances ("on a sunny day")."""
    generic_frac: float = 0.6
    """Probability that a writer names the main object, the scene or both by a generic word ("an animal")."""
    careless_frac: float = 0.2
    """Share of reference captions written carelessly."""
    careless_error: float = 0.5
    """Probability that a careless writer gets a named slot wrong."""
    careful_error: float = 0.03
    """Probability that a careful writer gets a named slot wrong."""
    ability_mean: float = -0.2
    """Mean of the per-query ability (a slot's zero-shot logit before its competence and threshold)."""
    ability_std: float = 1.2
    """Std of the per-query ability."""
    slot_competence: tuple[float, ...] = (1.0, 0.3, 1.0, -0.2, 0.6, -0.4, -0.7)
    """Added to the logit of each slot (SLOTS order): how easy it is to see."""
    threshold_std: float = 0.5
    """Std of the per-query, per-slot threshold."""
    sensitivity_log_mean: float = 0.0
    """Mean of log sensitivity (how strongly a query's slots react to demonstrations)."""
    sensitivity_log_std: float = 0.5
    """Std of log sensitivity."""
    help_base: float = 0.25
    """Helpfulness of an unrelated demonstration of central quality (any caption shows the task)."""
    help_topic: float = 0.25
    """Extra helpfulness of a same-topic demonstration of central quality."""
    help_topic_quality: float = 2.5
    """How much a same-topic demonstration's help grows per unit of its caption quality above the centre."""
    help_supertopic: float = 0.2
    """Affinity of a demonstration from another topic of the query's supertopic (1 = same topic)."""
    help_quality: float = 1.0
    """Topic-independent helpfulness per unit of caption quality above the centre."""
    quality_centre: float = 0.9
    """Caption quality (share of named slots right) at which the quality terms are 0."""
    copy_weight: float = 0.7
    """Pull towards the words of a fully resembling demonstration next to the query (0 = never copies)."""
    copy_object: float = 1.0
    """Resemblance added by sharing the main object, relative to sharing the topic (1)."""
    position_decay: float = 0.8
    """Weight of position i of k is position_decay ** (k - 1 - i): the demonstration next to the query weighs 1."""
    shot_cost: float = 0.01
    """Logit cost per shot (longer prompts distract)."""
    habit_style: int = 3
    """The model's own style without demonstrations (index into STYLES; a base model: web alt text)."""
    habit_length: float = 1.0
    """The model's own caption length without demonstrations (optional slots named)."""
    habit_weight: float = 0.9
    """Weight of the model's own style and length against the demonstrations' position weights."""
    correct_bar: float = 1.0
    """A caption is "correct" when its CIDEr-D reaches this (1.0 = 100 on the x100 scale)."""
    smoothing: float = 0.02
    """gt_prob: probability mass spread over every word of a slot (no reference word has probability 0)."""

    def __post_init__(self):
        lengths = {"count_probs": len(COUNT_WORDS), "salient_probs": 3, "mention_probs": MAX_LENGTH}
        lengths |= {"reference_style_probs": len(STYLES), "slot_competence": len(SLOTS)}
        weights = ("count_probs", "salient_probs", "reference_style_probs")
        check_config(self, CAPTION_WORLDS, CAPTION_RANGES, lengths, weights)


# Allowed values per parameter (each entry of a tuple), as intervals; one not listed takes any finite number.
CAPTION_RANGES: dict[str, str] = {
    "dim": "[1, inf)",
    "num_train": "[1, inf)",
    "num_val": "[1, inf)",
    **dict.fromkeys(("supertopic_share", "signature_object", "signature_verb", "careless_frac"), "[0, 1]"),
    **dict.fromkeys(("careless_error", "careful_error", "quality_centre"), "[0, 1]"),
    **dict.fromkeys(("phrasing_variety", "adjective_frac", "extra_frac", "generic_frac"), "[0, 1]"),
    **dict.fromkeys(("count_probs", "salient_probs", "mention_probs", "reference_style_probs"), "[0, 1]"),
    **dict.fromkeys(("image_topic", "image_object", "image_noise", "text_words", "text_style"), "[0, inf)"),
    **dict.fromkeys(("text_length", "text_noise", "ability_std", "threshold_std"), "[0, inf)"),
    "sensitivity_log_std": "[0, inf)",
    "copy_weight": "[0, inf)",
    "copy_object": "[0, inf)",
    "position_decay": "(0, inf)",
    "habit_style": f"[0, {len(STYLES) - 1}]",
    "habit_length": f"[0, {MAX_LENGTH}]",
    "habit_weight": "(0, inf)",
    "correct_bar": "[0, inf)",
    "smoothing": "(0, 1)",
}

# World name -> the parameters it sets. docs/worlds.md: what each mirrors.
CAPTION_WORLDS: dict[str, dict[str, float]] = {
    "base": {},
    # An instruction-tuned model captions in COCO's plain style and length by itself and sees more; demonstrations
    # add little and distract.
    "instruct": {
        "habit_style": 0,
        "habit_length": 2.0,
        "habit_weight": 2.0,
        "ability_mean": 1.2,
        "help_base": -0.1,
        "help_topic": 0.1,
        "help_topic_quality": 1.0,
        "help_quality": 0.3,
    },
}


def caption_world_config(world: str = "base", **overrides) -> CaptionConfig:
    """The CaptionConfig of a caption world: its preset, then `overrides` (any CaptionConfig field but `world`)."""
    if world not in CAPTION_WORLDS:
        raise ValueError(f"unknown caption world {world!r}; the caption worlds are {', '.join(CAPTION_WORLDS)}")
    return CaptionConfig(world=world, **{**CAPTION_WORLDS[world], **overrides})


def parse_caption_settings(pairs: list[str]) -> dict:
    """FIELD=VALUE strings -> CaptionConfig overrides, each VALUE read as its field's type (a tuple as a comma list);
    a knob of the VQA worlds only is refused in one line, and the ranges are CaptionConfig's to check."""
    vqa_only = {f.name for f in dataclasses.fields(SimConfig)} - {f.name for f in dataclasses.fields(CaptionConfig)}
    for pair in pairs:
        name, sep, _ = pair.partition("=")
        if sep and name.strip() in vqa_only:
            raise ValueError(
                f"{pair!r}: {name.strip()} is a parameter of the VQA worlds; the caption world has none such"
            )
    return parse_settings(pairs, CaptionConfig)


# ---------------------------------------------------------------------------------------------------------------------
# Drawing a split


def _word_ids(supertopic: Tensor, index: Tensor) -> Tensor:
    """Slot values as indices within an image's supertopic (..., J), supertopic broadcastable to (...,) -> word ids."""
    sup = supertopic.expand(index.shape[:-1])
    out = index.clone()
    for j in (OBJECT, OBJECT2, OBJECT3):
        out[..., j] = SUPER_OBJECTS[sup, index[..., j]]
    out[..., SCENE] = sup * SCENES_PER_SUPERTOPIC + index[..., SCENE]
    return out


def _wrong(index: Tensor, gen: torch.Generator) -> Tensor:
    """Another value of each slot within the same supertopic: (..., J) indices -> (..., J), never the same."""
    choices = torch.tensor(CHOICES)  # (J,)
    offset = 1 + (torch.rand(index.shape, generator=gen) * (choices - 1)).long()  # uniform in [1, choices - 1]
    return (index + offset) % choices


def _draw_images(cfg: CaptionConfig, gen: torch.Generator, n: int) -> dict[str, Tensor]:
    """One split's planted image content: "topic", "supertopic" (N,), "index" (N, J) each slot's true value as an index
    within the supertopic, "truth" (N, J) as word ids, "salient" (N,) in 1..3."""
    topic = torch.randint(NUM_TOPICS, (n,), generator=gen)  # (N,)
    sup, scene = topic // SCENES_PER_SUPERTOPIC, topic % SCENES_PER_SUPERTOPIC
    # Each topic has two typical main objects (2 scene, 2 scene + 1 of its supertopic's list) and a typical verb.
    typical = 2 * scene + torch.randint(2, (n,), generator=gen)  # (N,)
    any_object = torch.randint(OBJECTS_PER_SUPERTOPIC, (n,), generator=gen)
    obj = torch.where(torch.rand(n, generator=gen) < cfg.signature_object, typical, any_object)
    # object2 and object3: two other objects of the supertopic, distinct from the main one and each other
    obj2 = (obj + 1 + torch.randint(OBJECTS_PER_SUPERTOPIC - 1, (n,), generator=gen)) % OBJECTS_PER_SUPERTOPIC
    step3 = 1 + torch.randint(OBJECTS_PER_SUPERTOPIC - 2, (n,), generator=gen)
    obj3 = (obj2 + step3) % OBJECTS_PER_SUPERTOPIC
    obj3 = torch.where(obj3 == obj, (obj3 + 1) % OBJECTS_PER_SUPERTOPIC, obj3)
    obj3 = torch.where(obj3 == obj2, (obj3 + 1) % OBJECTS_PER_SUPERTOPIC, obj3)
    verb = torch.where(
        torch.rand(n, generator=gen) < cfg.signature_verb,
        topic % len(VERBS),
        torch.randint(len(VERBS), (n,), generator=gen),
    )
    count = torch.multinomial(torch.tensor(cfg.count_probs), n, replacement=True, generator=gen)
    color = torch.randint(len(COLORS), (n,), generator=gen)
    salient = 1 + torch.multinomial(torch.tensor(cfg.salient_probs), n, replacement=True, generator=gen)
    index = torch.stack([count, color, obj, verb, scene, obj2, obj3], dim=1)  # (N, J)
    return {"topic": topic, "supertopic": sup, "index": index, "truth": _word_ids(sup, index), "salient": salient}


def _draw_references(cfg: CaptionConfig, gen: torch.Generator, images: dict[str, Tensor]) -> dict[str, Tensor]:
    """Five reference captions per image, as structure: "ref_style" (N, R), "ref_mention" (N, R, J) bool, "ref_word"
    (N, R, J) word ids (a slot not named holds the true word), "ref_careless" (N, R) bool."""
    n, r, j = len(images["topic"]), NUM_REFERENCES, len(SLOTS)
    style = torch.multinomial(torch.tensor(cfg.reference_style_probs), n * r, replacement=True, generator=gen)
    careless = torch.rand(n, r, generator=gen) < cfg.careless_frac
    mention = torch.zeros(n, r, j, dtype=torch.bool)
    mention[..., COUNT] = mention[..., OBJECT] = True
    draws = torch.rand(n, r, MAX_LENGTH, generator=gen) < torch.tensor(cfg.mention_probs)  # (N, R, 5)
    for s, slot in enumerate(SALIENCE):
        mention[..., slot] = draws[..., s]
    salient = images["salient"][:, None]  # (N, 1)
    mention[..., OBJECT2] &= salient >= 2
    mention[..., OBJECT3] &= (salient >= 3) & mention[..., OBJECT2]
    error = torch.where(careless, cfg.careless_error, cfg.careful_error)  # (N, R)
    wrong = torch.rand(n, r, j, generator=gen) < error[..., None]  # (N, R, J)
    index = torch.where(wrong, _wrong(images["index"][:, None].expand(n, r, j), gen), images["index"][:, None])
    sizes = torch.tensor([len(v) for v in PHRASES])  # (P,)
    varied = torch.rand(n, r, len(PHRASES), generator=gen) < cfg.phrasing_variety
    varied[..., ADJECTIVE] = torch.rand(n, r, generator=gen) < cfg.adjective_frac
    varied[..., EXTRA] = torch.rand(n, r, generator=gen) < cfg.extra_frac
    varied[..., GENERIC] = torch.rand(n, r, generator=gen) < cfg.generic_frac
    other = 1 + (torch.rand(n, r, len(PHRASES), generator=gen) * (sizes - 1)).long()  # uniform over the others
    return {
        "ref_phrasing": torch.where(varied, other, 0),  # (N, R, P)
        "ref_style": style.view(n, r),
        "ref_mention": mention,
        "ref_word": _word_ids(images["supertopic"][:, None], index),
        "ref_careless": careless,
    }


def _draw_queries(cfg: CaptionConfig, gen: torch.Generator, images: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the model brings to each image as a query: "ability", "sensitivity" (N,), "threshold" (N, J) and
    "hallucination" (N, J), the wrong word it says for a slot it does not see."""
    n = len(images["topic"])
    # Stratified normal draws (one per quantile bin, randomly assigned), as in sim.py: the share of easy and hard
    # queries is fixed, so scores vary little with the seed.
    strata = (torch.randperm(n, generator=gen) + torch.rand(n, generator=gen)) / n  # (N,) in (0, 1)
    ability = cfg.ability_mean + cfg.ability_std * torch.special.ndtri(strata)
    sensitivity = (cfg.sensitivity_log_mean + cfg.sensitivity_log_std * torch.randn(n, generator=gen)).exp()
    threshold = cfg.threshold_std * torch.randn(n, len(SLOTS), generator=gen)
    hallucination = _word_ids(images["supertopic"], _wrong(images["index"], gen))
    return {
        "ability": ability.double(),
        "sensitivity": sensitivity.double(),
        "threshold": threshold.double(),
        "hallucination": hallucination,
    }


def _render(
    style: list[int], mention: list[list[bool]], word: list[list[int]], phrasing: list[list[int]] | None = None
) -> list[str]:
    """Captions from their structure, one per row: "[prefix] {count} [adjective] [color] {object} [verb] [in the
    {scene}] [next to a {object2}] [and a {object3}]", lower case, words separated by single spaces; phrasing (one row
    of PHRASES variants each) words them as a writer does, None as the model does (every phrase's first variant)."""
    out = []
    for i, (s, m, w) in enumerate(zip(style, mention, word)):
        v = phrasing[i] if phrasing is not None else (0,) * len(PHRASES)
        sup = SUPER_OF_OBJECT[w[OBJECT]]
        noun = GENERIC_OBJECTS[sup] if v[GENERIC] in (1, 3) else OBJECT_WORDS[w[OBJECT]]
        if w[COUNT] > 0:
            noun = _plural(noun)
        if m[COLOR]:
            noun = f"{COLORS[w[COLOR]]} {noun}"
        if v[ADJECTIVE]:
            noun = f"{PHRASES[ADJECTIVE][v[ADJECTIVE]]} {noun}"
        head = _with_article(noun) if w[COUNT] == 0 else f"{PHRASES[w[COUNT] - 1][v[w[COUNT] - 1]]} {noun}"
        if v[ORDER] == 3:  # "there is a ..." / "there are two ..."
            head = f"there {'are' if w[COUNT] else 'is'} {head}"
        verb = PHRASES[VERB_PHRASE][v[VERB_PHRASE]][w[COUNT] > 0].format(VERBS[w[VERB]]) if m[VERB] else ""
        where = GENERIC_SCENES[w[SCENE] // SCENES_PER_SUPERTOPIC] if v[GENERIC] >= 2 else SCENE_WORDS[w[SCENE]]
        scene = f"{PHRASES[SCENE_PHRASE][v[SCENE_PHRASE]]} {where}" if m[SCENE] else ""
        near = (
            f"{PHRASES[OBJECT2_PHRASE][v[OBJECT2_PHRASE]]} {_with_article(OBJECT_WORDS[w[OBJECT2]])}"
            if m[OBJECT2]
            else ""
        )
        if m[OBJECT3]:  # named only with object2 (by writers, and by the model, whose SALIENCE has object2 first)
            near += f" {PHRASES[OBJECT3_PHRASE][v[OBJECT3_PHRASE]]} {_with_article(OBJECT_WORDS[w[OBJECT3]])}"
        if v[ORDER] == 1:
            parts = [scene, head, verb, near]
        elif v[ORDER] == 2:
            parts = [head, verb, near, scene]
        else:
            parts = [head, verb, scene, near]
        parts.append(PHRASES[EXTRA][v[EXTRA]])
        out.append(PREFIX[s] + " ".join(x for x in parts if x))
    return out


def _caption_embed(cfg: CaptionConfig, gen: torch.Generator, directions: dict[str, Tensor], lat: dict) -> Tensor:
    """CLIP-like text view of each item's shown caption (its first reference), (N, d) L2-normalised: the directions of
    its words (a wrong word points elsewhere than the picture), its style and its length."""
    n, d = len(lat["topic"]), cfg.dim
    mention, word = lat["mention"].float(), lat["word"]  # (N, J), (N, J)
    words = torch.zeros(n, d)
    for j, table in enumerate(directions["slots"]):
        words += mention[:, j, None] * table[word[:, j]]
    length = lat["length"].float() - lat["length"].float().mean()
    text = (
        cfg.text_words * F.normalize(words, dim=-1)
        + cfg.text_style * directions["style"][lat["style"]]
        + cfg.text_length * length[:, None] * directions["length"]
        + cfg.text_noise * torch.randn(n, d, generator=gen) / math.sqrt(d)
    )
    return F.normalize(text, dim=-1)


def _sigmoid(x: Tensor) -> Tensor:
    """The logistic function as exp and a division: torch.sigmoid rounds its SIMD body and its scalar tail differently
    (in float64 too), so a row's value would depend on the batch it came in; these two do not."""
    return 1 / (1 + (-x).exp())


class CaptionSimulator:
    """COCO-style caption splits with embeddings, and a deterministic simulated LVLM that captions a query image after
    an ordered sequence of demonstrations (train items, each showing its first reference caption).

    Attributes (the interface of `sim.Simulator` the stages use):
        cfg: the CaptionConfig.
        items: "train", "val" -> list of {"question_id", "image_id" (equal), "question": "", "answers": 5 reference
             captions}, as caption_data.py reads real ones.
        emb: "train", "val" -> fused (N, d) float32 L2-normalised (the selector's input: the image view, so train
             anchors and val queries look alike); "<split>_image" the image view; "train_text" each demonstration's
             caption view, "val_text" the caption instruction's (one vector for every query).
        latents: split -> planted truth: "topic", "supertopic", "salient" (N,); "index", "truth" (N, J) each slot's
             true value (index within the supertopic; word id); the references "ref_style" (N, R), "ref_mention",
             "ref_word" (N, R, J), "ref_careless" (N, R), "ref_phrasing" (N, R, P) (its writer's wording); the shown
             caption (reference 0) "style", "length", "quality" (N,), "mention", "word" (N, J), "right" (N, J); the
             query's "ability", "sensitivity" (N,), "threshold", "hallucination" (N, J); "image_id", "question_id"."""

    def __init__(self, cfg: CaptionConfig = CaptionConfig()):  # noqa: B008  (frozen, so sharing the default is safe)
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        d = cfg.dim
        directions = {
            "topic": _directions(cfg, gen)["topic"],  # (T, d) shared with the scene words, as CLIP aligns them
            "object": _unit((len(OBJECT_WORDS), d), gen),
            "style": _unit((len(STYLES), d), gen),
            "length": _unit((d,), gen),
            "instruction": _unit((d,), gen),
        }
        directions["slots"] = (
            _unit((len(COUNT_WORDS), d), gen),
            _unit((len(COLORS), d), gen),
            directions["object"],
            _unit((len(VERBS), d), gen),
            directions["topic"],
            directions["object"],
            directions["object"],
        )
        self.items: dict[str, list[dict]] = {}
        self.emb: dict[str, Tensor] = {}
        self.latents: dict[str, dict[str, Tensor]] = {}
        self._refs: dict[str, list[list[str]]] = {}  # tokenized references per split, the CIDEr-D scorer's input
        first_image = 1
        for split, n in (("train", cfg.num_train), ("val", cfg.num_val)):
            lat = _draw_images(cfg, gen, n)
            lat |= _draw_references(cfg, gen, lat)
            shown = {
                "style": lat["ref_style"][:, 0],
                "mention": lat["ref_mention"][:, 0],
                "word": lat["ref_word"][:, 0],
            }
            shown["length"] = shown["mention"][:, list(SALIENCE)].sum(1)
            shown["right"] = shown["word"] == lat["truth"]
            shown["quality"] = (shown["right"] & shown["mention"]).sum(1) / shown["mention"].sum(1)
            lat |= shown | _draw_queries(cfg, gen, lat)
            image_noise = torch.randn(n, d, generator=gen) / math.sqrt(d)
            image = F.normalize(
                cfg.image_topic * directions["topic"][lat["topic"]]
                + cfg.image_object * directions["object"][lat["truth"][:, OBJECT]]
                + cfg.image_noise * image_noise,
                dim=-1,
            )  # (N, d)
            text = _caption_embed(cfg, gen, directions, lat) if split == "train" else directions["instruction"]
            self.emb[split] = image.clone()  # no storage shared with the image view: safetensors refuses that
            self.emb[f"{split}_image"] = image
            self.emb[f"{split}_text"] = text.expand(n, d).contiguous()
            ids = torch.arange(first_image, first_image + n)
            lat |= {"image_id": ids, "question_id": ids}
            self.latents[split] = lat
            raw = _render(
                lat["ref_style"].flatten().tolist(),
                lat["ref_mention"].flatten(0, 1).tolist(),
                lat["ref_word"].flatten(0, 1).tolist(),
                lat["ref_phrasing"].flatten(0, 1).tolist(),
            )
            raw = [c[0].upper() + c[1:] + "." for c in raw]  # as annotators write them; tokenized for scoring
            tokens = ptb_tokenize(raw)
            self._refs[split] = [tokens[i : i + NUM_REFERENCES] for i in range(0, len(tokens), NUM_REFERENCES)]
            self.items[split] = [
                {"question_id": i, "image_id": i, "question": "", "answers": raw[r : r + NUM_REFERENCES]}
                for i, r in zip(ids.tolist(), range(0, len(raw), NUM_REFERENCES))
            ]
            first_image += n
        # CIDEr-D with document frequencies fixed by the train split's references (a caption's score depends on it and
        # its references alone); scores memoised by (split, query, caption), since many prompts give one caption.
        self._scorer = CiderD(self._refs["train"])
        self._memo: dict[tuple[str, int, str], float] = {}
        self._templates: dict[tuple[str, int], Tensor] = {}

    # ------------------------------------------------------------------------------------------------------------------
    # The caption model

    def position_weights(self, k: int) -> Tensor:
        """Weight of each prompt position for k shots, (k,) float64: the last, next to the query, weighs 1."""
        return self.cfg.position_decay ** torch.arange(k - 1, -1, -1, dtype=torch.float64)

    def _features(self, split: str, queries: Tensor, icds: Tensor, observable: bool = False) -> dict[str, Tensor]:
        """What the caption model needs of each demonstration for its query: (B,), (B, k) train rows -> "h" (B, k)
        helpfulness, "res" (B, k) resemblance, "style" (B, k, S) its style (one-hot), "length" (B, k), "mention"
        (B, k, J) which slots its caption names, "match" (B, k, J) whether its word is right for the query's picture,
        and "word" (B, k, J) its words. observable=True: what `probes` read off the embeddings (posteriors and
        expectations, population rates for what no embedding tells), no "word"."""
        cfg = self.cfg
        if observable:
            p = self.probes
            q, c = p.read(split, queries), p.read("train", icds)
            same_topic = (q["topic"][:, None] * c["topic"]).sum(-1)  # (B, k)
            same_super = (q["supertopic"][:, None] * c["supertopic"]).sum(-1)
            same_object = (q["object"][:, None] * c["object"]).sum(-1)
            quality, style, length = c["quality"], c["style"], c["length"]
            mention = p.mention_rate.expand(*icds.shape, -1)  # (B, k, J)
            equal = same_topic[..., None] * p.equal_same_topic + (1 - same_topic[..., None]) * p.equal_other_topic
            equal[..., SCENE], equal[..., OBJECT] = same_topic, same_object
            match = quality.clamp(0, 1)[..., None] * equal  # (B, k, J) the shown word right, and the query's
        else:
            q, c = self.latents[split], self.latents["train"]
            same_topic = (q["topic"][queries][:, None] == c["topic"][icds]).double()
            same_super = (q["supertopic"][queries][:, None] == c["supertopic"][icds]).double()
            same_object = (q["truth"][queries][:, None, OBJECT] == c["truth"][icds][..., OBJECT]).double()
            quality = c["quality"][icds].double()
            style = F.one_hot(c["style"][icds], len(STYLES)).double()  # (B, k, S)
            length = c["length"][icds].double()
            mention = c["mention"][icds].double()  # (B, k, J)
            word = c["word"][icds]  # (B, k, J)
            match = (word == q["truth"][queries][:, None]).double()
        affinity = same_topic + cfg.help_supertopic * (same_super - same_topic)  # (B, k)
        centred = quality - cfg.quality_centre
        h = cfg.help_base + affinity * (cfg.help_topic + cfg.help_topic_quality * centred) + cfg.help_quality * centred
        res = (affinity + cfg.copy_object * same_object) / (1 + cfg.copy_object)
        f = {"h": h, "res": res, "style": style, "length": length, "mention": mention, "match": match}
        return f if observable else f | {"word": word}

    def _query(self, split: str, queries: Tensor, observable: bool = False) -> dict[str, Tensor]:
        """The query's latents the caption model reads, (B,) and (B, J); observable=True: the population medians
        (nothing in an embedding tells a query's ability or thresholds)."""
        if observable:
            n, cfg = len(queries), self.cfg
            return {
                "ability": torch.full((n,), cfg.ability_mean, dtype=torch.float64),
                "sensitivity": torch.full((n,), math.exp(cfg.sensitivity_log_mean), dtype=torch.float64),
                "threshold": torch.zeros(n, len(SLOTS), dtype=torch.float64),
            }
        q = self.latents[split]
        return {key: q[key][queries] for key in ("ability", "sensitivity", "threshold", "truth", "hallucination")}

    def _start(self, n: int, words: bool) -> dict[str, Tensor]:
        """The model's state before any demonstration, for n rows: "votes" (N, S) per style, "length" and "total" (N,)
        the weighted sum of lengths and of weights, "effect" (N,), and per slot (N, J) the strongest "pull" so far and
        its demonstration's "match" (whether its word is right for the query) and, with words, "word". The habits start
        the votes and the length."""
        cfg, j = self.cfg, len(SLOTS)
        votes = torch.zeros(n, len(STYLES), dtype=torch.float64)
        votes[:, cfg.habit_style] = cfg.habit_weight
        state = {
            "votes": votes,
            "length": torch.full((n,), cfg.habit_weight * cfg.habit_length, dtype=torch.float64),
            "total": torch.full((n,), cfg.habit_weight, dtype=torch.float64),
            "effect": torch.zeros(n, dtype=torch.float64),
            "pull": torch.zeros(n, j, dtype=torch.float64),
            "match": torch.zeros(n, j, dtype=torch.float64),
        }
        return state | {"word": torch.zeros(n, j, dtype=torch.long)} if words else state

    @staticmethod
    def _add(state: dict[str, Tensor], c: dict[str, Tensor], w: Tensor, wins_ties: bool) -> dict[str, Tensor]:
        """The state with one more demonstration, of features c (one position of `_features`, broadcastable to the
        state's rows) at position weight w (broadcastable, 0 for none). A pull stronger than the strongest so far
        takes over the slot; wins_ties: an equal one too (it sits earlier in the prompt, and the earliest wins)."""
        p = w[..., None] * c["res"][..., None] * c["mention"]  # (..., J)
        stronger = (p >= state["pull"]) & (p > 0) if wins_ties else p > state["pull"]
        out = {
            "votes": state["votes"] + w[..., None] * c["style"],
            "length": state["length"] + w * c["length"],
            "total": state["total"] + w,
            "effect": state["effect"] + w * c["h"],
            "pull": torch.where(stronger, p, state["pull"]),
            "match": torch.where(stronger, c["match"], state["match"]),
        }
        return out | {"word": torch.where(stronger, c["word"], state["word"])} if "word" in state else out

    def _finish(self, state: dict[str, Tensor], query: dict[str, Tensor], k: int) -> dict[str, Tensor]:
        """The caption a state gives, rows (...): "style", "length" (the optional slots it names), "mention" (..., J),
        "margin", "copies" (bool), "right" (a probability under observable features), "mean_length", and with the
        query's truth, "word" (..., J) the words it says and "copied" (..., J) the words a copy would say."""
        cfg = self.cfg
        mean_length = state["length"] / state["total"]
        named = torch.floor(mean_length + 0.5).clamp(0, MAX_LENGTH).long()
        mention = torch.stack([named >= 0] * len(SLOTS), -1)  # count and object always
        for r, slot in enumerate(SALIENCE):
            mention[..., slot] = named > r
        competence = torch.tensor(cfg.slot_competence, dtype=torch.float64)
        margin = (
            query["ability"][..., None]
            + competence
            + query["sensitivity"][..., None] * state["effect"][..., None]
            - cfg.shot_cost * k
            - query["threshold"]
        )  # (..., J)
        # Copies (greedily) when the pull beats the odds of its own word: copy_weight * pull > e^margin.
        copies = (state["pull"] > 0) & (cfg.copy_weight * state["pull"] > margin.exp())
        out = {
            "style": state["votes"].argmax(-1),  # the first of equal votes
            "length": named,
            "mention": mention,
            "margin": margin,
            "copies": copies,
            "right": torch.where(copies, state["match"], (margin > 0).double()),
            "mean_length": mean_length,
        }
        if "truth" in query:
            own = torch.where(margin > 0, query["truth"], query["hallucination"])
            out |= {"word": torch.where(copies, state["word"], own), "copied": state["word"]}
        return out

    def _reply(self, f: dict[str, Tensor], query: dict[str, Tensor], k: int) -> dict[str, Tensor]:
        """The caption model on features (N, k, ...) (`_features`) and query latents (`_query`): `_finish`'s caption
        and the state it came from. Positions are added one by one (elementwise, float64), so a row's caption never
        depends on the batch it came in."""
        state = self._start(len(query["ability"]), "word" in f)
        w = self.position_weights(k)
        for i in range(k):
            state = self._add(state, {name: v[:, i] for name, v in f.items()}, w[i].expand(len(state["total"])), False)
        return self._finish(state, query, k) | {"state": state}

    def _captions(self, split: str, queries: Tensor, icds: Tensor) -> tuple[dict[str, Tensor], list[str]]:
        """The model's greedy caption of each query after its demonstrations: (B,), (B, k) -> the reply (`_reply`) and
        the captions."""
        r = self._reply(self._features(split, queries, icds), self._query(split, queries), icds.shape[1])
        return r, _render(r["style"].tolist(), r["mention"].tolist(), r["word"].tolist())

    def _cider(self, split: str, queries: list[int], captions: list[str]) -> Tensor:
        """CIDEr-D of each caption against its query's references, memoised: (B,) float64."""
        keys = [(split, q, c) for q, c in zip(queries, captions)]
        new = list(dict.fromkeys(key for key in keys if key not in self._memo))
        if new:
            scores = self._scorer.score([c for _, _, c in new], [self._refs[split][q] for _, q, _ in new])
            self._memo.update(zip(new, scores.tolist()))
        return torch.tensor([self._memo[key] for key in keys], dtype=torch.float64)

    def _gt_prob(self, split: str, queries: Tensor, r: dict[str, Tensor]) -> Tensor:
        """P(the query's first reference | prompt) under the caption model, as exp of the mean log probability of its
        parts (InfoScore's exp(-mean token cross-entropy), with slots for tokens): each slot it names, its style and
        its length. A slot's word: copied with probability sigmoid(log(copy_weight * pull) - margin), else the true
        word with probability sigmoid(margin) and the model's wrong word otherwise; a smoothing share spread over the
        slot's vocabulary. Style: votes / their sum; length: a unit Gaussian around the mean length over 0..5."""
        cfg, eps = self.cfg, self.cfg.smoothing
        q = self.latents[split]
        ref_mention, ref_word = q["ref_mention"][queries, 0], q["ref_word"][queries, 0]  # (B, J)
        ref_style, ref_length = q["ref_style"][queries, 0], q["length"][queries]
        own, pull = _sigmoid(r["margin"]), r["state"]["pull"]  # (B, J)
        copy = torch.where(pull > 0, _sigmoid((cfg.copy_weight * pull).log() - r["margin"]), torch.zeros_like(own))
        truth, wrong, copied = q["truth"][queries], q["hallucination"][queries], r["copied"]
        p = copy * (ref_word == copied) + (1 - copy) * (own * (ref_word == truth) + (1 - own) * (ref_word == wrong))
        p = (1 - eps) * p + eps / VOCAB_SIZES  # (B, J)
        votes = r["state"]["votes"]
        p_style = (votes.gather(1, ref_style[:, None])[:, 0] / votes.sum(1)) * (1 - eps) + eps / len(STYLES)
        lengths = torch.arange(MAX_LENGTH + 1, dtype=torch.float64)
        p_length = (-0.5 * (lengths - r["mean_length"][:, None]) ** 2).softmax(1).gather(1, ref_length[:, None])[:, 0]
        p_length = (1 - eps) * p_length + eps / (MAX_LENGTH + 1)
        logp = (p.log() * ref_mention).sum(1) + p_style.log() + p_length.log()
        return (logp / (ref_mention.sum(1) + 2)).exp()

    def score(self, split: str, queries: Tensor, icds: Tensor) -> dict:
        """Simulated greedy caption and its scores: (B,), (B, k) train rows in prompt order (k may be 0) -> "prediction"
        (list[str]), "acc" (CIDEr-D, not x100), "correct" (acc >= cfg.correct_bar), "gt_prob" (P(the query's first
        reference | prompt), `_gt_prob`), "rel" (share of the caption's slots right for the picture), each (B,)."""
        if queries.dim() != 1 or icds.dim() != 2 or icds.shape[0] != queries.shape[0]:
            raise ValueError(f"expected queries (B,) and icds (B, k), got {tuple(queries.shape)}, {tuple(icds.shape)}")
        r, captions = self._captions(split, queries, icds)
        acc = self._cider(split, queries.tolist(), captions)
        rel = (r["right"] * r["mention"]).sum(1) / r["mention"].sum(1)
        return {
            "prediction": captions,
            "acc": acc,
            "correct": acc >= self.cfg.correct_bar,
            "gt_prob": self._gt_prob(split, queries, r),
            "rel": rel,
        }

    @functools.cached_property
    def probes(self) -> CaptionProbes:
        """Probes fitted on the train split's embeddings and planted latents (fitted once)."""
        return CaptionProbes(self)

    # ------------------------------------------------------------------------------------------------------------------
    # The oracle and the observable ceiling

    def _template_cider(self, split: str, queries: Tensor) -> Tensor:
        """CIDEr-D of the all-right caption of each query in each style and length: (B,) -> (B, S, L+1) float64, the
        search's estimate of what a caption of that style and length can score (memoised per query)."""
        todo = [q for q in dict.fromkeys(queries.tolist()) if (split, q) not in self._templates]
        if todo:
            rows = torch.tensor(todo).repeat_interleave(len(STYLES) * (MAX_LENGTH + 1))  # (Q*S*(L+1),)
            style = torch.arange(len(STYLES)).repeat_interleave(MAX_LENGTH + 1).repeat(len(todo))
            named = torch.arange(MAX_LENGTH + 1).repeat(len(todo) * len(STYLES))
            mention = torch.zeros(len(rows), len(SLOTS), dtype=torch.bool)
            mention[:, COUNT] = mention[:, OBJECT] = True
            for r, slot in enumerate(SALIENCE):
                mention[:, slot] = named > r
            truth = self.latents[split]["truth"][rows]
            scores = self._cider(split, rows.tolist(), _render(style.tolist(), mention.tolist(), truth.tolist()))
            for q, t in zip(todo, scores.view(len(todo), len(STYLES), MAX_LENGTH + 1)):
                self._templates[split, q] = t
        return torch.stack([self._templates[split, q] for q in queries.tolist()])

    @functools.cached_property
    def _mean_template(self) -> Tensor:
        """`_template_cider` averaged over (up to) the first 500 train images: (S, L+1), what the observable search
        expects of a style and length, since no embedding holds a query's references."""
        return self._template_cider("train", torch.arange(min(500, self.cfg.num_train))).mean(0)

    def oracle(
        self, split: str, queries: Tensor, pools: Tensor, k: int, beam: int = 16, observable: bool = False
    ) -> Tensor:
        """The best ordered sequence of k distinct pool items for each query: (B,), (B, K) -> (B, k) train rows in
        PROMPT order; pool entries < 0 are padding. A beam search (`_search`) guided by an estimate of CIDEr-D, its
        `beam` final sequences then scored by the true CIDEr-D and the best returned: exact when beam >= the number of
        ordered k-sequences of the pool. observable=True: the search with what `probes` read off the embeddings in place
        of the latents, its best estimate returned (the query's references are in no embedding)."""
        num, _ = pools.shape
        valid = pools >= 0
        if k < 0 or (num and k > int(valid.sum(1).min())):
            raise ValueError(f"k={k} must be in [0, {int(valid.sum(1).min())}], the fewest valid candidates of a pool")
        if beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        chunk = 32  # queries searched at once: their (beam x pool) candidate sequences stay a few tens of MiB
        parts = [
            self._search(split, queries[c : c + chunk], pools[c : c + chunk], k, beam, observable)
            for c in range(0, num, chunk)
        ]
        return torch.cat(parts) if parts else pools[:, :k]

    def oracle_value(self, split: str, queries: Tensor, icds: Tensor, observable: bool = False) -> Tensor:
        """What `oracle` ranks whole sequences by, comparable across their lengths: (B,), (B, k) train rows in prompt
        order (k may be 0) -> (B,) float64, the caption's CIDEr-D; observable=True: the observable search's estimate
        of it (`_search`'s value under what `probes` read off the embeddings)."""
        if not observable:  # `score`'s acc, without the probabilities and shares it adds
            _, captions = self._captions(split, queries, icds)
            return self._cider(split, queries.tolist(), captions)
        r = self._reply(self._features(split, queries, icds, True), self._query(split, queries, True), icds.shape[1])
        wrong = ((1 - r["right"]) * r["mention"]).sum(-1)  # (B,) slots expected wrong
        return self._mean_template[r["style"], r["length"]] * WRONG_WORD_FACTOR**wrong

    def _search(self, split: str, queries: Tensor, pools: Tensor, k: int, beam: int, observable: bool) -> Tensor:
        """Beam search over ordered sequences of k distinct pool items, filled from the query backwards (the position
        next to it weighs most) and valued with the empty positions left out: the template CIDEr-D of the reply's style
        and length (`_template_cider`; observable: `_mean_template`) times WRONG_WORD_FACTOR per slot it gets wrong
        (expected, under observable features). (B,), (B, K) -> (B, k) train rows, prompt order."""
        num, pool_len = pools.shape
        valid, ids = pools >= 0, pools.clamp(min=0)  # (B, K)
        if k == 0:
            return ids[:, :0]
        feats = self._features(split, queries, ids, observable)  # (B, K, ...)
        query = self._query(split, queries, observable)
        template = self._mean_template.expand(num, -1, -1) if observable else self._template_cider(split, queries)
        state = {key: v[:, None] for key, v in self._start(num, not observable).items()}  # (B, M=1, ...)
        every = {key: v[:, None, None] for key, v in query.items()}  # (B, 1, 1, ...)
        rows, idx = torch.arange(num)[:, None, None], torch.arange(pool_len)
        w = self.position_weights(k)
        chosen = torch.zeros(num, 1, 0, dtype=torch.long)  # (B, M, t) pool indices of positions k-t .. k-1
        alive = torch.ones(num, 1, dtype=torch.bool)  # (B, M) beam entries that are sequences
        for t in range(k):
            m = chosen.shape[1]
            # Position k-1-t gets each candidate, after every beam entry: (B, M, K, ...); it sits before the positions
            # filled so far, so it wins equal pulls.
            grown = self._add(
                {key: v[:, :, None] for key, v in state.items()},
                {key: v[:, None] for key, v in feats.items()},
                w[k - 1 - t].expand(num, 1, 1),
                True,
            )
            r = self._finish(grown, every, k)
            wrong = ((1 - r["right"]) * r["mention"]).sum(-1)  # (B, M, K)
            v = template[rows, r["style"], r["length"]] * WRONG_WORD_FACTOR**wrong  # (B, M, K) estimated CIDEr-D
            taken = (chosen[:, :, :, None] == idx).any(2)  # (B, M, K)
            v = v.masked_fill(taken | ~valid[:, None] | ~alive[..., None], -math.inf)
            top = v.flatten(1).topk(min(beam, m * pool_len), dim=1)  # (B, M')
            parent, pick = top.indices // pool_len, top.indices % pool_len  # (B, M'), (B, M')
            alive = top.values > -math.inf
            chosen = torch.cat([pick[..., None], chosen.gather(1, parent[..., None].expand(-1, -1, t))], dim=2)
            grown = {key: v.expand(num, m, pool_len, *v.shape[3:]).flatten(1, 2) for key, v in grown.items()}
            state = {key: v[torch.arange(num)[:, None], top.indices] for key, v in grown.items()}  # (B, M', ...)
        if observable:  # its best estimate: nothing observable scores a caption against the query's references
            return ids.gather(1, chosen[:, 0])
        m = chosen.shape[1]
        rows = ids.gather(1, chosen.flatten(1)).view(num * m, k)  # (B*M, k)
        _, captions = self._captions(split, queries.repeat_interleave(m), rows)
        cider = self._cider(split, queries.repeat_interleave(m).tolist(), captions)
        best = cider.view(num, m).masked_fill(~alive, -math.inf).argmax(1)  # (B,) the first of equal scores
        return rows.view(num, m, k)[torch.arange(num), best]


class CaptionProbes:
    """What the embeddings reveal about the planted latents, fitted on the train split in float64 (as sim.Probes):
    linear discriminant analysis for topic and main object (image view) and for the shown caption's style (text
    view), ridge regressions for its length (text view) and for its quality from a CLIP-like score, the cosine of its
    image and text views (wrong words point away from the picture). Population rates from the train split stand for
    what no embedding tells: how often a caption names each slot, and how often two pictures share a slot's value
    when they share their topic or not."""

    def __init__(self, sim: CaptionSimulator):
        lat = sim.latents["train"]
        image, text = sim.emb["train_image"].double(), sim.emb["train_text"].double()
        topic = _lda(image, lat["topic"], NUM_TOPICS)
        obj = _lda(image, lat["truth"][:, OBJECT], len(OBJECT_WORDS))
        clip = (image * text).sum(-1, keepdim=True)  # (N, 1)
        quality = _ridge(clip, lat["quality"].double())
        style = _lda(text, lat["style"], len(STYLES))
        length = _ridge(text, lat["length"].double())
        self.split: dict[str, dict[str, Tensor]] = {}
        for split in SPLITS:
            t = topic(sim.emb[f"{split}_image"].double())  # (N, T)
            self.split[split] = {
                "topic": t,
                "supertopic": t.view(len(t), len(SUPERTOPICS), SCENES_PER_SUPERTOPIC).sum(-1),  # (N, 8)
                "object": obj(sim.emb[f"{split}_image"].double()),  # (N, O)
            }
        self.split["train"] |= {"quality": quality(clip), "style": style(text), "length": length(text)}
        self.mention_rate = lat["mention"].double().mean(0)  # (J,)
        # P(two pictures share slot j's value | same topic), and | different topics, over ordered pairs of train images
        n, topics = len(lat["topic"]), lat["topic"]
        per_topic = torch.bincount(topics, minlength=NUM_TOPICS).double()  # (T,)
        same_pairs, other_pairs = (per_topic * (per_topic - 1)).sum(), n * n - (per_topic**2).sum()
        same, other = [], []
        for j, vocab in enumerate(WORDS):
            both = torch.zeros(NUM_TOPICS, len(vocab), dtype=torch.float64)
            both.index_put_((topics, lat["truth"][:, j]), torch.ones(n, dtype=torch.float64), accumulate=True)
            same.append((both * (both - 1)).sum() / same_pairs.clamp_min(1))
            other.append((both.sum(0) ** 2 - (both**2).sum(0)).sum() / other_pairs.clamp_min(1))
        self.equal_same_topic, self.equal_other_topic = torch.stack(same), torch.stack(other)  # (J,), (J,)

    def read(self, split: str, rows: Tensor) -> dict[str, Tensor]:
        """The posteriors and estimates of the items `rows` (any shape) of `split`."""
        return {key: v[rows] for key, v in self.split[split].items()}


# ---------------------------------------------------------------------------------------------------------------------
# Calibration


def calibrate_caption(sim: CaptionSimulator, pool_size: int = 64, shots: int = 8, seed: int = 0) -> dict:
    """The caption world against its calibration targets, CIDEr-D x 100 over the val queries, each with its own random
    pool: "zero_shot", and per k in 1..shots "random_k" (the first k of a random sequence), "similar_k" (the k most
    image-similar, the most similar next to the query: RICES), "oracle_k" and "observable_k" (`oracle`)."""
    gen = torch.Generator().manual_seed(seed)
    ids = {split: torch.tensor([it["image_id"] for it in sim.items[split]]) for split in SPLITS}
    queries = torch.arange(len(ids["val"]))  # (V,)
    val_pools = pools.query_pools("random", pool_size, {}, ids, "val", queries, torch.full_like(queries, -1), gen)
    full = torch.ones_like(val_pools, dtype=torch.bool)  # (V, K)
    rand_seq = val_pools.gather(1, pools.random_sequences(full, 1, shots, gen)[:, 0])  # (V, S)
    ranking = pools.pool_ranking(sim.emb["val"], sim.emb["train"], val_pools)  # (V, K)
    similar = val_pools.gather(1, ranking[:, :shots])  # (V, S) most similar first

    def cider(icds: Tensor) -> float:
        return 100 * sim.score("val", queries, icds)["acc"].mean().item()

    out = {"zero_shot": cider(val_pools[:, :0])}
    for k in range(1, shots + 1):
        out[f"random_{k}"] = cider(rand_seq[:, :k])
        out[f"similar_{k}"] = cider(similar[:, :k].flip(1))
        out[f"oracle_{k}"] = cider(sim.oracle("val", queries, val_pools, k))
        out[f"observable_{k}"] = cider(sim.oracle("val", queries, val_pools, k, observable=True))
    return out


def caption_calibration_table(cal: dict, shots: int) -> str:
    """`calibrate_caption`'s numbers as a Markdown table (rows: demonstrations, columns: shots) and a zero-shot line."""
    rows = ["| ICDs | " + " | ".join(f"{k}-shot" for k in range(1, shots + 1)) + " |", "|---|" + "---|" * shots]
    names = (
        ("random", "random"),
        ("similar", "most image-similar (RICES)"),
        ("observable", "observable"),
        ("oracle", "oracle"),
    )
    for name, label in names:
        rows.append(f"| {label} | " + " | ".join(f"{cal[f'{name}_{k}']:.2f}" for k in range(1, shots + 1)) + " |")
    rows.append(f"\nzero-shot: {cal['zero_shot']:.2f} (CIDEr-D x 100, document frequencies of the train references)")
    return "\n".join(rows)
