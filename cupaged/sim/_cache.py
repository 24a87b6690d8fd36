"""The per-user cache of compiled code and compile results.

``$CUPAGED_CACHE_DIR``, else ``$XDG_CACHE_HOME/cupaged``, else ``~/.cache/cupaged``, one
subdirectory per kind (``sim`` for the sim's shared objects, ``resources`` for the compile gate's
ptxas statistics). It holds code this process will load: every directory is created 0700 and must
be owned by the current user and not writable by others, files are written to a temp file and
renamed into place, and a file not owned by the current user is never read.
"""

from __future__ import annotations

import os
import tempfile

from cupaged.sim._errors import SimCompileError

__all__ = ["cache_dir", "usable", "write_private"]


def cache_dir(kind: str) -> str:
    """The cache subdirectory ``kind``, created private to the current user."""
    root = os.environ.get("CUPAGED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "cupaged")
    path = os.path.join(root, kind)
    # os.makedirs applies `mode` to the leaf only: the root it creates got 0777 & ~umask, which under
    # a umask of 002 is group-writable, and the check below then refused the cache it had just made.
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    for d in (root, path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    for d in (root, path):
        st = os.stat(d)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise SimCompileError(
                f"refusing to use the compile cache {d}: it must be owned by uid {os.getuid()} and "
                "not writable by group or others (set CUPAGED_CACHE_DIR to a private directory)")
    return path


def usable(path: str) -> bool:
    """Exists and is ours; a file of another user is deleted (it lives in our 0700 directory)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.unlink(path)
        return False
    return True


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temp file in the same directory (mkstemp: mode 0600
    whatever the umask), then renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
