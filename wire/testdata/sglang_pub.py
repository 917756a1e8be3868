#!/usr/bin/env python3
"""An SGLang-style KV event publisher on the C libzmq (pyzmq), shaped as the
snapshot-capable ZmqEventPublisher of SGLang (docs/FORMAT.md §6):

  - PUB sends [topic + b"\\x00sgl-kv-epoch=" + epoch, seq (8 bytes BE), batch],
    the batch SGLang's array-like [ts, events, attn_dp_rank] with array-form
    events (tag first): ["BlockStored", hashes, parent, token_ids, block_size,
    lora_id, medium], ["BlockRemoved", hashes, medium], ["AllBlocksCleared"].
    The epoch is a uuid4 hex, new at every (re)start. Without --snapshot the
    topic is the plain one, as SGLang keeps it when snapshots are disabled.
  - the replay ROUTER answers [empty, start] with [empty, seq, payload] for
    every buffered batch (barriers included) from start on, then an end marker
    (seq -1, empty payload);
  - the snapshot ROUTER (--snapshot) answers [empty, b"snapshot-v1"] with
    [empty, b"header", header], [empty, b"chunk", records] (at most --chunk
    records each), [empty, b"end", b""]. Before answering it publishes the
    barrier, an empty batch with its own seq on topic + epoch marker + epoch +
    b"\\x00sgl-kv-snapshot=" + barrier_id, also put in the replay buffer; the
    snapshot is the cache as of that barrier, header [1, epoch, rank,
    barrier_seq + 1, barrier_seq, barrier_id, record_count], records
    [parent, [hash]] in the order the blocks were first stored. Anything but
    [empty, b"snapshot-v1"] gets [empty, b"error", b"invalid snapshot-v1
    request"]. Sends time out after 500 ms, as in SGLang.

The engine's cache is a dict hash -> parent, kept up to date by every batch it
publishes (also those it drops), as SGLang's placement mirror is.

Driven over stdin/stdout by Go tests, one phase at a time:
  - it publishes probe batches (no events) until it reads "go": PUB drops what
    is sent before the subscription arrives, so the test says when it listens;
  - "batches N [BASE [DROP]]" publishes N batches, batch i storing block
    BASE+i (BASE defaults to 1000) under BASE+i-1 (a root for i = 0), tokens
    ((BASE-1000+i)*block_size + t) % 50000, medium "GPU"; indexes in the comma
    list DROP are kept for replay (and in the cache) but not sent; it answers
    "published SEQ" (SEQ: the next seq);
  - "prompt BASE N [BAD]" serves a prompt of N tokens (BASE + j) % 50000 as
    SGLang with --speculative-algorithm EAGLE caches it (--eagle): its radix
    keys are the prompt's N-1 bigrams, so it holds (N-1) // block_size pages,
    page i the bigrams (t[i*bs+k], t[i*bs+k+1]) for k < bs. It publishes one
    batch of one BlockStored per page, chained, token_ids those bigram pairs,
    hashes SGLang's (the first 8 bytes of a SHA-256 over the parent's hash
    and the page's tokens, as a signed int64). With BAD, page BAD's bigrams
    are published broken (not a chain), as an engine bug would: a reader can
    read the other pages. Without --eagle the pages are plain, N // bs of
    them. It answers "published SEQ PAGES";
  - "remove H1,H2,..." publishes one BlockRemoved of those hashes ("published SEQ");
  - "clear" publishes one AllBlocksCleared ("published SEQ");
  - "restart" closes the sockets and binds them again as soon as the ports are
    free, with a new epoch, seq back at 0, an empty replay buffer and an empty
    cache, and probes again until "go"; it answers "restarted EPOCH";
  - "restart-keep" is "restart" with the cache kept: a publisher that restarts
    while its engine's cache survives ("restarted EPOCH");
  - "snapshot-busy" makes the next snapshot request get [empty, b"error",
    b"snapshot provider busy"] (no barrier), and "snapshot-error TEXT..." the
    same with TEXT (e.g. "snapshot capture failed"); both answer "armed";
  - "stats" answers "stats seq=SEQ blocks=N epoch=EPOCH snapshots=K";
  - "quit" exits. Between commands it keeps answering replay and snapshot requests.
It says "ready EPOCH" once bound.
"""
import argparse
import hashlib
import struct
import time
import uuid

import msgpack
import zmq

from engine_pub import Commands, bind_soon  # the same directory: Python puts it on the path

END = struct.pack(">q", -1)
EPOCH_MARKER = b"\x00sgl-kv-epoch="
SNAPSHOT_MARKER = b"\x00sgl-kv-snapshot="
SNAPSHOT_REQUEST = b"snapshot-v1"
SNAPSHOT_SEND_TIMEOUT_MS = 500


def signed64(digest):
    return struct.unpack(">q", digest[:8])[0]


def eagle_pages(tokens, block_size, eagle, bad):
    """The BlockStored events of one prompt's pages, as SGLang publishes them."""
    n = (len(tokens) - 1) // block_size if eagle else len(tokens) // block_size
    events, parent = [], None
    for i in range(n):
        page = tokens[i * block_size : (i + 1) * block_size + (1 if eagle else 0)]
        h = hashlib.sha256((b"" if parent is None else struct.pack(">q", parent)) + struct.pack("<%dI" % len(page), *page))
        block = signed64(h.digest())
        ids = [[page[k], page[k + 1]] for k in range(block_size)] if eagle else list(page)
        if i == bad:
            ids[block_size // 2][0] += 1  # breaks the chain of pairs
        events.append(["BlockStored", [block], parent, ids, block_size, None, "GPU"])
        parent = block
    return events


def as_map(event):
    """An array-form event as current SGLang's map form."""
    keys = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
    return dict([("type", event[0])] + list(zip(keys, event[1:])))


def stored(i, block_size, base):
    return [
        "BlockStored",
        [base + i],
        None if i == 0 else base + i - 1,
        [((base - 1000 + i) * block_size + t) % 50000 for t in range(block_size)],
        block_size,
        None,  # lora_id
        "GPU",
    ]



class Engine:
    def __init__(self, args):
        self.args = args
        self.ctx = zmq.Context()
        self.cache = {}  # engine hash -> parent hash (None for a root), in first-stored order
        self.snapshots = 0
        self.next_error = None  # the error the next snapshot request gets
        self.bind(args.epoch or uuid.uuid4().hex)

    def bind(self, epoch):
        self.epoch = epoch
        topic = self.args.topic.encode()
        self.live_topic = topic + EPOCH_MARKER + epoch.encode() if self.args.snapshot else topic
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.args.hwm:
            self.pub.setsockopt(zmq.SNDHWM, self.args.hwm)
        bind_soon(self.pub, self.args.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        bind_soon(self.router, self.args.replay)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.snap = None
        if self.args.snapshot:
            self.snap = self.ctx.socket(zmq.ROUTER)
            self.snap.setsockopt(zmq.LINGER, 0)
            self.snap.setsockopt(zmq.SNDTIMEO, SNAPSHOT_SEND_TIMEOUT_MS)
            bind_soon(self.snap, self.args.snapshot)
            self.poller.register(self.snap, zmq.POLLIN)
        self.seq = 0
        self.buffer = []  # (seq, payload), the last --buffer batches

    def close(self):
        self.pub.close()
        self.router.close()
        if self.snap is not None:
            self.snap.close()

    def restart(self, keep_cache):
        self.close()
        if not keep_cache:
            self.cache = {}
        self.bind(uuid.uuid4().hex)

    def batch(self, events):
        return msgpack.packb([time.time(), events, self.args.rank], use_bin_type=True)

    def publish(self, events, send=True, topic=None):
        """Publishes one batch under the next seq (kept for replay even when
        not sent) and applies it to the cache; returns its seq."""
        seq = self.seq
        self.seq += 1
        payload = self.batch(events)
        seq_bytes = struct.pack(">Q", seq)
        self.buffer.append((seq_bytes, payload))
        del self.buffer[: -self.args.buffer]
        if send:
            self.pub.send_multipart([topic or self.live_topic, seq_bytes, payload])
        for e in events:
            if isinstance(e, dict):
                e = [e["type"]] + [e.get(k) for k in ("block_hashes", "parent_block_hash")]
            if e[0] == "BlockStored":
                parent = e[2]
                for h in e[1]:
                    self.cache[h] = parent
                    parent = h
            elif e[0] == "BlockRemoved":
                for h in e[1]:
                    self.cache.pop(h, None)
            elif e[0] == "AllBlocksCleared":
                self.cache.clear()
        return seq

    def serve(self, timeout_ms):
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is self.router:
                self.serve_replay()
            else:
                self.serve_snapshot()

    def serve_replay(self):
        frames = self.router.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # as SGLang: an invalid replay request gets no answer
        ident, _, start = frames
        (start,) = struct.unpack(">Q", start)
        for seq, payload in self.buffer:
            if struct.unpack(">Q", seq)[0] >= start:
                self.router.send_multipart([ident, b"", seq, payload])
        self.router.send_multipart([ident, b"", END, b""])

    def serve_snapshot(self):
        frames = self.snap.recv_multipart()
        ident = frames[0]
        try:
            if frames[1:] != [b"", SNAPSHOT_REQUEST]:
                self.snap.send_multipart([ident, b"", b"error", b"invalid snapshot-v1 request"])
                return
            if self.next_error is not None:
                error, self.next_error = self.next_error, None
                self.snap.send_multipart([ident, b"", b"error", error])
                return
            barrier_id = uuid.uuid4().hex
            barrier_topic = self.args.topic.encode() + EPOCH_MARKER + self.epoch.encode() + SNAPSHOT_MARKER + barrier_id.encode()
            barrier_seq = self.publish([], topic=barrier_topic)
            records = [[parent, [h]] for h, parent in self.cache.items()]
            header = [1, self.epoch, self.args.rank, barrier_seq + 1, barrier_seq, barrier_id, len(records)]
            self.snapshots += 1
            self.snap.send_multipart([ident, b"", b"header", msgpack.packb(header, use_bin_type=True)])
            for start in range(0, len(records), self.args.chunk):
                chunk = msgpack.packb(records[start : start + self.args.chunk], use_bin_type=True)
                self.snap.send_multipart([ident, b"", b"chunk", chunk])
            self.snap.send_multipart([ident, b"", b"end", b""])
        except zmq.Again:
            pass  # a reader that does not drain within 500 ms loses the response, as in SGLang



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True, help="PUB endpoint to bind")
    ap.add_argument("--replay", required=True, help="replay ROUTER endpoint to bind")
    ap.add_argument("--snapshot", help="snapshot ROUTER endpoint to bind (without it: no epoch in the topic)")
    ap.add_argument("--topic", default="")
    ap.add_argument("--buffer", type=int, default=10000, help="batches kept for replay")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4096, help="records per snapshot chunk at most")
    ap.add_argument("--rank", type=int, default=0, help="attn_dp_rank of the batches and replica_rank of the header")
    ap.add_argument("--epoch", help="the first epoch (a uuid4 hex when not given); restarts always draw a new one")
    ap.add_argument("--hwm", type=int, default=0, help="PUB send high-water mark (libzmq's default when 0)")
    ap.add_argument("--eagle", action="store_true", help="EAGLE speculative decoding: prompts cached as bigram pages")
    ap.add_argument("--map-events", action="store_true", help="map-form events for prompts (current SGLang); array form otherwise")
    args = ap.parse_args()
    engine = Engine(args)
    print("ready", engine.epoch, flush=True)
    probing = True
    commands = Commands()
    while True:
        if probing:
            engine.publish([])
            engine.serve(0)
            cmd = commands.next(0.02)
        else:
            engine.serve(20)
            cmd = commands.next(0)
        if cmd is None:
            continue
        if cmd == ["go"]:
            probing = False
        elif cmd[0] == "batches":
            n = int(cmd[1])
            base = int(cmd[2]) if len(cmd) > 2 else 1000
            drop = {int(x) for x in cmd[3].split(",") if x} if len(cmd) > 3 else set()
            for i in range(n):
                engine.publish([stored(i, args.block_size, base)], send=i not in drop)
                engine.serve(0)
            print("published", engine.seq, flush=True)
        elif cmd[0] == "prompt":
            tokens = [(int(cmd[1]) + j) % 50000 for j in range(int(cmd[2]))]
            bad = int(cmd[3]) if len(cmd) > 3 else -1
            events = eagle_pages(tokens, args.block_size, args.eagle, bad)
            engine.publish([as_map(e) for e in events] if args.map_events else events)
            print("published", engine.seq, len(events), flush=True)
        elif cmd[0] == "remove":
            hashes = [int(x) for x in cmd[1].split(",") if x] if len(cmd) > 1 else []
            engine.publish([["BlockRemoved", hashes, "GPU"]])
            print("published", engine.seq, flush=True)
        elif cmd == ["clear"]:
            engine.publish([["AllBlocksCleared"]])
            print("published", engine.seq, flush=True)
        elif cmd in (["restart"], ["restart-keep"]):
            engine.restart(keep_cache=cmd == ["restart-keep"])
            probing = True
            print("restarted", engine.epoch, flush=True)
        elif cmd == ["snapshot-busy"]:
            engine.next_error = b"snapshot provider busy"
            print("armed", flush=True)
        elif cmd[0] == "snapshot-error":
            engine.next_error = " ".join(cmd[1:]).encode() or b"snapshot capture failed"
            print("armed", flush=True)
        elif cmd == ["stats"]:
            print(f"stats seq={engine.seq} blocks={len(engine.cache)} epoch={engine.epoch} snapshots={engine.snapshots}", flush=True)
        elif cmd == ["quit"]:
            engine.close()
            engine.ctx.term()
            return


if __name__ == "__main__":
    main()
