"""The data disk under the store's write pattern (``diskpatterns``), beside the plain probe."""

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.gpu import harness as H

DISKPAT_FILE_MB = 64  # a 2,048-token sample at the 8B shape in bf16: 2,048 x 32,773 B


def phase_diskpatterns() -> None:
    """The data disk under the store's own write pattern, beside the plain probe (no GPU): which part of it keeps a
    disk-bound pipeline under the probe. Each pattern writes ``DISKPAT_FILES`` 64 MiB sample-sized files copied by
    sendfile from a shared-memory dump, as the workers do; bytes a second over the pattern's wall."""
    R = H.RESULTS.setdefault("diskpatterns", {})
    H.DATA.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(f"findmnt -n -o SOURCE,FSTYPE,OPTIONS -T {H.DATA} || df -T {H.DATA}", shell=True,
                           capture_output=True, text=True)  # fmt: skip
    R["mount"] = (mount.stdout + mount.stderr).strip()
    R["probe_before"] = H.disk_probe()
    H.DUMPS.mkdir(parents=True, exist_ok=True)
    dump = H.DUMPS / "diskpattern.dump"
    dump.write_bytes(os.urandom(DISKPAT_FILE_MB << 20))
    n = int(os.environ.get("DISKPAT_FILES", "128"))
    patterns = {  # name: (writers, fsync the file, fsync the folder, remove each file behind)
        "store x32, removed behind (the pipeline bench)": (32, True, True, True),
        "store x32, kept": (32, True, True, False),
        "store x32, no folder fsync": (32, True, False, False),
        "store x8": (8, True, True, False),
        "store x64": (64, True, True, False),
        "x32, no fsync, one syncfs at the end (the disk streaming)": (32, False, False, False),
    }
    R["patterns"] = {}
    try:
        for name, spec in patterns.items():
            R["patterns"][name] = write_pattern(dump, n, *spec)
            H.log(f"diskpatterns {name}: {R['patterns'][name]}")
            H.save("diskpatterns")
    finally:
        dump.unlink(missing_ok=True)
    R["probe_after"] = H.disk_probe()


def write_pattern(dump: Path, n: int, writers: int, fsync: bool, dir_fsync: bool, remove: bool) -> dict:
    """``n`` copies of ``dump`` written by ``writers`` threads as the store writes a sample (temp file, sendfile,
    fsync, rename, fsync of the folder), spread over 256 folders as the store spreads them; GB a second."""
    root = H.DATA / "diskpattern"
    for i in range(256):
        (root / f"{i:02x}").mkdir(parents=True, exist_ok=True)
    size = dump.stat().st_size

    def one(i: int) -> None:
        folder = root / f"{i * 97 % 256:02x}"
        tmp, final = folder / f".{i}.partial", folder / f"{i}.safetensors"
        src, fd = os.open(dump, os.O_RDONLY), os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            while offset < size:
                offset += os.sendfile(fd, src, offset, size - offset)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
            os.close(src)
        os.replace(tmp, final)
        if dir_fsync:
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        if remove:
            final.unlink()

    t = time.time()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(one, range(n)))
    if not fsync:
        os.sync()
    wall = time.time() - t
    shutil.rmtree(root)
    return {"GBps": round(n * size / wall / 1e9, 3), "wall_s": round(wall, 2), "files": n, "writers": writers}
