"""A selector on the Hugging Face Hub: what `PointerSelector.from_pretrained`, `push_to_hub` and the model card do.

A Hub repository of a selector looks like its run folder: model.safetensors and model.json (byte for byte what
`PointerSelector.save` writes), the run's config.json and metrics.jsonl (so evaluate.py and compare.py see its flags
and history in a downloaded folder), and a README.md model card written from the run's config and its evaluation.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from huggingface_hub import ModelHubMixin, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

from icl_select.files import DataError, atomic_write_bytes, read_json, selector_digest
from icl_select.tables import accuracy_table

# What of a run folder travels with its selector to the Hub, beside model.safetensors and model.json; and the
# README.md that push_to_hub uploads (a Jinja template: the Hub mixin fills it in).
RUN_FILES = ("config.json", "metrics.jsonl")
CARD = """---
{{ card_data }}
---

# Pointer selector (icl-select)

Picks up to {{ picks }} in-context demonstrations for a vision-language model, one at a time, from a per-query pool
of candidates given as {{ dim }}-d embeddings (the icl-select kit's `PointerSelector`: {{ settings }}).
{{ run }}
## Use

```python
from model import PointerSelector  # icl-select

selector = PointerSelector.from_pretrained("{{ repo_id | default("<user>/<name>", true) }}")
```

Evaluate it on a dataset folder of the kit (the same embedding encoder):
`hf download {{ repo_id | default("<user>/<name>", true) }} --local-dir selector` and
`python evaluate.py selector --data <dataset folder>`.
{{ evaluation }}"""


@contextmanager
def one_line(source) -> Iterator[None]:
    """A Hub error (no such repository, an id that is not one) as one line naming the source."""
    try:
        yield
    except (EntryNotFoundError, HfHubHTTPError, HFValidationError) as e:
        first = str(e).splitlines()[0]
        raise FileNotFoundError(f"{source}: no such run folder, nor a selector on the Hub ({first})") from None


def load(
    cls: type[ModelHubMixin], model_id: str, revision, cache_dir, force_download: bool, local_files_only: bool, token
):
    """A run folder, or a Hub repository's files (from the local cache when offline), in eval mode (as Hub models
    load); keeps the folder's RUN_FILES to travel with it, and its evaluation of these weights for the model card."""
    folder = Path(model_id)
    if not folder.is_dir():
        hub = dict(revision=revision, cache_dir=cache_dir, force_download=force_download, token=token)
        files = ["model.json", "model.safetensors", *RUN_FILES]
        folder = Path(snapshot_download(model_id, allow_patterns=files, local_files_only=local_files_only, **hub))
    model = cls.load(folder)
    model.run_files = {name: (folder / name).read_bytes() for name in RUN_FILES if (folder / name).is_file()}
    if "config.json" in model.run_files and not isinstance(read_json(folder / "config.json"), dict):
        raise DataError(f"{folder / 'config.json'}: expected a JSON object of the run's settings")
    evaluation = folder / "eval" / "val.json"
    if evaluation.is_file():
        doc = read_json(evaluation)
        if isinstance(doc, dict) and doc.get("selector_digest") == selector_digest(folder):
            model.run_eval = doc
        else:  # training went on after it (or it is no evaluation of these weights): its table is not about them
            print(f"note: {evaluation} evaluated other weights; the model card leaves it out", file=sys.stderr)
    return model.eval()


def save(model: ModelHubMixin, folder: Path) -> None:
    """The kit's two files, and the run's config.json (the Hub route reads it first) and metrics.jsonl."""
    model.save(folder)
    for name, data in model.run_files.items():
        atomic_write_bytes(folder / name, data)


def check_run(model: ModelHubMixin) -> None:
    """One line where there is no run to share: a pushed selector carries its run's config.json and card."""
    if "config.json" not in (model.run_files or {}):
        raise ValueError(
            "this selector has no run config.json to share beside it: load it with "
            "PointerSelector.from_pretrained(<run folder holding config.json>)"
        )


def card_facts(model: ModelHubMixin) -> dict:
    """What CARD says of a selector: its settings, the run that trained it and its accuracy."""
    facts = {"dim": model.cfg.dim, "picks": model.cfg.picks, "run": "", "evaluation": ""}
    facts["settings"] = ", ".join(f"{k}={v}" for k, v in asdict(model.cfg).items())
    if "config.json" in (model.run_files or {}):
        config = json.loads(model.run_files["config.json"])
        argv, data = config.get("argv") or [], config.get("data") or {}
        line = f"Trained by `python {shlex.join([Path(argv[0]).name, *argv[1:]])}`" if argv else "Trained"
        line += f" at kit commit `{config['git_sha'][:12]}`" if config.get("git_sha") else ""
        if data.get("digest"):
            kind = "simulated LVLM" if data.get("simulation") else "LVLM-scored"
            line += f" on dataset content `{data['digest']}` ({kind})"
        facts["run"] = f"\n{line}; config.json holds every flag and library version, metrics.jsonl each epoch.\n"
    if doc := model.run_eval:
        world = doc.get("backend_info", {}).get("sim_config", {}).get("world")
        lvlm = f"simulated LVLM, world {world}" if world else f"LVLM {doc['backend']}"
        facts["evaluation"] = (
            f"\n## Accuracy\n\n`evaluate.py` on `{doc['data']}` (val split, {lvlm}), weights "
            f"digest `{doc['selector_digest'][:16]}`: VQA accuracy (%) of the first n questions (rows) with k "
            f"demonstrations picked (columns).\n\n{accuracy_table(doc)}\n"
        )
    return facts
