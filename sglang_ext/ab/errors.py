"""Errors of the A/B tool. Each one is an environment or input problem the user can fix;
the CLI prints its message and exits non-zero instead of showing a traceback."""


class ABError(RuntimeError):
    """Base class: a clear, user-facing failure of an A/B run."""


class EndpointDown(ABError):
    """The server could not be reached (connection refused, DNS, reset)."""


class EndpointTimeout(ABError):
    """The server did not answer within --timeout on every attempt."""


class ServerError(ABError):
    """The server answered with an HTTP error (5xx after all retries, or a 4xx)."""


class MalformedResponse(ABError):
    """The server answered 200 with a body that is not a chat completion."""


class InputError(ABError):
    """Bad user input: missing checkpoint, missing layer, unreadable prompt or activation file."""
