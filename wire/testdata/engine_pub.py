#!/usr/bin/env python3
"""An engine-side KV event publisher on the C libzmq (pyzmq), shaped as vLLM's
ZmqEventPublisher: PUB sends [topic, seq (8 bytes BE), msgpack batch], and a
ROUTER answers [empty, start] with every buffered batch from start on, then an
end marker (seq -1, empty payload).

Driven over stdin/stdout by the Go interop test, one phase at a time:
  - it publishes probe batches (no events) until it reads "go": PUB drops what
    is sent before the subscription arrives, so the test says when it listens;
  - "batches N DROP" publishes N batches with one BlockStored each (block hash
    1000+i); indexes in the comma list DROP are kept for replay but not sent,
    as vLLM's PUB drops past its high-water mark;
  - "flood N" publishes N copies of one pre-packed step (8 BlockStored of 4
    blocks of 16 tokens) as fast as the PUB takes them, for the benchmark;
  - "chain N BASE" publishes N batches as fast as the PUB takes them, batch i
    storing block BASE+i under BASE+i-1 (tokens distinct per BASE), answering
    replays every 64 batches;
  - "restart" closes both sockets and binds them again with seq back at 0;
  - "restart-ahead N BASE" restarts at once (no pause) and publishes a chain
    from BASE of N batches more than the old incarnation had sent, so the
    new seqs are past the old last one before any subscriber is back;
  - "quit" exits. Between commands it keeps answering replay requests.
"""
import argparse
import os
import select
import struct
import sys
import time

import msgpack
import zmq

END = struct.pack(">q", -1)


def batch(events):
    return msgpack.packb([time.time(), events, 0], use_bin_type=True)


def stored(i, block_size, base=1000):
    return {
        "type": "BlockStored",
        "block_hashes": [base + i],
        "parent_block_hash": None if i == 0 else base + i - 1,
        "token_ids": [((base - 1000 + i) * block_size + t) % 50000 for t in range(block_size)],
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def bind_soon(sock, endpoint):
    """Binds as soon as the port is free: libzmq closes sockets in its I/O
    thread, so a restart within milliseconds may find the old one still bound."""
    for _ in range(2000):
        try:
            return sock.bind(endpoint)
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.001)
    sock.bind(endpoint)


class Engine:
    def __init__(self, args):
        self.args = args
        self.ctx = zmq.Context()
        self.bind()

    def bind(self):
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.args.hwm:
            self.pub.setsockopt(zmq.SNDHWM, self.args.hwm)
        bind_soon(self.pub, self.args.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        bind_soon(self.router, self.args.replay)
        self.seq = 0
        self.buffer = []  # (seq, payload), the last --buffer batches

    def close(self):
        self.pub.close()
        self.router.close()

    def publish(self, payload, send=True):
        seq = struct.pack(">Q", self.seq)
        self.seq += 1
        self.buffer.append((seq, payload))
        del self.buffer[: -self.args.buffer]
        if send:
            self.pub.send_multipart([self.args.topic.encode(), seq, payload])

    def serve_replay(self, timeout_ms):
        if not self.router.poll(timeout_ms):
            return
        ident, empty, start = self.router.recv_multipart()
        (start,) = struct.unpack(">Q", start)
        head = [self.args.topic.encode()] if self.args.reply_topic else []
        for seq, payload in self.buffer:
            if struct.unpack(">Q", seq)[0] >= start:
                self.router.send_multipart([ident, b""] + head + [seq, payload])
        self.router.send_multipart([ident, b""] + head + [END, b""])


class Commands:
    """Lines from stdin without blocking (select on the raw fd: Python's
    buffered readline would hide a second line already read)."""

    def __init__(self):
        self.buf = b""

    def next(self, timeout):
        if b"\n" not in self.buf and select.select([sys.stdin], [], [], timeout)[0]:
            chunk = os.read(sys.stdin.fileno(), 4096)
            self.buf += chunk if chunk else b"quit\n"  # stdin closed: the test is gone
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().split() or None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--buffer", type=int, default=10000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reply-topic", action="store_true")
    ap.add_argument("--hwm", type=int, default=0, help="PUB send high-water mark (libzmq's default when 0)")
    args = ap.parse_args()
    engine = Engine(args)
    print("ready", flush=True)
    probing = True
    commands = Commands()
    while True:
        if probing:
            engine.publish(batch([]))
            engine.serve_replay(0)
            cmd = commands.next(0.02)
        else:
            engine.serve_replay(20)
            cmd = commands.next(0)
        if cmd is None:
            continue
        if cmd == ["go"]:
            probing = False
        elif cmd[0] == "batches":
            drop = {int(x) for x in cmd[2].split(",") if x} if len(cmd) > 2 else set()
            for i in range(int(cmd[1])):
                engine.publish(batch([stored(i, args.block_size)]), send=i not in drop)
                engine.serve_replay(0)
            print("published", engine.seq, flush=True)
        elif cmd[0] == "flood":
            step = batch([dict(stored(i * 4, args.block_size), block_hashes=[1000 + i * 4 + j for j in range(4)],
                               token_ids=list(range(4 * args.block_size))) for i in range(8)])
            for i in range(int(cmd[1])):
                engine.publish(step)
                if i % 64 == 0:  # vLLM answers replays from its own thread
                    engine.serve_replay(0)
            print("published", engine.seq, flush=True)
        elif cmd[0] == "chain":
            n, base = int(cmd[1]), int(cmd[2])
            for i in range(n):
                engine.publish(batch([stored(i, args.block_size, base)]))
                if i % 64 == 0:
                    engine.serve_replay(0)
            print("published", engine.seq, flush=True)
        elif cmd[0] == "restart-ahead":
            n, base = engine.seq + int(cmd[1]), int(cmd[2])
            engine.close()
            engine.bind()
            for i in range(n):
                engine.publish(batch([stored(i, args.block_size, base)]))
            print("restarted", engine.seq, flush=True)
        elif cmd == ["restart"]:
            engine.close()
            time.sleep(0.3)
            engine.bind()
            probing = True
            print("restarted", flush=True)
        elif cmd == ["quit"]:
            engine.close()
            engine.ctx.term()
            return


if __name__ == "__main__":
    main()
