package bench

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"

	"github.com/kvpipe/kvpipe/internal/serve"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// grpcgoService answers the match calls with grpc-go, with the answers of
// serve's connect-go handler: what differs is the library and its HTTP/2.
type grpcgoService struct {
	UnimplementedIndexServiceServer
	s *serve.Server
}

func (g grpcgoService) Match(ctx context.Context, r *kvpipev1.MatchRequest) (*kvpipev1.MatchResponse, error) {
	return g.s.Match(ctx, r)
}

func (g grpcgoService) MatchBatch(ctx context.Context, r *kvpipev1.MatchBatchRequest) (*kvpipev1.MatchBatchResponse, error) {
	return g.s.MatchBatch(ctx, r)
}

// MatchStream answers each request as it comes; grpc-go's writer merges
// the answers that are ready into one write by itself.
func (g grpcgoService) MatchStream(stream grpc.BidiStreamingServer[kvpipev1.MatchRequest, kvpipev1.MatchResponse]) error {
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		a, err := g.s.Match(stream.Context(), req)
		if err != nil {
			return err
		}
		if err := stream.Send(a); err != nil {
			return err
		}
	}
}

// runGRPCGo serves s's matches with grpc-go on loopback until the
// benchmark ends, and returns its address.
func runGRPCGo(b *testing.B, s *serve.Server) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(8 << 20)) // serve's MaxMessageBytes
	RegisterIndexServiceServer(srv, grpcgoService{s: s})
	done := make(chan error, 1)
	go func() { done <- srv.Serve(l) }()
	b.Cleanup(func() {
		srv.Stop()
		if err := <-done; err != nil {
			b.Error(err)
		}
	})
	return l.Addr().String()
}

// grpcgoClient is a grpc-go client of the server at addr.
func grpcgoClient(b *testing.B, addr string) rpcClient {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cc.Close() })
	c := NewIndexServiceClient(cc)
	return rpcClient{
		match: func(ctx context.Context, r *kvpipev1.MatchRequest) (*kvpipev1.MatchResponse, error) {
			return c.Match(ctx, r)
		},
		batch: func(ctx context.Context, r *kvpipev1.MatchBatchRequest) (*kvpipev1.MatchBatchResponse, error) {
			return c.MatchBatch(ctx, r)
		},
		stream: func() matchStream {
			ctx, cancel := context.WithCancel(context.Background())
			s, err := c.MatchStream(ctx)
			if err != nil {
				cancel()
				b.Fatal(err)
			}
			return grpcgoStream{s, cancel}
		},
	}
}

// grpcgoStream is a grpc-go MatchStream as matchStream: its response side
// closes by cancelling its context.
type grpcgoStream struct {
	grpc.BidiStreamingClient[kvpipev1.MatchRequest, kvpipev1.MatchResponse]
	cancel context.CancelFunc
}

func (s grpcgoStream) Receive() (*kvpipev1.MatchResponse, error) { return s.Recv() }
func (s grpcgoStream) CloseRequest() error                       { return s.CloseSend() }
func (s grpcgoStream) CloseResponse() error                      { s.cancel(); return nil }
