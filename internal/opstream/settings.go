package opstream

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Defaults of Settings, as relay.Settings documents them.
const (
	DefaultPrefix     = "kvpipe.ops"
	DefaultStream     = "KVPIPE_OPS"
	DefaultBucket     = "kvpipe-snapshots"
	DefaultObject     = "snapshot"
	DefaultDuplicates = 2 * time.Minute
	DefaultMaxAge     = time.Hour
	DefaultMaxBytes   = 1 << 30 // 1 GiB
)

// Settings is relay.Settings, whose doc says what each field is, with the
// methods the relay and its followers share: package relay converts its
// public Settings to this type, so the two keep the same fields in the
// same order (the conversion does not compile otherwise).
type Settings struct {
	Prefix, Stream, Bucket, Object string
	Duplicates, MaxAge             time.Duration
	MaxBytes, MaxMsgs              int64
	Replicas                       int
	Storage                        jetstream.StorageType
}

var (
	// BucketName is what a bucket's name may be (object store, KV).
	BucketName = regexp.MustCompile(`^[a-zA-Z0-9_-]+$`)
	plainRe    = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)
)

// WithDefaults returns s with every zero field defaulted, or an error for
// a field the server would refuse.
func (s Settings) WithDefaults() (Settings, error) {
	if s.Prefix == "" {
		s.Prefix = DefaultPrefix
	}
	if s.Stream == "" {
		s.Stream = DefaultStream
	}
	if s.Bucket == "" {
		s.Bucket = DefaultBucket
	}
	if s.Object == "" {
		s.Object = DefaultObject
	}
	if s.Duplicates == 0 {
		s.Duplicates = DefaultDuplicates
	}
	if s.MaxAge == 0 {
		s.MaxAge = DefaultMaxAge
	}
	if s.MaxBytes == 0 {
		s.MaxBytes = DefaultMaxBytes
	}
	if s.Replicas == 0 {
		s.Replicas = 1
	}
	for _, tok := range strings.Split(s.Prefix, ".") {
		if tok == "" || strings.ContainsAny(tok, "*> \t\r\n") {
			return s, fmt.Errorf("relay: prefix %q is not a subject without wildcards", s.Prefix)
		}
	}
	switch {
	case strings.ContainsAny(s.Stream, ".*> \t\r\n/\\"):
		return s, fmt.Errorf("relay: stream name %q has a character a stream name cannot", s.Stream)
	case !BucketName.MatchString(s.Bucket):
		return s, fmt.Errorf("relay: bucket name %q must match %s", s.Bucket, BucketName)
	case s.Duplicates < 0 || s.MaxAge < 0 || s.MaxBytes < 0 || s.MaxMsgs < 0 || s.Replicas < 0:
		return s, errors.New("relay: Duplicates, MaxAge, MaxBytes, MaxMsgs and Replicas must not be negative")
	case s.Duplicates > s.MaxAge:
		return s, fmt.Errorf("relay: Duplicates %v exceeds MaxAge %v", s.Duplicates, s.MaxAge)
	}
	return s, nil
}

// Subject returns worker's subject, <Prefix>.<token> (see Token).
func (s Settings) Subject(worker string) string { return s.Prefix + "." + Token(worker) }

// Token is worker's subject token: the name itself when it matches
// [A-Za-z0-9_-]+, else "~" and the name's bytes in unpadded URL base64,
// so that any name (dots, spaces, wildcards, UTF-8) gets a token of those
// characters alone and no two names share one.
func Token(worker string) string {
	if plainRe.MatchString(worker) {
		return worker
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(worker))
}

// workerOf is Token's inverse: the worker of a token, or an error for a
// token Token never makes.
func workerOf(token string) (string, error) {
	if rest, ok := strings.CutPrefix(token, "~"); ok {
		b, err := base64.RawURLEncoding.DecodeString(rest)
		if err != nil || len(b) == 0 || plainRe.Match(b) {
			return "", fmt.Errorf("relay: bad worker token %q", token)
		}
		return string(b), nil
	}
	if !plainRe.MatchString(token) {
		return "", fmt.Errorf("relay: bad worker token %q", token)
	}
	return token, nil
}

// WorkerOfSubject is workerOf for a subject under prefix.
func WorkerOfSubject(prefix, subject string) (string, error) {
	tok, ok := strings.CutPrefix(subject, prefix+".")
	if !ok || strings.Contains(tok, ".") {
		return "", fmt.Errorf("relay: subject %q is not a worker's under %q", subject, prefix)
	}
	return workerOf(tok)
}

// StreamConfig is the stream Ensure creates: <Prefix>.> in file storage,
// the oldest messages discarded past the limits, the de-duplication window.
func (s Settings) StreamConfig() jetstream.StreamConfig {
	cfg := jetstream.StreamConfig{
		Name:        s.Stream,
		Description: "kvpipe relay: normalised index ops, one subject per worker",
		Subjects:    []string{s.Prefix + ".>"},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Storage:     s.Storage,
		Replicas:    s.Replicas,
		MaxAge:      s.MaxAge,
		MaxBytes:    s.MaxBytes,
		MaxMsgs:     s.MaxMsgs,
		Duplicates:  s.Duplicates,
	}
	if cfg.MaxMsgs == 0 {
		cfg.MaxMsgs = -1 // no limit, as the server stores it
	}
	return cfg
}

// Ensure creates the stream and the bucket of s, or updates them to s's
// limits, and returns them (s's zero fields defaulted). A relay calls it
// on start; followers only open what a relay made.
func Ensure(ctx context.Context, js jetstream.JetStream, s Settings) (jetstream.Stream, jetstream.ObjectStore, error) {
	s, err := s.WithDefaults()
	if err != nil {
		return nil, nil, err
	}
	stream, err := js.CreateOrUpdateStream(ctx, s.StreamConfig())
	if err != nil {
		return nil, nil, fmt.Errorf("relay: stream %s: %w", s.Stream, err)
	}
	obs, err := js.CreateOrUpdateObjectStore(ctx, jetstream.ObjectStoreConfig{
		Bucket: s.Bucket, Description: "kvpipe relay snapshots", Storage: s.Storage, Replicas: s.Replicas,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("relay: bucket %s: %w", s.Bucket, err)
	}
	return stream, obs, nil
}
