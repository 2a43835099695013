#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# pytest's "no tests collected" (exit 5) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
if [ -x .venv-sglang-router/bin/python ] && [ -z "${SGLANG_ROUTER_PYTHON:-}" ]; then
  export SGLANG_ROUTER_PYTHON="$PWD/.venv-sglang-router/bin/python"
fi
.venv/bin/python -m pytest -q --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
