"""One error hierarchy for the whole control plane.

    CrossflowError
    ├── InvalidArgument        bad input: a field is missing, negative, NaN, absurd or malformed
    ├── NotFound               an unknown node or reservation
    ├── FailedPrecondition     valid input the current state refuses
    │   └── StaleLease         a lease whose (epoch, version) is not newer than the stored one
    ├── Aborted                a conditional write lost a race (expected version did not match)
    ├── Unavailable            something could not answer in time (callers fail closed)
    │   ├── StoreUnavailable   the broker's store errored or timed out
    │   │   └── StoreAuthFailed  the store refused the credentials (a broker does not start)
    │   └── BrokerUnavailable  the broker could not be reached or did not answer (client side)
    ├── Unauthenticated        the caller proved no identity
    ├── PermissionDenied       the caller's identity may not do this; nothing was changed
    └── ConfigError            settings refused at start

The broker maps each class to one gRPC status code at the boundary; the client maps the codes
back to these classes, so callers on both sides handle the same types.
"""

from __future__ import annotations


class CrossflowError(Exception):
    """Root of every error the control plane raises on purpose."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class InvalidArgument(CrossflowError):
    """The input is malformed; nothing was changed."""


class NotFound(CrossflowError):
    """The named node or reservation does not exist (or no longer exists)."""


class FailedPrecondition(CrossflowError):
    """The input is well formed but the current state refuses it; nothing was changed."""


class StaleLease(FailedPrecondition):
    """A lease that is not newer than the stored one."""

    def __init__(
        self, message: str, *, stored_epoch: int, stored_version: int, field: str | None = None
    ) -> None:
        super().__init__(message, field=field)
        self.stored_epoch = stored_epoch
        self.stored_version = stored_version


class Aborted(CrossflowError):
    """A conditional write found another version than the one expected; nothing was changed."""

    def __init__(self, message: str, *, current_version: int = 0, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.current_version = current_version


class Unavailable(CrossflowError):
    """Something could not answer in time; admission fails closed to the normal path."""


class StoreUnavailable(Unavailable):
    """The store could not answer in time (the broker was reached)."""


class BrokerUnavailable(Unavailable):
    """The broker could not be reached or did not answer in time (raised by clients)."""


class StoreAuthFailed(StoreUnavailable):
    """The store refused the credentials (wrong password, unknown user, no permission)."""


class Unauthenticated(CrossflowError):
    """The caller presented no valid identity (certificate or bearer token)."""


class PermissionDenied(CrossflowError):
    """The caller's identity may not do this (another router's reservation, another node's
    lease, an admin RPC); nothing was changed."""


class ConfigError(CrossflowError):
    """A setting was refused at start."""
