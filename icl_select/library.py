"""A trained selector at work: demonstrations for any picture and question, from a library of demonstrations you keep.

    demos = Demonstrations.from_run("runs/grpo-kl0.1")            # a run folder, or a Hub id with library= and encoder=
    picked = demos.pick("photo.jpg", "What is the man holding?")   # [Demo(row, question_id, image_id, image, question,
                                                                   #       answers, prob), ...] in prompt order
    lvlm = demos.lvlm()                                            # the run's LVLM with its recorded prompt layout
    lvlm.generate([demos.example("photo.jpg", "What is the man holding?", picked)])

A `Library` is items (question, annotator answers, picture) and their CLIP embeddings: the train split of the run's own
dataset folder, another dataset folder of the kit, or OK-VQA / VQAv2 files (official or parquet) embedded once and
cached in `<folder>/.icl-select/`, in a file named by the digest of the items, their pictures' bytes and the encoder (id
and revision): a changed library is embedded again, never silently reused. A query is embedded by the run's encoder,
its pool built as the run built its pools (`pools.query_pools` with the run's sampler and pool size: the top n a chunk
of the library at a time, never one question on the query's picture), and the selector decodes greedily as evaluate.py
does (`validation.greedy_icds`), the picks put in the prompt order it was trained with. A random-sampler run draws a
query's pool from a generator seeded by the run's seed and the query itself (its question and its picture's pixels):
the same question on the same picture gets the same demonstrations, alone or in any batch; `sampler="image"` builds
similarity pools instead.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from icl_select import lineage, pools
from icl_select.backends import LVLMRun, open_backend
from icl_select.data import DATA_FILES, data_digest, read_embeddings, read_eval_pools, read_items, read_meta
from icl_select.files import DataError, atomic_write_bytes, save_tensors
from icl_select.pictures import picture_digest, picture_digests, pixel_digest, same_picture_ids
from icl_select.runs import check_selector
from icl_select.validation import greedy_icds
from icl_select.vqa import shown_answer
from icl_select.vqa_data import check_images, load_vqa_split
from model import PointerSelector

__all__ = ["CACHE", "Demo", "Demonstrations", "Library"]

CACHE = ".icl-select"  # a library's embedding cache, inside its folder
VIEWS = {"random": (), "image": ("image",), "text": ("text",), "mix": ("image", "text")}  # what each sampler compares


@dataclass(frozen=True)
class Demo:
    """One chosen demonstration: a library item and the selector's probability of picking it at its step."""

    row: int  # the item's row in the library
    question_id: int | str
    image_id: int
    image: str | None  # the picture's file (None on the simulator)
    question: str  # "" for a picture to caption
    answers: list[str]  # every annotator answer, or every reference caption
    prob: float
    task: str = "vqa"
    picture: str | None = None  # its picture's pixel digest (pictures.pixel_digest), where the library knows it

    @property
    def answer(self) -> str:
        """What the kit's prompt shows: the annotators' most common answer, or a caption's first reference."""
        return shown_answer(self.answers, self.task)

    @property
    def item(self) -> dict:
        """The item as the LVLM backend reads it (`LVLMBackend.messages`, `generate`, `score_examples`)."""
        keys = {"question_id": self.question_id, "image_id": self.image_id, "question": self.question}
        picture = {"image": self.image} if self.image is not None else {}
        picture |= {"picture": self.picture} if self.picture is not None else {}
        return keys | {"answers": self.answers} | picture


# ----------------------------------------------------------------------------------------------------------------------
# The library


@dataclass(eq=False)  # compared by identity: its fields hold tensors
class Library:
    """Demonstrations to pick from: items and their embeddings, all (N, d) float32 rows in item order: "fused" (what
    the selector reads), "image" and "text" (what similarity samplers compare)."""

    items: list[dict]
    emb: dict[str, Tensor]
    encoder: str  # what embedded them: a model id or folder, or "sim"
    encoder_revision: str | None = None  # the encoder's Hub commit, or its folder's digest (None: the simulator)
    task: str = "vqa"
    where: str = "the library"  # how messages name it
    meta: dict | None = None  # the meta.json of the dataset folder it comes from
    folder: Path | None = None  # that folder (its train split is this library)
    image_ids: Tensor = field(init=False, repr=False)  # (N,) each item's picture (pictures.same_picture_ids)
    sorted_image_ids: Tensor = field(init=False, repr=False)  # (N,) the same, ascending: a picture's questions count
    by_pixels: dict[str, int] = field(init=False, repr=False)  # a picture's pixel digest -> its picture id

    def __post_init__(self):
        n = len(self.items)
        if n == 0 or "fused" not in self.emb:
            raise ValueError(f"{self.where}: a library needs items and their 'fused' embeddings")
        for name, t in self.emb.items():
            if t.dim() != 2 or t.shape != self.emb["fused"].shape or t.shape[0] != n:
                raise ValueError(
                    f"{self.where}: embeddings {name!r} are {tuple(t.shape)}, expected ({n}, d) like 'fused', one row "
                    "per item"
                )
        # Pictures are who their pixels are: a query on a copy of a library picture, a link to it or its PIL image is
        # on that picture (items of a dataset folder carry their digest; others are decoded once)
        digests = [it.get("picture") or (picture_digest(it["image"]) if "image" in it else None) for it in self.items]
        ids = same_picture_ids([it["image_id"] for it in self.items], digests)
        self.image_ids = torch.tensor(ids, dtype=torch.long)
        self.sorted_image_ids = self.image_ids.sort().values
        self.by_pixels = {d: i for d, i in zip(digests, ids) if d is not None}

    @property
    def dim(self) -> int:
        return self.emb["fused"].shape[1]

    @property
    def reads(self) -> dict:
        """The task and the encoder's identity (lineage.reads), as a selector that picks from it must have them."""
        return lineage.reads({"task": self.task, "encoder": self.encoder, "encoder_revision": self.encoder_revision})

    @classmethod
    def from_dataset(cls, folder: str | Path, encoder: str | None = None, device: str = "auto") -> Library:
        """The train split of a dataset folder of the kit, with the folder's own embeddings; with another `encoder`,
        its items embedded by that one (cached in the folder)."""
        folder = Path(folder)
        if not (folder / "meta.json").is_file():
            raise DataError(
                f"{folder}: not a dataset folder of the kit (no meta.json); OK-VQA or VQAv2 files are a library "
                "through Library.from_vqa"
            )
        meta = read_meta(folder)
        items = read_items(folder / "items.json")
        own, task = meta.get("encoder"), meta["task"]
        if encoder is None or encoder == own:
            emb = read_embeddings(folder / "embeddings.safetensors", {s: len(v) for s, v in items.items()})
            views = {"fused": emb["train"]} | {v: emb[f"train_{v}"] for v in ("image", "text") if f"train_{v}" in emb}
            return cls(items["train"], views, own, meta.get("encoder_revision"), task, str(folder), meta, folder)
        if meta["source"] == "sim":
            raise ValueError(f"{folder}: a simulated dataset has no pictures for {encoder} to embed")
        emb, revision = embedded(items["train"], task, folder / CACHE, "train", encoder, device)
        return cls(items["train"], emb, encoder, revision, task, f"{folder} (embedded by {encoder})", meta, folder)

    @classmethod
    def from_vqa(
        cls,
        dataset: str,
        data_root: str | Path,
        encoder: str,
        split: str = "train",
        device: str = "auto",
        questions: str | None = None,
        annotations: str | None = None,
        images: str | None = None,
    ) -> Library:
        """A split of OK-VQA or VQAv2 (the official files and COCO pictures, or a parquet export, as gen_rl_data.py
        reads them), embedded by `encoder` once and cached in `<data_root>/.icl-select/`."""
        items = load_vqa_split(dataset, Path(data_root), split, questions, annotations, images)
        return cls.of_split(items, "vqa", dataset, split, Path(data_root), encoder, device)

    @classmethod
    def from_captions(
        cls,
        dataset: str,
        data_root: str | Path,
        encoder: str,
        split: str = "train",
        device: str = "auto",
        captions: str | None = None,
        images: str | None = None,
    ) -> Library:
        """A split of COCO captions (2014, 2017, Karpathy's; official files or a parquet export, as gen_rl_data.py
        --task caption reads them), embedded by `encoder` as a captioning selector reads them, once, cached in
        `<data_root>/.icl-select/`."""
        from icl_select.caption_data import load_caption_split

        items = load_caption_split(dataset, Path(data_root), split, captions, images)
        return cls.of_split(items, "caption", dataset, split, Path(data_root), encoder, device)

    @classmethod
    def of_split(
        cls, items: list[dict], task: str, dataset: str, split: str, data_root: Path, encoder: str, device: str
    ) -> Library:
        """A split of a dataset's files, its items embedded by `encoder` for `task` once, cached in
        `<data_root>/.icl-select/`."""
        emb, revision = embedded(items, task, data_root / CACHE, f"{dataset}-{split}", encoder, device)
        return cls(items, emb, encoder, revision, task, f"{dataset} {split} of {data_root}")


def library_digest(items: list[dict], pictures: dict[str, str], task: str, encoder: str, revision: str) -> str:
    """What a library's embeddings are made from: the task (what a selector reads of an item), the encoder (its Hub
    commit or its folder's digest) and every item with its picture's pixels (not its path, so a moved library keeps
    its embeddings)."""
    h = hashlib.sha256(json.dumps([task, encoder, revision]).encode())
    for it in items:
        made_of = [it["question_id"], it["image_id"], it["question"], it["answers"], pictures[it["image"]]]
        h.update(json.dumps(made_of).encode())
    return h.hexdigest()[:16]


def embedded(
    items: list[dict], task: str, cache: Path, name: str, encoder: str, device: str
) -> tuple[dict[str, Tensor], str]:
    """`clip.task_embed` of the items, read from `cache/<name>-<encoder>-<digest>.safetensors` when their digest is
    unchanged, else computed and written there (the files of older digests removed); and the encoder's revision."""
    from icl_select.clip import task_embed
    from icl_select.hf import resolve_model

    revision = resolve_model(encoder)[1]
    cache.mkdir(parents=True, exist_ok=True)
    encoder_name = re.sub(r"[^\w.-]+", "-", Path(encoder.rstrip("/")).name)
    stem = f"{name}-{encoder_name}-{hashlib.sha256(encoder.encode()).hexdigest()[:8]}"
    pictures = picture_digests([it["image"] for it in items], cache / f"{name}-pixels.json")
    for it in items:  # who each item's picture is, so that the library knows it without decoding it again
        it["picture"] = pictures[it["image"]]
    path = cache / f"{stem}-{library_digest(items, pictures, task, encoder, revision)}.safetensors"
    if path.is_file():
        return read_embeddings(path, dict.fromkeys(("fused", "image", "text"), len(items))), revision
    emb = task_embed(items, task, encoder, device)
    save_tensors(path, emb)
    for old in cache.glob(f"{stem}-*.safetensors"):
        if old != path:
            old.unlink()
    return emb, revision


# ----------------------------------------------------------------------------------------------------------------------
# The selector at work


def run_data(config: dict, library) -> tuple[Path | None, str]:
    """The dataset folder a run was trained on, recognised by the digest its config.json records (the library, when it
    is a folder, may be it), or None and why."""
    recorded = config.get("data") if isinstance(config.get("data"), dict) else {}
    folder, digest = recorded.get("folder"), recorded.get("digest")
    if not folder or not digest:
        return None, "it does not name the dataset it was trained on (no config.json field 'data.folder')"
    here = {
        Path(f): data_digest(Path(f))
        for f in (library, folder)
        if isinstance(f, str | os.PathLike) and all((Path(f) / n).is_file() for n in ("meta.json", *DATA_FILES))
    }
    if found := [f for f, d in here.items() if d == digest]:
        return found[0], ""
    if (now := here.get(Path(folder))) is not None:
        return None, f"its dataset folder {folder} changed since training (digest {digest} in config.json, {now} now)"
    return None, f"its dataset folder {folder} (config.json field 'data.folder') is not here"


def stable_seed(*parts: bytes) -> int:
    """A generator seed in [0, 2**63) from bytes: the same parts give the same seed on every machine."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return int.from_bytes(h.digest()[:8], "little") >> 1


@dataclass(eq=False)
class Demonstrations:
    """A selector and the library it picks from, with the run's pool settings (`from_run` reads them).

    What it returns is the selector's own choice, as evaluate.py scores it: a selector trained to fill its slots
    gives k demonstrations; one that may stop (rce.py --can-stop) gives up to k, fewer or none where it stops, as
    eval/<split>-upto.json holds them, and exactly k with `exactly=True`, as eval/<split>.json does. Every
    demonstration is an item of the library, never a placeholder."""

    selector: PointerSelector
    library: Library
    sampler: str  # how a query's pool is built (pools.SAMPLERS)
    pool_size: int  # candidates per pool (fewer where the library holds fewer)
    seed: int = 0  # the run's data seed: random pools are drawn from it and the query
    meta: dict | None = None  # the run's dataset meta.json, where its folder is here
    data: Path | None = None  # that folder
    source: str = "the selector"  # the run folder or Hub id, for messages
    device: str = "auto"  # where queries are embedded
    query_pictures: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)  # PIL queries
    val: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False)  # the run's val embeddings, pools

    def __post_init__(self):
        if self.sampler not in pools.SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r}: expected one of {pools.SAMPLERS}")
        if self.pool_size < 1:
            raise ValueError(f"pool_size {self.pool_size}: expected >= 1")
        if missing := [v for v in VIEWS[self.sampler] if v not in self.library.emb]:
            raise ValueError(f"{self.library.where}: no {missing[0]!r} embeddings for the {self.sampler} sampler")
        # the selector was trained for the library's task, on embeddings of its encoder (its model.json says)
        check_selector(self.selector, Path(self.source), self.library.reads, self.library.where, self.library.dim)
        if self.task == "caption" and self.sampler in ("text", "mix"):
            raise ValueError(f"sampler {self.sampler!r} compares questions; a picture to caption has none")
        self.selector.eval()

    @classmethod
    def from_run(
        cls,
        run: str | Path,
        library: Library | str | Path | None = None,
        encoder: str | None = None,
        sampler: str | None = None,
        pool_size: int | None = None,
        device: str = "auto",
        revision: str | None = None,
    ) -> Demonstrations:
        """The selector of a run folder or Hub id (`revision` of the Hub repository), the library to pick from (by
        default the train split of the run's dataset folder; a dataset folder of the kit; or a `Library`), and the
        run's task, encoder and pool settings from that folder's meta.json, or the copy in the run's config.json where
        the folder is not here (a Hub download carries none: then name the library). `sampler` and `pool_size` build
        other pools than the run's."""
        selector = PointerSelector.from_pretrained(run, revision=revision)
        config = json.loads((selector.run_files or {}).get("config.json", b"{}"))
        data, why = run_data(config, library)
        meta = read_meta(data) if data is not None else config.get("dataset")  # config.json copies its settings
        if not isinstance(meta, dict) or not {"task", "encoder", "sampler", "pool_size"} <= set(meta):
            raise ValueError(
                f"{run}: its config.json does not record the task, encoder and pools it was trained with (field "
                "'dataset'), and its dataset folder is not here; use a run folder of this kit"
            )
        if encoder is not None and encoder != meta["encoder"]:
            raise ValueError(f"{run} was trained on embeddings of {meta['encoder']}, not of {encoder}")
        encoder, trained = meta["encoder"], meta.get("encoder_revision")
        if library is None and data is None:
            raise ValueError(f"{run}: {why}; name the library to pick from (Demonstrations.from_run(..., library=...))")
        if library is None:
            library = Library.from_dataset(data)
        elif not isinstance(library, Library):
            library = Library.from_dataset(library, encoder, device)
        if (library.encoder, library.encoder_revision) != (encoder, trained):
            raise ValueError(
                f"{library.where} was embedded by {library.encoder} (revision {library.encoder_revision}), but {run} "
                f"was trained on embeddings of {encoder} (revision {trained}); embed the library with that encoder "
                "(Library.from_dataset, from_vqa or from_captions with encoder=...)"
            )
        if encoder != "sim":  # the encoder that embeds the queries here must be the one the run was trained with
            from icl_select.hf import resolve_model

            if (here := resolve_model(encoder)[1]) != trained:
                fix = (
                    "restore the weights it was trained with"
                    if Path(encoder).expanduser().is_dir()
                    else f"`hf download {encoder} --revision {trained}` first"
                )
                raise ValueError(f"{encoder} is {here} here, but {run} was trained on embeddings of {trained}; {fix}")
        sampler, pool_size = sampler or meta["sampler"], pool_size or meta["pool_size"]
        return cls(selector, library, sampler, pool_size, meta.get("seed", 0), meta, data, str(run), device)

    @property
    def task(self) -> str:
        """What the selector picks for ("vqa", "caption"): its library's task, which is its own (`__post_init__`)."""
        return self.library.task

    # -- picking -------------------------------------------------------------------------------------------------------
    def pick(self, image, question: str | None = None, k: int | None = None, exactly: bool = False) -> list[Demo]:
        """The demonstrations for a picture (a file path or a PIL image) and its question (none for a picture to
        caption), in prompt order (the last one next to the query): k of them (default: as many as the selector was
        trained to pick), or up to k for a selector that may stop, unless `exactly`."""
        return self.pick_batch([image if self.task == "caption" else (image, question)], k, exactly)[0]

    def pick_batch(self, queries: Sequence, k: int | None = None, exactly: bool = False) -> list[list[Demo]]:
        """`pick` for many queries, (picture, question) pairs or, for captions, pictures: the encoder loads once per
        call."""

        from icl_select.clip import task_embed

        if self.library.encoder == "sim":
            raise ValueError(
                f"{self.source} is a simulator run: its questions have no pictures to embed; pick for its validation "
                "questions with pick_val(rows), or for embeddings with pick_embedded"
            )
        items, keys, same_picture = [], [], []  # same_picture: the library's picture the query shows, if any
        for i, query in enumerate(queries):
            image, question = self.query(i, query)
            path, pixels = self.picture(image)
            items.append({"image": path, "question": question})
            keys.append(stable_seed(str(self.seed).encode(), bytes.fromhex(pixels), question.encode()))
            same_picture.append(self.library.by_pixels.get(pixels, self.no_picture))
        if not items:
            return []
        emb = task_embed(items, self.task, self.library.encoder, self.device)
        return self.pick_embedded(emb, k, torch.tensor(same_picture), keys, exactly)

    def query(self, i: int, query) -> tuple[object, str]:
        """Query `i` of a batch as (picture, question): a (picture, question) pair, or for captions a picture."""
        if self.task == "caption":
            if isinstance(query, tuple):
                raise ValueError(
                    f"query {i}: {self.source} captions pictures; give each query as a picture alone, not {query!r}"
                )
            image, question = query, ""
        else:
            if not (isinstance(query, tuple) and len(query) == 2):
                raise ValueError(f"query {i}: expected a (picture, question) pair, got {query!r}")
            image, question = query
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"query {i}: expected a question, got {question!r}")
        if image is None:
            raise ValueError(f"query {i} has no picture: {self.source} picks demonstrations for a picture")
        return image, question

    def pick_embedded(
        self,
        emb: dict[str, Tensor],
        k: int | None = None,
        image_ids: Tensor | None = None,
        keys: list[int] | None = None,
        exactly: bool = False,
    ) -> list[list[Demo]]:
        """Demonstrations for queries given as embeddings, as `clip.task_embed` returns them: "fused" (B, d), and the
        "image" / "text" views the sampler compares. `image_ids` (B,): the library's items on these pictures stay out
        of the pools (default: none); `keys` seed the random pools (default: from each query's embedding); `k` and
        `exactly` as in `pick`."""
        fused = emb["fused"]
        n = fused.shape[0]
        for name, t in emb.items():
            if t.shape != (n, self.library.dim) or not torch.isfinite(t).all():
                raise ValueError(
                    f"query embeddings {name!r}: expected finite ({n}, {self.library.dim}), got {tuple(t.shape)}"
                )
        if missing := [v for v in VIEWS[self.sampler] if v not in emb]:
            raise ValueError(f"query embeddings: the {self.sampler} sampler needs {missing[0]!r} embeddings too")
        ids = torch.full((n,), self.no_picture) if image_ids is None else image_ids
        if keys is None:
            keys = [stable_seed(str(self.seed).encode(), row.numpy().tobytes()) for row in fused.float()]
        k = self.steps(k)
        found = {}
        for rows, pool in self.pools(emb, ids, keys, k):
            found.update(zip(rows.tolist(), self.decode(fused, rows, pool, k, exactly)))
        return [found[i] for i in range(n)]

    def pick_val(self, rows: Sequence[int] | Tensor, k: int | None = None, exactly: bool = False) -> list[list[Demo]]:
        """Demonstrations for validation questions of the run's own dataset, from their pools in eval_pools.json:
        exactly what evaluate.py picks for them at k shots (eval/val.json with `exactly`, eval/val-upto.json
        without, for a selector that may stop)."""
        if self.data is None or self.library.folder != self.data or self.library.encoder != self.meta["encoder"]:
            raise ValueError(f"pick_val picks from the evaluation pools of {self.source}'s own dataset folder")
        if self.val is None:
            items = read_items(self.data / "items.json")
            emb = read_embeddings(self.data / "embeddings.safetensors", {s: len(v) for s, v in items.items()})
            val_pools = read_eval_pools(self.data / "eval_pools.json", len(items["val"]), len(items["train"]))
            self.val = emb["val"], val_pools
        rows = torch.as_tensor(rows, dtype=torch.long)
        return self.decode(self.val[0], rows, self.val[1][rows], self.steps(k), exactly)

    # -- the pieces ----------------------------------------------------------------------------------------------------
    @property
    def no_picture(self) -> int:
        """An image id that no library item has: a query's picture that is none of the library's."""
        return int(self.library.sorted_image_ids[0]) - 1

    def steps(self, k: int | None) -> int:
        picks = self.selector.cfg.picks
        k = picks if k is None else k
        if not 1 <= k <= picks:
            raise ValueError(f"k={k}: {self.source} makes 1 to {picks} picks (model.json field 'picks')")
        return k

    def pools(self, emb: dict[str, Tensor], image_ids: Tensor, keys: list[int], k: int) -> list[tuple[Tensor, Tensor]]:
        """Each query's pool (`pools.query_pools`), grouped by size: [(query indices (n,), library rows (n, K))]. A
        pool holds pool_size rows, or every row not on the query's picture where the library has fewer."""
        lib_ids, ordered = self.library.image_ids, self.library.sorted_image_ids  # (N,) each
        on_picture = torch.searchsorted(ordered, image_ids, right=True) - torch.searchsorted(ordered, image_ids)  # (B,)
        size = (len(lib_ids) - on_picture).clamp(max=self.pool_size)  # (B,)
        if (size < k).any():
            i = int((size < k).nonzero()[0, 0])
            raise ValueError(
                f"{self.library.where} holds {int(size[i])} demonstrations not on the picture of query {i}, fewer than "
                f"the {k} asked for"
            )
        views = {f"train_{v}": self.library.emb[v] for v in VIEWS[self.sampler]}
        views |= {f"query_{v}": emb[v] for v in VIEWS[self.sampler]}
        image_ids = {"train": lib_ids, "query": image_ids}
        out = []
        for K in size.unique().tolist():
            rows = (size == K).nonzero()[:, 0]  # (n,)
            none = torch.full((len(rows),), -1)  # no query is a library row
            if self.sampler == "random":  # each query's own generator: its pool does not depend on the batch
                one = [(torch.tensor([q]), torch.Generator().manual_seed(keys[q])) for q in rows.tolist()]
                made = [pools.query_pools("random", K, views, image_ids, "query", q, none[:1], g) for q, g in one]
                out.append((rows, torch.cat(made)))
            else:
                g = torch.Generator()  # unused: similarity pools draw nothing
                out.append((rows, pools.query_pools(self.sampler, K, views, image_ids, "query", rows, none, g)))
        return out

    @torch.no_grad()
    def decode(self, query: Tensor, rows: Tensor, pool: Tensor, k: int, exactly: bool) -> list[list[Demo]]:
        """The selector's greedy picks for the queries `query[rows]` from their pools (n, K) of library rows, as
        evaluate.py decodes them (up to k, or `exactly` k), in prompt order, each with its probability at its step."""
        lib = self.library.emb["fused"]
        view = SimpleNamespace(emb={"query": query, "train": lib})
        picks = greedy_icds(self.selector, view, "query", rows, pool, k, k if exactly else 0)  # (n, k), -1 after a stop
        at = (pool[:, None, :] == picks[:, :, None]).long().argmax(-1).where(picks >= 0, -1)  # (n, k) pool positions
        probs = []
        for c in pools.pool_chunks(*pool.shape, lib.shape[1]):
            one = torch.ones(len(c), 1, dtype=torch.bool)
            pool_emb = lib[pool[c].clamp_min(0)]  # (c, K, d)
            steps = self.selector.log_probs(query[rows[c]], pool_emb, pool[c] >= 0, at[c][:, None], one)  # (c, 1, k)
            probs.append(steps[:, 0].exp())  # (c, k); a stop's step holds the stop's probability
        # each query's steps in prompt order: the picks alone, never the stop nor the -1 after it
        order = self.selector.cfg.to_prompt(torch.arange(k).expand_as(picks).where(picks >= 0, -1))  # (n, k)
        chosen, probs = picks.gather(1, order.clamp_min(0)), torch.cat(probs).gather(1, order.clamp_min(0))
        return [
            [self.demo(r, p) for r, p, o in zip(rs, ps, os) if o >= 0]
            for rs, ps, os in zip(chosen.tolist(), probs.tolist(), order.tolist())
        ]

    def demo(self, row: int, prob: float) -> Demo:
        it = self.library.items[row]
        image, answers = it.get("image"), it["answers"]
        return Demo(
            row, it["question_id"], it["image_id"], image, it["question"], answers, prob, self.task, it.get("picture")
        )

    def picture(self, image) -> tuple[str, str]:
        """A query's picture (a file or a PIL image) as a file named by its pixels, which the encoder and the LVLM read
        (never a stale copy of a file that changed since it was read), and the digest of those pixels
        (`pictures.pixel_digest`)."""
        from PIL import Image

        if isinstance(image, Image.Image):
            rgb = image.convert("RGB")
        else:
            check_images([str(image)], "given as a query")
            with Image.open(image) as img:
                rgb = img.convert("RGB")
        pixels = pixel_digest(rgb)
        if self.query_pictures is None:
            self.query_pictures = tempfile.TemporaryDirectory(prefix="icl-select-queries-")
        path = Path(self.query_pictures.name) / f"{pixels[:32]}.png"
        if not path.is_file():
            png = io.BytesIO()
            rgb.save(png, format="PNG", compress_level=1)
            atomic_write_bytes(path, png.getvalue())
        return str(path), pixels

    # -- into an LVLM --------------------------------------------------------------------------------------------------
    def example(self, image, question: str | None, demos: list[Demo]) -> tuple[dict, list[dict]]:
        """(query item, demonstration items) as the LVLM backend takes a prompt (`LVLMBackend.generate`, `messages`);
        the question None for a picture to caption."""
        return {"question": question or "", "image": self.picture(image)[0]}, [d.item for d in demos]

    def lvlm(self, model: str | None = None, options: LVLMRun | None = None):
        """The run's LVLM (or `model`) as the kit scores with it: `lvlm.LVLMBackend` with the prompt layout and
        generation settings recorded in the run's meta.json, self-checked against plain transformers on the library."""
        if self.meta is None:
            raise ValueError(
                f"{self.source}: its prompt layout is recorded in its dataset folder's meta.json, which is not here"
            )
        if self.meta["source"] == "sim":
            raise ValueError(f"{self.source} is a simulator run: the simulated LVLM answers no real question")
        return open_backend(self.meta, {"train": self.library.items}, {}, options or LVLMRun(), model)
