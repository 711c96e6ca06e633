#!/usr/bin/env bash
# The whole pipeline on the built-in simulated LVLM: data -> RCE -> GRPO (offline, online) and the rivals -> evaluation
# with baselines -> comparison (the glance table printed; the full report in runs/report.md, figures in runs/plots/).
# Re-running never deletes anything: every stage resumes when its command is re-run (an interrupted one continues, a
# finished run is reused as it is), and a run made with other flags or data is refused with a message; delete
# data/sim and runs/ yourself to start over.
set -euo pipefail
cd "$(dirname "$0")"
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-5}   # fewer progress-bar redraws in logs

python gen_rl_data.py                                   # data/sim (resumes if interrupted)
python gen_rl_data.py --report data/sim
python rce.py                                           # runs/rce
python grpo.py --kl-beta 0.1 --no-rank-advantage        # runs/grpo-kl0.1 (offline, the scored groups)
python rce.py --can-stop --out runs/rce-stop            # the same picks, and a stop for online GRPO to train
python grpo.py --online --init runs/rce-stop --out runs/grpo-kl0.3-online   # chooses how many (simulator in the loop)

# the rivals: a retriever trained on the same data, and Lever-LM as published (its own data: 1.93M LVLM calls)
python rce.py --retriever                               # runs/retriever
python gen_rl_data.py --groups infoscore --group-size 5 --seq-len 2 --num-queries 5000 --out data/sim-leverlm
python rce.py --data data/sim-leverlm --weights uniform --quality all --picks 4 --out runs/lever-lm

for b in zero-shot random image-sim text-sim mmices mmr coreset oracle observable; do
  python evaluate.py --baseline "$b" --seeds 3
done
python evaluate.py runs/rce runs/grpo-kl0.1 runs/grpo-kl0.3-online runs/retriever runs/lever-lm

python compare.py runs/baseline-* runs/rce runs/grpo-kl0.1 runs/grpo-kl0.3-online runs/retriever runs/lever-lm \
  --baseline rce --out runs/report.md --plot runs/plots
