"""uvicorn's HTTP/1.1 protocol (h11) with the timeouts `edge serve` needs.

uvicorn closes a connection that stays idle for timeout_keep_alive seconds after a response,
but arms no timer before the first request, and cancels its timer on any byte: a client that
connects and sends nothing, or part of a request (headers, or a body shorter than its
Content-Length), holds its connection and its handler for ever. A client that stops reading
a streamed answer holds it too, once the socket buffers are full.

:func:`timed_protocol` makes an H11Protocol with one deadline per request and one per stalled
write (llama-server's -to/--timeout is a read and write timeout of the same kind):

- a request must have arrived whole (request line, headers and body) within ``timeout``
  seconds of the connection or of the previous response; otherwise a client that sent part of
  one gets a 408 in the API's error shape and the connection is closed (one that sent nothing is
  simply closed);
- a write that cannot go on for ``timeout`` seconds (the client reads nothing) drops the
  connection, which cancels the request's generation as any disconnect does.

A request that arrived whole is not timed while it is served: generating takes what it takes.
uvicorn's own 400 for a malformed request is given the API's error shape too.
"""
from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _error_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _TimedH11Protocol(H11Protocol):
    timeout: float = 60.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = self._write_timer = None
        self._received = 0          # bytes of the request being waited for
        self._arm_read()

    def _arm_read(self) -> None:
        self._cancel(self._read_timer)
        self._received = 0
        self._read_timer = self.loop.call_later(self.timeout, self._read_timed_out)

    @staticmethod
    def _cancel(timer) -> None:
        if timer is not None:
            timer.cancel()

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._cancel(self._read_timer)   # the request is whole (or the connection is done)
            self._read_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._arm_read()                  # the next request on this connection

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is not h11.IDLE and state is not h11.SEND_BODY:
            return
        answered = self.cycle is not None and self.cycle.response_started and state is h11.SEND_BODY
        if self._received and not answered:
            self.transport.write(_error_response(
                408, "Request Timeout", f"the request did not arrive whole within {self.timeout:g} s "
                                        "(edge serve --timeout)", "request_timeout"))
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._cancel(self._write_timer)
        self._write_timer = self.loop.call_later(self.timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._write_timer)
        self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            self.transport.abort()            # the client reads nothing: drop it

    def connection_lost(self, exc) -> None:
        self._cancel(self._read_timer)
        self._cancel(self._write_timer)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_error_response(400, "Bad Request", f"invalid HTTP request: {msg}", "invalid_http"))
        self.transport.close()


def timed_protocol(timeout: float) -> type[H11Protocol]:
    """An H11Protocol class for uvicorn.Config(http=...) with read and write deadlines of
    ``timeout`` seconds (> 0) as the module docstring says."""
    if not timeout > 0:
        raise ValueError(f"--timeout must be more than 0 seconds, got {timeout}")
    return type("TimedH11Protocol", (_TimedH11Protocol,), {"timeout": float(timeout)})
