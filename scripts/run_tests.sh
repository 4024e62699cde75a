#!/usr/bin/env bash
# Installs everything (reusing the venv when present) and runs the test suite on PJRT CPU.
#   bash scripts/run_tests.sh [pytest args]
bash "$(dirname "${BASH_SOURCE[0]}")/install_launchers.sh"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail
cd "$DSX_ROOT"
# Two workers (pytest-xdist): a launched run leaves a core idle while its launcher and workers import; each module's
# tests stay on one worker (tests/conftest.py's groups).
python -m pytest tests -q -p no:cacheprovider --timeout 900 --durations=15 -n 2 --dist loadgroup --no-loadscope-reorder "$@"
