"""Exceptions of ti-core and the error policy that decides what a telemetry failure does.

Telemetry must never break training unless asked to: under ``warn`` (default) and ``ignore`` every
exception raised inside the observer's hooks is caught; ``raise`` propagates it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, Literal, TypeGuard, get_args

ErrorPolicyName = Literal["warn", "ignore", "raise"]
"""What ``error_policy=`` accepts."""
ERROR_POLICIES: Final[tuple[ErrorPolicyName, ...]] = get_args(ErrorPolicyName)


def is_error_policy(name: object) -> TypeGuard[ErrorPolicyName]:
    """Whether ``name`` is one of :data:`ERROR_POLICIES`."""
    return isinstance(name, str) and name in ERROR_POLICIES


class ObserverAlreadyAttachedError(RuntimeError):
    """``inject_observer`` was called on a model that already has an observer."""


class MissingProviderError(ImportError):
    """A named provider (sink, rank policy) needs a distribution that is not installed."""


class TelemetryWarning(RuntimeWarning):
    """A measurement failed; training continued (``error_policy="warn"``)."""


MEASUREMENT_CONSEQUENCE: Final[str] = (
    "the affected measurements are recorded as nulls with this reason"
)
SINK_CONSEQUENCE: Final[str] = (
    "this sink's records that could not be written are lost (the error above names the path "
    "and what, if anything, was lost)"
)


class ErrorPolicy:
    """Applies ``warn`` / ``ignore`` / ``raise`` to failures inside the observer.

    ``warn`` emits one warning per distinct failure kind (stage and exception type), so a failure
    repeated every step does not flood the log.
    """

    def __init__(self, name: ErrorPolicyName) -> None:
        if not is_error_policy(name):
            raise ValueError(
                f"error_policy={name!r} is not known; use one of {', '.join(ERROR_POLICIES)}"
            )
        self.name: ErrorPolicyName = name
        self._seen: set[tuple[object, str]] = set()
        self._lock = threading.Lock()
        self._deferring = threading.local()
        self._deferred: list[str] = []

    @property
    def raises(self) -> bool:
        return self.name == "raise"

    def handle(
        self,
        stage: str,
        error: BaseException,
        *,
        key: object = None,
        consequence: str = MEASUREMENT_CONSEQUENCE,
    ) -> None:
        """Report ``error`` raised while doing ``stage``; re-raise it under ``raise``.

        ``warn`` reports once per ``(key, exception type)``; ``key`` defaults to ``stage``
        (e.g. one key per sink, so its failed writes and its failed close warn once together).
        ``consequence`` says what the failure cost.
        """
        if self.name == "raise":
            raise error
        if self.name == "ignore":
            return
        kind = (stage if key is None else key, type(error).__name__)
        with self._lock:
            if kind in self._seen:
                return
            self._seen.add(kind)
        message = (
            f"ti-core: {stage} failed ({type(error).__name__}: {error}); training continues and "
            f"{consequence}. Further failures of this kind are not reported again "
            "(error_policy='warn')."
        )
        if getattr(self._deferring, "on", False):
            with self._lock:
                self._deferred.append(message)
            return
        warnings.warn(message, TelemetryWarning, stacklevel=2)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Within this block (on this thread), warnings wait for :meth:`report_deferred`.

        The emission worker runs under it, so a failure there warns on the training thread,
        where the user's warning filters and ``catch_warnings`` blocks apply.
        """
        self._deferring.on = True
        try:
            yield
        finally:
            self._deferring.on = False

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def report_deferred(self) -> None:
        """Emit the warnings deferred so far (call on the training thread)."""
        with self._lock:
            messages, self._deferred = self._deferred, []
        for message in messages:
            warnings.warn(message, TelemetryWarning, stacklevel=3)
