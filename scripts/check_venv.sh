#!/usr/bin/env bash
# check_venv.sh PYTHON: refuse (exit 2) unless PYTHON runs in a virtual environment that does not see
# the system's site packages - a package the machine happens to carry must never hide a missing
# install step of the project's own.
set -euo pipefail
"$1" - <<'PY'
import os, sys
if sys.prefix == sys.base_prefix:
    sys.exit(f"{sys.executable} is not in a virtual environment (sys.prefix {sys.prefix}); create one with "
             f"python3 -m venv DIR")
cfg = os.path.join(sys.prefix, "pyvenv.cfg")
with open(cfg) as f:
    opts = {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in f if "=" in line)}
if opts.get("include-system-site-packages", "false").lower() == "true":
    sys.exit(f"{sys.prefix} sees the system's site packages ({cfg}: include-system-site-packages = true); "
             f"create it without --system-site-packages")
PY
