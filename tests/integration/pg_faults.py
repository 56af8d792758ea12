"""Faults to inflict on PostgreSQL, for the resilience tests: a private cluster (so that its
restarts and `pg_terminate_backend` touch no other test: `tests.pgserver`) and a TCP proxy that
cuts and refuses connections."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from tests.pgserver import PrivatePostgres, free_port

__all__ = ["PrivatePostgres", "TcpProxy", "free_port"]


# PostgreSQL's ReadyForQuery message, less its status byte: the server has finished what it
# was sent; the byte after says whether a transaction is left open ('T') or not ('I').
_READY = b"Z\x00\x00\x00\x05"


class TcpProxy:
    """<host>:<port> (127.0.0.1 unless said) forwarding to 127.0.0.1:`target_port`. `outage(s)`
    cuts every open connection and refuses new ones (nothing listens) for `s` seconds: a
    dropped network path. `drop_answer_to(marker)`: the next message with `marker` reaches the
    server, which runs it, but its answer is lost and the client's connection cut: an
    ambiguous commit."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target_port = target_port
        self.host = host
        self.port = free_port()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.cuts = 0
        self.drops = 0
        self.answered = 0  # dropped answers whose statement the server committed
        self._marker: bytes | None = None
        self._hold_until = 0.0  # monotonic time before which new connections wait
        self._listen()

    def drop_answer_to(self, marker: bytes) -> None:
        self._marker = marker

    def _listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: an outage, or the end
            # After a dropped answer, the next connection (the client's retry) waits until the
            # dropped statement has surely run: on a loaded machine the retry could otherwise
            # reach the server first, and the test would see another, equally correct, path.
            time.sleep(max(0.0, self._hold_until - time.monotonic()))
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks |= {client, upstream}
            dropped = threading.Event()  # this connection's answers are lost from now on
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up, dropped), daemon=True).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, up: bool, dropped: threading.Event
    ) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if dropped.is_set() and not up:
                    # The server's answer to the marked statement, lost on the way. Once it
                    # says it is ready again (ReadyForQuery, 'Z'), the statement has run and
                    # committed: the client's connection is cut then. (Cut at once, as before,
                    # the rest of the client's message, its Sync, could be lost on a loaded
                    # machine, and the statement rolled back: another, equally correct, path.)
                    # Its status byte says whether that committed: 'I' (idle) means no
                    # transaction is left open; 'T' means the statement ran inside one whose
                    # COMMIT the client never got to send, so it rolls back when cut.
                    buf = tail + data
                    at = buf.find(_READY)
                    if at >= 0 and at + len(_READY) < len(buf):
                        if buf[at + len(_READY)] == ord("I"):
                            self.answered += 1
                        return
                    tail = buf[at:] if at >= 0 else buf[-len(_READY) :]
                    continue
                marker = self._marker
                if up and marker is not None and marker in data:
                    # Marked before the bytes go on, not after: once they are sent, the
                    # server's answer can reach the other pump first on a loaded machine; it
                    # was then relayed, and the next statement's answer on this connection
                    # (another transaction's BEGIN: 'T'; an autocommit: 'I') was lost instead.
                    self._marker = None
                    self.drops += 1
                    self._hold_until = time.monotonic() + 2.5
                    dropped.set()  # the client's bytes still go on; the answers no more
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _shut(s)
            with self._lock:
                self._socks -= {src, dst}

    def outage(self, seconds: float) -> None:
        assert self._listener is not None
        _shut(self._listener)  # wakes its accept(), which close() alone would not
        self._listener.close()  # new connections: refused
        with self._lock:
            open_now = list(self._socks)
        for s in open_now:  # open ones: cut
            _shut(s)
        self.cuts += len(open_now) // 2
        time.sleep(seconds)
        self._listen()

    def close(self) -> None:
        if self._listener is not None:
            _shut(self._listener)
            self._listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()


def _shut(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
