"""A seeded, deterministic simulated "LVLM + VQA dataset" with a planted, known optimum.

The selection algorithms need a testbed where the right answer is known. `Simulator` holds a train split (the ICD source
and the anchor queries) and a val split of synthetic VQA items with CLIP-like embeddings, and answers a query given an
ordered sequence of ICDs, instantly. Per item: one of 40 topics in 8 supertopics (1-3 questions share an image), an
answer type, an ICD quality ~ N(0, 1) and a misleading flag; per query: a difficulty, a sensitivity > 0 and an answer
threshold. Each world's answer model (WORLDS, presets of SimConfig) and its equations: docs/worlds.md.

What a selector can learn from the embeddings: topic (noisy, in both views), answer type (text view) and noisy read-outs
of quality and of the misleading flag (text view), never which answer an ICD shows. Cosine similarity uses topic and
type but is blind to quality and walks into misleading same-topic items, so a trained selector has room above it; the
oracle bounds that room.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from icl_select import pools
from icl_select.vqa import answer_rel, vqa_score

__all__ = ["SimConfig", "Simulator", "WORLDS", "world_config", "parse_settings", "calibrate", "SPLITS", "ANSWER_TYPES"]

SPLITS: tuple[str, ...] = ("train", "val")
ANSWER_TYPES: tuple[str, ...] = ("yes/no", "number", "color", "other")

# Supertopic -> (scenes = its topics, objects seen there). Topic t is scene t % 5 of supertopic t // 5.
SUPERTOPICS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (
        ("kitchen", "dining room", "bakery", "restaurant", "cafe"),
        ("plate", "cup", "bowl", "spoon", "fork", "oven", "sandwich", "cake", "pizza", "banana"),
    ),
    (
        ("street", "parking lot", "bus stop", "intersection", "sidewalk"),
        ("car", "bus", "truck", "traffic light", "bicycle", "motorcycle", "stop sign", "fire hydrant", "van", "taxi"),
    ),
    (
        ("tennis court", "baseball field", "ski slope", "skate park", "soccer field"),
        ("ball", "racket", "bat", "helmet", "skateboard", "snowboard", "frisbee", "glove", "net", "goal"),
    ),
    (
        ("farm", "zoo", "pasture", "savanna", "barn"),
        ("horse", "cow", "goat", "giraffe", "elephant", "zebra", "dog", "bird", "fence", "tractor"),
    ),
    (
        ("living room", "bedroom", "bathroom", "office", "hallway"),
        ("couch", "bed", "chair", "lamp", "television", "laptop", "clock", "vase", "mirror", "rug"),
    ),
    (
        ("beach", "park", "mountain", "lake", "forest"),
        ("tree", "bench", "kite", "umbrella", "boat", "rock", "surfboard", "tent", "dog", "bird"),
    ),
    (
        ("airport", "train station", "harbor", "runway", "platform"),
        ("airplane", "train", "suitcase", "ship", "backpack", "sign", "clock", "bench", "cart", "flag"),
    ),
    (
        ("market", "grocery store", "plaza", "shop", "rooftop"),
        ("basket", "orange", "apple", "umbrella", "cart", "flag", "bottle", "box", "carrot", "bag"),
    ),
)
SCENES_PER_SUPERTOPIC = 5
NUM_TOPICS = len(SUPERTOPICS) * SCENES_PER_SUPERTOPIC
OBJECTS_PER_SUPERTOPIC = 10
COLORS: tuple[str, ...] = (
    "red",
    "blue",
    "green",
    "yellow",
    "white",
    "black",
    "brown",
    "gray",
    "orange",
    "pink",
    "purple",
)
MAX_COUNT = 8  # number answers are 0..MAX_COUNT
YES_NO_MINORITY: tuple[str, ...] = ("maybe", "not sure")
TEMPLATES: tuple[tuple[str, ...], ...] = (
    (
        "Is there {a_obj} in the {scene}?",
        "Is the {obj} {color}?",
        "Are there any {objs} in this picture?",
        "Is this picture taken at {a_scene}?",
    ),
    ("How many {objs} are in the {scene}?", "How many {objs} can you see?", "How many {objs} are in this photo?"),
    ("What color is the {obj}?", "What is the color of the {obj} in the {scene}?", "What color is the {obj} here?"),
    (
        "What is next to the {obj}?",
        "What is on the {obj} in the {scene}?",
        "What is the person near the {obj} holding?",
    ),
)
NUM_ANNOTATORS = 10
MIN_MAJORITY = 3  # majority_count_probs[i] is the probability of MIN_MAJORITY + i agreeing annotators
# Answer regimes: the columns of the per-query answer tables (majority, band minority, near miss, far miss).
MAJORITY, MINORITY, NEAR_MISS, FAR_MISS = range(4)


@dataclass(frozen=True)
class SimConfig:
    """Every parameter of the simulator (lengths in unit-free embedding norms, effects in logit units); a world is a set
    of their values (`world_config`)."""

    world: str = "additive"
    """The WORLDS preset these values started from (a label: the values alone decide the answers)."""
    seed: int = 0
    """Seed of the one torch.Generator behind every draw (same seed -> bitwise identical simulator)."""
    dim: int = 512
    """Embedding size (CLIP ViT-B/32 is 512)."""
    num_train: int = 5000
    """Train questions: the ICD source and the RL anchor queries."""
    num_val: int = 1200
    """Val questions: the evaluation queries (their images are disjoint from train's)."""
    image_group_probs: tuple[float, ...] = (0.45, 0.35, 0.20)
    """Probability that an image carries 1, 2, 3, ... questions."""
    answer_type_probs: tuple[float, float, float, float] = (0.38, 0.12, 0.15, 0.35)
    """Probabilities of the answer types yes/no, number, color, other (VQAv2-like)."""
    majority_count_probs: tuple[float, ...] = (0.04, 0.05, 0.06, 0.07, 0.09, 0.12, 0.17, 0.40)
    """Probability that 3, 4, ..., 10 of the 10 annotators give the majority answer (yes/no: at least 6)."""
    supertopic_share: float = 0.35
    """Share of a topic direction (in squared norm) that is its supertopic's direction."""
    image_topic: float = 1.0
    """Norm of the topic direction in the image view."""
    image_noise: float = 1.6
    """Norm of the isotropic per-image noise in the image view."""
    text_topic: float = 0.4
    """Norm of the topic direction in the text view."""
    text_type: float = 0.8
    """Norm of the answer-type direction in the text view."""
    text_quality: float = 0.45
    """Scale of the (noisy) quality read-out along a fixed direction of the text view."""
    text_misleading: float = 0.6
    """Scale of the (noisy) misleading-flag read-out along another fixed direction of the text view."""
    readout_noise: float = 1.0
    """Std of the noise on quality and the misleading flag before they enter the text view."""
    text_noise: float = 1.0
    """Norm of the isotropic per-question noise in the text view."""
    difficulty_mean: float = 0.1
    """Mean of the per-query difficulty (the zero-shot logit before the threshold)."""
    difficulty_std: float = 1.7
    """Std of the per-query difficulty; large, so that most queries do not depend on their ICDs."""
    threshold_std: float = 0.3
    """Std of the per-query answer threshold in logit space (around 0, i.e. sigmoid threshold around 0.5)."""
    sensitivity_log_mean: float = 0.1
    """Mean of log sensitivity (how strongly a query's answer reacts to its ICDs)."""
    sensitivity_log_std: float = 0.6
    """Std of log sensitivity."""
    help_base: float = -0.06
    """Helpfulness of an unrelated ICD (a distraction: slightly negative)."""
    help_topic: float = 0.55
    """Extra helpfulness of a same-topic ICD of average quality."""
    help_topic_quality: float = 0.8
    """How much a same-topic ICD's help grows per unit of its quality."""
    help_supertopic: float = 0.1
    """Affinity of an ICD from another topic of the query's supertopic (1 = same topic)."""
    help_type: float = 0.15
    """Extra helpfulness of an ICD with the query's answer type (it shows the answer format)."""
    help_quality: float = 0.12
    """Topic-independent helpfulness per unit of ICD quality."""
    misleading_frac: float = 0.18
    """Share of items whose answers mislead (wrong/odd labels)."""
    help_misleading: float = 1.0
    """A misleading ICD's topical term is -help_misleading (it hurts same-topic queries most)."""
    position_decay: float = 0.8
    """Weight of position i of k is position_decay ** (k - i): the ICD next to the query weighs 1."""
    shot_cost: float = 0.015
    """Logit cost per shot (longer prompts distract)."""
    redundancy_weight: float = 1.5
    """Penalty for a pair of identical ICDs (scaled down linearly to 0 at the redundancy threshold)."""
    redundancy_threshold: float = 0.5
    """Fused-embedding cosine above which two ICDs count as near-duplicates (same-image pairs mostly are)."""
    band: float = 0.35
    """Width (logit units) of the band above the threshold where a minority answer comes out."""
    near_miss: float = 1.0
    """Width below the threshold where the wrong answer is a near miss (higher rel) rather than a far one."""
    copy_weight: float = 0.0
    """copy: pull towards the answer of a fully resembling ICD next to the query (0 = never copies)."""
    copy_question: float = 0.5
    """copy: resemblance of an ICD of the query's answer type on an unrelated topic (1 = same topic)."""
    gain_decay: float = 1.0
    """saturating: the r-th largest helpful effect weighs gain_decay ** r (1 = additive, 0 = best only)."""
    help_pair: float = 0.0
    """saturating: extra help of an ICD of the query's answer type plus a clean one on its topic."""
    primacy: float = 0.0
    """order: extra weight of the first of k > 1 positions (with recency, a U shape; 0 = recency only)."""
    neighbour: float = 0.0
    """order: each two adjacent ICDs add neighbour times the smaller of their two helpfulnesses."""

    def __post_init__(self):
        check_config(
            self,
            WORLDS,
            RANGES,
            lengths={"answer_type_probs": len(ANSWER_TYPES), "majority_count_probs": NUM_ANNOTATORS - MIN_MAJORITY + 1},
            weights=("image_group_probs", "answer_type_probs", "majority_count_probs"),
        )

    @property
    def additive(self) -> bool:
        """Whether the answer model is additive over ICDs (every term of the other worlds off)."""
        return (self.copy_weight, self.gain_decay, self.help_pair, self.primacy, self.neighbour) == (0, 1, 0, 0, 0)


# Allowed values per parameter (each entry of a tuple), as intervals; one not listed takes any finite number.
RANGES: dict[str, str] = {
    "dim": "[1, inf)",
    "num_train": "[1, inf)",
    "num_val": "[1, inf)",
    "image_group_probs": "[0, 1]",
    "answer_type_probs": "[0, 1]",
    "majority_count_probs": "[0, 1]",
    "supertopic_share": "[0, 1]",
    **dict.fromkeys(
        ("image_topic", "image_noise", "text_topic", "text_type", "text_quality", "text_misleading"), "[0, inf)"
    ),
    **dict.fromkeys(("readout_noise", "text_noise", "difficulty_std", "threshold_std"), "[0, inf)"),
    "sensitivity_log_std": "[0, inf)",
    "misleading_frac": "[0, 1]",
    "position_decay": "(0, inf)",
    "redundancy_weight": "[0, inf)",
    "redundancy_threshold": "[0, 1)",
    "band": "[0, inf)",
    "near_miss": "[0, inf)",
    "copy_weight": "[0, inf)",
    "copy_question": "[0, 1]",
    "gain_decay": "[0, 1]",
    "help_pair": "[0, inf)",
    "primacy": "[0, inf)",
}


def _inside(value: float, interval: str) -> bool:
    """Whether a finite `value` lies in an interval written "[lo, hi)" (brackets closed, parentheses open)."""
    if not math.isfinite(value):
        return False
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    return (lo <= value if interval[0] == "[" else lo < value) and (value <= hi if interval[-1] == "]" else value < hi)


def check_config(cfg, worlds, ranges: dict[str, str], lengths: dict[str, int], weights: tuple[str, ...]) -> None:
    """Refuse a world config in one line: its world not among `worlds`, a value (each entry of a tuple) outside its
    interval in `ranges` (any finite number where none is listed), a tuple of another length than `lengths` says, or
    probability weights (`weights`) that do not sum to a positive number."""
    kind = type(cfg).__name__
    if cfg.world not in worlds:
        raise ValueError(f"{kind}.world must be one of {', '.join(worlds)}, got {cfg.world!r}")
    for name in (f.name for f in dataclasses.fields(cfg) if f.name != "world"):
        value, interval = getattr(cfg, name), ranges.get(name, "(-inf, inf)")
        for v in value if isinstance(value, tuple) else (value,):
            if not _inside(v, interval):
                raise ValueError(f"{kind}.{name} must be in {interval}, got {value}")
    for name, n in lengths.items():
        if len(getattr(cfg, name)) != n:
            raise ValueError(f"{kind}.{name} needs {n} entries, got {len(getattr(cfg, name))}")
    for name in weights:
        if not sum(getattr(cfg, name)) > 0:
            raise ValueError(f"{kind}.{name} must have a positive sum, got {getattr(cfg, name)}")


# World name -> the parameters it sets (every other one keeps SimConfig's default). docs/worlds.md: what each mirrors.
WORLDS: dict[str, dict[str, float]] = {
    "additive": {},
    "copy": {"copy_weight": 5.0},
    "saturating": {"gain_decay": 0.3, "help_pair": 0.6, "help_type": 0.05, "help_topic": 0.3},
    "strong": {"difficulty_mean": 1.0, "help_base": -0.15, "help_topic": 0.1, "help_quality": 0.2},
    "order": {"primacy": 0.6, "neighbour": 0.3},
    "harmful": {
        "difficulty_mean": 1.0,
        "help_base": -0.22,
        "help_topic": 0.25,
        "help_quality": 0.0,
        "copy_weight": 2.2,
    },
}


def world_config(world: str = "additive", **overrides) -> SimConfig:
    """The SimConfig of a world: its preset, then `overrides` (any SimConfig field but `world`) on top."""
    if world not in WORLDS:
        raise ValueError(f"unknown world {world!r}; the worlds are {', '.join(WORLDS)}")
    return SimConfig(world=world, **{**WORLDS[world], **overrides})


def parse_settings(pairs: list[str], config: type = SimConfig) -> dict:
    """FIELD=VALUE strings -> overrides of a world config (SimConfig, or sim_caption's CaptionConfig), each VALUE read
    as its field's type (a tuple as a comma list); the ranges are the config's to check."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    where = f"{config.__module__.rpartition('.')[2]}.{config.__name__}"
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{pair!r} is not FIELD=VALUE")
        if name not in fields:
            raise ValueError(f"{pair!r}: {name!r} is not a parameter of {where}")
        if name in FLAGGED:
            raise ValueError(f"{pair!r}: set {name} with --{FLAGGED[name]}, not as a parameter")
        kind = type(fields[name].default)
        try:
            out[name] = tuple(float(x) for x in text.split(",")) if kind is tuple else kind(text)
        except ValueError:
            what = "a comma list of numbers" if kind is tuple else "an integer" if kind is int else "a number"
            raise ValueError(f"{pair!r}: {name} takes {what}, got {text!r}") from None
    return out


# SimConfig fields that gen_rl_data.py sets with flags of their own.
FLAGGED = {"world": "world", "seed": "seed", "num_train": "num-train", "num_val": "num-val"}


def _unit(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Random unit vectors along the last axis (nearly orthogonal to each other in high dimension)."""
    return F.normalize(torch.randn(shape, generator=gen), dim=-1)


def _plural(word: str) -> str:
    return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")


def _answer_set(qtype: int, draw: dict[str, int]) -> tuple[str, list[str], str, str]:
    """The majority answer, up to 4 distinct minority candidates, a near miss and a far miss for one question; no wrong
    answer coincides with a credited one, so their VQA accuracy is 0."""
    if qtype == 0:
        gt = "yes" if draw["yes"] else "no"
        wrong = "no" if draw["yes"] else "yes"
        return gt, list(YES_NO_MINORITY), wrong, wrong
    if qtype == 1:
        n = draw["number"]
        # Other counts ordered by distance from the truth: the closest is the near miss, the farthest the far one.
        others = sorted((x for x in range(MAX_COUNT + 1) if x != n), key=lambda x: (abs(x - n), x))
        return str(n), [str(x) for x in others[1:5]], str(others[0]), str(others[-1])
    if qtype == 2:
        c = draw["color"]
        far = (c + draw["offset"]) % len(COLORS)
        minority = [COLORS[(far + j) % len(COLORS)] for j in range(1, 5)]
        return COLORS[c], minority, f"light {COLORS[c]}", COLORS[far]
    objects = SUPERTOPICS[draw["super"]][1]
    gt = objects[draw["answer_obj"]]
    minority = [objects[(draw["answer_obj"] + j) % OBJECTS_PER_SUPERTOPIC] for j in range(1, 5)]
    far_objects = SUPERTOPICS[(draw["super"] + draw["offset"] % (len(SUPERTOPICS) - 1) + 1) % len(SUPERTOPICS)][1]
    far = next(o for o in far_objects[draw["answer_obj"] :] + far_objects if o not in objects)
    return gt, minority, _plural(gt), far


def _official_acc(count: int) -> float:
    """VQA accuracy of an answer given by `count` of the 10 annotators (leave-one-out average)."""
    return vqa_score("a", ["a"] * count + ["b"] * (NUM_ANNOTATORS - count))


def _directions(cfg: SimConfig, gen: torch.Generator) -> dict[str, Tensor]:
    """The fixed embedding directions shared by both splits: topic (T, d), answer type (4, d), quality, misleading."""
    d, share = cfg.dim, cfg.supertopic_share
    super_dir = _unit((len(SUPERTOPICS), d), gen)  # (8, d)
    own_dir = _unit((NUM_TOPICS, d), gen)  # (T, d)
    # Topics of one supertopic share a component, so cosine similarity also ranks related topics above others.
    topic = F.normalize(
        math.sqrt(share) * super_dir.repeat_interleave(SCENES_PER_SUPERTOPIC, 0) + math.sqrt(1 - share) * own_dir,
        dim=-1,
    )  # (T, d)
    answer_type = _unit((len(ANSWER_TYPES), d), gen)  # (4, d)
    quality, misleading = _unit((2, d), gen)  # (d,), (d,)
    return {"topic": topic, "answer_type": answer_type, "quality": quality, "misleading": misleading}


def _draw_latents(cfg: SimConfig, gen: torch.Generator, n: int, first_image: int) -> dict[str, Tensor]:
    """The planted per-question latents of one split of n questions, (N,) each (see `Simulator.latents`)."""
    # Images: groups of 1..3 consecutive questions sharing an image (and so its topic and its image view).
    sizes = torch.multinomial(torch.tensor(cfg.image_group_probs), n, replacement=True, generator=gen) + 1  # (n,)
    num_images = int((sizes.cumsum(0) < n).sum()) + 1
    sizes = sizes[:num_images]  # (I,)
    image_of = torch.arange(num_images).repeat_interleave(sizes)[:n]  # (N,)
    image_topic = torch.randint(NUM_TOPICS, (num_images,), generator=gen)  # (I,)
    topic = image_topic[image_of]  # (N,)
    answer_type = torch.multinomial(torch.tensor(cfg.answer_type_probs), n, replacement=True, generator=gen)  # (N,)
    quality = torch.randn(n, generator=gen)  # (N,)
    misleading = torch.rand(n, generator=gen) < cfg.misleading_frac  # (N,)
    # Stratified normal draws (one per quantile bin, randomly assigned): accuracies then vary little with the seed,
    # because the share of easy and hard queries is fixed rather than sampled.
    strata = (torch.randperm(n, generator=gen) + torch.rand(n, generator=gen)) / n  # (N,) in (0, 1)
    difficulty = cfg.difficulty_mean + cfg.difficulty_std * torch.special.ndtri(strata)  # (N,)
    log_sensitivity = cfg.sensitivity_log_mean + cfg.sensitivity_log_std * torch.randn(n, generator=gen)  # (N,)
    threshold = cfg.threshold_std * torch.randn(n, generator=gen)  # (N,)
    majority = MIN_MAJORITY + torch.multinomial(
        torch.tensor(cfg.majority_count_probs), n, replacement=True, generator=gen
    )  # (N,)
    # yes/no has only two minority answers ("maybe", "not sure") of at most 2 annotators each.
    majority = torch.where(answer_type == 0, majority.clamp(min=NUM_ANNOTATORS - 4), majority)  # (N,)
    return {
        "topic": topic,
        "supertopic": topic // SCENES_PER_SUPERTOPIC,
        "answer_type": answer_type,
        "quality": quality,
        "misleading": misleading,
        "difficulty": difficulty,
        "sensitivity": log_sensitivity.exp(),
        "threshold": threshold,
        "majority_count": majority,
        "image_id": first_image + image_of,
        # VQAv2-style question ids: image_id * 1000 + the question's slot on its image.
        "question_id": (first_image + image_of) * 1000 + torch.arange(n) - (sizes.cumsum(0) - sizes)[image_of],
    }


def _embed(
    cfg: SimConfig, gen: torch.Generator, latents: dict[str, Tensor], directions: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """CLIP-like image and text views of one split, (N, d) each, L2-normalised."""
    n, d = latents["topic"].shape[0], cfg.dim
    image_id = latents["image_id"]
    first_of_image = torch.ones(n, dtype=torch.bool)  # (N,)
    first_of_image[1:] = image_id[1:] != image_id[:-1]
    # One noise draw per image, shared by its questions: they show the same picture.
    image_noise = torch.randn(int(first_of_image.sum()), d, generator=gen) / math.sqrt(d)  # (I, d)
    image_view = (
        cfg.image_topic * directions["topic"][latents["topic"]]
        + cfg.image_noise * image_noise[first_of_image.cumsum(0) - 1]
    )  # (N, d)
    quality_read = latents["quality"] + cfg.readout_noise * torch.randn(n, generator=gen)  # (N,)
    misleading_read = latents["misleading"].float() + cfg.readout_noise * torch.randn(n, generator=gen)  # (N,)
    text_view = (
        cfg.text_topic * directions["topic"][latents["topic"]]
        + cfg.text_type * directions["answer_type"][latents["answer_type"]]
        + cfg.text_quality * quality_read[:, None] * directions["quality"]
        + cfg.text_misleading * misleading_read[:, None] * directions["misleading"]
        + cfg.text_noise * torch.randn(n, d, generator=gen) / math.sqrt(d)
    )  # (N, d)
    return F.normalize(image_view, dim=-1), F.normalize(text_view, dim=-1)


def _with_article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _write_items(
    gen: torch.Generator, latents: dict[str, Tensor], rel_cache: dict[tuple[str, tuple[str, ...]], float]
) -> tuple[list[dict], list[tuple[str, ...]], Tensor, Tensor]:
    """Question/answer strings of one split and, per question, the answer, VQA acc and rel of each regime: items,
    predictions (N rows of 4 strings), acc (N, 4), rel (N, 4). `rel_cache` memoises `answer_rel`."""
    n = latents["topic"].shape[0]
    # Word choices drawn as tensors (so only the generator decides them), then assembled per question.
    words = {
        "template": torch.randint(12, (n,), generator=gen),  # 12 is a multiple of every template count
        "obj": torch.randint(OBJECTS_PER_SUPERTOPIC, (n,), generator=gen),
        "answer_obj": torch.randint(1, OBJECTS_PER_SUPERTOPIC, (n,), generator=gen),
        "color": torch.randint(len(COLORS), (n,), generator=gen),
        "number": torch.randint(MAX_COUNT + 1, (n,), generator=gen),
        "yes": torch.randint(2, (n,), generator=gen),
        "offset": torch.randint(1, len(COLORS) - 4, (n,), generator=gen),
    }
    annotator_order = torch.rand(n, NUM_ANNOTATORS, generator=gen).argsort(dim=1).tolist()  # (N, 10)
    columns = {k: v.tolist() for k, v in words.items()}
    topics, types, majorities = (latents[k].tolist() for k in ("topic", "answer_type", "majority_count"))
    question_ids, image_ids = latents["question_id"].tolist(), latents["image_id"].tolist()
    acc_by_count = [_official_acc(c) for c in range(NUM_ANNOTATORS + 1)]
    items, predictions, acc, rel = [], [], [], []
    for i in range(n):
        draw = {k: v[i] for k, v in columns.items()} | {"super": topics[i] // SCENES_PER_SUPERTOPIC}
        # An "other" answer object differs from the asked-about object (answer_obj was drawn as an offset >= 1).
        draw["answer_obj"] = (draw["obj"] + draw["answer_obj"]) % OBJECTS_PER_SUPERTOPIC
        scenes, objects = SUPERTOPICS[draw["super"]]
        scene, obj = scenes[topics[i] % SCENES_PER_SUPERTOPIC], objects[draw["obj"]]
        templates = TEMPLATES[types[i]]
        question = templates[draw["template"] % len(templates)].format(
            obj=obj,
            a_obj=_with_article(obj),
            objs=_plural(obj),
            a_scene=_with_article(scene),
            scene=scene,
            color=COLORS[draw["color"]],
        )
        gt, minority, near, far = _answer_set(types[i], draw)
        # The dissenting annotators pair up over the minority answers (2, 2, ..., then maybe 1), so no minority
        # answer ties the majority and each minority answer scores 0.6 or 0.3.
        dissent = [minority[j // 2] for j in range(NUM_ANNOTATORS - majorities[i])]
        given = [gt] * majorities[i] + dissent
        answers = [given[j] for j in annotator_order[i]]
        row = (gt, minority[0] if dissent else near, near, far)
        key = tuple(sorted(set(answers)))
        for pred in row:
            if (pred, key) not in rel_cache:
                rel_cache[pred, key] = answer_rel(pred, answers)
        items.append(
            {"question_id": question_ids[i], "image_id": image_ids[i], "question": question, "answers": answers}
        )
        predictions.append(row)
        acc.append([acc_by_count[answers.count(p)] for p in row])
        rel.append([rel_cache[p, key] for p in row])
    return items, predictions, torch.tensor(acc, dtype=torch.float32), torch.tensor(rel, dtype=torch.float32)


class Simulator:
    """Synthetic VQA splits with embeddings, and a deterministic simulated LVLM over them.

    Attributes:
        cfg: the SimConfig.
        items: "train", "val" -> list of {"question_id", "image_id", "question", "answers" (10 str)}.
        emb: "train", "val" -> fused (N, d) float32 L2-normalised embeddings (the selector's input);
             "<split>_image", "<split>_text" -> the two L2-normalised views; fused = norm(image + text).
        latents: split -> planted per-item latents, (N,) tensors: "topic", "supertopic", "answer_type" (index
             into ANSWER_TYPES), "quality", "misleading" (bool), "difficulty", "sensitivity", "threshold" (logit
             space), "majority_count" (annotators giving the majority answer), and "image_id", "question_id" (as
             in `items`, for vectorised exclusion masks)."""

    def __init__(self, cfg: SimConfig = SimConfig()):  # noqa: B008  (frozen, so sharing the default is safe)
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        directions = _directions(cfg, gen)
        self.items: dict[str, list[dict]] = {}
        self.emb: dict[str, Tensor] = {}
        self.latents: dict[str, dict[str, Tensor]] = {}
        # Per split, one row per query and one column per answer regime (majority, band, near miss, far miss): the
        # answer given, its VQA acc and its rel. Precomputed so that scoring is a gather.
        self._predictions: dict[str, list[tuple[str, ...]]] = {}
        self._acc: dict[str, Tensor] = {}
        self._rel: dict[str, Tensor] = {}
        rel_cache: dict[tuple[str, tuple[str, ...]], float] = {}
        first_image = 1
        for split, n in (("train", cfg.num_train), ("val", cfg.num_val)):
            latents = _draw_latents(cfg, gen, n, first_image)
            image_view, text_view = _embed(cfg, gen, latents, directions)
            self.latents[split] = latents
            self.emb[f"{split}_image"] = image_view
            self.emb[f"{split}_text"] = text_view
            self.emb[split] = F.normalize(image_view + text_view, dim=-1)  # (N, d)
            self.items[split], self._predictions[split], self._acc[split], self._rel[split] = _write_items(
                gen, latents, rel_cache
            )
            first_image = int(latents["image_id"][-1]) + 1

    # ------------------------------------------------------------------------------------------------------------------
    # The answer model

    def position_weights(self, k: int) -> Tensor:
        """Weight of each prompt position for k shots, (k,): recency (the last, next to the query, weighs 1), and
        with primacy a U shape."""
        decay = self.cfg.position_decay
        w = decay ** torch.arange(k - 1, -1, -1, dtype=torch.float32)  # (k,)
        if self.cfg.primacy and k > 1:  # the first of several ICDs weighs more too (a U shape)
            w = w + self.cfg.primacy * (torch.arange(k) == 0)  # (k,)
        return w

    def helpfulness(self, split: str, queries: Tensor, icds: Tensor) -> Tensor:
        """h(query, icd) for each query and each of its ICDs: (B,), (B, k) train-row ids -> (B, k)."""
        cfg, q, c = self.cfg, self.latents[split], self.latents["train"]
        same_topic = q["topic"][queries][:, None] == c["topic"][icds]  # (B, k)
        same_super = q["supertopic"][queries][:, None] == c["supertopic"][icds]  # (B, k)
        same_type = q["answer_type"][queries][:, None] == c["answer_type"][icds]  # (B, k)
        affinity = torch.where(same_topic, 1.0, torch.where(same_super, cfg.help_supertopic, 0.0))  # (B, k)
        quality = c["quality"][icds]  # (B, k)
        topical = torch.where(
            c["misleading"][icds], -cfg.help_misleading, cfg.help_topic + cfg.help_topic_quality * quality
        )  # (B, k)
        return cfg.help_base + affinity * topical + cfg.help_type * same_type + cfg.help_quality * quality  # (B, k)

    def expected_helpfulness(self, split: str, queries: Tensor, icds: Tensor) -> Tensor:
        """E[h(query, icd)] under the latents `Probes` read off the fused embeddings, query and ICD posteriors taken as
        independent: (B,), (B, k) -> (B, k)."""
        cfg, probes = self.cfg, self.probes
        q, c = probes.read(split, queries), probes.read("train", icds)
        same_topic = (q["topic"][:, None] * c["topic"]).sum(-1)  # (B, k)
        same_super = (q["supertopic"][:, None] * c["supertopic"]).sum(-1)  # (B, k)
        same_type = (q["answer_type"][:, None] * c["answer_type"]).sum(-1)  # (B, k)
        affinity = same_topic + cfg.help_supertopic * (same_super - same_topic)  # (B, k)
        quality, misleading = c["quality"], c["misleading"]  # (B, k)
        topical = -cfg.help_misleading * misleading + (1 - misleading) * (
            cfg.help_topic + cfg.help_topic_quality * quality
        )  # (B, k)
        h = cfg.help_base + affinity * topical + cfg.help_type * same_type + cfg.help_quality * quality
        return h.float()

    @functools.cached_property
    def probes(self) -> Probes:
        """Probes fitted on the train split's fused embeddings and planted latents (fitted once, ~1 s)."""
        return Probes(self)

    def _pair_penalty(self, cos: Tensor) -> Tensor:
        """Redundancy penalty of each pair from its fused-embedding cosine, same shape as `cos`."""
        t = self.cfg.redundancy_threshold
        return self.cfg.redundancy_weight * ((cos - t).clamp(min=0) / (1 - t))

    def redundancy(self, icds: Tensor, chunk: int = 8192) -> Tensor:
        """Near-duplicate penalty of each ICD set (order-free): (B, k) train-row ids -> (B,), chunked over B so that it
        never holds more than chunk * k * d floats."""
        k = icds.shape[1]
        upper = torch.ones(k, k, dtype=torch.bool).triu(1)  # (k, k)
        out = []
        for part in icds.split(chunk):
            e = self.emb["train"][part]  # (b, k, d)
            cos = e @ e.transpose(1, 2)  # (b, k, k)
            out.append((self._pair_penalty(cos) * upper).sum(dim=(1, 2)))  # (b,)
        return torch.cat(out) if out else torch.zeros(0)

    def _features(self, split: str, queries: Tensor, icds: Tensor, observable: bool = False) -> dict[str, Tensor]:
        """What the answer model needs of each ICD for its query: (B,), (B, k) train-row ids -> dict of (B, k).

        "h": helpfulness; with help_pair, "format" (same answer type) and "topic" (same topic, not misleading); with
        copying, "resemblance" (docs/worlds.md, copy), "credit" (VQA accuracy of the ICD's answer for the query) and
        "answer" (its id in `_answers`). observable=True: each latent replaced by what the probes read, and "credit" by
        the mean credit of an answer of the same type (the query's answers are in no embedding); no "answer"."""
        cfg = self.cfg
        f = {"h": (self.expected_helpfulness if observable else self.helpfulness)(split, queries, icds)}
        if not (cfg.help_pair or cfg.copy_weight):
            return f
        if observable:
            q, c = self.probes.read(split, queries), self.probes.read("train", icds)
            same = {key: (q[key][:, None] * c[key]).sum(-1).float() for key in ("topic", "supertopic", "answer_type")}
            clean = 1 - c["misleading"].float()  # (B, k)
        else:
            q, c = self.latents[split], self.latents["train"]
            same = {
                key: (q[key][queries][:, None] == c[key][icds]).float()
                for key in ("topic", "supertopic", "answer_type")
            }
            clean = (~c["misleading"][icds]).float()  # (B, k)
        if cfg.help_pair:
            f["format"], f["topic"] = same["answer_type"], same["topic"] * clean
        if cfg.copy_weight:
            affinity = same["topic"] + cfg.help_supertopic * (same["supertopic"] - same["topic"])  # (B, k)
            f["resemblance"] = same["answer_type"] * (cfg.copy_question + (1 - cfg.copy_question) * affinity)
            a = self._answers
            if observable:
                both = q["answer_type"][:, None] * c["answer_type"]  # (B, k, 4) P(both of each type)
                f["credit"] = ((both @ a["credit_rate"].double()) / both.sum(-1).clamp_min(1e-12)).float()
            else:
                f["answer"] = a["shown"][icds]  # (B, k)
                ids, acc = a[split]["ids"][queries], a[split]["acc"][queries]  # (B, A)
                f["credit"] = ((ids[:, None, :] == f["answer"][..., None]) * acc[:, None, :]).sum(-1)  # (B, k)
        return f

    def _effect(self, f: dict[str, Tensor], redundancy: Tensor, k: int, present: Tensor | None = None) -> Tensor:
        """The ICDs' effect on the logit before the query's sensitivity: features (N, k), redundancy (N,) -> (N,);
        present (N, k) marks the positions that hold an ICD (the oracle's partial sequences)."""
        cfg, h, w = self.cfg, f["h"], self.position_weights(k)
        if cfg.gain_decay == 1:
            effect = h @ w  # (N,)
        else:  # diminishing returns: the helpful effects sorted, the r-th weighs gain_decay ** r; harmful ones add up
            wh = h * w  # (N, k)
            gains = wh.clamp(min=0).sort(dim=1, descending=True).values  # (N, k)
            effect = gains @ cfg.gain_decay ** torch.arange(k, dtype=torch.float32) + wh.clamp(max=0).sum(1)
        if cfg.neighbour and k > 1:
            weaker = torch.minimum(h[:, 1:], h[:, :-1])  # (N, k-1)
            if present is not None:
                weaker = weaker * (present[:, 1:] & present[:, :-1])
            effect = effect + cfg.neighbour * weaker.sum(1)
        if cfg.help_pair and k > 1:
            both = f["format"][:, :, None] * f["topic"][:, None, :]  # (N, k, k) format ICD i with topic ICD j
            effect = effect + cfg.help_pair * both.masked_fill(torch.eye(k, dtype=torch.bool), 0).flatten(1).amax(1)
        return effect - redundancy

    def _reply(
        self, f: dict[str, Tensor], redundancy: Tensor, k: int, query: dict[str, Tensor], present: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The answer model on features (N, k) (`_features`) and the query's latents (N,): "difficulty", "sensitivity",
        "threshold", and "acc" (N, 4) its answer table (None: no "acc" out). Returns (N,) each: "logit" (of the model's
        own answer), "regime" (column of the answer tables), "copies" (bool), "source" (the position copied from), "acc"
        and "gt_prob" (float64)."""
        cfg = self.cfg
        logit = query["difficulty"] + query["sensitivity"] * self._effect(f, redundancy, k, present) - cfg.shot_cost * k
        margin = logit - query["threshold"]  # (N,)
        # float32 sigmoid rounds a batch's SIMD body and tail differently: computed in float64, an answer does not
        # depend on the batch it came in (the score cache relies on it)
        gt_prob = torch.sigmoid(logit.double())  # (N,)
        out = {"logit": logit}
        copying = bool(cfg.copy_weight) and k > 0
        if copying:
            pull, source = (f["resemblance"] * self.position_weights(k)).max(dim=1)  # (N,) the strongest pull
            # Copy odds = pull / the odds of the own answer: copies (greedily) when the pull beats e^margin.
            copy = torch.sigmoid((cfg.copy_weight * pull.double()).log() - margin.double())  # (N,) 0 without pull
            credit = f["credit"].gather(1, source[:, None])[:, 0].double()  # (N,)
            gt_prob = (1 - copy) * gt_prob + copy * credit
            out.update(copies=copy > 0.5, source=source)
        out["gt_prob"] = gt_prob
        if query.get("acc") is not None:
            # Above the threshold: correct, the majority answer, or a minority one in the band just above it (when
            # the query has a minority answer). Below: a near miss, then a far miss. Columns of the answer tables.
            has_minority = query["acc"][:, MINORITY] > 0  # (N,)
            out["regime"] = torch.where(
                margin > 0,
                torch.where((margin <= cfg.band) & has_minority, MINORITY, MAJORITY),
                torch.where(margin > -cfg.near_miss, NEAR_MISS, FAR_MISS),
            )  # (N,)
            out["acc"] = query["acc"].gather(1, out["regime"][:, None])[:, 0]  # (N,)
            if copying:
                out["acc"] = torch.where(out["copies"], credit.float(), out["acc"])
        return out

    def _query(self, split: str, queries: Tensor) -> dict[str, Tensor]:
        """The latents of queries (B,) that `_reply` reads."""
        q = self.latents[split]
        return {key: q[key][queries] for key in ("difficulty", "sensitivity", "threshold")} | {
            "acc": self._acc[split][queries]
        }

    def logit(self, split: str, queries: Tensor, icds: Tensor) -> Tensor:
        """Logit of the model's own answer for each query given its ICDs in prompt order: (B,), (B, k) train-row
        ids -> (B,). (A copying world may reply with an ICD's answer instead, see `score`.)"""
        if queries.dim() != 1 or icds.dim() != 2 or icds.shape[0] != queries.shape[0]:
            raise ValueError(f"expected queries (B,) and icds (B, k), got {tuple(queries.shape)}, {tuple(icds.shape)}")
        f, query = self._features(split, queries, icds), self._query(split, queries) | {"acc": None}
        return self._reply(f, self.redundancy(icds), icds.shape[1], query)["logit"]

    def score(self, split: str, queries: Tensor, icds: Tensor) -> dict:
        """Simulated greedy answer and its scores: (B,), (B, k) train-row ids (k may be 0) -> "prediction" (list[str]),
        "acc" (VQA accuracy), "correct" (acc > 0), "gt_prob" (probability of a credited answer, times its credit for a
        copied one), "rel" (closeness to the annotator answers, 1 when correct), each (B,)."""
        if queries.dim() != 1 or icds.dim() != 2 or icds.shape[0] != queries.shape[0]:
            raise ValueError(f"expected queries (B,) and icds (B, k), got {tuple(queries.shape)}, {tuple(icds.shape)}")
        f = self._features(split, queries, icds)
        r = self._reply(f, self.redundancy(icds), icds.shape[1], self._query(split, queries))
        acc, rel = r["acc"], self._rel[split][queries, r["regime"]]  # (B,)
        table = self._predictions[split]
        prediction = [table[i][j] for i, j in zip(queries.tolist(), r["regime"].tolist())]
        if "copies" in r and bool(r["copies"].any()):
            a = self._answers
            answer = f["answer"].gather(1, r["source"][:, None])[:, 0]  # (B,) id of the answer copied
            ids = a[split]["ids"][queries]  # (B, A)
            copied_rel = a["rel"][answer[:, None], ids.clamp(min=0)].masked_fill(ids < 0, 0).amax(1)  # (B,)
            rel = torch.where(r["copies"], copied_rel, rel)
            words = a["words"]
            for i, w in zip(r["copies"].nonzero()[:, 0].tolist(), answer[r["copies"]].tolist()):
                prediction[i] = words[w]
        return {"prediction": prediction, "acc": acc, "correct": acc > 0, "gt_prob": r["gt_prob"].float(), "rel": rel}

    def oracle(
        self, split: str, queries: Tensor, pools: Tensor, k: int, beam: int = 16, observable: bool = False
    ) -> Tensor:
        """The best ordered sequence of k distinct pool items under the known answer model: (B,), (B, K) -> (B, k) train
        rows in PROMPT order (score them as they are); pool entries < 0 are padding. observable=True searches with what
        `Probes` read off the embeddings in place of the latents.

        Additive world: the best order of a set puts the most helpful ICD last (weights grow towards the query,
        redundancy ignores order), so a beam search runs over sets with exact partial scores, exact whenever beam >=
        C(K, t) for all t < k. Other worlds: `_search`."""
        num, pool_len = pools.shape
        valid = pools >= 0  # (B, K)
        num_valid = valid.sum(dim=1)  # (B,)
        if k < 0 or (num and k > int(num_valid.min())):
            raise ValueError(f"k={k} must be in [0, {int(num_valid.min())}], the fewest valid candidates of a pool")
        if beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        if not self.cfg.additive:
            chunk = 128  # queries searched at once: their candidate sequences stay a few MiB
            parts = [
                self._search(split, queries[c : c + chunk], pools[c : c + chunk], k, beam, observable)
                for c in range(0, num, chunk)
            ]
            return torch.cat(parts) if parts else pools[:, :k]
        helpfulness = self.expected_helpfulness if observable else self.helpfulness
        h = helpfulness(split, queries, pools.clamp(min=0)).masked_fill(~valid, float("-inf"))  # (B, K)
        # Sensitivity > 0 and the shot cost is fixed for fixed k, so maximising sum w*h - redundancy maximises logit.
        h_sorted, order = h.sort(dim=1, descending=True, stable=True)  # (B, K) padding sorted last
        ids = pools.gather(1, order).clamp(min=0)  # (B, K) pool in decreasing helpfulness
        e = self.emb["train"][ids]  # (B, K, d)
        pair = self._pair_penalty(e @ e.transpose(1, 2))  # (B, K, K)
        idx = torch.arange(pool_len)  # (K,)
        score = torch.zeros(num, 1)  # (B, M)
        last = torch.full((num, 1), -1)  # (B, M) sorted index picked last
        penalty = torch.zeros(num, 1, pool_len)  # (B, M, K) redundancy each candidate would add
        chosen = torch.zeros(num, 1, 0, dtype=torch.long)  # (B, M, t)
        for t in range(k):
            # Step t fills prompt position k-1-t (weight decay**t) with an item less helpful than those picked
            # so far, leaving enough later items to complete the set.
            cand = score[:, :, None] + self.cfg.position_decay**t * h_sorted[:, None, :] - penalty  # (B, M, K)
            ok = (idx > last[:, :, None]) & (idx <= (num_valid - k + t)[:, None, None])  # (B, M, K)
            cand = cand.masked_fill(~ok, float("-inf"))  # (B, M, K)
            top = cand.flatten(1).topk(min(beam, cand.shape[1] * pool_len), dim=1)  # (B, M')
            parent, pick = top.indices // pool_len, top.indices % pool_len  # (B, M'), (B, M')
            score, last = top.values, pick
            chosen = torch.cat([chosen.gather(1, parent[..., None].expand(-1, -1, t)), pick[..., None]], dim=2)
            penalty = penalty.gather(1, parent[..., None].expand(-1, -1, pool_len)) + pair.gather(
                1, pick[..., None].expand(-1, -1, pool_len)
            )  # (B, M', K)
        best = chosen[:, 0].flip(1)  # (B, k) prompt order: the first pick goes last
        return ids.gather(1, best)  # (B, k)

    def _search(self, split: str, queries: Tensor, pools: Tensor, k: int, beam: int, observable: bool) -> Tensor:
        """Beam search over ordered sequences of k distinct pool items, filled from the query backwards and valued with
        the empty positions left out, then improved by pairwise swaps while one helps: (B,), (B, K) -> (B, k), prompt
        order. Value: VQA accuracy, ties broken by gt_prob; observable=True: the probes' gt_prob with the query's
        difficulty, sensitivity and threshold at their population medians. Not exhaustive: the accuracy found bounds the
        best from below."""
        num, pool_len = pools.shape
        valid, ids = pools >= 0, pools.clamp(min=0)  # (B, K)
        feats = self._features(split, queries, ids, observable)
        feats.pop("answer", None)
        empty = pool_len  # a position's pool index when it holds no ICD: every feature is 0 there
        feats = {name: F.pad(v, (0, 1)) for name, v in feats.items()}  # (B, K+1)
        e = self.emb["train"][ids]  # (B, K, d)
        pair = self._pair_penalty(e @ e.transpose(1, 2))  # (B, K, K)
        query = self._median_query(num) if observable else self._query(split, queries)

        def value(slots: Tensor, redundancy: Tensor) -> Tensor:
            """Sequences (B, S, k) of pool indices (`empty` where none) and their redundancy (B, S) -> (B, S)."""
            s = slots.shape[1]
            rows = {name: v.gather(1, slots.flatten(1)).view(-1, k) for name, v in feats.items()}  # (B*S, k)
            each = {key: v.repeat_interleave(s, 0) for key, v in query.items()}  # (B*S,)
            r = self._reply(rows, redundancy.flatten(), k, each, (slots < empty).view(-1, k))
            out = r["gt_prob"] if observable else 10 * r["acc"].double() + r["gt_prob"]  # acc, then gt_prob
            return out.view(num, s)

        idx = torch.arange(pool_len)  # (K,)
        chosen = torch.zeros(num, 1, 0, dtype=torch.long)  # (B, M, t) pool indices of positions k-t .. k-1
        alive = torch.ones(num, 1, dtype=torch.bool)  # (B, M) beam entries that are sequences
        redundancy = torch.zeros(num, 1)  # (B, M)
        penalty = torch.zeros(num, 1, pool_len)  # (B, M, K) redundancy each candidate would add
        for t in range(k):
            m = chosen.shape[1]
            slots = torch.full((num, m, pool_len, k), empty)  # (B, M, K, k) each beam entry with each candidate
            slots[..., k - t :] = chosen[:, :, None, :]
            slots[..., k - 1 - t] = idx
            v = value(slots.flatten(1, 2), (redundancy[:, :, None] + penalty).flatten(1)).view(num, m, pool_len)
            taken = (chosen[:, :, :, None] == idx).any(2)  # (B, M, K)
            v = v.masked_fill(taken | ~valid[:, None] | ~alive[..., None], -math.inf)
            top = v.flatten(1).topk(min(beam, m * pool_len), dim=1)  # (B, M')
            parent, pick = top.indices // pool_len, top.indices % pool_len  # (B, M'), (B, M')
            alive = top.values > -math.inf
            chosen = torch.cat([pick[..., None], chosen.gather(1, parent[..., None].expand(-1, -1, t))], dim=2)
            redundancy = (redundancy[:, :, None] + penalty).flatten(1).gather(1, top.indices)  # (B, M')
            penalty = penalty.gather(1, parent[..., None].expand(-1, -1, pool_len)) + pair.gather(
                1, pick[..., None].expand(-1, -1, pool_len)
            )  # (B, M', K)
        best, redundancy = chosen[:, 0], redundancy[:, :1]  # (B, k), (B, 1) the best sequence (beam sorted)
        # Swaps: the identity, then every transposition of two positions, as permutations (P, k).
        perms = [list(range(k))] + [
            [j if x == i else i if x == j else x for x in range(k)] for i, j in itertools.combinations(range(k), 2)
        ]
        perms = torch.tensor(perms)  # (P, k)
        for _ in range(k * k):  # each round takes the best swap; the identity first, so a tie keeps the order
            cand = best[:, perms]  # (B, P, k)
            top = value(cand, redundancy.expand(-1, len(perms))).argmax(dim=1)  # (B,)
            if not bool(top.any()):
                break
            best = cand[torch.arange(num), top]  # (B, k)
        return ids.gather(1, best)  # (B, k)

    def _median_query(self, num: int) -> dict[str, Tensor]:
        """The latents `_reply` reads, at their population medians, for `num` queries: what the observable ceiling
        assumes of a query whose difficulty, sensitivity and threshold no embedding reveals."""
        cfg = self.cfg
        median = (cfg.difficulty_mean, math.exp(cfg.sensitivity_log_mean), 0.0)
        return {key: torch.full((num,), v) for key, v in zip(("difficulty", "sensitivity", "threshold"), median)}

    def oracle_value(self, split: str, queries: Tensor, icds: Tensor, observable: bool = False) -> Tensor:
        """What the oracle's search ranks whole sequences by, comparable across their lengths: (B,), (B, k) train rows
        in prompt order (k may be 0) -> (B,) float64, VQA accuracy with ties broken by gt_prob; observable=True: the
        gt_prob that the probes' latents and a median query give (the observable ceiling's own estimate)."""
        f = self._features(split, queries, icds, observable)
        f.pop("answer", None)
        query = self._median_query(len(queries)) if observable else self._query(split, queries)
        r = self._reply(f, self.redundancy(icds), icds.shape[1], query)
        return r["gt_prob"] if observable else 10 * r["acc"].double() + r["gt_prob"]

    @functools.cached_property
    def _answers(self) -> dict:
        """The answers an ICD can pass on, as ids into "words" (built once, for copying worlds): "shown" (N_train,) each
        train item's majority answer; per split "ids" (N, A) its distinct annotator answers (-1 pads) and "acc" (N, A)
        their VQA accuracy; "rel" (W, W) answer_rel of a shown word against an annotator answer; "credit_rate" (4,) per
        answer type, the mean credit of a train item's shown answer for a train question of that type."""
        words: dict[str, int] = {}
        acc_by_count = [_official_acc(c) for c in range(NUM_ANNOTATORS + 1)]
        out: dict = {}
        for split in SPLITS:
            counts = [Counter(it["answers"]) for it in self.items[split]]
            width = max(map(len, counts))
            out[split] = {
                "ids": torch.tensor(
                    [[words.setdefault(a, len(words)) for a in c] + [-1] * (width - len(c)) for c in counts]
                ),
                "acc": torch.tensor([[acc_by_count[n] for n in c.values()] + [0.0] * (width - len(c)) for c in counts]),
            }
        vocab = list(words)
        shown = torch.tensor([words[row[MAJORITY]] for row in self._predictions["train"]])  # (N_train,)
        rel = torch.zeros(len(vocab), len(vocab))
        for a in shown.unique().tolist():
            rel[a] = torch.tensor([answer_rel(vocab[a], [b]) for b in vocab])
        # credit_rate[t] = mean over train questions q of type t of sum_a P(an ICD of type t shows a) * acc_q(a)
        types, train = self.latents["train"]["answer_type"], out["train"]
        freq = torch.zeros(len(ANSWER_TYPES), len(vocab)).index_put_(
            (types, shown), torch.ones(len(shown)), accumulate=True
        )
        freq = freq / freq.sum(1, keepdim=True).clamp_min(1)  # (4, W)
        per_query = (freq[types[:, None], train["ids"].clamp(min=0)] * train["acc"]).sum(1)  # (N_train,)
        rate = torch.zeros(len(ANSWER_TYPES)).index_add_(0, types, per_query)
        rate = rate / torch.bincount(types, minlength=len(ANSWER_TYPES)).clamp_min(1)
        return out | {"words": vocab, "shown": shown, "rel": rel, "credit_rate": rate}


class Probes:
    """What the fused embeddings reveal about the planted latents, fitted on the train split in float64: linear
    discriminant analysis for topic and answer type (the simulator's noise is isotropic, so one spherical covariance
    is the right model), ridge regression for quality, and two 1-d Gaussians over a ridge read-out for the misleading
    flag."""

    def __init__(self, sim: Simulator):
        x, lat = sim.emb["train"].double(), sim.latents["train"]
        topic = _lda(x, lat["topic"], NUM_TOPICS)
        answer_type = _lda(x, lat["answer_type"], len(ANSWER_TYPES))
        quality = _ridge(x, lat["quality"].double())
        misleading = _binary_posterior(x, lat["misleading"])
        self.split: dict[str, dict[str, Tensor]] = {}
        for split in SPLITS:
            z = sim.emb[split].double()
            t = topic(z)  # (N, T)
            self.split[split] = {
                "topic": t,
                "supertopic": t.view(len(z), len(SUPERTOPICS), SCENES_PER_SUPERTOPIC).sum(-1),  # (N, 8)
                "answer_type": answer_type(z),  # (N, 4)
                "quality": quality(z),  # (N,)
                "misleading": misleading(z),  # (N,)
            }

    def read(self, split: str, rows: Tensor) -> dict[str, Tensor]:
        """The posteriors of the items `rows` (any shape) of `split`."""
        return {k: v[rows] for k, v in self.split[split].items()}


def _lda(x: Tensor, y: Tensor, classes: int):
    """Class posterior p(y | x) of a Gaussian model with class means and one shared spherical variance."""
    count = torch.bincount(y, minlength=classes).to(x.dtype)  # (C,)
    mean = torch.zeros(classes, x.shape[1], dtype=x.dtype).index_add_(0, y, x) / count.clamp_min(1)[:, None]
    var = (x - mean[y]).pow(2).mean()
    log_prior = (count / len(y)).clamp_min(1e-12).log()  # (C,)
    return lambda z: (z @ mean.T / var - mean.pow(2).sum(-1) / (2 * var) + log_prior).softmax(-1)  # (N, C)


def _ridge(x: Tensor, y: Tensor, strength: float = 1e-3):
    """Ridge regression of y on x (penalty strength * N, the intercept unpenalised): returns z -> E[y | z]."""
    x_mean, y_mean = x.mean(0), y.mean()
    xc = x - x_mean
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    w = torch.linalg.solve(xc.T @ xc + strength * len(x) * eye, xc.T @ (y - y_mean))  # (d,)
    return lambda z: (z - x_mean) @ w + y_mean


def _binary_posterior(x: Tensor, y: Tensor):
    """P(y | z) for a binary latent: two 1-d Gaussians (shared variance) over its ridge read-out."""
    read = _ridge(x, y.double())
    r = read(x)
    m1, m0 = r[y].mean(), r[~y].mean()
    var = torch.cat([r[y] - m1, r[~y] - m0]).pow(2).mean()
    prior = y.double().mean().clamp(1e-6, 1 - 1e-6)
    log_odds = (prior / (1 - prior)).log()
    return lambda z: torch.sigmoid(((read(z) - m0) ** 2 - (read(z) - m1) ** 2) / (2 * var) + log_odds)


def calibrate(
    sim: Simulator, pool_size: int = 64, group_size: int = 16, seq_len: int = 4, num_anchors: int = 800, seed: int = 0
) -> dict:
    """The simulator against the calibration targets (accuracies in %, fractions in [0, 1]). Val queries, each with its
    own random pool: "random_k" (first k of a random sequence), "similar_k" (the k most similar, most similar last),
    "oracle_k", "observable_k". "varying_reward_frac": the share of `num_anchors` train anchors whose group (one
    similarity sequence and group_size - 1 random ones) does not share one reward, reward = correct + acc."""
    gen = torch.Generator().manual_seed(seed)
    train_img = sim.latents["train"]["image_id"]  # (N,)
    val_img = sim.latents["val"]["image_id"]  # (V,)
    queries = torch.arange(len(val_img))  # (V,)
    ids = {"train": train_img, "val": val_img}
    # Built in chunks of queries: no (V, N) matrix, the same pools and generator state as one whole-matrix draw.
    val_pools = pools.query_pools(
        "random", pool_size, {}, ids, "val", queries, torch.full_like(queries, -1), gen
    )  # (V, K)
    full = torch.ones_like(val_pools, dtype=torch.bool)  # (V, K)
    rand_seq = val_pools.gather(1, pools.random_sequences(full, 1, seq_len, gen)[:, 0])  # (V, S)
    ranking = pools.pool_ranking(sim.emb["val"], sim.emb["train"], val_pools)  # (V, K)
    similar = val_pools.gather(1, ranking[:, :seq_len])  # (V, S) most similar first

    def pct(icds: Tensor) -> float:
        return 100 * sim.score("val", queries, icds)["acc"].mean().item()

    out = {"zero_shot": pct(val_pools[:, :0])}
    best = {name: [val_pools[:, :0]] for name in ("oracle", "observable")}  # each one's best of k, k = 0, 1, ...
    for k in range(1, seq_len + 1):
        out[f"random_{k}"] = pct(rand_seq[:, :k])
        out[f"similar_{k}"] = pct(similar[:, :k].flip(1))
        for name, seqs in best.items():
            seqs.append(sim.oracle("val", queries, val_pools, k, observable=name == "observable"))
            out[f"{name}_{k}"] = pct(seqs[-1])
    for name, seqs in best.items():  # the best of 0..k, by the search's own value (fewer demonstrations on a tie)
        value = torch.stack([sim.oracle_value("val", queries, s, name == "observable") for s in seqs])  # (S+1, V)
        scores = torch.stack([sim.score("val", queries, s)["acc"] for s in seqs])  # (S+1, V)
        for k in range(1, seq_len + 1):
            j = value[: k + 1].argmax(0)  # (V,)
            out[f"{name}_upto_{k}"] = 100 * scores[j, queries].mean().item()
            out[f"{name}_shots_{k}"] = j.double().mean().item()

    anchors = torch.randperm(len(train_img), generator=gen)[:num_anchors]  # (A,)
    anchor_pools = pools.query_pools("random", pool_size, {}, ids, "train", anchors, anchors, gen)  # (A, K)
    ranking = pools.pool_ranking(sim.emb["train"][anchors], sim.emb["train"], anchor_pools)  # (A, K)
    group, _ = pools.candidate_groups(ranking, group_size, seq_len, gen)
    icds = anchor_pools.gather(1, group.flatten(1)).view(-1, seq_len)  # (A*G, S)
    res = sim.score("train", anchors.repeat_interleave(group_size), icds)
    reward = (res["correct"].float() + res["acc"]).view(-1, group_size)  # (A, G)
    out["varying_reward_frac"] = (reward.amax(dim=1) > reward.amin(dim=1)).float().mean().item()
    return out
