"""Redis as untrusted input (issue 33, item 8), against a real redis-server: what another writer puts there
is validated as registration validates, dropped and counted when it fails, and never stops a replica;
secrets are never kept there in plain text; a password and TLS are configured beside the URL.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from proxy.config import ProxyConfig, StateConfig, StateTLS
from proxy.observability.metrics import ProxyMetrics
from proxy.protocol import WorkerRegistration
from proxy.workers.redis_mirror import EVENTS_CHANNEL, WORKERS_KEY, RedisState
from proxy.workers.registry import Registry
from tests.support.procs import free_port, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
SECRET_KEY = "a shared state key, 32+ chars long"
ENGINE_KEY = "sk-engine-8c1f5e2a-do-not-store"


@dataclass
class Replica:
    """One proxy replica's shared state, in process: its registry, its Redis mirror and its metrics."""

    state: RedisState
    metrics: ProxyMetrics

    @property
    def registry(self) -> Registry:
        return self.state.registry

    @property
    def dropped(self) -> Counter[str]:
        return self.state.dropped


@pytest.fixture
async def replicas(redis_url) -> AsyncIterator[Callable[..., Replica]]:
    started: list[RedisState] = []

    async def start(secret_key: str | None = SECRET_KEY) -> Replica:
        registry = Registry()
        metrics = ProxyMetrics(registry)
        # port 1: this replica's own address, which no worker URL may name
        state = RedisState(registry, StateConfig(url=redis_url, secret_key=secret_key), ProxyConfig(port=1),
                           on_dropped=metrics.redis_dropped)
        await state.start()
        started.append(state)
        return Replica(state, metrics)

    yield start
    for state in started:
        await state.stop()


async def until(predicate: Callable[[], object], within: float = 5.0, what: str = "condition",
                retry: Callable[[], object] | None = None) -> None:
    """Wait for `predicate` (calling `retry` between looks: a message published before a replica's subscription
    exists reaches nobody)."""
    deadline = time.monotonic() + within
    while not predicate():
        if retry is not None:
            retry()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def registration(worker_id: str, url: str = "http://127.0.0.1:9001", **extra: object) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, url=url, models=["m1"], **extra)


async def test_junk_on_the_events_channel_is_dropped_and_counted_and_the_subscriber_keeps_going(replicas, redis_url):
    # One PUBLISH of a non-JSON message used to kill every replica's subscriber for good.
    a, b = await replicas(), await replicas()
    raw = aioredis.from_url(redis_url)
    junk = [b"not json", b"[1,2]", b'{"kind":"register","worker_id":"x\\r\\ny","entry":{}}',
            b'{"kind":"report","worker_id":"w9","report":{"seq":' + b"9" * 30 + b"}}",
            orjson.dumps({"kind": "register", "worker_id": "w9", "entry": {"registration": {"worker_id": "w9",
                          "url": "http://127.0.0.1:9", "models": ["m1\r\nSet-Cookie: a=b"]}}}),
            orjson.dumps({"kind": "drain", "worker_id": "w9", "entry": "nope"}), b"\xff\xfe"]
    try:
        await until(lambda: b.state.subscribed, what="b subscribed")
        for message in junk:
            await raw.publish(EVENTS_CHANNEL, message)
        await until(lambda: sum(b.dropped.values()) >= len(junk), what="every junk event counted")
        a.registry.register(registration("w1"))
        await until(lambda: b.registry.get("w1") is not None, what="a genuine event after the junk")
        assert [w.worker_id for w in b.registry.workers()] == ["w1"]
        text = b.metrics.render().decode()
        assert 'kvroute:redis_dropped_total{reason="malformed"}' in text
        assert 'kvroute:redis_dropped_total{reason="invalid"}' in text
    finally:
        await raw.aclose()


async def test_the_subscriber_subscribes_again_after_its_connection_is_killed(replicas, redis_url):
    a, b = await replicas(), await replicas()
    a.registry.register(registration("w1"))
    await until(lambda: b.registry.get("w1") is not None, what="the first worker")
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.client_kill_filter(_type="pubsub") >= 2
    finally:
        client.close()
    a.registry.register(registration("w2", "http://127.0.0.1:9002"))
    # a resync (RESYNC_INTERVAL_S) would also bring w2; a drain is carried by events alone
    await until(lambda: b.registry.get("w2") is not None, 10, what="the second worker")
    await asyncio.sleep(1.0)  # the subscriber's backoff starts at 0.5 s
    a.registry.drain("w1")
    await until(lambda: b.registry.get("w1").drain_requested, 10, what="a drain through the new subscription")


@pytest.mark.parametrize("url", ["http://169.254.169.254:80", "http://203.0.113.5:8000", "http://[fe80::1]:80",
                                 "http://127.0.0.1:1"])
async def test_a_worker_written_into_redis_outside_worker_networks_is_not_adopted(replicas, redis_url, url):
    # Registration refuses these URLs (proxy.worker_networks, or the proxy's own port 1 here); Redis may not
    # bring them in around it, neither at start-up nor through an event.
    entry = {"registration": {"worker_id": "evil", "url": url, "models": ["m1"]}, "source": "api",
             "draining": False, "secret_hash": None}
    client = redis.Redis.from_url(redis_url)
    try:
        client.hset(WORKERS_KEY, "evil", orjson.dumps(entry))
        client.hset(WORKERS_KEY, "bad\r\nid", orjson.dumps(entry))
        client.hset(WORKERS_KEY, "junk", b"{not json")
        a = await replicas()
        assert a.registry.workers() == [] and a.dropped["url_not_allowed"] >= 1 and a.dropped["invalid"] >= 1
        event = orjson.dumps({"kind": "register", "worker_id": "evil", "entry": entry})
        await until(lambda: a.dropped["url_not_allowed"] >= 2, what="the event refused too",
                    retry=lambda: client.publish(EVENTS_CHANNEL, event))
        assert a.registry.workers() == []
        assert 'kvroute:redis_dropped_total{reason="url_not_allowed"}' in a.metrics.render().decode()
    finally:
        client.close()


async def test_engine_keys_are_sealed_in_redis_and_open_only_on_replicas_that_share_the_key(replicas, redis_url):
    raw = aioredis.from_url(redis_url)
    published: list[bytes] = []
    pubsub = raw.pubsub()
    await pubsub.subscribe(EVENTS_CHANNEL)

    async def listen() -> None:
        async for message in pubsub.listen():
            if message["type"] == "message":
                published.append(message["data"])

    listener = asyncio.create_task(listen())
    try:
        a, b = await replicas(), await replicas()
        other = await replicas(secret_key="another key that this replica was given")
        a.registry.register(registration("w1", api_key=ENGINE_KEY))
        await until(lambda: b.registry.get("w1") is not None and other.registry.get("w1") is not None,
                    what="the worker on both replicas")
        assert b.registry.get("w1").api_key == ENGINE_KEY  # b can still send the engine its key
        assert other.registry.get("w1").api_key is None and other.dropped["key_unreadable"] >= 1
        await until(lambda: published, what="the published event")
        stored = b"".join([k + v for k, v in (await raw.hgetall(WORKERS_KEY)).items()]
                          + [await raw.dump(k) or b"" for k in await raw.keys("*")] + published)
        assert ENGINE_KEY.encode() not in stored and b"w1" in stored
        assert b"api_key_sealed" in stored
    finally:
        listener.cancel()
        await pubsub.aclose()
        await raw.aclose()


async def test_without_a_key_to_seal_it_an_engine_key_is_not_kept_in_redis_at_all(replicas, redis_url):
    a = await replicas(secret_key=None)  # and no admin token in its ProxyConfig
    a.registry.register(registration("w1", api_key=ENGINE_KEY))
    raw = aioredis.from_url(redis_url)
    try:
        entry = None
        for _ in range(250):
            if entry := await raw.hget(WORKERS_KEY, "w1"):
                break
            await asyncio.sleep(0.02)
        assert entry is not None and b'"url":"http://127.0.0.1:9001"' in entry
        assert ENGINE_KEY.encode() not in entry and b"api_key" not in entry
    finally:
        await raw.aclose()


# --- a password and TLS beside the URL --------------------------------------------------------------------

def _certificates(folder) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1, made here (no files are committed)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "redis")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False).sign(ca_key, hashes.SHA256()))
    paths = (folder / "ca.pem", folder / "redis.pem", folder / "redis.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return tuple(str(p) for p in paths)  # type: ignore[return-value]


async def test_a_password_and_tls_from_the_config_beside_a_plain_url(procs, tmp_path):
    assert shutil.which("redis-server"), "redis-server is not installed: run `make test` (it installs it)"
    ca, cert, key = _certificates(tmp_path)
    port = free_port()
    procs.start(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                 "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no",
                 "--requirepass", "s3cret-redis-pass", "--save", "", "--appendonly", "no"], name="redis-tls")
    url = f"redis://127.0.0.1:{port}/0"  # no password, no rediss://: both come from the config
    good = StateConfig(url=url, password="s3cret-redis-pass", tls=StateTLS(ca_file=ca), secret_key=SECRET_KEY)

    def answers(state: StateConfig) -> bool:
        client = redis.Redis.from_url(url.replace("redis://", "rediss://"), password=state.password,
                                      ssl_ca_certs=ca, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()

    wait_until(lambda: answers(good), 15, what="redis-server with TLS to answer")
    a, b = RedisState(Registry(), good), RedisState(Registry(), good)
    wrong = RedisState(Registry(), good.model_copy(update={"password": "guess"}))
    plain = RedisState(Registry(), StateConfig(url=url, password="s3cret-redis-pass"))  # no TLS: refused
    for state in (a, b, wrong, plain):
        await state.start()
    try:
        assert a.connected and b.connected and not wrong.connected and not plain.connected
        a.registry.register(registration("w1"))
        await until(lambda: b.registry.get("w1") is not None, what="the worker through TLS")
        assert wrong.registry.workers() == [] and plain.registry.workers() == []
    finally:
        for state in (a, b, wrong, plain):
            await state.stop()
