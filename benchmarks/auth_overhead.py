"""What authentication costs an Admit, next to the plaintext floor measured in the same run.

    python benchmarks/auth_overhead.py [--calls 2000]

Starts in-process brokers on loopback (embedded store, borrowing disabled so Admit answers
NORMAL at once and the figures are transport + authorization only) and times sequential
AdmissionService.Admit calls from one client each:

* ``plaintext, no auth``       the floor: today's default
* ``bearer token, plaintext``  token file lookup (sha256 + constant-time compare) per call
* ``TLS, no client auth``      encryption only
* ``mTLS + rules``             client certificate identity, rule table, owner recorded

Certificates and the token are made for the run (tests/security/pki.py). Prints p50/p99 in
microseconds and each p50 over the floor's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.security import (
    AuthSettings,
    ClientCredentials,
    ServerTLS,
    hash_token,
)
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.security.pki import TestCA


async def _time(auth: AuthSettings, creds: ClientCredentials, calls: int) -> list[float]:
    settings = BrokerSettings(
        listen="127.0.0.1:0", auth=auth, policy=PolicySettings(enabled=False), log_level="error"
    )
    server = BrokerServer(settings, MemoryStore())
    await server.start()
    try:
        async with AdmissionClient(
            f"127.0.0.1:{server.port}", timeout_s=5, credentials=creds
        ) as client:
            for _ in range(50):  # warm up: channel, handshake
                await client.admit(uncached_prompt_tokens=1_000)
            out = []
            for _ in range(calls):
                started = time.perf_counter()
                await client.admit(uncached_prompt_tokens=1_000)
                out.append((time.perf_counter() - started) * 1e6)
            return out
    finally:
        await server.stop(grace_s=0.1)


async def main(calls: int) -> None:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    with tempfile.TemporaryDirectory() as tmp:
        ca = TestCA(Path(tmp) / "pki")
        server, router = ca.server(), ca.client("router", "bench")
        tokens = Path(tmp) / "tokens"
        tokens.write_text(f"{hash_token('bench-token')} spiffe://crossflow/router/bench\n")
        token_file = Path(tmp) / "token"
        token_file.write_text("bench-token")
        tls = ServerTLS(cert_file=server.cert, key_file=server.key)
        mtls = ServerTLS(cert_file=server.cert, key_file=server.key, client_ca_file=ca.cert)
        cases = [
            ("plaintext, no auth", AuthSettings(), ClientCredentials()),
            (
                "bearer token, plaintext",
                AuthSettings(token_file=tokens),
                ClientCredentials(token_file=token_file),
            ),
            (
                "TLS, no client auth",
                AuthSettings(tls=tls),
                ClientCredentials(ca_file=ca.cert, server_name="localhost"),
            ),
            (
                "mTLS + rules",
                AuthSettings(tls=mtls),
                ClientCredentials(
                    ca_file=ca.cert,
                    cert_file=router.cert,
                    key_file=router.key,
                    server_name="localhost",
                ),
            ),
        ]
        floor = 0.0
        print(f"{'case':<26}{'p50 us':>10}{'p99 us':>10}{'p50/floor':>11}   ({calls} Admits each)")
        for name, auth, creds in cases:
            samples = sorted(await _time(auth, creds, calls))
            p50 = statistics.median(samples)
            p99 = samples[int(len(samples) * 0.99) - 1]
            floor = floor or p50
            print(f"{name:<26}{p50:>10.0f}{p99:>10.0f}{p50 / floor:>10.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    asyncio.run(main(parser.parse_args().calls))
