"""Names that become file names. Run ids, sample ids and request ids are checked here, never used raw
as paths."""

import hashlib
import re

SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SAFE_RID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,299}")
RID_PREFIX = "eaglet:"


class UnsafeName(ValueError):
    """A run id, sample id or request id that is not a safe single file name."""


def check_id(name: str, what: str = "id") -> str:
    """Returns ``name`` if it is a safe run or sample id (one path component, no ':'), else raises."""
    if not isinstance(name, str) or not SAFE_ID.fullmatch(name) or ".." in name:
        raise UnsafeName(
            f"{what} {name!r} is not a safe id: use 1-128 of [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return name


def check_rid(rid: str) -> str:
    """Returns ``rid`` if it can name a dump file, else raises ``UnsafeName``."""
    if not isinstance(rid, str) or not SAFE_RID.fullmatch(rid) or ".." in rid:
        raise UnsafeName(f"rid {rid!r} is not a safe file name: use 1-300 of [A-Za-z0-9._:-], without '..'")
    return rid


def make_rid(run_id: str, sample_id: str, attempt: int) -> str:
    """``eaglet:<run>:<sample>:<attempt>``: names the dump file, so it is unique per attempt."""
    return check_rid(f"{RID_PREFIX}{check_id(run_id, 'run id')}:{check_id(sample_id, 'sample id')}:{attempt}")


def is_eaglet_rid(rid: object) -> bool:
    """Warm-ups and health checks carry other rids; only ours are dumped."""
    return isinstance(rid, str) and rid.startswith(RID_PREFIX)


def fanout(sample_id: str) -> str:
    """Two hex digits that spread sample files over 256 folders, so no folder grows past what tools list."""
    return hashlib.sha1(sample_id.encode()).hexdigest()[:2]
