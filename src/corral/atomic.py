"""Files replaced whole: written beside their place, then renamed over it, so a reader (or a
process started after a crash) sees the old file or the new one, never a part."""

from __future__ import annotations

import os
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """`path` holds `text` (its folder made if missing); OSError if it cannot be written. The
    part file carries the process id: two processes writing at once never share one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.write_text(text)
    part.replace(path)
