#!/usr/bin/env bash
# Pack what SkyRL's RL loop (Ray + SkyRL + this project, examples/rl_tiny/run_rl_tiny.sh and its
# entrypoint integrations/skyrl/entrypoint.py) needs beyond the GPU image and .whl-gpu into one
# xz archive, .rlxz/rl.tar.xz (24.4 MiB; 207 MB unpacked), so that it travels in the same device
# call as .whl-gpu (6 MB: megatron-core, fla-core, pydantic and its three helpers) and .tcache:
# the limit is 64 MiB per call, working tree included (all of it together: 33 MiB). Ray's wheel
# alone is 78 MB; the parts of Ray that neither SkyRL nor this project imports are dropped below.
#
# Usage, from anywhere (this machine needs pip and an index; the device needs neither):
#   bash bench/pack_rl_site.sh                    -> .rlxz/rl.tar.xz (ignored via .git/info/exclude)
# On the device, carry [".whl-gpu", ".rlxz", ".tcache"] and start the command with:
#   mkdir -p .site-rl && tar xJf .rlxz/rl.tar.xz -C .site-rl &&
#   WHEELS=.whl-gpu bash bench/device_run.sh env PYTHONPATH=$PWD/.site-rl:$PWD/.site:$PWD \
#     bash examples/rl_tiny/run_rl_tiny.sh trainer.kda.overrides.model.dsa.kernel=torch ...
# (bench/device_run.sh installs .whl-gpu into .site and restores .tcache.) PYTHONPATH order
# matters: .site-rl first, so that its transformers 5.23.0 shadows the image's 5.17.0 (5.17 lacks
# glm5_next's indexed attention); .site (.whl-gpu) next; the repository last. The image's own
# packages (torch, numpy, pandas, pyarrow, huggingface-hub 1.33, tokenizers 0.23, aiohttp, ...)
# come after all of these. Ray's worker processes inherit PYTHONPATH, so they see the same order.
#
# What is packed, at the versions the CPU development environment runs the RL example with (ray:
# the 2.57.0 that skyrl 0.4.0's extras pin), each one missing from the GPU image (its package
# list, as the device tool documents it), the closure of their Requires-Dist less what the image
# has:
#   ray==2.57.0 (stripped)              the driver, actors and placement groups
#   jsonschema + referencing + rpds-py + jsonschema-specifications   Ray's requirements
#   skyrl==0.4.0, skyrl-gym==0.4.0      the trainer, generator and environment base
#   transformers==5.23.0                the project's `sampler` pin (glm5_next for the CPU sampler)
#   omegaconf, loguru, cloudpathlib, orjson, pybase64, torchdata   what skyrl's train modules import
#   datasets + dill + multiprocess      skyrl's prompt dataset
#   func_timeout                        skyrl-gym's requirement (no wheel on PyPI: built here)
# Left out on purpose: skyrl's peft, hf_transfer and zstandard (LoRA, fast downloads and
# compressed checkpoints, none imported by main_base or the entrypoint; the image has peft),
# huggingface-hub 2.x and its httpx2/httpcore2/truststore (the image's huggingface-hub 1.33
# satisfies transformers' and datasets' >=1.31), vLLM (the example samples with glm5_next),
# TileLang (the run uses model.dsa.kernel=torch; .tlxz carries it when needed).
# Checked on a CPU machine only: a bare Python 3.12 venv holding links to the image's listed
# packages (huggingface-hub 1.33.0, tokenizers 0.23.2 and transformers 5.17.0 as on the image),
# .whl-gpu in .site and this archive in .site-rl ran run_rl_tiny.sh (STEPS=1) to "Training done".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=.rlxz
mkdir -p "$dest"
if [ -d .git ]; then grep -qx "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The device's interpreter, not this machine's: CPython 3.12 on x86-64 manylinux.
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/whl" \
  ray==2.57.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 \
  skyrl==0.4.0 skyrl-gym==0.4.0 transformers==5.23.0 \
  omegaconf==2.4.0 loguru==0.7.3 cloudpathlib==0.26.0 orjson==3.13.0 pybase64==1.5.1 \
  torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# func_timeout ships only as an sdist; it is pure Python, so a wheel built here runs there.
python3 -m pip wheel -q --no-deps -w "$work/whl" func_timeout==4.3.5
# --target with the device's tags: unpacks the wheels as that machine's pip would, without
# checking them against this machine's Python. No console scripts are needed there (the run
# uses `python -m`), and their shebangs would point at this machine's interpreter. pip checks a
# local wheel's Requires-Python against the Python running pip, not --python-version: where that
# is not 3.12 (here 3.11), --ignore-requires-python lets the 3.12-only wheels (skyrl) through.
python3 -m pip install -q --no-index --no-deps --no-compile --ignore-requires-python "${plat[@]}" \
  --target "$work/site" "$work"/whl/*.whl
rm -rf "$work/site/bin"

# Ray: drop what neither skyrl, skyrl-gym nor this project imports (they import ray, ray.actor,
# ray.util.{placement_group,scheduling_strategies,metrics} and ray.experimental), and what Ray's
# core (_raylet.so, the raylet and GCS binaries, _private with the runtime-env agent, util,
# experimental, dag, autoscaler, the dashboard's Python modules) imports only from these:
#   jars          Java workers (33 MB)
#   rllib tune serve llm data train air   Ray's libraries; only each other and the dashboard's
#                 train/serve/data request handlers (never started here: the full dashboard needs
#                 aiohttp_cors and opencensus, which neither machine has) import them, lazily.
#                 ray.air's __init__ imports ray.data, so ray.air goes with it, and ray.train
#                 imports ray.air.
#   dashboard/client/build   the dashboard's web page (JavaScript)
r="$work/site/ray"
rm -rf "$r/jars" "$r/rllib" "$r/tune" "$r/serve" "$r/llm" "$r/data" "$r/train" "$r/air" \
  "$r/dashboard/client/build"
# Nothing may still import what was dropped, outside the dropped parts themselves (the dashboard's
# lazy handlers aside): stop here if a new version does.
if grep -rlE "^(from|import) ray\.(rllib|tune|serve|llm|data|train|air)\b" "$r" --include='*.py'; then
  echo "error: the files above import a part of Ray that was dropped" >&2; exit 1
fi
# Test suites inside packages are never imported by the run.
find "$work/site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +

python3 - "$work/site" <<'EOF'
import pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.dist-info")):
    meta = dict(l.split(": ", 1) for l in (p / "METADATA").read_text().splitlines()[:5] if ": " in l)
    print(f"  {meta['Name']}=={meta['Version']}")
EOF
# xz -9 on one thread: the packing machine may be busy; the archive is the same either way.
(cd "$work/site" && tar cf - --owner=0 --group=0 . | xz -9 -T1 > "$OLDPWD/$dest/rl.tar.xz")
du -h "$dest/rl.tar.xz"
