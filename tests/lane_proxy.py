"""A TCP proxy in front of a daemon's data lane, for tests of faults in flight:
`LaneProxy` copies lane frames both ways and, on the first DATA frame going one way,
flips a byte of its payload (`mode="flip"`) or cuts the connection halfway through it
(`mode="cut"`). The daemon advertises the proxy's address (data_lane_advertise).
"""

from __future__ import annotations

import socket
import threading

from kvstore.data_lane import DATA, HEADER_BYTES, TRAILER, unpack


class LaneProxy:
    """Copies lane frames both ways; the first DATA frame going `direction` ("to_daemon"
    or "to_client") is flipped or cut (`mode`)."""

    def __init__(self, mode: str, direction: str) -> None:
        assert mode in ("flip", "cut") and direction in ("to_daemon", "to_client")
        self.mode = mode
        self.direction = direction
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream: tuple[str, int] | None = None
        self.hits = 0  # DATA frames flipped or cut
        self.hit_block: int | None = None  # the block of the frame flipped or cut
        self.data_frames = 0  # DATA frames going `direction`
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._pumps: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            assert self.upstream is not None
            daemon = socket.create_connection(self.upstream)
            self._sockets += [client, daemon]
            for src, dst, way in ((client, daemon, "to_daemon"), (daemon, client, "to_client")):
                pump = threading.Thread(target=self._pump, args=(src, dst, way == self.direction), daemon=True)
                self._pumps.append(pump)
                pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket, faulty: bool) -> None:
        try:
            while True:
                header = _exact(src, HEADER_BYTES)
                frame = unpack(header)
                payload = bytearray(_exact(src, frame.length + (TRAILER.size if frame.kind == DATA else 0)))
                if faulty and frame.kind == DATA:
                    with self._lock:
                        self.data_frames += 1
                        hit = not self.hits
                        self.hits += hit
                        if hit:
                            self.hit_block = frame.block
                    if hit and self.mode == "cut":
                        dst.sendall(header + payload[: frame.length // 2])
                        return
                    if hit:
                        payload[frame.length // 2] ^= 0x01
                dst.sendall(header + payload)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self.thread.join(5)
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for pump in self._pumps:
            pump.join(5)
        for sock in self._sockets:
            sock.close()


def _exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise OSError("closed")
        out += chunk
    return bytes(out)
