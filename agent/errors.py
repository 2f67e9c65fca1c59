"""The base of providerd's own errors: a stable code, a message, and an optional hint.

The code is what a client's JSON body carries as `error` and what scripts may match on; the
message is one sentence for people; the hint says what to do about it (the CLI prints it as a
`Hint:` line).
"""

from __future__ import annotations


class ProviderdError(Exception):
    code = "error"

    def __init__(
        self, message: str = "", *, hint: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if code is not None:
            self.code = code

    def body(self) -> dict[str, object]:
        """The JSON body of a response made up for this error."""
        return {"error": self.code, "message": self.message}
