"""The Redis backend: one index shared by coordinator replicas, on Redis or a Redis Cluster.

Keyspace and slot placement
---------------------------
Nodes are spread over ``B`` *buckets* by ``crc32(node_id) % B``; every key of a bucket carries the hash
tag ``{<prefix>:<b>}``, so a bucket lives on one Cluster slot and therefore one shard, and every Lua
script touches one bucket only. A bucket holds whole nodes (all their models and DP ranks). In a bucket:

========================  =====  ====================================================================
``T:loc``                 hash   location name ``<len(model)>:<model><rank>:<node>`` -> live location id
``T:name``                hash   live location id -> location name (a reader sees only these ids)
``T:pend``                hash   location id being filled by ``replace_node``, not yet visible
``T:next``                str    location id counter (an id is never reused: ids are generations)
``T:ver``                 str    version token of ``T:name``, new on every change (lookups cache names)
``T:node:<node>``         set    the node's location ids (live and pending): ``remove_node`` reads only it
``T:inv:<model>``         hash   block hash (8 bytes, big-endian) -> holders: 5-byte records ``(location
                                 id u32, tier mask u8)`` sorted by id: the inverted index lookups walk
``T:fwd:<id>``            hash   block hash -> tier mask: one location's blocks (clear, export, reclaim)
``T:cnt``                 hash   ``<id>:<tier>`` -> entries, so ``stats`` never counts entries one by one
``T:dead`` / ``T:cur``    list   retired location ids waiting for reclaim, and their HSCAN cursors
``T:fence:<node>``        str    the node's fencing token: the highest a replica claimed it with
``T:epoch``               str    the bucket's lifetime marker: random, set when missing (``generation``)
========================  =====  ====================================================================

A lookup reads, per bucket, one ``MULTI`` holding a tiny script (``T:name`` only if ``T:ver`` differs from the
client's cached token) and a raw ``HMGET`` of the whole query's hashes in ``T:inv:<model>``, and walks the
holder strings client-side (``walk``): it keeps the set of locations still in the run and stops at the first
block no live candidate holds. Consecutive blocks held by the same locations have byte-identical holder
strings (records are kept sorted by id, whatever order the stores came in), so the holder list is decoded only
where it changes. A standalone Redis or Sentinel's primary (TCP, TLS or a unix socket) gets every bucket's
MULTI in one write on the pipelined connection, one round trip; on a Cluster (TCP or TLS) each bucket's
MULTI goes to its shard's pipelined connection (``shards``), all at once. Walking in Redis's Lua would pay
~0.6-1 us per block to turn query bytes and reply elements into Lua strings; a raw HMGET costs ~0.2 us per
field and hiredis parses the reply in C. The price is reading the query's tail past the stop (a few hundred
bytes at most per block). The ``T:ver`` token is a counter plus the server time, so a Redis restarted
empty never repeats one.

Ingest: ``apply`` validates and packs a batch in Python (consecutive same-tier events merge into one
op), then queues it on its bucket. One write call per bucket is in flight at a time and takes every
batch queued meanwhile (up to ``_WRITE_COALESCE_BLOCKS``): one EVALSHA applies many nodes' batches in
queue order, so per-node order holds, and a script is atomic, so each batch is applied whole. Each op
costs one HMGET (of the inverted hash: the location's own record there is its tier mask) and two
HSETs (or HDELs) whatever its size.

To a standalone Redis or Sentinel's primary (TCP, TLS or a unix socket), scripts go over one pipelined
connection of our own (hiredis packs commands and parses replies) rather than through redis-py's pool:
a PING round trip costs ~20 us that way and ~100 us through redis-py on the test VM. On a Cluster,
lookups use one such connection per primary, found by slot through redis-py's view of the cluster
(refreshed on a redirect or a lost connection); everything else goes through redis-py.

Following the primary (Sentinel, a DNS name that moves): every connect resolves the primary again (the
sentinels' answer, or DNS) and the fast path checks ``ROLE``; a ``READONLY`` reply drops every connection
and fails the call as unavailable, so a demoted node is never written to (``client``'s docstring).

With plain Redis there is one bucket by default
(``?buckets=1``): one round trip per lookup. On a Cluster the default is 16 buckets, and a lookup sends
one MULTI per bucket, all at once, each to its bucket's shard: the shards answer in parallel, each
reading only its own nodes. A single hash tag per
model would put a whole model on one shard and defeat scale-out; a tag per node would need one script
per node per lookup. Buckets are the middle ground; ``B`` should be at least a few times the shard
count, and is fixed for a keyspace (stored in ``{<prefix>}:conf``; a mismatching client is refused).

Clear and node removal retire location ids: they drop the id from ``T:loc``/``T:name`` (readers stop
seeing it at once, O(locations of the node), never a keyspace scan) and queue it on ``T:dead``. A
background task reclaims a dead id's entries in chunks by HSCAN over its own ``T:fwd:<id>`` only. A
re-added node gets fresh ids, so old entries never resurrect. ``replace_node`` fills a pending id that
readers cannot see, then swaps it in with one script.

Lookup mirror (``?mirror=1``): while a bucket's ``T:feedon`` exists, every write script
also appends the holder strings it set (and whether ``T:name`` changed) to the bucket's stream ``T:feed``,
in the same atomic call, numbered by ``T:feedseq``. A mirroring client copies ``T:name`` and the inverted
hashes once, then replays the feed, and walks its copy for lookups (in C when built): no round trip, no
per-block Redis work. The copy is eventually consistent with Redis (a feed entry arrives within a
millisecond or so), and a client's own writes are visible to its next lookup (``apply`` waits for its
entry). See :class:`~kvcoord.index.redis.mirror.LookupMirror` for loading, gaps and
outages.

Fencing (replicas on one Redis): a replica that takes a node over claims it (``claim``); its next write
for the node first gets a new token from ``T:fence:<node>``, higher than any before (at least Redis's
clock in microseconds, so a Redis restarted empty still issues higher ones). Every write script
(write, begin, commit, clear, remove_node) carries the writer's token and checks it in the same atomic
call: an older token is refused (-1; ``FencedWrite``, counted by the coordinator's
``InstrumentedIndex``), so a replica that was paused or cut off while another took its node over
cannot write over the new owner. A write of a client that never claimed the node carries ``0`` and
is not fenced (library use, an admin removal).
``reclaim_node`` removes a dead owner's node only while the token is still that owner's, and then
issues a new one, fencing the dead owner out for good.

Lost data (FLUSHALL, a restart without persistence) is noticed in the call that meets it, not by a
poll: a client accepts each bucket's ``T:epoch`` when it reads the generation (``remote.generation``,
which sets a fresh marker where it is missing, so the first client to notice sets the new lifetime and
the others adopt it). The lookup's ``NAMES`` (inside its ``MULTI``) and every
write script (write, begin, commit, clear, remove_node, claim, remove_pending: checked in the prelude,
before fencing) carry the accepted marker and answer -2, having read or written nothing, when the
bucket's differs or is gone; the client raises :class:`~kvcoord.index.base.IndexReset`. Nothing is
answered from, or written into, a keyspace that lost its data until the client has re-read the
generation, which makes the coordinator resync its nodes first. The mirror answers only while every
bucket's marker was confirmed recently (:meth:`LookupMirror.current`).

Entries are only ever lost if Redis loses them: run Redis with ``maxmemory-policy noeviction`` (an
evicted ``T:inv`` field would silently hide a block that a node still holds; with ``noeviction`` a
full Redis rejects writes, the coordinator sees the error, keeps the agents' batches unacked and
reports NOT_SERVING). Location ids are 32-bit in holder records.

Modules
-------
``keys`` key names and buckets; ``scripts`` the Lua (one ``.lua`` file per script, package data); ``client``
the connection (:class:`RedisConnection`: round trips, EVALSHA, the pipelined fast path, metrics); ``walk``
the client-side holder-string walk; ``writes`` batch packing and the per-bucket coalescing write queue;
``epochs`` the buckets' accepted lifetime markers (carried by every call); ``shards`` a Cluster's per-primary
lookup connections; ``mirror`` the lookup mirror; ``records`` the node directory, engine registrations and
reservation changes replicas share (the index's ``node_directory``, ``engine_store`` and
``reservation_feed``); ``index`` :class:`RedisIndex`. The index
and the mirror share only the connection, the bucket tags and the accepted markers.
"""
