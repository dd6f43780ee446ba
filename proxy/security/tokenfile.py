"""The admin token `kvroute up` and `kvroute proxy` generate, kept in a 0600 file the CLI finds.

Owns the file's place (KVROUTE_CONFIG_DIR, else $XDG_CONFIG_HOME/kvroute, else ~/.config/kvroute;
one file per proxy port), writing it privately, and looking a token up for a proxy URL. Blocking
file I/O: for command-line start-up only.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from yarl import URL

CONFIG_DIR_ENV = "KVROUTE_CONFIG_DIR"


def config_dir() -> Path:
    if os.environ.get(CONFIG_DIR_ENV):
        return Path(os.environ[CONFIG_DIR_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvroute"


def token_path(port: int) -> Path:
    return config_dir() / f"admin-token-{port}"


def generate_admin_token(port: int) -> tuple[str, Path]:
    """A token for the proxy on `port`: the one in its file if there is one (scripts keep working across
    restarts), else a new one written to a file only this user can read."""
    path = token_path(port)
    existing = read_token(path)
    if existing:
        return existing, path
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)  # also when the file existed (empty) with a looser mode
    return token, path


def ensure_admin_token(proxy: Any) -> Path | None:
    """Give a proxy config without an admin token the one in its port's file (made if missing), unless the
    operator opened the control plane on purpose. Administering then always takes a token, on loopback too:
    a web page in a local browser has none. The path of the file, or None when nothing was set."""
    if proxy.admin_token or proxy.insecure_open_control_plane:
        return None
    proxy.admin_token, path = generate_admin_token(proxy.port)
    return path


def read_token(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def token_for(proxy_url: str, given: str | None = None) -> str | None:
    """The admin token to send to `proxy_url`: `given` (--token / KVROUTE_ADMIN_TOKEN), else the file
    `kvroute up` wrote for that port, else None."""
    if given:
        return given
    try:
        port = URL(proxy_url).port
    except ValueError:
        return None
    return read_token(token_path(port)) if port else None
