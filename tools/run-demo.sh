#!/usr/bin/env bash
# The main job: install, then one checked step of each MLA operator on the best backend present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
exec ${PYTHON:-python3} -m flash_mla demo "$@"
