package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/kvpipe/kvpipe"
	"github.com/kvpipe/kvpipe/internal/opstream"
	"github.com/kvpipe/kvpipe/internal/relaypub"
	"github.com/kvpipe/kvpipe/internal/sim"
	"github.com/kvpipe/kvpipe/relay"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// replica is a router Pipeline fed by a relay's stream, and its Follower.
type replica struct {
	r *router
	f *relay.Follower
}

// natsRun is one --nats run: its server, its connections, the two relays
// on one lease and the routers following the stream.
type natsRun struct {
	o          options
	logger     *slog.Logger
	srv        *server.Server
	conns      []*nats.Conn
	engines    []*engine
	relays     [2]*relaypub.Relay
	stopRelays [2]func()
	replicas   []*replica
}

// runNATS replays the trace through a relay into an in-process JetStream
// server, with two router replicas following the stream; the first routes.
// A second relay stands by on the same lease and takes over at
// o.failoverAt of the trace, when the first stops.
// At the end both must hold the same index, and two routers that join late,
// one from the relay's snapshot and one from the stream alone, must catch up
// to it.
func runNATS(ctx context.Context, o options, reqs []sim.Request, source string, stdout, stderr io.Writer) error {
	n := &natsRun{o: o, logger: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	dir, err := os.MkdirTemp("", "kvpipe-nats")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	n.srv, err = server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	n.srv.Start()
	defer func() { n.srv.Shutdown(); n.srv.WaitForShutdown() }()
	if !n.srv.ReadyForConnections(10 * time.Second) {
		return errors.New("nats-server not ready within 10s")
	}
	defer n.close()
	if n.engines, err = startEngines(o, len(reqs)); err != nil {
		return err
	}
	js, err := n.startRelays(ctx)
	if err != nil {
		return err
	}
	for range 2 {
		if _, err := n.follow(relay.Settings{}); err != nil {
			return err
		}
	}
	if err := waitConnected(ctx, n.relays[0].Pipeline(), len(n.engines)); err != nil {
		return err
	}
	res, err := n.replay(ctx, reqs, stderr)
	if err != nil {
		return err
	}
	if res.info, err = n.drained(ctx, js); err != nil {
		return err
	}
	if err := n.compare(ctx, reqs, &res); err != nil {
		return err
	}
	n.report(stdout, source, &res)
	if !res.agree || !res.joins[0].agree || !res.joins[1].agree {
		return errors.New("the routers' indexes differ")
	}
	return nil
}

// natsResult is what a --nats run measured.
type natsResult struct {
	start    time.Time
	wall     time.Duration
	routed   int
	fo       failover
	rl       *relaypub.Relay // the relay leading at the end
	info     *jetstream.StreamInfo
	lags     []time.Duration
	agree    bool
	compared int
	joins    [2]join
}

// connect opens one connection, as each process of a deployment would.
func (n *natsRun) connect() (jetstream.JetStream, error) {
	nc, err := nats.Connect(n.srv.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		return nil, err
	}
	n.conns = append(n.conns, nc)
	return jetstream.New(nc)
}

// close stops the routers and relays still running, then the engines, and
// closes the connections.
func (n *natsRun) close() {
	for _, rp := range n.replicas {
		rp.r.stop()
	}
	for _, stop := range n.stopRelays {
		if stop != nil {
			stop()
		}
	}
	if n.engines != nil {
		stopEngines(n.engines)
	}
	for _, nc := range n.conns {
		nc.Close()
	}
}

// startRelays starts two relays for the engines on one lease: the first
// writes, the second waits as its standby and takes over when the first
// stops. It returns the first one's JetStream.
func (n *natsRun) startRelays(ctx context.Context) (jetstream.JetStream, error) {
	var js jetstream.JetStream
	for i := range n.relays {
		rjs, err := n.connect()
		if err != nil {
			return nil, err
		}
		if i == 0 {
			js = rjs
		}
		lease, err := relaypub.NewLease(rjs, relaypub.LeaseConfig{Key: "replay", Logger: n.logger})
		if err != nil {
			return nil, err
		}
		rl, err := relaypub.New(rjs, relaypub.Config{Pipeline: kvpipe.Config{BlockSize: n.o.blockSize, Shards: n.o.shards, Logger: n.logger},
			SnapshotEvery: 2 * time.Second, Lease: lease})
		if err != nil {
			return nil, err
		}
		for _, e := range n.engines {
			if err := rl.AddWorker(e.name, kvpipe.WorkerConfig{Endpoint: "tcp://" + e.pub.Addr(), ReplayEndpoint: "tcp://" + e.pub.ReplayAddr()}); err != nil {
				return nil, err
			}
		}
		relayCtx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- rl.Run(relayCtx) }()
		n.stopRelays[i] = func() { cancel(); <-done }
		n.relays[i] = rl
		if i == 0 { // the first leads
			if err := waitLeading(ctx, rl); err != nil {
				return nil, err
			}
		}
	}
	return js, nil
}

// follow starts a router fed by the stream, as settings name it.
func (n *natsRun) follow(settings relay.Settings) (*replica, error) {
	js, err := n.connect()
	if err != nil {
		return nil, err
	}
	f, err := relay.NewFollower(js, settings, n.logger)
	if err != nil {
		return nil, err
	}
	p, err := kvpipe.New(kvpipe.Config{BlockSize: n.o.blockSize, Shards: n.o.shards, Source: f, Logger: n.logger})
	if err != nil {
		return nil, err
	}
	r := &router{p: p, runDone: make(chan error, 1)}
	go func() { r.runDone <- p.Run(context.Background()) }()
	rp := &replica{r: r, f: f}
	n.replicas = append(n.replicas, rp)
	return rp, nil
}

// replay routes the trace through the first replica; at o.failoverAt the
// leading relay stops (its last snapshot written, its lease given up) and
// the standby takes over from that snapshot and the engines' replay
// buffers, while the engines go on.
func (n *natsRun) replay(ctx context.Context, reqs []sim.Request, stderr io.Writer) (natsResult, error) {
	res := natsResult{start: time.Now(), rl: n.relays[0]}
	at := len(reqs)
	if n.o.failoverAt > 0 {
		at = int(float64(len(reqs)) * n.o.failoverAt)
	}
	p := n.replicas[0].r.p
	res.routed = route(ctx, n.o, reqs[:at], 0, p, n.engines, stderr, res.start)
	if at < len(reqs) && res.routed == at {
		t0 := time.Now()
		n.stopRelays[0]()
		n.stopRelays[0] = nil
		if err := waitLeading(ctx, n.relays[1]); err != nil {
			return res, err
		}
		res.fo = failover{at: at, took: time.Since(t0)}
		res.rl = n.relays[1]
		res.routed += route(ctx, n.o, reqs, at, p, n.engines, stderr, res.start) - at
	}
	quiesce(n.engines)
	settle(res.rl.Pipeline(), n.engines)
	res.wall = time.Since(res.start)
	return res, nil
}

// drained waits until the stream is quiet and returns its state.
func (n *natsRun) drained(ctx context.Context, js jetstream.JetStream) (*jetstream.StreamInfo, error) {
	stream, err := js.Stream(ctx, opstream.DefaultStream)
	if err != nil {
		return nil, err
	}
	return quietStream(ctx, stream)
}

// compare waits for the replicas to catch up with the stream and compares
// their indexes; then two routers join, one from the relay's newest
// snapshot, one without any (an object name nothing is written under).
func (n *natsRun) compare(ctx context.Context, reqs []sim.Request, res *natsResult) error {
	last := res.info.State.LastSeq
	res.lags = make([]time.Duration, len(n.replicas))
	for i, rp := range n.replicas {
		var err error
		if res.lags[i], err = caughtUp(ctx, rp, last, res.start); err != nil {
			return err
		}
	}
	first := n.replicas[0].r.p
	res.agree, res.compared = sameIndex(ctx, n.o, reqs[:res.routed], first, n.replicas[1].r.p)
	for i, settings := range []relay.Settings{{}, {Object: "none"}} {
		t0 := time.Now()
		rp, err := n.follow(settings)
		if err != nil {
			return err
		}
		if _, err := caughtUp(ctx, rp, last, t0); err != nil {
			return err
		}
		res.joins[i] = join{took: time.Since(t0), stats: rp.f.Stats()}
		res.joins[i].agree, _ = sameIndex(ctx, n.o, reqs[:res.routed], first, rp.r.p)
	}
	res.fo.stats = n.relays[1].Stats()
	return nil
}

// report prints what the run measured.
func (n *natsRun) report(stdout io.Writer, source string, res *natsResult) {
	rs := n.relays[0].Stats()
	if res.fo.took > 0 {
		rs2 := n.relays[1].Stats()
		rs.Published += rs2.Published
		rs.Duplicates += rs2.Duplicates
		rs.Retries += rs2.Retries
		rs.Snapshots += rs2.Snapshots
		rs.SnapshotBytes = rs2.SnapshotBytes
	}
	var hit hits
	for _, e := range n.engines {
		hit.device += e.hits.device
		hit.host += e.hits.host
		hit.blocks += e.hits.blocks
	}
	info, wall := res.info, res.wall
	fmt.Fprintf(stdout, "replay over NATS JetStream (%s, %d workers, capacity %d blocks; relay -> stream %s -> 2 router replicas)\n",
		source, n.o.workers, n.o.capacity, opstream.DefaultStream)
	fmt.Fprintf(stdout, "  requests           %d in %s; kvpipe routing (replica 0) %s\n", res.routed, wall.Round(time.Millisecond), hit)
	fmt.Fprintf(stdout, "  stream             %d messages, %d bytes (%.0f messages/s published, %d duplicates, %d retries); %d snapshots written, the last %d bytes\n",
		info.State.Msgs, info.State.Bytes, float64(rs.Published)/wall.Seconds(), rs.Duplicates, rs.Retries, rs.Snapshots, rs.SnapshotBytes)
	for i, rp := range n.replicas[:2] {
		st := rp.f.Stats()
		fmt.Fprintf(stdout, "  replica %d          %d messages applied, caught up %s after the last request\n", i, st.Applied, (res.lags[i] - wall).Round(time.Millisecond))
	}
	if fo := res.fo; fo.took > 0 {
		fmt.Fprintf(stdout, "  failover           at request %d the leading relay stopped; its standby led %s later: %d workers from the snapshot (%d recorded absent by the leader: started afresh), %d messages made again from the engines' replay, %d resets\n",
			fo.at, fo.took.Round(time.Millisecond), fo.stats.Restored, n.relays[0].Stats().SnapshotAbsent, fo.stats.Replayed, fo.stats.Resets)
		for i, r := range n.relays {
			st := r.Stats()
			fmt.Fprintf(stdout, "  relay %d            %d terms leading (%d ended by a lost lease), %d published, %d duplicates, %d resets\n",
				i, st.Terms, st.LeaseLost, st.Published, st.Duplicates, st.Resets)
		}
	}
	fmt.Fprintf(stdout, "  replicas agree     %v (%d prompts compared, per worker and tier)\n", res.agree, res.compared)
	for i, name := range []string{"from the snapshot", "without"} {
		j := res.joins[i]
		fmt.Fprintf(stdout, "  late join %-17s caught up in %s: %d messages applied, %d skipped (in the snapshot), %d snapshots loaded; agrees %v\n",
			name, j.took.Round(time.Millisecond), j.stats.Applied, j.stats.Skipped, j.stats.SnapshotsLoaded, j.agree)
	}
}

// quietStream waits until the relay has published everything: the
// stream's last message stays the same for half a second (it may still be
// catching up on a replay, or resyncing a worker).
func quietStream(ctx context.Context, stream jetstream.Stream) (*jetstream.StreamInfo, error) {
	var last uint64
	stable := time.Now()
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
		info, err := stream.Info(ctx)
		if err != nil {
			return nil, err
		}
		if info.State.LastSeq != last {
			last, stable = info.State.LastSeq, time.Now()
		} else if time.Since(stable) > 500*time.Millisecond {
			return info, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil, errors.New("the relay did not stop publishing within a minute")
}

type join struct {
	took  time.Duration
	stats relay.FollowerStats
	agree bool
}

type failover struct {
	at    int
	took  time.Duration
	stats relaypub.Stats
}

// waitLeading waits until the relay holds the lease and runs its pipeline.
func waitLeading(ctx context.Context, rl *relaypub.Relay) error {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		if p := rl.Pipeline(); rl.Stats().Terms > 0 && p != nil && len(p.Stats().Workers) > 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return errors.New("the relay did not lead within 10s")
}

// caughtUp waits until rp has applied the stream up to last, and returns
// how long after since that was.
func caughtUp(ctx context.Context, rp *replica, last uint64, since time.Time) (time.Duration, error) {
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
		if st := rp.f.Stats(); st.LastApplied >= last {
			if err := rp.r.p.Sync(ctx); err != nil {
				return 0, err
			}
			return time.Since(since), nil
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return 0, fmt.Errorf("a router did not catch up with the stream (message %d) within a minute: %+v", last, rp.f.Stats())
}

// sameIndex asks both pipelines about every request and compares their
// answers worker by worker and tier by tier, and their blocks per tier.
func sameIndex(ctx context.Context, o options, reqs []sim.Request, a, b *kvpipe.Pipeline) (bool, int) {
	var h kvpipe.Hasher
	var tokens []uint32
	var keys []uint64
	var ma, mb []kvpipe.Match
	for i := range reqs {
		tokens = sim.InputTokens(tokens[:0], &reqs[i])
		req := kvpipe.Request{Tokens: tokens}
		if o.lora {
			req.Lora = reqs[i].Lora
		}
		keys = h.RequestKeys(keys[:0], &req, o.blockSize)
		ma, _ = a.AppendMatchesKeys(ctx, ma[:0], keys, nil)
		mb, _ = b.AppendMatchesKeys(ctx, mb[:0], keys, nil)
		if !sameMatches(ma, mb) {
			return false, i + 1
		}
	}
	sa, sb := a.Stats(), b.Stats()
	if len(sa.Workers) != len(sb.Workers) {
		return false, len(reqs)
	}
	for i := range sa.Workers {
		if sa.Workers[i].Name != sb.Workers[i].Name || sa.Workers[i].Actor.TierBlocks != sb.Workers[i].Actor.TierBlocks {
			return false, len(reqs)
		}
	}
	return true, len(reqs)
}

func sameMatches(a, b []kvpipe.Match) bool {
	if len(a) != len(b) {
		return false
	}
	by := map[string]kvpipe.Match{}
	for _, m := range a {
		by[m.Worker] = m
	}
	for _, m := range b {
		if o, ok := by[m.Worker]; !ok || o.Tiers != m.Tiers {
			return false
		}
	}
	return true
}
