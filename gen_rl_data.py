"""Stage 1: embeddings, per-query candidate pools, and LVLM-scored demonstration sequences.

For each anchor query (a train item) it builds a pool of K train items (never the query nor another question on its
image), makes G distinct sequences of S picks from it (a selector's picks with --init, one similarity-retrieval
sequence, random ones to fill the group; or, with --groups infoscore, Lever-LM's beam search on InfoScore, below) and
scores each with the LVLM: VQA accuracy `acc`, `correct = acc > 0`,
`gt_prob` (the probability of replying with an answer the VQA metric credits, weighted by that credit, at full precision
for log-space rewards) and `rel`; once per anchor, `zero_shot_gt_prob` for the info_score reward. Each validation query
gets a pool from the same sampler (eval_pools.json). The default LVLM is the built-in simulator, labelled as simulation
in every output.

--groups infoscore builds the data Lever-LM / ICD-LM train on: per anchor, a beam search over its pool that grows each
beam by the candidate c of the highest InfoScore(c) = P(y | c + S, x) - P(y | S, x), the new demonstration placed first
(P: the geometric-mean token probability of the query's most common answer y; the simulator's gt_prob), keeping the G
best (beam width G) at each of the S steps; the G final beams are the anchor's group. It asks the LVLM about
1 + K + (S - 1) G K prompts per anchor, every one counted in meta.json's lvlm_calls (docs/rivals.md).

Usage:
    python gen_rl_data.py                              # builds data/sim/ (800 anchors, G=16, S=4, K=64)
    python gen_rl_data.py --calibrate                  # print the simulator's calibration table
    python gen_rl_data.py --world copy --out data/sim-copy             # another simulated world (docs/worlds.md)
    python gen_rl_data.py --world strong --sim-set help_base=-0.2 --out data/sim-strong2   # a world's variant
    python gen_rl_data.py --report data/sim            # Markdown report of a dataset folder
    python gen_rl_data.py --init runs/rce --out data/sim-r2   # add sequences decoded by a trained selector
    python gen_rl_data.py --groups infoscore --group-size 5 --seq-len 2 --num-queries 5000 --out data/sim-leverlm
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro
from torch import Tensor
from tqdm import tqdm

from icl_select import lineage, pools, sharding
from icl_select.backends import LVLMOptions, SimBackend, check_lvlm_run, lvlm_backend
from icl_select.caption_data import DATASETS as CAPTION_FILES
from icl_select.cli import CpuArgs, default_is, help_first, run_cli
from icl_select.data import (
    DEFAULT_DATA,
    FORMAT_VERSION,
    METRIC,
    QUALITY_TIERS,
    REWARD_MODES,
    SEQ_FIELDS,
    ZERO_SHOT,
    RewardArgs,
    compute_reward,
    load_dataset,
    picture_ids,
    quality_labels,
    read_embeddings,
    read_items,
    read_meta,
)
from icl_select.files import atomic_write_text, full_disk_names, save_tensors, selector_digest
from icl_select.locks import exclusive
from icl_select.pictures import check_pictures, picture_digest, write_stamps
from icl_select.runs import check_selector, load_selector
from icl_select.sim import WORLDS, Simulator, calibrate, parse_settings, world_config
from icl_select.sim_caption import (
    CAPTION_WORLDS,
    CaptionSimulator,
    calibrate_caption,
    caption_calibration_table,
    caption_world_config,
    parse_caption_settings,
)
from icl_select.vqa_data import DATASETS as VQA_FILES
from model import reward_spread

VQA_DATASETS = tuple(VQA_FILES)
CAPTION_DATASETS = tuple(CAPTION_FILES)
CAPTION_SHOTS = 8  # captioning's calibration goes to 8 shots, as Lever-LM and OpenFlamingo report
World = Literal[tuple(WORLDS) + tuple(CAPTION_WORLDS)]  # type: ignore[valid-type]
DatasetName = Literal[VQA_DATASETS + CAPTION_DATASETS]  # type: ignore[valid-type]


@help_first("out", "lvlm", "dataset", "data_root", "task")
@dataclass
class Args(RewardArgs, LVLMOptions, CpuArgs):
    out: Annotated[Path | None, default_is("data/sim, or data/<dataset>-<model name> for a real LVLM")] = None
    """Dataset folder to write; re-running the same command resumes it."""
    num_queries: int = 800
    """Anchor queries (train items) to score."""
    num_train: int = 5000
    """Simulator: train items, the ICD source."""
    num_val: int = 1200
    """Simulator: validation questions."""
    pool_size: int = 64
    """Candidates per query pool (K)."""
    group_size: int = 16
    """Distinct scored sequences per anchor query (G)."""
    seq_len: int = 4
    """Demonstrations per sequence (S), i.e. the largest shot count."""
    min_shots: Annotated[int | None, default_is("--seq-len")] = None
    """Fewest demonstrations in a sampled sequence: random ones get lengths from here to S, 0 adds the zero-shot prompt
    to every group. RCE and offline GRPO learn from the full-length sequences alone, a selector that may stop too."""
    sampler: Literal["random", "image", "text", "mix"] = "random"
    """How pools are built: random, most image-similar, most text-similar, or half of each."""
    groups: Literal["sampled", "infoscore"] = "sampled"
    """How each anchor's sequences are made: sampled (retrieval, random, --init's picks) or infoscore (Lever-LM's beam
    search; --group-size is its beam width)."""
    init: Path | None = None
    """A trained selector run folder: add its greedy, beam and sampled sequences to each group."""
    init_beams: int = 4
    """With --init: beam width (the beams join the group)."""
    init_samples: int = 6
    """With --init: sequences sampled from the selector."""
    init_temperature: float = 1.0
    """With --init: sampling temperature."""
    seed: int = 0
    """Seed of the simulator, the anchors, the pools and the random sequences."""
    task: Literal["vqa", "caption"] = "vqa"
    """What the LVLM does: answer a question about a picture, scored by VQA accuracy, or caption a picture, scored by
    CIDEr-D; every later stage reads it from meta.json."""
    world: Annotated[World | None, default_is("additive, or base (caption)")] = None
    """Simulator: which simulated LVLM answers (docs/worlds.md)."""
    sim_set: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """Simulator: FIELD=VALUE sets a field of the world's settings (sim.SimConfig, sim_caption.CaptionConfig)."""
    lvlm: str = "sim"
    """`sim` (the built-in simulator) or a Hugging Face model id / local path."""
    dataset: Annotated[DatasetName | None, default_is("okvqa, or coco2017 (caption)")] = None
    """Real data: which official files to read (VQA: questions and annotations; captions: COCO or Karpathy's)."""
    data_root: Path | None = None
    """Real data: folder of the official question/annotation files and the COCO images."""
    train_questions: Annotated[str | None, default_is("the official name")] = None
    """Real data: train questions file under --data-root."""
    train_annotations: Annotated[str | None, default_is("the official name")] = None
    """Real data: train annotations file under --data-root."""
    val_questions: Annotated[str | None, default_is("the official name")] = None
    """Real data: val questions file under --data-root."""
    val_annotations: Annotated[str | None, default_is("the official name")] = None
    """Real data: val annotations file under --data-root."""
    train_captions: Annotated[str | None, default_is("the official name")] = None
    """Real data, captions: the train captions file under --data-root (Karpathy: dataset_coco.json)."""
    val_captions: Annotated[str | None, default_is("the official name")] = None
    """Real data, captions: the val captions file under --data-root."""
    train_images: Annotated[str | None, default_is("train2014")] = None
    """Real data: train image folder under --data-root."""
    val_images: Annotated[str | None, default_is("val2014")] = None
    """Real data: val image folder under --data-root."""
    max_train: int | None = None
    """Real data: keep only the first N train items (quick runs)."""
    max_val: int | None = None
    """Real data: keep only the first N val questions (quick runs)."""
    encoder: str = "openai/clip-vit-base-patch32"
    """Real data: CLIP model (id or path) for the image and question embeddings."""
    chunk: int = 0
    """Anchor queries per backend call (0 = 64 for the simulator, 4 for a real LVLM)."""
    calibrate: bool = False
    """Print the simulator's calibration table (docs/worlds.md) and exit."""
    report: Path | None = None
    """Print a Markdown report of this dataset folder (finished or not) and exit."""


def rng(seed: int, stream: int) -> torch.Generator:
    """Independent, reproducible random streams (anchors, pools, sequences, ...) from one seed."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def min_shots(args: Args) -> int:
    return args.seq_len if args.min_shots is None else args.min_shots


def world_name(args: Args) -> str:
    return args.world or ("additive" if args.task == "vqa" else "base")


def dataset_name(args: Args) -> str:
    return args.dataset or ("okvqa" if args.task == "vqa" else "coco2017")


def make_sim(args: Args) -> Simulator | CaptionSimulator:
    """The simulated LVLM of the task, its world and --sim-set."""
    sizes = dict(seed=args.seed, num_train=args.num_train, num_val=args.num_val)
    try:
        if args.task == "caption":
            overrides = parse_caption_settings(args.sim_set)
            return CaptionSimulator(caption_world_config(world_name(args), **sizes, **overrides))
        return Simulator(world_config(world_name(args), **sizes, **parse_settings(args.sim_set)))
    except ValueError as e:
        raise ValueError(f"--sim-set: {e}") from None


def is_sim(args: Args) -> bool:
    return args.lvlm == "sim"


def out_folder(args: Args) -> Path:
    if args.out is not None:
        return args.out
    if is_sim(args):
        return DEFAULT_DATA if args.task == "vqa" else Path("data/sim-caption")
    return Path("data") / f"{dataset_name(args)}-{Path(args.lvlm.rstrip('/')).name}"


def check_args(args: Args) -> None:
    for name in ("num_queries", "num_train", "num_val", "pool_size", "group_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_lvlm_run(args)
    if args.seq_len > args.pool_size:
        raise ValueError(f"--seq-len {args.seq_len} is larger than --pool-size {args.pool_size}")
    if math.perm(args.pool_size, args.seq_len) < args.group_size:
        raise ValueError(
            f"--group-size {args.group_size} cannot be drawn: a pool of {args.pool_size} holds only "
            f"{math.perm(args.pool_size, args.seq_len)} distinct sequences of {args.seq_len}"
        )
    if not 0 <= min_shots(args) <= args.seq_len or (args.groups == "infoscore" and min_shots(args) != args.seq_len):
        raise ValueError(f"--min-shots must be in 0..{args.seq_len} (sampled groups only), got {args.min_shots}")
    if args.init_beams < 1 or args.init_samples < 0:
        raise ValueError(
            f"--init-beams must be >= 1 and --init-samples >= 0, got {args.init_beams}, {args.init_samples}"
        )
    if not 0 < args.init_temperature < math.inf:
        raise ValueError(f"--init-temperature must be a finite number > 0, got {args.init_temperature}")
    if args.chunk < 0:
        raise ValueError(f"--chunk must be >= 0, got {args.chunk}")
    if args.groups == "infoscore" and args.init is not None:
        raise ValueError("--init adds a selector's picks to sampled groups; --groups infoscore builds its own beams")
    if not is_sim(args) and (args.world is not None or args.sim_set):
        raise ValueError(f"--world and --sim-set set the simulator; --lvlm {args.lvlm} is a real LVLM")
    if not is_sim(args) and args.data_root is None:
        raise ValueError(f"--lvlm {args.lvlm} needs --data-root: the folder with its {dataset_name(args)} files")
    worlds, datasets = (WORLDS, VQA_DATASETS) if args.task == "vqa" else (CAPTION_WORLDS, CAPTION_DATASETS)
    if world_name(args) not in worlds or dataset_name(args) not in datasets:
        what = f"--world {world_name(args)}" if world_name(args) not in worlds else f"--dataset {dataset_name(args)}"
        raise ValueError(f"{what} is not a {args.task} one; --task {args.task} takes {', '.join([*worlds, *datasets])}")
    if args.task == "caption" and args.sampler in ("text", "mix"):
        raise ValueError(
            f"--sampler {args.sampler} compares captions, which a query to caption does not have (an anchor's would be "
            "its own reference): use image or random"
        )


@dataclass
class Source:
    """What the folder is made from: items per split, their embeddings (None until computed), and the backend (a real
    LVLM: None until `open_lvlm` loads it, after every check that does not need it)."""

    items: dict[str, list[dict]]
    emb: dict[str, Tensor] | None
    backend: object | None
    settings: dict  # how the items, embeddings and scores were made


def open_source(args: Args) -> Source:
    """The simulator, or the real dataset files (the LVLM is loaded later, by `open_lvlm`)."""
    if is_sim(args):
        sim = make_sim(args)
        return Source(sim.items, sim.emb, SimBackend(sim), {"source": "sim", "encoder": "sim"})
    from icl_select.caption_data import load_caption_split
    from icl_select.hf import resolve_model
    from icl_select.vqa_data import load_vqa_split

    if args.task == "caption":
        files = {s: (getattr(args, f"{s}_captions"), getattr(args, f"{s}_images")) for s in ("train", "val")}
        load = load_caption_split
    else:
        files = {
            s: (getattr(args, f"{s}_questions"), getattr(args, f"{s}_annotations"), getattr(args, f"{s}_images"))
            for s in ("train", "val")
        }
        load = load_vqa_split
    limit = {"train": args.max_train, "val": args.max_val}
    items = {s: load(dataset_name(args), args.data_root, s, *files[s])[: limit[s]] for s in ("train", "val")}
    data = {
        "source": dataset_name(args),
        "data_root": str(Path(args.data_root).resolve()),
        "files": files,
        "limits": limit,
        "encoder": args.encoder,
        # The commit of the cached CLIP snapshot, or a local folder's digest, as the LVLM's revision is recorded:
        # embeddings from other weights would silently change every pool.
        "encoder_revision": resolve_model(args.encoder)[1],
        # the questions, answers and picture files read (a resumed build must read the same)
        "items": lineage.digest(items),
    }
    return Source(items, None, None, {**data, "system_prompt": args.system_prompt})


def open_lvlm(args: Args, src: Source) -> None:
    """The real LVLM, loaded and self-checked (the simulator is its own backend)."""
    if src.backend is None:
        src.backend = lvlm_backend(args.lvlm, src.items, args, args.task)


def embed(args: Args, items: dict[str, list[dict]]) -> dict[str, Tensor]:
    """CLIP image, question and fused embeddings of both splits (real data), as the task's selector reads them
    (`clip.task_embed`: a captioning selector reads the picture alone). Each item gets its picture's pixel digest
    ("picture", decoded for the embedding already), by which pools keep a question's own picture out, copies too."""
    from icl_select.clip import task_embed

    emb = {}
    for split, rows in items.items():
        e = task_embed(rows, args.task, args.encoder, args.device)
        emb.update({split: e["fused"], f"{split}_image": e["image"], f"{split}_text": e["text"]})
        for it in rows:
            it["picture"] = picture_digest(it["image"])
    return emb


def settings(args: Args, src: Source) -> dict:
    """Everything that determines the folder's content: a resumed run must match these exactly. Before the real LVLM
    loads (`open_lvlm`), all but what it says of itself."""
    init = None
    if args.init is not None:
        init = {
            "selector": selector_digest(args.init)[:16],  # its weights and settings, not their path
            "beams": args.init_beams,
            "samples": args.init_samples,
            "temperature": args.init_temperature,
        }
    return {
        "format_version": FORMAT_VERSION,
        "task": args.task,
        **src.settings,
        **(src.backend.describe() if src.backend is not None else {}),
        "sampler": args.sampler,
        "groups": args.groups,
        "pool_size": args.pool_size,
        "group_size": args.group_size,
        "seq_len": args.seq_len,
        "min_shots": min_shots(args),
        "seed": args.seed,
        "num_queries": args.num_queries,
        "init": init,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Pools and groups


def make_pools(
    args: Args, items: dict, emb: dict, split: str, queries: Tensor, query_rows: Tensor, stream: int
) -> Tensor:
    """(Q,) query rows of `split` -> (Q, K) train rows, built by the chosen sampler, none on the query's picture."""
    image_ids = picture_ids(items)
    return pools.query_pools(
        args.sampler, args.pool_size, emb, image_ids, split, queries, query_rows, rng(args.seed, stream)
    )


def init_candidates(args: Args, train: Tensor, anchors: Tensor, pool: Tensor) -> tuple[Tensor, list[str]]:
    """Sequences decoded by a trained selector: greedy, beams, samples -> (Q, C, S) and their sources; a chunk of
    anchors at a time (`pools.pool_chunks`), the samples of each chunk the next draws of one generator."""
    model = load_selector(args.init).eval()
    gen, seqs = rng(args.seed, 4), []
    for c in pools.pool_chunks(*pool.shape, train.shape[1]):
        query, pool_emb = train[anchors[c]], train[pool[c]]  # (C, d), (C, K, d)
        mask = torch.ones(pool_emb.shape[:2], dtype=torch.bool)
        least = min_shots(args)  # a selector that may stop makes no sequence shorter than the data allows
        greedy, _ = model.greedy(query, pool_emb, mask, args.seq_len, least)
        beams, _ = model.beam_search(query, pool_emb, mask, args.seq_len, args.init_beams, least)
        samples, _ = model.sample(
            query, pool_emb, mask, args.seq_len, args.init_samples, gen, args.init_temperature, least
        )
        seqs.append(model.cfg.to_prompt(torch.cat([greedy[:, None], beams, samples], 1)))  # (C, 1+B+N, S) prompt order
    return torch.cat(seqs), ["greedy"] + ["beam"] * args.init_beams + ["sample"] * args.init_samples


def anchor_groups(
    args: Args, items: dict, emb: dict, anchors: Tensor
) -> tuple[Tensor, Tensor | None, list[list[str]] | None]:
    """The anchors' pools (Q, K) train rows and G distinct sequences per anchor (Q, G, S) in pool positions, with
    their sources: the selector's picks (with --init), one similarity-retrieval sequence, then random ones. InfoScore
    groups are searched with the LVLM as their anchors are scored: None, None."""
    anchor_pools = make_pools(args, items, emb, "train", anchors, anchors, stream=2)  # (Q, K)
    if args.groups == "infoscore":
        return anchor_pools, None, None
    train = emb["train"]
    prefix, prefix_sources = None, None
    if args.init is not None:
        prefix, prefix_sources = init_candidates(args, train, anchors, anchor_pools)
    ranking = pools.pool_ranking(train[anchors], train, anchor_pools)  # (Q, K)
    groups, sources = pools.candidate_groups(
        ranking, args.group_size, args.seq_len, rng(args.seed, 3), prefix, prefix_sources, min_shots(args)
    )
    return anchor_pools, groups, sources


def infoscore_beams(backend, queries: Tensor, pools: Tensor, width: int, steps: int) -> Tensor:
    """Lever-LM's beam search: for each query (C,) train rows over its pool (C, K) train rows, the `width` sequences
    of `steps` demonstrations whose last step had the highest InfoScore(c) = P(y | c + S, x) - P(y | S, x), each step
    placing the new demonstration first -> (C, W, S) pool positions in prompt order, best first. P is the backend's
    `info_prob`; every prompt it is asked about is a distinct one (`infoscore_calls` counts them)."""
    C, K = pools.shape
    rows = torch.arange(C)
    beams = torch.zeros(C, 1, 0, dtype=torch.long)  # (C, M, t) the beams, prompt order
    base = backend.info_prob("train", queries, pools[:, :0])[:, None]  # (C, M) P(y | S, x) of each beam
    for t in range(steps):
        M = beams.shape[1]
        new = torch.arange(K).view(1, 1, K, 1).expand(C, M, K, 1)
        seqs = torch.cat([new, beams[:, :, None].expand(C, M, K, t)], -1)  # (C, M, K, t+1) the candidate first
        fresh = ~(beams[..., None] == torch.arange(K)).any(2)  # (C, M, K) candidates not yet in the beam
        flat = seqs[fresh]  # (n, t+1)
        who = rows[:, None, None].expand(C, M, K)[fresh]  # (n,)
        prob = torch.zeros(C, M, K, dtype=torch.float64)
        prob[fresh] = backend.info_prob("train", queries[who], pools[who].gather(1, flat)).double()
        info = (prob - base[..., None]).masked_fill(~fresh, float("-inf"))  # (C, M, K)
        top = info.flatten(1).topk(min(width, int(fresh[0].sum())), dim=1).indices  # (C, W') best first
        beams = seqs.flatten(1, 2)[rows[:, None], top]  # (C, W', t+1)
        base = prob.flatten(1)[rows[:, None], top]  # (C, W')
    return beams


def infoscore_calls(pool_size: int, width: int, steps: int) -> int:
    """Prompts `infoscore_beams` asks about for one anchor (its zero-shot one included)."""
    calls, beams = 1, 1
    for t in range(steps):
        calls += beams * (pool_size - t)
        beams = min(width, beams * (pool_size - t))
    return calls


def data_calls(meta: dict) -> int:
    """The LVLM prompts a finished dataset folder's anchors cost: each scored sequence and each zero-shot prompt, and
    for InfoScore groups every prompt the beam search asked about."""
    per_anchor = meta["group_size"] + 1
    if meta["groups"] == "infoscore":
        per_anchor += infoscore_calls(meta["pool_size"], meta["group_size"], meta["seq_len"])
    return meta["num_queries"] * per_anchor


# ----------------------------------------------------------------------------------------------------------------------
# Generation


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}, so a settings mismatch names the exact field."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def prepare_folder(out: Path, want: dict, partial: bool = False) -> dict | None:
    """The existing meta.json if this folder was started with the settings `want` (`partial`: those it names, as
    before the LVLM loads), None if the folder is new."""
    if not out.exists() or not any(out.iterdir()):
        return None
    if not (out / "meta.json").is_file():
        raise ValueError(f"{out} exists, is not empty and has no meta.json: not a dataset folder, refusing to write")
    meta = read_meta(out)
    have, want = flatten(meta.get("settings", {})), flatten(json.loads(json.dumps(want)))  # tuples -> lists
    names = [*want, *(k for k in have if k not in want and not partial)]
    lineage.check(out / "meta.json", have, want, "use another --out, or the flags that built it", names)
    return meta


def shard_files(out: Path) -> list[Path]:
    return sorted(out.glob("rl_data.rank*.jsonl"))


def scored_queries(out: Path) -> dict[int, dict]:
    """query -> its record, from rl_data.jsonl and the shard files of (possibly interrupted) torchrun ranks."""
    return sharding.done([out / "rl_data.jsonl", *shard_files(out)], "query")


def jsonl_line(record: dict) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def merge_shards(out: Path, anchors: Tensor, done: dict[int, dict]) -> None:
    """rl_data.jsonl in anchor order from `done` (`scored_queries`), then the shard files removed."""
    atomic_write_text(out / "rl_data.jsonl", "".join(jsonl_line(done[q]) for q in anchors.tolist() if q in done))
    for path in shard_files(out):
        path.unlink()


def seq_record(icds: list[int], source: str, res: dict, i: int) -> dict:
    icds = [c for c in icds if c >= 0]
    # gt_prob unrounded: log-space rewards need every probability, however small (acc and rel are coarse anyway)
    scores = {k: int(res[k][i]) if k == "correct" else round(float(res[k][i]), 6) for k in SEQ_FIELDS}
    scores["gt_prob"] = float(res["gt_prob"][i])
    return {"icds": icds, "source": source, **scores, "prediction": res["prediction"][i]}


def score_queries(
    args: Args,
    backend,
    path: Path,
    todo: list[int],
    anchors: Tensor,
    anchor_pools: Tensor,
    groups: Tensor | None,
    sources: list[list[str]] | None,
    rank: int,
    world: int,
) -> float:
    """Score the anchors `todo` (indices into anchors) chunk by chunk, appending one line per query to `path`; groups
    None: each chunk's InfoScore beams are searched first. Returns the sequences scored a second."""
    chunk = args.chunk or (64 if is_sim(args) else 4)
    G, S = args.group_size, args.seq_len
    desc = f"scoring (rank {rank})" if world > 1 else "scoring"
    bar = tqdm(total=len(todo), unit="query", desc=desc, position=rank, dynamic_ncols=True)
    start, scored = time.perf_counter(), 0
    with full_disk_names(path), sharding.own_file(path) as f:
        for c in range(0, len(todo), chunk):
            idx = torch.tensor(todo[c : c + chunk])  # (C,)
            if groups is None:
                seqs = infoscore_beams(backend, anchors[idx], anchor_pools[idx], G, S)  # (C, G, S)
                origin = [["infoscore"] * G] * len(idx)
            else:
                seqs, origin = groups[idx], [sources[i] for i in idx.tolist()]
            at = seqs.flatten(1)  # (C, G*S) pool positions, -1 after the last of a shorter sequence
            icds = anchor_pools[idx].gather(1, at.clamp_min(0)).where(at >= 0, -1).view(-1, S)  # (C*G, S) train rows
            res = backend.score("train", anchors[idx].repeat_interleave(G), icds)
            no_icds = torch.zeros(len(idx), 0, dtype=torch.long)  # (C, 0)
            zero_shot = backend.score("train", anchors[idx], no_icds)["gt_prob"]  # (C,)
            for j, i in enumerate(idx.tolist()):
                group = [seq_record(seqs[j, g].tolist(), origin[j][g], res, j * G + g) for g in range(G)]
                pool = anchor_pools[i].tolist()
                line = {"query": int(anchors[i]), "pool": pool, ZERO_SHOT: float(zero_shot[j]), "seqs": group}
                f.write(jsonl_line(line))
            f.flush()
            scored += len(idx) * G
            bar.update(len(idx))
            bar.set_postfix(seq_per_s=f"{scored / (time.perf_counter() - start):.1f}", refresh=False)
    bar.close()
    return scored / (time.perf_counter() - start)


def generate(args: Args) -> None:
    """Check everything that needs no LVLM (flags, files, the folder's settings, --init), then build or resume the
    folder under its lock."""
    check_args(args)
    rank, world = sharding.init()
    src = open_source(args)
    if args.num_queries > (n_train := len(src.items["train"])):
        raise ValueError(f"--num-queries {args.num_queries} exceeds the {n_train} train items")
    want = settings(args, src)
    prepare_folder(out_folder(args), want, partial=src.backend is None)
    if args.init is not None:  # a selector of this task and encoder (its width once the embeddings are known)
        check_selector(load_selector(args.init), args.init, lineage.reads(want), out_folder(args), None)
    with exclusive(out_folder(args), rank):  # one writer per dataset folder (torchrun: one job)
        build_folder(args, src, rank, world)


BUILDING = ".icl-select-building"  # marks a scratch folder as this kit's: only a marked (or empty) one is removed


def scratch_folder(out: Path) -> Path:
    """`<out>.building`, where a new folder is made before its rename to `out`; a leftover of a killed build (marked,
    or empty: killed before its mark) is removed, anything else stops the run: the kit deletes only what it made."""
    build = out.with_name(out.name + ".building")
    if build.is_dir() and ((build / BUILDING).is_file() or not any(build.iterdir())):
        shutil.rmtree(build)
    elif build.exists():
        raise ValueError(f"{build} exists and was not made by gen_rl_data.py (no {BUILDING} inside); move it away")
    return build


def write_folder(out: Path, meta: dict, items: dict, emb: dict, val_pools: Tensor) -> None:
    """The new folder's files, written under a marked scratch name and renamed: a kill leaves no half-made folder
    behind, and a failure (a full disk) removes the scratch folder."""
    build = scratch_folder(out)
    build.mkdir(parents=True)
    try:
        (build / BUILDING).touch()
        atomic_write_text(build / "items.json", json.dumps(items) + "\n")
        write_stamps(build, items)  # what tells readers the pictures are those embedded (check_pictures)
        save_tensors(build / "embeddings.safetensors", emb)
        pools_doc = {"sampler": meta["sampler"], "pools": val_pools.tolist()}
        atomic_write_text(build / "eval_pools.json", json.dumps(pools_doc))
        atomic_write_text(build / "meta.json", json.dumps(meta, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # prepare_folder found it empty
        build.rename(out)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    (out / BUILDING).unlink()


def build_folder(args: Args, src: Source, rank: int, world: int) -> None:
    """Create, resume or complete the dataset folder: settings check, pools, embeddings, then the scored groups.
    Everything that can refuse (settings, --init, pools and groups) runs before the first file is written."""
    out = out_folder(args)
    if rank == 0 and (not out.exists() or not any(out.iterdir())):
        scratch_folder(out)  # a foreign <out>.building stops the run before any work
    if (out / "items.json").is_file():  # a resumed build's pictures are those it embedded, checked before a model loads
        check_pictures(out, read_items(out / "items.json"))
    open_lvlm(args, src)
    n_train, n_val = len(src.items["train"]), len(src.items["val"])
    want = settings(args, src)
    meta = prepare_folder(out, want)
    sharding.barrier(world)  # every rank has checked the folder before rank 0 creates it

    anchors = torch.randperm(n_train, generator=rng(args.seed, 1))[: args.num_queries]  # (Q,)
    new = meta is None and rank == 0
    emb = embed(args, src.items) if src.emb is None and new else src.emb
    if emb is not None and args.init is not None:
        check_selector(load_selector(args.init), args.init, lineage.reads(want), out, emb["train"].shape[1])
    if emb is not None:  # pools and groups first: whatever refuses does so before a file is written
        anchor_pools, groups, sources = anchor_groups(args, src.items, emb, anchors)
    if new:
        val_pools = make_pools(args, src.items, emb, "val", torch.arange(n_val), torch.full((n_val,), -1), stream=5)
        meta = {"format_version": FORMAT_VERSION, "kind": "icl-select dataset", **want, "settings": want}
        if getattr(src.backend, "check", None) is not None:  # the real backend against plain transformers
            meta["self_check"] = src.backend.check
        created = datetime.now(UTC).isoformat(timespec="seconds")
        write_folder(out, {**meta, "complete": False, "created_at": created}, src.items, emb, val_pools)
    sharding.barrier(world)
    meta = read_meta(out)
    if emb is None:  # a real dataset's embeddings and pictures' digests, computed once and stored in the folder
        src.items = read_items(out / "items.json")
        emb = read_embeddings(out / "embeddings.safetensors", {"train": n_train, "val": n_val})
        anchor_pools, groups, sources = anchor_groups(args, src.items, emb, anchors)

    # This rank's share of what is left; its lines go to rl_data.jsonl, or to its own shard under torchrun.
    path = out / ("rl_data.jsonl" if world == 1 else f"rl_data.rank{rank}.jsonl")
    done = scored_queries(out)
    todo = [i for i in sharding.share(len(anchors), rank, world) if int(anchors[i]) not in done]
    rate = None
    if todo:
        rate = score_queries(args, src.backend, path, todo, anchors, anchor_pools, groups, sources, rank, world)

    sharding.barrier(world)
    if rank == 0:
        changed = bool(todo)
        lines = (out / "rl_data.jsonl").read_text().count("\n") if (out / "rl_data.jsonl").exists() else 0
        done = scored_queries(out)  # every rank's lines, read once
        if shard_files(out) or lines != len(done):  # shards to merge, or a query written twice
            merge_shards(out, anchors, done)  # one line per query, in anchor order
            changed = True
        if missing := sum(q not in done for q in anchors.tolist()):
            raise ValueError(f"{out}: {missing} anchor queries are still unscored; re-run the same command to finish")
        if not meta["complete"]:
            meta.update(complete=True, counts={"train": n_train, "val": n_val, "anchors": len(anchors)})
            meta["lvlm_calls"] = data_calls(meta)
            if rate is not None and not is_sim(args):  # this process's LVLM sequences a second, readable after the run
                meta["lvlm_seq_per_s"] = round(rate, 3)
            if is_sim(args):
                meta["calibration"] = calibration(args, src.backend.sim)
            atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
            changed = True
        label = "simulated LVLM" if is_sim(args) else f"LVLM {args.lvlm}"
        what = f"{len(anchors)} anchor queries x {args.group_size} sequences, {n_val} val queries; {label}"
        print(f"wrote {out} ({what})" if changed else f"{out} is complete ({what}); left as it is")
    sharding.finish(world)


# ----------------------------------------------------------------------------------------------------------------------
# Calibration and report


def calibration_table(cal: dict, seq_len: int) -> str:
    rows = ["| ICDs | " + " | ".join(f"{k}-shot" for k in range(1, seq_len + 1)) + " |", "|---|" + "---|" * seq_len]
    names = (("random", "random"), ("similar", "most similar"), ("oracle", "oracle"), ("observable", "observable"))
    for name, label in names:
        rows.append(f"| {label} | " + " | ".join(f"{cal[f'{name}_{k}']:.2f}" for k in range(1, seq_len + 1)) + " |")
    for name in ("oracle", "observable"):  # the best of 0..k (in brackets: the demonstrations it uses on average)
        cells = [f"{cal[f'{name}_upto_{k}']:.2f} ({cal[f'{name}_shots_{k}']:.2f})" for k in range(1, seq_len + 1)]
        rows.append(f"| {name}, up to k (shots used) | " + " | ".join(cells) + " |")
    rows.append(
        f"\nzero-shot: {cal['zero_shot']:.2f}; anchors whose sequences differ in reward: "
        f"{100 * cal['varying_reward_frac']:.1f}%"
    )
    return "\n".join(rows)


def quantiles(x: Tensor) -> str:
    q = torch.quantile(x.double(), torch.tensor([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0], dtype=torch.float64))
    return " | ".join(f"{v:.3f}" for v in q.tolist())


def report(folder: Path, args: Args) -> str:
    ds = load_dataset(folder, allow_unfinished=True)
    g = ds.groups
    m = g.seq_mask
    sizes = m.sum(-1).tolist()
    correct = (g.fields["correct"] > 0) & m
    reward = compute_reward(g.fields, args)
    varies = (reward_spread(reward, m) > 0).double().mean()
    labels = quality_labels(g, reward)
    lines = [
        f"# Data report: {folder}" + (" (simulated LVLM)" if ds.is_sim else f" ({ds.meta.get('lvlm')})"),
        "",
        "| | |",
        "|---|---|",
        f"| anchor queries | {len(g)}" + f" of {ds.meta['num_queries']}: UNFINISHED" * (not ds.meta["complete"]) + " |",
        f"| scored sequences | {int(m.sum())} |",
        f"| group size min / median / max | {min(sizes)} / {statistics.median(sizes):g} / {max(sizes)} |",
        f"| correct sequences | {100 * correct.sum() / m.sum():.1f}% |",
        f"| queries with >= 1 correct sequence | {100 * correct.any(-1).double().mean():.1f}% |",
        f"| queries whose rewards vary ({args.reward_mode}) | {100 * varies:.1f}% |",
        "",
        "## Reward quantiles per mode",
        "",
        "| mode | min | 10% | 25% | 50% | 75% | 90% | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in REWARD_MODES:
        r = compute_reward(g.fields, RewardArgs(mode, args.hard_weight, args.soft_weight, args.rel_weight))
        lines.append(f"| {mode} | {quantiles(r[m])} |")
    lines += ["", f"## Query quality ({args.reward_mode})", "", "| quality | queries | share |", "|---|---|---|"]
    for q, *_, rule in (*QUALITY_TIERS, ("low", "the rest")):
        n = labels.count(q)
        lines.append(f"| {q} ({rule}) | {n} | {100 * n / len(labels):.1f}% |")
    if "calibration" in ds.meta:
        table = caption_calibration_table if ds.meta["task"] == "caption" else calibration_table
        lines += ["", f"## Simulator calibration (val queries, {METRIC[ds.meta['task']]})", ""]
        lines.append(table(ds.meta["calibration"], CAPTION_SHOTS if ds.meta["task"] == "caption" else ds.seq_len))
    return "\n".join(lines)


def calibration(args: Args, sim: Simulator | CaptionSimulator) -> dict:
    """The simulator against its calibration targets (docs/worlds.md)."""
    if args.task == "caption":  # at the shot counts captioning papers report
        return calibrate_caption(sim, args.pool_size, CAPTION_SHOTS, args.seed)
    return calibrate(sim, args.pool_size, args.group_size, args.seq_len, args.num_queries, args.seed)


def main(args: Args) -> None:
    if args.report is not None:
        print(report(args.report, args))
    elif args.calibrate:
        check_args(args)
        sim = make_sim(args)
        cal = calibration(args, sim)
        print(f"Simulated LVLM calibration, world {sim.cfg.world} (val queries, {METRIC[args.task]})\n")
        table = caption_calibration_table if args.task == "caption" else calibration_table
        print(table(cal, CAPTION_SHOTS if args.task == "caption" else args.seq_len))
    else:
        generate(args)


if __name__ == "__main__":
    run_cli(main, Args)
