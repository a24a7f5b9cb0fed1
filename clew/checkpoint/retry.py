"""Which storage errors are worth retrying, and how patiently.

Checkpoint uploads are long, and one dropped connection, 5xx or throttling response should
not kill a day of training. botocore and s3fs retry a few times internally, but only per HTTP
request and only for some errors, then raise; ``Storage`` retries the whole file operation on
top of that. Errors that waiting cannot fix (403, 404, a missing bucket) are never retried.

Errors arrive in three shapes: botocore ``ClientError`` (with an error code and HTTP status),
s3fs's translation of it into ``OSError`` subclasses (the ClientError kept as ``__cause__``),
and socket/HTTP-client exceptions. All three are recognised here.
"""

from __future__ import annotations

import errno
import random
from dataclasses import dataclass

from clew.errors import CheckpointError

# Matched by class name anywhere in the MRO so that botocore/aiohttp stay optional imports
# (a local-only install has neither).
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "HTTPClientError",
        "IncompleteRead",
        "ResponseParserError",
        "ClientConnectionError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "FSTimeoutError",
    }
)
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "TooManyRequestsException",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
    }
)
# s3fs turns a 5xx/throttling ClientError into OSError(EBUSY / EREMOTEIO); the rest are
# socket-level failures.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,
        getattr(errno, "EREMOTEIO", errno.EIO),
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
    }
)
_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    CheckpointError,
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed operation is tried again.

    ``attempts`` counts the first try; delays grow as ``base_delay * 2**(n-1)`` up to
    ``max_delay``, each scaled by a random factor in [0.5, 1] so many workers that failed
    together do not retry in lockstep.
    """

    attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 30.0

    def delay(self, attempt: int) -> float:
        return min(self.max_delay, self.base_delay * 2 ** (attempt - 1)) * random.uniform(0.5, 1)


def _client_error_info(exc: BaseException) -> tuple[str, int] | None:
    """(error code, HTTP status) of a botocore ClientError in ``exc``'s ``__cause__`` chain.

    Only explicit causes are followed (s3fs raises its OSError ``from`` the ClientError);
    ``__context__`` may hold an unrelated error that was being handled at the time.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response.get("Error", {}).get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code, status
        cur = cur.__cause__
    return None


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: connection failures, timeouts, 5xx and throttling."""
    if isinstance(exc, _PERMANENT):
        return False
    info = _client_error_info(exc)
    if info is not None:
        code, status = info
        return code in _THROTTLE_CODES or status >= 500 or status == 429
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(exc).__mro__):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def is_missing_bucket(exc: BaseException) -> bool:
    """True if ``exc`` is (or was caused by) S3's NoSuchBucket."""
    info = _client_error_info(exc)
    return info is not None and info[0] == "NoSuchBucket"
