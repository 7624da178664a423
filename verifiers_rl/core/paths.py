"""Whether a path a run will write can be created: checked before anything loads, by the command, RLTrainer and the
benchmarks alike (a read-only or special file system, /proc/x, failed at the first write, after the model loaded)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random


def unwritable(path, is_file: bool) -> str | None:
    """Why ``path`` (a file, or a folder) cannot be created or written by this user, or None."""
    try:
        probe_writable(Path(path).expanduser(), is_file)
    except OSError as error:
        where = f" at {error.filename}" if error.filename and str(error.filename) != str(path) else ""
        return (f"cannot create or write {'the file' if is_file else 'the folder'} ({error.strerror}{where}); pass a "
                "path this user can write")
    return None


# Every rank of a launch probes the same paths at once: one rank's clean-up can remove a folder another has just made
# (FileNotFoundError or FileExistsError there), so those are tried again; a path that cannot be made (/proc/x) raises
# them every time.
@retry(retry=retry_if_exception_type((FileNotFoundError, FileExistsError)), stop=stop_after_attempt(5),
       wait=wait_random(0.01, 0.1), reraise=True)
def probe_writable(path: Path, is_file: bool) -> None:
    """Raise the OSError of creating ``path`` (its folder, a file in it; an existing file opened to append), leaving
    nothing behind: the folders it made are removed (root's write permission is no answer: /proc refuses root)."""
    folder = path.parent if is_file else path
    made = [missing for missing in (folder, *folder.parents) if not missing.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        if is_file and path.exists():
            path.open("a").close()
    finally:
        for created in made:
            try:
                created.rmdir()
            except OSError:  # never made, or another process's files are in it now
                pass
