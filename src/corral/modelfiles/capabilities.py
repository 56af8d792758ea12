"""What a `cmd:` model's server takes, read from its command when the configuration does not
say: clients offer tools only to a model listed as taking them (`/api/show`,
`/api/tags`, `/v1/models`), and the gateway refuses `tools` to one listed as not.

- `corral sim-backend`: it answers tools.
- llama-server (`-m FILE.gguf`): the chat template it will use, as llama-server picks it:
  `--no-jinja` takes no tools; `--chat-template-file F` renders tools if F does; a named
  `--chat-template` with jinja is llama.cpp's built-in one, without tools; else the GGUF's own
  template if it renders a tool list (none: llama-server's generic one, without tools).
- anything else: unknown (None): its requests pass as they come.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from corral.cmdline import flag_value
from corral.config.models import CapabilitiesConfig
from corral.modelfiles.gguf import GgufError, read_gguf

log = logging.getLogger("corral.modelfiles")

MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file read to decide; a bigger one: not read


def takes_tools(argv: list[str]) -> bool | None:
    """Whether the server `argv` starts takes `tools` (see the module), None: unknown."""
    if "sim-backend" in argv:
        return True
    model = flag_value(argv, "-m", "--model")
    if model is None or not model.lower().endswith(".gguf"):
        return None
    if "--no-jinja" in argv:
        return False
    file = flag_value(argv, "--chat-template-file")
    if file is not None:
        try:
            with open(file, "rb") as f:
                text = f.read(MAX_TEMPLATE_BYTES + 1)
        except OSError:
            return None  # llama-server will say what is wrong with it
        return len(text) <= MAX_TEMPLATE_BYTES and b"tools" in text
    if flag_value(argv, "--chat-template") is not None:
        return False
    try:
        template = read_gguf(Path(model)).chat_template
    except (GgufError, OSError, ValueError):
        return None
    return bool(template) and "tools" in (template or "")


def capabilities_of(cmd: str) -> CapabilitiesConfig | None:
    """A `cmd:` model's capabilities from its command, or None where it cannot be told."""
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return None
    tools = takes_tools(argv)
    if tools is None:
        return None
    return CapabilitiesConfig(inputs=["text"], outputs=["text"], tools=tools)
