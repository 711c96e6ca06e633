"""The real backend as it runs on a GPU (bfloat16 on CUDA, what `--device auto` picks there) against plain
transformers on the same GPU in bfloat16, one prompt at a time: tests/test_families.py's reference, tiny checkpoints
and mixed-image prompts. Skipped where torch sees no CUDA device (CI has none).

Half precision is not exact under batching: left padding and the batch's shape change which kernels run and how they
round, so log P(reply) moves in its low bits and a near-tied greedy token can flip. The bound is the one the
self-check applies to 8 prompts of the user's data before every LVLM run (lvlm.LVLMBackend.self_check): log P(reply)
within 0.1 nats + 0.5% of its size (bfloat16 keeps about 3 significant digits of each logit, so rounding grows with
them), at most one answer in four different. docs/real-models.md gives what an H100 measured.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import FAMILIES
from test_families import MAX_NEW, Reference, rgb_images

from icl_select.lvlm import LVLMBackend

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning"),
]

ATOL, RTOL = 0.1, 0.005  # on log P(reply): the self-check's bound in half precision, ATOL + RTOL * |log P| nats


@pytest.fixture(scope="module")
def examples(mixed_items) -> list[tuple[dict, list[dict]]]:
    """16 prompts of 0-4 ICDs (test_families' 8 and 8 more), so that one flip in four has room to show."""
    train, val = mixed_items["train"], mixed_items["val"]
    return [(val[i % len(val)], [train[(3 * i + j) % len(train)] for j in range(i % 5)]) for i in range(16)]


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_on_cuda_stays_within_the_self_checks_bounds(name, family_models, mixed_items, examples):
    check_family(name, family_models, mixed_items, examples)


@pytest.mark.slow  # each family's decoding step compiled for CUDA graphs: minutes in all
@pytest.mark.parametrize("static", ["inductor", "cudagraphs"])
@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "gemma3"])  # Gemma3's sliding window: not static
def test_decoding_over_a_static_cache_stays_within_the_bounds(name, static, family_models, mixed_items, examples):
    """Decoding over a static cache, compiled (CUDA graphs): the same bounds against plain transformers."""
    backend = check_family(name, family_models, mixed_items, examples, static_decode=static)
    assert backend.static_caches  # the static path ran


def check_family(name, family_models, mixed_items, examples, **options) -> LVLMBackend:
    """The family's batched path (batches of 4, `options` for LVLMBackend) against plain transformers on each prompt
    alone, in bfloat16 on the GPU, within the self-check's bounds; returns the backend."""
    folder = family_models[name]
    backend = LVLMBackend(str(folder), mixed_items, batch_size=4, max_new_tokens=MAX_NEW, device="cuda", **options)
    assert backend.model.dtype == torch.bfloat16 and backend.model.device.type == "cuda"
    ref = Reference(folder, device="cuda", dtype=torch.bfloat16)
    replies = [[query["answers"][0], "Yes", "fire hydrant"] for query, _ in examples]
    chats = [backend.messages(query, icds) for query, icds in examples]
    images = [rgb_images(query, icds) for query, icds in examples]
    want = [ref.answer(c, im) for c, im in zip(chats, images)]
    want_logps = [[ref.log_prob(c, im, r) for r in rs] for c, im, rs in zip(chats, images, replies)]

    answers, probs = backend.run(examples, replies)
    differ = sum(a != w for a, w in zip(answers, want))
    got = [[math.log(p) if p > 0 else -math.inf for p in ps.tolist()] for ps in probs]
    pairs = [(g, w) for gs, ws in zip(got, want_logps) for g, w in zip(gs, ws)]
    worst = max(abs(g - w) for g, w in pairs)
    rel = max(abs(g - w) / abs(w) for g, w in pairs)
    print(
        f"\n{name} {options or ''}: {differ} of {len(examples)} answers differ; |log P(reply) - reference| up to "
        f"{worst:.3g} nats, {rel:.2%} of |log P|"
    )
    assert differ <= len(examples) // 4, list(zip(answers, want))
    assert all(abs(g - w) <= ATOL + RTOL * abs(w) for g, w in pairs), (got, want_logps)
    report = backend.self_check()  # the guard of every LVLM run passes on its own prompts
    assert (report["tolerance"], report["tolerance_rel"]) == (ATOL, RTOL)
    return backend
