#!/usr/bin/env python3
"""A router-side subscriber on the C libzmq (pyzmq), for the reverse interop
test: it subscribes to a Go Publisher, prints one JSON line per message
(frame count, seq, decoded batch), and after --count messages that carry events
asks the Go ROUTER to replay from --replay-from and prints each reply.
"""
import argparse
import json
import struct

import msgpack
import zmq


def describe(payload):
    b = msgpack.unpackb(payload, raw=False)
    return {"events": [e["type"] if isinstance(e, dict) else e[0] for e in b[1]],
            "hashes": [h for e in b[1] if isinstance(e, dict) for h in e.get("block_hashes", [])]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--replay-from", type=int, required=True)
    args = ap.parse_args()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    sub.connect(args.endpoint)
    seen = 0
    while seen < args.count:
        frames = sub.recv_multipart()
        line = {"kind": "live", "frames": len(frames), "topic": frames[0].decode()}
        if len(frames) == 3 and len(frames[1]) == 8:
            line["seq"] = struct.unpack(">Q", frames[1])[0]
            line.update(describe(frames[2]))
            if line["events"]:
                seen += 1
        print(json.dumps(line), flush=True)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(args.replay)
    dealer.send_multipart([b"", struct.pack(">Q", args.replay_from)])
    while dealer.poll(5000):
        frames = dealer.recv_multipart()
        seq = struct.unpack(">q", frames[-2])[0]
        line = {"kind": "replay", "frames": len(frames), "seq": seq}
        if seq != -1:
            line.update(describe(frames[-1]))
        print(json.dumps(line), flush=True)
        if seq == -1:
            break
    sub.close()
    dealer.close()
    ctx.term()


if __name__ == "__main__":
    main()
