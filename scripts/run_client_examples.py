"""Run an official client's example programs against a running Corral, as a user trying
`make run` would: each example's model names replaced by one Corral serves, its
prompts for input answered, its exit and last lines reported.

    python scripts/run_client_examples.py DIR --url http://127.0.0.1:8080 --model explorer-3b

DIR is a client's examples folder (ollama-python's `examples/`, openai-python's `examples/`
and `examples/responses/`); nothing is downloaded. Prints one line an example and a summary.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The model names the examples use, each replaced by the one Corral serves.
NAMES = (
    "gemma3", "llama3.2", "llama3.1:8b", "llama3.1", "deepseek-r1", "qwen3", "gpt-oss:20b",
    "gpt-oss:120b-cloud",
    "codellama:7b-code", "llava", "x/z-image-turbo", "gpt-4o-2024-08-06", "gpt-4o-mini",
    "gpt-4o", "gpt-4", "gpt-3.5-turbo", "gpt-3.5-turbo-instruct", "gpt-4.1", "gpt-5",
    "o3-mini", "text-embedding-3-small", "text-embedding-ada-002",
)  # fmt: skip
# A 1x1 PNG for the examples that ask for an image's path.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


# OpenAI's chat models by pattern (gpt-4o, gpt-5.5, o3-mini ...), and its audio models: the
# sim servers speak /v1/audio too.
CHAT = r"gpt-\d[\w.\-]*|o\d(?:-[\w\-]+)?|tts-1|whisper-1"


def rewrite(source: str, model: str, url: str) -> str:
    names = "|".join(re.escape(n) for n in sorted(NAMES, key=len, reverse=True))
    source = re.sub(rf"(['\"])(?:{names}|{CHAT})\1", rf"\g<1>{model}\g<1>", source)
    return source.replace('"https://..."', repr(f"{url}/v1/"))  # a placeholder to fill in


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="explorer-3b")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="examples-"))
    image = work / "image.png"
    image.write_bytes(PNG)
    env = {
        **os.environ,
        "OLLAMA_HOST": args.url,
        "OPENAI_BASE_URL": f"{args.url}/v1",
        "OPENAI_API_KEY": "unused",
        "ANTHROPIC_BASE_URL": args.url,
        "ANTHROPIC_API_KEY": "unused",
    }
    ran = failed = 0
    for path in sorted(args.folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        copy = work / path.name
        copy.write_text(rewrite(path.read_text(), args.model, args.url))
        for helper in args.folder.glob("*.py"):  # modules an example imports
            if not (work / helper.name).exists():
                shutil.copy(helper, work / helper.name)
        try:
            done = subprocess.run(
                [args.python, copy.name],
                cwd=work,
                env=env,
                input=f"{image}\nhello\n",
                capture_output=True,
                text=True,
                timeout=args.timeout_s,
            )
            code, out = done.returncode, (done.stdout + done.stderr).strip().splitlines()
        except subprocess.TimeoutExpired:
            code, out = -1, ["(timed out)"]
        # An interactive example that answered and then met the end of its input ran.
        interactive = code != 0 and out and out[-1].startswith("EOFError")
        ok = code == 0 or bool(interactive)
        ran += ok
        failed += not ok
        last = out[-1] if out else ""
        print(f"{'ran ' if ok else 'FAIL'} {path.name:40} {last[:110]}")
    print(f"\n{ran} of {ran + failed} ran to completion")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
