"""The A/B proxy's HTTP/1.1 client: h11 over asyncio streams, with a keep-alive pool per server.

Why not httpx: a relay pays per request and per chunk, and on the proxy's hot path httpx's
layers (request building, auth and redirect flows, httpcore, anyio) cost about 3x the CPU per
chunk of h11 on a plain StreamReader (benchmarks/ab_proxy_overhead.py), with a millisecond
or so per request. This client does only what a relay needs:

- `open()` sends one request (the user's headers, our Host and Content-Length) and returns once
  the response's status and headers are in; `chunks()` yields the body's bytes as they come,
  de-chunked but not decoded (Content-Encoding passes through), each read's bytes as one piece.
- A connection goes back to the pool only after a response read to its end on a connection
  both sides keep open; anything else closes it. A request whose reused connection turns out
  closed by the server before any response byte is sent again once on a fresh connection.
- Every failure is an UpstreamError with client.py's kinds: 'connection' (cannot connect),
  'timeout' (connect_timeout, or read_timeout between two reads), 'dropped' (the connection
  broke mid-response), 'protocol' (not HTTP/1.1).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections.abc import AsyncIterator

import h11

READ_SIZE = 65536
_timeout = getattr(asyncio, "timeout", None)


class UpstreamError(Exception):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.eof = False

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def receive(self, data: bytes) -> None:
        """Bytes read from the server; b"" is its end of stream."""
        self.eof = not data
        self.h11.receive_data(data)

    def next_event(self):
        try:
            return self.h11.next_event()
        except h11.RemoteProtocolError as e:
            if self.eof:
                raise UpstreamError("the server closed the connection before the end of its "
                                    f"answer ({e})", "dropped") from None
            raise UpstreamError(f"not an HTTP/1.1 answer: {e}", "protocol") from None

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """Status and headers (lower-case names, as bytes); the body through chunks(); aclose()
    always (it returns or closes the connection)."""

    def __init__(self, pool: Upstream, connection: _Connection, response: h11.Response,
                 read_timeout: float | None) -> None:
        self.pool, self.connection = pool, connection
        self.status = response.status_code
        self.headers: list[tuple[bytes, bytes]] = list(response.headers)
        self.read_timeout = read_timeout
        self.complete = False

    def header(self, name: bytes) -> str:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return ""

    async def chunks(self) -> AsyncIterator[bytes]:
        connection = self.connection
        while not self.complete:
            pieces = []
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    break
                if isinstance(event, h11.Data):
                    pieces.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    self.complete = True
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise UpstreamError("the server closed the connection mid-response",
                                        "dropped")
            if pieces:
                yield b"".join(pieces)
            if not self.complete:
                # b"" (end of stream) ends a body delimited by the close, or breaks a short one
                connection.receive(await self.pool.read(connection, self.read_timeout))

    async def aclose(self) -> None:
        connection, self.connection = self.connection, None
        if connection is None:
            return
        if (self.complete and connection.h11.our_state is h11.DONE
                and connection.h11.their_state is h11.DONE):
            connection.h11.start_next_cycle()
            self.pool.release(connection)
        else:
            connection.close()


class Upstream:
    """One server (a base URL: scheme, host, port; a path prefix is kept) and its idle
    connections."""

    def __init__(self, base_url: str, connect_timeout: float | None, max_idle: int = 256
                 ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.host_header = parts.netloc.rpartition("@")[2].encode("ascii")
        self.prefix = parts.path.rstrip("/")
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle: list[_Connection] = []

    async def open(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                   body: bytes, read_timeout: float | None = None) -> UpstreamResponse:
        """Send the request; return once the status and headers are in. `target` is the path
        and query; `headers` go as they are (no Host, Content-Length, hop-by-hop ones);
        `read_timeout` bounds every wait for bytes, the headers' and the body's (None: none)."""
        request_headers = [(b"host", self.host_header), *headers]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            request_headers.append((b"content-length", str(len(body)).encode()))
        try:
            request = h11.Request(method=method, headers=request_headers,
                                  target=(self.prefix + target).encode("latin-1"))
        except h11.LocalProtocolError as e:
            raise UpstreamError(f"cannot send this request on: {e}", "protocol") from None
        while self.idle:
            connection = self.idle.pop()
            if not connection.usable():
                connection.close()
                continue
            response = await self._exchange(connection, request, body, read_timeout, reused=True)
            if response is not None:
                return response
        connection = await self._connect()
        response = await self._exchange(connection, request, body, read_timeout, reused=False)
        assert response is not None  # a fresh connection never asks for a retry
        return response

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl,
                                        limit=READ_SIZE), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(f"no connection to {self.host}:{self.port} within "
                                f"{self.connect_timeout}s", "timeout") from None
        except OSError as e:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {e}",
                                "connection") from None
        return _Connection(reader, writer)

    async def _exchange(self, connection: _Connection, request: h11.Request, body: bytes,
                        read_timeout: float | None, reused: bool) -> UpstreamResponse | None:
        """None: a reused connection was closed by the server before answering (retry)."""
        received_any = False
        try:
            data = connection.h11.send(request)
            if body:
                data += connection.h11.send(h11.Data(data=body))
            connection.writer.write(data + connection.h11.send(h11.EndOfMessage()))
            try:
                await connection.writer.drain()
            except OSError as e:
                raise UpstreamError(f"the connection broke: {e!r}", "dropped") from None
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    chunk = await self.read(connection, read_timeout)
                    if not chunk and reused and not received_any:
                        connection.close()
                        return None
                    received_any = True
                    connection.receive(chunk)
                elif isinstance(event, h11.Response):
                    return UpstreamResponse(self, connection, event, read_timeout)
                elif isinstance(event, h11.ConnectionClosed):
                    raise UpstreamError("the server closed the connection before answering",
                                        "dropped")
                # an InformationalResponse (1xx): the real one follows
        except UpstreamError as e:
            connection.close()
            if e.kind == "dropped" and reused and not received_any:
                return None
            raise
        except BaseException:
            connection.close()
            raise

    async def read(self, connection: _Connection, timeout: float | None) -> bytes:
        try:
            if timeout is None:
                return await connection.reader.read(READ_SIZE)
            if _timeout is None:  # Python 3.10
                return await asyncio.wait_for(connection.reader.read(READ_SIZE), timeout)
            async with _timeout(timeout):  # no task per read, unlike 3.11's wait_for
                return await connection.reader.read(READ_SIZE)
        except asyncio.TimeoutError:
            raise UpstreamError(f"no bytes from {self.host}:{self.port} for {timeout}s",
                                "timeout") from None
        except (ConnectionError, OSError) as e:
            raise UpstreamError(f"the connection broke: {e!r}", "dropped") from None

    def release(self, connection: _Connection) -> None:
        if len(self.idle) < self.max_idle and connection.usable():
            self.idle.append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        for connection in self.idle:
            connection.close()
        self.idle.clear()

