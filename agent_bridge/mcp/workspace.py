"""The folder the MCP tools may touch: path checks, text-file checks, atomic writes.

Every path an agent hands us is resolved (symlinks included) and must land inside
the root; files must be regular, reasonably small, UTF-8 text; writes go to a temp
file in the same folder and are renamed over the original, so a file is either the
old text or the new text, never a mix.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from engine.base.files import fsync_dir  # one way to make a rename durable

MAX_FILE_BYTES = 512 * 1024  # larger files won't fit a local model's context anyway
BINARY_SNIFF_BYTES = 8192


class WorkspaceError(Exception):
    """A path or file the tools refuse, with a message fit for the agent."""


class Workspace:
    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int = MAX_FILE_BYTES):
        root_path = Path(root if root is not None else os.getcwd()).expanduser()
        if not root_path.is_dir():
            raise WorkspaceError(f"workspace root is not a directory: {root_path}")
        self.root = root_path.resolve()
        self.max_bytes = max_bytes

    def resolve(self, path: str) -> Path:
        """The real path of `path` (relative to the root, or absolute), refused if outside the root."""
        if not isinstance(path, str) or not path.strip():
            raise WorkspaceError("path is empty")
        if "\x00" in path:
            raise WorkspaceError("path contains a NUL byte")
        candidate = Path(path).expanduser()
        if not candidate.is_absolute():
            candidate = self.root / candidate
        real = candidate.resolve()  # follows every symlink, also in parent folders
        if real != self.root and not real.is_relative_to(self.root):
            raise WorkspaceError(f"{path}: outside the workspace root {self.root} (refused)")
        return real

    def relative(self, real: Path) -> str:
        return real.relative_to(self.root).as_posix()

    def read_text(self, path: str) -> tuple[Path, str]:
        """(real path, text) of a UTF-8 text file inside the root."""
        real = self.resolve(path)
        try:
            st = real.stat()
        except FileNotFoundError:
            raise WorkspaceError(f"{path}: no such file") from None
        except OSError as e:
            raise WorkspaceError(f"{path}: cannot stat: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise WorkspaceError(f"{path}: not a regular file")
        if st.st_size > self.max_bytes:
            raise WorkspaceError(f"{path}: too large ({st.st_size} bytes > {self.max_bytes} limit)")
        try:
            data = real.read_bytes()
        except OSError as e:
            raise WorkspaceError(f"{path}: cannot read: {e.strerror}") from None
        if b"\x00" in data[:BINARY_SNIFF_BYTES]:
            raise WorkspaceError(f"{path}: binary file (contains NUL bytes)")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise WorkspaceError(f"{path}: not UTF-8 text (undecodable byte at offset {e.start})") from None
        return real, text

    def write_text(self, path: str, text: str) -> Path:
        """Atomically replace `path` (inside the root) with `text`, keeping its permissions."""
        real = self.resolve(path)
        write_atomic(real, text)
        return real

    def commit(self, changes: list[tuple[str, str, str]]) -> None:
        """Write several files all or nothing: `changes` is [(path, expected old text, new text)].

        Every new text is staged in a temp file beside its target first (a full disk fails
        here, before any file is touched); then every file is checked to still hold its old
        text; then the temps are renamed over the targets, and a failure part-way puts the
        already-replaced files back. WorkspaceError says which file and why."""
        staged: list[tuple[Path, str, str, str]] = []  # (real, old, new, temp)
        try:
            for path, old, new in changes:
                real = self.resolve(path)
                if real.exists() and not real.stat().st_mode & 0o222:  # root could write it anyway
                    raise WorkspaceError(f"{self.relative(real)}: read-only file (refused)")
                staged.append((real, old, new, stage(real, new)))
            for real, old, _, _ in staged:
                _, now = self.read_text(str(real))
                if now != old:
                    raise WorkspaceError(f"{self.relative(real)} changed on disk while the local model was working")
            done: list[tuple[Path, str]] = []
            try:
                for real, old, _, tmp in staged:
                    os.replace(tmp, real)
                    done.append((real, old))
                for real in {real.parent for real, *_ in staged}:
                    fsync_dir(real)
            except OSError as e:
                for real, old in reversed(done):  # put back what was already replaced
                    write_atomic(real, old)
                raise WorkspaceError(f"write failed ({e}); every file was restored") from None
        except OSError as e:
            raise WorkspaceError(f"could not stage the new files ({e})") from None
        finally:
            for *_, tmp in staged:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass


def write_atomic(path: Path, text: str) -> None:
    """Write to a temp file beside `path`, fsync, then os.replace and fsync the folder:
    never a partial file, and the rename itself survives a power cut."""
    tmp = stage(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def stage(path: Path, text: str) -> str:
    """A synced temp file beside `path` holding `text`, with `path`'s permissions."""
    data = text.encode("utf-8")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp
