"""A shared remote tier of chunk KV on Redis or Valkey, below each process's RAM and local disk tiers.

Layout: one Redis hash per chunk, named ``<prefix>:<key>`` (the 64-hex chunk key already covers the model
fingerprint, storage dtype and layout version). Field ``meta`` holds the chunk's metadata as JSON: the
same fields and crcs as a disk file's header (``store/fileformat.py`` builds and checks both). Field
``<i>`` holds layer i's K bytes then V bytes in the storage dtype (``fileformat.layer_bytes``). A layer is
fetched alone (HGET) and checked against its crc before use, so fusion streams layers from the remote tier
as it does from disk; a bounded in-process LRU of layers sits in front. One hash per chunk means eviction,
expiry and deletion remove a chunk whole.

Pinned corpus vs request traffic: chunks written at ingest (``pinned=True``) have no TTL; chunks computed
for a request (``pinned=False``) get one (``adhoc_ttl``, default 7 days). Run the server with
``maxmemory-policy volatile-lru`` (or volatile-lfu / volatile-ttl): under memory pressure it evicts only
keys that have a TTL, so request traffic can never push the corpus out; once only pinned chunks are left,
writes fail with OOM (logged once; the chunk is still kept locally) instead of evicting any. An
``allkeys-*`` policy would evict pinned chunks, and the tier warns when it sees one.

Failures never reach an answer. A connection error or timeout makes the tier unavailable: one warning per
outage, then every call is a miss without network traffic until a back-off (doubling from 0.5 s to 30 s)
has passed, when one call tries again; the first success logs that the tier is back. A value that fails
its checks (wrong bytes, another model's fingerprint, another layout) is logged, counted, deleted and
served as a miss, so the chunk is recomputed and written again.

URL: ``redis://[user:password@]HOST:PORT/DB`` (``rediss://`` for TLS, ``unix://`` for a socket), with
optional query parameters ``prefix`` (key prefix, default ``cacheblend:kv``), ``adhoc_ttl`` (seconds),
``local_cache_mb`` (the in-process layer LRU) and redis-py's own (``socket_timeout``...).
"""

from .admin import RemoteVerifyReport
from .connection import RemoteCounters
from .source import RemoteChunkKV
from .tier import RedisKVTier, connect_remote

__all__ = ["RedisKVTier", "RemoteChunkKV", "RemoteCounters", "RemoteVerifyReport", "connect_remote"]
