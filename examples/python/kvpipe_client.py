#!/usr/bin/env python3
"""A Python client of kvpipe serve's gRPC service (proto/kvpipe/v1/index.proto),
on the standard grpcio package (Debian: python3-grpcio python3-grpc-tools).

The stubs are generated from the .proto at first use, with grpc_tools, into a
temporary directory: nothing generated is kept in the repository.

    kvpipe_client.py --server 127.0.0.1:8080 match --tokens 1,2,3,...
    kvpipe_client.py --server 127.0.0.1:8080 match --tokens-file prompt.txt --lora sql
    KVPIPE_TOKEN=... kvpipe_client.py match --tokens-file prompt.txt --routed-to e0
    kvpipe_client.py batch --tokens-file a.txt --tokens-file b.txt
    KVPIPE_TOKEN=... kvpipe_client.py register --name e0 --endpoint tcp://10.0.0.5:5557 --replay tcp://10.0.0.5:5558
    KVPIPE_TOKEN=... kvpipe_client.py unregister --name e0
    kvpipe_client.py list
    KVPIPE_TOKEN=... kvpipe_client.py dump --worker e0
    kvpipe_client.py watch

Each command prints its answer as JSON (one line per message for streams).
A router imports this module and calls Client(...).match(tokens) instead.
"""
import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


def load_stubs(proto_root=PROTO_ROOT):
    """Generates the Python stubs of kvpipe/v1/index.proto and imports them."""
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="kvpipe_stubs_")
    atexit.register(shutil.rmtree, out, True)  # imported by then: nothing reads it again
    args = ["protoc", "-I" + proto_root, "--python_out=" + out, "--grpc_python_out=" + out,
            os.path.join(proto_root, "kvpipe", "v1", "index.proto")]
    if protoc.main(args) != 0:
        raise RuntimeError("grpc_tools.protoc failed on " + proto_root)
    sys.path.insert(0, out)
    from kvpipe.v1 import index_pb2, index_pb2_grpc
    return index_pb2, index_pb2_grpc


class Client:
    """One channel to kvpipe serve; token is the bearer token of register,
    unregister, dump and routed matches, which also shows the workers'
    endpoints in list and watch (KVPIPE_TOKEN by default)."""

    def __init__(self, server, token=None, credentials=None, timeout=10.0):
        self.pb, grpc_mod = load_stubs()
        if credentials is not None:
            self.channel = grpc.secure_channel(server, credentials)
        else:
            self.channel = grpc.insecure_channel(server)
        self.stub = grpc_mod.IndexServiceStub(self.channel)
        token = token if token is not None else os.environ.get("KVPIPE_TOKEN", "")
        self.auth = [("authorization", "Bearer " + token)] if token else []
        self.timeout = timeout

    def request(self, tokens=(), keys=(), lora_name="", lora_id=None, salt="", multimodal=(), routed_to=""):
        """Builds a MatchRequest for match_batch and match_stream."""
        req = self.pb.MatchRequest(tokens=tokens, keys=keys, lora_name=lora_name, salt=salt, routed_to=routed_to)
        if lora_id is not None:
            req.lora_id, req.has_lora_id = lora_id, True
        for h, offset, length in multimodal:
            req.multimodal.add(hash=h, offset=offset, length=length)
        return req

    def match(self, tokens=(), routed_to="", **kw):
        """Returns the MatchResponse: per worker, leading blocks (per tier),
        blocks predicted, score, partial. routed_to names the worker this
        request goes to: its blocks count as predicted there (needs the token)."""
        req = self.request(tokens=tokens, routed_to=routed_to, **kw)
        return self.stub.Match(req, metadata=self.auth, timeout=self.timeout)

    def match_batch(self, requests):
        """Answers many requests (from request()) in one call, in order; a
        refused one has its .error set in its place."""
        batch = self.pb.MatchBatchRequest(requests=list(requests))
        return self.stub.MatchBatch(batch, metadata=self.auth, timeout=self.timeout).responses

    def match_stream(self, requests):
        """Answers requests (an iterator of request()) over one stream, in
        order, as they come: a router keeps one open for its lifetime."""
        return self.stub.MatchStream(requests, metadata=self.auth)

    def register(self, name, endpoint, replay="", snapshot="", topic="", block_size=0):
        spec = self.pb.WorkerSpec(name=name, endpoint=endpoint, replay_endpoint=replay,
                                  snapshot_endpoint=snapshot, topic=topic, block_size=block_size)
        return self.stub.RegisterWorker(self.pb.RegisterWorkerRequest(worker=spec), metadata=self.auth, timeout=self.timeout)

    def unregister(self, name):
        return self.stub.UnregisterWorker(self.pb.UnregisterWorkerRequest(name=name), metadata=self.auth, timeout=self.timeout)

    def list(self):
        return self.stub.ListWorkers(self.pb.ListWorkersRequest(), metadata=self.auth, timeout=self.timeout)

    def dump(self, worker):
        return self.stub.Dump(self.pb.DumpRequest(worker=worker), metadata=self.auth, timeout=self.timeout)

    def watch(self):
        return self.stub.WatchWorkers(self.pb.WatchWorkersRequest(), metadata=self.auth)


def as_json(msg):
    from google.protobuf import json_format
    return json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True), sort_keys=True)


def read_tokens(args):
    if args.tokens_file:
        with open(args.tokens_file) as f:
            text = f.read()
    else:
        text = args.tokens or ""
    return [int(t) for t in text.replace(",", " ").split()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="127.0.0.1:8080", help="kvpipe serve's host:port")
    ap.add_argument("--ca", help="PEM of the CA that signed the server's TLS certificate (TLS when set)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("match")
    m.add_argument("--tokens", help="comma- or space-separated token ids")
    m.add_argument("--tokens-file", help="file of token ids")
    m.add_argument("--lora", default="")
    m.add_argument("--salt", default="")
    m.add_argument("--routed-to", default="", help="the worker this request is sent to (needs KVPIPE_TOKEN)")
    b = sub.add_parser("batch")
    b.add_argument("--tokens-file", action="append", required=True, help="a file of token ids per request")
    r = sub.add_parser("register")
    r.add_argument("--name", required=True)
    r.add_argument("--endpoint", required=True)
    r.add_argument("--replay", default="")
    r.add_argument("--topic", default="")
    u = sub.add_parser("unregister")
    u.add_argument("--name", required=True)
    sub.add_parser("list")
    d = sub.add_parser("dump")
    d.add_argument("--worker", required=True)
    sub.add_parser("watch")
    args = ap.parse_args(argv)

    creds = None
    if args.ca:
        with open(args.ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    c = Client(args.server, credentials=creds)
    try:
        if args.cmd == "match":
            print(as_json(c.match(tokens=read_tokens(args), lora_name=args.lora, salt=args.salt, routed_to=args.routed_to)))
        elif args.cmd == "batch":
            reqs = [c.request(tokens=read_tokens(argparse.Namespace(tokens_file=f, tokens=None))) for f in args.tokens_file]
            for resp in c.match_batch(reqs):
                print(as_json(resp))
        elif args.cmd == "register":
            print(as_json(c.register(args.name, args.endpoint, replay=args.replay, topic=args.topic)))
        elif args.cmd == "unregister":
            print(as_json(c.unregister(args.name)))
        elif args.cmd == "list":
            print(as_json(c.list()))
        elif args.cmd in ("dump", "watch"):
            for msg in (c.dump(args.worker) if args.cmd == "dump" else c.watch()):
                print(as_json(msg), flush=True)
    except grpc.RpcError as e:
        print(json.dumps({"code": e.code().name, "message": e.details()}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
