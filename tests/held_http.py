"""Test support (no tests here): a loopback HTTP server that holds one file until the test lets it go.

A run whose manifest names `<url>/hold.png` last is certainly still running (blocked in that read) until
`release` is set: the event tests gate on instead of a timing."""
from __future__ import annotations

import json
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class HoldingServer:
    """Serves `root`; GET /hold.png waits until `release` is set."""

    def __init__(self, root: Path):
        self.release = threading.Event()
        release = self.release

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/hold.png":
                    release.wait(600)
                super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.httpd.handle_error = lambda request, address: None  # a reader killed mid-body (the stopped run)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def held_manifest(tmp_path: Path, n_free: int) -> tuple[Path, HoldingServer]:
    """`n_free` small PNGs served at once, then `hold.png` (held); returns (manifest.jsonl, server)."""
    import numpy as np
    from PIL import Image

    media = tmp_path / "media"
    media.mkdir()
    names = [f"img{i:02d}.png" for i in range(n_free)] + ["hold.png"]
    for i, name in enumerate(names):
        Image.fromarray((np.random.default_rng(i).random((40, 48, 3)) * 255).astype("uint8")).save(media / name)
    server = HoldingServer(media)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(
        json.dumps({"media_uri": f"{server.url}/{n}", "media_type": "image"}) + "\n" for n in names))
    return manifest, server
