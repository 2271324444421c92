#!/usr/bin/env bash
# vLLM server mode on real GPUs, end to end: `rlfleet up --local-vm` on this machine, one
# short GRPO job submitted with `--vllm-server-gpus 1` (trl vllm-serve on one GPU, the
# trainer on another), followed to its end; prints figures. Needs nvidia-smi with at
# least 2 GPUs and vllm importable by this checkout's python; otherwise it says so in one
# line and exits 2.
#
#   bench/gpu_check.sh                       # Qwen/Qwen2.5-0.5B-Instruct, 10 steps
#   MODEL=… STEPS=… PYTHON=… bench/gpu_check.sh
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
model=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
steps=${STEPS:-10}
timeout_s=${TIMEOUT_S:-1800}

refuse() { echo "gpu_check: $1" >&2; exit 2; }
command -v nvidia-smi >/dev/null 2>&1 || refuse "no nvidia-smi here: run this on a machine with NVIDIA GPUs"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
[ "$gpus" -ge 2 ] || refuse "needs 2 GPUs (one for vLLM, one for the trainer); nvidia-smi lists $gpus"
[ -x "$python" ] || refuse "no python at $python (make venv, or set PYTHON)"
"$python" -c 'import vllm' >/dev/null 2>&1 || refuse "vllm is not importable by $python (pip install vllm)"

work=$(mktemp -d "${TMPDIR:-/tmp}/rlfleet-gpu-check.XXXXXX")
state=$work/state
rlfleet=("$python" -m scheduler.cli)
"${rlfleet[@]}" up --local-vm --state-dir "$state" >"$work/up.log" 2>&1 &
up=$!
stop_up() { kill -TERM "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true; }
trap stop_up EXIT

for _ in $(seq 1 600); do [ -s "$state/env" ] && break; sleep 0.5; done
[ -s "$state/env" ] || { echo "gpu_check: rlfleet up did not start (see $work/up.log)" >&2; exit 1; }
# shellcheck disable=SC1091
. "$state/env"
for _ in $(seq 1 120); do
  free=$("${rlfleet[@]}" vm list --json 2>/dev/null \
    | "$python" -c 'import json,sys; print(sum(v.get("available_gpus") or 0 for v in json.load(sys.stdin)))' \
    2>/dev/null || echo 0)
  [ "$free" -ge 2 ] && break
  sleep 1
done

submitted=$(date +%s.%N)
job=$("${rlfleet[@]}" job submit --model "$model" \
  --dataset "$root/training/data/arithmetic.jsonl" --reward-function keyword_match \
  --gpus 1 --vllm-server-gpus 1 --max-retries 0 --name gpu-check \
  -- --max_steps "$steps" --output_dir "$work/out")
echo "gpu_check: job $job submitted (model $model, $steps steps, work dir $work)"

status=
deadline=$(( $(date +%s) + timeout_s ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  status=$("${rlfleet[@]}" job show "$job" --json --no-progress \
    | "$python" -c 'import json,sys; print(json.load(sys.stdin)["status"])')
  case "$status" in completed|failed|cancelled) break ;; esac
  sleep 2
done
ended=$(date +%s.%N)

"${rlfleet[@]}" job show "$job" --json >"$work/job.json" || true
"${rlfleet[@]}" job logs "$job" >"$work/train.log" 2>&1 || true
"${rlfleet[@]}" job logs "$job" --role vllm >"$work/vllm.log" 2>&1 || true
"${rlfleet[@]}" job logs "$job" --role trainer >"$work/trainer.log" 2>&1 || true
"$python" - "$work/job.json" "$submitted" "$ended" "$steps" <<'PY'
import json, sys
from datetime import datetime
job = json.load(open(sys.argv[1]))
submitted, ended, steps = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
def at(key):
    value = job.get(key)
    return datetime.fromisoformat(value).timestamp() if value else None
running, finished = at("running_at"), at("finished_at")
progress = job.get("progress") or {}
train_s = (finished - running) if running and finished else None
print(f"status={job['status']} reason={job.get('status_reason') or '-'}")
print(f"submit_to_running_s={running - submitted:.1f}" if running else "submit_to_running_s=-")
print(f"running_to_end_s={train_s:.1f}" if train_s else "running_to_end_s=-")
print(f"steps={progress.get('step', '-')}/{steps} reward_last={progress.get('reward', '-')}")
if train_s:
    print(f"steps_per_s_including_vllm_start={steps / train_s:.3f}")
print(f"wall_s={ended - submitted:.1f}")
PY
echo "gpu_check: logs in $work (train.log: the group's supervisor; vllm.log; trainer.log)"
[ "$status" = completed ]
