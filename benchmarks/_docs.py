"""Replace one '## ...' section of docs/benchmarks.md with a benchmark's latest figures."""
from __future__ import annotations

import os
import re


def write_section(path: str, heading: str, body: str) -> None:
    """Replace (or append) the section starting with ``heading`` (a '## ' line), leaving the
    rest of the file alone; ``body`` is the text under the heading. Atomic (rename)."""
    section = heading + "\n\n" + body.strip("\n") + "\n"
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    # the heading alone on its line (or with a parenthesised suffix an older file may carry), so
    # "## Peer redundancy" never takes "## Peer redundancy: findings"
    pat = re.compile(r"^" + re.escape(heading) + r"[ \t]*(?:\([^)\n]*\))?[ \t]*\n.*?(?=^## |\Z)", re.S | re.M)
    if pat.search(text):
        text = pat.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text.rstrip("\n") + "\n")
    os.replace(tmp, path)
