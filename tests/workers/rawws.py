"""A raw-socket WebSocket client that can stop reading entirely (libraries keep reading into
their own buffers, which hides backpressure)."""

from __future__ import annotations

import base64
import os
import socket
import struct


class RawWebSocket:
    def __init__(self, host: str, port: int, path: str, rcvbuf: int = 4096) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect((host, port))
        self.close_code: int | None = None
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(4096)
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(head.decode(errors="replace"))

    def send_text(self, text: str) -> None:
        self.send_frame(0x1, text.encode())

    def send_frame(self, opcode: int, data: bytes) -> None:
        """One final frame, masked as a client's must be (0x1 text, 0xA pong, ...)."""
        mask = os.urandom(4)
        n = len(data)
        if n < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 65536:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.sock.sendall(header + mask + masked)

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("connection closed without a close frame")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv_frame(self) -> tuple[int, bytes]:
        b0, b1 = self._read(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._read(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._read(8))[0]
        return b0 & 0x0F, self._read(n)

    def read_until_close(self, timeout: float) -> int | None:
        """Drain frames; the close code, or None if the peer dropped the TCP connection."""
        self.sock.settimeout(timeout)
        try:
            while True:
                opcode, payload = self.recv_frame()
                if opcode == 0x8:
                    return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
        except (ConnectionError, OSError):
            return None

    def close(self) -> None:
        self.sock.close()
