#!/usr/bin/env bash
# Installs everything (reusing the venv when present) and runs the test suite on PJRT CPU.
#   bash scripts/run_tests.sh [pytest args]
bash "$(dirname "${BASH_SOURCE[0]}")/install_launchers.sh"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail
cd "$DSX_ROOT"
python -m pytest tests -q -p no:cacheprovider --timeout 900 --durations=15 "$@"
