"""Every GPU figure of docs/real-models.md from one run, on random weights in Qwen2.5-VL-3B-Instruct's and CLIP
ViT-B/32's shapes (built on the spot, nothing downloaded) and an OK-VQA-format folder of 640 x 480 pictures: bench.py's
LVLM line and its levers, the recurring-pictures line, CLIP's embedding rate, each LVLM stage as its own command with
the rate it records, and from them the GPU-hours of the README's one-GPU OK-VQA pipeline. report.md and report.json are
rewritten into --report-dir after every step, so a run cut short keeps what it measured.

Usage:
    python gpu_report.py --report-dir DIR        # on a GPU machine, under 10 minutes
    python gpu_report.py --smoke                 # the same steps, tiny models, on the CPU (a check of the script)
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import bench
from icl_select import tiny
from icl_select.cli import run_cli


@dataclass
class Args:
    report_dir: Path = Path("runs/gpu-report")
    """Where report.md, report.json and report.log go."""
    smoke: bool = False
    """The same steps with the tiny models on the CPU (a check of the script, not GPU figures)."""
    report_seconds: float = 540
    """No step starts after this many seconds (a device command stops at 600)."""
    device: str = "auto"
    """cpu, cuda, or auto (CUDA in bf16 if present, else CPU float32); --smoke runs on the CPU."""


@dataclass(frozen=True)
class ReportShapes:
    """What the report runs: the pictures of its OK-VQA-format folder, the bench lines' shapes, and each
    stage's size."""

    train_pictures: int  # two questions each
    val_pictures: int  # one question each
    picture_size: tuple[int, int] | None  # None: the tests' small mixed sizes
    queries: int  # bench: questions per step, each a group of `group` sequences of `shots` from a pool of `pool`
    group: int
    shots: int
    pool: int
    batch: int  # prompts per forward pass, in the bench lines and every stage (0: the stages' default)
    steps: int  # the recurring-pictures line's online steps
    repeats: int
    data_queries: int  # gen_rl_data.py anchors
    eval_questions: int  # evaluate.py questions, at 1-4 shots
    grpo_batch: int  # online grpo.py queries per step
    grpo_budget: int  # online grpo.py --lvlm-budget


# The bench command, its recurring-pictures line and the stages on a GPU; the same steps in miniature on the
# CPU (--smoke), to check the script end to end where no GPU is at hand.
GPU_SHAPES = ReportShapes(
    train_pictures=1000, val_pictures=64, picture_size=(640, 480), queries=4, group=16, shots=4, pool=64, batch=0,
    steps=3, repeats=2, data_queries=12, eval_questions=48, grpo_batch=8, grpo_budget=384,
)  # fmt: skip
SMOKE_SHAPES = ReportShapes(
    train_pictures=24, val_pictures=12, picture_size=None, queries=2, group=4, shots=2, pool=8, batch=4,
    steps=2, repeats=1, data_queries=8, eval_questions=6, grpo_batch=2, grpo_budget=60,
)  # fmt: skip

# The README's one-GPU OK-VQA recipe at the stages' defaults (9,009 train and 5,046 val questions), in LVLM prompts per
# stage and the processes that load the model; rce.py's are at most what --val-lvlm and --can-stop ask (every epoch's
# 200 validation anchors at 1-4 shots, and the cross-fitted halves' 200 anchors at 0-4), fewer where picks recur.
PIPELINE = {
    "clip": 9_009 + 5_046,  # questions (and about as many pictures) embedded once, in gen_rl_data.py
    "data": 800 * (16 + 1),  # anchors x (sequences of 4 shots, and the anchor asked with none)
    "rce": 11 * 200 * 4 + 2 * 200 * 5,  # rce.py --can-stop --val-lvlm: epochs 0-10, then the cross-fitting
    "online": 35_000,  # grpo.py --online --lvlm-budget 35000, training and validation
    "eval_selectors": 3 * 800 * 4,  # RCE, the 35k run and RICES: 800 questions x 1-4 shots
    "eval_zero_shot": 800,  # asked once for every shot count
    "processes": 6,  # gen_rl_data, rce, grpo, evaluate of the two runs, RICES and zero-shot apart
}
# What another training of the recipe adds, for a CI over trainings: rce.py and grpo.py again (another --seed) and
# the evaluation of both.
REPLICATE = {"rce": PIPELINE["rce"], "online": PIPELINE["online"], "eval_selectors": 2 * 800 * 4, "processes": 3}


def gpu_report(args: Args) -> dict:
    """Every GPU figure of docs/real-models.md from one run, on random weights in Qwen2.5-VL-3B-Instruct's and CLIP
    ViT-B/32's shapes and an OK-VQA-format folder of 640 x 480 pictures built on the spot: the bench line at the
    stages' batch and at 16 prompts, each LVLM stage as its own command (gen_rl_data.py, online grpo.py with
    --lvlm-budget, evaluate.py of a selector and of zero-shot) with the rate it records, CLIP's embedding rate, the
    recurring-pictures line and each lever alone, and from them the GPU-hours of the whole pipeline. `--smoke` runs
    the same steps with the tiny Qwen and CLIP on the CPU. report.md and report.json are rewritten into --report-dir
    after every step, so that a run cut short keeps what it measured; a step that fails is reported and the next
    runs."""
    import contextlib
    import io
    import json
    import os
    import platform
    import subprocess
    import sys
    import traceback
    from dataclasses import asdict

    import transformers

    from icl_select.files import atomic_write_text

    shapes, device = (SMOKE_SHAPES, "cpu") if args.smoke else (GPU_SHAPES, args.device)
    out = args.report_dir
    out.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="icl-select-report-")  # models and data: removed on return or exit
    work = Path(scratch.name)
    log = out / "report.log"
    log.write_text("")
    cuda = torch.cuda.is_available() and device != "cpu"
    doc = {
        "smoke": args.smoke,
        "command": "python gpu_report.py" + (" --smoke" if args.smoke else ""),
        "machine": {
            "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "shapes": asdict(shapes),
        "steps": {},
    }
    started = time.perf_counter()

    def save() -> None:
        doc["seconds"] = round(time.perf_counter() - started, 1)
        doc["hours"] = pipeline_hours(doc)
        atomic_write_text(out / "report.json", json.dumps(doc, indent=2) + "\n")
        atomic_write_text(out / "report.md", report_markdown(doc))

    def step(name: str, fn: Callable[[], dict]) -> dict | None:
        """Run one step, its output into the log; its result (or its error) into the report. Past --report-seconds no
        step starts: what ran is kept where a command's time limit would cut it off."""
        if time.perf_counter() - started > args.report_seconds:
            doc["steps"][name] = {"seconds": 0, "error": f"skipped: past --report-seconds {args.report_seconds}"}
            save()
            return None
        t0 = time.perf_counter()
        print(f"[{time.perf_counter() - started:6.0f} s] {name} ...", flush=True)
        text = io.StringIO()
        try:
            with contextlib.redirect_stdout(text):
                result = fn()
            doc["steps"][name] = {"seconds": round(time.perf_counter() - t0, 1), **result}
        except Exception as e:  # noqa: BLE001  (a failed step is reported, and the rest still runs)
            text.write(traceback.format_exc())
            doc["steps"][name] = {"seconds": round(time.perf_counter() - t0, 1), "error": f"{type(e).__name__}: {e}"}
        with log.open("a") as f:
            f.write(f"==== {name}\n{text.getvalue()}\n")
        print(text.getvalue(), end="", flush=True)
        save()
        return doc["steps"][name] if "error" not in doc["steps"][name] else None

    def stage(name: str, argv: list[str]) -> float:
        """One stage as its own command (a user's process: the model's loading, compiling and self-check included);
        its wall seconds. Its output goes to the log."""
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, *argv], cwd=Path(__file__).parent, capture_output=True, text=True)
        with log.open("a") as f:
            f.write(f"==== {name}: {' '.join(argv)}\n{done.stdout}{done.stderr}\n")
        if done.returncode != 0:
            last = [line for line in done.stderr.splitlines() if any(c.isalnum() for c in line)][-1:] or ["no output"]
            raise RuntimeError(f"{name} exited with {done.returncode}: {last[0]}")
        return time.perf_counter() - t0

    built = {}

    def build() -> dict:
        size = {"image_size": shapes.picture_size} if shapes.picture_size else {}
        built["vqa"] = tiny.build_okvqa_fixture(
            work / "okvqa", train_images=shapes.train_pictures, val_images=shapes.val_pictures, **size
        )
        if args.smoke:
            built["lvlm"], built["clip"] = (
                tiny.build_tiny_qwen(work / "lvlm"),
                tiny.build_tiny_clip(work / "clip"),
            )
        else:
            built["lvlm"] = tiny.build_qwen2_5_vl_3b_shape(work / "lvlm")
            built["clip"] = tiny.build_clip_b32_shape(work / "clip")
        return {"model": "tiny Qwen2.5-VL" if args.smoke else "random weights in Qwen2.5-VL-3B-Instruct's shape"}

    def bench_line(**kw) -> Callable[[], dict]:
        def run() -> dict:
            common = dict(
                lvlm=str(built["lvlm"]),
                vqa_root=built["vqa"],
                device=device,
                queries=shapes.queries,
                group_size=shapes.group,
                shots=shapes.shots,
                pool_size=shapes.pool,
                lvlm_batch_size=shapes.batch,
                repeats=shapes.repeats,
                lvlm_reference=False,
            )
            r = bench.bench_lvlm(bench.Args(only="lvlm", **(common | kw)))
            rates = {k: statistics.median(v) for k, v in r["rates"].items()}
            return {
                "rates": rates,
                "rate_runs": r["rates"],
                "prepared": {k: statistics.median(v) for k, v in r["prepared"].items()},
                "tokens": r["tokens"],
                "pictures": r["pictures"],
                "batch": r["batch"],
                "agreement": r["agreement"],
                "peaks_gib": {k: v / 2**30 for k, v in r["peaks"].items()},
                "phases": {k: v / sum(r["phases"].values()) for k, v in r["phases"].items()},
                "flops": r["flops"],
            }

        return run

    def clip_rate() -> dict:
        from icl_select.clip import clip_embed
        from icl_select.pictures import DECODED_IMAGES
        from icl_select.vqa_data import load_vqa_split

        items = [it for s in ("train", "val") for it in load_vqa_split("okvqa", built["vqa"], s)]
        clip_embed(items[:8], str(built["clip"]), device=device)  # the encoder loaded, kernels warm
        DECODED_IMAGES.clear()
        t0 = time.perf_counter()
        clip_embed(items, str(built["clip"]), device=device)
        seconds = time.perf_counter() - t0
        return {
            "items": len(items),
            "pictures": len({it["image"] for it in items}),
            "items_per_s": len(items) / seconds,
        }

    lvlm_flags = ["--lvlm-batch-size", str(shapes.batch), "--device", device]
    data, rce_run, online_run = work / "data", work / "rce", work / "online"

    def data_stage() -> dict:
        argv = ["gen_rl_data.py", "--lvlm", str(built["lvlm"]), "--dataset", "okvqa", "--data-root", str(built["vqa"])]
        argv += ["--encoder", str(built["clip"]), "--num-queries", str(shapes.data_queries), "--out", str(data)]
        argv += ["--pool-size", str(shapes.pool), "--group-size", str(shapes.group), "--seq-len", str(shapes.shots)]
        seconds = stage("gen_rl_data.py", argv + lvlm_flags)
        rate = json.loads((data / "meta.json").read_text())["lvlm_seq_per_s"]
        return {"rate": rate, "process_seconds": seconds, "sequences": shapes.data_queries * shapes.group}

    def online_stage() -> dict:
        argv = ["rce.py", "--data", str(data), "--out", str(rce_run), "--epochs", "2", "--val-frac", "0.25"]
        stage("rce.py", argv + ["--quality", "all"])  # a random LVLM's rewards rarely vary within a group
        argv = ["grpo.py", "--data", str(data), "--init", str(rce_run), "--online", "--out", str(online_run)]
        argv += ["--lvlm-budget", str(shapes.grpo_budget), "--batch-size", str(shapes.grpo_batch)]
        argv += ["--group-size", str(shapes.group)]
        seconds = stage("grpo.py --online", argv + lvlm_flags)
        epochs = [json.loads(x) for x in (online_run / "metrics.jsonl").read_text().splitlines()]
        rates = [e["lvlm/seq_per_s"] for e in epochs if "lvlm/seq_per_s" in e]
        return {"rate": statistics.median(rates), "epoch_rates": rates, "process_seconds": seconds}

    def eval_stage(run: Path | None) -> Callable[[], dict]:
        def go() -> dict:
            target = work / "zero-shot" if run is None else run
            argv = ["evaluate.py"] + ([] if run is None else [str(run)]) + ["--data", str(data)]
            argv += ["--num-samples", str(shapes.eval_questions), "--shots", *map(str, range(1, shapes.shots + 1))]
            if run is None:
                argv += ["--baseline", "zero-shot", "--out", str(target)]
            seconds = stage(f"evaluate.py {target.name}", argv + lvlm_flags)
            result = json.loads((target / "eval" / "val.json").read_text())
            asked = shapes.eval_questions * (1 if run is None else shapes.shots)
            return {"rate": result["lvlm_seq_per_s"], "process_seconds": seconds, "sequences": asked}

        return go

    # The most wanted figures first: the default path's rate, the batch the kit sizes against a fixed one, each stage
    # for the pipeline's hours; then each other lever alone, beside the default in the same process; decoding over a
    # static cache (compiling CUDA graphs: the least predictable time) last.
    if step("build", build) is not None:
        step("bench", bench_line(lvlm_passes=["default"]))
        step("bench batch 16", bench_line(lvlm_passes=["default"], lvlm_batch_size=16))
        if step("gen_rl_data.py", data_stage) is not None:
            if step("grpo.py --online", online_stage) is not None:
                step("evaluate.py selector", eval_stage(online_run))
            step("evaluate.py zero-shot", eval_stage(None))
        step("clip", clip_rate)
        step("bench recurring", bench_line(lvlm_steps=shapes.steps, lvlm_passes=["default", "preprocess-held"]))
        step("bench levers", bench_line(lvlm_passes=["default", "no-encoder-cache", "picture-processes", "inline"]))
        if cuda:
            step("bench static", bench_line(lvlm_passes=["default", "static-inductor", "static-cudagraphs"]))
    save()
    scratch.cleanup()
    print(f"wrote {out / 'report.md'} and {out / 'report.json'} ({doc['seconds']:.0f} s)")
    return doc


def pipeline_hours(doc: dict) -> dict | None:
    """The GPU-hours of PIPELINE, and of REPLICATE, from the rates measured: prompts / rate per stage (rce.py's at
    evaluate.py's rate: the same prompts), plus each process's start-up (its wall time less its scoring: loading,
    compiling, the self-check), measured on the stages that ran."""
    steps = doc["steps"]
    need = ("clip", "gen_rl_data.py", "grpo.py --online", "evaluate.py selector", "evaluate.py zero-shot")
    if any(name not in steps or "error" in steps[name] for name in need):
        return None
    rate = {
        "data": steps["gen_rl_data.py"]["rate"],
        "rce": steps["evaluate.py selector"]["rate"],
        "online": steps["grpo.py --online"]["rate"],
        "eval_selectors": steps["evaluate.py selector"]["rate"],
        "eval_zero_shot": steps["evaluate.py zero-shot"]["rate"],
    }
    names = {
        "data": "gen_rl_data.py",
        "rce": "rce.py --can-stop --val-lvlm, at most",
        "online": "grpo.py --online --lvlm-budget 35000",
        "eval_selectors": "evaluate.py: RCE, the 35k run, RICES x 800 x 1-4 shots",
        "eval_zero_shot": "evaluate.py: zero-shot x 800",
    }
    start_up = statistics.median(
        steps[name]["process_seconds"] - steps[name]["sequences"] / steps[name]["rate"]
        for name in ("gen_rl_data.py", "evaluate.py selector", "evaluate.py zero-shot")
    )

    def hours(plan: dict) -> dict:
        seconds = {"CLIP embeddings": plan["clip"] / steps["clip"]["items_per_s"]} if "clip" in plan else {}
        seconds |= {names[k]: plan[k] / rate[k] for k in names if k in plan}
        seconds["process start-ups"] = plan["processes"] * start_up
        return {"stages": {k: v / 3600 for k, v in seconds.items()}, "total": sum(seconds.values()) / 3600}

    return hours(PIPELINE) | {"replicate": hours(REPLICATE)}


def batch_text(batch: dict) -> str:
    tokens = f" and {batch['tokens']:,} padded tokens" if batch["tokens"] else ""
    return f"batches of at most {batch['prompts']} prompts{tokens}"


def report_markdown(doc: dict) -> str:
    """report.json as Markdown: the machine, each measured figure, and the pipeline's GPU-hours."""
    m, steps = doc["machine"], doc["steps"]
    label = "SMOKE RUN on the CPU with tiny models: not GPU figures" if doc["smoke"] else "measured"
    lines = [
        f"# Scoring throughput report ({label})",
        "",
        f"`{doc['command']}` on {m['device']} ({m['cores']} cores), torch {m['torch']}, transformers "
        f"{m['transformers']}, Python {m['python']}; {doc['seconds']:.0f} s in all. "
        + (
            "The tiny random Qwen2.5-VL and CLIP of the tests on small pictures: a check of the script."
            if doc["smoke"]
            else "Random weights in Qwen2.5-VL-3B-Instruct's and CLIP ViT-B/32's shapes (a random model rarely stops "
            "before its 10 new tokens: the rates are floors), an OK-VQA-format folder of 640 x 480 pictures built on "
            "the spot."
        ),
        "",
    ]
    for name, r in steps.items():
        if "error" in r:
            lines += [f"## {name}: FAILED after {r['seconds']} s", "", f"`{r['error']}` (report.log has the trace)", ""]
    s = doc["shapes"]
    titles = {
        "bench": "The bench line",
        "bench batch 16": "The bench line at 16 prompts a batch",
        "bench recurring": "Pictures recurring as in a GRPO run",
        "bench levers": "Each older lever turned off alone",
        "bench static": "Decoding over a static cache (CUDA graphs)",
    }
    for name, title in titles.items():
        r = steps.get(name)
        if r is None or "error" in r:
            continue
        steps_note = f"{s['steps']} online steps of " if name == "bench recurring" else ""
        lines += [
            f"## {title}",
            "",
            f"{steps_note}{s['queries']} questions x {s['group']} sequences of {s['shots']} demonstrations from pools "
            f"of {s['pool']}, {batch_text(r['batch'])}, {r['tokens']:.0f} prompt tokens a sequence; "
            f"{r['pictures']['distinct']} distinct pictures in {r['pictures']['slots']} picture slots. Median of "
            f"{s['repeats']} interleaved passes (runs: sequences/s of each).",
            "",
            "| scoring path | sequences/s | runs | peak memory GiB | answers as the default's |",
            "|---|---|---|---|---|",
        ]
        for k, rate in r["rates"].items():
            agree = r["agreement"].get(k)
            same = "" if agree is None else f"{agree[0]}, gt_prob within {agree[1]:.1e}"
            runs = " / ".join(f"{x:.2f}" for x in r["rate_runs"][k])
            lines.append(f"| {bench.LVLM_PASSES[k][0]} | {rate:.2f} | {runs} | {r['peaks_gib'][k]:.1f} | {same} |")
        f = r["flops"]
        total = f["lm"] + f["vision"]
        sheet = f["datasheet"]
        share = f", {total / sheet:.0%} of the datasheet's {sheet / 1e12:.0f} TFLOP/s" if sheet else ""
        lines += [
            "",
            f"The default: {total / 1e12:.3g} TFLOP/s (2 x parameters x tokens), {total / f['matmul']:.0%} of a dense "
            f"matrix product measured here ({f['matmul'] / 1e12:.3g} TFLOP/s){share}. Wall time: "
            + ", ".join(f"{k} {v:.0%}" for k, v in r["phases"].items())
            + ". The CPU side alone (batches prepared, nothing run): "
            + ", ".join(f"pictures preprocessed {k} {v:.1f} sequences/s" for k, v in r["prepared"].items())
            + ".",
            "",
        ]
    bench_rate = steps.get("bench", {}).get("rates", {}).get("default")
    rows = []
    for name in ("gen_rl_data.py", "grpo.py --online", "evaluate.py selector", "evaluate.py zero-shot"):
        r = steps.get(name)
        if r is None or "error" in r:
            continue
        ratio = f"{r['rate'] / bench_rate:.0%}" if bench_rate else ""
        rows.append(f"| `{name}` | {r['rate']:.2f} | {ratio} | {r['process_seconds']:.0f} |")
    if rows:
        lines += [
            "## The stages, each as its own command",
            "",
            f"gen_rl_data.py: {s['data_queries']} anchors x {s['group']} sequences of {s['shots']}; grpo.py --online: "
            f"--lvlm-budget {s['grpo_budget']}, {s['grpo_batch']} queries a step; evaluate.py: {s['eval_questions']} "
            f"questions at 1-{s['shots']} shots (the online run's selector), and zero-shot. The rate is the one each "
            "records (meta.json, metrics.jsonl, the evaluation file).",
            "",
            "| stage | sequences/s | of the bench line's default | process seconds, loading and self-check included |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    if (r := steps.get("clip")) is not None and "error" not in r:
        lines += [f"CLIP: {r['items_per_s']:.0f} questions/s ({r['items']} questions on {r['pictures']} pictures).", ""]
    hours = doc.get("hours")
    if hours:
        lines += [
            "## GPU-hours of the whole pipeline, from these rates"
            + (" (smoke: tiny models on the CPU)" if doc["smoke"] else ""),
            "",
            "OK-VQA at the stages' defaults, the README's one-GPU commands (zero-shot and RICES included): prompts / "
            f"the stage's rate, plus each of {PIPELINE['processes']} processes' start-up (the median measured above).",
            "",
            "| stage | GPU-hours |",
            "|---|---|",
            *(f"| {k} | {v:.3f} |" for k, v in hours["stages"].items()),
            f"| **whole pipeline** | **{hours['total']:.2f}** |",
            f"| another training of RCE and the 35k run, evaluated (a CI over trainings) | "
            f"{hours['replicate']['total']:.2f} |",
            "",
        ]
    return "\n".join(lines)


def main(args: Args) -> None:
    gpu_report(args)


if __name__ == "__main__":
    run_cli(main, Args)
