package serve

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
)

// selfSigned is a TLS config with a certificate for 127.0.0.1.
func selfSigned(t *testing.T) *tls.Config {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvpipe test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
}

// testCA trusts the certificate of a selfSigned config.
func testCA(t *testing.T, c *tls.Config) *x509.CertPool {
	t.Helper()
	cert, err := x509.ParseCertificate(c.Certificates[0].Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return pool
}

// Over TLS, gRPC and HTTP/JSON answer; plain HTTP does not.
func TestTLS(t *testing.T) {
	r := start(t, Config{TLS: selfSigned(t)})
	if _, err := r.grpc.Match(context.Background(), connect.NewRequest(&kvpipev1.MatchRequest{Tokens: chainTokens(1, 2)})); err != nil {
		t.Fatalf("gRPC over TLS: %v", err)
	}
	if code, body := r.call("GET", "/healthz", "", ""); code != http.StatusOK {
		t.Fatalf("GET /healthz over TLS: %d %s", code, body)
	}
	plain := &http.Client{Timeout: time.Minute}
	defer plain.CloseIdleConnections()
	resp, err := plain.Get("http" + r.url[len("https"):] + "/healthz")
	if err == nil {
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Error("plain HTTP answered 200 by a TLS server")
		}
	}
}
