package serve

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1/kvpipev1connect"
)

// guard decides who may change or dump the index (the bearer token) and
// which hosts a registration may make the server dial (the allow-list).
type guard struct {
	token    []byte // empty: every guarded call is refused
	allow    []netip.Prefix
	resolver *net.Resolver
	refused  func(reason string) // counts a refusal
}

// guarded says whether a call changes or dumps state.
func guarded(procedure string) bool {
	switch procedure {
	case kvpipev1connect.IndexServiceRegisterWorkerProcedure, kvpipev1connect.IndexServiceUnregisterWorkerProcedure,
		kvpipev1connect.IndexServiceDumpProcedure:
		return true
	}
	return false
}

// newGuard resolves the allow-list's names now, once: each entry is a CIDR,
// an address or a host name (all of its addresses).
func newGuard(ctx context.Context, token string, allow []string, r *net.Resolver, refused func(string)) (*guard, error) {
	g := &guard{token: []byte(token), resolver: r, refused: refused}
	for _, a := range allow {
		if p, err := netip.ParsePrefix(a); err == nil {
			g.allow = append(g.allow, p.Masked())
			continue
		}
		addrs, err := g.lookup(ctx, a)
		if err != nil {
			return nil, fmt.Errorf("serve: --allow %q: %w", a, err)
		}
		for _, ad := range addrs {
			g.allow = append(g.allow, netip.PrefixFrom(ad, ad.BitLen()))
		}
	}
	return g, nil
}

func (g *guard) lookup(ctx context.Context, host string) ([]netip.Addr, error) {
	if a, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{a.Unmap()}, nil
	}
	addrs, err := g.resolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return nil, err
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("%s has no address", host)
	}
	for i := range addrs {
		addrs[i] = addrs[i].Unmap()
	}
	return addrs, nil
}

// authorize checks the Authorization header for the bearer token.
func (g *guard) authorize(h http.Header) error {
	if len(g.token) == 0 {
		g.refused("unauthenticated")
		return connect.NewError(connect.CodeUnauthenticated, errors.New("this call needs a token, and the server has none: start it with --token-file or KVPIPE_TOKEN"))
	}
	if !g.holds(h) {
		g.refused("unauthenticated")
		return connect.NewError(connect.CodeUnauthenticated, errors.New("this call needs the server's token: Authorization: Bearer TOKEN"))
	}
	return nil
}

// holds reports whether h carries the token, refusing nothing: a call
// anyone may make shows more with it.
func (g *guard) holds(h http.Header) bool {
	got, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
	return ok && len(g.token) > 0 && subtle.ConstantTimeCompare([]byte(got), g.token) == 1
}

// pin checks every endpoint of w against the allow-list, every address its
// host resolves to, and returns w with each endpoint naming the address
// checked, so that a name that resolves elsewhere later is never dialed.
func (g *guard) pin(ctx context.Context, w *kvpipev1.WorkerSpec) (*kvpipev1.WorkerSpec, error) {
	out := clone(w)
	for _, ep := range []*string{&out.Endpoint, &out.ReplayEndpoint, &out.SnapshotEndpoint} {
		if *ep == "" {
			continue
		}
		host, port, err := splitEndpoint(*ep)
		if err != nil {
			return nil, err
		}
		addrs, err := g.lookup(ctx, host)
		if err != nil {
			g.refused("permission_denied")
			return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("register: %s: cannot resolve %q: %v", *ep, host, err))
		}
		for _, a := range addrs {
			if !slices.ContainsFunc(g.allow, func(p netip.Prefix) bool { return p.Contains(a) }) {
				g.refused("permission_denied")
				return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("register: %s: address %s is not on the allow-list (--allow)", *ep, a))
			}
		}
		*ep = "tcp://" + net.JoinHostPort(preferV4(addrs).String(), port)
	}
	return out, nil
}

func preferV4(addrs []netip.Addr) netip.Addr {
	for _, a := range addrs {
		if a.Is4() {
			return a
		}
	}
	return addrs[0]
}

// interceptor refuses a guarded call without the token, streams included.
func (g *guard) interceptor() connect.Interceptor { return authInterceptor{g} }

type authInterceptor struct{ g *guard }

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if guarded(req.Spec().Procedure) {
			if err := a.g.authorize(req.Header()); err != nil {
				return nil, err
			}
		}
		return next(ctx, req)
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if guarded(conn.Spec().Procedure) {
			if err := a.g.authorize(conn.RequestHeader()); err != nil {
				return err
			}
		}
		return next(ctx, conn)
	}
}
