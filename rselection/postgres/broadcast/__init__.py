"""``PostgresBroadcaster``: the in-process :class:`~rselection.Broadcaster`, across nodes.

A package of one concept in parts, each an object that owns its state:
:class:`~rselection.postgres.broadcast.broadcaster.PostgresBroadcaster` (the public
API), its :class:`~rselection.postgres.broadcast.writer.Writer` and
:class:`~rselection.postgres.broadcast.listener.Listener` (the writer with a thread of its
own that borrows the process's pooled sessions; the listeners of a process share one
:class:`~rselection.postgres.broadcast.listening.ListeningSession` per connection string,
held only while the process reads), the
:class:`~rselection.postgres.broadcast.sessions.Sessions` they use, the writer's
:class:`~rselection.postgres.broadcast.statements.PublishStatements`, the listener's
:class:`~rselection.postgres.broadcast.fetches.Fetches` and its reading of a NOTIFY
(:mod:`~rselection.postgres.broadcast.wakeups`), the
:class:`~rselection.postgres.broadcast.outbox.Outbox` statements, the
:class:`~rselection.postgres.broadcast.location.Locator` that finds the table, and the checked
:class:`~rselection.postgres.broadcast.settings.Settings`.

Every node of a fleet creates one on the same database and table::

    bc = PostgresBroadcaster("postgresql://...")
    sub = bc.subscribe("orders")
    bc.publish("orders", {"id": 42})  # reaches "orders" subscribers on every node

How it works
------------

**Outbox.** :meth:`PostgresBroadcaster.publish` encodes the message as JSON at once
(what JSON cannot encode raises :class:`MessageEncodeError` in the caller) and hands it
to this broadcaster's writer thread, which appends it to an outbox table (see
:mod:`rselection.postgres.broadcast.outbox`) with an increasing ``id`` and sends one ``NOTIFY``
in the same transaction. ``publish`` never waits for Postgres (it is safe in ``async
def`` code); :meth:`PostgresBroadcaster.flush` waits until what was published is
committed. The writer puts every message waiting at that moment in one transaction, so
a burst costs one round trip per batch, not per message. Its statements are prepared
once per session and run through libpq with text parameters (a lone message uses a
simpler statement than a batch), so a publish costs little more than a bare NOTIFY.

**No session of its own to publish.** Each round of the writer (a batch, a purge)
borrows one of the process's pooled sessions for its connection string
(:class:`~rselection.postgres.session_pool.SessionPool`, at most 2, shared with claims,
checkpoints, electors and membership; ``application_name`` ``rselection:pool``) and
gives it back at once; with a pool as ``conninfo`` it borrows the pool's connections
instead. ``synchronous_commit`` is set inside each publish's own transaction, never on
the session, which other users share. At construction the writer checks the tables
(``create_tables``) on a pooled session; :meth:`PostgresBroadcaster.wait_ready` waits
for that.

**One order for everyone.** A publish locks the row of the outbox's state table before
its ids are drawn and holds the lock through its commit, so ids become visible strictly
in increasing order (only a role that may update that table can take the lock; an
advisory lock's key would be anyone's to take). Each node's listener thread keeps the
last id it delivered and fetches ``id > last`` in order: no message is skipped, none is
delivered twice, and every node delivers the messages in the same order (the order of
the ids); messages of one publisher keep the order in which it published them. The
publisher's own subscribers get its messages the same way, exactly once.

**NOTIFY is only a wake-up.** One NOTIFY channel per table (its name is a hash of the
schema-qualified table name, so logical channel names may be of any length and
characters). A NOTIFY carries the last id of the publish's transaction and nothing
else: any role that can connect may LISTEN on that channel, so no message's channel or
body travels in it, and any role may NOTIFY on it, so a listener takes it as a wake-up
only (:mod:`~rselection.postgres.broadcast.wakeups`). It delivers only rows it read from
the outbox table, and its position, its gaps and its resets follow only what it read
from the outbox and its state table, which only roles with privileges on them can
write. The id in a NOTIFY only spares a fetch that could find nothing new; a payload
that is not an id is ignored, counted (``stats().ignored_notifies``) and reported in a
warning at most once a minute. Each wake-up costs one round trip, a statement prepared
once per listening connection (:mod:`~rselection.postgres.broadcast.fetches`); a page of
rows is bounded by the bytes of its payloads, so a message of any size (up to
``max_message_bytes``) is delivered whole and a backlog of small ones comes in a few
pages.

**A session to LISTEN only for readers.** A node that only publishes holds no listening
session and is not woken by any message. The first
:meth:`~PostgresBroadcaster.subscribe` or :meth:`~PostgresBroadcaster.connect` of the
process connects the listening session, LISTENs and reads the newest id, and returns
once it has: every message committed after that is delivered. When the last reader of a
table in the process has gone, the session UNLISTENs that table; when the last reader of
the process has gone (a subscription closed, a receiver disconnected, a broadcaster
closed), it closes its Postgres session at once, and the next reader connects again
(from the newest id: messages published while nobody read are not delivered).

**Nothing lost while disconnected.** NOTIFY is dropped for a listener that is not
connected. After every (re)connect the listener LISTENs first and then fetches every
row after its last id, so it catches up in order. Rows are kept for ``retention``
seconds (server time); the writers delete older ones now and then and record the
highest id they deleted. A listener that finds rows it never read among the deleted
ones reports a *gap*: a warning log, ``stats().gaps``, and the ``on_gap`` hook. Nothing
is dropped silently.

**Ids that go back.** Should the outbox's ids ever go back (the table dropped and created
again, its sequence reset, a restore from a backup), "fetch ``id > last``" would skip
the new messages. Every fetch therefore also reads, in its snapshot, the newest id and
the table's oid: when the table is another one than where the position was taken, or
every id up to the last one delivered is gone without the purge watermark covering it,
the listener resynchronises on the new ids, delivers every message the table holds, and
reports a :class:`Gap` with ``reset=True`` (``stats().resets``).

**Where the table is.** The writer and the listener find the table the same way, through
the search path the broadcaster read once on a session of its own, and follow it
together when its name finds another table (or the table moved): see
:mod:`rselection.postgres.broadcast.location`. A NOTIFY whose id is not above the
previous ones' (commits are ordered by id, so that happens only when the ids went back,
or when someone else sent it) makes it fetch at once, as does one above the last id
delivered.

**One listening session per process.** Every broadcaster of a process on one connection
string shares one listening session and thread (the thread starts with the first
reader and ends with the last broadcaster; the session is held while there are
readers): it LISTENs on the channel of each table one of them reads, and hands every
NOTIFY to the listeners of that table, each with its own position, counters and readers.
The session polls after the shortest ``probe_interval`` of its broadcasters and bounds
its round trips by the longest ``timeout``; receivers of all of them run in its thread.

**Dead connections.** The listening session has its own connection (never a lease's), with TCP
keepalives and ``tcp_user_timeout``. When it has heard nothing for ``probe_interval``
seconds it polls the outbox, and a round trip that overruns ``timeout`` aborts the
connection, so a half-open connection (a silent partition) is found within
``probe_interval + timeout``. It reconnects with capped exponential backoff and jitter.

**Exactly once on writer failures.** A publish whose session breaks before the commit
was confirmed may or may not have committed. The writer then borrows another session,
ends the old backend (``pg_terminate_backend``, waiting until it is gone so it cannot
commit later), and looks for the batch itself (its origin and the ``origin_seq`` of its
last message, never an id: ids go back when the table is created again) before writing
it again, so a batch is never written twice nor counted twice.
"""

from __future__ import annotations

from .broadcaster import MessageEncodeError, PostgresBroadcaster, PostgresBroadcastStats
from .listener import Gap, GapHook

__all__ = [
    "Gap",
    "GapHook",
    "MessageEncodeError",
    "PostgresBroadcastStats",
    "PostgresBroadcaster",
]
