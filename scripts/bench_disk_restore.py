"""The disk tier's restore rate next to the disk's own: every file of a prefix-cache folder read
as a restore reads it (DiskTier.load_many: into the arrays, CRC-checked, on several threads) and
as `dd` reads it (16 MiB blocks into one buffer, nothing else), best of --repeats.

    .venv/bin/python scripts/bench_disk_restore.py FOLDER [--repeats 3]

FOLDER is a `--prefix-cache-dir` (its identity folders are all read) or one identity folder.
Both reads come from the page cache when the files were read or written lately: `--drop-caches`
(as root, on a machine of your own) empties it before each read, for the cold rates.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.caches.kv_disk import SUFFIX, DiskTier  # noqa: E402


def dd_read(paths: list[Path], block: int = 16 << 20) -> float:
    buf = bytearray(block)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - t0


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:  # root only
        f.write("3\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each read (root)")
    args = ap.parse_args()
    fresh = drop_page_cache if args.drop_caches else (lambda: None)
    root = Path(args.folder)
    folders = [root] if any(root.glob(f"*{SUFFIX}")) else [d for d in root.iterdir() if d.is_dir()]
    for folder in folders:
        tier = DiskTier(folder.parent, folder.name, 1 << 50)
        entries = list(tier.by_end.values())
        nbytes = sum(e.size for e in entries)
        if not entries:
            continue
        restore, disk = [], []
        for _ in range(args.repeats):
            fresh()
            t0 = time.perf_counter()
            got = tier.load_many(entries)
            restore.append(time.perf_counter() - t0)
            fresh()
            disk.append(dd_read([e.path for e in entries]))
        tier.close()
        ok = sum(g is not None for g in got)
        print(f"{folder.name}: {len(entries)} files ({ok} good), {nbytes / 1e6:.1f} MB; restore "
              f"{nbytes / min(restore) / 1e9:.2f} GB/s, dd-style read {nbytes / min(disk) / 1e9:.2f} GB/s "
              f"(best of {args.repeats}{', page cache dropped' if args.drop_caches else ''}; {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
