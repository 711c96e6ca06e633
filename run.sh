#!/usr/bin/env bash
# The whole pipeline on the built-in simulated LVLM: data -> RCE -> GRPO (offline, online) and the rivals -> evaluation
# with baselines -> comparison (the glance table printed; the full report in runs/report.md, figures in runs/plots/).
# Two chains run side by side, one a core: the online run's (the longest), and every other stage after the data. Each
# stage's output goes to runs/logs/<stage>.log and its seconds to runs/logs/seconds.tsv (bench.py --only run-sh).
# Re-running never deletes anything: every stage resumes when its command is re-run (an interrupted one continues, a
# finished run is reused as it is), and a run made with other flags or data is refused with a message; delete
# data/sim and runs/ yourself to start over.
set -euo pipefail
cd "$(dirname "$0")"
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-5}   # fewer progress-bar redraws in logs
# AVX2 kernels and one thread a stage (icl_select/runs.py KERNELS): the same figures on any x86-64 machine, where an
# AVX-512 CPU's own kernels round otherwise and move the online run's
export ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1
mkdir -p runs/logs
trap 'kill $(jobs -p) 2> /dev/null || true' EXIT   # a chain that failed stops the other

step() {  # step NAME COMMAND...: the command's output to runs/logs/NAME.log, its seconds to runs/logs/seconds.tsv
  local name=$1 start=$EPOCHSECONDS
  shift
  if ! "$@" > "runs/logs/$name.log" 2>&1; then
    echo "failed: $name; the end of runs/logs/$name.log:" >&2
    tail -n 5 "runs/logs/$name.log" >&2
    return 1
  fi
  printf '%s\t%s\n' "$name" $((EPOCHSECONDS - start)) >> runs/logs/seconds.tsv
  echo "done: $name ($((EPOCHSECONDS - start)) s)"
}

step data python gen_rl_data.py                        # data/sim (resumes if interrupted)
python gen_rl_data.py --report data/sim

# the online run's chain: a selector that may stop, trained online with the simulator in the loop
(
  step rce-stop python rce.py --can-stop --out runs/rce-stop   # the same picks, and a stop for online GRPO to train
  step online python grpo.py --online --init runs/rce-stop --out runs/grpo-kl0.3-online   # chooses how many
  step evaluate-online python evaluate.py runs/grpo-kl0.3-online
) &
online=$!

# the other chain: RCE, offline GRPO, the rivals (a retriever trained on the same data, and Lever-LM as published,
# on its own data: 1.93M LVLM calls) and the baselines
step rce python rce.py                                            # runs/rce
step offline python grpo.py --kl-beta 0.1 --no-rank-advantage      # runs/grpo-kl0.1 (offline, the scored groups)
step retriever python rce.py --retriever                          # runs/retriever
step lever-lm-data python gen_rl_data.py --groups infoscore --group-size 5 --seq-len 2 --num-queries 5000 \
  --out data/sim-leverlm
step lever-lm python rce.py --data data/sim-leverlm --weights uniform --quality all --picks 4 --out runs/lever-lm
for b in zero-shot random image-sim text-sim mmices mmr coreset oracle observable; do
  step "baseline-$b" python evaluate.py --baseline "$b" --seeds 3
done
step evaluate python evaluate.py runs/rce runs/grpo-kl0.1 runs/retriever runs/lever-lm
wait "$online"

python compare.py runs/baseline-* runs/rce runs/grpo-kl0.1 runs/grpo-kl0.3-online runs/retriever runs/lever-lm \
  --baseline rce --out runs/report.md --plot runs/plots
