"""JetStream layout of the mesh and a thin typed wrapper over nats-py (docs/DESIGN.md §1, §5).

::

             TASKS (work queue)        TRAJ_RAW (work queue)     TRAJ_GRADED (work queue)
   store ───────────────────▶ rollout ──────────────────▶ grader ──────────────────▶ store
                                                                                       │
   rollout ◀── KV trajmesh_weights["latest"] + WEIGHTS (limits, last N) ◀── learner ◀──┘
   evaluator ◀── (same KV watch) ;  evaluator ── EVAL (limits, every record) ──▶ learner, readers
   (what the weights KV and stream carry, and how they are read: trajmesh/weights/announce.py)

   any message above the server's max_payload: bytes ─▶ object store `trajmesh_blobs`,
   the stream carries an empty message with header `Trajmesh-Blob: <name>`.

Work-queue streams delete a message once it is acked, and admit one durable consumer per
subject; services scale by binding several pull subscribers to that one durable, which share the
work. Delivery is at-least-once: an unacked message comes back after ``ack_wait``, so every
consumer dedupes by id. Publishers set ``msg_id`` so a retried publish within the stream's
duplicate window is stored once.

Poison and blobs. A message delivered more than ``max_deliveries`` times (it crashed or stalled
its consumer that often) is not handed out again: :meth:`Consumer.fetch` passes it to the
consumer's ``on_poison`` hook (the store archives it), terminates it (JetStream ``AckTerm``) and
counts it in ``trajmesh_bus_poison_messages_total``. A message that travelled through the object
store deletes its blob once its outcome is final: on ``ack()`` (confirmed by the server first) or
``term()``.

Store partitions. With ``store.replicas: N > 1`` each store replica owns the groups whose
:func:`partition_of` is its index: the grader publishes a graded trajectory on its partition's
subject (:func:`graded_subject`, ``trajmesh.traj.graded.<k>``) and replica k consumes that subject
alone through its own durable (:func:`store_durable`, ``store-<k>``). With one replica the subject
and the durable are the unpartitioned ones.

A ``namespace`` lets two runs share one NATS server: it prefixes every stream (``run1_TASKS``),
subject (``run1.trajmesh.tasks``), KV bucket and object-store bucket. Callers always speak in the
unprefixed constants below; the :class:`Bus` applies the namespace.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
import uuid
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType

import nats
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore
from prometheus_client import Counter

__all__ = [
    "BLOB_HEADER",
    "KV_WEIGHTS",
    "OBJ_BLOBS",
    "STREAM_EVAL",
    "STREAM_TASKS",
    "STREAM_TRAJ_GRADED",
    "STREAM_TRAJ_RAW",
    "STREAM_WEIGHTS",
    "SUBJECT_EVAL",
    "SUBJECT_EVAL_GRADE",
    "SUBJECT_TASKS",
    "SUBJECT_TRAJ_GRADED",
    "SUBJECT_TRAJ_RAW",
    "SUBJECT_WEIGHTS",
    "WEIGHTS_VERSION_HEADER",
    "Bus",
    "Consumer",
    "ConsumerPending",
    "Layout",
    "PoisonHook",
    "StreamSpec",
    "connect",
    "graded_subject",
    "partition_of",
    "store_durable",
]

# Streams and their subjects (unprefixed; see Layout for namespacing).
STREAM_TASKS = "TASKS"
SUBJECT_TASKS = "trajmesh.tasks"
STREAM_TRAJ_RAW = "TRAJ_RAW"
SUBJECT_TRAJ_RAW = "trajmesh.traj.raw"
STREAM_TRAJ_GRADED = "TRAJ_GRADED"
SUBJECT_TRAJ_GRADED = "trajmesh.traj.graded"
STREAM_WEIGHTS = "WEIGHTS"
SUBJECT_WEIGHTS = "trajmesh.weights"
# Held-out evaluation records (one JSON record per evaluated version, services/evaluator.py).
STREAM_EVAL = "EVAL"
SUBJECT_EVAL = "trajmesh.eval"
# Held-out episodes graded on request (core NATS request/reply, no stream: nothing is stored, the
# store never sees them): the evaluator asks, one grader replica (queue group `grader`) answers.
SUBJECT_EVAL_GRADE = "trajmesh.grade.eval"
EVAL_HISTORY = 100_000
"""Eval records the EVAL stream keeps (a record per evaluated version: a run's whole history)."""

# Weight announcements for late joiners, and anchor requests: the KV bucket.
KV_WEIGHTS = "trajmesh_weights"
"""Its keys and what is written under them: `trajmesh.weights.announce`."""
# Object store for payloads above the server's max_payload.
OBJ_BLOBS = "trajmesh_blobs"

# Header naming the object-store blob that holds a message's real payload.
BLOB_HEADER = "Trajmesh-Blob"
# Header carrying the policy version on messages of the WEIGHTS stream.
WEIGHTS_VERSION_HEADER = "Trajmesh-Weights-Version"

# Bytes kept free under max_payload for headers before a payload goes to the object store.
_HEADER_HEADROOM_BYTES = 4096
# Object-store chunk size cap (nats-py's default chunk size).
_MAX_CHUNK_BYTES = 128 * 1024
# JetStream API error code: "stream name already in use with a different configuration".
_ERR_STREAM_NAME_IN_USE = 10058

_log = logging.getLogger("trajmesh.bus")

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_-]*$")

# Deliveries of one message before it counts as poison (see Consumer.fetch); config:
# infra.max_deliveries.
DEFAULT_MAX_DELIVERIES = 8
GRADER_ACK_WAIT_S = 30.0
"""The grader's TRAJ_RAW ack wait: a dead grader's messages come back after it (the store's
straggler hold is sized by it)."""
# Seconds an ack of a blob message may take to be confirmed before its blob is deleted.
_BLOB_ACK_TIMEOUT_S = 5.0
PUBLISH_RETRY_S = 60.0
"""How long a deduplicated publish (one with a msg id) is retried by its service before it fails:
NATS restarting, or the process paused past the request's deadline (the stream ack came while it
was stopped). The retried copy is stored once."""

PUBLISH_RETRIES = Counter(
    "trajmesh_bus_publish_retried_failures_total",
    "Failed publish attempts retried (a NATS error or timeout; the msg id stores the message once)",
    ["subject"],
)
POISON_MESSAGES = Counter(
    "trajmesh_bus_poison_messages_total",
    "Messages terminated (AckTerm) after more than max_deliveries deliveries",
    ["stream", "durable"],
)
BLOB_DELETE_FAILURES = Counter(
    "trajmesh_bus_blob_delete_failures_total",
    "Object-store blobs not deleted when their message was final (left to the bucket's TTL)",
    ["reason"],
)

PoisonHook = Callable[[Msg], Awaitable[None]]
"""Called with a poison message (payload still resolvable) before it is terminated."""


@dataclass(frozen=True)
class StreamSpec:
    """One stream of the mesh, unprefixed."""

    name: str
    subject: str
    retention: api.RetentionPolicy
    # Messages kept per subject of a limits stream; -1: the weights history (`ensure_streams`).
    # Work queues keep every message until it is acked.
    max_msgs_per_subject: int = -1
    # The stream also holds one subject per store partition, ``<subject>.<k>`` (graded_subject).
    partitioned: bool = False

    @property
    def subjects(self) -> tuple[str, ...]:
        return (self.subject, f"{self.subject}.*") if self.partitioned else (self.subject,)


_SPECS: tuple[StreamSpec, ...] = (
    StreamSpec(STREAM_TASKS, SUBJECT_TASKS, api.RetentionPolicy.WORK_QUEUE),
    StreamSpec(STREAM_TRAJ_RAW, SUBJECT_TRAJ_RAW, api.RetentionPolicy.WORK_QUEUE),
    StreamSpec(STREAM_TRAJ_GRADED, SUBJECT_TRAJ_GRADED, api.RetentionPolicy.WORK_QUEUE, partitioned=True),
    StreamSpec(STREAM_WEIGHTS, SUBJECT_WEIGHTS, api.RetentionPolicy.LIMITS),
    StreamSpec(STREAM_EVAL, SUBJECT_EVAL, api.RetentionPolicy.LIMITS, max_msgs_per_subject=EVAL_HISTORY),
)


def partition_of(group_id: str, partitions: int) -> int:
    """The store replica that owns group `group_id` among `partitions`: crc32 of the id, modulo
    (the same in every process and after every restart; Python's `hash` is salted per process)."""
    return zlib.crc32(group_id.encode()) % partitions if partitions > 1 else 0


def graded_subject(partition: int, partitions: int) -> str:
    """The (unprefixed) TRAJ_GRADED subject of store partition `partition` of `partitions`."""
    return SUBJECT_TRAJ_GRADED if partitions <= 1 else f"{SUBJECT_TRAJ_GRADED}.{partition}"


def store_durable(partition: int, partitions: int) -> str:
    """The durable consumer of TRAJ_GRADED that store replica `partition` of `partitions` binds."""
    return "store" if partitions <= 1 else f"store-{partition}"


@dataclass(frozen=True)
class Layout:
    """Maps the unprefixed names above to the names used on the server for one namespace."""

    namespace: str = ""

    def __post_init__(self) -> None:
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(f"namespace must match [A-Za-z0-9_-]*, got {self.namespace!r}")

    def stream(self, name: str) -> str:
        return f"{self.namespace}_{name}" if self.namespace else name

    def subject(self, subject: str) -> str:
        return f"{self.namespace}.{subject}" if self.namespace else subject

    def bucket(self, name: str) -> str:
        return f"{self.namespace}_{name}" if self.namespace else name

    def spec(self, stream: str) -> StreamSpec:
        """The spec of an unprefixed stream name (KeyError for an unknown stream)."""
        for spec in _SPECS:
            if spec.name == stream:
                return spec
        raise KeyError(f"unknown stream {stream!r}; known: {[s.name for s in _SPECS]}")

    @property
    def specs(self) -> tuple[StreamSpec, ...]:
        return _SPECS


@dataclass(frozen=True)
class ConsumerPending:
    """Backlog of one durable consumer, for lag metrics and autoscaling."""

    # Messages in the stream not yet delivered to this consumer.
    num_pending: int
    # Messages delivered and awaiting an ack.
    num_ack_pending: int
    # Messages delivered more than once and still unacked.
    num_redelivered: int
    # Pull requests currently waiting on the server.
    num_waiting: int

    @property
    def backlog(self) -> int:
        """Work not yet finished: undelivered plus unacked."""
        return self.num_pending + self.num_ack_pending


def _blob_name(msg: Msg) -> str | None:
    headers = msg.headers
    return headers.get(BLOB_HEADER) if headers else None


class _Blobs:
    """Object-store side of large payloads, shared by the Bus and its consumers."""

    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self._js = js
        self._bucket = bucket
        self._store: ObjectStore | None = None

    async def store(self) -> ObjectStore:
        if self._store is None:
            self._store = await self._js.object_store(self._bucket)
        return self._store

    async def resolve(self, msg: Msg) -> bytes:
        name = _blob_name(msg)
        if name is None:
            return bytes(msg.data)
        result = await (await self.store()).get(name)
        return bytes(result.data or b"")

    async def discard(self, msg: Msg) -> None:
        name = _blob_name(msg)
        if name is None:
            return
        try:
            await (await self.store()).delete(name)
        except nats.js.errors.NotFoundError:
            pass  # already discarded by an earlier delivery of the same message
        except (nats.errors.Error, asyncio.TimeoutError) as err:
            BLOB_DELETE_FAILURES.labels(reason=type(err).__name__).inc()
            _log.warning("blob %s not deleted (%s); the bucket's TTL expires it", name, err)


class _BlobMsg(Msg):
    """A delivered message whose payload is a blob: deletes the blob once its outcome is final.

    ``ack()`` waits for the server to confirm the ack before deleting (a lost ack would redeliver a
    message whose blob is gone); an unconfirmed ack keeps the blob. ``term()`` deletes it too.
    """

    _blobs: _Blobs

    @classmethod
    def wrap(cls, msg: Msg, blobs: _Blobs) -> _BlobMsg:
        wrapped = cls.__new__(cls)
        wrapped.__dict__.update(msg.__dict__)
        wrapped._blobs = blobs
        return wrapped

    async def ack(self) -> None:
        try:
            await self.ack_sync(timeout=_BLOB_ACK_TIMEOUT_S)
        except (nats.errors.Error, asyncio.TimeoutError) as err:
            BLOB_DELETE_FAILURES.labels(reason="ack_unconfirmed").inc()
            _log.warning("ack of %s not confirmed (%s); its blob is kept", self.subject, err)
            return
        await self._blobs.discard(self)

    async def term(self) -> None:
        await super().term()
        await self._blobs.discard(self)


class Consumer:
    """Pull subscriber bound to one durable consumer with explicit acks.

    Several Consumers bound to the same durable share its messages (each message goes to one of
    them). Messages come back as nats-py ``Msg``: call ``await msg.ack()`` when done,
    ``msg.nak(delay=...)`` to retry, ``msg.in_progress()`` to extend ``ack_wait`` on long work,
    ``msg.term()`` to give up on a poison message; ``msg.metadata.num_delivered`` counts deliveries.
    Messages delivered more than ``max_deliveries`` times never come out of :meth:`fetch` (see the
    module docstring); blob messages delete their blob on ``ack()``/``term()``.
    """

    def __init__(
        self,
        sub: JetStreamContext.PullSubscription,
        *,
        js: JetStreamContext,
        stream: str,
        durable: str,
        blobs: _Blobs,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        on_poison: PoisonHook | None = None,
    ) -> None:
        self._sub = sub
        self._js = js
        self.stream = stream
        self.durable = durable
        self._blobs = blobs
        self.max_deliveries = max_deliveries
        """Deliveries a message may have; the next one terminates it as poison."""
        self.on_poison = on_poison
        """Awaited with each poison message before it is terminated (e.g. to archive it)."""

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Msg]:
        """Up to ``batch`` messages, waiting at most ``timeout`` seconds; [] when none arrived.

        Poison messages (more than ``max_deliveries`` deliveries) are terminated here and left out.
        """
        try:
            msgs = await self._sub.fetch(batch, timeout=timeout)
        except asyncio.TimeoutError:
            # nats-py raises nats.errors.TimeoutError (a subclass) on most paths, but a bare
            # asyncio.TimeoutError when the deadline runs out between its two pull requests.
            return []
        kept = []
        for msg in msgs:
            if _blob_name(msg) is not None:
                msg = _BlobMsg.wrap(msg, self._blobs)
            if msg.metadata.num_delivered > self.max_deliveries:
                await self._terminate(msg)
            else:
                kept.append(msg)
        return kept

    async def _terminate(self, msg: Msg) -> None:
        """Hand a poison message to the hook, terminate it (deleting its blob) and count it."""
        meta = msg.metadata
        _log.warning("%s/%s: message seq %s delivered %d times (max %d): terminated as poison",
                     self.stream, self.durable, meta.sequence.stream, meta.num_delivered, self.max_deliveries)
        if self.on_poison is not None:
            await self.on_poison(msg)
        await msg.term()
        POISON_MESSAGES.labels(stream=self.stream, durable=self.durable).inc()

    async def resolve(self, msg: Msg) -> bytes:
        """The message's payload, fetched from the object store when it travelled by reference."""
        return await self._blobs.resolve(msg)

    async def discard_blob(self, msg: Msg) -> None:
        """Delete the object-store blob behind ``msg`` (if any). Messages from :meth:`fetch` do
        this themselves on ``ack()``/``term()``; this is for messages obtained otherwise."""
        await self._blobs.discard(msg)

    async def pending(self) -> ConsumerPending:
        return _pending(await self._js.consumer_info(self.stream, self.durable))

    async def close(self) -> None:
        """Unsubscribe this subscriber; the durable consumer and its unacked messages remain."""
        await self._sub.unsubscribe()


def _pending(info: api.ConsumerInfo) -> ConsumerPending:
    return ConsumerPending(
        num_pending=int(info.num_pending or 0),
        num_ack_pending=int(info.num_ack_pending or 0),
        num_redelivered=int(info.num_redelivered or 0),
        num_waiting=int(info.num_waiting or 0),
    )


class Bus:
    """A NATS connection with its JetStream context, speaking the mesh's layout.

    Create with :func:`connect`; call :meth:`ensure_streams` once per process (idempotent) before
    publishing or subscribing.
    """

    def __init__(self, nc: NATS, *, layout: Layout, max_deliveries: int = DEFAULT_MAX_DELIVERIES) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.layout = layout
        self.max_deliveries = max_deliveries
        """Default of :meth:`pull_subscribe`'s ``max_deliveries`` (config infra.max_deliveries)."""
        self._blobs = _Blobs(self.js, layout.bucket(OBJ_BLOBS))
        self._kv: KeyValue | None = None

    # -- layout ---------------------------------------------------------------------------
    async def ensure_streams(
        self,
        *,
        duplicate_window_s: float = 120.0,
        max_queue_msgs: int = 1_000_000,
        weights_history: int = 8,
        blob_ttl_s: float = 24 * 3600.0,
    ) -> None:
        """Create or update every stream, the weights KV bucket and the blob object store.

        ``max_queue_msgs`` bounds each work queue; a publish beyond it fails loudly (discard NEW)
        instead of silently dropping work. ``weights_history`` is how many announcements the
        WEIGHTS stream keeps. ``blob_ttl_s`` expires blobs whose consumer never discarded them.
        """
        for spec in self.layout.specs:
            work_queue = spec.retention == api.RetentionPolicy.WORK_QUEUE
            config = api.StreamConfig(
                name=self.layout.stream(spec.name),
                subjects=[self.layout.subject(subject) for subject in spec.subjects],
                retention=spec.retention,
                storage=api.StorageType.FILE,
                duplicate_window=duplicate_window_s,
                max_msgs=max_queue_msgs if work_queue else -1,
                max_msgs_per_subject=-1 if work_queue else (
                    spec.max_msgs_per_subject if spec.max_msgs_per_subject > 0 else weights_history),
                discard=api.DiscardPolicy.NEW if work_queue else api.DiscardPolicy.OLD,
            )
            await self._create_or_update_stream(config)
        await self.weights_kv()
        await self._ensure_object_store(blob_ttl_s)

    async def _create_or_update_stream(self, config: api.StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError as err:
            if err.err_code != _ERR_STREAM_NAME_IN_USE:
                raise
            await self.js.update_stream(config)

    async def weights_kv(self) -> KeyValue:
        """The weights KV bucket (created if missing); what goes in it: `trajmesh.weights.announce`."""
        if self._kv is None:
            bucket = self.layout.bucket(KV_WEIGHTS)
            try:
                self._kv = await self.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                self._kv = await self.js.create_key_value(
                    api.KeyValueConfig(bucket=bucket, history=1, storage=api.StorageType.FILE)
                )
        return self._kv

    async def _ensure_object_store(self, ttl_s: float) -> None:
        bucket = self.layout.bucket(OBJ_BLOBS)
        try:
            await self.js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            await self.js.create_object_store(
                bucket, config=api.ObjectStoreConfig(ttl=ttl_s, storage=api.StorageType.FILE)
            )

    # -- publish --------------------------------------------------------------------------
    @property
    def max_inline_bytes(self) -> int:
        """Largest payload sent inline; bigger ones travel through the object store."""
        return int(self.nc.max_payload) - _HEADER_HEADROOM_BYTES

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        retry_s: float = 0.0,
    ) -> api.PubAck:
        """Publish to a stream subject (unprefixed) and wait for the stream's ack.

        ``msg_id`` sets ``Nats-Msg-Id``: a second publish with the same id inside the duplicate
        window is not stored again (``PubAck.duplicate`` is True). Payloads above
        :attr:`max_inline_bytes` go through :meth:`publish_large`.

        With ``retry_s`` (it needs ``msg_id``, which makes a retry safe) a NATS error or timeout is
        retried with backoff for up to ``retry_s`` seconds, then raised.
        """
        if retry_s <= 0:
            return await self._publish_once(subject, data, msg_id=msg_id, headers=headers)
        if msg_id is None:
            raise ValueError("a retried publish needs a msg_id (a retry without one may be stored twice)")
        deadline = time.monotonic() + retry_s
        delay = 0.2
        while True:
            try:
                return await self._publish_once(subject, data, msg_id=msg_id, headers=headers)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as err:
                if time.monotonic() + delay > deadline:
                    raise
                PUBLISH_RETRIES.labels(subject=subject).inc()
                _log.warning("publishing %s on %s failed (%r); retrying in %.1f s", msg_id, subject, err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _publish_once(
        self, subject: str, data: bytes, *, msg_id: str | None, headers: dict[str, str] | None,
    ) -> api.PubAck:
        if len(data) > self.max_inline_bytes:
            return await self.publish_large(subject, data, msg_id=msg_id, headers=headers)
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs[api.Header.MSG_ID.value] = msg_id
        return await self.js.publish(self.layout.subject(subject), data, headers=hdrs or None)

    async def publish_large(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> api.PubAck:
        """Store ``data`` in the blob object store and publish an empty reference message.

        The blob is named after ``msg_id`` (a fresh uuid without one), so a retried publish
        rewrites the same blob and the stream dedupes the reference.
        """
        name = msg_id if msg_id is not None else uuid.uuid4().hex
        store = await self._blobs.store()
        chunk = max(1024, min(_MAX_CHUNK_BYTES, self.max_inline_bytes))
        meta = api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=chunk))
        await store.put(name, data, meta=meta)
        hdrs = dict(headers or {})
        hdrs[BLOB_HEADER] = name
        if msg_id is not None:
            hdrs[api.Header.MSG_ID.value] = msg_id
        try:
            return await self.js.publish(self.layout.subject(subject), b"", headers=hdrs)
        except BaseException:
            await store.delete(name)
            raise

    async def resolve(self, msg: Msg) -> bytes:
        """The message's payload, fetched from the object store when it travelled by reference."""
        return await self._blobs.resolve(msg)

    # -- consume --------------------------------------------------------------------------
    async def pull_subscribe(
        self,
        stream: str,
        durable: str,
        *,
        ack_wait_s: float = 30.0,
        max_deliveries: int | None = None,
        max_ack_pending: int = 1000,
        on_poison: PoisonHook | None = None,
        subject: str | None = None,
    ) -> Consumer:
        """Create or update the durable pull consumer on ``stream`` (unprefixed) and bind to it.
        ``subject`` (unprefixed; default: the stream's own) is the one subject it consumes.

        ``ack_wait_s``: seconds before an unacked message is redelivered (extend it with
        ``msg.in_progress()``). ``max_deliveries`` (default: the Bus's): deliveries a message may
        have; the next one is terminated as poison by :meth:`Consumer.fetch`, after ``on_poison``
        (the server's own ``max_deliver`` is one more, so it never silently strands a message).
        ``max_ack_pending`` bounds the messages in flight across all bound subscribers.
        """
        deliveries = self.max_deliveries if max_deliveries is None else max_deliveries
        if deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {deliveries}")
        spec = self.layout.spec(stream)
        stream_name = self.layout.stream(spec.name)
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=self.layout.subject(subject or spec.subject),
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=deliveries + 1,
            max_ack_pending=max_ack_pending,
        )
        # CONSUMER.CREATE with a name creates the consumer or updates its mutable fields.
        await self.js.add_consumer(stream_name, config=config)
        sub = await self.js.pull_subscribe_bind(durable=durable, stream=stream_name)
        return Consumer(sub, js=self.js, stream=stream_name, durable=durable, blobs=self._blobs,
                        max_deliveries=deliveries, on_poison=on_poison)

    # -- held-out evaluation --------------------------------------------------------------
    async def publish_eval(self, version: int, record: bytes) -> api.PubAck:
        """Publish one eval record (JSON) of ``version`` on EVAL (deduped per version within the
        duplicate window: a retried publish is stored once)."""
        return await self.publish(SUBJECT_EVAL, record, msg_id=f"eval-v{version}",
                                  headers={WEIGHTS_VERSION_HEADER: str(version)})

    async def eval_records(self) -> AsyncGenerator[bytes, None]:
        """Every eval record on EVAL, oldest first, then each new one as it is published (an
        ordered ephemeral consumer: a restarted reader replays the whole history)."""
        sub = await self.js.subscribe(self.layout.subject(SUBJECT_EVAL), stream=self.layout.stream(STREAM_EVAL),
                                      ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL)
        try:
            async for msg in sub.messages:
                yield bytes(msg.data)
        finally:
            await sub.unsubscribe()

    async def request(self, subject: str, data: bytes, timeout_s: float) -> bytes:
        """Core NATS request/reply on an (unprefixed) subject: the first reply's payload. Raises
        nats.errors.NoRespondersError (no subscriber) or nats.errors.TimeoutError."""
        msg = await self.nc.request(self.layout.subject(subject), data, timeout=timeout_s)
        return bytes(msg.data)

    async def serve(self, subject: str, queue: str, handler: Callable[[bytes], Awaitable[bytes]]) -> Subscription:
        """Answers requests on an (unprefixed) subject with `handler(payload)`, one member of queue
        group `queue` per request; returns the subscription (unsubscribe to stop)."""
        async def reply(msg: Msg) -> None:
            await msg.respond(await handler(bytes(msg.data)))

        return await self.nc.subscribe(self.layout.subject(subject), queue=queue, cb=reply)

    # -- introspection --------------------------------------------------------------------
    async def stream_info(self, stream: str) -> api.StreamInfo:
        """Server-side info of an (unprefixed) stream: ``.state.messages``, ``.config``..."""
        return await self.js.stream_info(self.layout.stream(stream))

    async def pending(self, stream: str, durable: str) -> ConsumerPending:
        """Backlog of a durable consumer on an (unprefixed) stream."""
        return _pending(await self.js.consumer_info(self.layout.stream(stream), durable))

    # -- lifecycle ------------------------------------------------------------------------
    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _log_error(err: Exception) -> None:
    _log.error("%s", err)  # e.g. "nats: permissions violation for publish to ..."


async def connect(
    url: str,
    *,
    name: str,
    user: str | None = None,
    password: str | None = None,
    tls: ssl.SSLContext | None = None,
    namespace: str = "",
    connect_timeout_s: float = 5.0,
    max_reconnect_attempts: int = -1,
    inbox_prefix: str = "_INBOX",
    max_deliveries: int = DEFAULT_MAX_DELIVERIES,
) -> Bus:
    """Connect to NATS as client ``name`` and return a :class:`Bus` for ``namespace``.

    Reconnects forever by default (``max_reconnect_attempts=-1``): a service rides out a NATS
    restart; JetStream state survives it on disk. ``user``/``password``/``tls``/``inbox_prefix``
    come from :func:`trajmesh.security.connect_bus` (a user may subscribe only to its own inboxes).
    Errors the server reports asynchronously (a permissions violation) are logged.
    ``max_deliveries`` is the default poison threshold of this Bus's consumers.
    """
    layout = Layout(namespace)
    nc = await nats.connect(
        servers=[url],
        name=name,
        user=user,
        password=password,
        tls=tls,
        inbox_prefix=inbox_prefix,
        error_cb=_log_error,
        connect_timeout=connect_timeout_s,
        max_reconnect_attempts=max_reconnect_attempts,
        reconnect_time_wait=0.5,
    )
    return Bus(nc, layout=layout, max_deliveries=max_deliveries)
