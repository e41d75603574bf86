#!/usr/bin/env bash
# On the offline GPU machine: two venvs in front of its image's packages (torch and the rest),
# so a tool's pins and the supervisor's do not meet on one path.
#   /tmp/supenv  the supervisor: the wheels of .whl/ (make-wheels.sh)
#   /tmp/axenv   axolotl 0.19.0: its pins from .whl/axolotl/ (see bench/foreign_trainers.py),
#                plus bitsandbytes, structlog and tenacity from .whl/
#   /tmp/lfenv   LLaMA-Factory 0.9.5: its pins from .whl/llamafactory/ (transformers 5.6.0, peft
#                0.18.1, accelerate 1.11.0, datasets 4.0.0, trl 0.24.0), the same three from .whl/
# (each made when its folder is there: the carried tree holds 64 MiB, so one tool's at a time)
# Each venv's own site-packages comes first; a .pth line then adds the image's site-packages
# after it (processed as a site dir, so its own .pth files still run). PYTHONPATH is left unset:
# it would come before both and put one side's versions in the other's process.
# Usage (from the project root, .whl carried):  bash bench/device_tool_venvs.sh
set -euo pipefail
image_site=$(python3 -c "import site; print(site.getsitepackages()[0])")
make_venv() {
  local dir=$1; shift
  rm -rf "$dir"
  python3 -m venv --without-pip "$dir"
  local site
  site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
  echo "import site; site.addsitedir('$image_site')" > "$site/zz-image-site.pth"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$@"
}
make_venv /tmp/supenv .whl/*.whl
shopt -s nullglob
base=(.whl/bitsandbytes-*.whl .whl/structlog-*.whl .whl/tenacity-*.whl .whl/typing_extensions-*.whl)
if compgen -G ".whl/axolotl/*.whl" > /dev/null; then
  make_venv /tmp/axenv .whl/axolotl/*.whl "${base[@]}"
fi
if compgen -G ".whl/llamafactory/*.whl" > /dev/null; then
  make_venv /tmp/lfenv .whl/llamafactory/*.whl "${base[@]}"
fi
for py in /tmp/supenv/bin/python /tmp/axenv/bin/python /tmp/lfenv/bin/python; do
  if [ -x "$py" ]; then
    "$py" -c "import sys, torch, transformers; print(sys.prefix, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  fi
done
