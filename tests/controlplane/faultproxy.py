"""The fault proxy of the e2e tests (tests/controlplane/faultproxy/main.go): built with Go
into .cache/faultproxy/<source hash>, started between canaryd and the real
kube-apiserver, and switched through its control API (half-open, black hole,
latency, resets, an outage behind a load balancer that answers 503, heal). See
main.go for why it exists beside Toxiproxy.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import yaml

HERE = Path(__file__).resolve().parent / "faultproxy"
ROOT = HERE.parent.parent.parent


def build() -> Path:
    """The proxy binary, built once per source version (a no-op when it is there)."""
    digest = hashlib.sha256()
    for name in ("go.mod", "main.go"):
        digest.update((HERE / name).read_bytes())
    out = ROOT / ".cache" / "faultproxy" / digest.hexdigest()[:16] / "faultproxy"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["go", "build", "-trimpath", "-o", str(out), "."],
            cwd=HERE,
            check=True,
            env={**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"},
            timeout=300,
        )
    return out


class FaultProxy:
    def __init__(self, process: subprocess.Popen[str], address: str, control: str) -> None:
        self.process, self.address, self.control = process, address, control

    def _post(self, path: str) -> str:
        request = urllib.request.Request(f"http://{self.control}{path}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:  # 127.0.0.1 only
            return response.read().decode().strip()

    def freeze(self) -> str:
        """Half-open: established connections go silent; new ones work."""
        return self._post("/freeze")

    def blackhole(self) -> str:
        """New connects time out, established connections freeze."""
        return self._post("/blackhole")

    def latency(self, seconds: float) -> str:
        """Added to everything the server sends."""
        return self._post(f"/latency?ms={int(seconds * 1000)}")

    def reset(self) -> str:
        """Every established connection gets a RST."""
        return self._post("/reset")

    def cut_next_answer(self, after_bytes: int = 1000) -> str:
        """The next answer is lost: the first connection whose client sends
        ``after_bytes`` or more from now is reset when the answer comes back (the
        server got the request: a write is applied, the client cannot tell)."""
        return self._post(f"/cut?bytes={after_bytes}")

    def cuts(self) -> int:
        return int(self._get("/cuts"))

    def outage(self, after_bytes: int | None = None) -> str:
        """The API server goes away behind a load balancer that answers every request
        503 "no healthy upstream" (text/plain) and resets every open connection; with
        ``after_bytes``, once the next answer to a request of that size or more (a
        bump) has been passed on, what the server sent on other connections since (its
        watch event) lost."""
        return self._post("/outage" + (f"?after_bytes={after_bytes}" if after_bytes else ""))

    def outage_state(self) -> str:
        """off, armed or on."""
        return self._get("/outage")

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://{self.control}{path}", timeout=10) as response:
            return response.read().decode().strip()

    def heal(self) -> str:
        return self._post("/heal")

    def kubeconfig(self, source: Path, target: Path) -> Path:
        """``source`` with its cluster's server pointing at the proxy (same TLS names)."""
        config = yaml.safe_load(source.read_text())
        for cluster in config["clusters"]:
            server = urlsplit(cluster["cluster"]["server"])
            cluster["cluster"]["server"] = f"{server.scheme}://{self.address}"
        target.write_text(yaml.safe_dump(config))
        target.chmod(0o600)
        return target


@contextlib.contextmanager
def fault_proxy(upstream_url: str, tls: tuple[Path, Path] | None = None) -> Iterator[FaultProxy]:
    """A fault proxy in front of ``upstream_url`` (https://127.0.0.1:PORT); ``tls``, the
    server's certificate and key, to answer for it in an outage."""
    upstream = urlsplit(upstream_url)
    binary = build()
    certificate = ["-cert", str(tls[0]), "-key", str(tls[1])] if tls else []
    process = subprocess.Popen(
        [str(binary), "-upstream", f"{upstream.hostname}:{upstream.port}", *certificate],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        words = process.stdout.readline().split()  # "proxy ADDR control ADDR"
        if len(words) != 4:
            raise RuntimeError(f"faultproxy did not start: {words}")
        yield FaultProxy(process, words[1], words[3])
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
