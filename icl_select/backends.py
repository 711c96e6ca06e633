"""LVLM backends behind one interface: score a query given an ordered list of ICDs.

    backend.score(split, queries (N,), icds (N, k) train rows, gt_prob=True) -> {"prediction": [str], "acc",
                                                              "correct", "gt_prob", "rel": (N,) tensors}
    backend.info_prob(split, queries, icds) -> (N,) InfoScore's P(y | ICDs, x) (gen_rl_data.py --groups infoscore)
    backend.describe() -> dict recorded in meta.json / eval files (id, revision, prompt template, generation args)

`SimBackend` wraps the built-in simulator (default, CPU, instant); `lvlm.LVLMBackend` runs a transformers LVLM
(Qwen2.5-VL & co.) and is imported only when asked for, so simulator runs never load transformers.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, fields
from typing import Annotated, Literal

import torch
from torch import Tensor

from icl_select import lineage, sharding
from icl_select.cli import SIDE, default_is
from icl_select.data import SEQ_FIELDS
from icl_select.sim import SPLITS, SimConfig, Simulator
from icl_select.sim_caption import CaptionConfig, CaptionSimulator


class SimBackend:
    """The simulated LVLM; every output it produces is labelled as simulation."""

    def __init__(self, sim: Simulator):
        self.sim = sim

    def score(self, split: str, queries: Tensor, icds: Tensor, gt_prob: bool = True) -> dict:
        """The simulator's scores (gt_prob is free here). Rows may hold -1 after their last demonstration (prompts of
        several lengths, none included): each length is asked in one call, the results put back in the rows' order."""
        n = (icds >= 0).sum(-1)  # (N,) demonstrations per prompt
        if bool((n == icds.shape[1]).all()):
            return self.sim.score(split, queries, icds)
        out: dict = {}
        for length in n.unique().tolist():
            rows = (n == length).nonzero()[:, 0]
            for key, value in self.sim.score(split, queries[rows], icds[rows, :length]).items():
                if isinstance(value, list):  # predictions
                    kept = out.setdefault(key, [""] * len(n))
                    for i, v in zip(rows.tolist(), value):
                        kept[i] = v
                else:
                    out.setdefault(key, value.new_zeros(len(n)))[rows] = value
        return out

    def info_prob(self, split: str, queries: Tensor, icds: Tensor) -> Tensor:
        """InfoScore's P(y | ICDs, x): the simulated answer's probability of a credited answer (the simulated caption's
        of the query's first reference)."""
        return self.sim.score(split, queries, icds)["gt_prob"]

    def describe(self) -> dict:
        return {"lvlm": "sim", "simulation": True, "sim_config": asdict(self.sim.cfg)}


@dataclass
class LVLMRun:
    """How a real LVLM runs in this process: speed and memory, never results (so not recorded with them)."""

    lvlm_batch_size: int = 0
    """Real LVLM: prompts per forward pass at most (0 = 64 on a GPU, 8 on the CPU)."""
    lvlm_batch_tokens: int = 0
    """Real LVLM: padded prompt tokens per forward pass at most, a memory bound (0 = on a GPU, what half its memory
    left after loading holds; none on the CPU)."""
    lvlm_workers: Annotated[int, SIDE] = 0
    """Real LVLM: threads that prepare pictures ahead of the model (0 = one per core, shared by a machine's ranks)."""
    device: str = "auto"
    """Real LVLM: auto = this rank's CUDA device in bf16 if present, else CPU float32."""
    image_cache_mib: Annotated[int, SIDE] = 4096
    """Real LVLM: memory per process for decoded and preprocessed pictures (half each)."""
    encoder_cache_mib: Annotated[int | None, SIDE, default_is("a quarter of a GPU's free memory, or 4096")] = None
    """Real LVLM: GPU memory per process for vision-encoder outputs (Qwen family; 0 = off)."""
    lvlm_compile: bool = True
    """Real LVLM on CUDA in half precision: torch.compile its norms, MLPs and vision blocks (fused kernels)."""
    skip_self_check: Annotated[bool, SIDE] = False
    """Real LVLM: skip the self-check against plain transformers (docs/real-models.md)."""


def check_lvlm_run(run: LVLMRun) -> None:
    least = {"lvlm_batch_size": 0, "image_cache_mib": 1, "lvlm_batch_tokens": 0, "lvlm_workers": 0}
    for name, lo in (least | {"encoder_cache_mib": 0}).items():
        if getattr(run, name) is not None and getattr(run, name) < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(run, name)}")


# Per task: the demonstration's and the query's text after their images (single-turn), and the longest reply.
TEMPLATES = {
    "vqa": ("Question: {question} Short answer: {answer}", "Question: {question} Short answer:"),
    "caption": ("Caption: {answer}", "Caption:"),
}
MAX_NEW_TOKENS = {"vqa": 10, "caption": 30}


def per_task(i: int):
    """--help's default of a template flag: its text for VQA and for captions."""
    return default_is(f"{TEMPLATES['vqa'][i]!r}; captions: {TEMPLATES['caption'][i]!r}")


@dataclass
class LVLMOptions(LVLMRun):
    """How the real backend prompts (recorded in meta.json; evaluate.py and grpo.py reuse the dataset's)."""

    system_prompt: str | None = None
    """Optional system prompt before the user turn."""
    icd_template: Annotated[str | None, per_task(0)] = None
    """Text after each demonstration's image."""
    query_template: Annotated[str | None, per_task(1)] = None
    """Text after the query's image; in turn-per-demo also each ICD's question."""
    prompt_style: Literal["single-turn", "turn-per-demo"] = "single-turn"
    """One user turn for all, or a user + assistant turn per ICD (docs/real-models.md)."""
    max_new_tokens: Annotated[int | None, default_is("10, or 30 for captions")] = None
    """Greedy generation length (a caption's tokens at most)."""


class ScoreCache:
    """A backend's scores by (split, query, ICD train rows): only unseen ones go to the backend, in one batch, since
    online GRPO and validation ask for the same prompts again and again. `calls` counts the misses; `state` / `restore`
    carry the memo over a resume, so a resumed run neither pays nor counts a score twice."""

    def __init__(self, backend):
        self.backend, self.memo = backend, {}
        self.made: list[tuple[Tensor, ...]] = []  # every batch of new scores, in order: what `state` saves

    @property
    def calls(self) -> int:
        return len(self.memo)  # every miss adds exactly one entry

    def describe(self) -> dict:
        return self.backend.describe()

    def score(self, split: str, queries: Tensor, icds: Tensor) -> dict[str, Tensor]:
        """queries (N,), icds (N, k) train rows (-1 after the last of a shorter prompt) -> acc, correct, gt_prob, rel
        as (N,) float64 (no predictions)."""
        keys = [(split, q, tuple(r for r in s if r >= 0)) for q, s in zip(queries.tolist(), icds.tolist())]
        first = {k: i for i, k in reversed(list(enumerate(keys))) if k not in self.memo}  # unseen, once each
        new = sorted(first.values())
        if new:
            vals = self.fresh(split, queries[new], icds[new])  # (n, fields)
            for i, v in zip(new, vals.tolist()):
                self.memo[keys[i]] = tuple(v)
            split_code = torch.full((len(new),), SPLITS.index(split), dtype=torch.uint8)
            self.made.append((split_code, queries[new].long(), icds[new].long(), vals))
        vals = torch.tensor([self.memo[k] for k in keys], dtype=torch.float64).view(len(keys), len(SEQ_FIELDS))
        return dict(zip(SEQ_FIELDS, vals.unbind(-1)))

    def fresh(self, split: str, queries: Tensor, icds: Tensor) -> Tensor:
        """Scores of unseen prompts, (n, fields) float64. Under torchrun each rank scores its chunk and every rank
        gets all of them, so every rank must ask for the same prompts at the same time (online GRPO's ranks do)."""
        rank, world = sharding.rank_world()
        mine = sharding.chunk(len(queries), rank, world)
        vals = torch.zeros(0, len(SEQ_FIELDS), dtype=torch.float64)
        if len(mine):
            res = self.backend.score(split, queries[mine.start : mine.stop], icds[mine.start : mine.stop])
            vals = torch.stack([res[f].double() for f in SEQ_FIELDS], -1)
        return sharding.gather(vals, len(queries), world)

    def state(self) -> dict[str, Tensor]:
        """Every score so far, in the order they were made (so any earlier state is a prefix of it)."""
        if not self.made:
            return {}
        width = max(icds.shape[1] for _, _, icds, _ in self.made)
        return {
            "split": torch.cat([c[0] for c in self.made]),  # (N,) index into SPLITS
            "query": torch.cat([c[1] for c in self.made]),  # (N,)
            # (N, width) train rows, -1 past the shots of a shorter prompt
            "icds": torch.cat([torch.nn.functional.pad(c[2], (0, width - c[2].shape[1]), value=-1) for c in self.made]),
            "scores": torch.cat([c[3] for c in self.made]),  # (N, fields)
        }

    def restore(self, state: dict[str, Tensor], n: int) -> None:
        """The cache as it was after its first `n` scores, from a state saved then or later."""
        if len(state.get("query", ())) < n:
            raise ValueError(f"the saved scores hold {len(state.get('query', ()))} entries, the checkpoint counted {n}")
        self.memo, self.made = {}, []
        if n == 0:
            return
        self.made = [tuple(state[k][:n] for k in ("split", "query", "icds", "scores"))]
        for s, q, row, v in zip(*(state[k][:n].tolist() for k in ("split", "query", "icds", "scores"))):
            self.memo[SPLITS[s], q, tuple(r for r in row if r >= 0)] = tuple(v)


def lvlm_backend(model: str, items: dict[str, list[dict]], opts: LVLMOptions, task: str = "vqa"):
    from icl_select.lvlm import LVLMBackend, PromptTemplate

    icd, query = (given or default for given, default in zip((opts.icd_template, opts.query_template), TEMPLATES[task]))
    template = PromptTemplate(icd=icd, query=query, style=opts.prompt_style)
    backend = LVLMBackend(
        model,
        items,
        opts.lvlm_batch_size,
        opts.max_new_tokens or MAX_NEW_TOKENS[task],
        opts.system_prompt,
        template,
        opts.device,
        opts.image_cache_mib,
        opts.encoder_cache_mib,
        opts.lvlm_batch_tokens,
        opts.lvlm_workers,
        opts.lvlm_compile,
        task=task,
    )
    # The fast path against plain transformers on a few prompts of this data, before any long run (raises if off).
    backend.check = None if opts.skip_self_check else backend.self_check()
    if backend.check is not None and sharding.rank_world()[0] == 0:  # one line per job, not per torchrun rank
        c = backend.check
        print(
            f"self-check of {model}: {c['prompts']} prompts, {c['answers_differ']} answers differ from plain "
            f"transformers, log P(reply) within {c['max_abs_logp_diff']:.1e} nats (tolerance {c['tolerance']}"
            + (f" + {c['tolerance_rel']:g} x |log P|)" if c["tolerance_rel"] else ")"),
            file=sys.stderr,
        )
    return backend


def sim_from_meta(meta: dict) -> Simulator | CaptionSimulator:
    """The simulator a dataset folder's meta.json describes (its task's kind)."""
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["sim_config"].items()}  # JSON lists -> tuples
    return CaptionSimulator(CaptionConfig(**cfg)) if meta["task"] == "caption" else Simulator(SimConfig(**cfg))


def lvlm_identity(meta: dict, lvlm: str | None = None) -> str:
    """The LVLM `open_backend` would answer with (lineage.lvlm_of), known before it loads: a reader checks what it
    would make against what it made before loading a model."""
    if meta.get("source") == "sim" and lvlm in (None, "sim"):
        return lineage.lvlm_of(meta)
    from icl_select.hf import resolve_model

    name = lvlm or meta["lvlm"]
    return lineage.model_of(name, resolve_model(name)[1])


def open_backend(
    meta: dict, items: dict[str, list[dict]], emb: dict[str, Tensor], run: LVLMRun, lvlm: str | None = None
):
    """The backend a dataset folder was scored with (or another LVLM, `lvlm`), rebuilt from its meta.json and run as
    `run` says. A simulated folder's embeddings must be those the rebuilt simulator makes, else its scores would
    disagree."""
    if meta.get("source") == "sim" and lvlm in (None, "sim"):
        sim = sim_from_meta(meta)
        if not all(torch.equal(sim.emb[k], emb[k]) for k in ("train", "val")):
            raise ValueError("the dataset's embeddings differ from those of the simulator its meta.json describes")
        return SimBackend(sim)
    if meta.get("source") == "sim" or lvlm == "sim":
        raise ValueError("a simulated dataset can only be answered by the simulator, and a real one by a real LVLM")
    opts = LVLMOptions(
        **{f.name: getattr(run, f.name) for f in fields(LVLMRun)},
        system_prompt=meta.get("system_prompt"),
        icd_template=meta["prompt_template"]["icd"],
        query_template=meta["prompt_template"]["query"],
        prompt_style=meta["prompt_template"]["style"],
        max_new_tokens=meta["generation"]["max_new_tokens"],
    )
    return lvlm_backend(lvlm or meta["lvlm"], items, opts, meta["task"])
