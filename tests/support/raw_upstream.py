"""A worker stand-in that writes its HTTP answers by hand, to test how the proxy relays each framing.

`python -m tests.support.raw_upstream PORT`. POSTs answer by the request's x-test-mode header:
length (JSON echo of what arrived, Content-Length), chunked (SSE, chunked), close (SSE framed by
the connection's end), close-json, interim (a 103 before the echo), hop (hop-by-hop response
headers), flood (SSE of x-flood-bytes bytes, written as fast as the reader takes them), chat-flood (an endless
stream of chat chunks, as fast as the reader takes them), huge-header (a response header value of x-head-bytes
bytes), bad-header (a response header the proxy must not relay: x-bad-header names which).
GET /progress: bytes the flood has written so far, POSTs, connections that carried a POST. Any other GET: 200 "ok".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys

progress = {"flood_bytes": 0, "flood_done": False, "post_connections": 0, "posts": 0}


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return out
            out += await reader.readexactly(size)
            await reader.readexactly(2)
    return b""


def echo(request_line: str, pairs: list[tuple[str, str]], body: bytes) -> bytes:
    return json.dumps({"request_line": request_line, "headers": pairs, "body_len": len(body),
                       "body_sha256": hashlib.sha256(body).hexdigest()}).encode()


def length_response(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


SSE_EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    posted = False
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            request_line = lines[0]
            pairs = [(k.strip(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)]
            headers = {k.lower(): v for k, v in pairs}
            body = await read_body(reader, headers)
            if request_line.startswith("GET"):
                text = json.dumps(progress).encode() if request_line.startswith("GET /progress") else b"ok"
                writer.write(length_response(text))
                await writer.drain()
                continue
            progress["posts"] += 1
            if not posted:
                posted = True
                progress["post_connections"] += 1
            mode = headers.get("x-test-mode", "length")
            if mode == "length":
                writer.write(length_response(echo(request_line, pairs, body)))
            elif mode == "interim":
                writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(length_response(echo(request_line, pairs, body)))
            elif mode == "hop":
                writer.write(length_response(b"{}", b"Connection: x-drop-me\r\nx-drop-me: secret\r\n"
                                             b"Keep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\nx-keep: yes\r\n"))
            elif mode == "chunked":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for event in SSE_EVENTS:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(0.02)
                writer.write(b"0\r\n\r\n")
            elif mode in ("close", "close-json"):
                kind = b"text/event-stream" if mode == "close" else b"application/json"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nConnection: close\r\n\r\n")
                for event in SSE_EVENTS if mode == "close" else [b'{"whole": ', b'"answer"}']:
                    writer.write(event)
                    await writer.drain()
                    await asyncio.sleep(0.02)
                writer.close()
                return
            elif mode == "chat-flood":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                event = b"data: " + json.dumps({
                    "id": "chatcmpl-flood", "object": "chat.completion.chunk", "created": 1, "model": "m1",
                    "choices": [{"index": 0, "delta": {"content": "token " * 682}, "finish_reason": None}]}).encode()
                frame = b"%x\r\n%s\n\n\r\n" % (len(event) + 2, event)
                while True:  # until the proxy lets go of the connection
                    writer.write(frame * 16)
                    await writer.drain()
            elif mode == "huge-header":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-big: ")
                piece = b"v" * (1 << 20)
                for _ in range(int(headers["x-head-bytes"]) >> 20):
                    writer.write(piece)
                    await writer.drain()
                writer.write(b"\r\nContent-Length: 2\r\n\r\n{}")
            elif mode == "bad-header":
                bad = {"control": b"x-evil: a\x01b\r\n", "long": b"x-long: " + b"v" * 9000 + b"\r\n",
                       "name": b"x evil: 1\r\n"}[headers["x-bad-header"]]
                writer.write(length_response(b"{}", bad + b"x-injected: yes\r\n"))
            elif mode == "flood":
                total = int(headers["x-flood-bytes"])
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                event = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
                sent = 0
                while sent < total:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    sent += len(event)
                    progress["flood_bytes"] = sent
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE_EVENTS[2]), SSE_EVENTS[2]))
                progress["flood_done"] = True
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    for sock in server.sockets:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    print(f"raw upstream listening on {port}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
