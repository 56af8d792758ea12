"""Secrets a configuration holds, and text with them masked: what `corral config
check`, the start-up line, `/running`, `/logs` and the model servers' log files show.

A secret is an API key (`server.api_keys`, a principal's, a model's `upstream_api_key`), the
webhook secret, the store URL's password, and the value of a secret-looking flag in a model's `cmd`
(`--api-key X`, `--api-key=X`, `--hf-token X`, ...). Each is shown as its first three and last
four characters (`sk-...4f2a`), or `***` when that would give away too much of a short one.
"""

from __future__ import annotations

import re
import shlex
import stat
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # only its attributes are read: the backends use this module without it
    from corral.config import Config

# Flags whose value is a credential, in the servers Corral starts (llama-server, vLLM, SGLang,
# text-generation-inference and most OpenAI-compatible commands).
SECRET_FLAGS = ("--api-key", "--api_key", "--hf-token", "--token", "--auth-token", "--password")
_FLAG = re.compile(r"(?:" + "|".join(re.escape(f) for f in SECRET_FLAGS) + r")(?:=|\s+)(\S+)")


def mask(secret: str) -> str:
    """`sk-...4f2a`: enough to tell two keys apart, too little to use one."""
    return f"{secret[:3]}...{secret[-4:]}" if len(secret) >= 16 else "***"


def flag_values(cmd: str) -> list[str]:
    """The values of secret flags in a command line."""
    try:
        argv = shlex.split(cmd, comments=False)
    except ValueError:
        return [m.group(1) for m in _FLAG.finditer(cmd)]
    out = []
    for i, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if name in SECRET_FLAGS:
            if eq:
                out.append(value)
            elif i + 1 < len(argv):
                out.append(argv[i + 1])
    return out


def secrets_of(config: Config) -> list[str]:
    """Every secret `config` holds, longest first (so a key that contains another is masked
    whole)."""
    found = set(config.server.api_keys)
    for p in config.server.principals.values():
        found.update(k for k in p.keys if not k.startswith("sha256:"))
    if config.batch.webhook_secret:
        found.add(config.batch.webhook_secret)
    if config.server.store:
        password = urlsplit(config.server.store).password
        if password:
            found.add(password)
    for m in config.models.values():
        if m.upstream_api_key:
            found.add(m.upstream_api_key)
        if m.upstream and urlsplit(m.upstream).password:
            found.add(urlsplit(m.upstream).password or "")
        for cmd in (m.cmd, m.cmd_stop):
            if cmd:
                found.update(flag_values(cmd))
    return sorted((s for s in found if s), key=len, reverse=True)


class Redactor:
    """Masks a configuration's secrets in any text."""

    def __init__(self, secrets: list[str]) -> None:
        self.secrets = secrets
        self._pattern = re.compile("|".join(re.escape(s) for s in secrets)) if secrets else None

    @classmethod
    def of(cls, config: Config) -> Redactor:
        return cls(secrets_of(config))

    def with_config(self, config: Config) -> Redactor:
        """This redactor's secrets and `config`'s (a configuration reloaded: the old servers'
        logs and the new ones both stay masked)."""
        return Redactor(sorted(set(self.secrets) | set(secrets_of(config)), key=len, reverse=True))

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: mask(m.group(0)), text)


def warn_if_exposed(path: Path, config: Config) -> str | None:
    """A warning when other users than its owner can write the configuration file (a changed
    `cmd` runs as whoever runs Corral), or read it while it holds secrets written out in it
    (not read from the environment with `${env.NAME}`); else None."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    writable = mode & (stat.S_IWGRP | stat.S_IWOTH)
    readable = mode & (stat.S_IRGRP | stat.S_IROTH) and any(s in text for s in secrets_of(config))
    if not (writable or readable):
        return None
    what = []
    if writable:
        what.append("written (a changed `cmd` runs as you)")
    if readable:
        what.append("read (it holds API keys)")
    return (
        f"{path} can be {' and '.join(what)} by other users (mode {stat.filemode(mode)}): "
        f"chmod 600 {path}, and read keys from the environment with ${{env.NAME}}"
    )
