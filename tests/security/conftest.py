"""Fixtures: a CA made for the test, and brokers that authenticate callers over real gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.security import AuthSettings, ClientCredentials, ServerTLS, hash_token
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.base import Store
from crossflow_ctl.store.memory import MemoryStore
from tests.security.pki import TestCA

POLICY = PolicySettings(borrow_share=1.0, hold_ttl_ms=5_000, max_lease_ttl_ms=5_000)


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "pki")


class Brokers:
    """Starts brokers with given auth settings on one store; ``creds`` makes client creds."""

    def __init__(self, ca: TestCA, tmp: Path, store: Store) -> None:
        self.ca = ca
        self.tmp = tmp
        self.store = store
        self.servers: list[BrokerServer] = []
        self.server_pair = ca.server()

    def mtls(self, **auth: Any) -> AuthSettings:
        tls = ServerTLS(
            cert_file=self.server_pair.cert,
            key_file=self.server_pair.key,
            client_ca_file=self.ca.cert,
        )
        return AuthSettings(tls=tls, **auth)

    def tokens(self, mapping: dict[str, str], *, tls: bool = False) -> AuthSettings:
        """Token auth; ``mapping`` token -> ``role/name``; the file holds only hashes."""
        path = self.tmp / "tokens.txt"
        lines = [f"{hash_token(tok)} spiffe://crossflow/{who}" for tok, who in mapping.items()]
        path.write_text("# test tokens\n" + "\n".join(lines) + "\n")
        server_tls = (
            ServerTLS(cert_file=self.server_pair.cert, key_file=self.server_pair.key)
            if tls
            else ServerTLS()
        )
        return AuthSettings(tls=server_tls, token_file=path)

    async def start(self, auth: AuthSettings, **settings: Any) -> BrokerServer:
        fields: dict[str, Any] = {"listen": "127.0.0.1:0", "policy": POLICY}
        fields.update(stream_grace_s=1.0, notice_block_ms=200, auth=auth, **settings)
        cfg = BrokerSettings(**fields)
        server = BrokerServer(cfg, self.store, SystemClock())
        await server.start()
        self.servers.append(server)
        return server

    def creds(self, role: str, name: str) -> ClientCredentials:
        pair = self.ca.client(role, name)
        return ClientCredentials(
            ca_file=self.ca.cert,
            cert_file=pair.cert,
            key_file=pair.key,
            server_name="localhost",
        )

    def token(self, token: str, *, tls: bool = False) -> ClientCredentials:
        path = self.tmp / f"token-{abs(hash(token))}"
        path.write_text(token + "\n")
        if tls:
            return ClientCredentials(ca_file=self.ca.cert, server_name="localhost", token_file=path)
        return ClientCredentials(token_file=path)


@pytest.fixture
async def brokers(ca: TestCA, tmp_path: Path) -> AsyncIterator[Brokers]:
    b = Brokers(ca, tmp_path, MemoryStore(seed=3))
    try:
        yield b
    finally:
        for server in b.servers:
            await server.stop(grace_s=0.5)


def target(server: BrokerServer) -> str:
    return f"127.0.0.1:{server.port}"


Factory = Callable[..., Any]
