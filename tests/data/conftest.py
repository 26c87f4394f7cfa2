"""A local HTTP file server for the download tests (127.0.0.1, a free port; never the internet)."""

from __future__ import annotations

import http.server
import threading
import time

import pytest


class Server:
    """Serves ``files`` by name. Modes: normal (honours Range), drop (first response stops
    halfway), ignore_range (always 200), stall (headers, then silence)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.mode = "normal"
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                name = self.path.lstrip("/")
                rng = self.headers.get("Range")
                server.requests.append((name, rng))
                if name not in server.files:
                    self.send_error(404, "Not Found")
                    return
                body, start = server.files[name], 0
                if rng and server.mode != "ignore_range":
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        self.send_error(416, "Range Not Satisfiable")
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                payload = body[start:]
                if server.mode == "drop":
                    server.mode = "normal"  # only the first response is cut
                    self.wfile.write(payload[:len(payload) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if server.mode == "stall":
                    time.sleep(1.5)
                self.wfile.write(payload)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server():
    server = Server()
    yield server
    server.close()
