"""Shared test setup: the flat repo root on sys.path, one torch thread (as every stage runs by default, so a plain
`pytest -q` takes the time the README states), hypothesis profiles (HYPOTHESIS_PROFILE=dev|ci, default ci), and
session fixtures (a small simulated dataset; tiny offline real models of every tested family and OK-VQA-format
datasets)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; child processes inherit it

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Tensor tests are slower than hypothesis' default 200 ms deadline on a loaded 2-core CI machine.
settings.register_profile(
    "ci", max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SMALL = dict(num_train=600, num_val=150, num_queries=48, group_size=8, pool_size=24)
# A small selector, for tests about runs (calls counted, bytes on resume, what training reads) rather than capacity.
SMALL_NET = dict(hidden=32, num_heads=2)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """A small simulated dataset folder, built once per test session (tests must copy it before modifying it)."""
    from gen_rl_data import Args, generate

    out = tmp_path_factory.mktemp("data") / "sim"
    generate(Args(out=out, **SMALL))
    return out


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict:
    """Tiny random-weight Qwen2.5-VL, CLIP and text-only LM, and an OK-VQA-format dataset, built offline once."""
    from icl_select.tiny import build_okvqa_fixture, build_tiny_clip, build_tiny_qwen, build_tiny_text_lm

    root = tmp_path_factory.mktemp("real")
    return {
        "qwen": build_tiny_qwen(root / "qwen"),
        "clip": build_tiny_clip(root / "clip"),
        "text_lm": build_tiny_text_lm(root / "text-lm"),
        "okvqa": build_okvqa_fixture(root / "okvqa"),
    }


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "llava", "llava_next", "llava_onevision", "gemma3")


@pytest.fixture(scope="session")
def family_models(assets, tmp_path_factory) -> dict:
    """A tiny random-weight checkpoint of each model family in FAMILIES (Qwen2.5-VL: assets["qwen"]), built once."""
    from icl_select import tiny

    root = tmp_path_factory.mktemp("families")
    built = {name: getattr(tiny, f"build_tiny_{name}")(root / name) for name in FAMILIES if name != "qwen2_5_vl"}
    return built | {"qwen2_5_vl": assets["qwen"]}


@pytest.fixture(scope="session")
def mixed_okvqa(tmp_path_factory):
    """The OK-VQA-format dataset with images of mixed sizes, modes and formats (wide, tall, tiny, L, P, CMYK)."""
    from icl_select.tiny import build_okvqa_fixture

    return build_okvqa_fixture(tmp_path_factory.mktemp("real") / "okvqa-mixed", mixed=True)


@pytest.fixture(scope="session")
def mixed_items(mixed_okvqa) -> dict[str, list[dict]]:
    """mixed_okvqa's questions, as vqa_data reads them, per split."""
    from icl_select.vqa_data import load_vqa_split

    return {split: load_vqa_split("okvqa", mixed_okvqa, split) for split in ("train", "val")}


def die_after_first_chunk(monkeypatch, stage: str, calls: int = 0) -> None:
    """Inside the monkeypatch's context, kill the next `stage` run as a machine would once it has written its first
    chunk: gen_rl_data.py after its first --chunk of anchors; evaluate.py after its first batch of questions, which
    asks the backend `calls` times (once per shot count)."""
    if stage == "gen_rl_data.py":
        import gen_rl_data

        real = gen_rl_data.score_queries

        def one_chunk(args, backend, path, todo, *rest):
            real(args, backend, path, todo[: args.chunk], *rest)
            raise KeyboardInterrupt

        monkeypatch.setattr(gen_rl_data, "score_queries", one_chunk)
        return
    import evaluate

    real_open = evaluate.open_backend

    def dying(*a, **kw):
        backend = real_open(*a, **kw)
        score, asked = backend.score, [0]

        def counted(*args, **kwargs):
            asked[0] += 1
            if asked[0] > calls:
                raise KeyboardInterrupt
            return score(*args, **kwargs)

        backend.score = counted
        return backend

    monkeypatch.setattr(evaluate, "open_backend", dying)
