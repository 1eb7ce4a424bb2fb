"""The engine's folders and how a file in them is written: whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """$MLX_DSPARK_CACHE_DIR, else $XDG_CACHE_HOME/mlx-dspark, else ~/.cache/mlx-dspark."""
    if os.environ.get("MLX_DSPARK_CACHE_DIR"):
        return Path(os.environ["MLX_DSPARK_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mlx-dspark"


def config_dir() -> Path:
    """$MLX_DSPARK_CONFIG_DIR, else $XDG_CONFIG_HOME/mlx-dspark, else ~/.config/mlx-dspark."""
    if os.environ.get("MLX_DSPARK_CONFIG_DIR"):
        return Path(os.environ["MLX_DSPARK_CONFIG_DIR"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "mlx-dspark"


def write_json(path: Path, data) -> Path:
    """A measurement cache file, written whole or not at all (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a no-op where folders can't be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the rename is still atomic
    finally:
        os.close(fd)
