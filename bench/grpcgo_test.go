package bench

import (
	"context"
	"testing"

	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// grpcgoClient is a grpc-go client of the server at addr.
func grpcgoClient(b *testing.B, addr string) rpcClient {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cc.Close() })
	c := kvpipev1.NewIndexServiceClient(cc)
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
