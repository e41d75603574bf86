#!/usr/bin/env bash
# On the offline GPU machine: venvs in front of its image's packages (torch and the rest), so a
# tool's pins and the supervisor's do not meet on one path.
#   /tmp/supenv  the supervisor: the wheels of .whl/ (../shared/gpu/make-wheels.sh in the
#                development checkout; the project wheel and what the image lacks)
#   /tmp/axenv   axolotl 0.19.0: its pins from .whl/axolotl/ (tests/fixtures/tool-venvs/axolotl.txt,
#                downloaded for CPython 3.12 with `pip download --no-deps`)
#   /tmp/lfenv   LLaMA-Factory 0.9.5: its pins from .whl/llamafactory/ (transformers 5.6.0, peft
#                0.18.1, accelerate 1.11.0, datasets 4.0.0, trl 0.24.0; the results README lists them)
# A tool's venv also gets, from .whl/, each of bitsandbytes, structlog, tenacity and
# typing_extensions that its own folder lacks (pip refuses two wheels of one project). Each is
# made when its folder is there (the carried tree holds 64 MiB: one tool's wheels at a time).
# Each venv's own site-packages comes first; a .pth line then adds the image's site-packages
# after it (processed as a site dir, so its own .pth files still run). PYTHONPATH is left unset:
# it would come before both and put one side's versions in the other's process.
# Usage (from the project root, .whl carried):  bash bench/trainers/device_tool_venvs.sh
set -euo pipefail
shopt -s nullglob
image_site=$(python3 -c "import site; print(site.getsitepackages()[0])")
made=()
make_venv() {
  local dir=$1; shift
  rm -rf "$dir"
  python3 -m venv --without-pip "$dir"
  local site
  site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
  echo "import site; site.addsitedir('$image_site')" > "$site/zz-image-site.pth"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$@"
  made+=("$dir")
}
tool_venv() {  # DIR FOLDER: the folder's wheels plus the shared ones it does not hold
  local dir=$1 folder=$2 extra=() name
  for name in bitsandbytes structlog tenacity typing_extensions; do
    local own=("$folder/$name"-*.whl)
    if [ ${#own[@]} -eq 0 ]; then extra+=(.whl/"$name"-*.whl); fi
  done
  make_venv "$dir" "$folder"/*.whl "${extra[@]}"
}
make_venv /tmp/supenv .whl/*.whl
if compgen -G ".whl/axolotl/*.whl" > /dev/null; then tool_venv /tmp/axenv .whl/axolotl; fi
if compgen -G ".whl/llamafactory/*.whl" > /dev/null; then tool_venv /tmp/lfenv .whl/llamafactory; fi
for dir in "${made[@]}"; do
  "$dir/bin/python" -c "import sys, torch, transformers; print(sys.prefix, 'torch', torch.__version__, 'transformers', transformers.__version__)"
done
